"""`FSDP2Accelerator`: `accelerate.Accelerator` whose FSDP is the fsdp2_strategy core (see the package docstring)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DynamoBackend, FullyShardedDataParallelPlugin, GradScalerKwargs, InitProcessGroupKwargs
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

import fsdp2_strategy as f2
from fsdp2_strategy.checkpoint import AsyncSaver, make_saver, peft_models
from fsdp2_strategy.choose import resolve_on_process_group
from fsdp2_strategy.distributed import log_rank_zero
from fsdp2_strategy.shard import shard_with_rank0_weights
from fsdp2_strategy.train import parameters_by_name, rebind_optimizer
from fsdp2_strategy.tuning import example_batch_from

from . import _compat as compat
from . import checkpoint, context_parallel, throughput
from .deepspeed_env import apply_to_accelerator, clip_before_each_step, log_summary
from .device_map import check_quantised_device_map
from .env import accelerate_cpu_requested
from .parallelism import apply_parallelism_config, parallelism_mesh, requested_parallelism_config
from .plugin import FSDP2Plugin

__all__ = ["FSDP2Accelerator"]

_CPU_HINT = (
    "FSDP2Accelerator(cpu=True) or ACCELERATE_USE_CPU=true (accelerate's FSDP launcher does not pass the "
    "config's `use_cpu: true` on); or lower `num_processes` in the accelerate config"
)
_REFUSED_KWARGS = ("deepspeed_plugin", "deepspeed_plugins", "megatron_lm_plugin", "torch_tp_plugin")


@contextlib.contextmanager
def _env_without(*names: str) -> Iterator[None]:
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


class FSDP2Accelerator(Accelerator):
    """`accelerate.Accelerator` whose FSDP is the fsdp2_strategy core, on CPU (gloo) as on GPU.

    Args:
        fsdp_plugin: an `FSDP2Plugin`; default `FSDP2Plugin()`, which reads the FSDP config
            `accelerate launch --config_file` passes in the environment.
        mixed_precision: "no", "bf16" or "fp16" (default: the accelerate config's value),
            applied as an FSDP2 mixed-precision policy; must agree with the plugin's own
            `mixed_precision` if it was given one.
        cpu: run on CPU even where an accelerator exists (also chosen when none exists, or
            when the accelerate config says `use_cpu: true`).
        timeout: process-group timeout when this class starts the group (default: the
            `InitProcessGroupKwargs` handler's, else torch's).
        log_throughput_every: log tokens/s, MFU and peak memory (`throughput/...`, per rank) every this
            many optimizer steps through `log` (the trackers of `log_with`, main process only); the
            first prepared model's forward counts the tokens of its `input_ids` (or first integer
            tensor), the first prepared optimizer's step reports. The latest report is
            `accelerator.throughput.meter.last`. Default None: off.
        **kwargs: every other `Accelerator` argument (`gradient_accumulation_steps`,
            `project_config`, `log_with`, `kwargs_handlers`: `GradScalerKwargs` for fp16,
            `InitProcessGroupKwargs` for the timeout, ...). `parallelism_config` (an accelerate
            `ParallelismConfig`, or ACCELERATE_USE_PARALLELISM_CONFIG + PARALLELISM_CONFIG_* as
            `accelerate launch` sets them): dp_replicate/dp_shard/tp sizes become hybrid sharding,
            `mesh_shape` and `tensor_parallel_size`; cp/sp sizes are refused. DeepSpeed, Megatron-LM
            and the old `torch_tp_plugin` are refused: they are other engines.
    """

    def __init__(
        self,
        *,
        fsdp_plugin: FSDP2Plugin | None = None,
        mixed_precision: str | None = None,
        cpu: bool = False,
        timeout: timedelta | None = None,
        log_throughput_every: int | None = None,
        **kwargs: Any,
    ) -> None:
        if log_throughput_every is not None and log_throughput_every < 1:
            raise ValueError(
                f"FSDP2Accelerator(log_throughput_every={log_throughput_every}) is invalid; use a step count of 1 "
                "or more, or None (off)."
            )
        self._throughput_every = log_throughput_every
        self.throughput: f2.ThroughputTracker | None = None
        if fsdp_plugin is None:
            fsdp_plugin = FSDP2Plugin()
        elif not isinstance(fsdp_plugin, FSDP2Plugin):
            hint = (
                " It reads the same accelerate config file."
                if isinstance(fsdp_plugin, FullyShardedDataParallelPlugin)
                else ""
            )
            raise TypeError(
                f"FSDP2Accelerator(fsdp_plugin=...) needs an FSDP2Plugin, got {type(fsdp_plugin).__name__}.{hint}"
            )
        refused = [k for k in _REFUSED_KWARGS if kwargs.get(k) is not None]
        if refused:
            raise ValueError(f"FSDP2Accelerator does not combine with {', '.join(refused)}; FSDP2 is the engine here.")
        if mixed_precision is not None:
            fsdp_plugin.with_precision(str(mixed_precision))
        # No accelerator: tell Accelerate so, or on CPU it would decide "not distributed" and
        # train every rank alone (LOCAL_RANK set but no GPU) or wrap the model in DDP.
        cpu = cpu or accelerate_cpu_requested() or not torch.accelerator.is_available()
        handlers = {type(h): h for h in kwargs.get("kwargs_handlers") or []}
        init_handler = handlers.get(InitProcessGroupKwargs)
        # Started here, before Accelerate's state would start its own: on an accelerator the core
        # adds a CPU backend ("cpu:gloo,cuda:nccl") that DCP and offloaded state need.
        f2.init_distributed(
            cpu=cpu,
            timeout=timeout if timeout is not None or init_handler is None else init_handler.timeout,
            cpu_hint=_CPU_HINT,
        )
        compat.release_reported_precision()
        parallelism = requested_parallelism_config(kwargs.pop("parallelism_config", None))
        if parallelism is not None:
            # Sizes become core config (refused if unsupported) before any model is sharded.
            fsdp_plugin.fsdp2_config = apply_parallelism_config(
                fsdp_plugin.fsdp2_config, parallelism, torch.distributed.get_world_size()
            )
            context_parallel.set_rotation(parallelism)
        # Accelerate must not build its own FSDP plugin from the environment (it parses the
        # same variables with FSDP1 defaults) nor autocast: FSDP2 policies do the casting.
        # Nor DeepSpeed (a DEEPSPEED launch's config was translated into the plugin's).
        with _env_without("ACCELERATE_USE_FSDP", "ACCELERATE_USE_PARALLELISM_CONFIG", "ACCELERATE_USE_DEEPSPEED"):
            super().__init__(mixed_precision="no", cpu=cpu, fsdp_plugin=None, **kwargs)
        compat.check_accelerator(self)
        # The settings every prepared model is sharded with, final from here on: the plugin's
        # (accelerate config, FSDP2Config, keywords, mixed_precision=, parallelism_config) with the
        # gradient accumulation plugin's sync_each_batch, which Accelerate set up just now.
        self._fsdp2_config = fsdp_plugin.config_for(sync_each_batch=self._sync_each_batch())
        # Accelerate's data loaders read this mesh: one batch per data-parallel rank, the same
        # batch across a TP group. Accelerate's own parallelism_config stays None (its TP/FSDP
        # code paths must not run); the core shards on this same mesh.
        self._fsdp2_mesh = parallelism_mesh(self._fsdp2_config)
        self.state.device_mesh = self._fsdp2_mesh  # also None: the state is shared by later accelerators
        fsdp_plugin.claim()
        # SIGTERM on any process becomes Accelerate's own cross-process flag (`check_trigger`).
        self._preemption = f2.PreemptionWatch() if self._fsdp2_config.checkpoint_on_preemption else None
        # The background writer of `checkpoint_async_save` (None: `save_state` writes before it returns).
        self._checkpoint_saver: AsyncSaver | None = make_saver(self._fsdp2_config.checkpoint_async_save)
        compat.claim_fsdp_state(self.state, fsdp_plugin, fsdp_plugin.accelerate_precision)
        if fsdp_plugin.accelerate_precision == "fp16":
            # fp16 gradients overflow: a scaler that agrees on inf/NaN across ranks (the sharded
            # one), and `native_amp` so Accelerate unscales before clipping.
            scaler_handler = handlers.get(GradScalerKwargs)
            self.scaler = ShardedGradScaler(
                device=self.device.type, **(scaler_handler.to_kwargs() if scaler_handler else {})
            )
            self.native_amp = True
        if self.state.dynamo_plugin.backend != DynamoBackend.NO:
            log_rank_zero(
                "dynamo_backend is not applied by FSDP2Accelerator; use FSDP2Plugin(compile=True) to compile "
                "each wrapped block.",
                level=30,
            )
        deepspeed = fsdp_plugin.deepspeed  # distributed_type: DEEPSPEED, translated
        self._deepspeed_max_grad_norm = deepspeed.max_grad_norm if deepspeed else None
        if deepspeed is not None:
            log_summary(deepspeed, apply_to_accelerator(self, deepspeed))
        log_rank_zero(
            "FSDP2Accelerator: %d process(es), device %s, precision %s, %s",
            self.num_processes,
            self.device,
            self.mixed_precision,
            fsdp_plugin,
        )

    # ------------------------------------------------------------------ configuration
    @property
    def fsdp_plugin(self) -> FSDP2Plugin:
        """The `FSDP2Plugin` in use (also `accelerator.state.fsdp_plugin`)."""
        return self.state.fsdp_plugin

    @property
    def fsdp2_config(self) -> f2.FSDP2Config:
        """The core config every prepared model is sharded with, fixed when the accelerator is built.

        `GradientAccumulationPlugin(sync_each_batch=True)` means "reduce every micro-batch": the
        config's `accumulation` becomes "sync_each" (combined with "keep_gathered" it raises)."""
        return self._fsdp2_config

    def _sync_each_batch(self) -> bool:
        """What the gradient accumulation plugin says (Accelerate's `accumulate` reads the same)."""
        return bool(self.gradient_state.plugin_kwargs.get("sync_each_batch", False))

    # ------------------------------------------------------------------ prepare
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepare models, optimizers, data loaders and schedulers, in any number and order.

        Each model is sharded by the core; each optimizer given here or prepared earlier that
        holds a model's pre-sharding parameters is pointed at the shards (an optimizer built
        after `prepare(model)` needs nothing). Returns the objects in the same order.
        """
        if device_placement is not None and len(device_placement) != len(args):
            raise ValueError(
                f"`device_placement` should be a list with {len(args)} elements (the number of objects passed)."
            )
        placements = device_placement or [None] * len(args)
        self._fsdp2_example_batch = self._example_batch(args)
        result = list(args)
        snapshots = []
        for i, obj in enumerate(args):
            if not isinstance(obj, nn.Module):
                continue
            if getattr(obj, "_is_accelerate_prepared", False):
                # Sharded already (by evaluate(), say): registered again, since `free_memory()`
                # (which the Trainer calls before training) forgets it and save_state would miss it.
                result[i] = self.prepare_model(obj)
                continue
            before = parameters_by_name(obj)
            result[i] = self.prepare_model(obj, device_placement=placements[i])
            snapshots.append((before, result[i]))
        optimizers = [
            o for o in args if isinstance(o, torch.optim.Optimizer) and not isinstance(o, AcceleratedOptimizer)
        ]
        prepared = compat.registries(self)
        optimizers += [o.optimizer for o in prepared.optimizers]
        for optimizer in optimizers:
            for before, model in snapshots:
                rebind_optimizer(optimizer, before, model)
        for i, obj in enumerate(result):  # optimizers before schedulers: a scheduler finds its wrapped optimizer
            if isinstance(obj, DataLoader):
                result[i] = self.prepare_data_loader(obj, device_placement=placements[i])
            elif isinstance(obj, torch.optim.Optimizer):
                # No device placement: FSDP owns where parameters and their state live.
                result[i] = self.prepare_optimizer(obj, device_placement=False)
        for i, obj in enumerate(result):
            if isinstance(obj, LRScheduler):
                result[i] = self.prepare_scheduler(obj)
        for obj in result:
            if any(
                obj is o for o in (*prepared.dataloaders, *prepared.models, *prepared.optimizers, *prepared.schedulers)
            ):
                obj._is_accelerate_prepared = True
        self.throughput = self.throughput or throughput.attach(self, self._throughput_every)
        return tuple(result) if len(result) > 1 else result[0]

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        """Accelerate's; under a DeepSpeed launch with `gradient_clipping` the optimizer also clips
        before each step, as DeepSpeed's engine does."""
        prepared = super().prepare_optimizer(optimizer, device_placement=device_placement)
        clip_before_each_step(prepared.optimizer, self._deepspeed_max_grad_norm)
        return prepared

    def _example_batch(self, args: tuple) -> Any:
        """For `objective="throughput"`: one micro-batch of the first DataLoader passed to this `prepare`
        call (taken without iterating it: `tuning.example_batch_from`), which the core tunes the model
        on with its default loss (the output's `.loss`, else its first tensor's mean); else None."""
        config = self.fsdp2_config
        if config.sharding_strategy != "auto" or config.objective != "throughput":
            return None
        loader = next((a for a in args if isinstance(a, DataLoader)), None)
        if loader is None:
            if any(isinstance(a, nn.Module) and not getattr(a, "_is_accelerate_prepared", False) for a in args):
                raise ValueError(
                    "FSDP2Plugin(objective='throughput') tunes on one batch of the train DataLoader: pass it in the "
                    "same call, accelerator.prepare(model, optimizer, train_dataloader), or run f2.tune(model, batch) "
                    "and pass the fields of its best_config to FSDP2Plugin."
                )
            return None
        return example_batch_from(loader)

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        """Shard `model` in place with the core (also for evaluation: it is what fits in memory)."""
        if getattr(model, "_is_accelerate_prepared", False):
            models = compat.registries(self).models
            if not any(model is m for m in models):
                models.append(model)
            return model
        check_quantised_device_map(model, self)
        if self.verify_device_map(model):
            raise ValueError("A model loaded with `device_map=...` cannot be sharded; load it without a device map.")
        batch, self._fsdp2_example_batch = getattr(self, "_fsdp2_example_batch", None), None
        if self.fsdp_plugin.cpu_ram_efficient_loading:
            config = resolve_on_process_group(model, self.fsdp2_config, mesh=self._fsdp2_mesh, example_batch=batch)
            shard_with_rank0_weights(model, config, mesh=self._fsdp2_mesh)
        else:
            f2.shard_model(model, self.fsdp2_config, mesh=self._fsdp2_mesh, example_batch=batch)
        if context_parallel.cp_mesh(self._fsdp2_mesh) is not None:
            context_parallel.prepare_for_context_parallel(model)
        compat.registries(self).models.append(model)
        model._is_accelerate_prepared = True
        return model

    @contextlib.contextmanager
    def maybe_context_parallel(
        self,
        buffers: list[torch.Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ) -> Iterator[None]:
        """Accelerate's `maybe_context_parallel`: with `ParallelismConfig(cp_size=N)`, `buffers` split
        in place along `buffer_seq_dims` to this rank's part (restored on exit unless in
        `no_restore_buffers`) and attention a ring over the "cp" ranks inside; else no effect."""
        with context_parallel.maybe_context_parallel(self._fsdp2_mesh, buffers, buffer_seq_dims, no_restore_buffers):
            yield

    # ------------------------------------------------------------------ training step
    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Accumulate without the full reduction inside the block (`accumulate` uses it on
        non-final micro-batches), as the model's `FSDP2Config.accumulation` mode says."""
        with f2.no_sync(model):
            yield

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """Accelerate's `accumulate`; with `sync_each_batch=True` the non-final micro-batches still
        enter `no_sync`, which under "sync_each" reduce-scatters and only defers HSDP's all-reduce."""
        with super().accumulate(*models), contextlib.ExitStack() as stack:
            if self._sync_each_batch() and not self.sync_gradients:
                for model in models:
                    stack.enter_context(self.no_sync(model))
            yield

    def clip_grad_norm_(
        self, parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        """Clip by the global norm over all shards (core `clip_grad_norm_`); returns the total norm."""
        self.unscale_gradients()
        return f2.clip_grad_norm_(
            list(parameters) if not isinstance(parameters, torch.Tensor) else parameters, max_norm, norm_type
        )

    def clip_grad_value_(self, parameters: torch.Tensor | Iterable[torch.Tensor], clip_value: float) -> None:
        """Clamp every gradient element (on each rank's shards; no communication needed)."""
        self.unscale_gradients()
        f2.clip_grad_value_(parameters, clip_value)

    @contextlib.contextmanager
    def autocast(self, autocast_handler: Any = None) -> Iterator[None]:
        """No autocast: the FSDP2 mixed-precision policy already computes in low precision."""
        yield

    # ------------------------------------------------------------------ weights and checkpoints
    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights on CPU on rank 0, `{}` elsewhere. Collective: call on every rank.

        torch gathers one tensor at a time and only rank 0 keeps each copy, so no rank ever
        holds more than one full tensor beyond rank 0's CPU copy of the result."""
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save_model(
        self,
        model: nn.Module,
        save_directory: str | os.PathLike,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Accelerate's `save_model` (safetensors, sharded with an index past `max_shard_size`) on the
        gathered weights; for a Hugging Face model also its `config.json`, so that
        `from_pretrained(save_directory)` loads it. A PEFT model's adapter is written in PEFT's
        format instead (`PeftModel.from_pretrained(base, save_directory)`; its full weights with
        PEFT's names would load nowhere): `f2.save_merged` gives merged weights. Collective."""
        if peft_models(model):
            f2.save_peft_adapter(model, save_directory)
            return
        super().save_model(model, save_directory, max_shard_size=max_shard_size, safe_serialization=safe_serialization)
        config = getattr(model, "config", None)
        if self.is_main_process and callable(getattr(config, "save_pretrained", None)):
            config.save_pretrained(save_directory)
        self.wait_for_everyone()

    def save_state(
        self,
        output_dir: str | os.PathLike | None = None,
        safe_serialization: bool = True,
        **save_model_func_kwargs: Any,
    ) -> str:
        """Save models, optimizers, schedulers, samplers, RNG, step and registered objects as one
        atomic, checksummed DCP directory (see `checkpoint`). Returns its path."""
        if save_model_func_kwargs:
            raise TypeError(
                f"FSDP2Accelerator.save_state does not take {sorted(save_model_func_kwargs)} (DeepSpeed options)."
            )
        return checkpoint.save_state(self, output_dir, safe_serialization)

    def wait_for_checkpoint(self) -> None:
        """Commit a `save_state` still being written with `FSDP2Config.checkpoint_async_save`
        (collective). The next `save_state`/`load_state`, `end_training()` and `f2.shutdown()` call it."""
        checkpoint.wait_for_checkpoint(self)

    def check_trigger(self) -> bool:
        """Accelerate's `check_trigger` (collective: whether any process called `set_trigger()`); with
        `checkpoint_on_preemption` a SIGTERM received by any process sets the trigger too, so the loop
        Accelerate documents (`if accelerator.check_trigger(): accelerator.save_state(); break`) saves
        and stops on preemption; end the script with `f2.PREEMPTION_EXIT_CODE` (143) then."""
        if self._preemption is not None and self._preemption.received is not None:
            self.set_trigger()
        return super().check_trigger()

    def end_training(self) -> None:
        """Commit the last asynchronous `save_state`, then Accelerate's `end_training` (trackers)."""
        self.wait_for_checkpoint()
        super().end_training()

    def load_state(
        self, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs: Any
    ) -> None:
        """Load what `save_state` wrote (any world size: DCP reshards). Prepare the same models and
        optimizers first. A missing, partial or damaged directory raises before anything changes."""
        if load_model_func_kwargs:
            raise TypeError(f"FSDP2Accelerator.load_state does not take {sorted(load_model_func_kwargs)}.")
        checkpoint.load_state(self, input_dir, load_kwargs)

"""`FSDP2FabricStrategy`: Lightning Fabric's strategy hooks translated into fsdp2_strategy core calls.

It subclasses Fabric's `ModelParallelStrategy` and keeps its device mesh (dimensions
"data_parallel" and "tensor_parallel"), with a `parallelize_fn` that is the core's `shard_model`.
What it adds is the core's: sharding by policy in `fabric.setup`, tensor parallelism by
`tensor_parallel_size` / `tensor_parallel_plan` (as the Trainer adapter), precision strings as FSDP2
policies, `fabric.no_backward_sync` through `f2.no_sync`, clipping by a global norm, and
`fabric.save`/`fabric.load` as one atomic, checksummed DCP directory.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer

import fsdp2_strategy as f2
from fsdp2_strategy.checkpoint import make_saver
from fsdp2_strategy.config_checks import FieldErrors
from fsdp2_strategy.train import parameters_by_name, rebind_optimizer

from .._lightning_shared import (
    check_start_method,
    core_mesh,
    effective_config,
    model_parallel_args,
    plugin_property,
    process_group_backend,
    register_all,
    sampler_kwargs,
)
from . import checkpoint as ckpt
from ._compat import BackwardSyncControl, OptimizedModule, ShutdownMultiProcessingLauncher
from .precision import FSDP2FabricPrecision, to_fsdp2_precision

__all__ = ["FSDP2FabricStrategy"]


class FSDP2FabricStrategy(ModelParallelStrategy):
    """Fabric strategy that shards each module set up with `fabric.setup` by `fsdp2_strategy.shard_model`.

    It takes `ModelParallelStrategy`'s constructor with its meaning (`parallelize_fn`,
    `data_parallel_size`, `tensor_parallel_size`, `save_distributed_checkpoint`,
    `process_group_backend`, `timeout`), so `ModelParallelStrategy(fn, ...)` becomes
    `FSDP2FabricStrategy(fn, ...)`; one default differs (`tensor_parallel_size`, below).

    Args:
        parallelize_fn: `ModelParallelStrategy`'s: `fn(module, device_mesh) -> module`, run first in
            `fabric.setup` (tensor parallelism, `fully_shard` of chosen blocks, `torch.compile`); the
            engine then shards by policy what it left (modules it `fully_shard`-ed stay as they are).
        config: an `FSDP2Config`, a dict of its fields, or the path of its YAML file.
        data_parallel_size: ranks in the "data_parallel" mesh dim; "auto" (default): every rank
            outside tensor parallelism (`ModelParallelStrategy`'s "auto" is the node count, which
            shards nothing on one node).
        save_distributed_checkpoint: True (default): `fabric.save` writes one atomic, checksummed DCP
            directory; False: Lightning's single file of full weights and optimizer state (rank 0).
        start_method: "popen" (Fabric re-runs the script per rank, or `fabric run`/torchrun did),
            or "spawn"/"fork"/"forkserver" (`fabric.launch(fn)` in processes: notebooks, tests).
        process_group_backend: torch.distributed backend; default gloo on CPU, and on an
            accelerator "cpu:gloo,<device>:<nccl...>" so CPU collectives have a backend too.
        timeout: process-group timeout; a rank that fails then ends the others.
        **fields: `FSDP2Config` fields (`wrap_policy`, `sharding_strategy`, `tensor_parallel_size`,
            `tensor_parallel_plan`, ...), overriding `config`. With `tensor_parallel_size > 1` the
            mesh is (world // tp, tp): TP over consecutive ranks, FSDP over the "data_parallel" dim;
            each data-parallel rank's TP group must see the same batch. `tensor_parallel_size`
            defaults to 1 (FSDP over every device); "auto" is `ModelParallelStrategy`'s default, the
            devices of one node.

    Raises:
        ValueError: an unknown or invalid config field, `data_parallel_size` or `start_method`.
    """

    def __init__(
        self,
        parallelize_fn: Callable[[nn.Module, Any], nn.Module] | None = None,
        config: f2.FSDP2Config | dict | str | Path | None = None,
        data_parallel_size: Literal["auto"] | int = "auto",
        save_distributed_checkpoint: bool = True,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **fields: Any,
    ) -> None:
        if parallelize_fn is not None and not callable(parallelize_fn):
            # `FSDP2FabricStrategy(config)` positionally: config was the first argument before parallelize_fn.
            raise TypeError(
                f"FSDP2FabricStrategy(parallelize_fn={parallelize_fn!r}): parallelize_fn must be callable "
                "(module, device_mesh) -> module; pass a config as config=..."
            )
        # Every argument is checked before raising: one error names all the bad ones.
        errors = FieldErrors("FSDP2FabricStrategy")
        errors.check(check_start_method, "FSDP2FabricStrategy", start_method)
        self._parallel_args = errors.check(model_parallel_args, "FSDP2FabricStrategy", fields, data_parallel_size)
        try:
            self.fsdp2_config = f2.FSDP2Config(**fields) if config is None else f2.FSDP2Config.coerce(config, **fields)
        except ValueError as exc:
            errors.messages.append(str(exc))
        errors.raise_if_any()
        self._start_method = start_method
        self._user_parallelize_fn = parallelize_fn
        super().__init__(
            parallelize_fn=self._parallelize,
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=self.fsdp2_config.tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._backward_sync_control = _CoreNoSync()
        self._saver = make_saver(self.fsdp2_config.checkpoint_async_save)

    # ------------------------------------------------------------------ plugins and launch
    precision = plugin_property("_precision", FSDP2FabricPrecision, to_fsdp2_precision)

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method != "popen":
            self._launcher = ShutdownMultiProcessingLauncher(self, start_method=self._start_method)
        else:
            super()._configure_launcher()

    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or process_group_backend(self.root_device)

    def setup_environment(self) -> None:
        """Set up the process group and the ("data_parallel", "tensor_parallel") mesh: TP from the
        config ("auto": the devices of a node), data parallelism every other rank or as given."""
        self.fsdp2_config, self._data_parallel_size, self._tensor_parallel_size = self._parallel_args.resolve(
            "FSDP2FabricStrategy", self.fsdp2_config, self.num_nodes, self.num_processes
        )
        super().setup_environment()

    # ------------------------------------------------------------------ model and optimizers
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Lightning's, except that the ranks of a context-parallel group take one batch."""
        return (
            sampler_kwargs(self.fsdp2_config, self.global_rank, self.world_size) or super().distributed_sampler_kwargs
        )

    def _parallelize(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        """`ModelParallelStrategy`'s `parallelize_fn`: the user's function first, then the core's
        `shard_model` on what it left (a root it `fully_shard`-ed is kept as it is; a module it
        compiled is sharded inside the compiled wrapper)."""
        if self._user_parallelize_fn is not None:
            module = self._user_parallelize_fn(module, device_mesh)
            if not isinstance(module, nn.Module):
                raise TypeError(
                    f"FSDP2FabricStrategy's parallelize_fn must return the nn.Module, but got {type(module).__name__}."
                )
        target = _compiled_module(module)
        if isinstance(target, FSDPModule):
            return module
        config = effective_config(
            self.fsdp2_config,
            getattr(self.precision, "fsdp2_mixed_precision", None),
            self.num_nodes,
            self.num_processes,
            module=target,
            data_parallel_size=self._data_parallel_size,
        )
        f2.shard_model(target, config, mesh=core_mesh(config, device_mesh))
        return module

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        """`fabric.setup(model, *optimizers)`: shard, then point the optimizers (built on the
        unsharded parameters, as Fabric users write it) at the shards, matched by name."""
        before = parameters_by_name(module)
        module = self.setup_module(module)
        for optimizer in optimizers:
            rebind_optimizer(optimizer, before, _compiled_module(module))
        return module, [self.setup_optimizer(o) for o in optimizers], scheduler

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """The global norm over every shard and mesh (equal to the single-process norm), clipped."""
        self.precision.unscale_gradients(optimizer)
        parameters = list(self.precision.main_params(optimizer))
        return f2.clip_grad_norm_(parameters, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self.precision.unscale_gradients(optimizer)
        f2.clip_grad_value_(list(self.precision.main_params(optimizer)), clip_val)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """`fabric.save(path, state)`: one atomic, checksummed DCP directory (see `checkpoint.save`);
        with `save_distributed_checkpoint=False`, Lightning's single file of full state on rank 0
        (`filter=` applies there, as in `ModelParallelStrategy`)."""
        if storage_options is not None:
            raise TypeError(
                "fabric.save(..., storage_options=...) is not supported with strategy='fsdp2': "
                "sharded checkpoints are written by torch.distributed.checkpoint, not a CheckpointIO."
            )
        if not self._save_distributed_checkpoint:
            self.wait_for_checkpoint()
            f2.reshard(*(v for v in state.values() if isinstance(v, nn.Module)))  # gathered after an eval forward
            return super().save_checkpoint(path, state, filter=filter)
        if filter is not None:
            raise ValueError(
                "fabric.save(..., filter=...) is not supported with strategy='fsdp2' and sharded checkpoints: "
                "a filtered sharded checkpoint could not be loaded back. Save without filter (take a subset of "
                "the full weights later with fsdp2_strategy.export_full), or save one file of full state with "
                "FSDP2FabricStrategy(save_distributed_checkpoint=False), where filter= applies."
            )
        ckpt.save(
            Path(self.broadcast(path)),
            state,
            trainable_only=self.fsdp2_config.checkpoint_trainable_only,
            saver=self._saver,
        )

    def wait_for_checkpoint(self) -> None:
        """Commit a `fabric.save` still being written with `checkpoint_async_save` (collective).
        `fabric.load`, the next `fabric.save`, `teardown()` and `f2.shutdown()` call it; call it
        yourself before reading the checkpoint from another process."""
        if self._saver is not None:
            self._saver.wait()

    def teardown(self) -> None:
        """Commit the last asynchronous save, then Fabric's teardown."""
        self.wait_for_checkpoint()
        super().teardown()

    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """`fabric.load(path, state)`: a committed directory (any world size: DCP reshards), or a
        single file of full state (`ModelParallelStrategy(save_distributed_checkpoint=False)`, a
        one-device Fabric) read by Lightning's loader, which broadcasts weights and optimizer state
        from rank 0 into the shards; `fabric.load_raw(path, model)`: full weights
        (`f2.load_full_weights`)."""
        self.wait_for_checkpoint()
        if isinstance(state, nn.Module):  # fabric.load_raw
            f2.load_full_weights(state, Path(self.broadcast(path)), strict=strict)
            return {}
        if isinstance(state, Optimizer):
            raise NotImplementedError(
                "fabric.load_raw(path, optimizer) is not supported with strategy='fsdp2': "
                "save the optimizer with fabric.save(path, {'model': ..., 'optimizer': ...})."
            )
        path = Path(self.broadcast(path)) if state else path
        if not state or path.is_file():  # no state: Fabric's error (a model is needed)
            return super().load_checkpoint(path, state, strict, weights_only)
        return ckpt.load(path, state, strict=strict, weights_only=weights_only)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register "fsdp2", "fsdp2_hybrid", "fsdp2_cpu_offload" and "fsdp2_spawn" (as the Trainer's)."""
        register_all(cls, strategy_registry)


def _compiled_module(module: nn.Module) -> nn.Module:
    """The module `torch.compile` wrapped (its `_orig_mod`), else `module` itself."""
    return module._orig_mod if isinstance(module, OptimizedModule) else module


class _CoreNoSync(BackwardSyncControl):  # type: ignore[misc,valid-type]
    """`fabric.no_backward_sync(model)`: the core's `f2.no_sync` (gradient reduction skipped on
    every FSDP group and replicated parameter until the last micro-batch)."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return f2.no_sync(module) if enabled else nullcontext()

"""`FSDP2Strategy`: Lightning's Strategy hooks translated into fsdp2_strategy core calls.

It subclasses Lightning's `ModelParallelStrategy` and keeps its device mesh (dimensions
"data_parallel" and "tensor_parallel"), so LightningModules written for that strategy run
unchanged. What it adds is the core's: sharding by policy after `configure_model`, precision
strings as FSDP2 policies, gradient sync skipped while accumulating, clipping by a global
norm, and checkpoints committed atomically with checksums.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.constants import default_pg_timeout
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.optim import Optimizer

import fsdp2_strategy as f2
from fsdp2_strategy.checkpoint import (
    AsyncSaver,
    is_checkpointer_step,
    load_into,
    make_saver,
    model_state,
    optimizer_state_dict,
    saves_trainable_only,
    side_entries,
    unstepped_kept,
)
from fsdp2_strategy.checkpoint import directory as cdir
from fsdp2_strategy.config_checks import FieldErrors
from fsdp2_strategy.train import register_step_method

from .._lightning_shared import (
    META_FILE,
    check_start_method,
    core_mesh,
    effective_config,
    is_sharded_checkpoint,
    model_parallel_args,
    not_committed_error,
    plugin_property,
    process_group_backend,
    read_meta,
    register_all,
    sampler_kwargs,
    trusts,
)
from ._compat import FullStateMultiProcessingLauncher, SubprocessScriptLauncher, optimizers_to_device
from .context_parallel import ContextParallelSteps
from .converted import lightning_state
from .precision import FSDP2Precision, to_fsdp2_precision
from .tuning import throughput_inputs

__all__ = ["FSDP2Strategy"]

_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
"""LightningModule methods Lightning calls instead of `forward`; FSDP gathers the root around them."""

_MODEL_KEY = "model"
"""The model's key in a sharded checkpoint: FSDPStrategy's, which Lightning's `consolidate_checkpoint`
reads (optimizers are "optimizer_<i>", as in both Lightning strategies)."""
_LOADABLE_MODEL_KEYS = (_MODEL_KEY, "state_dict")
"""Model keys `load_checkpoint` reads: ours (and FSDPStrategy's), and ModelParallelStrategy's."""


def _check_state_dict_type(state_dict_type: Any, save_distributed_checkpoint: bool | None) -> None:
    if state_dict_type not in (None, "sharded", "full"):
        raise ValueError(f"FSDP2Strategy.state_dict_type={state_dict_type!r} is invalid; use 'sharded' or 'full'.")
    if (
        save_distributed_checkpoint is not None
        and state_dict_type is not None
        and save_distributed_checkpoint != (state_dict_type == "sharded")
    ):
        raise ValueError(
            f"FSDP2Strategy(state_dict_type={state_dict_type!r}, save_distributed_checkpoint="
            f"{save_distributed_checkpoint}) disagree; give one of them."
        )


class FSDP2Strategy(ContextParallelSteps, ModelParallelStrategy):
    """Lightning strategy that shards the LightningModule with `fsdp2_strategy.shard_model`.

    Args:
        config: an `FSDP2Config`, a dict of its fields, or the path of its YAML file.
        state_dict_type: "sharded" (default): `save_checkpoint(path)` writes a directory of
            DCP shards plus Lightning's `meta.pt`, committed atomically; "full": the full
            weights gathered to rank 0 into one file.
        start_method: "popen" (Lightning re-runs the script per rank, or torchrun does),
            or "spawn"/"fork"/"forkserver" (multiprocessing: notebooks, tests).
        process_group_backend: torch.distributed backend; default gloo on CPU, and on an
            accelerator "cpu:gloo,<device>:<nccl...>" so CPU collectives (async
            checkpointing) have a backend too.
        timeout: process-group timeout; a rank that fails then ends the others.
        data_parallel_size: as in `ModelParallelStrategy`: ranks in the "data_parallel" mesh dim;
            "auto" (default): every rank outside tensor parallelism (ModelParallelStrategy's
            "auto" is the node count, which shards nothing on one node).
        save_distributed_checkpoint: as in `ModelParallelStrategy` (True: "sharded", False: "full").
        **fields: `FSDP2Config` fields (`wrap_policy`, `sharding_strategy`, `tensor_parallel_size`,
            `tensor_parallel_plan`, ...), overriding `config`. `tensor_parallel_size="auto"` means
            ModelParallelStrategy's default, the devices of one node. A LightningModule that
            parallelises itself in `configure_model` keeps its own tensor parallelism.
    """

    def __init__(
        self,
        config: f2.FSDP2Config | dict | str | Path | None = None,
        state_dict_type: Literal["sharded", "full"] | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        data_parallel_size: Literal["auto"] | int = "auto",
        save_distributed_checkpoint: bool | None = None,
        **fields: Any,
    ) -> None:
        # Every argument is checked before raising: one error names all the bad ones.
        errors = FieldErrors("FSDP2Strategy")
        errors.check(_check_state_dict_type, state_dict_type, save_distributed_checkpoint)
        errors.check(check_start_method, "FSDP2Strategy", start_method)
        self._parallel_args = errors.check(model_parallel_args, "FSDP2Strategy", fields, data_parallel_size)
        try:
            # `FSDP2Config(**fields)` spelled out (not only via `coerce`) lets LightningCLI's parser
            # see the config fields as this class's own `init_args`.
            self.fsdp2_config = f2.FSDP2Config(**fields) if config is None else f2.FSDP2Config.coerce(config, **fields)
        except ValueError as exc:
            errors.messages.append(str(exc))
        errors.raise_if_any()
        self._start_method = start_method
        self._saver: AsyncSaver | None = None
        self._preemption: f2.PreemptionWatch | None = None
        self._failed = False  # an exception other than a preemption: no collective at teardown
        sharded = save_distributed_checkpoint if save_distributed_checkpoint is not None else state_dict_type != "full"
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=self.fsdp2_config.tensor_parallel_size,
            save_distributed_checkpoint=sharded,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )

    # ------------------------------------------------------------------ plugins and launch
    precision_plugin = plugin_property("_precision_plugin", FSDP2Precision, to_fsdp2_precision)

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method != "popen":
            self._launcher = FullStateMultiProcessingLauncher(self, start_method=self._start_method)
        elif not self.cluster_environment.creates_processes_externally:
            self._launcher = SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or process_group_backend(self.root_device)

    def setup_environment(self) -> None:
        """Set up the process group and Lightning's ("data_parallel", "tensor_parallel") mesh.

        ModelParallelStrategy's sizes keep their meaning; its "auto" data-parallel size (the node
        count: nothing sharded on one node) becomes every rank outside tensor parallelism."""
        self.fsdp2_config, self._data_parallel_size, self._tensor_parallel_size = self._parallel_args.resolve(
            "FSDP2Strategy", self.fsdp2_config, self.num_nodes, self.num_processes
        )
        super().setup_environment()

    # ------------------------------------------------------------------ model
    def setup(self, trainer: Any) -> None:
        """Shard the LightningModule (after `configure_model`), then set up optimizers."""
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if any(isinstance(m, FullyShardedDataParallel) for m in self.model.modules()):
            raise TypeError(
                "strategy='fsdp2' found FSDP1 `FullyShardedDataParallel` modules: remove that wrapping "
                "(the strategy shards by its wrap_policy) or apply FSDP2 `fully_shard` instead."
            )
        # "-true" precisions cast before sharding, so the shards are stored in that dtype.
        self.model = self.precision_plugin.convert_module(self.model)
        self._shard()  # fully_shard moves each shard to the mesh's device
        self.model_to_device()  # buffers and anything left unsharded
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)  # after sharding: the optimizers hold the shards
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    def _shard(self) -> None:
        """Apply the core's `shard_model` and gather the root around Lightning's step methods."""
        module = self.lightning_module
        if isinstance(module, FSDPModule):
            return  # sharded already: by an earlier fit/validate, or by the user's configure_model
        config = self._effective_config()
        f2.shard_model(module, config, mesh=self._core_mesh(config))
        for name in _STEP_METHODS:
            if callable(getattr(module, name, None)):
                # Gathers the root around the step without casting the batch (targets keep their dtype).
                register_step_method(module, name)

    def _effective_config(self) -> f2.FSDP2Config:
        """The config plus the precision string's policy, for hybrid sharding the (nodes, devices
        per node) mesh, and the module's own tensor parallelism respected (see
        `integrations._lightning_shared.effective_config`). With `objective="throughput"` the core tunes
        on the train dataloader's first batch and `training_step`'s loss (`tuning.throughput_inputs`)."""
        policy = getattr(self.precision_plugin, "fsdp2_mixed_precision", None)
        return effective_config(
            self.fsdp2_config,
            policy,
            self.num_nodes,
            self.num_processes,
            module=self.lightning_module,
            data_parallel_size=self._data_parallel_size,
            **throughput_inputs(self, self.fsdp2_config),
        )

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Lightning's, except that the ranks of a context-parallel group take one batch."""
        return (
            sampler_kwargs(self.fsdp2_config, self.global_rank, self.world_size) or super().distributed_sampler_kwargs
        )

    def _core_mesh(self, config: f2.FSDP2Config):
        """What `shard_model` shards on (see `_lightning_shared.core_mesh`)."""
        return core_mesh(config, self.device_mesh)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """The micro-batches `accumulate_grad_batches` accumulates follow `FSDP2Config.accumulation`:
        "sync_last" (default) reduces on the last only, "keep_gathered" also keeps parameters
        gathered for the whole step, "sync_each" reduces every micro-batch (sharded gradients)."""
        with f2.no_sync(self.model):
            yield

    # ------------------------------------------------------------------ end of an entry point
    # Forward-only passes (validation, test, predict) leave the root group gathered: each entry
    # point ends with every managed parameter back as its shard.
    def on_train_end(self) -> None:
        super().on_train_end()
        f2.reshard(self.model)

    def on_validation_end(self) -> None:
        super().on_validation_end()
        f2.reshard(self.model)

    def on_test_end(self) -> None:
        super().on_test_end()
        f2.reshard(self.model)

    def on_predict_end(self) -> None:
        super().on_predict_end()
        f2.reshard(self.model)

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state for a checkpoint, taken after resharding (a checkpoint taken outside
        a step, after validation, would otherwise see the root's gathered parameters)."""
        f2.reshard(self.model)
        if not self._save_distributed_checkpoint:
            return super().lightning_module_state_dict()
        # The core's view: quantised weights left out, frozen ones too for a trainable-only save.
        return model_state(self.model, trainable_only=self._trainable_only())

    def _trainable_only(self) -> bool:
        return saves_trainable_only(self.model, self.fsdp2_config.checkpoint_trainable_only)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state for `save_checkpoint`, leaving an optimizer that never stepped
        without state (torch's state-dict call would step it once; see core `checkpoint.state`)."""
        raw = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if self._save_distributed_checkpoint:
            # An asynchronous save copies to CPU memory itself ("overlap": behind the next steps).
            offload = self._checkpoint_saver() is None
            return optimizer_state_dict(self.model, raw, StateDictOptions(cpu_offload=offload))
        with unstepped_kept(raw):  # full state: Lightning's own re-keyed format
            return super().optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Sharded: DCP shards + `meta.pt` into `filepath/`, committed atomically (rank 0 renames a
        finished `.tmp-<name>/`), so a crash mid-save leaves the previous checkpoint intact."""
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(
                "FSDP2Strategy.save_checkpoint(..., storage_options=...) is not supported: "
                "sharded checkpoints are written by torch.distributed.checkpoint, not a CheckpointIO."
            )
        if self.model is None:
            raise RuntimeError(
                "FSDP2Strategy.save_checkpoint: no model is attached to the strategy, and a sharded checkpoint "
                "is written from the sharded model. Save through the Trainer, trainer.save_checkpoint(path), "
                "once trainer.fit/validate/test/predict has set the model up."
            )
        path = Path(self.broadcast(filepath))  # every rank writes to rank 0's path
        state = {_MODEL_KEY: checkpoint.pop("state_dict")}  # the Trainer's key for the model's state
        state.update(side_entries(_MODEL_KEY, self.model, self._trainable_only()))
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        # Names Lightning rewrites (`last.ckpt`, `save_top_k` slots) are replaced, never mixed.
        saver, models, on_commit = self._checkpoint_saver(), {_MODEL_KEY: self.model}, self._on_commit()
        cdir.save_dir(
            path, state, files={META_FILE: checkpoint}, replace=True, saver=saver, models=models, on_commit=on_commit
        )

    def _on_commit(self) -> Callable[[Path], None] | None:
        """What runs on every rank once a sharded checkpoint is committed, given its directory (a hook:
        the Ray strategy reports it then)."""
        return None

    def _checkpoint_saver(self) -> AsyncSaver | None:
        """The background writer of `FSDP2Config.checkpoint_async_save` (Lightning's own switch,
        `Trainer(plugins=[AsyncCheckpointIO()])`, means True) while `fit` runs, or None: outside
        `fit` (`trainer.save_checkpoint` after it) nothing would commit a save later."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is None or (trainer.state.fn, trainer.state.status) != (TrainerFn.FITTING, TrainerStatus.RUNNING):
            return None
        if self._saver is None:
            mode = self.fsdp2_config.checkpoint_async_save or isinstance(self.checkpoint_io, AsyncCheckpointIO)
            self._saver = make_saver(mode)
        return self._saver

    def wait_for_checkpoint(self) -> None:
        """Commit an asynchronous save still being written (collective). Loading, the next save and
        the end of `fit` call it."""
        if self._saver is not None:
            self._saver.wait()

    def teardown(self) -> None:
        """Commit the last asynchronous save (not after a failure: the other ranks may be gone), then
        Lightning's teardown; after a preemption save, end the process with 143 (`f2.shutdown`)."""
        self.close_split()
        if self._saver is not None and not self._failed:
            self._saver.close()
        self._saver = None
        preempted = self._preemption is not None and self._preemption.agreed
        if self._preemption is not None:
            self._preemption.close()
            self._preemption = None
        super().teardown()
        if preempted and not self._failed:
            f2.shutdown(f2.PREEMPTION_EXIT_CODE)

    # ------------------------------------------------------------------ preemption
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.fsdp2_config.checkpoint_on_preemption:
            # Replaces the SIGTERM handler Lightning installed just before: it broadcasts from inside the
            # handler (on the signalled rank only) and each rank stops on its own flag, so a SIGTERM to one
            # rank can hang the others. The watch's ranks agree in `on_train_batch_start`.
            self._preemption = f2.PreemptionWatch()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """With `checkpoint_on_preemption`: if any rank received SIGTERM, save `hpc_ckpt_<N>.ckpt` in the
        Trainer's `default_root_dir` (Lightning's name; `fit(ckpt_path="hpc")` resumes from it) and stop
        as Lightning stops on SIGTERM (`SIGTERMException`, here with exit status 143)."""
        super().on_train_batch_start(batch, batch_idx)
        if self._preemption is None or not self._preemption.requested():
            return
        trainer = self.lightning_module.trainer
        path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        trainer.save_checkpoint(path)
        self.wait_for_checkpoint()
        raise SIGTERMException(f2.PREEMPTION_EXIT_CODE)

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self._failed = not isinstance(exception, SIGTERMException)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded directory (any world size: DCP reshards) or a full file; return the rest.
        A directory is read as data (`f2.UntrustedCheckpointError` for another type) unless
        `weights_only=False`; Lightning does not pass `fit`'s `weights_only` on to a strategy that
        restores after setup (this one, as `ModelParallelStrategy`): admit types with
        `torch.serialization.add_safe_globals` there."""
        self.wait_for_checkpoint()
        path = Path(self.broadcast(checkpoint_path))
        if is_checkpointer_step(path):
            return self._load_converted(path)
        if not is_sharded_checkpoint(path):
            if path.is_dir():
                raise not_committed_error(path, "Pick another checkpoint.")
            return super().load_checkpoint(path, weights_only)
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        cdir.verify_dir(path)  # checksums before any file is parsed
        meta = read_meta(path, weights_only)  # as data, like the shards: before any tensor changes
        cdir.load_dir(
            path,
            {_saved_model_key(path): self.model},
            {f"optimizer_{i}": (self.model, o) for i, o in enumerate(optimizers)},
            strict=self.lightning_module.strict_loading,
            trusted=trusts(weights_only),
            verify=False,
        )
        return meta

    def _load_converted(self, path: Path) -> dict[str, Any]:
        """A `Checkpointer` step (`f2.convert_deepspeed_checkpoint`, `f2.convert_fsdp1_checkpoint`): model and
        optimizer into the LightningModule's submodule it was saved from, the counters and scheduler in
        Lightning's keys."""
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        if len(optimizers) > 1:
            raise ValueError(
                f"{path} is a Checkpointer step holding one optimizer's state, and configure_optimizers returned "
                f"{len(optimizers)}; resume it with one optimizer, or load it with f2.load_step_dir per submodule."
            )
        extra = load_into(path, self.model, optimizers[0] if optimizers else None)
        return lightning_state(self.lightning_module.trainer, extra)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Rank 0 removes a checkpoint file or directory (ModelCheckpoint's `save_top_k`)."""
        if self.is_global_zero:
            path = Path(filepath)
            if path.is_dir() and not path.is_symlink():
                cdir.remove_dir(path)  # un-published first: a crash mid-delete leaves nothing loadable
            else:
                super().remove_checkpoint(filepath)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register "fsdp2", "fsdp2_hybrid", "fsdp2_cpu_offload" and "fsdp2_spawn"."""
        register_all(cls, strategy_registry)


def _saved_model_key(path: Path) -> str:
    """Which of `_LOADABLE_MODEL_KEYS` the sharded checkpoint at `path` holds the model under."""
    names = cdir.read_metadata(path).state_dict_metadata
    return next((k for k in _LOADABLE_MODEL_KEYS if any(n.startswith(k + ".") for n in names)), _MODEL_KEY)

"""PyTorch Lightning adapter: `Trainer(strategy="fsdp2")` backed by the fsdp2_strategy core.

    import fsdp2_strategy.integrations.lightning  # registers "fsdp2", "fsdp2_hybrid", "fsdp2_cpu_offload"
    trainer = lightning.pytorch.Trainer(strategy="fsdp2", devices=2)

`FSDP2Strategy` subclasses Lightning's `ModelParallelStrategy` and keeps its device mesh
(dims "data_parallel" and "tensor_parallel"), so LightningModules written for that strategy
keep working. The sharding itself is `fsdp2_strategy.shard_model`; this module only
translates Lightning's hooks into core calls.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal, Optional

from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from torch.distributed.constants import default_pg_timeout
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

import fsdp2_strategy as f2

__all__ = ["FSDP2Strategy", "STEP_METHODS"]

STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
"""LightningModule methods Lightning calls instead of `forward`; FSDP gathers the root around them."""

_ONE_DIM_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP")


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning strategy that shards the LightningModule with `fsdp2_strategy.shard_model`.

    Keyword arguments are the `fsdp2_strategy.FSDP2Config` fields (invalid values raise the
    core's `ValueError`), plus:

    Args:
        state_dict_type: "sharded" (each rank saves its shard, a DCP folder) or "full"
            (full weights gathered to rank 0 into one file).
        process_group_backend: torch.distributed backend; default from the device (gloo on CPU).
        timeout: process-group timeout.
        **config: `FSDP2Config` fields (`sharding_strategy`, `wrap_policy`, `mixed_precision`, ...).
    """

    def __init__(
        self,
        state_dict_type: Literal["sharded", "full"] = "sharded",
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        **config: Any,
    ) -> None:
        if state_dict_type not in ("sharded", "full"):
            raise ValueError(f"FSDP2Strategy.state_dict_type={state_dict_type!r} is invalid; use 'sharded' or 'full'.")
        self.fsdp2_config = f2.FSDP2Config(**config)
        super().__init__(
            save_distributed_checkpoint=state_dict_type == "sharded",
            process_group_backend=process_group_backend,
            timeout=timeout,
        )

    def setup_environment(self) -> None:
        """Set up the process group and a ("data_parallel"=world size, "tensor_parallel"=1) mesh."""
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        """Shard the LightningModule (after `configure_model`), then set up optimizers."""
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self._shard()  # fully_shard moves each shard to the mesh's device
        self.model_to_device()  # buffers and anything left unsharded
        self.model = self.precision_plugin.convert_module(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _shard(self) -> None:
        """Apply the core's `shard_model` and gather the root around Lightning's step methods."""
        module = self.lightning_module
        f2.shard_model(module, self.fsdp2_config, mesh=self._core_mesh())
        if isinstance(module, FSDPModule):
            for name in STEP_METHODS:
                if callable(getattr(module, name, None)):
                    register_fsdp_forward_method(module, name)

    def _core_mesh(self):
        """The 1-D data-parallel sub-mesh for 1-D strategies; None lets the core build hybrid meshes."""
        cfg = self.fsdp2_config
        if cfg.sharding_strategy in _ONE_DIM_STRATEGIES and cfg.mesh_shape is None:
            return self.device_mesh["data_parallel"]
        return None

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register "fsdp2", "fsdp2_hybrid" and "fsdp2_cpu_offload" in `strategy_registry`."""
        entries = {
            "fsdp2": ("FSDP2 (fully_shard) via fsdp2_strategy", {}),
            "fsdp2_hybrid": ("FSDP2 hybrid sharding via fsdp2_strategy", {"sharding_strategy": "HYBRID_SHARD"}),
            "fsdp2_cpu_offload": ("FSDP2 with CPU offload via fsdp2_strategy", {"cpu_offload": True}),
        }
        for name, (description, params) in entries.items():
            strategy_registry.register(name, cls, description=description, override=True, **params)


FSDP2Strategy.register_strategies(StrategyRegistry)

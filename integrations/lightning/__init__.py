"""PyTorch Lightning adapter: `Trainer(strategy="fsdp2")` backed by the fsdp2_strategy core.

    import fsdp2_strategy.integrations.lightning  # registers "fsdp2", "fsdp2_hybrid", "fsdp2_cpu_offload", "fsdp2_spawn"
    trainer = lightning.pytorch.Trainer(strategy="fsdp2", devices=2, precision="bf16-mixed")

Importing this module also teaches `LightningModule.load_from_checkpoint` to read the
sharded checkpoint directories the strategy writes (in one process, weights gathered).
"""

from lightning.pytorch.strategies import StrategyRegistry

from ._compat import install_checkpoint_loader
from .precision import (
    SUPPORTED_PRECISION,
    FSDP2HalfPrecision,
    FSDP2MixedPrecision,
    FSDP2Precision,
)
from .strategy import FSDP2Strategy
from .throughput import FSDP2ThroughputMonitor

__all__ = [
    "FSDP2HalfPrecision",
    "FSDP2MixedPrecision",
    "FSDP2Precision",
    "FSDP2Strategy",
    "FSDP2ThroughputMonitor",
    "SUPPORTED_PRECISION",
]

FSDP2Strategy.register_strategies(StrategyRegistry)
install_checkpoint_loader()

"""Lightning Fabric adapter: `Fabric(strategy="fsdp2")` backed by the fsdp2_strategy core.

    import fsdp2_strategy.integrations.fabric  # registers "fsdp2", "fsdp2_hybrid", "fsdp2_cpu_offload", "fsdp2_spawn"
    fabric = lightning.fabric.Fabric(strategy="fsdp2", devices=2, precision="bf16-mixed")
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)   # sharded by wrap policy

The names are those of the Trainer adapter, in Fabric's own registry.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY

from .._lightning_shared import SUPPORTED_PRECISION
from ._compat import install_precision_choice
from .precision import FSDP2FabricHalfPrecision, FSDP2FabricMixedPrecision, FSDP2FabricPrecision
from .strategy import FSDP2FabricStrategy

__all__ = [
    "FSDP2FabricHalfPrecision",
    "FSDP2FabricMixedPrecision",
    "FSDP2FabricPrecision",
    "FSDP2FabricStrategy",
    "SUPPORTED_PRECISION",
]

FSDP2FabricStrategy.register_strategies(STRATEGY_REGISTRY)
install_precision_choice(FSDP2FabricStrategy)

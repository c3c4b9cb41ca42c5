"""Memory estimation before anything is materialised: one training step played on the meta
device (`simulate`, with what the device and optimizer change: `sim_device`, `sim_model`,
`sim_optimizer`), the per-rank estimate (`memory`), the strategy comparison and the memory
planner's choice for `sharding_strategy="auto"` (`compare`), and the step-time model (`step_time`).

Imports the base modules and `train`. `__all__` is what other packages and the adapters use.
"""

from .compare import (
    PlanRow,
    StrategyComparison,
    compare_strategies,
    default_budget,
    nothing_fits_message,
    resolve_auto,
)
from .memory import MemoryEstimate, estimate_memory, human_bytes
from .micro_batch import MicroBatchFit, largest_micro_batch
from .sim_model import default_loss
from .sim_optimizer import optimizer_factory
from .step_time import (
    CollectiveFit,
    ComputeProfile,
    Link,
    StepTimeModel,
    StepTimePrediction,
    collective_count,
    fit_offload,
    fsdp_calls,
    offload_moves_state,
)

__all__ = [
    "CollectiveFit",
    "ComputeProfile",
    "Link",
    "StepTimeModel",
    "StepTimePrediction",
    "PlanRow",
    "collective_count",
    "default_budget",
    "default_loss",
    "fit_offload",
    "fsdp_calls",
    "nothing_fits_message",
    "offload_moves_state",
    "optimizer_factory",
    "MemoryEstimate",
    "MicroBatchFit",
    "largest_micro_batch",
    "StrategyComparison",
    "compare_strategies",
    "estimate_memory",
    "human_bytes",
    "resolve_auto",
]

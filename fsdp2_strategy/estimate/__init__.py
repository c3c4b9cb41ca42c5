"""Memory estimation before anything is materialised: one training step played on the meta
device (`simulate`, with what the device and optimizer change: `sim_device`, `sim_model`,
`sim_optimizer`), the per-rank estimate (`memory`) and the strategy comparison behind
`sharding_strategy="auto"` (`compare`).

Imports the base modules and `train`. `__all__` is what other packages and the adapters use.
"""

from .compare import StrategyComparison, compare_strategies, resolve_strategy
from .memory import MemoryEstimate, estimate_memory, human_bytes
from .step_time import CollectiveFit, ComputeProfile, Link, StepTimeModel, StepTimePrediction, predict_step_time

__all__ = [
    "CollectiveFit",
    "ComputeProfile",
    "Link",
    "StepTimeModel",
    "StepTimePrediction",
    "predict_step_time",
    "MemoryEstimate",
    "StrategyComparison",
    "compare_strategies",
    "estimate_memory",
    "human_bytes",
    "resolve_strategy",
]

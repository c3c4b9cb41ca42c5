"""Training with a sharded model: accumulation modes and `no_sync`, clipping, optimizer checks,
parameters kept replicated by hand, trainer entry points other than `forward`, and per-step
throughput metrics (tokens/s, MFU, peak memory).

Imports only the base modules of the core. `__all__` is what other packages and the adapters use.
"""

from .accumulation import DEFAULT_MODE, gathers_up_front, mode_of, no_sync, record_mode, set_gradient_sync
from .clipping import clip_grad_norm_, clip_grad_value_
from .optimizer import check_optimizer, mark_replaced_params, parameters_by_name, rebind_optimizer
from .replicated import ATTR as REPLICATED_ATTR
from .replicated import SCALAR_REASON, ReplicatedParams, find_scalar_params, replicated_params_of
from .resharding import reshard
from .step_methods import register_step_method
from .throughput import (
    PeakFlops,
    StepMetrics,
    ThroughputMeter,
    ThroughputTracker,
    count_tokens,
    flops_per_token,
    log_step_metrics,
    peak_flops,
    track_throughput,
)

__all__ = [
    "PeakFlops",
    "StepMetrics",
    "ThroughputMeter",
    "ThroughputTracker",
    "count_tokens",
    "flops_per_token",
    "log_step_metrics",
    "peak_flops",
    "track_throughput",
    "DEFAULT_MODE",
    "REPLICATED_ATTR",
    "SCALAR_REASON",
    "ReplicatedParams",
    "check_optimizer",
    "clip_grad_norm_",
    "clip_grad_value_",
    "find_scalar_params",
    "gathers_up_front",
    "mark_replaced_params",
    "mode_of",
    "no_sync",
    "parameters_by_name",
    "rebind_optimizer",
    "record_mode",
    "register_step_method",
    "replicated_params_of",
    "reshard",
    "set_gradient_sync",
]

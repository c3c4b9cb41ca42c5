"""Training with a sharded model: accumulation modes and `no_sync`, clipping, optimizer checks,
parameters kept replicated by hand, trainer entry points other than `forward`, and per-step
throughput metrics (tokens/s, MFU, peak memory).

Imports only the base modules of the core. `__all__` is what other packages and the adapters use.
"""

from .accumulation import mode_of, no_sync, record_mode, set_gradient_sync
from .accumulation_mode import DEFAULT_MODE, MODES, AccumulationMode, accumulation_mode
from .causal_lm import LogitsNotBuiltError, install_chunked_loss
from .chunked_loss import IGNORE_INDEX, chunked_causal_lm_loss
from .clipping import clip_grad_norm_, clip_grad_value_
from .kept_gathered import KeptGroups
from .optimizer import check_optimizer, mark_replaced_params, parameters_by_name, rebind_optimizer
from .replicated import SCALAR_REASON, ReplicatedParams, find_scalar_params
from .resharding import reshard
from .state import EngineState, engine_state, recorded_state, replicated_params_of
from .step_methods import register_step_method
from .throughput import (
    PeakFlops,
    StepMetrics,
    ThroughputMeter,
    ThroughputTracker,
    flops_per_token,
    peak_flops,
    track_throughput,
)

__all__ = [
    "IGNORE_INDEX",
    "LogitsNotBuiltError",
    "install_chunked_loss",
    "chunked_causal_lm_loss",
    "PeakFlops",
    "StepMetrics",
    "ThroughputMeter",
    "ThroughputTracker",
    "flops_per_token",
    "peak_flops",
    "track_throughput",
    "AccumulationMode",
    "DEFAULT_MODE",
    "MODES",
    "EngineState",
    "KeptGroups",
    "SCALAR_REASON",
    "ReplicatedParams",
    "check_optimizer",
    "clip_grad_norm_",
    "clip_grad_value_",
    "accumulation_mode",
    "engine_state",
    "find_scalar_params",
    "mark_replaced_params",
    "mode_of",
    "no_sync",
    "parameters_by_name",
    "rebind_optimizer",
    "record_mode",
    "recorded_state",
    "register_step_method",
    "replicated_params_of",
    "reshard",
    "set_gradient_sync",
]

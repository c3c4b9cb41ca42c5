"""What the Trainer adapter (`integrations/lightning`) and the Fabric adapter (`integrations/fabric`)
share, written once, as Lightning's own Trainer strategies build on Fabric's helpers: the config
and mesh derived from what Lightning knows (`config`), precision strings and plugin swaps
(`precision`), the sharded-checkpoint format (`checkpoint`), the spawn launchers' clean end
(`launch`), `ModelParallelStrategy`'s constructor sizes (`model_parallel`), and the private Lightning names the shared code needs (`_compat`).
"""

from .checkpoint import META_FILE, is_sharded_checkpoint, not_committed_error, read_meta, trusts
from .config import (
    REGISTERED,
    START_METHODS,
    check_start_method,
    check_tensor_parallel_layout,
    core_mesh,
    effective_config,
    parallel_sizes,
    process_group_backend,
    register_all,
    sampler_kwargs,
)
from .launch import ShutdownAfterWorker
from .model_parallel import ModelParallelArgs, model_parallel_args
from .precision import MIXED_POLICY, SUPPORTED_PRECISION, mixed_scaler, plugin_property, swap_plugin

__all__ = [
    "META_FILE",
    "MIXED_POLICY",
    "ModelParallelArgs",
    "REGISTERED",
    "START_METHODS",
    "SUPPORTED_PRECISION",
    "ShutdownAfterWorker",
    "check_start_method",
    "check_tensor_parallel_layout",
    "core_mesh",
    "effective_config",
    "is_sharded_checkpoint",
    "sampler_kwargs",
    "mixed_scaler",
    "model_parallel_args",
    "not_committed_error",
    "parallel_sizes",
    "plugin_property",
    "process_group_backend",
    "read_meta",
    "register_all",
    "swap_plugin",
    "trusts",
]

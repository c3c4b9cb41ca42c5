"""fsdp2-strategy: one FSDP2 engine for any trainer.

Example:
    ```python
    import fsdp2_strategy as f2
    model = f2.shard_model(model, f2.FSDP2Config(wrap_policy="auto", mixed_precision="bf16"))
    optimizer = torch.optim.AdamW(model.parameters())
    ```
"""

from . import _torch_compat  # noqa: F401  (checks the private torch names the core uses; raises ImportError naming them)
from .checkpoint import (
    Checkpointer,
    UntrustedCheckpointError,
    export_full,
    export_peft,
    full_weights,
    inspect_checkpoint,
    load_full_weights,
    save_merged,
    save_peft_adapter,
)
from .choose import compare_strategies, shard_model, shard_reference
from .config import FSDP2Config, ModuleOverride
from .distributed import init_distributed, shutdown
from .estimate import MemoryEstimate, MicroBatchFit, StrategyComparison, estimate_memory, largest_micro_batch
from .fsdp1 import fully_shard
from .migrate import (
    ConvertedCheckpoint,
    ConvertedFSDP1Checkpoint,
    DeepSpeedTranslation,
    convert_deepspeed_checkpoint,
    convert_fsdp1_checkpoint,
    translate_deepspeed,
)
from .precision import native_low_precision
from .preemption import PREEMPTION_EXIT_CODE, PreemptionWatch
from .sequence import ContextParallelBatch, context_parallel
from .shard import ShardingPlan, gathered, replicate, sharding_plan, to_4bit
from .train import (
    AccumulationMode,
    EngineState,
    LogitsNotBuiltError,
    PeakFlops,
    StepMetrics,
    ThroughputMeter,
    ThroughputTracker,
    accumulation_mode,
    check_optimizer,
    chunked_causal_lm_loss,
    clip_grad_norm_,
    clip_grad_value_,
    engine_state,
    flops_per_token,
    no_sync,
    peak_flops,
    reshard,
    set_gradient_sync,
    track_throughput,
)
from .tuning import TuneResult, measure_link, tune
from .versions import __version__ as __version__
from .versions import warn_untested_versions

__all__ = [
    "ContextParallelBatch",
    "context_parallel",
    "AccumulationMode",
    "Checkpointer",
    "UntrustedCheckpointError",
    "DeepSpeedTranslation",
    "EngineState",
    "LogitsNotBuiltError",
    "PREEMPTION_EXIT_CODE",
    "PeakFlops",
    "PreemptionWatch",
    "ConvertedCheckpoint",
    "ConvertedFSDP1Checkpoint",
    "FSDP2Config",
    "MemoryEstimate",
    "MicroBatchFit",
    "largest_micro_batch",
    "ModuleOverride",
    "ShardingPlan",
    "StepMetrics",
    "StrategyComparison",
    "ThroughputMeter",
    "ThroughputTracker",
    "TuneResult",
    "accumulation_mode",
    "check_optimizer",
    "chunked_causal_lm_loss",
    "clip_grad_norm_",
    "clip_grad_value_",
    "compare_strategies",
    "convert_deepspeed_checkpoint",
    "convert_fsdp1_checkpoint",
    "engine_state",
    "estimate_memory",
    "export_full",
    "export_peft",
    "flops_per_token",
    "full_weights",
    "fully_shard",
    "gathered",
    "init_distributed",
    "inspect_checkpoint",
    "load_full_weights",
    "to_4bit",
    "measure_link",
    "native_low_precision",
    "no_sync",
    "peak_flops",
    "replicate",
    "reshard",
    "save_merged",
    "save_peft_adapter",
    "set_gradient_sync",
    "shard_model",
    "shard_reference",
    "sharding_plan",
    "shutdown",
    "track_throughput",
    "translate_deepspeed",
    "tune",
]

warn_untested_versions()

"""FSDP1's vocabulary on FSDP2: `f2.fully_shard(module, sharding_strategy=..., mixed_precision=
MixedPrecision(...), cpu_offload=CPUOffload(...), auto_wrap_policy=..., ignored_modules=...)`
translated onto `shard_model` (`translate`), and FSDP1's auto-wrap policies read as groups (`wrap`).

Imports the base modules and `shard`. `__all__` is what other packages and the adapters use.
"""

from .translate import fully_shard

__all__ = ["fully_shard"]

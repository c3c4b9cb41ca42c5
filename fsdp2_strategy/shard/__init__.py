"""Applying FSDP2 to a model: `shard_model` (groups bottom-up, tensor parallel, checkpointing,
compile, prefetch), meta-device materialisation, the gloo rings and the host allocator it
installs, `replicate` for what no group owns, rank-0 weight broadcast, and the sharding report.

Imports the base modules, `train` and `estimate` (for `sharding_strategy="auto"`). `__all__` is
what other packages and the adapters use.
"""

from .gathered import gathered
from .materialize import copy_from_full, has_meta_tensors, local_region, local_tensor
from .quantise_on_load import pending_4bit, quantise_pending, to_4bit
from .quantised import as_packed_bytes, dequantised, four_bit_layers, quantised_param_names
from .rank0_weights import shard_with_rank0_weights
from .replicate import replicate
from .report import ShardingPlan, sharding_plan
from .ring_comms import RingAllGather, RingReduceScatter
from .sharding import shard_model

__all__ = [
    "RingAllGather",
    "RingReduceScatter",
    "ShardingPlan",
    "as_packed_bytes",
    "copy_from_full",
    "dequantised",
    "four_bit_layers",
    "gathered",
    "has_meta_tensors",
    "local_region",
    "local_tensor",
    "pending_4bit",
    "quantise_pending",
    "quantised_param_names",
    "replicate",
    "shard_model",
    "shard_with_rank0_weights",
    "sharding_plan",
    "to_4bit",
]

"""Context parallelism: each sequence split across the "cp" ranks, attention as a ring.

`FSDP2Config(context_parallel_size=N)` gives the mesh a "cp" dim (FSDP shards over data parallel x
context parallel ranks); `context_parallel(model, batch)` runs a step on this rank's part of every
sequence, with `ContextParallelBatch.loss` over all the sequences' tokens. torch's ring attention
runs on accelerators as torch ships it and on CPUs through the kernel `ring` registers.

Others may use: `context_parallel`, `ContextParallelBatch`, `context_mesh` (the model's "cp" mesh),
`ring_attention` (torch's `context_parallel` on any device, for the adapters' context managers),
`prepare` (a batch of whole sequences with what a rank cannot derive from its part),
`check_sdpa_attention` (a Hugging Face model's attention must be SDPA), `set_ring_rotation`,
`IGNORE_INDEX` (the label of a token without a target).
"""

from .batch import IGNORE_INDEX, ContextParallelBatch, prepare
from .context import check_sdpa_attention, context_mesh, context_parallel, ring_attention, set_ring_rotation

__all__ = [
    "IGNORE_INDEX",
    "ContextParallelBatch",
    "check_sdpa_attention",
    "context_mesh",
    "context_parallel",
    "prepare",
    "ring_attention",
    "set_ring_rotation",
]

"""Count FSDP's collectives by patching the torch.distributed functions it calls, and the
point-to-point rings (`fsdp2_strategy.ring_comms`) that replace its all-gather and reduce-scatter
on gloo: a ring call counts as the `*_single` collective FSDP would have called instead."""

from __future__ import annotations

import contextlib
from collections import Counter

import torch.distributed as dist

from fsdp2_strategy.ring_comms import RingAllGather, RingReduceScatter

NAMES = ("reduce_scatter_single", "all_gather_single", "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor")
RINGS = ((RingAllGather, "ring_all_gather", "all_gather_single"),
         (RingReduceScatter, "ring_reduce_scatter", "reduce_scatter_single"))


@contextlib.contextmanager
def count_collectives():
    """Yield a Counter of collective calls made through `torch.distributed` or the rings inside the block."""
    counts: Counter = Counter()
    originals = {n: getattr(dist, n) for n in NAMES if hasattr(dist, n)}
    ring_originals = {(cls, attr): getattr(cls, attr) for cls, attr, _ in RINGS}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    for cls, attr, name in RINGS:
        setattr(cls, attr, staticmethod(wrap(name, ring_originals[(cls, attr)])))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        for (cls, attr), fn in ring_originals.items():
            setattr(cls, attr, staticmethod(fn))

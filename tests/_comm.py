"""Count FSDP's collectives by patching the torch.distributed functions it calls."""

from __future__ import annotations

import contextlib
from collections import Counter

import torch.distributed as dist

NAMES = ("reduce_scatter_single", "all_gather_single", "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor")


@contextlib.contextmanager
def count_collectives():
    """Yield a Counter of collective calls made through `torch.distributed` inside the block."""
    counts: Counter = Counter()
    originals = {n: getattr(dist, n) for n in NAMES if hasattr(dist, n)}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)

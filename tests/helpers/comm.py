"""Watch FSDP's collectives by patching the torch.distributed functions it calls, and the
point-to-point rings (`fsdp2_strategy.ring_comms`) that replace its all-gather and reduce-scatter
on gloo: a ring call is reported as the `*_single` collective FSDP would have called instead
(same argument positions: output first, input second). `benchmarks/collectives.py` counts bytes
through the same hook."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from fsdp2_strategy.shard.ring_comms import RingAllGather, RingReduceScatter

NAMES = ("reduce_scatter_single", "all_gather_single", "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor")
# torch 2.13 named FSDP's two collectives `*_single`; before, FSDP called `reduce_scatter_tensor` and
# `all_gather_into_tensor`: on such a torch those are reported under the new names.
RENAMED = {"reduce_scatter_tensor": "reduce_scatter_single", "all_gather_into_tensor": "all_gather_single"}
RINGS = (
    (RingAllGather, "ring_all_gather", "all_gather_single"),
    (RingReduceScatter, "ring_reduce_scatter", "reduce_scatter_single"),
)


@contextlib.contextmanager
def observe_collectives(on_call: Callable[[str, tuple, dict], Any]):
    """Inside the block, `on_call(name, args, kwargs)` runs before each collective call."""
    originals = {n: getattr(dist, n) for n in NAMES if hasattr(dist, n)}
    ring_originals = {(cls, attr): getattr(cls, attr) for cls, attr, _ in RINGS}

    def wrap(name, fn):
        def observed(*args, **kwargs):
            on_call(name, args, kwargs)
            return fn(*args, **kwargs)

        return observed

    for name, fn in originals.items():
        new = RENAMED.get(name)
        setattr(dist, name, wrap(new if new is not None and not hasattr(dist, new) else name, fn))
    for cls, attr, name in RINGS:
        setattr(cls, attr, staticmethod(wrap(name, ring_originals[(cls, attr)])))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        for (cls, attr), fn in ring_originals.items():
            setattr(cls, attr, staticmethod(fn))


@contextlib.contextmanager
def count_collectives():
    """Yield a Counter of collective calls made through `torch.distributed` or the rings inside the block."""
    counts: Counter = Counter()
    with observe_collectives(lambda name, args, kwargs: counts.update([name])):
        yield counts


@contextlib.contextmanager
def collective_dtypes():
    """Yield a set of (collective, dtype name) for the gradient reductions made inside the block: the
    input of each reduce-scatter, the tensor of each all-reduce (what the reduce dtype decides)."""
    seen: set = set()

    def record(name: str, args: tuple, kwargs: dict) -> None:
        if name.startswith("reduce_scatter") and len(args) > 1:
            seen.add((name, str(args[1].dtype).removeprefix("torch.")))
        elif name == "all_reduce" and args:
            seen.add((name, str(args[0].dtype).removeprefix("torch.")))

    with observe_collectives(record):
        yield seen

"""What the tuner's probe step records as it runs: the c10d collectives dispatched
(`CountCollectives`) and, on CPU, the peak of live tensor bytes (`LiveTensorBytes`).

`LiveTensorBytes` counts what torch's `MemTracker` counts (the reference the memory planner is
checked against, `tests/helpers/memtrack.py`), and keeps only the running total and its peak: MemTracker
also hooks every module, every parameter's gradient and the optimizer step to attribute the bytes
to modules and kinds, which the tuner never reads. A probe step under this mode is therefore
closer to a plain step's time than one under MemTracker, with the same peaks.
"""

from __future__ import annotations

import functools
import weakref
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .. import _torch_compat as tc

C10D_NAMES = {
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "send": "p2p_send",
}
"""c10d operations counted, by the name shown ("p2p_send": one step of a gloo ring)."""


class CountCollectives(tc.TorchDispatchMode):
    """Counts the c10d collectives dispatched under it, by `C10D_NAMES` (`.counts`)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._count(func)
        return out

    def _count(self, func: Any) -> None:
        if func.namespace == "c10d":
            name = C10D_NAMES.get(func.__name__.split(".")[0])
            if name:
                self.counts[name] += 1


class LiveTensorBytes(CountCollectives):
    """Peak bytes of the tensor storages alive under the mode (`.peak`), counting collectives too.

    Counted, each storage once at its size: those of `roots`' tensors when entering (modules'
    parameters, gradients and buffers, optimizers' state, the batch) and of every op's outputs,
    until the storage dies (a weak reference's callback) and at its new size after
    `UntypedStorage.resize_`, which FSDP2 frees and re-allocates its gathered parameters with and
    which no dispatch mode sees (patched while inside). Ops on DTensors are left to DTensor, so
    the local ops it runs are the ones counted; its sharding propagation under a fake mode is not.
    """

    def __init__(self, *roots: Any) -> None:
        super().__init__()
        self.now = self.peak = 0
        self._roots = roots
        self._sizes: dict[int, tuple[int, weakref.ref]] = {}
        self._resize = torch.UntypedStorage.resize_
        self._fake_on_entry: Any = None

    def __enter__(self) -> LiveTensorBytes:
        self._fake_on_entry = tc.active_fake_mode()
        for t in _root_tensors(self._roots):
            self._track(t)
        self.peak = self.now
        resize, track = self._resize, self._track_storage

        def tracked_resize(storage: torch.UntypedStorage, size: int) -> Any:
            out = resize(storage, size)
            track(storage)
            return out

        torch.UntypedStorage.resize_ = tracked_resize  # type: ignore[method-assign, assignment]
        super().__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        # The weak references go: no callback runs (nor keeps this mode alive) once the peak is known.
        self._sizes.clear()
        super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        self._count(func)
        if tc.active_fake_mode() is self._fake_on_entry:
            for t in _tensors(out):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        for storage in _storages(t):
            self._track_storage(storage, new=True)

    def _track_storage(self, storage: torch.UntypedStorage, new: bool = False) -> None:
        """Count a storage not yet counted (`new`) or one whose size changed."""
        key = tc.storage_key(storage)
        known = self._sizes.get(key)
        if known is None and not new:
            return  # resized before it was seen: counted at its size when an op first outputs it
        nbytes = storage.nbytes()
        if known is not None and known[0] == nbytes:
            return
        ref = known[1] if known is not None else weakref.ref(storage, functools.partial(self._free, key))
        self.now += nbytes - (known[0] if known is not None else 0)
        self._sizes[key] = (nbytes, ref)
        self.peak = max(self.peak, self.now)

    def _free(self, key: int, ref: weakref.ref) -> None:
        known = self._sizes.get(key)
        if known is not None and known[1] is ref:
            del self._sizes[key]
            self.now -= known[0]


def _tensors(out: Any) -> Iterator[torch.Tensor]:
    """The tensors of an op's output (a tensor, or lists and tuples of them and other values)."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for item in out:
            yield from _tensors(item)


def _storages(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """A tensor's storages: its own, or its inner tensors' for a wrapper subclass (DTensor,
    quantised weights)."""
    if tc.is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
        for inner in (getattr(t, name) for name in names):
            if isinstance(inner, torch.Tensor):  # DTensor also names its mesh
                yield from _storages(inner)
    elif t.layout == torch.strided:
        yield t.untyped_storage()


def _root_tensors(roots: tuple) -> Iterator[torch.Tensor]:
    for root in roots:
        if isinstance(root, torch.nn.Module):
            for p in root.parameters():
                yield p
                if p.grad is not None:
                    yield p.grad
            yield from root.buffers()
        elif isinstance(root, torch.optim.Optimizer):
            for state in root.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))
        else:
            yield from (t for t in tc.tree_flatten(root)[0] if isinstance(t, torch.Tensor))

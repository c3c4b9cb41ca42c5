"""Hold back the copy of an asynchronous ("overlap") save, so that training really goes on while it runs.

`slow_staging(delay)` makes every `AsyncSaver` built inside it (the adapters' and `Checkpointer`'s
default stager) sleep `delay` seconds before copying: without the optimizer step's wait the saved
parameters would then be the next step's. `full_state(model, optimizer)` is what a checkpoint must
hold, whole (collective).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.tensor import DTensor

from fsdp2_strategy.checkpoint import async_save


class SlowStager(DefaultStager):
    delay = 0.6
    copies_started: list[float] = []
    """`time.perf_counter()` as each copy starts (before it is held back), in this process."""
    copies_done: list[float] = []
    """`time.perf_counter()` at the end of each held-back copy, in this process."""

    def _stage(self, state_dict, **kwargs):
        SlowStager.copies_started.append(time.perf_counter())
        time.sleep(self.delay)
        staged = super()._stage(state_dict, **kwargs)
        SlowStager.copies_done.append(time.perf_counter())
        return staged


def copied_by(moment: float) -> bool:
    """Whether a held-back copy had ended by `moment` (a `time.perf_counter()`): a save that returned
    before its copy ended did not wait for it, however long its own work took on a loaded machine."""
    return any(done <= moment for done in SlowStager.copies_done)


def slow(stager: DefaultStager, delay: float) -> DefaultStager:
    """`stager`, its copies held back `delay` seconds."""
    stager.__class__ = type("Slow", (SlowStager, type(stager)), {"delay": delay})
    return stager


@contextmanager
def slow_staging(delay: float) -> Iterator[None]:
    original = async_save.default_stager
    SlowStager.copies_done.clear()
    SlowStager.copies_started.clear()
    async_save.default_stager = lambda mode: slow(original(mode), delay)
    try:
        yield
    finally:
        async_save.default_stager = original


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and optimizer state tensor, whole (collective)."""
    out = {name: _whole(t) for name, t in model.state_dict().items()}
    optimizer = getattr(optimizer, "optimizer", optimizer)  # Fabric's and Accelerate's wrappers
    names = {p: n for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        for k, t in state.items():
            if torch.is_tensor(t) and t.dim() > 0:
                out[f"optim.{names[p]}.{k}"] = _whole(t)
    return out


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors are not bitwise equal (or missing from one side)."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))

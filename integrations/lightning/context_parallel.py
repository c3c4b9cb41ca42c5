"""Context parallelism in the Trainer: each step's batch split across the "cp" ranks.

With `FSDP2Strategy(context_parallel_size=N)` the strategy hands `training_step` (and the
evaluation steps) this rank's part of every sequence: the core's `ContextParallelBatch` (a dict of
the batch's tensors plus "position_ids" and "shift_labels", and `.loss(logits)`). torch's ring
attention must still be routed when the backward of that step runs, which Lightning starts after
`training_step` returns, so the split stays open until the strategy's `backward` ends.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

from torch import Tensor, nn

import fsdp2_strategy as f2
from fsdp2_strategy.sequence import context_mesh


class StepSplit:
    """The open context-parallel split of the current step (at most one)."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()

    def open(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """`args` with the batch (first) replaced by this rank's part, when `module` was sharded with
        context parallelism; else `args` unchanged. Closes a split a previous step left open."""
        self.close()
        if not args or context_mesh(module) is None:
            return args
        part = self._stack.enter_context(f2.context_parallel(module, args[0]))
        return (part, *args[1:])

    def close(self) -> None:
        """End the split: with the exception being handled, if any (so its checks do not mask it)."""
        stack, self._stack = self._stack, contextlib.ExitStack()
        stack.__exit__(*sys.exc_info())


class ContextParallelSteps:
    """The Trainer strategy's step methods with context parallelism: `training_step` and
    `validation_step` get this rank's part of every sequence; the split of a training step stays
    open until `backward` ends. Without context parallelism they are Lightning's own."""

    lightning_module: Any

    @property
    def _split(self) -> StepSplit:
        return self.__dict__.setdefault("_step_split", StepSplit())

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        args = self._split.open(self.lightning_module, args)
        try:
            return super().training_step(*args, **kwargs)  # type: ignore[misc]
        except BaseException:
            self._split.close()
            raise

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        try:
            return super().backward(closure_loss, optimizer, *args, **kwargs)  # type: ignore[misc]
        finally:
            self._split.close()

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        args = self._split.open(self.lightning_module, args)
        try:
            return super().validation_step(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._split.close()

    def close_split(self) -> None:
        """End a split a step left open (teardown)."""
        self._split.close()

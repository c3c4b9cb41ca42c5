"""`PreemptionWatch`: SIGTERM (what Kubernetes, SLURM and spot instances send before killing a job)
turned into a flag every rank agrees on at a point of the training loop the user chooses.

The signal may reach one rank only, in the middle of a step: its handler only sets a flag (a
collective or a save inside a signal handler would run on that rank alone and hang the others).
`requested()` is the agreement: one all-reduce of the flag, so every rank stops after the same step.
`Checkpointer(save_on_preemption=True)` and the adapters' `checkpoint_on_preemption` build on it.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from .distributed import is_distributed, logger, rank
from .mesh import collective_device

PREEMPTION_EXIT_CODE = 128 + signal.SIGTERM
"""Exit status after a preemption save (143: "terminated by SIGTERM", what a process killed by the
signal reports): launchers and schedulers see an interrupted run, so torchrun's `--max-restarts`,
SLURM requeueing or Ray's `FailureConfig` restart it, and it resumes from the saved step."""

__all__ = ["PREEMPTION_EXIT_CODE", "PreemptionWatch"]


class PreemptionWatch:
    """Catches `signals` (default SIGTERM) in this process from construction until `close()`.

    `requested()` (collective) says whether any rank caught one. Build it on every rank, in the main
    thread (Python delivers signals there only). The handler it replaces is restored by `close()`.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionWatch must be created in the main thread (signal handlers live there).")
        self.received: int | None = None
        self._agreed = False
        self._previous: dict[int, Any] = {s: signal.signal(s, self._handle) for s in signals}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum
        logger.warning("Rank %d received %s: stopping after this step", rank(), signal.Signals(signum).name)

    def requested(self) -> bool:
        """Collective: whether any rank caught a signal (once True, stays True without communicating)."""
        if not self._agreed:
            flag = torch.tensor([1 if self.received is not None else 0], device=collective_device())
            if is_distributed():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            self._agreed = bool(flag.item())
        return self._agreed

    @property
    def agreed(self) -> bool:
        """Whether `requested()` returned True already (read without communicating)."""
        return self._agreed

    def close(self) -> None:
        """Restore the handlers that were installed before this watch."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

"""`AsyncSaver`: one asynchronous DCP save at a time, committed later - the engine behind
`Checkpointer(async_save=...)` and the adapters' `FSDP2Config.checkpoint_async_save`.

Modes (`ASYNC_MODES`):

- False: nothing here runs; the caller writes synchronously (`directory.save_dir`).
- True: `dcp.async_save` copies the state to CPU memory before `start()` returns, then a background
  thread writes it.
- "overlap": `start()` returns before the copy is made; it runs while the next micro-batches run
  forward and backward. Parameters and optimizer state change only in an optimizer step, so a global
  optimizer step pre-hook orders the next `optimizer.step()` (of any optimizer) after the copy. On an
  accelerator the copies are queued on a side stream before `start()` returns (`StreamCopyStager`)
  and the step's kernels wait for them on the device; on the host, the copy runs in DCP's stager
  thread and the step waits for it. Buffers, which a forward may change (BatchNorm's running
  statistics), are copied before `start()` returns. Anything else changed in place outside
  `optimizer.step()` (an EMA written by hand) must wait for `wait_staged()` first.

Each saver keeps DCP's save plan from one save to the next (`tc.caching_save_planner`): DCP's
background thread otherwise plans every save anew (each rank's plan gathered to rank 0, deduplicated,
the global plan and metadata scattered back), Python work that shares the GIL with the training loop
while it runs the next steps. A save of the same structure reuses the plan; another is planned again.

The write is committed (checksummed, renamed into place) by `wait()`, which the owner calls before
the next save, before a load and when training ends: every rank calls it at the same point, so the
commit's collectives line up.
"""

from __future__ import annotations

import atexit
import itertools
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import _torch_compat as tc
from ..config_checks import ASYNC_MODES, check_async_save
from ..distributed import before_shutdown, is_distributed, logger
from .stream_copy import StreamCopyStager

__all__ = ["ASYNC_MODES", "AsyncSaver", "copy_buffers", "make_saver"]

_SAVER_IDS = itertools.count()


class AsyncSaver:
    """Runs `dcp.async_save` in mode `mode` (True or "overlap") and commits each save on `wait()`.

    `make_stager` builds DCP's stager once (it keeps its CPU buffers between saves); `None` uses
    `default_stager(mode)`. Every method but `wait_staged` is collective.
    """

    def __init__(self, mode: bool | str, *, make_stager: Callable[[], DefaultStager] | None = None):
        check_async_save(mode, "async_save")
        if not mode:
            raise ValueError("AsyncSaver needs async_save=True or 'overlap'; save synchronously otherwise.")
        self.mode = mode
        self._make_stager = make_stager or (lambda: default_stager(mode))
        self._stager: DefaultStager | None = None
        self._group: dist.ProcessGroup | None = None
        self._pending: tuple[Path, Future, Callable[[], None]] | None = None
        self._staging: Future | None = None  # "overlap": the copy in flight
        self._step_hook: Any = None
        self._plan_key = f"fsdp2_strategy.AsyncSaver.{next(_SAVER_IDS)}"  # this saver's cached plan
        before_shutdown(self.wait)  # `f2.shutdown()` commits the last save
        atexit.register(_warn_if_pending, weakref.ref(self))

    @property
    def pending(self) -> Path | None:
        """The directory of the save in flight (not committed yet), or None."""
        return self._pending[0] if self._pending is not None else None

    def start(
        self,
        state: dict[str, Any],
        tmp: Path,
        commit: Callable[[], None],
        *,
        writer: FileSystemWriter | None = None,
        models: Mapping[str, nn.Module] | None = None,
    ) -> None:
        """Start writing `state` into the prepared directory `tmp`; `commit()` runs in `wait()` once
        every rank's shards are written. `models`: the models whose flat state is `state[key]`; in
        "overlap" mode their buffers are copied now."""
        self.wait()  # one save in flight at a time
        if self.mode == "overlap":
            copy_buffers(state, models or {})
        if self._group is None and is_distributed():
            # DCP's collectives run in a background thread; on the default group they could
            # interleave with the training step's all-gathers and deadlock or mix data.
            self._group = dist.new_group(backend="gloo")
        if self._stager is None:
            self._stager = self._make_stager()
        # "overlap" on the host: the copy waits until this returns. Started at once in DCP's stager
        # thread, its Python loop would hold the GIL while this thread still starts DCP's upload
        # thread, each hand-over costing up to the interpreter's 5 ms switch interval: save() blocked
        # 65 ms instead of 8.5 (Llama, 8 layers, CPU; benchmarks/results/design_measurements.md).
        release_copy = tc.hold_staging(self._stager)
        try:
            self._start(state, tmp, commit, writer)
        finally:
            release_copy()

    def _start(
        self, state: dict[str, Any], tmp: Path, commit: Callable[[], None], writer: FileSystemWriter | None
    ) -> None:
        """`dcp.async_save` into `tmp`; the copy's completion and the write are kept for `wait()`."""
        try:
            response = dcp.async_save(
                state,
                storage_writer=writer or FileSystemWriter(str(tmp)),
                planner=tc.caching_save_planner(self._plan_key),
                process_group=self._group,
                async_stager=self._stager,
                no_dist=not is_distributed(),
            )
        except CheckpointException as exc:  # a BaseException: `except Exception` would miss it
            raise RuntimeError(f"DCP async save into {tmp} failed: {exc}") from exc
        # A Future, or AsyncSaveResponse when staging itself is asynchronous ("overlap").
        staging = getattr(response, "staging_completion", None)
        if staging is not None and not staging.done():
            self._staging = staging
            # Parameters and optimizer state change in the next optimizer step, of whichever
            # optimizer (the adapters' and the user's alike): it waits for the copy.
            self._step_hook = register_optimizer_step_pre_hook(self._before_step)
        self._pending = (tmp, cast(Future, getattr(response, "upload_completion", response)), commit)

    def _before_step(self, *_: Any) -> None:
        """The next optimizer step's pre-hook: its kernels wait for the copy on the device where the
        copies are stream-ordered (the host goes on); elsewhere the host waits."""
        if isinstance(self._stager, StreamCopyStager):
            self._remove_step_hook()
            self._stager.order_after_copy()  # `_staging` stays: wait() still collects its outcome
        else:
            self.wait_staged()

    def _remove_step_hook(self) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    def wait_staged(self) -> None:
        """Wait until an "overlap" save's copy of the state exists (then parameters may change).
        The next `optimizer.step()` calls it; not collective."""
        staging, self._staging = self._staging, None
        self._remove_step_hook()
        if staging is not None:
            staging.result()  # an error surfaces again, with the directory, from wait()

    def wait(self) -> None:
        """Wait for the save in flight to finish writing, then commit it (collective)."""
        try:
            self.wait_staged()
        except Exception:  # reported below by the upload future, which depends on the copy
            pass
        if self._pending is None:
            return
        tmp, future, commit = self._pending
        self._pending = None
        try:
            future.result()
        except (CheckpointException, Exception) as exc:
            raise RuntimeError(f"asynchronous DCP save into {tmp} failed: {exc}") from exc
        commit()

    def close(self) -> None:
        """Commit the save in flight, free the CPU staging buffers and forget the cached plan
        (collective)."""
        self.wait()
        tc.drop_plan_cache(self._plan_key)
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def make_saver(mode: bool | str) -> AsyncSaver | None:
    """An `AsyncSaver` for `mode` (True or "overlap"), or None for False (save synchronously)."""
    check_async_save(mode, "async_save")
    return AsyncSaver(mode) if mode else None


def _warn_if_pending(ref: weakref.ref) -> None:
    saver = ref()
    if saver is not None and saver.pending is not None:
        logger.warning(
            "The checkpoint being written into %s was not committed before the process ended, so it is not "
            "loadable: call the saver's wait() (Checkpointer.wait, or the adapter's wait_for_checkpoint) or "
            "fsdp2_strategy.shutdown() at the end of training.",
            saver.pending,
        )


def default_stager(mode: bool | str) -> DefaultStager:
    """DCP's stager: a copy to CPU memory, made before `save()` returns (True); for "overlap", queued
    on a side stream of the accelerator (`StreamCopyStager`) or, without one, made in a background
    thread. Pinned memory and non-blocking copies only with an accelerator (on a CPU-only machine
    they fail)."""
    accel = torch.accelerator.is_available()
    if mode == "overlap" and accel:
        return StreamCopyStager()
    return tc.reusable_stager(
        StagingOptions(
            use_pinned_memory=accel,
            use_shared_memory=False,
            use_async_staging=mode == "overlap",
            use_non_blocking_copy=accel,
        )
    )


def copy_buffers(state: dict[str, Any], models: Mapping[str, nn.Module]) -> None:
    """Replace each model's buffers in its flat state `state[key]` by copies: a forward may change
    them (BatchNorm's running statistics) while an "overlap" save copies the rest."""
    for key, model in models.items():
        flat = state.get(key)
        if not isinstance(flat, dict):
            continue
        for name, _ in model.named_buffers():
            if isinstance(flat.get(name), torch.Tensor):
                flat[name] = flat[name].detach().clone()

"""`Checkpointer`: sharded, atomic, resumable checkpoints with Distributed Checkpoint (DCP).

Layout under `root`:

    step-000100/            committed: DCP shards, `extra.pt`, `checksums.json`, `.metadata` (the commit marker)
    .tmp-step-000200/       a save in progress, or one that crashed; never loaded

Each rank writes only its own shards (no full gather). A save goes into `.tmp-step-N/` and
rank 0 renames it to `step-N/` only after every rank finished writing and `.metadata` exists,
so a crash at any moment leaves at most a `.tmp-*` directory behind: the previous step stays
the latest, and a committed directory is never rewritten (torch's own `dcp.save` into an
existing directory that dies half-way would leave a loadable, mixed checkpoint). `load()`
verifies the files against `checksums.json` first (see `integrity`).
"""

from __future__ import annotations

import functools
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager

from ..config_checks import check_async_save, check_trainable_only
from ..distributed import barrier, log_rank_zero, logger, rank, shutdown
from ..preemption import PREEMPTION_EXIT_CODE, PreemptionWatch
from . import directory as cdir
from .async_save import AsyncSaver, default_stager
from .directory import TMP_PREFIX
from .safe_load import load_small_file
from .state import Models, Optimizers, sharded_state

EXTRA_FILE = "extra.pt"
MODEL_KEY, OPTIM_KEY = "model", "optim"  # top-level keys; DCP flattens them to "model.<name>"


def step_dir_name(step: int) -> str:
    """Directory name of a committed step (`step-000123`)."""
    return f"step-{step:06d}"


class Checkpointer:
    """Save and load sharded model/optimizer state (plus `extra` state) one directory per step.

    Args:
        root: folder holding `step-N/` directories (created on the first save).
        keep_last: after each committed save keep only the newest `keep_last` steps
            (None keeps all). Stale `.tmp-*` directories from crashed saves are removed then too.
        async_save: False (write before `save()` returns), True (write in a background thread,
            `dcp.async_save`; `save()` returns once the state is copied to CPU memory), or
            "overlap" (`save()` returns at once: the copy itself runs in a background thread while
            the next micro-batches run forward and backward, and the next `optimizer.step()` of any
            optimizer waits until it is done; buffers, which a forward may change, are copied before
            `save()` returns). Asynchronous steps are committed by `wait()` or the next
            `save()`/`load()`. In "overlap" mode change no parameter or optimizer state in place
            outside `optimizer.step()` until `wait_staged()` (an EMA update written by hand, say).
            Which when: True on CPU (the copy is a quick memcpy; on shared cores a background
            copy only slows the next step), "overlap" on accelerators (a device-to-host copy on
            its own stream), False when memory for a CPU copy of the state is short.
        save_on_preemption: catch SIGTERM (`PreemptionWatch`) and, at the next
            `exit_if_preempted(step, ...)` (call it once per step, on every rank), finish the save in
            flight, save that step, and exit with `PREEMPTION_EXIT_CODE` (143).
        trainable_only: store only what training changes: parameters that require gradients,
            buffers and the optimizer state, with a fingerprint of the frozen parameters that
            `load()` checks (another base is refused by name). "auto" (default): for PEFT models
            (a LoRA checkpoint is then adapter-sized); True; False (everything). `load()` reads
            either kind whatever this says.

    Every method is collective: call it on every rank, in the same order.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        keep_last: int | None = None,
        async_save: bool | str = False,
        trainable_only: bool | str = "auto",
        save_on_preemption: bool = False,
    ):
        check_trainable_only(trainable_only, "Checkpointer trainable_only")
        check_async_save(async_save, "Checkpointer async_save")
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"Checkpointer keep_last must be None or an int >= 1, got {keep_last!r}.")
        self.root = Path(root)
        self.keep_last = keep_last
        self.async_save = async_save
        self.trainable_only = trainable_only
        self._saver = AsyncSaver(async_save, make_stager=self._make_stager) if async_save else None
        self._watch = PreemptionWatch() if save_on_preemption else None
        self._deletion: threading.Thread | None = None  # rank 0: pruned steps being deleted

    # ------------------------------------------------------------------ queries
    def latest_step(self) -> int | None:
        """Largest committed step (a `step-N/` directory holding `.metadata`), or None."""
        steps = cdir.committed_steps(self.root)
        return max(steps) if steps else None

    def step_path(self, step: int) -> Path:
        """Where step `step` lives once committed."""
        return self.root / step_dir_name(step)

    # ------------------------------------------------------------------ save
    def save(
        self,
        step: int,
        *,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        extra: Any = None,
        on_commit: Callable[[Path], None] | None = None,
    ) -> None:
        """Save `model`/`optimizer` state (sharded) and `extra` as step `step`.

        `extra` is any picklable object (step counters, RNG states, data-loader position);
        rank 0's value is saved and `load()` returns it on every rank (types beyond tensors,
        containers, primitives and NumPy arrays load with `trusted=True` or torch's safe globals). Raises ValueError if
        `step` is already committed. With `async_save` this returns before the write ends.
        `on_commit(step_dir)` runs on every rank once the step is committed: before `save()`
        returns, or for an asynchronous save in `wait()` (which the next `save()` calls).
        """
        self.wait()  # one save in flight at a time; commits the previous one first
        cdir.check_step(step)
        final = self.step_path(step)
        if cdir.is_committed(final):
            raise ValueError(
                f"Checkpoint step {step} already exists at {final}; committed steps are never rewritten. "
                "Save under a new step number, or delete that directory first."
            )
        state = sharded_state(
            *_named(model, optimizer), trainable_only=self.trainable_only
        )  # validates the arguments before touching the disk
        cdir.save_dir(
            final,
            state,
            files={EXTRA_FILE: extra} if extra is not None else None,
            saver=self._saver,
            models={MODEL_KEY: model} if model is not None else {},
            make_writer=self._storage_writer,
            on_commit=functools.partial(self._on_commit, on_commit=on_commit),
        )

    def wait_staged(self) -> None:
        """Wait until an "overlap" save's copy of the state exists (then parameters may change).
        The next `optimizer.step()` calls it; not collective."""
        if self._saver is not None:
            self._saver.wait_staged()

    def wait(self) -> None:
        """Wait for an asynchronous save to finish writing, then commit it (collective)."""
        if self._saver is not None:
            self._saver.wait()

    def exit_if_preempted(
        self,
        step: int,
        *,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        extra: Any = None,
    ) -> None:
        """Collective, once per step with `save_on_preemption=True`: if any rank received SIGTERM,
        finish the save in flight, save `step` (unless it is saved already), commit it and end the
        process with `PREEMPTION_EXIT_CODE` via `f2.shutdown` (never returns then). Costs one
        all-reduce of one number; returns at once without `save_on_preemption`."""
        if self._watch is None or not self._watch.requested():
            return
        self.wait()
        if not cdir.is_committed(self.step_path(step)):
            self.save(step, model=model, optimizer=optimizer, extra=extra)
        self.close()
        log_rank_zero(
            "Preempted: step %d is committed under %s; exiting with %d", step, self.root, PREEMPTION_EXIT_CODE
        )
        shutdown(PREEMPTION_EXIT_CODE)

    def close(self) -> None:
        """Finish a pending save and the deletion of pruned steps; free the CPU staging buffers kept
        between async saves."""
        if self._saver is not None:
            self._saver.close()
        self._join_deletion()
        barrier()  # every rank sees the folder without the deleted steps

    # ------------------------------------------------------------------ load
    def load(
        self,
        *,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        step: int | str = "latest",
        trusted: bool = False,
    ) -> Any:
        """Load step `step` (default: the latest committed) into `model`/`optimizer`; return `extra`.

        Works across world sizes and sharding layouts (DCP reshards on read). Every file is read as
        data: a type beyond tensors, containers, primitives and NumPy arrays (in `extra`, say) is
        refused unless `trusted=True` (a checkpoint you wrote yourself) or admitted with
        `torch.serialization.add_safe_globals`. Raises FileNotFoundError if the step is not committed,
        ValueError if the checkpoint does not match the model (missing, unexpected or differently
        shaped keys are listed), `UntrustedCheckpointError` (a ValueError) for a refused type; the
        model and optimizer are unchanged after any of them.
        """
        self.wait()
        _check_types(model, optimizer)
        if model is None and optimizer is not None:
            raise ValueError(
                "Checkpointer.load(optimizer=...) needs model= too: optimizer state is keyed by parameter names."
            )
        path = cdir.resolve_step(self.root, step)
        others = sorted(s for s, p in cdir.committed_steps(self.root).items() if p != path)
        return load_step_dir(
            path,
            model=model,
            optimizer=optimizer,
            hint=f"Load an earlier step with load(step=N); other committed steps: {others or 'none'}.",
            trusted=trusted,
        )

    # ------------------------------------------------------------------ internals
    def _storage_writer(self, path: Path) -> FileSystemWriter:
        """The DCP writer for one save (a hook: tests override it to crash mid-write)."""
        return FileSystemWriter(str(path))

    def _make_stager(self) -> DefaultStager:
        """DCP's stager for this Checkpointer's mode (see `async_save.default_stager`). A hook: tests
        slow the copy down."""
        return default_stager(self.async_save)

    def _on_commit(self, path: Path, *, on_commit: Callable[[Path], None] | None) -> None:
        """Every rank, once step directory `path` is committed: retention, then the caller's `on_commit`."""
        if rank() == 0:
            try:
                self._apply_retention()
            except OSError as exc:  # pruning is housekeeping: the step itself is committed
                logger.warning("Could not prune old checkpoints under %s: %s", self.root, exc)
        barrier()  # retention done before any rank saves again
        log_rank_zero("Saved checkpoint %s", path)
        if on_commit is not None:
            on_commit(path)

    def _apply_retention(self) -> None:
        """Rank 0: drop committed steps beyond the newest `keep_last`, and stale `.tmp-*` dirs.

        The steps are un-published (renamed) now; deleting their files runs in a background thread,
        off the save's critical path (deleting is a sizeable part of a synchronous save). A crash
        mid-delete leaves a `.tmp-*` directory, never a loadable one, removed by the next save."""
        self._join_deletion()
        if self.keep_last is not None:
            cdir.prune(self.root, self.keep_last, delete=False)
        stale = list(self.root.glob(f"{TMP_PREFIX}*"))  # only one save is in flight, and it just committed
        self._deletion = threading.Thread(target=_delete_trees, args=(stale,), name="fsdp2-prune", daemon=True)
        self._deletion.start()

    def _join_deletion(self) -> None:
        if self._deletion is not None:
            self._deletion.join()
            self._deletion = None


# ---------------------------------------------------------------------- helpers
def _delete_trees(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def _check_types(model: Any, optimizer: Any) -> None:
    """Wrong objects fail here by name instead of deep inside torch's state-dict helpers."""
    if model is not None and not isinstance(model, nn.Module):
        raise ValueError(f"Checkpointer: model= must be an nn.Module, got {type(model).__name__}.")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"Checkpointer: optimizer= must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")


def load_step_dir(
    path: str | os.PathLike,
    *,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    hint: str = "",
    trusted: bool = False,
) -> Any:
    """Collective: load one committed step directory written by `Checkpointer.save`; return its `extra`.

    For a step directory that lives outside a Checkpointer root (a copy a cluster manager such
    as Ray Train stored and hands back). Same checks as `Checkpointer.load` (checksums, files read
    as data unless `trusted`, model compatibility, optimizer state present); `hint` is added to a
    checksum error.
    """
    if model is None and optimizer is not None:
        raise ValueError("load_step_dir(optimizer=...) needs model= too: optimizer state is keyed by parameter names.")
    path = Path(path)
    models, optimizers = _named(model, optimizer)
    cdir.verify_dir(path, hint)
    extra = read_extra(path, trusted=trusted)  # before the model changes: a refused `extra` changes nothing
    cdir.load_dir(path, models, optimizers, trusted=trusted, verify=False)
    log_rank_zero("Loaded checkpoint %s", path)
    return extra


def _named(model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> tuple[Models, Optimizers]:
    """The Checkpointer's top-level keys for what it saves and loads."""
    _check_types(model, optimizer)
    if model is None:
        if optimizer is not None:
            raise ValueError("Checkpointer needs model= with optimizer=: optimizer state is keyed by parameter names.")
        return {}, {}
    return {MODEL_KEY: model}, ({OPTIM_KEY: (model, optimizer)} if optimizer is not None else {})


def read_extra(path: Path, *, trusted: bool = False) -> Any:
    """The `extra` saved in step directory `path` (None if none), read as data unless `trusted`
    (`safe_load.load_small_file`), onto the CPU so that a checkpoint from an accelerator loads anywhere."""
    file = path / EXTRA_FILE
    if not file.is_file():
        return None
    return load_small_file(file, name=file, trusted=trusted)

"""One atomic DCP directory: the save/commit/verify/load primitives behind every checkpoint.

`Checkpointer` (one directory per step) and every trainer adapter (Lightning's
`trainer.save_checkpoint(path)`, Fabric's `fabric.save`, Accelerate's `save_state(dir)` and with
it the Hugging Face Trainer's `checkpoint-N`, Ray's reported steps) write a checkpoint with one
call, `save_dir`, whose steps are:

1. prepare (`prepare_tmp`): rank 0 empties `.tmp-<name>/` beside `final` and writes the small
   non-tensor files (pickled with `torch.save`, fsynced) into it; the caller's `add_files` then
   writes its own (every rank);
2. write (`write_dcp`, or `AsyncSaver.start` in the background): every rank writes its own shards;
   DCP writes `.metadata` last; the caller's `complete` then adds what needs the shards;
3. commit (`commit`): every rank hashes its files into `checksums.json`, then rank 0 publishes
   the directory with one rename. Until that rename nothing at `final` changes, so a crash at
   any moment loses at most the save in progress;
4. the caller's `on_commit(final)`: pruning older checkpoints (`prune`), logging, reporting.

`load_dir(path, models, optimizers)` is the counterpart: it verifies the checksums (every rank
raises the same error together) and checks the models against the checkpoint before DCP reads
anything, so a damaged or mismatched checkpoint never half-loads into a model. `remove_dir` and
`prune` delete checkpoints so that a crash mid-delete never leaves a loadable half.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from ..distributed import barrier, from_rank_zero, is_distributed, logger, rank
from . import integrity as integrity
from . import safe_load
from .async_save import AsyncSaver
from .layout import check_param_groups, layouts_named, saved_group_keys
from .matching import MAX_LISTED, check_compatible, check_same_base, has_prefix, saved_keys
from .state import UNSTEPPED, Models, Optimizers, apply_state, model_state, sharded_state, without_markers
from .trainable import fingerprint_key

METADATA = ".metadata"  # DCP writes it last: the commit marker of a checkpoint directory
STEP_DIR = re.compile(r"^step-(\d+)$")  # `Checkpointer`'s per-step directories
TMP_PREFIX = ".tmp-"


def tmp_path_for(final: Path) -> Path:
    """Where a save destined for `final` is written until it commits."""
    return final.parent / f"{TMP_PREFIX}{final.name}"


def is_committed(path: Path) -> bool:
    """A directory holding DCP's `.metadata` (written last by DCP, then the directory renamed)."""
    return (Path(path) / METADATA).is_file()


def step_dirs(root: Path, pattern: re.Pattern = STEP_DIR) -> dict[int, Path]:
    """Every directory under `root` named by `pattern` (its group 1 is the step), committed or not."""
    steps = {}
    for child in root.iterdir() if root.is_dir() else []:
        match = pattern.match(child.name)
        if match and child.is_dir():
            steps[int(match.group(1))] = child
    return dict(sorted(steps.items()))


def committed_steps(root: Path, pattern: re.Pattern = STEP_DIR) -> dict[int, Path]:
    """The step directories under `root` (`step-N/` by default) that hold `.metadata`, by step."""
    return {step: path for step, path in step_dirs(root, pattern).items() if is_committed(path)}


def resolve_step(root: Path, step: int | str = "latest") -> Path:
    """The committed `step-N/` directory of `step` ("latest": the largest) under `root`.

    Raises FileNotFoundError naming the committed steps; partial saves are never chosen.
    """
    steps = committed_steps(root)
    if step == "latest":
        if not steps:
            raise FileNotFoundError(
                f"No committed checkpoint under {root}: neither it nor any step-N/ folder in it holds {METADATA} "
                "(a save that crashed leaves none and is never loaded). Save one first, or check the path."
            )
        return steps[max(steps)]
    check_step(step)
    if step not in steps:
        raise FileNotFoundError(
            f"Checkpoint step {step} is not committed under {root}; committed steps: {sorted(steps) or 'none'}."
        )
    return steps[step]


def check_step(step: Any) -> None:
    """Raise ValueError unless `step` is an int >= 0."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"Checkpoint step must be an int >= 0 (or 'latest' when loading), got {step!r}.")


# ---------------------------------------------------------------------- save
def prepare_tmp(final: Path, files: Mapping[str, Any] | None = None) -> Path:
    """Collective: rank 0 creates an empty `.tmp-<name>` and writes `files` (name -> object) into it."""
    tmp = tmp_path_for(final)
    if rank() == 0:
        if tmp.exists():
            logger.warning("Removing %s left by an earlier save that did not finish", tmp)
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        for name, value in (files or {}).items():
            write_file(tmp / name, value)
    barrier()  # no rank writes shards into a directory rank 0 may still be deleting
    return tmp


def write_dcp(state: dict, path: Path, writer: FileSystemWriter | None = None) -> None:
    """Collective: every rank writes its shards of `state` into `path` (synchronously)."""
    try:
        with single_process_quiet():
            dcp.save(state, storage_writer=writer or FileSystemWriter(str(path)), no_dist=not is_distributed())
    except CheckpointException as exc:  # a BaseException: `except Exception` would miss it
        raise RuntimeError(f"DCP save into {path} failed: {dcp_failure(exc)}") from exc


def commit(final: Path, *, replace: bool = False) -> None:
    """Collective: checksum the finished `.tmp-<name>` and rename it to `final`.

    `replace=False` refuses to overwrite a committed `final`; `replace=True` swaps it out
    (for names a trainer rewrites, such as Lightning's `last.ckpt`).
    """
    barrier()
    error = integrity.write_checksums(tmp_path_for(final), rank())
    if error is None and rank() == 0:
        try:
            publish(final, replace=replace)
        except Exception as exc:  # reported to every rank below, so none waits forever
            error = f"committing {final} failed: {type(exc).__name__}: {exc}"
    error = from_rank_zero(error)  # also the barrier: every rank sees `final` when this returns
    if error is not None:
        raise RuntimeError(error)


def publish(final: Path, *, replace: bool = False) -> None:
    """Rank 0: the rename that makes a finished save visible at `final`."""
    tmp = tmp_path_for(final)
    if not (tmp / METADATA).is_file():
        raise RuntimeError(f"DCP returned but {tmp / METADATA} is missing; {final} stays as it was")
    if final.exists() or final.is_symlink():
        if is_committed(final) and not replace:
            raise FileExistsError(f"{final} is a committed checkpoint and is never rewritten")
        # Un-publish the old directory with a rename first: `final` then holds either the
        # old checkpoint or the new one, never a mix; only a crash in the instant between the
        # two renames leaves no `final` (the old copy is still beside it, see `trash_path_for`).
        old = unpublish(final) if final.is_dir() and not final.is_symlink() else None
        if old is None:  # a stray file or link where the directory goes
            final.unlink()
        os.replace(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)  # atomic on POSIX: the checkpoint appears complete or not at all
    fsync_dir(final.parent)


def save_dir(
    final: Path,
    state: dict,
    *,
    files: Mapping[str, Any] | None = None,
    add_files: Callable[[Path], None] | None = None,
    complete: Callable[[Path], None] | None = None,
    replace: bool = False,
    saver: AsyncSaver | None = None,
    models: Mapping[str, nn.Module] | None = None,
    make_writer: Callable[[Path], FileSystemWriter] | None = None,
    on_commit: Callable[[Path], None] | None = None,
) -> None:
    """Collective: the one save sequence (module docstring): write `state` (sharded, DCP) and rank
    0's `files` as directory `final`, atomically, then call `on_commit(final)` on every rank.

    Args:
        final: The checkpoint directory to create (or replace, with `replace`).
        state: What DCP writes: every rank's shards.
        files: Rank 0's small files, name -> object (`torch.save`d).
        add_files: Every rank, after prepare: writes the caller's own files into the uncommitted
            directory it is given (covered by the checksums like the rest).
        complete: Every rank, once the shards are written, before the commit: adds what needs
            them (a view onto the shards, consolidated weights).
        replace: Replace a committed `final` (a name a trainer rewrites, e.g. `last.ckpt`);
            otherwise a committed `final` is never rewritten.
        saver: Writes the shards in the background; `final` is committed by `saver.wait()`
            (the next save through the same saver calls it).
        models: The models whose flat state is `state[key]` (with `saver` in "overlap" mode their
            buffers are copied first).
        make_writer: The DCP writer for the uncommitted directory (default `FileSystemWriter`).
        on_commit: Every rank, once `final` is committed (pruning, logging, reporting).
    """
    final = Path(final)

    def commit_and_report() -> None:  # every rank, once all shards are written
        tmp = tmp_path_for(final)
        if complete is not None:
            complete(tmp)
        commit(final, replace=replace)
        if on_commit is not None:
            on_commit(final)

    if saver is not None:
        saver.wait()  # the save in flight may be writing into the same `.tmp-<name>`
    tmp = prepare_tmp(final, files)
    if add_files is not None:
        add_files(tmp)
    writer = make_writer(tmp) if make_writer is not None else None
    if saver is not None:
        saver.start(state, tmp, commit_and_report, writer=writer, models=models)
        return
    write_dcp(state, tmp, writer)
    commit_and_report()


# ---------------------------------------------------------------------- removal (rank 0 only)
def trash_path_for(final: Path) -> Path:
    """Where `unpublish` moves a directory before deleting it (not the `.tmp-<name>` a save uses)."""
    return final.parent / f"{TMP_PREFIX}deleting-{final.name}"


def unpublish(final: Path) -> Path:
    """Rank 0: rename a checkpoint directory out of sight and return where it went.

    Deleting in place could crash half-way and leave a directory that still holds `.metadata`
    but lost shards, i.e. one that looks committed; after the rename nothing is loadable there."""
    trash = trash_path_for(final)
    shutil.rmtree(trash, ignore_errors=True)  # left by a crash during an earlier delete
    os.replace(final, trash)
    return trash


def remove_dir(final: Path) -> None:
    """Rank 0: delete checkpoint directory `final` so that no crash leaves a loadable half."""
    shutil.rmtree(unpublish(Path(final)), ignore_errors=True)


def prune(
    root: Path,
    keep_last: int,
    pattern: re.Pattern = STEP_DIR,
    *,
    protect: Iterable[str | os.PathLike] = (),
    keep_newest: bool = True,
    delete: bool = True,
) -> list[Path]:
    """Rank 0: the one way old checkpoints go. Removes the oldest committed directories under `root`
    named by `pattern` until `keep_last` are left, never one in `protect` nor (`keep_newest`) the
    newest, which may keep more; returns the removed paths, oldest first. Each is un-published
    (renamed, loadable no more) before it is deleted, so a crash mid-delete leaves nothing loadable.
    `delete=False` only un-publishes them (to `trash_path_for(path)`) and leaves the deleting to the
    caller."""
    paths = list(committed_steps(root, pattern).values())
    protected = {Path(p).resolve() for p in protect}
    if keep_newest and paths:
        protected.add(paths[-1].resolve())
    keep = max(keep_last, len(protected))
    doomed: list[Path] = []
    for path in paths:
        if len(paths) - len(doomed) <= keep:
            break
        if path.resolve() not in protected:
            doomed.append(path)
    for path in doomed:
        remove_dir(path) if delete else unpublish(path)
    return doomed


# ---------------------------------------------------------------------- load
def verify_dir(path: Path, hint: str = "") -> None:
    """Collective: raise ValueError on every rank if a file listed in `checksums.json` changed; the
    error ends with `hint`, by default the committed checkpoints beside `path` (`alternatives_hint`)."""
    world = dist.get_world_size() if is_distributed() else 1
    problems = integrity.verify(path, rank(), world)
    if problems:
        raise ValueError(
            f"Checkpoint {path} is damaged and was not loaded (the model is unchanged):\n  "
            + "\n  ".join(problems[:MAX_LISTED])
            + f"\n{hint or alternatives_hint(path)}"
        )


def alternatives_hint(path: Path) -> str:
    """What to load instead of the damaged checkpoint `path`: the committed directories beside it
    (the same parent; a save in progress or un-published is not one), newest first."""
    path = Path(path)
    others = [
        p
        for p in path.parent.iterdir()
        if p.is_dir() and p.name != path.name and not p.name.startswith(TMP_PREFIX) and is_committed(p)
    ]
    if not others:
        return f"No other committed checkpoint is in {path.parent}: load one from elsewhere, or save again."
    newest = sorted(others, key=lambda p: (p.stat().st_mtime, p.name), reverse=True)
    names = ", ".join(p.name for p in newest[:MAX_LISTED]) + (" ..." if len(newest) > MAX_LISTED else "")
    return (
        f"Committed checkpoints beside it in {path.parent}, newest first: {names}. Load one of them "
        "instead: the same load call with its path."
    )


def read_metadata(path: Path, *, trusted: bool = False) -> Metadata:
    """DCP's metadata of a committed directory (tensor names, shapes, dtypes), read as data
    (`safe_load.read_metadata_file`; `trusted`: by the full unpickler).

    Raises:
        FileNotFoundError: no `.metadata`.
        UntrustedCheckpointError: it names a type outside DCP's metadata (not `trusted`).
        ValueError: it is unreadable.
    """
    try:
        return safe_load.read_metadata_file(Path(path) / METADATA, trusted=trusted)
    except (FileNotFoundError, safe_load.UntrustedCheckpointError):
        raise
    except ValueError as exc:  # a truncated or overwritten `.metadata`
        raise ValueError(f"{exc} Load or export an earlier step. {alternatives_hint(Path(path))}") from exc


def load_dcp(state: dict, path: Path, *, trusted: bool = False, checked: dict[str, Any] | None = None) -> None:
    """Collective: fill `state` in place from the DCP files in `path` (resharding as needed), every
    file read as data unless `trusted` (`safe_load`; `checked`: entries `check_byte_entries` read)."""
    reader = safe_load.SafeFileSystemReader(path, trusted=trusted)
    planner = safe_load.SafeLoadPlanner(path, trusted=trusted, checked=checked)
    try:
        with single_process_quiet():
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=not is_distributed())
    except CheckpointException as exc:
        refused = [err for err, _ in exc.failures.values() if isinstance(err, safe_load.UntrustedCheckpointError)]
        if refused:
            raise refused[0] from None
        raise RuntimeError(f"DCP load from {path} failed: {dcp_failure(exc)}") from exc


def dcp_failure(exc: CheckpointException) -> str:
    """The underlying errors of a DCP failure, one line each, by rank (DCP's own text is a traceback)."""
    errors = sorted({f"{type(err).__name__}: {err}" for err, _ in exc.failures.values()})
    return "; ".join(errors) or str(exc).splitlines()[0]


def load_dir(
    path: Path,
    models: Models,
    optimizers: Optimizers | None = None,
    *,
    strict: bool = True,
    hint: str = "",
    trusted: bool = False,
    verify: bool = True,
) -> None:
    """Collective: load the models and optimizers saved under their keys in committed directory `path`.

    The counterpart of `save_dir`. In order: checksums verified (`hint` is added to that error;
    `verify=False`: the caller verified them),
    the metadata and every non-tensor entry read as data (`safe_load`; `trusted`: by the full
    unpickler), every model checked against the checkpoint (missing, unexpected and differently
    shaped keys; `strict=False` loads the keys both sides have), each optimizer's state checked to be
    there, then DCP reads (resharding to this world size) and the state is applied. Raises ValueError
    (`UntrustedCheckpointError` for a refused type) before anything changes.
    """
    path = Path(path)
    if verify:
        verify_dir(path, hint)
    metadata = read_metadata(path, trusted=trusted)
    checked = None if trusted else safe_load.check_byte_entries(path, metadata)
    optimizers = optimizers or {}
    absent = [
        f"no optimizer state under {key!r} in checkpoint (it was saved without that optimizer); load without it"
        for key in optimizers
        if not has_prefix(metadata, key + ".")
    ]
    # A trainable-only checkpoint (its frozen base's fingerprint saved beside it) holds no frozen weights.
    partial = {key for key in models if fingerprint_key(key) in metadata.state_dict_metadata}
    model_states = {key: model_state(model, trainable_only=key in partial) for key, model in models.items()}
    with layouts_named(metadata, model_states):  # every error below names both layouts
        for i, (key, current) in enumerate(model_states.items()):
            check_compatible(metadata, current, key + ".", path, absent if i == 0 else None, strict=strict)
            if not strict:
                saved = saved_keys(metadata, key + ".")
                model_states[key] = {k: v for k, v in current.items() if k in saved}
        if absent and not models:
            raise ValueError(f"Checkpoint {path} does not match:\n  " + "\n  ".join(absent))
        fingerprints = {fingerprint_key(key): "" for key in partial}
        state = {**model_states, **fingerprints, **without_markers(sharded_state({}, optimizers), optimizers)}
        saved_groups = {k: None for key in optimizers for k in saved_group_keys(metadata.state_dict_metadata, key)}
        if saved_groups:  # the parameter names of each saved group: a few small entries
            load_dcp(saved_groups, path, trusted=trusted, checked=checked)
            check_param_groups(path, saved_groups, {key: state[key] for key in optimizers})
        if state:
            load_dcp(state, path, trusted=trusted, checked=checked)
        for key in sorted(partial):
            check_same_base(path, key, state[fingerprint_key(key)], models[key])
        unstepped = frozenset(k for k in optimizers if f"{k}.{UNSTEPPED}" in metadata.state_dict_metadata)
        apply_state(state, models, optimizers, strict=strict, unstepped=unstepped)


# ---------------------------------------------------------------------- small helpers
@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """Without a process group DCP warns "assuming the intent is to save in a single process": it is."""
    with warnings.catch_warnings():
        if not is_distributed():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to", category=UserWarning)
        yield


def write_file(path: Path, value: Any) -> None:
    """`torch.save` made durable: fsynced before `.metadata` can exist."""
    with open(path, "wb") as f:
        torch.save(value, f)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename durable (POSIX); silently skipped where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

"""Committed `Checkpointer` steps reported to Ray Train, and a restarted run resumed from them.

Ray Train keeps the checkpoints of a run in its storage (`RunConfig(storage_path=...)`) and
hands the latest reported one to the train function after a restart (`ray.train.get_checkpoint()`).
Only a committed step directory (`.metadata` present, every rank's shards written) is reported,
so a worker killed during a save leaves an unreported `.tmp-*` directory, never resumed. Rank 0
uploads the whole step directory: every rank wrote its shards into it, so the Checkpointer root
must be on storage all ranks share (one machine, or NFS/Lustre across nodes).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray.train
import torch
from torch import nn

from fsdp2_strategy.checkpoint import Checkpointer, load_step_dir, step_dir_name
from fsdp2_strategy.checkpoint import directory as cdir
from fsdp2_strategy.distributed import barrier, from_rank_zero, rank

__all__ = ["report_dir", "report_step", "resume", "save_and_report"]

METRICS_DIR = ".ray-metrics"  # not a step-N/ name: Checkpointer and retention ignore it


def report_step(checkpointer: Checkpointer, step: int, metrics: Mapping[str, Any] | None = None) -> None:
    """Collective: report committed step `step` of `checkpointer` to Ray with `metrics`.

    Waits for an asynchronous save to commit first; a partial save is never reported. Ray
    stores the copy as `<storage>/<run>/step-N`. Every worker must call it.

    Args:
        checkpointer: The `Checkpointer` that saved the step.
        step: The step to report.
        metrics: The metrics reported with it (None: none).

    Raises:
        ValueError: If step `step` is not committed under `checkpointer.root`.
    """
    checkpointer.wait()
    path = checkpointer.step_path(step)
    if not cdir.is_committed(path):
        raise ValueError(
            f"report_step(step={step}): {path} is not a committed checkpoint (no .metadata); save the step with "
            "checkpointer.save(step, ...) on every rank before reporting it."
        )
    report_dir(path, metrics)


def save_and_report(
    checkpointer: Checkpointer,
    step: int,
    metrics: Mapping[str, Any] | None = None,
    *,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Any = None,
) -> None:
    """Collective: save step `step` with `checkpointer` and report it to Ray once it commits.

    The report happens when the step commits: before this returns, or with an asynchronous
    Checkpointer (`async_save=True` or "overlap") when `checkpointer.wait()` commits it - the next
    save does; call `checkpointer.close()` at the end of the train function for the last one.

    The metrics are also kept beside the step (`<root>/.ray-metrics/step-N.json`, removed with the
    step by `keep_last`), so that `resume` can report the step again with them if Ray lost the
    report (see `resume`).

    Args:
        checkpointer: The `Checkpointer` that saves the step.
        step: The step to save and report.
        metrics: The metrics reported with it (None: none).
        model: Passed to `checkpointer.save`: the sharded model to save.
        optimizer: Passed to `checkpointer.save`: its optimizer.
        extra: Passed to `checkpointer.save`: any picklable object saved with the step (rank 0's;
            `resume` returns it).

    Raises:
        ValueError: If step `step` is already committed, or `step` is not an int >= 0.
    """

    def report(path: Path) -> None:
        if rank() == 0:
            _write_metrics(checkpointer.root, step, metrics)
            _prune_metrics(checkpointer.root)
        report_dir(path, metrics)

    checkpointer.save(step, model=model, optimizer=optimizer, extra=extra, on_commit=report)


def report_dir(path: Path, metrics: Mapping[str, Any] | None) -> None:
    """Collective: report the committed checkpoint directory `path` to Ray with `metrics`. One
    uploader: the directory already holds every rank's shards, and Ray merges what several workers
    report into one folder anyway."""
    checkpoint = ray.train.Checkpoint.from_directory(str(path)) if rank() == 0 else None
    ray.train.report(dict(metrics or {}), checkpoint=checkpoint, checkpoint_dir_name=path.name)


def resume(
    checkpointer: Checkpointer, *, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None
) -> Any:
    """Collective: load the newest committed step into `model`/`optimizer`; return its `extra`.

    The newest of Ray's latest reported checkpoint (`ray.train.get_checkpoint()`) and the latest
    committed step under `checkpointer.root`. They differ when a worker died right after a save:
    Ray registers a report only when its controller next polls the workers, so a report made
    just before a death is lost by Ray itself. Such a step is committed, so it is resumed and
    reported again (with the metrics `save_and_report` kept) instead of being trained twice.

    Args:
        checkpointer: The `Checkpointer` whose root holds the run's steps.
        model: The sharded model to load into (None: not loaded).
        optimizer: Its optimizer, to load into (None: not loaded).

    Returns:
        The `extra` saved with the step loaded, or None (and nothing loaded) on a first start,
        when neither has a checkpoint.

    Raises:
        ValueError: If Ray's checkpoint was not reported by this module (not a `step-N`
            directory) or is damaged, or the checkpoint does not match `model`/`optimizer`.
    """
    checkpoint = ray.train.get_checkpoint()
    reported = _step_of(Path(checkpoint.path)) if checkpoint is not None else None
    local = from_rank_zero(checkpointer.latest_step() if rank() == 0 else None)
    if local is not None and (reported is None or local > reported):
        extra = checkpointer.load(model=model, optimizer=optimizer, step=local)
        report_step(checkpointer, local, _read_metrics(checkpointer.root, local))
    elif checkpoint is not None:
        with checkpoint.as_directory() as directory:
            extra = load_step_dir(
                Path(directory),
                model=model,
                optimizer=optimizer,
                hint="The checkpoint Ray stored is damaged; delete it from the run's storage to "
                "resume from an earlier one.",
            )
    else:
        return None
    if rank() == 0:  # saves the failure interrupted: never loaded, only taking space
        for stale in Path(checkpointer.root).glob(f"{cdir.TMP_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
    barrier()
    return extra


def _step_of(path: Path) -> int:
    match = cdir.STEP_DIR.fullmatch(path.name)
    if match is None:
        raise ValueError(
            f"Ray checkpoint {path} was not reported by fsdp2_strategy.integrations.ray (expected a directory named "
            "step-NNNNNN); report checkpoints with report_step/save_and_report."
        )
    return int(match.group(1))


def _metrics_path(root: Path, step: int) -> Path:
    return Path(root) / METRICS_DIR / f"{step_dir_name(step)}.json"


def _write_metrics(root: Path, step: int, metrics: Mapping[str, Any] | None) -> None:
    """Rank 0: keep the metrics reported with `step` (JSON-able ones; others as their repr)."""
    path = _metrics_path(root, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(metrics or {}), default=repr))


def _prune_metrics(root: Path) -> None:
    """Rank 0: drop the kept metrics of steps no longer committed (removed by `keep_last`)."""
    committed = {path.name for path in cdir.committed_steps(Path(root)).values()}
    for sidecar in (Path(root) / METRICS_DIR).glob("*.json"):
        if sidecar.stem not in committed:
            sidecar.unlink(missing_ok=True)


def _read_metrics(root: Path, step: int) -> dict[str, Any]:
    """The metrics `save_and_report` kept for `step`, or {} (a step saved without it)."""
    path = _metrics_path(root, step)
    return json.loads(path.read_text()) if path.is_file() else {}

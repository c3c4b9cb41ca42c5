"""Committed `Checkpointer` steps reported to Ray Train, and a restarted run resumed from them.

Ray Train keeps the checkpoints of a run in its storage (`RunConfig(storage_path=...)`) and
hands the latest reported one to the train function after a restart (`ray.train.get_checkpoint()`).
Only a committed step directory (`.metadata` present, every rank's shards written) is reported,
so a worker killed during a save leaves an unreported `.tmp-*` directory and Ray resumes from the
step before. Rank 0 uploads the whole step directory: every rank wrote its shards into it, so the
Checkpointer root must be on storage all ranks share (one machine, or NFS/Lustre across nodes).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Mapping

import ray.train
import torch
from torch import nn

from fsdp2_strategy import checkpoint_dir as cdir
from fsdp2_strategy.checkpoint import Checkpointer, load_step_dir
from fsdp2_strategy.distributed import barrier, rank

__all__ = ["report_step", "save_and_report", "resume"]


def report_step(checkpointer: Checkpointer, step: int, metrics: Mapping[str, Any] | None = None) -> None:
    """Collective: report committed step `step` of `checkpointer` to Ray with `metrics`.

    Waits for an asynchronous save to commit first. Raises ValueError if the step is not
    committed (never reports a partial save). Ray stores the copy as `<storage>/<run>/step-N`.
    """
    checkpointer.wait()
    path = checkpointer.step_path(step)
    if not cdir.is_committed(path):
        raise ValueError(
            f"report_step(step={step}): {path} is not a committed checkpoint (no .metadata); save the step with "
            "checkpointer.save(step, ...) on every rank before reporting it."
        )
    # One uploader: the directory already holds every rank's shards, and Ray merges what
    # several workers report into one folder anyway.
    checkpoint = ray.train.Checkpoint.from_directory(str(path)) if rank() == 0 else None
    ray.train.report(dict(metrics or {}), checkpoint=checkpoint, checkpoint_dir_name=path.name)


def save_and_report(checkpointer: Checkpointer, step: int, metrics: Mapping[str, Any] | None = None, *,
                    model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                    extra: Any = None) -> None:
    """Collective: `checkpointer.save(step, ...)`, then `report_step(checkpointer, step, metrics)`."""
    checkpointer.save(step, model=model, optimizer=optimizer, extra=extra)
    report_step(checkpointer, step, metrics)


def resume(checkpointer: Checkpointer, *, model: nn.Module | None = None,
           optimizer: torch.optim.Optimizer | None = None) -> Any:
    """Collective: load Ray's latest reported checkpoint into `model`/`optimizer`; return its `extra`.

    Returns None (and loads nothing) on a first start, when Ray has no checkpoint. Steps in
    `checkpointer.root` newer than the resumed one were committed but never reported (the run
    died between the two): they are removed so the resumed run can save those steps again.
    """
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        path = Path(directory)
        step = _step_of(Path(checkpoint.path))
        extra = load_step_dir(path, model=model, optimizer=optimizer,
                              hint="The checkpoint Ray stored is damaged; delete it from the run's storage to resume from an earlier one.")
    if rank() == 0:
        _drop_unreported(checkpointer.root, after=step)
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


def _drop_unreported(root: Path, *, after: int) -> None:
    """Rank 0: remove committed steps newer than `after` and stale `.tmp-*` saves under `root`."""
    for step, path in cdir.step_dirs(root).items():
        if step > after:
            cdir.remove_dir(path)
    for stale in Path(root).glob(f"{cdir.TMP_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)

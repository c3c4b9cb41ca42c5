"""The Trainer's checkpoints as `FSDP2Accelerator.save_state` directories.

`checkpoint-N/` is written the way every checkpoint of this project is: into `.tmp-checkpoint-N/`,
renamed into place once every rank's DCP shards, `.metadata` and `checksums.json` exist. Besides
what `save_state` writes (model and optimizer shards, RNG, step; `model.safetensors` too with
`FULL_STATE_DICT`) the directory holds the Trainer's own files, written before the commit so the
checksums cover them: `trainer_state.json`, `scheduler.pt`, `rng_state_<rank>.pth`,
`training_args.bin`, the model's `config.json` and the tokenizer.

Only committed directories count: `resume_from_checkpoint=True` picks the newest committed
`checkpoint-N`, and `save_total_limit` deletes the oldest committed ones (never the newest nor the
best) after each save, and at the end of training with `save_total_limit=1` every one but the best,
as the stock Trainer does; each through the core's `prune`, which un-publishes a directory before
deleting it (a crash mid-delete leaves nothing loadable).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

from fsdp2_strategy.checkpoint import directory as cdir
from fsdp2_strategy.checkpoint import load_small_file
from fsdp2_strategy.distributed import barrier, log_rank_zero, rank

from ..accelerate import _compat as accelerate_compat
from . import _compat as compat

CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def committed_checkpoints(run_dir: str | os.PathLike) -> dict[int, Path]:
    """The committed `checkpoint-N/` directories under `run_dir`, by step (partial saves left out).

    Args:
        run_dir: The Trainer's output directory (`TrainingArguments.output_dir`).

    Returns:
        Step -> checkpoint directory, in step order; empty when none is committed.
    """
    return cdir.committed_steps(Path(run_dir), CHECKPOINT_NAME)


def latest_checkpoint(run_dir: str | os.PathLike) -> str:
    """The newest committed `checkpoint-N/` under `run_dir`, for `resume_from_checkpoint`.

    Args:
        run_dir: The Trainer's output directory (`TrainingArguments.output_dir`).

    Returns:
        The checkpoint directory's path.

    Raises:
        ValueError: If no checkpoint under `run_dir` is committed; the message names the partial
            ones.
    """
    found = committed_checkpoints(run_dir)
    if found:
        return str(found[max(found)])
    partial = sorted(p.name for p in cdir.step_dirs(Path(run_dir), CHECKPOINT_NAME).values())
    raise ValueError(
        f"No valid checkpoint found in output directory ({run_dir}): no committed checkpoint-N/ (holding "
        f"DCP's .metadata){f'; not committed: {partial}' if partial else ''}. Train without resume_from_checkpoint."
    )


def check_resumable(path: str | os.PathLike) -> str:
    """`path` if it is a committed FSDP2Trainer checkpoint, else a FileNotFoundError that says why."""
    if not cdir.is_committed(Path(path)):
        raise FileNotFoundError(
            f"resume_from_checkpoint={str(path)!r} is not a committed FSDP2Trainer checkpoint (no DCP .metadata): "
            "it is missing, a save that did not finish, or a stock Trainer checkpoint. Pass another checkpoint-N, "
            "or resume_from_checkpoint=True for the newest committed one."
        )
    return str(path)


def model_key(trainer: Any) -> str:
    """The key `FSDP2Accelerator.save_state` stores the Trainer's model under (`model`, `model_1`, ...)."""
    models = accelerate_compat.registries(trainer.accelerator).models
    index = next((i for i, m in enumerate(models) if m is trainer.model), None)
    if index is None:
        raise RuntimeError("The Trainer's model was not prepared by its accelerator; train or evaluate first.")
    return "model" if index == 0 else f"model_{index}"


def _write_trainer_state(trainer: Any, directory: Path) -> None:
    """`trainer_state.json` with the callbacks' exportable state, as the stock `_save_checkpoint` writes it."""
    state = trainer.state
    for cb in [c for c in trainer.callback_handler.callbacks + [trainer.control] if isinstance(c, ExportableState)]:
        name = cb.__class__.__name__
        if isinstance(state.stateful_callbacks[name], list):
            state.stateful_callbacks[name].append(cb.state())
        else:
            state.stateful_callbacks[name] = cb.state()
    state.save_to_json(str(directory / compat.TRAINER_STATE_NAME))


def _trainer_files_hook(trainer: Any):
    """A `register_save_state_pre_hook` hook writing the Trainer's files into the uncommitted directory."""

    def write(models: list, weights: list, tmp: str) -> None:
        directory = Path(tmp)
        trainer._save_rng_state(tmp)  # every rank: rng_state_<rank>.pth
        if rank() != 0:
            return
        if trainer.lr_scheduler is not None:
            cdir.write_file(directory / compat.SCHEDULER_NAME, trainer.lr_scheduler.state_dict())
        cdir.write_file(directory / compat.TRAINING_ARGS_NAME, trainer.args)
        config = getattr(trainer.accelerator.unwrap_model(trainer.model), "config", None)
        if callable(getattr(config, "save_pretrained", None)):
            config.save_pretrained(tmp)  # with FULL_STATE_DICT's model.safetensors: from_pretrained(checkpoint-N)
        if trainer.processing_class is not None and hasattr(trainer.processing_class, "save_pretrained"):
            trainer.processing_class.save_pretrained(tmp)
        _write_trainer_state(trainer, directory)

    return write


@contextmanager
def _trainer_files(trainer: Any) -> Iterator[None]:
    handle = trainer.accelerator.register_save_state_pre_hook(_trainer_files_hook(trainer))
    try:
        yield
    finally:
        handle.remove()


def _note_best(trainer: Any, run_dir: Path) -> None:
    """Stock bookkeeping: the best step's directory becomes `best_model_checkpoint` (this save included)."""
    state, args = trainer.state, trainer.args
    if args.save_strategy not in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST):
        return
    if not state.best_global_step:
        return
    best = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}"
    if state.best_global_step == state.global_step or cdir.is_committed(best):
        state.best_model_checkpoint = str(best)


def rotate(run_dir: Path, limit: int | None, best: str | None) -> list[Path]:
    """Rank 0: delete the oldest committed checkpoints beyond `limit`, never the newest nor `best`."""
    if not limit or limit <= 0 or rank() != 0:
        return []
    return cdir.prune(run_dir, limit, CHECKPOINT_NAME, protect=[best] if best is not None else [])


def keep_only_best(trainer: Any, trial: Any) -> list[Path]:
    """Collective, at the end of training: what the stock Trainer then deletes with `shutil.rmtree`
    (with `save_total_limit=1` and a best checkpoint, every committed checkpoint but the best), done
    first and crash-safely by rank 0, so the stock loop finds nothing left to delete."""
    args, best = trainer.args, trainer.state.best_model_checkpoint
    if best is None or args.save_total_limit != 1:
        return []
    trainer.accelerator.wait_for_checkpoint()  # a save still in flight is committed (and counted) first
    removed = []
    if args.should_save:
        run_dir = Path(trainer._get_output_dir(trial=trial))
        removed = cdir.prune(run_dir, 1, CHECKPOINT_NAME, protect=[best], keep_newest=False)
        if removed:
            log_rank_zero("Deleted checkpoints other than the best (save_total_limit=1): %s", _names(removed))
    barrier()
    return removed


def _names(paths: list[Path]) -> str:
    return ", ".join(p.name for p in paths)


def save_checkpoint(trainer: Any, trial: Any) -> str:
    """The Trainer's `_save_checkpoint`: one committed `checkpoint-<global_step>/`, then rotation. Collective."""
    if trainer.hp_search_backend is None and trial is None:
        trainer.store_flos()
    run_dir = Path(trainer._get_output_dir(trial=trial))
    path = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    _note_best(trainer, run_dir)
    with _trainer_files(trainer):
        trainer.accelerator.save_state(str(path))
    if trainer.args.push_to_hub:
        trainer.accelerator.wait_for_checkpoint()  # push what is committed
        trainer._push_from_checkpoint(str(path))
    removed = rotate(run_dir, trainer.args.save_total_limit, trainer.state.best_model_checkpoint)
    if removed:
        log_rank_zero("Deleted older checkpoints (save_total_limit): %s", _names(removed))
    barrier()
    return str(path)


def read_scheduler(checkpoint: str) -> dict | None:
    """The state in `scheduler.pt` (None if absent), read as data: `f2.UntrustedCheckpointError` for a
    type the reader does not admit (`torch.serialization.add_safe_globals` admits one)."""
    path = Path(checkpoint) / compat.SCHEDULER_NAME
    return load_small_file(path, name=path) if path.is_file() else None


def load_model_weights(trainer: Any, checkpoint: str) -> None:
    """Only the model's weights from a committed checkpoint (for `load_best_model_at_end`). Collective."""
    cdir.load_dir(Path(check_resumable(checkpoint)), {model_key(trainer): trainer.model})
    log_rank_zero("Loaded the model weights of %s", checkpoint)

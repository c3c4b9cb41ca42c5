"""`save_state` / `load_state` for `FSDP2Accelerator`: the core's atomic DCP directory.

One checkpoint is one directory, written the way every checkpoint of this project is
(`fsdp2_strategy.checkpoint.directory`): into `.tmp-<name>/` beside it, then renamed into place
by rank 0 once every rank's shards, DCP's `.metadata` and `checksums.json` exist. Inside:

- DCP shards of each prepared model (`model`, `model_1`, ...) and optimizer (`optimizer`,
  `optimizer_1`, ...): each rank writes only its shards; loading reshards to any world size;
- Accelerate's own files for the state it owns, written by Accelerate's
  `save_accelerator_state` (schedulers, data-loader samplers, `random_states_<rank>.pkl`,
  step, grad scaler) and `save_custom_state` (`register_for_checkpointing` objects);
- with `state_dict_type="full"`, the consolidated weights `model.safetensors` too.

Every function here is collective: all ranks call it.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils.constants import FSDP_MODEL_NAME
from torch import nn

import fsdp2_strategy as f2
from fsdp2_strategy.checkpoint import (
    Models,
    Optimizers,
    load_small_file,
    owning_models,
    sharded_state,
    write_model_view,
)
from fsdp2_strategy.checkpoint import directory as cdir
from fsdp2_strategy.distributed import barrier, from_rank_zero, log_rank_zero, rank

from . import _compat as compat

_AUTO_NAME = re.compile(r"^checkpoint_(\d+)$")


def _key(kind: str, index: int) -> str:
    return kind if index == 0 else f"{kind}_{index}"


def _raw(optimizer: Any) -> torch.optim.Optimizer:
    return optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer


def _owner(optimizer: torch.optim.Optimizer, models: Models) -> nn.Module:
    """The prepared model whose parameters the optimizer updates (DCP keys its state by their names)."""
    owners = owning_models(optimizer, models)
    if len(owners) != 1:
        what = "no prepared model" if not owners else f"{len(owners)} prepared models"
        raise ValueError(
            f"save_state/load_state: {type(optimizer).__name__} updates parameters of {what}; each optimizer must "
            "belong to exactly one model passed to FSDP2Accelerator.prepare (use one optimizer per model)."
        )
    return models[owners[0]]


def _named(acc: Accelerator) -> tuple[Models, Optimizers]:
    """Every prepared model and optimizer under its checkpoint key (`model`, `model_1`, `optimizer`, ...)."""
    prepared = compat.registries(acc)
    models = {_key("model", i): m for i, m in enumerate(prepared.models)}
    optimizers = {}
    for i, wrapped in enumerate(prepared.optimizers):
        opt = _raw(wrapped)
        optimizers[_key("optimizer", i)] = (_owner(opt, models), opt)
    return models, optimizers


def _auto_root(acc: Accelerator) -> Path:
    return Path(acc.project_dir) / "checkpoints"


def _committed_auto(root: Path) -> dict[int, Path]:
    return cdir.committed_steps(root, _AUTO_NAME)


def _prune(acc: Accelerator, root: Path) -> None:
    """Rank 0: keep the newest `keep_last` (or `total_limit`) automatically named checkpoints."""
    limit = acc.fsdp_plugin.keep_last or acc.project_configuration.total_limit
    if limit and rank() == 0:
        cdir.prune(root, limit, _AUTO_NAME)


def save_state(
    acc: Accelerator,
    output_dir: str | os.PathLike | None,
    safe_serialization: bool,
    on_commit: Callable[[Path], None] | None = None,
) -> str:
    """Write the full training state atomically to `output_dir` (or the next automatic name);
    `on_commit(path)` runs on every rank once it is committed."""
    automatic = acc.project_configuration.automatic_checkpoint_naming
    if automatic:
        path = _auto_root(acc) / f"checkpoint_{acc.save_iteration}"
        if cdir.is_committed(path):
            raise ValueError(
                f"Checkpoint directory {path} ({acc.save_iteration}) already exists; committed checkpoints "
                "are never rewritten. Set `accelerator.project_configuration.iteration` to a new number."
            )
    elif output_dir is None:
        raise ValueError("save_state() needs output_dir unless ProjectConfiguration(automatic_checkpoint_naming=True).")
    else:
        path = Path(output_dir)
    path = Path(from_rank_zero(str(path.resolve())))  # one directory, rank 0's spelling
    models, optimizers = _named(acc)
    state = sharded_state(models, optimizers, trainable_only=acc.fsdp2_config.checkpoint_trainable_only)
    # With an asynchronous saver the commit comes with the next save_state/load_state, end_training
    # or f2.shutdown().
    cdir.save_dir(
        path,
        state,
        add_files=functools.partial(_accelerate_files, acc, safe_serialization),
        complete=functools.partial(_add_views, acc, len(models)),
        replace=not automatic,  # an explicit directory is replaced whole, never mixed
        saver=acc._checkpoint_saver,
        models=models,
        on_commit=functools.partial(_after_commit, acc, automatic, on_commit),
    )
    return str(path)


def _accelerate_files(acc: Accelerator, safe_serialization: bool, tmp: Path) -> None:
    """Every rank: Accelerate's own files, registered objects and save-hook files into the uncommitted
    directory (so the commit's checksums cover them)."""
    prepared = compat.registries(acc)
    compat.save_accelerator_state(
        str(tmp),
        [],
        [],
        prepared.schedulers,
        prepared.dataloaders,
        acc.process_index,
        acc.step,
        acc.scaler,
        save_on_each_node=False,
        safe_serialization=safe_serialization,
    )
    for i, obj in enumerate(prepared.custom_objects):
        compat.save_custom_state(obj, str(tmp), i)
    for hook in prepared.save_hooks.values():
        hook(prepared.models, [], str(tmp))
    acc.project_configuration.iteration += 1


def _add_views(acc: Accelerator, n_models: int, tmp: Path) -> None:
    """Every rank, once the shards are written: rank 0 adds Accelerate's per-model views and, when
    asked, the full weights."""
    if rank() != 0:
        return
    # Accelerate's `merge-weights` reads one model per directory, `pytorch_model_fsdp_<i>/` in
    # its own layout: a view onto the shards (no tensor written twice) keeps it working.
    for i in range(n_models):
        write_model_view(tmp, _key("model", i), f"{FSDP_MODEL_NAME}_{i}")
    if acc.fsdp_plugin.full_state_dict:
        # Read back from the shards just written, one file at a time: no rank gathers the model.
        f2.export_full(tmp, tmp)


def _after_commit(acc: Accelerator, automatic: bool, on_commit: Callable[[Path], None] | None, path: Path) -> None:
    """Every rank, once `path` is committed: the pruning of automatic checkpoints, then `on_commit`."""
    if automatic:
        _prune(acc, path.parent)
        barrier()
    log_rank_zero("Saved accelerator state to %s", path)
    if on_commit is not None:
        on_commit(path)


def wait_for_checkpoint(acc: Accelerator) -> None:
    """Collective: commit a `save_state` still being written in the background."""
    if acc._checkpoint_saver is not None:
        acc._checkpoint_saver.wait()


def _custom_state(path: Path, index: int, trusted: bool) -> Any:
    """A `register_for_checkpointing` object's state, read as data unless `trusted` (Accelerate's own
    `load_custom_state` always unpickles any type)."""
    file = path / compat.CUSTOM_STATE_FILE.format(index)
    return load_small_file(file, name=file, trusted=trusted)


def resolve_load_dir(acc: Accelerator, input_dir: str | os.PathLike | None) -> Path:
    """The directory `load_state` reads: `input_dir`, or the newest committed automatic checkpoint."""
    if input_dir is not None:
        path = Path(os.path.expanduser(str(input_dir)))
    elif acc.project_configuration.automatic_checkpoint_naming:
        found = _committed_auto(_auto_root(acc))
        if not found:
            raise FileNotFoundError(
                f"No committed checkpoint_N under {_auto_root(acc)}; partial saves are never loaded."
            )
        path = found[max(found)]
    else:
        raise ValueError("load_state() needs input_dir unless ProjectConfiguration(automatic_checkpoint_naming=True).")
    if not cdir.is_committed(path):
        raise FileNotFoundError(
            f"{path} is not a committed FSDP2Accelerator checkpoint (no DCP .metadata): it is missing, or a save "
            "that did not finish. Load another checkpoint."
        )
    return Path(from_rank_zero(str(path.resolve())))


def load_state(acc: Accelerator, input_dir: str | os.PathLike | None, load_kwargs: dict | None) -> None:
    """Restore everything `save_state` wrote; DCP reshards when the world size changed. Our files and
    the `register_for_checkpointing` states are read as data (`f2.UntrustedCheckpointError` for another
    type, before anything changes) unless `load_kwargs={"weights_only": False}`; Accelerate reads its
    own files (schedulers, RNG states) with `weights_only=True` unless told otherwise the same way."""
    wait_for_checkpoint(acc)
    path = resolve_load_dir(acc, input_dir)
    trusted = (load_kwargs or {}).get("weights_only") is False  # torch's and Accelerate's own switch
    prepared = compat.registries(acc)
    cdir.verify_dir(path)  # checksums before any file is parsed
    custom = [_custom_state(path, i, trusted) for i in range(len(prepared.custom_objects))]
    cdir.load_dir(path, *_named(acc), trusted=trusted, verify=False)
    for hook in prepared.load_hooks.values():
        hook(prepared.models, str(path))
    # RNG states are per rank: after a world-size change a rank without its file keeps its own
    # (Accelerate logs "Could not load random states").
    override = compat.load_accelerator_state(
        str(path),
        [],
        [],
        prepared.schedulers,
        prepared.dataloaders,
        acc.process_index,
        acc.scaler,
        map_location="cpu",
        load_kwargs=load_kwargs,
    )
    if "step" in override:
        acc.step = override["step"]
    for obj, state in zip(prepared.custom_objects, custom):
        obj.load_state_dict(state)
    if acc.project_configuration.automatic_checkpoint_naming:
        # Number the next save after the newest checkpoint (stock Accelerate restarts at 0 and
        # refuses the existing `checkpoint_0` at the next save_state).
        found = _committed_auto(_auto_root(acc))
        if found:
            acc.project_configuration.iteration = max(found) + 1
    log_rank_zero("Loaded accelerator state from %s", path)

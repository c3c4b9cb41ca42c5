"""An FSDP1 checkpoint (torch, Lightning `FSDPStrategy`, Accelerate; sharded or full) -> one committed
step of ours, resumable on any number of ranks (`convert_fsdp1_checkpoint`, the command
`fsdp2-strategy convert-fsdp1`).

FSDP1 already saves torch's optimizer layout (`FSDP.optim_state_dict`: per parameter name its state,
the groups with their hyperparameters), so the conversion is a re-keying: FSDP1's wrapper prefixes
dropped from every name, Lightning's full checkpoint's positions (`rekey_optim_state_dict` to
`PARAM_ID`) turned back into names, and the trainer's scheduler and counters moved into `extra`. The
result is written once, from one process, as a plain DCP checkpoint that DCP reshards on load; each
tensor is read from the source when the writer asks for it (`stream_write`), so a sharded source is
never whole in memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint import MODEL_KEY, OPTIM_KEY, directory, step_dir_name
from ..distributed import logger
from .fsdp1_files import TensorSource, clean_name
from .fsdp1_formats import FSDP1Save, read_fsdp1_save
from .stream_write import Loaders, lazy, write_converted


@dataclass
class ConvertedFSDP1Checkpoint:
    """What `convert_fsdp1_checkpoint` wrote.

    Attributes:
        path: the committed step directory (`<target>/step-<N>`).
        step: its step number.
        source_format: what was read: "torch-sharded", "torch-full", "lightning-sharded",
            "lightning-full" or "accelerate".
        source_world_size: how many ranks wrote a sharded source (None for a full one).
        tensors: model entries carried over (parameters and buffers).
        optimizer_params: parameters carried over with their optimizer state (0 with `weights_only`).
        extra: the keys of `extra` (what `Checkpointer.load` returns).
    """

    path: Path
    step: int
    source_format: str
    source_world_size: int | None
    tensors: int
    optimizer_params: int
    extra: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        world = f" on {self.source_world_size} rank(s)" if self.source_world_size else ""
        state = f"{self.optimizer_params} with optimizer state" if self.optimizer_params else "weights only"
        return (
            f"{self.path}: step {self.step}, from {self.source_format}{world}; {self.tensors} model tensors "
            f"({state}); extra: {', '.join(self.extra)}"
        )


def convert_fsdp1_checkpoint(
    source: str | os.PathLike,
    target_dir: str | os.PathLike,
    *,
    optimizer_file: str | os.PathLike | None = None,
    step: int | None = None,
    model: nn.Module | None = None,
    weights_only: bool = False,
    progress: bool = True,
    trusted: bool = False,
) -> ConvertedFSDP1Checkpoint:
    """Convert an FSDP1 checkpoint into a committed step under `target_dir`.

    Run it in one process (the command line does). Resume with
    `extra = f2.Checkpointer(target_dir).load(model=model, optimizer=optimizer)` on any number of
    ranks, then `scheduler.load_state_dict(extra["lr_scheduler"])` where the source kept one.

    Args:
        source: what FSDP1 wrote: a DCP folder (torch's `SHARDED_STATE_DICT` saved with
            `dcp.save({"model": ..., "optim": FSDP.optim_state_dict(...)})`, or Lightning's sharded
            checkpoint folder with `meta.pt`), Accelerate's `save_state` folder, Lightning's full
            `.ckpt` file, or a full model state dict file (`FULL_STATE_DICT`, with `optimizer_file`).
        target_dir: a `Checkpointer` root; the step is written as `<target_dir>/step-<N>`.
        optimizer_file: for a full model state dict file: the `torch.save`d full `FSDP.optim_state_dict`.
        step: the step number of the result (default: the trainer's counter where it kept one, else
            the optimizer's step count).
        model: the model (on the meta device will do) whose `named_parameters()` order names the
            positions of an optimizer state keyed by position (Lightning's full `.ckpt`). Without it
            positions follow the state dict's order, checked against each state's shape.
        weights_only: write the model state only (no optimizer state).
        progress: show a progress bar (tqdm) while tensors are written.
        trusted: unpickle any type in the source's files (a folder you wrote yourself whose extra
            state holds your own types); by default they are read as data and another type is refused.

    Returns:
        What was written (`ConvertedFSDP1Checkpoint`).

    Raises:
        FileNotFoundError: `source` or `optimizer_file` does not exist.
        UntrustedCheckpointError: a file holds a type not read as data (not `trusted`); nothing is written.
        ValueError: a save this converter cannot read, named by file and key (no model state, optimizer
            state not keyed by parameter, names or shapes that do not match the model state, no optimizer
            state without `weights_only`), or an existing step at the target.
        RuntimeError: called inside a process group of several ranks.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            "convert_fsdp1_checkpoint runs in one process (it writes an unsharded checkpoint that any "
            "world size loads); call it before init_process_group, or use `fsdp2-strategy convert-fsdp1`."
        )
    save = read_fsdp1_save(Path(source), Path(optimizer_file) if optimizer_file is not None else None, trusted=trusted)
    loaders: Loaders = {}
    model_state = _model_entries(save.model, loaders)
    state: dict[str, Any] = {MODEL_KEY: model_state}
    if not weights_only:
        if save.optim is None:
            raise ValueError(
                f"{source} holds no optimizer state ({save.format}); pass the optimizer file "
                "(optimizer_file= / --optimizer-file) or convert with weights_only=True (--weights-only)"
            )
        state[OPTIM_KEY] = _optimizer_entries(save.optim, model_state, loaders, model)
    step = _step(save, state.get(OPTIM_KEY)) if step is None else step
    directory.check_step(step)
    final = Path(target_dir) / step_dir_name(step)
    if directory.is_committed(final):
        raise ValueError(f"{final} already exists (committed steps are never rewritten); pass another step= or target")
    extra = _extra(save, source)
    logger.info("Converting %s (%s) into %s: %d tensors", source, save.format, final, len(loaders))
    write_converted(final, state, extra, loaders, progress)
    optimized = len(state[OPTIM_KEY]["state"]) if OPTIM_KEY in state else 0
    return ConvertedFSDP1Checkpoint(
        final, step, save.format, save.source_world_size, len(model_state), optimized, sorted(extra)
    )


# ---------------------------------------------------------------------- the model
def _model_entries(source: TensorSource, loaders: Loaders) -> dict[str, Any]:
    """The model's flat state under clean names: meta tensors standing in for the source's tensors,
    0-dim tensors (scalar buffers) as they are."""
    state: dict[str, Any] = {}
    for key, entry in source.tensors.items():
        name = clean_name(key)
        state[name] = lazy(loaders, f"{MODEL_KEY}.{name}", entry.shape, entry.load, entry.dtype)
    for key, value in source.values.items():
        if isinstance(value, torch.Tensor):
            state[clean_name(key)] = value.clone()
    if not state:
        raise ValueError(f"{source.where}: the model state holds no tensors")
    return state


# ---------------------------------------------------------------------- the optimizer
def _optimizer_entries(
    source: TensorSource, model_state: dict[str, Any], loaders: Loaders, model: nn.Module | None
) -> dict[str, Any]:
    """torch's optimizer state dict layout (`get_optimizer_state_dict`) under clean parameter names."""
    groups = _param_groups(source)
    per_param = _per_param_keys(source)
    naming = _position_names(source, model_state, per_param, model) if _by_position(groups) else None
    names = {key: naming[key] if naming is not None else clean_name(key) for key in per_param}
    for group in groups:
        group["params"] = [naming[str(p)] if naming is not None else clean_name(p) for p in group["params"]]
    missing = sorted(({p for g in groups for p in g["params"]} | set(names.values())) - set(model_state))
    if missing:
        raise ValueError(
            f"{source.where}: the optimizer's parameters {missing[:5]} are not in the model state "
            f"(which holds e.g. {sorted(model_state)[:5]}): the files come from different models or saves"
        )
    state = {
        names[key]: {
            kind: _state_value(source, f"state.{key}.{kind}", names[key], kind, model_state, loaders) for kind in kinds
        }
        for key, kinds in per_param.items()
    }
    return {"state": state, "param_groups": groups}


def _param_groups(source: TensorSource) -> list[dict[str, Any]]:
    groups: dict[int, dict[str, Any]] = {}
    for key, value in source.values.items():
        if key.startswith("param_groups."):
            index, name = key[len("param_groups.") :].split(".", 1)
            groups.setdefault(int(index), {})[name] = value
    if not groups or any("params" not in g for g in groups.values()):
        raise ValueError(
            f"{source.where}: no optimizer param_groups with 'params' found: not an optimizer state dict "
            "(save it with FSDP.optim_state_dict(model, optimizer))"
        )
    return [groups[i] for i in sorted(groups)]


def _per_param_keys(source: TensorSource) -> dict[str, list[str]]:
    """Parameter key (a name, or a position) -> its state's keys ("exp_avg", "step", ...)."""
    keys: dict[str, list[str]] = {}
    for key in [*source.tensors, *source.values]:
        if key.startswith("state."):
            param, kind = key[len("state.") :].rsplit(".", 1)
            keys.setdefault(param, []).append(kind)
    return keys


def _by_position(groups: list[dict[str, Any]]) -> bool:
    return all(isinstance(p, int) for g in groups for p in g["params"])


def _position_names(
    source: TensorSource, model_state: dict[str, Any], per_param: dict[str, list[str]], model: nn.Module | None
) -> dict[str, str]:
    """Position (as text) -> parameter name, for an optimizer state keyed by position: from `model`'s
    parameters, else the model state's order (checked against each state tensor's shape)."""
    names = [clean_name(n) for n, _ in model.named_parameters()] if model is not None else list(model_state)
    naming = {str(i): name for i, name in enumerate(names)}
    for key in per_param:
        name = naming.get(key)
        shapes = {
            tuple(source.tensors[f"state.{key}.{k}"].shape)
            for k in per_param[key]
            if f"state.{key}.{k}" in source.tensors
        }
        if name is None or name not in model_state or any(s != tuple(model_state[name].shape) for s in shapes):
            raise ValueError(
                f"{source.where}: the optimizer state is keyed by position (Lightning's full checkpoint) and "
                f"position {key} does not match {'parameter ' + repr(name) if name else 'any parameter'} of the "
                "model state (buffers or tied weights change the order): pass the model "
                "(model=, on the meta device / --model package.module:factory) to name the positions"
            )
    return naming


def _state_value(
    source: TensorSource, key: str, name: str, kind: str, model_state: dict[str, Any], loaders: Loaders
) -> Any:
    entry = source.tensors.get(key)
    if entry is None:
        value = source.values[key]
        return value.clone() if isinstance(value, torch.Tensor) else value
    if entry.shape != model_state[name].shape:
        raise ValueError(
            f"{source.where}: optimizer state {key} has shape {tuple(entry.shape)}, but parameter {name!r} has "
            f"{tuple(model_state[name].shape)}: a flattened FSDP1 optimizer state (optimizer.state_dict() of "
            "an FSDP1 model); save it with FSDP.optim_state_dict(model, optimizer) instead"
        )
    return lazy(loaders, f"{OPTIM_KEY}.state.{name}.{kind}", entry.shape, entry.load, entry.dtype)


# ---------------------------------------------------------------------- step and extra
def _step(save: FSDP1Save, optim: dict[str, Any] | None) -> int:
    """The trainer's counter, else the optimizer's step count, else 0."""
    if save.counter is not None:
        return save.counter
    steps = [s["step"] for s in (optim or {}).get("state", {}).values() if "step" in s]
    return int(max(float(s) for s in steps)) if steps else 0


def _extra(save: FSDP1Save, source: Any) -> dict[str, Any]:
    """What `Checkpointer.load` returns: the trainer's scheduler and counters, and where it came from."""
    extra = dict(save.trainer_state)
    if save.counter is not None:
        extra.setdefault("global_step", save.counter)
    extra["fsdp1"] = {"source": str(source), "format": save.format, "source_world_size": save.source_world_size}
    return extra

"""A DeepSpeed ZeRO-1/2/3 checkpoint -> one committed step of ours, resumable on any number of ranks
(`convert_deepspeed_checkpoint`, the command `fsdp2-strategy convert-deepspeed`).

The result is what `Checkpointer(target).load(model=..., optimizer=...)` reads: the fp32 master
weights under "model", torch's optimizer state layout under "optim" (per parameter `exp_avg`,
`exp_avg_sq`, `step`; the groups' hyperparameters), and as `extra` the LR scheduler's state, the
engine's counters and the caller's `client_state`. It is written once, from one process, as a plain
(unsharded) DCP checkpoint; DCP reshards it on load onto whatever mesh the model has.

Memory: the state dict handed to DCP holds meta tensors; each real tensor is assembled from the
memory-mapped rank files when DCP's writer asks for it (`stream_write.StreamingWriter`), written into a file of
its own, and dropped. The peak is about one parameter (its slices and the assembled copy), whatever
the model's size; `tests/core/migrate/test_convert_deepspeed.py` measures it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint import MODEL_KEY, OPTIM_KEY, directory, step_dir_name
from ..distributed import logger
from .stream_write import lazy, write_converted
from .zero_files import DeepSpeedObject, client_state, find_files, resolve_step_dir
from .zero_tensors import ADAM_STATE, Slot, ZeroLayout

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}
"""The torch optimizers a converted checkpoint is laid out for (their hyperparameter names)."""


@dataclass
class ConvertedCheckpoint:
    """What `convert_deepspeed_checkpoint` wrote.

    Attributes:
        path: the committed step directory (`<target>/step-<N>`).
        step: its step number (DeepSpeed's `global_steps` unless given).
        zero_stage: the ZeRO stage of the source.
        source_world_size: how many data-parallel ranks saved the source.
        parameters: trainable parameters carried over, with their optimizer state when `optimizer_state`.
        frozen: frozen parameters and buffers carried over (no optimizer state).
        optimizer_state: whether optimizer state was written.
        extra: the keys of `extra` (what `Checkpointer.load` returns).
    """

    path: Path
    step: int
    zero_stage: int
    source_world_size: int
    parameters: int
    frozen: int
    optimizer_state: bool
    extra: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        state = "with optimizer state" if self.optimizer_state else "weights only"
        return (
            f"{self.path}: step {self.step}, from ZeRO-{self.zero_stage} on {self.source_world_size} rank(s); "
            f"{self.parameters} trainable parameters ({state}), {self.frozen} frozen parameters/buffers; "
            f"extra: {', '.join(self.extra)}"
        )


def convert_deepspeed_checkpoint(
    source_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    *,
    tag: str | None = None,
    step: int | None = None,
    optimizer: str = "AdamW",
    weights_only: bool = False,
    progress: bool = True,
    trusted: bool = False,
) -> ConvertedCheckpoint:
    """Convert a DeepSpeed ZeRO-1/2/3 checkpoint into a committed step under `target_dir`.

    Run it in one process (the command line does), without DeepSpeed installed. Resume with
    `extra = f2.Checkpointer(target_dir).load(model=model, optimizer=optimizer)` on any number of
    ranks, then `scheduler.load_state_dict(extra["lr_scheduler"])`.

    Args:
        source_dir: the folder `engine.save_checkpoint` wrote into (holding `latest` and the tag
            folders), or one tag folder itself.
        target_dir: a `Checkpointer` root; the step is written as `<target_dir>/step-<N>`.
        tag: the tag folder to convert (default: the one `latest` names).
        step: the step number of the result (default: DeepSpeed's `global_steps`).
        optimizer: the torch optimizer class ("AdamW" or "Adam") the run resumes with: its
            hyperparameter names complete the saved groups (those DeepSpeed's own optimizers lack).
        weights_only: write the fp32 weights and buffers only (any optimizer; no optimizer state).
        progress: show a progress bar (tqdm) while tensors are written.
        trusted: unpickle any type in the source's files (a folder you wrote yourself whose extra
            state holds your own types); by default they are read as data and another type is refused.

    Returns:
        What was written (`ConvertedCheckpoint`).

    Raises:
        FileNotFoundError: no such folder or tag, or no `latest` and no `tag`.
        UntrustedCheckpointError: a file holds a type not read as data (not `trusted`); nothing is written.
        ValueError: a save this converter cannot read, named by file and key: tensor or pipeline
            parallel (`mp_rank_01`), ZeRO stage 0, missing rank files, a non-Adam optimizer state, or
            an existing step at the target.
        RuntimeError: called inside a process group of several ranks.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            "convert_deepspeed_checkpoint runs in one process (it writes an unsharded checkpoint that any "
            "world size loads); call it before init_process_group, or use `fsdp2-strategy convert-deepspeed`."
        )
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: expected one of {sorted(OPTIMIZERS)}")
    step_dir = resolve_step_dir(Path(source_dir), tag)
    layout = ZeroLayout(find_files(step_dir), trusted=trusted)
    step = int(layout.model_states.get("global_steps", 0)) if step is None else step
    directory.check_step(step)
    final = Path(target_dir) / step_dir_name(step)
    if directory.is_committed(final):
        raise ValueError(f"{final} already exists (committed steps are never rewritten); pass another step= or target")
    loaders: dict[str, Callable[[], torch.Tensor]] = {}
    model_state, frozen = _model_entries(layout, loaders)
    state: dict[str, Any] = {MODEL_KEY: model_state}
    if not weights_only:
        state[OPTIM_KEY] = _optimizer_entries(layout, loaders, OPTIMIZERS[optimizer])
    extra = _extra(layout, step_dir)
    logger.info(
        "Converting %s (ZeRO-%d, %d ranks) into %s: %d tensors",
        step_dir,
        layout.stage,
        layout.world,
        final,
        len(loaders),
    )
    write_converted(final, state, extra, loaders, progress)
    return ConvertedCheckpoint(
        final, step, layout.stage, layout.world, len(layout.slots), frozen, not weights_only, sorted(extra)
    )


# ---------------------------------------------------------------------- the state written
def _model_entries(layout: ZeroLayout, loaders: dict[str, Callable[[], torch.Tensor]]) -> tuple[dict, int]:
    """The model's flat state (meta tensors standing in for the trainable and frozen parameters, tied
    names included) and how many frozen parameters and buffers it holds."""
    state: dict[str, Any] = {}
    for slot in layout.slots:
        state[slot.name] = lazy(loaders, f"{MODEL_KEY}.{slot.name}", slot.shape, functools.partial(layout.weight, slot))
    frozen, shapes = layout.frozen(), layout.frozen_shapes()
    for name, load in frozen.items():
        state[name] = lazy(loaders, f"{MODEL_KEY}.{name}", shapes[name], load)
    buffers = layout.buffers()
    state.update(buffers)
    for tied, source in layout.shared.items():
        if source in state and tied not in state:
            state[tied] = state[source]
            if f"{MODEL_KEY}.{source}" in loaders:
                loaders[f"{MODEL_KEY}.{tied}"] = loaders[f"{MODEL_KEY}.{source}"]
    return state, len(frozen) + len(buffers)


def _optimizer_entries(
    layout: ZeroLayout, loaders: dict[str, Callable[[], torch.Tensor]], optimizer: Callable[..., torch.optim.Optimizer]
) -> dict[str, Any]:
    """torch's optimizer state dict layout (`get_optimizer_state_dict`): per parameter name its state,
    and the groups with their hyperparameters and parameter names."""
    kinds = layout.state_keys()
    hyper = layout.param_groups()
    defaults = _defaults(optimizer)
    per_param: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for g, group_kinds in kinds.items():
        _check_adam(layout, g, group_kinds, hyper[g])
        names = [s.name for s in layout.slots if s.group == g]
        for slot in (s for s in layout.slots if s.group == g):
            per_param[slot.name] = _param_state(layout, loaders, slot, group_kinds, hyper[g])
        group = {**defaults, **_torch_hyper(hyper[g]), "params": names}
        if groups and layout.stage == 3 and _same_hyper(groups[-1], group):
            groups[-1]["params"] += names  # ZeRO-3 cuts one torch group into sub-groups
        else:
            groups.append(group)
    return {"state": per_param, "param_groups": groups}


def _param_state(
    layout: ZeroLayout,
    loaders: dict[str, Callable[[], torch.Tensor]],
    slot: Slot,
    kinds: dict[str, str],
    hyper: dict[str, Any],
) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for key, kind in kinds.items():
        fqn = f"{OPTIM_KEY}.state.{slot.name}.{key}"
        if kind == "flat":
            state[key] = lazy(loaders, fqn, slot.shape, functools.partial(layout.state_value, slot, key))
        elif key == "step":  # torch keeps it as a float32 scalar tensor per parameter
            state[key] = torch.tensor(float(layout.group_scalar(slot.group, key)), dtype=torch.float32)
        else:
            state[key] = layout.group_scalar(slot.group, key)
    if "step" not in state and "step" in hyper:  # DeepSpeed's FusedAdam counts steps in the group
        state["step"] = torch.tensor(float(hyper["step"]), dtype=torch.float32)
    return state


def _check_adam(layout: ZeroLayout, group: int, kinds: dict[str, str], hyper: dict[str, Any]) -> None:
    path = layout.files.optim_files[0]
    if not kinds:
        raise ValueError(
            f"{path}: the optimizer holds no state for parameter group {group} (it never stepped); "
            "convert with weights_only=True (--weights-only)"
        )
    missing = [k for k in ADAM_STATE if kinds.get(k) != "flat"]
    if missing:
        raise ValueError(
            f"{path}: the optimizer state of parameter group {group} holds {sorted(kinds)}, not Adam/AdamW's "
            f"{list(ADAM_STATE)} (missing {missing}): only Adam-like optimizer state is converted. Convert with "
            "weights_only=True (--weights-only) and start the optimizer afresh."
        )
    if hyper.get("bias_correction", True) is False:
        raise ValueError(f"{path}: group {group} trained without bias_correction, which torch's Adam/AdamW lack")


def _defaults(optimizer: Callable[..., torch.optim.Optimizer]) -> dict[str, Any]:
    """The hyperparameters a fresh torch `optimizer` group holds (names and default values)."""
    group = optimizer([torch.zeros(1, requires_grad=True)]).param_groups[0]
    return {k: v for k, v in group.items() if k != "params"}


def _torch_hyper(hyper: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's group hyperparameters under torch's names (FusedAdam's `adam_w_mode`)."""
    out = {k: v for k, v in hyper.items() if k not in ("step", "bias_correction", "adam_w_mode")}
    if "adam_w_mode" in hyper:
        out["decoupled_weight_decay"] = bool(hyper["adam_w_mode"])
    if isinstance(out.get("betas"), list):
        out["betas"] = tuple(out["betas"])
    return out


def _same_hyper(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return {k: v for k, v in a.items() if k != "params"} == {k: v for k, v in b.items() if k != "params"}


def _extra(layout: ZeroLayout, step_dir: Path) -> dict[str, Any]:
    """What `Checkpointer.load` returns: the scheduler, the counters, the caller's client state, and
    what DeepSpeed recorded about the run."""
    ms = layout.model_states
    extra = {
        "lr_scheduler": ms.get("lr_scheduler"),
        "global_steps": ms.get("global_steps"),
        "global_samples": ms.get("global_samples"),
        "skipped_steps": ms.get("skipped_steps"),
        "client_state": client_state(ms),
        "deepspeed": {
            "source": str(step_dir),
            "zero_stage": layout.stage,
            "dp_world_size": layout.world,
            "ds_version": ms.get("ds_version"),
            "ds_config": ms.get("ds_config"),
            "data_sampler": ms.get("data_sampler"),
            "random_ltd": ms.get("random_ltd"),
        },
    }
    return _plain(extra)


def _plain(value: Any) -> Any:
    """`value` with DeepSpeed's stand-in objects replaced by their text (they are not importable)."""
    if isinstance(value, DeepSpeedObject):
        return repr(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value

"""Resuming a trainer from a `Checkpointer` step (what the DeepSpeed and FSDP1 converters write).

A trainer's module is often not the model the step was saved from: a LightningModule holds it as an
attribute (`self.model`), so its parameter names are `model.<name>`. `load_into` finds the one
submodule whose state-dict names are exactly the step's, and whose parameters hold every parameter
the optimizer updates, and loads model and optimizer state into it. `resume_counters` reads the step
counters the converters stored in `extra`. The adapters call both from their own resume paths
(Lightning's `fit(ckpt_path=...)`, the Hugging Face Trainer's `train(resume_from_checkpoint=...)`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import directory as cdir
from .checkpointer import EXTRA_FILE, MODEL_KEY, OPTIM_KEY, load_step_dir, read_extra
from .matching import saved_keys

_MARKERS = ("meta.pt", "trainer_state.json")
"""Files of the adapters' own checkpoint layouts (Lightning's `meta.pt`, the HF Trainer's state)."""


def is_checkpointer_step(path: str | os.PathLike) -> bool:
    """Whether `path` is a committed `Checkpointer` step directory (the converters' output): DCP's
    `.metadata`, model state under `MODEL_KEY`, and `extra.pt` or optimizer state under `OPTIM_KEY`;
    not one of the adapters' own layouts."""
    path = Path(path)
    if not cdir.is_committed(path) or any((path / m).exists() for m in _MARKERS):
        return False
    keys = cdir.read_metadata(path).state_dict_metadata
    has = {k.split(".", 1)[0] for k in keys}
    return MODEL_KEY in has and (OPTIM_KEY in has or (path / EXTRA_FILE).is_file())


def resume_counters(extra: Any) -> tuple[int, int]:
    """(global step, epoch) from a converted step's `extra`: DeepSpeed's `global_steps`, the FSDP1
    trainers' `global_step`/`step` and `epoch`; 0 where the source kept none."""
    if not isinstance(extra, dict):
        return 0, 0
    step = next((extra[k] for k in ("global_step", "global_steps", "step") if isinstance(extra.get(k), int)), 0)
    client = extra.get("client_state")
    places: list[dict] = [extra, client] if isinstance(client, dict) else [extra]
    epoch = next((d["epoch"] for d in places if isinstance(d.get("epoch"), int)), 0)
    return int(step), int(epoch)


def step_extra(path: str | os.PathLike) -> Any:
    """A `Checkpointer` step's `extra` (None without one), read alone: the counters before any load."""
    return read_extra(Path(path))


def load_into(path: str | os.PathLike, module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
    """Collective: load `Checkpointer` step `path` into `module`, or into its one submodule the step
    was saved from; return the step's `extra`.

    Raises:
        ValueError: no submodule has exactly the step's names (the closest one's missing and
            unexpected names are listed), or several do (they are named).
    """
    path = Path(path)
    target = _target(path, module, optimizer)
    return load_step_dir(path, model=target, optimizer=optimizer)


def _target(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
    saved = set(saved_keys(cdir.read_metadata(path), MODEL_KEY + "."))
    names = list(module.state_dict(keep_vars=True))
    prefixes = [""] + [f"{n}." for n, _ in module.named_modules() if n]
    by_prefix = {p: {k[len(p) :] for k in names if k.startswith(p)} for p in prefixes}
    fitting = [p for p, keys in by_prefix.items() if keys == saved]
    exact = [p for p in fitting if optimizer is None or _updates_only(optimizer, _sub(module, p))]
    if fitting and not exact:
        raise ValueError(
            f"Checkpoint {path} fits {_names(fitting)} of {type(module).__name__}, but the optimizer also updates "
            "parameters outside it, and the checkpoint holds one model's optimizer state: resume with an optimizer "
            "over that submodule's parameters only."
        )
    if len(exact) == 1:
        return _sub(module, exact[0])
    if exact:
        raise ValueError(
            f"Checkpoint {path} fits several submodules of {type(module).__name__}: "
            f"{_names(exact)}; load it yourself into the one meant, "
            "f2.load_step_dir(path, model=<that submodule>, optimizer=...), before training."
        )
    closest = max(prefixes, key=lambda p: len(by_prefix[p] & saved))
    missing, unexpected = sorted(saved - by_prefix[closest]), sorted(by_prefix[closest] - saved)
    raise ValueError(
        f"Checkpoint {path} (a Checkpointer step) matches no submodule of {type(module).__name__} whose "
        f"state-dict names are the checkpoint's. Closest: {closest.rstrip('.') or '<root>'}, "
        f"missing in the model: {_few(missing)}; not in the checkpoint: {_few(unexpected)}. Build the model "
        "the checkpoint was converted from (the same parameter names)."
    )


def _sub(module: nn.Module, prefix: str) -> nn.Module:
    return module.get_submodule(prefix.rstrip(".")) if prefix else module


def _updates_only(optimizer: torch.optim.Optimizer, module: nn.Module) -> bool:
    """Whether every parameter `optimizer` updates belongs to `module` (its state is keyed by their names)."""
    owned = {id(p) for p in module.parameters()}
    return all(id(p) in owned for group in optimizer.param_groups for p in group["params"])


def _names(prefixes: list[str]) -> str:
    return ", ".join(p.rstrip(".") or "<root>" for p in prefixes)


def _few(names: list[str]) -> str:
    return (", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")) or "none"

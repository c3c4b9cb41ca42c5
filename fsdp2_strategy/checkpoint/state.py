"""Models and optimizers <-> the sharded state dict a checkpoint directory holds.

Every front door (`Checkpointer`, Lightning's `save_checkpoint`, Accelerate's `save_state`) names
its models and optimizers by top-level key ("model", "optim"; "state_dict", "optimizer_0";
"model", "optimizer", ...) and builds the state to save or load through `sharded_state`, so all
three get the same torch calls and the same fix below.

An optimizer that never stepped: torch's `get_optimizer_state_dict` initialises its state with
a real `step()` on zero gradients (lr set to 0), so after a save before the first step, Adam's
`step` counter is one ahead and training diverges from a run that did not save.
`optimizer_state_dict` lets torch build complete state (so every checkpoint has the same keys),
then empties the live optimizer again and marks the saved state `UNSTEPPED`; loading such a
checkpoint leaves the optimizer without state, exactly as it was when saved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..shard import quantised_param_names
from ..train import reshard
from .peft import peft_description, peft_key, peft_models
from .trainable import (
    fingerprint_key,
    fingerprint_text,
    frozen_names,
    saves_trainable_only,
    trainable_keys,
)

UNSTEPPED = "unstepped"
"""Key inside a saved optimizer state: present (True) when that optimizer had never stepped."""

Models = Mapping[str, nn.Module]
"""Top-level checkpoint key -> model."""
Optimizers = Mapping[str, tuple[nn.Module, torch.optim.Optimizer]]
"""Top-level checkpoint key -> (the model whose parameters it updates, optimizer)."""


@contextlib.contextmanager
def unstepped_kept(optimizer: torch.optim.Optimizer) -> Iterator[bool]:
    """Around a torch call that may initialise `optimizer`'s state with a zero-lr step: afterwards an
    optimizer that had no state has none again, and its gradients are as they were. Yields whether
    it had no state. Gradients are hidden during the call so torch initialises every time (torch
    skips initialising when any gradient exists, which would leave the saved state incomplete)."""
    if optimizer.state:
        yield False
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield True
    finally:
        optimizer.state.clear()
        for p, grad in zip(params, grads):
            p.grad = grad


def optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, options: StateDictOptions | None = None
) -> dict[str, Any]:
    """torch's `get_optimizer_state_dict`, without changing an optimizer that never stepped."""
    with unstepped_kept(optimizer) as unstepped:
        state: dict[str, Any] = dict(get_optimizer_state_dict(model, optimizer, options=options))
    if unstepped:
        state[UNSTEPPED] = True
    return state


def owning_models(optimizer: torch.optim.Optimizer, models: Mapping[str, nn.Module]) -> list[str]:
    """The keys of `models` whose parameters `optimizer` updates, in `models`' order (for pairing
    each optimizer with its model in an `Optimizers` mapping)."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [key for key, model in models.items() if any(id(p) in params for p in model.parameters())]


def model_state(model: nn.Module, *, trainable_only: bool = False) -> dict[str, Any]:
    """torch's `get_model_state_dict` (each rank's shards) without the quantised parameters that
    `shard_model` kept whole: they are frozen and come from the pretrained weights the model is
    built from (bitsandbytes' own state-dict entries beside them, `<name>.absmax` and the like,
    could not be loaded back into a sharded model). `trainable_only` also leaves out every frozen
    parameter (see `trainable`)."""
    state = get_model_state_dict(model)
    quantised = quantised_param_names(model)
    if quantised:
        state = {k: v for k, v in state.items() if not _under(k, quantised)}
    if trainable_only:
        state = {k: state[k] for k in trainable_keys(model, list(state))}
    return state


def _under(key: str, names: set[str]) -> bool:
    return any(key == n or key.startswith(n + ".") for n in names)


def sharded_state(
    models: Models, optimizers: Optimizers | None = None, *, trainable_only: Any = "auto"
) -> dict[str, Any]:
    """`{key: model or optimizer state}` with each rank's shards (DTensors), nothing gathered.

    Groups a forward-only pass left gathered are resharded first (`train.reshard`): every front
    door (Checkpointer, Fabric, Accelerate) saves from outside a step, and the model it leaves
    behind holds only shards. `trainable_only` ("auto": for PEFT models, True, False) leaves the
    frozen parameters out and adds their fingerprint under `frozen_base.<key>` (see `trainable`)."""
    reshard(*models.values())
    state: dict[str, Any] = {}
    for key, model in models.items():
        state.update(model_entries(key, model, saves_trainable_only(model, trainable_only)))
    for key, (model, optimizer) in (optimizers or {}).items():
        state[key] = optimizer_state_dict(model, optimizer)
    return state


def model_entries(key: str, model: nn.Module, trainable_only: bool) -> dict[str, Any]:
    """Collective: the checkpoint entries of one model: its state under `key` and its `side_entries`."""
    return {key: model_state(model, trainable_only=trainable_only), **side_entries(key, model, trainable_only)}


def side_entries(key: str, model: nn.Module, trainable_only: bool) -> dict[str, Any]:
    """Collective: what a checkpoint stores beside a model's state: the frozen base's fingerprint
    (trainable-only saves; see `trainable`) and a PEFT model's adapter description (see `peft`)."""
    entries: dict[str, Any] = {}
    if trainable_only:
        entries[fingerprint_key(key)] = fingerprint_text(model)
    if peft_models(model):  # adapters injected without a PeftModel have no config to export
        entries[peft_key(key)] = peft_description(model)
    return entries


def without_markers(state: dict[str, Any], optimizers: Optimizers | None) -> dict[str, Any]:
    """`state` minus the live optimizers' `UNSTEPPED` marks (what to request from a checkpoint,
    which holds the mark only if the optimizer it saved had not stepped)."""
    for key in optimizers or {}:
        state[key].pop(UNSTEPPED, None)
    return state


def apply_state(
    state: Mapping[str, Any],
    models: Models,
    optimizers: Optimizers | None = None,
    *,
    strict: bool = True,
    unstepped: frozenset[str] = frozenset(),
) -> None:
    """Copy loaded `state` into the live models and optimizers; the optimizers under `unstepped`
    keys end without state (as saved)."""
    for key, model in models.items():
        # Quantised weights are never stored, frozen ones not in a trainable-only checkpoint.
        expected_absent = quantised_param_names(model)
        if fingerprint_key(key) in state:
            expected_absent |= set(frozen_names(model))
        if not expected_absent:
            set_model_state_dict(model, state[key], options=StateDictOptions(strict=strict))
            continue
        result = set_model_state_dict(model, state[key], options=StateDictOptions(strict=False))
        missing = [k for k in result.missing_keys if not _under(k, expected_absent)]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(
                f"Loading {key!r}: missing keys {missing}, unexpected keys {list(result.unexpected_keys)} "
                "(quantised weights, and frozen ones in a trainable-only checkpoint, are not expected)."
            )
    for key, (model, optimizer) in (optimizers or {}).items():
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state[key])
        if key in unstepped:
            optimizer.state.clear()

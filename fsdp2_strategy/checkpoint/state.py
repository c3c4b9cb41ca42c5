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


def model_state(model: nn.Module) -> dict[str, Any]:
    """torch's `get_model_state_dict` (each rank's shards) without the quantised parameters that
    `shard_model` kept whole: they are frozen and come from the pretrained weights the model is
    built from (bitsandbytes' own state-dict entries beside them, `<name>.absmax` and the like,
    could not be loaded back into a sharded model)."""
    state = get_model_state_dict(model)
    quantised = quantised_param_names(model)
    return {k: v for k, v in state.items() if not _under(k, quantised)} if quantised else state


def _under(key: str, names: set[str]) -> bool:
    return any(key == n or key.startswith(n + ".") for n in names)


def sharded_state(models: Models, optimizers: Optimizers | None = None) -> dict[str, Any]:
    """`{key: model or optimizer state}` with each rank's shards (DTensors), nothing gathered.

    Groups a forward-only pass left gathered are resharded first (`train.reshard`): every front
    door (Checkpointer, Fabric, Accelerate) saves from outside a step, and the model it leaves
    behind holds only shards."""
    reshard(*models.values())
    state: dict[str, Any] = {key: model_state(model) for key, model in models.items()}
    for key, (model, optimizer) in (optimizers or {}).items():
        state[key] = optimizer_state_dict(model, optimizer)
    return state


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
        quantised = quantised_param_names(model)
        if not quantised:
            set_model_state_dict(model, state[key], options=StateDictOptions(strict=strict))
            continue
        # Quantised weights are not in checkpoints (`model_state`): strict about everything else.
        result = set_model_state_dict(model, state[key], options=StateDictOptions(strict=False))
        missing = [k for k in result.missing_keys if not _under(k, quantised)]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(
                f"Loading {key!r}: missing keys {missing}, unexpected keys {list(result.unexpected_keys)} "
                "(quantised weights are not stored and not expected)."
            )
    for key, (model, optimizer) in (optimizers or {}).items():
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state[key])
        if key in unstepped:
            optimizer.state.clear()

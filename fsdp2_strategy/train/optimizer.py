"""Optimizers built before `shard_model`, or while FSDP had parameters gathered: refused at their
first step, or pointed at the sharded parameters.

`shard_model` replaces every parameter with a new DTensor parameter, so an optimizer created
earlier holds objects that no longer receive gradients (`check_optimizer` refuses it at its
first step, through a global optimizer pre-step hook installed once). Trainers whose users build the optimizer first (Accelerate's
`prepare(model, optimizer)`) rebind it instead: parameters are matched by their qualified
name before and after sharding, which also holds for tied weights (one name, one parameter).

An optimizer built after a forward that no backward followed (evaluate, then train) holds FSDP's
gathered copies of the root's and the last block's parameters, which FSDP keeps gathered until the
next backward. The same hook points it at their sharded parameters at its first step, before it has
state: that order is what people write, and it then trains exactly as if built before the forward.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import _torch_compat as tc

logger = logging.getLogger(__name__)


def parameters_by_name(model: nn.Module) -> dict[str, nn.Parameter]:
    """The model's parameters by qualified name (tied parameters once): take it before sharding."""
    return dict(model.named_parameters())


def rebind_optimizer(optimizer: torch.optim.Optimizer, before: Mapping[str, nn.Parameter], model: nn.Module) -> int:
    """Replace, in `optimizer`, each parameter of `before` by the parameter of the same name in
    `model` now; returns how many were replaced (0 for an optimizer of another model).

    Raises ValueError if the optimizer already holds state for a replaced parameter (that
    state has the unsharded shape: step the optimizer only after sharding), or if a name
    it uses disappeared from the model.
    """
    after = dict(model.named_parameters())
    names = {id(p): n for n, p in before.items()}
    replaced = 0
    for group in optimizer.param_groups:
        params = group["params"]
        for i, old in enumerate(params):
            name = names.get(id(old))
            if name is None:
                continue  # not a parameter of this model
            new = after.get(name)
            if new is None:
                raise ValueError(
                    f"{type(optimizer).__name__} holds parameter {name!r}, which sharding removed from "
                    f"{type(model).__name__}; build the optimizer after sharding from model.parameters()."
                )
            if new is old:
                continue
            if optimizer.state.get(old):
                raise ValueError(
                    f"{type(optimizer).__name__} already has state for {name!r} (it stepped, or loaded a state dict, "
                    "before sharding); that state is unsharded. Shard first, then step or load optimizer state."
                )
            params[i] = new
            replaced += 1
    return replaced


# --------------------------------------------------------------------------- optimizer check
_REPLACED = "_fsdp2_replaced_by_sharding"
_checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_sharded_models: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_hook_handle = None


def mark_replaced_params(before: list[nn.Parameter], model: nn.Module) -> None:
    """Mark parameters that sharding replaced, so an optimizer still holding them is caught."""
    current = {id(p) for p in model.parameters()}
    for p in before:
        if id(p) not in current:
            setattr(p, _REPLACED, True)
    _sharded_models.add(model)
    _install_optimizer_check()


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise if `optimizer` holds parameters that `shard_model` replaced (it was built too early), or
    the gathered copies FSDP swaps in during a forward (it was built while they were gathered).

    The same check runs by itself at each optimizer's first step, once `shard_model` has run.

    Args:
        optimizer: The optimizer to check.

    Raises:
        ValueError: If `optimizer` was created before `shard_model()` and holds the original,
            unsharded parameters, which no longer receive gradients; or if it holds FSDP's gathered
            copies of parameters (built while they were gathered) with state of their own (at its first
            step, copies without state are pointed at their sharded parameters before this check).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(getattr(p, _REPLACED, False) for p in params):
        raise ValueError(
            f"{type(optimizer).__name__} was created before shard_model(): it holds the original, "
            "unsharded parameters, which no longer receive gradients. Create the optimizer after "
            "shard_model(model), from model.parameters()."
        )
    gathered = set().union(*(tc.gathered_param_ids(m) for m in list(_sharded_models)))
    if any(id(p) in gathered for p in params):
        raise ValueError(
            f"{type(optimizer).__name__} holds gathered copies of sharded parameters: it was built while FSDP "
            "had them gathered (after a forward that no backward followed, such as an evaluation: the root and "
            "the last block stay gathered until the next backward), and its steps would update copies that the "
            "next gather overwrites. At its first step an optimizer without state for them is pointed at the "
            "sharded parameters; one with state (loaded before its first step) cannot be: call f2.reshard(model) "
            "before building the optimizer, or build it first."
        )


def point_at_shards(optimizer: torch.optim.Optimizer) -> int:
    """Replace, in `optimizer`, each gathered copy of a sharded parameter (held since it was built
    while FSDP had the parameter gathered) that has no optimizer state yet by its sharded parameter;
    returns how many were replaced."""
    shards: dict[int, nn.Parameter] = {}
    for model in list(_sharded_models):
        shards.update(tc.sharded_params_by_gathered_id(model))
    replaced = 0
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            sharded = shards.get(id(p))
            if sharded is not None and not optimizer.state.get(p):
                params[i] = sharded
                replaced += 1
    if replaced:
        logger.info(
            "%s was built while FSDP had %d parameters gathered (a forward that no backward followed): "
            "it now holds their sharded parameters.",
            type(optimizer).__name__,
            replaced,
        )
    return replaced


def _optimizer_pre_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    # Checked once per optimizer, at its first step: later steps cost nothing.
    if optimizer in _checked:
        return
    point_at_shards(optimizer)
    check_optimizer(optimizer)
    _checked.add(optimizer)


def _install_optimizer_check() -> None:
    global _hook_handle
    if _hook_handle is None:
        _hook_handle = register_optimizer_step_pre_hook(_optimizer_pre_step)

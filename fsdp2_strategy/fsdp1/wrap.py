"""FSDP1 auto-wrap policies, run the way FSDP1 runs them, resolved to module names.

FSDP1 accepts three kinds of `auto_wrap_policy`:
- `ModuleWrapPolicy({Block})`: wrap every module of those classes;
- another `torch.distributed.fsdp.wrap._Policy` (e.g. `CustomPolicy`): asked once for the
  whole model;
- a callable `(module, recurse, nonwrapped_numel) -> bool` such as
  `functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})` or one
  written to the older signature `(module, recurse, unwrapped_params, ...)`.

Callables are called positionally (the third parameter's name changed between torch
releases) and follow FSDP1's `_recursive_wrap`: `recurse=True` asks "look inside this
module?" (False stops the descent), then `recurse=False` asks "wrap it?" with the
parameters its wrapped descendants did not already take. The root is never asked to wrap:
it is always a group of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from .. import _torch_compat as tc


def policy_groups(model: nn.Module, policy: Any, ignored: list[str]) -> list[str]:
    """Qualified names of the submodules FSDP1's `policy` wraps, in module order.

    `ignored` holds the qualified names of ignored modules: neither asked nor counted, as in
    FSDP1 (their parameters do not count towards `nonwrapped_numel`).
    """
    ignored_modules = {model.get_submodule(n) for n in ignored}
    if isinstance(policy, ModuleWrapPolicy):
        classes = tc.wrap_policy_classes(policy)
        chosen = [n for n, m in model.named_modules() if n and isinstance(m, classes)]
    elif isinstance(policy, tc.WrapPolicy):
        chosen = _run_policy_object(model, policy, ignored_modules)
    elif callable(policy):
        chosen = _recursive_wrap(model, policy, ignored_modules)
    else:
        raise ValueError(
            f"auto_wrap_policy={policy!r} is not an FSDP1 policy; pass ModuleWrapPolicy({{Block}}), "
            "functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}) or a callable "
            "(module, recurse, nonwrapped_numel) -> bool."
        )
    inside_ignored = {n for n in chosen for i in ignored if n == i or n.startswith(i + ".")}
    return [n for n in chosen if n not in inside_ignored]


def _run_policy_object(model: nn.Module, policy: Any, ignored_modules: set[nn.Module]) -> list[str]:
    targets = tc.run_wrap_policy(policy, model, ignored_modules)
    with_kwargs = [type(m).__name__ for m, kwargs in targets.items() if kwargs]
    if with_kwargs:
        raise ValueError(
            f"auto_wrap_policy={type(policy).__name__} returns per-module FSDP kwargs (for {sorted(set(with_kwargs))}); "
            "express per-module settings with f2.shard_model(model, FSDP2Config(module_overrides={glob: {...}})) instead."
        )
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(m)] for m in model.modules() if m in targets and names[id(m)]]


def _recursive_wrap(model: nn.Module, policy: Callable[..., bool], ignored_modules: set[nn.Module]) -> list[str]:
    """FSDP1's `_recursive_wrap` (only_wrap_children=True for the root), returning names."""
    ignored_params = {id(p) for m in ignored_modules for p in m.parameters()}
    chosen: list[str] = []

    def numel(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters() if id(p) not in ignored_params)

    def visit(module: nn.Module, name: str) -> int:
        """Returns the parameter count this subtree's wrapped modules took."""
        nonwrapped = numel(module)
        if not policy(module, True, nonwrapped):
            return 0
        wrapped = 0
        for child_name, child in module.named_children():
            if child in ignored_modules:
                continue
            wrapped += visit(child, f"{name}.{child_name}" if name else child_name)
        if name and policy(module, False, nonwrapped - wrapped):
            chosen.append(name)
            return nonwrapped
        return wrapped

    visit(model, "")
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(chosen, key=order.__getitem__)

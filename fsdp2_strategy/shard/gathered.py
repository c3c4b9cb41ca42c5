"""`gathered(model)`: every FSDP group gathered once and kept so, for generation.

Outside it, every forward of a sharded model all-gathers each group again and frees it after: one
all-gather per group per generated token, which is what makes generation on a sharded model slow
(and every rank must then run the same number of forwards). Inside it, the groups are gathered once,
all their all-gathers started together, and stay gathered for every forward, so decoding runs no
collective at all; on exit each group's own reshard choices come back and every group is resharded.
When the whole gathered model would not fit the memory budget, the groups that fit are held (in
forward order) and the others gathered at each forward as without the context: fewer all-gathers per
token, not none, and a warning says so.

With every group held, two more things change inside the context. FSDP's forward hooks, which still
run for every module of every token (they find the group gathered, set state, register backward
hooks), are replaced for forwards without gradients by what they then amount to: the mixed-precision
casts of inputs and outputs (`IdleForwardHooks`). And a model's `generate` defaults to
`synced_gpus=False`: Hugging Face turns it on for an FSDP-managed model, one all-reduce per token so
that ranks run the same forwards, which a model that gathers nothing does not need.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from .. import _torch_compat as tc
from ..config_checks import parse_bytes
from ..distributed import log_rank_zero
from ..estimate import default_budget, human_bytes
from ..groups import own_named_params
from ..mesh import detect_num_nodes
from ..train import KeptGroups, recorded_state


def gathered_bytes(model: nn.Module) -> int:
    """Bytes the model's FSDP-managed parameters take gathered, floating ones in their group's compute
    dtype (the mixed-precision policy's `param_dtype` where one is set). A parameter's `numel()` is
    its full size (a DTensor's global one; under tensor parallelism that over-counts the TP shard)."""
    return sum(_group_bytes(cast(nn.Module, module)) for module in tc.fsdp_groups(model))


def _group_bytes(module: nn.Module) -> int:
    """Bytes one FSDP group's own parameters take gathered (see `gathered_bytes`)."""
    state = recorded_state(module)
    compute = state.group.mp_policy.param_dtype if state is not None and state.group is not None else None
    total = 0
    for member in tc.group_modules(module):
        for _, p in own_named_params(member):
            dtype = compute if compute is not None and p.is_floating_point() else p.dtype
            total += p.numel() * torch.empty((), dtype=dtype, device="meta").element_size()
    return total


def _groups_within(models: tuple[nn.Module, ...], budget: int) -> list[list[FSDPModule]]:
    """Per model, its FSDP groups that fit `budget` together, taken in forward order."""
    chosen: list[list[FSDPModule]] = []
    used = 0
    for model in models:
        fitting = []
        for module in tc.fsdp_groups(model):
            size = _group_bytes(cast(nn.Module, module))
            if used + size <= budget:
                fitting.append(module)
                used += size
        chosen.append(fitting)
    return chosen


@contextlib.contextmanager
def gathered(*models: nn.Module, memory_budget: int | str | None = None) -> Iterator[None]:
    """Keep every FSDP group of `models` gathered inside the context (for generation).

    Every rank must enter and leave it together (the first gather and the last reshard are
    collective); inside, forwards run without collectives, so ranks may even generate different
    lengths: the models' `generate` defaults to `synced_gpus=False` inside (Hugging Face's default on
    a sharded model is True, one all-reduce per token so that every rank runs the same number of
    forwards, which only a sharded forward needs), and forwards without gradients skip FSDP's hooks.
    Use it around `model.generate(...)` or a hand-written decoding loop, not around training steps
    (every group would stay gathered through backward).

    Args:
        *models: Models `shard_model` sharded (a model without FSDP groups is left as it is).
        memory_budget: Bytes per rank the gathered parameters may take, an int or text like "20GiB";
            None: the accelerator's total memory, or on CPU the available RAM divided by the local
            ranks, less a margin (`estimate.default_budget`). Above it only the groups that fit are
            held (the others gathered at each forward, so every rank must run the same forwards:
            `generate` keeps its own `synced_gpus` default, and FSDP's hooks run), and a warning says so.

    Example:
        ```python
        with f2.gathered(model), torch.no_grad():
            tokens = model.generate(input_ids, max_new_tokens=64)  # synced_gpus=False inside
        ```
    """
    budget = parse_bytes(memory_budget, "gathered(memory_budget)") or default_budget(_local_ranks())
    needed = sum(gathered_bytes(m) for m in models)
    chosen = _groups_within(models, budget)
    if needed > budget:
        held_bytes = sum(_group_bytes(cast(nn.Module, m)) for group in chosen for m in group)
        log_rank_zero(
            "f2.gathered: the gathered model needs %s per rank, over the budget of %s; holding the %d groups "
            "that fit (%s), the others are gathered at each forward (keep generate's synced_gpus=True). "
            "Pass gathered(..., memory_budget=...) or free memory to hold them all.",
            human_bytes(needed),
            human_bytes(budget),
            sum(len(group) for group in chosen),
            human_bytes(held_bytes),
            level=30,
        )
    held, restores = [], []
    for model, groups in zip(models, chosen):
        modules = tc.fsdp_groups(model)
        if not modules or not groups:
            continue
        # The root's lazy init (normally at its first forward) fixes its reshard choice: run it first,
        # so the choices saved and restored are the final ones. Idempotent.
        tc.lazy_init(modules[0])
        kept = KeptGroups(groups)
        held.append(kept)
        kept.keep(gather_now=True)
        if len(groups) == len(modules):  # every group held: no forward gathers anything
            restores += [IdleForwardHooks(modules).restore, _unsynced_generate(model)]
    try:
        yield
    finally:
        for restore in reversed(restores):
            restore()
        for kept in held:
            kept.restore_flags()
            for module in kept.modules:
                module.reshard()


class IdleForwardHooks:
    """FSDP's forward hooks of `modules` (gathered groups, held so), replaced for forwards without
    gradients by the mixed-precision casts they would apply; with gradients enabled the hooks run as
    FSDP's (a forward that a backward may follow needs them). `restore` puts FSDP's hooks back, in place."""

    def __init__(self, modules: list[FSDPModule]):
        self.slots: list[tuple[dict, int, Any]] = []
        for module in modules:
            state = recorded_state(cast(nn.Module, module))
            if state is None or state.group is None:
                continue  # not sharded by shard_model: its precision is not known here, keep FSDP's hooks
            policy = state.group.mp_policy
            for hooks, key, is_pre in tc.forward_hook_slots(module):
                original = hooks[key]
                hooks[key] = _idle_pre_hook(original, policy) if is_pre else _idle_post_hook(original, policy)
                self.slots.append((hooks, key, original))

    def restore(self) -> None:
        for hooks, key, original in self.slots:
            if key in hooks:
                hooks[key] = original
        self.slots = []


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return tc.tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def _idle_pre_hook(original: Callable, policy: MixedPrecisionPolicy) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if torch.is_grad_enabled():
            return original(module, args, kwargs)
        if policy.cast_forward_inputs and policy.param_dtype is not None:
            return _cast_floats(args, policy.param_dtype), _cast_floats(kwargs, policy.param_dtype)
        return None

    return hook


def _idle_post_hook(original: Callable, policy: MixedPrecisionPolicy) -> Callable:
    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        if torch.is_grad_enabled():
            return original(module, args, output)
        return _cast_floats(output, policy.output_dtype) if policy.output_dtype is not None else None

    return hook


def _unsynced_generate(model: nn.Module) -> Callable[[], None]:
    """Make `model.generate` (if it has one that takes `synced_gpus`, as Hugging Face's does) default to
    `synced_gpus=False`; returns what undoes it."""
    generate = getattr(model, "generate", None)
    if not callable(generate) or not _takes_synced_gpus(model, generate):
        return lambda: None
    had_own = "generate" in model.__dict__  # e.g. torch's register_fsdp_forward_method(model, "generate")

    @functools.wraps(generate)
    def unsynced(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("synced_gpus", False)
        return generate(*args, **kwargs)

    vars(model)["generate"] = unsynced  # an instance attribute: the class is untouched

    def restore() -> None:
        if had_own:
            vars(model)["generate"] = generate
        else:
            del vars(model)["generate"]

    return restore


def _takes_synced_gpus(model: nn.Module, generate: Callable) -> bool:
    """Whether `generate` takes `synced_gpus`: by name, or through `**kwargs` handed on to a Hugging
    Face `generate` (a PEFT model's)."""
    try:
        parameters = inspect.signature(generate).parameters
    except (TypeError, ValueError):  # no signature to read: leave it alone
        return False
    if "synced_gpus" in parameters:
        return True
    passes_on = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return passes_on and any(
        any(c.__name__ == "GenerationMixin" for c in type(m).__mro__) for m in model.modules() if m is not model
    )


def _local_ranks() -> int:
    """Ranks on this node, as the memory planner counts them (`choose.resolve_on_process_group`)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return world // detect_num_nodes(world)

"""`shard_model`: apply a `ResolvedPlan` (`plan`) to a model: tensor parallelism, activation
checkpointing, compile and one `fully_shard` per group."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as _torch_fully_shard

from .. import _torch_compat as tc
from ..activation_checkpoint import apply_activation_checkpointing
from ..config import FSDP2Config
from ..distributed import log_rank_zero
from ..groups import own_named_params, top_level
from ..mesh import mesh_device
from ..precision import first_emulation_warning
from ..tensor_parallel import apply_tensor_parallel, user_parallelised_modules
from ..train import ReplicatedParams, engine_state, install_chunked_loss, mark_replaced_params, record_mode
from .custom_methods import guard_custom_methods
from .frozen import cast_frozen
from .host_memory import apply_host_allocator
from .materialize import materialize
from .plan import ResolvedPlan, ShardedGroup, plan_sharding
from .quantised import QUANTISED_REASON, pack_for_sharding, packed_storage
from .report import sharding_plan
from .ring_comms import install_ring_comms


def shard_model(
    model: nn.Module,
    config: FSDP2Config | Mapping[str, Any] | str | None = None,
    *,
    mesh: DeviceMesh | None = None,
    **overrides: Any,
) -> nn.Module:
    """`f2.shard_model` once `sharding_strategy="auto"` is resolved (`fsdp2_strategy.choose` does that
    first): shard `model` in place by `config` and return it. Arguments and errors as there.

    Raises:
        ValueError: `sharding_strategy` is still "auto", or the config does not fit the world or `mesh`.
    """
    config = FSDP2Config.coerce(config, **overrides)
    if config.sharding_strategy == "auto":
        raise ValueError(
            "sharding_strategy='auto' is chosen by fsdp2_strategy.shard_model (the memory planner or the tuner) "
            "before sharding; call that, or give a concrete strategy."
        )
    return apply_plan(model, plan_sharding(model, config, mesh=mesh))


def apply_plan(model: nn.Module, plan: ResolvedPlan) -> nn.Module:
    """Apply a `ResolvedPlan` to the model it was made for: tensor parallelism, activation
    checkpointing, compile, frozen dtypes, one `fully_shard` per group (children first, the root
    last), prefetch, materialisation, the replicated parameters; returns `model`."""
    if plan.tp_mesh is not None:
        # Before FSDP: fully_shard then shards the TP DTensors over the data-parallel dims.
        styles = apply_tensor_parallel(model, plan.tensor_parallel_plan, plan.tp_mesh)
        for module_name, style in styles.items():
            engine_state(model.get_submodule(module_name)).tp_style = style
    # Labelled now: after FSDP every managed parameter is a DTensor.
    for module in user_parallelised_modules(model):
        state = engine_state(module)
        state.tp_style = state.tp_style or "user"
    apply_activation_checkpointing(model, plan.activation_checkpointing, list(plan.wrapped))
    if plan.compile:
        _compile_blocks(model, list(plan.wrapped), plan.compile)

    ignored = {p for n in plan.ignored for p in model.get_submodule(n).parameters()}
    quantised = {n: model.get_parameter(n) for n in plan.quantised}
    skip_fsdp = ignored | {model.get_parameter(n) for n in plan.scalars} | set(quantised.values())
    packed = _packed_storage(model, plan)
    pack_for_sharding(model, packed)
    # Packed bytes are no weights to cast: frozen_dtype leaves them (mixed precision does, by their dtype).
    packed_params = {model.get_parameter(n) for n in packed}
    cast_frozen(model, [g.spec for g in plan.groups], plan.frozen_dtype, skip_fsdp | packed_params)
    params_before = list(model.parameters())
    for group in reversed(plan.groups):  # children before parents, root last
        _shard_one(model, group, skip_fsdp)
    mark_replaced_params(params_before, model)
    record_mode(model, plan.accumulation)
    engine_state(model).wrap_choice = plan.wrap_choice
    engine_state(model).cp_mesh = plan.cp_mesh
    install_ring_comms(model, plan.collectives)
    apply_host_allocator(plan.host_allocator, plan.root_mesh.device_type)

    _set_prefetch(model, list(plan.blocks), plan.forward_prefetch, plan.backward_prefetch)
    # Before the guard: it wraps whichever forward the model has, so the chunked loss's too.
    engine_state(model).loss_choice = install_chunked_loss(model, plan.chunked_loss, plan.tp_mesh is not None)
    _guard_direct_forward(model)
    guard_custom_methods(model)
    _guard_save_pretrained(model)
    if plan.meta:
        materialize(model, plan.root_mesh)
    if plan.scalars or quantised:
        # Looked up again by name: materialising replaces meta parameters with new objects.
        replicated = ReplicatedParams({n: model.get_parameter(n) for n in plan.scalars}, plan.root_mesh)
        replicated.move_to(mesh_device(plan.root_mesh))
        replicated.broadcast()
        # Added after the broadcast: every rank loaded the same quantised weights, and their
        # quantisation state (absmax, code map) lives outside the parameter's data.
        replicated.add(quantised, QUANTISED_REASON)
        engine_state(model).replicated = replicated
    if plan.log_plan:
        log_rank_zero("FSDP2 sharding plan:\n%s", sharding_plan(model))
    _warn_emulated_precision(plan)
    return model


def _warn_emulated_precision(plan: ResolvedPlan) -> None:
    """Once per process: computing in a dtype the device only emulates makes training slower, not faster."""
    for dtype in {group.spec.settings.mp_policy.param_dtype for group in plan.groups}:
        message = first_emulation_warning(dtype, plan.root_mesh.device_type)
        if message:
            log_rank_zero("%s", message, level=logging.WARNING)


def _packed_storage(model: nn.Module, plan: ResolvedPlan) -> dict[str, torch.dtype]:
    """Each packed 4-bit weight's storage dtype, from the compute dtype of its deepest group."""
    owners: dict[str, torch.dtype] = {}
    for group in reversed(plan.groups):  # children first: a parameter's owner is its deepest group
        compute = group.spec.settings.mp_policy.param_dtype
        for member in group.spec.modules:
            prefix = f"{member}." if member else ""
            for name in plan.packed:
                if name.startswith(prefix):
                    owners.setdefault(name, packed_storage(compute))
    return owners


def _shard_one(model: nn.Module, group: ShardedGroup, skip: set) -> None:
    """One `fully_shard` call on the group's module (or its modules, sharded together)."""
    name, settings = group.spec.name, group.spec.settings
    modules = [model.get_submodule(m) for m in group.spec.modules]
    own = {p for m in modules for p in m.parameters() if p in skip}
    module = modules[0]
    try:
        _torch_fully_shard(
            modules if len(modules) > 1 else module,
            mesh=group.mesh,
            reshard_after_forward=settings.reshard_after_forward,
            mp_policy=settings.mp_policy,
            offload_policy=settings.offload_policy,
            ignored_params=own or None,
        )
    except Exception as exc:
        what = " + ".join(settings.members) if settings.members else name or "<root>"
        raise type(exc)(f"fully_shard failed on module {what!r} ({type(module).__name__}): {exc}") from exc
    # torch's None means False for the root and True elsewhere: record what really happens.
    done = replace(settings, reshard_after_forward=settings.effective_reshard(is_root=name == ""))
    for m in modules:
        engine_state(m).group = done


def _compile_blocks(model: nn.Module, groups: list[str], options: bool | dict) -> None:
    kwargs = options if isinstance(options, dict) else {}
    for name in top_level(groups):
        block = model.get_submodule(name)
        # Compile forward only: FSDP's hooks stay eager around it and names stay unchanged.
        block.forward = torch.compile(block.forward, **kwargs)


def _set_prefetch(model: nn.Module, blocks: list[str], forward: int, backward: int) -> None:
    modules = [cast(FSDPModule, model.get_submodule(n)) for n in blocks]  # each block is a group
    for i, module in enumerate(modules):
        if forward:
            module.set_modules_to_forward_prefetch(modules[i + 1 : i + 1 + forward])
        if backward:
            module.set_modules_to_backward_prefetch(list(reversed(modules[max(0, i - backward) : i])))


class _GuardedForward:
    """Wraps a sharded module's forward to catch `module.forward(x)` called directly.

    FSDP2 gathers parameters in a hook of `module(x)`; calling `forward` skips it and the
    module would compute on shards, failing deep inside an op. The module's FSDP parameter
    groups say whether they are gathered. (Whether a parameter is a DTensor does not: under
    FSDP + tensor parallelism a gathered parameter is still a DTensor, on the TP mesh.)
    """

    def __init__(self, module: nn.Module, forward):
        self.module, self.forward = module, forward

    def __call__(self, *args, **kwargs):
        if not _gathered(self.module):
            raise ValueError(
                f"{type(self.module).__name__}.forward() was called directly on a sharded module, so FSDP "
                "did not gather its parameters. Call the module itself, model(inputs), or register extra "
                "entry points with torch.distributed.fsdp.register_fsdp_forward_method(model, 'generate')."
            )
        return self.forward(*args, **kwargs)


def _gathered(module: FSDPModule) -> bool:
    return all(g.is_unsharded for g in tc.param_groups(module))


def _guard_direct_forward(model: nn.Module) -> None:
    # An instance attribute, as torch's own `register_fsdp_forward_method` sets: no module hook sees
    # a direct `forward` call (hooks run only through `__call__`).
    for module in model.modules():
        if not isinstance(module, FSDPModule) or isinstance(module.forward, _GuardedForward):
            continue
        if any(True for _ in own_named_params(module)):
            module.forward = _GuardedForward(module, module.forward)


_SAVE_PRETRAINED_ERROR = (
    "{cls}.save_pretrained() on an FSDP2-sharded model would write each rank's shards (or crash on "
    "DTensor storage). Call, on every rank, fsdp2_strategy.save_peft_adapter(model, dir) for a PEFT "
    "adapter, fsdp2_strategy.save_merged(model, dir) for merged weights, or accelerator.save_model; "
    "or pass save_pretrained(..., state_dict=full_state_dict) gathered first."
)


def _guard_save_pretrained(model: nn.Module) -> None:
    """Hugging Face / PEFT `save_pretrained` reads the live (sharded) parameters; with an explicit
    gathered `state_dict` it is fine, without one it raises an error naming what to call instead."""
    # An instance attribute: neither transformers nor PEFT offers a hook before a save, and the
    # class (shared with unsharded models) must stay untouched.
    for module in model.modules():
        original = getattr(module, "save_pretrained", None)
        if not callable(original) or getattr(original, "_f2_guarded", False):
            continue

        def guarded(*args: Any, _original: Any = original, _cls: str = type(module).__name__, **kwargs: Any) -> Any:
            state_dict = kwargs.get("state_dict")
            if state_dict is None:
                raise RuntimeError(_SAVE_PRETRAINED_ERROR.format(cls=_cls))
            if not state_dict and kwargs.get("is_main_process") is False:
                # Accelerate's recipe passes `get_state_dict(model)`, gathered on rank 0 only: the
                # other ranks have nothing to write (PEFT would raise KeyError on the empty dict).
                return None
            return _original(*args, **kwargs)

        guarded._f2_guarded = True  # type: ignore[attr-defined]
        module.__dict__["save_pretrained"] = guarded  # an instance attribute: the class is untouched

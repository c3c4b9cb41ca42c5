"""Resolve once, then apply: everything `shard_model` will do to a model, decided before it touches it.

`plan_sharding(model, config, mesh=...)` turns the config, the model and the mesh into a
`ResolvedPlan`: every FSDP group with its resolved settings and mesh (`groups.resolve_groups`, the
same groups the memory estimator plays), the modules left out (ignored, 0-dim, quantised ones kept whole), the 4-bit weights sharded as bytes, the
block sequence for prefetch, compile and activation checkpointing, and the runtime choices
(accumulation mode, collectives, host allocator). Every check runs here, so a bad config changes
nothing; `shard_model` then applies the plan with typed arguments, not the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from ..config import FSDP2Config
from ..groups import GroupSpec, ignored_names, resolve_groups, top_level
from ..mesh import MeshCache, check_reshard_factor, mesh_device, shard_group_size, split_parallel_mesh
from ..train import AccumulationMode, accumulation_mode, find_scalar_params
from ..wrap_policy import describe_auto_choice
from .materialize import check_initialisable, has_meta_tensors
from .quantised import find_quantised_params


@dataclass(frozen=True)
class ShardedGroup:
    """One `fully_shard` call of the plan: its resolved spec and the mesh it shards over."""

    spec: GroupSpec
    mesh: DeviceMesh


@dataclass(frozen=True)
class ResolvedPlan:
    """What `shard_model` applies to one model: resolved, typed, immutable (`plan_sharding`)."""

    groups: tuple[ShardedGroup, ...]
    """Every `fully_shard` call, the root first (absent when the user sharded the root already)."""
    root_mesh: DeviceMesh
    """The root group's mesh (replicated parameters and materialisation use it too)."""
    tp_mesh: DeviceMesh | None
    """The tensor-parallel mesh (`tensor_parallel_size` > 1), else None."""
    cp_mesh: DeviceMesh | None
    """The context-parallel mesh (`context_parallel_size` > 1), else None: `f2.context_parallel`
    runs attention as a ring over it."""
    tensor_parallel_plan: Any
    """`FSDP2Config.tensor_parallel_plan`, applied on `tp_mesh` before FSDP."""
    ignored: tuple[str, ...]
    """Modules FSDP leaves alone (`ignored_modules`)."""
    scalars: tuple[str, ...]
    """0-dim parameters, kept replicated (`fully_shard` cannot shard them)."""
    quantised: tuple[str, ...]
    """Quantised (bitsandbytes) parameters kept whole on every rank."""
    packed: tuple[str, ...]
    """4-bit (bitsandbytes) weights sharded as their packed bytes (`quantised_weights="shard"`)."""
    wrapped: tuple[str, ...]
    """Every module given its own group, parents first (activation checkpointing and compile
    apply to the outermost of them)."""
    blocks: tuple[str, ...]
    """The outermost groups' first modules in order: the block sequence prefetch follows."""
    activation_checkpointing: Any
    """`FSDP2Config.activation_checkpointing`."""
    compile: bool | dict
    """`FSDP2Config.compile`: per-block `torch.compile` (its options when a dict)."""
    forward_prefetch: int
    backward_prefetch: int
    frozen_dtype: Any
    """How frozen parameters are stored (`FSDP2Config.frozen_dtype`)."""
    accumulation: AccumulationMode
    collectives: str
    host_allocator: str
    meta: bool
    """Whether the model is on the meta device (materialised after sharding)."""
    log_plan: bool
    chunked_loss: bool | str
    """`FSDP2Config.chunked_loss`."""
    wrap_choice: str
    """What `wrap_policy="auto"` chose and why ("" for another policy), for the plan."""


def plan_sharding(model: nn.Module, config: FSDP2Config, *, mesh: DeviceMesh | None = None) -> ResolvedPlan:
    """Resolve and check every setting `shard_model` applies to `model`; nothing is changed.

    Args:
        model: The model to be sharded.
        config: The config, with a concrete `sharding_strategy`.
        mesh: The device mesh given to `shard_model` (None: built from the world size and
            `config.mesh_shape`).

    Returns:
        The plan, which `shard_model` applies.

    Raises:
        ValueError: A setting does not fit the model, the world size or `mesh` (named as in the config).
    """
    tp, cp = config.tensor_parallel_size, config.context_parallel_size
    dp_mesh, cp_mesh, tp_mesh = split_parallel_mesh(mesh, tp, cp) if mesh is not None else (None, None, None)
    meshes = MeshCache(
        device_type=mesh.device_type if mesh is not None else None,
        given=dp_mesh,
        tp_size=tp,
        tp_mesh=tp_mesh,
        cp_size=cp,
        cp_mesh=cp_mesh,
    )
    ignored = ignored_names(model, config)
    specs = resolve_groups(model, config, ignored)
    root = specs[0].settings
    root_mesh = dp_mesh if dp_mesh is not None else meshes.get(root.strategy, config.mesh_shape)
    groups = []
    for spec in specs:
        if spec.name == "" and isinstance(model, FSDPModule):
            continue  # the user sharded the root already
        group_mesh = root_mesh if spec.settings.strategy == root.strategy else meshes.get(spec.settings.strategy, None)
        override = spec.settings.override
        field = f"FSDP2Config.module_overrides[{override!r}]" if override else "FSDP2Config"
        check_reshard_factor(
            spec.settings.reshard_after_forward, shard_group_size(group_mesh), f"{field}.reshard_after_forward"
        )
        groups.append(ShardedGroup(spec, group_mesh))
    left_out = {id(p) for n in ignored for p in model.get_submodule(n).parameters()}
    meta = has_meta_tensors(model)
    if meta:
        check_initialisable(model)
    quantised = find_quantised_params(model, left_out, mesh_device(root_mesh), config.quantised_weights)
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    wrapped = tuple(sorted((m for spec in specs[1:] for m in spec.modules), key=order.__getitem__))
    outer = set(top_level(list(wrapped)))
    return ResolvedPlan(
        groups=tuple(groups),
        root_mesh=root_mesh,
        tp_mesh=meshes.tp_mesh if tp > 1 else None,
        cp_mesh=meshes.cp_mesh if cp > 1 else None,
        tensor_parallel_plan=config.tensor_parallel_plan,
        ignored=tuple(ignored),
        scalars=tuple(find_scalar_params(model, left_out)),
        quantised=quantised.kept,
        packed=quantised.sharded,
        wrapped=wrapped,
        blocks=tuple(s.name for s in specs[1:] if s.name in outer),
        activation_checkpointing=config.activation_checkpointing,
        compile=config.compile,
        forward_prefetch=config.forward_prefetch,
        backward_prefetch=config.backward_prefetch,
        frozen_dtype=config.frozen_dtype,
        accumulation=accumulation_mode(config.accumulation),
        collectives=config.collectives,
        host_allocator=config.host_allocator,
        meta=meta,
        log_plan=config.log_plan,
        chunked_loss=config.chunked_loss,
        wrap_choice=describe_auto_choice(model) if config.wrap_policy == "auto" else "",
    )

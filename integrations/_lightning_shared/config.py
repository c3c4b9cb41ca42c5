"""The config and mesh both Lightning adapters derive from what Lightning knows (nodes, processes
per node, its device mesh), the registered strategy names, and the process-group backend.

Both adapters pass in what they read from their own strategy objects; nothing of Lightning is
imported here except through `_compat`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import fsdp2_strategy as f2
from fsdp2_strategy.choose import resolve_strategy
from fsdp2_strategy.distributed import log_rank_zero
from fsdp2_strategy.sharding_strategies import strategy
from fsdp2_strategy.tensor_parallel import declared_plan, user_parallelised_modules

from ._compat import default_backend_for_device

REGISTERED = {
    "fsdp2": ("FSDP2 (fully_shard) via fsdp2_strategy", {}),
    "fsdp2_hybrid": ("FSDP2 hybrid sharding via fsdp2_strategy", {"sharding_strategy": "HYBRID_SHARD"}),
    "fsdp2_cpu_offload": ("FSDP2 with CPU offload via fsdp2_strategy", {"cpu_offload": True}),
    "fsdp2_spawn": ("FSDP2 via fsdp2_strategy, processes spawned (notebooks)", {"start_method": "spawn"}),
}
"""Strategy name -> (description, constructor keywords): the same names in both registries."""

START_METHODS = ("popen", "spawn", "fork", "forkserver")


def register_all(cls: type, registry: Any) -> None:
    """Register every name of `REGISTERED` for strategy class `cls` in a Lightning strategy registry."""
    for name, (description, params) in REGISTERED.items():
        registry.register(name, cls, description=description, override=True, **params)


def check_start_method(owner: str, start_method: str) -> None:
    """Raise ValueError naming the accepted launch methods."""
    if start_method not in START_METHODS:
        raise ValueError(f"{owner}.start_method={start_method!r} is invalid; use one of {START_METHODS}.")


def effective_config(
    config: f2.FSDP2Config,
    mixed_policy: str | None,
    num_nodes: int,
    num_processes: int,
    *,
    module: nn.Module | None = None,
    data_parallel_size: Any = None,
    **planner_inputs: Any,
) -> f2.FSDP2Config:
    """`config` plus what Lightning knows: the precision string's FSDP2 policy (unless
    `mixed_precision` is set), `sharding_strategy="auto"` resolved by the core planner for
    Lightning's node and process counts (the mesh depends on the strategy), for hybrid sharding
    the (nodes, devices per node) mesh, and the module's own tensor parallelism
    (`own_tensor_parallel`). `planner_inputs` (`example_batch`, `loss_fn`) go to the core's
    `resolve_strategy` (objective="throughput" measures steps on that batch)."""
    changes: dict[str, Any] = {}
    if mixed_policy is not None and config.mixed_precision is None:
        changes["mixed_precision"] = mixed_policy
    if config.sharding_strategy == "auto":
        if module is None:
            raise ValueError("sharding_strategy='auto' is resolved when the module is sharded (the planner needs it).")
        # The planner sees the precision the run will use.
        world = num_nodes * num_processes
        config = resolve_strategy(module, dataclasses.replace(config, **changes), world, num_nodes, **planner_inputs)
    if strategy(config.sharding_strategy).layout == "hybrid" and config.mesh_shape is None:
        # Replicate across nodes, shard within one: Lightning's launcher may not set the
        # LOCAL_WORLD_SIZE the core would otherwise read.
        changes["mesh_shape"] = (num_nodes, num_processes // config.context_parallel_size)
    if module is not None and config.tensor_parallel_size > 1 and not core_applies_tensor_parallel(config, module):
        changes.update(own_tensor_parallel(config, module, data_parallel_size))
    if module is not None and config.tensor_parallel_size == 1:
        _note_own_tensor_parallel_on_one_rank(module)
    return dataclasses.replace(config, **changes) if changes else config


_noted_tp_default = False


def _note_own_tensor_parallel_on_one_rank(module: nn.Module) -> None:
    """Log once (rank 0) when the module parallelised itself (`configure_model`) while the strategy
    has `tensor_parallel_size=1`: its TP then spans one device. Our default differs on purpose from
    ModelParallelStrategy's (TP over the devices of a node): "fsdp2" promises FSDP over every device."""
    global _noted_tp_default
    # Own parameters on Lightning's "tensor_parallel" dim: modules the user only fully_shard-ed
    # (DTensors on "data_parallel") do not count.
    own = [
        m
        for m in module.modules()
        if any(
            isinstance(p, DTensor) and "tensor_parallel" in (p.device_mesh.mesh_dim_names or ())
            for p in m.parameters(recurse=False)
        )
    ]
    if own and not _noted_tp_default:
        _noted_tp_default = True
        log_rank_zero(
            "%d module(s) of %s apply tensor parallelism themselves (configure_model), but the strategy has "
            "tensor_parallel_size=1 (FSDP over every device, the 'fsdp2' default), so their 'tensor_parallel' "
            "mesh dim spans one device. ModelParallelStrategy's default is TP over the devices of a node: pass "
            "tensor_parallel_size='auto' (Trainer) or the TP size to get it.",
            len(own),
            type(module).__name__,
            level=logging.WARNING,
        )


def core_applies_tensor_parallel(config: f2.FSDP2Config, module: nn.Module) -> bool:
    """Whether the core parallelises the module: with `tensor_parallel_size > 1` and a plan it can
    resolve. With the default plan "auto" and a module that declares none, TP is the module's own
    business (`configure_model`; ModelParallelStrategy's meaning, which may also parallelise
    nothing), and the core shards over the "data_parallel" dim only."""
    if config.tensor_parallel_size == 1:
        return False
    return config.tensor_parallel_plan != "auto" or bool(declared_plan(module))


def own_tensor_parallel(config: f2.FSDP2Config, module: nn.Module, data_parallel_size: Any) -> dict[str, Any]:
    """Config changes when the module does its own TP: the core shards over "data_parallel" only,
    and with no data parallelism the module's TP modules stay out of FSDP (as ModelParallelStrategy
    leaves them: FSDP over one rank would only make their parameters 2-D)."""
    changes: dict[str, Any] = {"tensor_parallel_size": 1}
    own_tp = user_parallelised_modules(module)
    if data_parallel_size == 1 and own_tp:
        ignored = config.ignored_modules
        ignored = [] if ignored is None else [ignored] if isinstance(ignored, (str, type, nn.Module)) else list(ignored)
        changes["ignored_modules"] = [*ignored, *own_tp]
    return changes


def parallel_sizes(
    owner: str, config: f2.FSDP2Config, data_parallel_size: Any, num_nodes: int, num_processes: int
) -> tuple[int, int]:
    """Lightning's ("data_parallel", "tensor_parallel") mesh sizes: TP from the config, data
    parallelism every other rank ("auto"; `ModelParallelStrategy`'s "auto" is the node count, which
    shards nothing on one node) or as given. With context parallelism the "data_parallel" dim holds
    the data x context parallel ranks, and a given `data_parallel_size` counts the ranks that take
    different batches. Raises ValueError naming the sizes that do not fit."""
    check_tensor_parallel_layout(owner, config)
    world = num_nodes * num_processes
    tp, cp = config.tensor_parallel_size, config.context_parallel_size
    if cp > 1 and tp > 1:
        raise ValueError(
            f"{owner}(context_parallel_size={cp}, tensor_parallel_size={tp}) is not supported: Lightning's device "
            "mesh is (data_parallel, tensor_parallel), with no context-parallel dim. Use one of them here, or the "
            "core (f2.shard_model) or FSDP2Accelerator for data x context x tensor parallelism."
        )
    if world % (tp * cp):
        field = "tensor_parallel_size" if cp == 1 else "context_parallel_size"
        raise ValueError(
            f"{owner}({field}={tp * cp}) does not divide the {world} processes "
            f"({num_nodes} node(s) x {num_processes}); use a divisor of {world}."
        )
    if data_parallel_size == "auto":
        return world // tp, tp
    if data_parallel_size * tp * cp != world:
        raise ValueError(
            f"{owner}(data_parallel_size={data_parallel_size}, tensor_parallel_size={tp}"
            + (f", context_parallel_size={cp}" if cp > 1 else "")
            + f") needs {data_parallel_size * tp * cp} processes, but there are {world}; their product must equal "
            "the number of processes."
        )
    return data_parallel_size * cp, tp


def sampler_kwargs(config: f2.FSDP2Config, global_rank: int, world_size: int) -> dict[str, int] | None:
    """With context parallelism, the distributed sampler's replicas: the ranks of one "cp" group
    (consecutive) take the same batch. None without (Lightning's own kwargs hold)."""
    cp = config.context_parallel_size
    if cp == 1:
        return None
    return {"num_replicas": world_size // cp, "rank": global_rank // cp}


def check_tensor_parallel_layout(owner: str, config: f2.FSDP2Config) -> None:
    """Refuse hybrid sharding (or an explicit `mesh_shape`) with tensor parallelism: Lightning's
    mesh is ("data_parallel", "tensor_parallel"), and HSDP would need a third dim, which the core
    would build as a second mesh beside Lightning's (collectives Lightning does not know of)."""
    if config.tensor_parallel_size > 1 and (strategy(config.sharding_strategy).two_dim or config.mesh_shape):
        raise ValueError(
            f"{owner}(sharding_strategy={config.sharding_strategy!r}, mesh_shape={config.mesh_shape}, "
            f"tensor_parallel_size={config.tensor_parallel_size}) is not supported: Lightning's device mesh is "
            "(data_parallel, tensor_parallel), with no replicate dim. Use sharding_strategy='FULL_SHARD' or "
            "'SHARD_GRAD_OP' without mesh_shape for FSDP x TP, or tensor_parallel_size=1 for hybrid sharding."
        )


def core_mesh(config: f2.FSDP2Config, device_mesh: Any) -> Any:
    """What `shard_model` shards on: Lightning's whole ("data_parallel", "tensor_parallel") mesh
    with tensor parallelism (its last dim is the TP one), else its 1-D "data_parallel" sub-mesh
    for 1-D strategies; None lets the core build hybrid (2-D) meshes and meshes of an explicit
    `mesh_shape`."""
    if strategy(config.sharding_strategy).two_dim or config.mesh_shape is not None or config.context_parallel_size > 1:
        return None  # the core builds it (with context parallelism: its (data, "cp") mesh)
    return device_mesh if config.tensor_parallel_size > 1 else device_mesh["data_parallel"]


def process_group_backend(device: torch.device) -> str:
    """gloo on CPU; on an accelerator "cpu:gloo,<device>:<nccl...>" so that CPU collectives
    (asynchronous checkpoints, CPU offload) have a backend too."""
    backend = default_backend_for_device(device)
    return backend if device.type == "cpu" else f"cpu:gloo,{device.type}:{backend}"

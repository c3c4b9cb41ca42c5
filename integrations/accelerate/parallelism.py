"""Accelerate's `ParallelismConfig` (dp_replicate, dp_shard, cp, tp sizes) as FSDP2Config fields and a mesh.

Accelerate 1.15 reads these sizes from `Accelerator(parallelism_config=...)` or, with
`ACCELERATE_USE_PARALLELISM_CONFIG=true` (what `accelerate launch` sets from a config file's
`parallelism_config` section), from the `PARALLELISM_CONFIG_*` variables. Here they become the
core's `mesh_shape`, hybrid sharding, `context_parallel_size` and `tensor_parallel_size`, and one
device mesh whose dims carry Accelerate's names ("dp_replicate", "dp_shard", "cp", "tp"), so
Accelerate's data loaders give every rank of a CP or TP group the same batch. Sequence parallelism
(`sp_size`, another engine's) is refused.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from accelerate.parallelism_config import ParallelismConfig
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import fsdp2_strategy as f2
from fsdp2_strategy.mesh import CP_DIM, REPLICATE_DIM, SHARD_DIM, mesh_device_type
from fsdp2_strategy.sharding_strategies import strategy
from fsdp2_strategy.tensor_parallel import TP_DIM

_HYBRID_OF = {"FULL_SHARD": "HYBRID_SHARD", "SHARD_GRAD_OP": "HYBRID_SHARD_ZERO2"}


def requested_parallelism_config(given: Any) -> Any:
    """`given`, else the config Accelerate would build from the environment, else None."""
    if given is not None:
        return given
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        return ParallelismConfig()  # reads PARALLELISM_CONFIG_* as Accelerate does
    return None


def apply_parallelism_config(config: f2.FSDP2Config, pc: Any, world_size: int) -> f2.FSDP2Config:
    """`config` with the sizes of `pc` (an accelerate `ParallelismConfig`); ValueError naming the
    field for a sequence-parallel size, a product that is not the world size, or a plugin
    setting that disagrees."""
    sizes = {
        name: int(getattr(pc, f"{name}_size", None) or 1) for name in ("dp_replicate", "dp_shard", "tp", "cp", "sp")
    }
    if sizes["sp"] > 1:
        raise ValueError(
            f"ParallelismConfig(sp_size={sizes['sp']}) is not supported by FSDP2Accelerator (sequence parallelism "
            "over attention heads is another engine's); set sp_size=1, and use cp_size for long sequences."
        )
    rep, shard, cp, tp = sizes["dp_replicate"], sizes["dp_shard"], sizes["cp"], sizes["tp"]
    if rep * shard * cp * tp != world_size:
        raise ValueError(
            f"ParallelismConfig(dp_replicate_size={rep}, dp_shard_size={shard}, cp_size={cp}, tp_size={tp}) holds "
            f"{rep * shard * cp * tp} ranks but there are {world_size} processes; their product must equal the "
            f"number of processes (e.g. dp_shard_size={world_size // (rep * cp * tp)} if that divides)."
        )
    for field, mine, theirs, size in (
        ("tensor_parallel_size", config.tensor_parallel_size, "tp_size", tp),
        ("context_parallel_size", config.context_parallel_size, "cp_size", cp),
    ):
        if mine not in (1, size):
            raise ValueError(
                f"FSDP2Plugin({field}={mine}) disagrees with ParallelismConfig({theirs}={size}); set the size in one place."
            )
    if config.sharding_strategy == "auto":
        # The sizes fix the mesh, which the planner would choose: one of them has to give way.
        raise ValueError(
            "FSDP2Plugin(sharding_strategy='auto') cannot be combined with a ParallelismConfig (its sizes "
            "fix the mesh the planner would choose); name a sharding_strategy or drop the ParallelismConfig."
        )
    changes: dict[str, Any] = {"tensor_parallel_size": tp, "context_parallel_size": cp}
    name = strategy(config.sharding_strategy).name
    if rep > 1 or strategy(name).layout == "hybrid":
        hybrid = name if strategy(name).layout == "hybrid" else _HYBRID_OF.get(name)
        if hybrid is None:
            raise ValueError(
                f"ParallelismConfig(dp_replicate_size={rep}) needs hybrid sharding, but the FSDP2Plugin's "
                f"sharding_strategy is {name!r}; use FULL_SHARD, SHARD_GRAD_OP or a HYBRID_SHARD strategy."
            )
        changes.update(sharding_strategy=hybrid, mesh_shape=(rep, shard))
    elif strategy(name).layout == "shard":
        changes["mesh_shape"] = (shard,)
    if config.mesh_shape is not None and tuple(config.mesh_shape) != changes.get(
        "mesh_shape", tuple(config.mesh_shape)
    ):
        raise ValueError(
            f"FSDP2Plugin(mesh_shape={tuple(config.mesh_shape)}) disagrees with ParallelismConfig("
            f"dp_replicate_size={rep}, dp_shard_size={shard}); set the sizes in one place."
        )
    return dataclasses.replace(config, **changes)


def parallelism_mesh(config: f2.FSDP2Config) -> DeviceMesh | None:
    """The whole (dp_replicate?, dp_shard, cp?, tp?) mesh for `config`, named as Accelerate names its
    dims; None for plain 1-D sharding (nothing to tell Accelerate)."""
    tp, cp = config.tensor_parallel_size, config.context_parallel_size
    # "auto" (never with tensor parallelism or a ParallelismConfig) is resolved by `shard_model`,
    # which then builds the mesh of the strategy it picks.
    two_dim = config.sharding_strategy != "auto" and strategy(config.sharding_strategy).layout == "hybrid"
    if tp == 1 and cp == 1 and not two_dim:
        return None
    shape = tuple(config.mesh_shape)  # set by apply_parallelism_config
    names = (REPLICATE_DIM, SHARD_DIM) if two_dim else (SHARD_DIM,)
    if cp > 1:
        shape, names = (*shape, cp), (*names, CP_DIM)
    if tp > 1:
        shape, names = (*shape, tp), (*names, TP_DIM)
    return init_device_mesh(mesh_device_type(), shape, mesh_dim_names=names)

"""Device meshes for sharding strategies, and the one place that reads the launch environment.

Sharding strategies become meshes here; what each strategy means is in `sharding_strategies`.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import sharding_strategies as strategies
from .tensor_parallel import TP_DIM

REPLICATE_DIM, SHARD_DIM = "dp_replicate", "dp_shard"


def default_reshard_after_forward(strategy: str) -> bool | None:
    """The `reshard_after_forward` a strategy implies (None lets torch keep the root gathered)."""
    return strategies.strategy(strategy).reshard_after_forward


def mesh_device_type() -> str:
    """Device type for meshes: the accelerator when the process group can drive it, else "cpu"."""
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None without a usable one
    return accelerator.type if accelerator is not None and backend != "gloo" else "cpu"


def collective_device() -> torch.device:
    """Where a small tensor for a default-group collective must live (nccl cannot send CPU tensors)."""
    device_type = mesh_device_type()
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.accelerator.current_device_index())


def detect_num_nodes(world_size: int) -> int:
    """Number of nodes, from torchrun's LOCAL_WORLD_SIZE (1 when unknown)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
    if local <= 0 or world_size % local:
        return 1
    return world_size // local


def strategy_mesh_shape(strategy: str, mesh_shape: tuple[int, ...] | None, world_size: int) -> tuple[int, ...]:
    """The validated mesh shape for `strategy` on `world_size` ranks."""
    layout = strategies.strategy(strategy).layout
    if layout == "replicate":
        shape = mesh_shape or (world_size, 1)
        if len(shape) != 2 or shape[1] != 1:
            raise ValueError(
                f"FSDP2Config.mesh_shape={mesh_shape} conflicts with sharding_strategy='NO_SHARD', which "
                f"replicates on every rank; leave mesh_shape unset or use ({world_size}, 1)."
            )
    elif layout == "hybrid":
        if mesh_shape is not None and len(mesh_shape) != 2:
            raise ValueError(
                f"FSDP2Config.mesh_shape={mesh_shape} needs two dims (replicate, shard) for "
                f"sharding_strategy={strategy!r}, e.g. ({detect_num_nodes(world_size)}, "
                f"{world_size // detect_num_nodes(world_size)})."
            )
        nodes = detect_num_nodes(world_size)
        shape = mesh_shape or (nodes, world_size // nodes)
    else:
        if mesh_shape is not None and len(mesh_shape) != 1:
            raise ValueError(
                f"FSDP2Config.mesh_shape={mesh_shape} has two dims but sharding_strategy={strategy!r} "
                "shards over one; use sharding_strategy='HYBRID_SHARD' for a (replicate, shard) mesh."
            )
        shape = mesh_shape or (world_size,)
    product = 1
    for s in shape:
        product *= s
    if product != world_size:
        raise ValueError(
            f"FSDP2Config.mesh_shape={tuple(shape)} holds {product} ranks but the world size is {world_size}; "
            f"the product of mesh_shape must equal the world size."
        )
    return tuple(shape)


def check_reshard_factor(value, shard_size: int, field: str) -> None:
    """An int `reshard_after_forward` must divide the shard group size (torch's requirement)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return
    if value < 1 or shard_size % value:
        divisors = [d for d in range(1, shard_size + 1) if shard_size % d == 0]
        raise ValueError(
            f"{field}={value} does not divide the shard group size {shard_size}; use one of {divisors}, or True/False."
        )


class MeshCache:
    """Builds each mesh shape once per `shard_model` call (creating one is a collective).

    With `tp_size > 1` every data-parallel mesh is a sub-mesh of one (data..., "tp") mesh, and
    `tp_mesh` is its "tp" sub-mesh (FSDP2 needs both to share that parent).
    """

    def __init__(
        self,
        device_type: str | None = None,
        given: DeviceMesh | None = None,
        tp_size: int = 1,
        tp_mesh: DeviceMesh | None = None,
    ):
        self.device_type = device_type or mesh_device_type()
        self.given = given
        self.tp_size = tp_size
        self.tp_mesh = tp_mesh
        self._meshes: dict[tuple[int, ...], DeviceMesh] = {}

    def get(self, strategy: str, mesh_shape: tuple[int, ...] | None) -> DeviceMesh:
        if not dist.is_initialized():
            raise RuntimeError(
                "shard_model needs an initialised process group: call torch.distributed.init_process_group() "
                "first (torchrun sets the environment; a single process can use world_size=1)."
            )
        world = dist.get_world_size()
        if world % self.tp_size:
            raise ValueError(
                f"FSDP2Config.tensor_parallel_size={self.tp_size} does not divide the world size {world}; use a divisor "
                f"of it: {[d for d in range(1, world + 1) if world % d == 0]}."
            )
        shape = strategy_mesh_shape(strategy, mesh_shape, world // self.tp_size)
        if self.given is not None and tuple(self.given.shape) == shape:
            return self.given
        if shape not in self._meshes:
            names = (SHARD_DIM,) if len(shape) == 1 else (REPLICATE_DIM, SHARD_DIM)
            if self.tp_size == 1:
                self._meshes[shape] = init_device_mesh(self.device_type, shape, mesh_dim_names=names)
            else:
                full = init_device_mesh(self.device_type, (*shape, self.tp_size), mesh_dim_names=(*names, TP_DIM))
                self._meshes[shape] = full[names[0]] if len(names) == 1 else full[names]
                self.tp_mesh = full[TP_DIM]
        return self._meshes[shape]


def shard_group_size(mesh: DeviceMesh) -> int:
    """Ranks a parameter is sharded over: the last mesh dim."""
    return mesh.shape[-1]


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The torch.device this rank uses for `mesh` (its accelerator index, or the CPU)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())

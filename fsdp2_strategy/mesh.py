"""Device meshes for sharding strategies, and the one place that reads the launch environment.

Sharding strategies become meshes here; what each strategy means is in `sharding_strategies`.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import _torch_compat as tc
from . import sharding_strategies as strategies
from .tensor_parallel import TP_DIM

REPLICATE_DIM, SHARD_DIM = "dp_replicate", "dp_shard"
CP_DIM = "cp"
"""Name of the context-parallel dim in meshes the core builds (Accelerate's and torchtitan's name)."""
SHARD_CP_DIM = "dp_shard_cp"
"""The flattened (dp_shard, cp) dim FSDP shards over with context parallelism (torchtitan's name)."""


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

    With `tp_size > 1` or `cp_size > 1` every data-parallel mesh is a sub-mesh of one (data...,
    "cp"?, "tp"?) mesh: FSDP shards over the data-parallel dims with the last one flattened with
    "cp" (a sequence's ranks hold different tokens, so their gradients are averaged like data
    parallel ones), and `tp_mesh` / `cp_mesh` are its "tp" / "cp" sub-meshes (FSDP2 needs them to
    share that parent).
    """

    def __init__(
        self,
        device_type: str | None = None,
        given: DeviceMesh | None = None,
        tp_size: int = 1,
        tp_mesh: DeviceMesh | None = None,
        cp_size: int = 1,
        cp_mesh: DeviceMesh | None = None,
    ):
        self.device_type = device_type or mesh_device_type()
        self.given = given
        self.tp_size, self.tp_mesh = tp_size, tp_mesh
        self.cp_size, self.cp_mesh = cp_size, cp_mesh
        self._meshes: dict[tuple[int, ...], DeviceMesh] = {}

    def get(self, strategy: str, mesh_shape: tuple[int, ...] | None) -> DeviceMesh:
        if not dist.is_initialized():
            raise RuntimeError(
                "shard_model needs an initialised process group: call torch.distributed.init_process_group() "
                "first (torchrun sets the environment; a single process can use world_size=1)."
            )
        world = dist.get_world_size()
        _check_divides(world, self.tp_size, self.cp_size)
        shape = strategy_mesh_shape(strategy, mesh_shape, world // (self.tp_size * self.cp_size))
        if self.given is not None and tuple(self.given.shape) == shape:
            return self.given
        if shape not in self._meshes:
            names = (SHARD_DIM,) if len(shape) == 1 else (REPLICATE_DIM, SHARD_DIM)
            if self.tp_size == 1 and self.cp_size == 1:
                self._meshes[shape] = init_device_mesh(self.device_type, shape, mesh_dim_names=names)
            else:
                dims = [(n, s) for n, s in zip(names, shape)]
                dims += [(CP_DIM, self.cp_size)] if self.cp_size > 1 else []
                dims += [(TP_DIM, self.tp_size)] if self.tp_size > 1 else []
                full = init_device_mesh(
                    self.device_type, tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims)
                )
                self._meshes[shape] = fsdp_mesh_of(full, names, self.cp_size > 1)
                self.tp_mesh = full[TP_DIM] if self.tp_size > 1 else None
                self.cp_mesh = full[CP_DIM] if self.cp_size > 1 else None
        return self._meshes[shape]


def _check_divides(world: int, tp_size: int, cp_size: int) -> None:
    """ValueError naming the field when tensor x context parallel ranks do not divide the world."""
    if world % (tp_size * cp_size) == 0:
        return
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    if cp_size == 1:
        raise ValueError(
            f"FSDP2Config.tensor_parallel_size={tp_size} does not divide the world size {world}; use a divisor "
            f"of it: {divisors}."
        )
    raise ValueError(
        f"FSDP2Config.context_parallel_size={cp_size} x tensor_parallel_size={tp_size} does not divide the world "
        f"size {world}; pick sizes whose product is one of {divisors}."
    )


def fsdp_mesh_of(full: DeviceMesh, dp_names: tuple[str, ...], cp: bool) -> DeviceMesh:
    """The mesh FSDP shards over: `full`'s data-parallel dims `dp_names`, the last one flattened
    with "cp" (named `SHARD_CP_DIM`) when `cp`."""
    if not cp:
        return full[dp_names[0]] if len(dp_names) == 1 else full[dp_names]
    flat = tc.flatten_mesh(full[(dp_names[-1], CP_DIM)], SHARD_CP_DIM)
    # With HSDP the (replicate, flattened) pair is sliced from the root, as torchtitan does.
    return flat if len(dp_names) == 1 else full[(dp_names[0], SHARD_CP_DIM)]


def split_parallel_mesh(
    mesh: DeviceMesh, tp_size: int, cp_size: int
) -> tuple[DeviceMesh, DeviceMesh | None, DeviceMesh | None]:
    """(FSDP mesh, context-parallel mesh, tensor-parallel mesh) of a mesh given to `shard_model`.

    Without tensor or context parallelism the mesh is FSDP's as it is. Otherwise it is named, with
    one or two data-parallel dims, then a dim named "cp" of `cp_size` (when > 1), then the
    tensor-parallel dim of `tp_size` (when > 1; the last, whatever its name: Lightning calls it
    "tensor_parallel"). Raises ValueError otherwise, with an example mesh.
    """
    if tp_size == 1 and cp_size == 1:
        return mesh, None, None
    names, shape = mesh.mesh_dim_names, tuple(mesh.shape)
    dp = mesh.ndim - (cp_size > 1) - (tp_size > 1)
    fits = (
        names is not None
        and 1 <= dp <= 2
        and (tp_size == 1 or shape[-1] == tp_size)
        and (cp_size == 1 or (names[dp] == CP_DIM and shape[dp] == cp_size))
    )
    if not fits:
        tail = [(CP_DIM, cp_size)] * (cp_size > 1) + [(TP_DIM, tp_size)] * (tp_size > 1)
        fields = ", ".join(
            f"FSDP2Config.{f}={s}" for f, s in (("context_parallel_size", cp_size), ("tensor_parallel_size", tp_size))
        )
        raise ValueError(
            f"shard_model(mesh=...) with {fields} needs a named mesh of one or two data-parallel dims followed by "
            f"{' and '.join(f'{n!r} of size {s}' for n, s in tail)}, e.g. init_device_mesh(type, "
            f"(dp, {', '.join(str(s) for _, s in tail)}), mesh_dim_names=('dp_shard', "
            f"{', '.join(repr(n) for n, _ in tail)})); got shape {shape}, names {names}."
        )
    assert names is not None
    fsdp_mesh = fsdp_mesh_of(mesh, tuple(names[:dp]), cp_size > 1)
    return fsdp_mesh, mesh[CP_DIM] if cp_size > 1 else None, mesh[names[-1]] if tp_size > 1 else None


def shard_group_size(mesh: DeviceMesh) -> int:
    """Ranks a parameter is sharded over: the last mesh dim."""
    return mesh.shape[-1]


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The torch.device this rank uses for `mesh` (its accelerator index, or the CPU)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())

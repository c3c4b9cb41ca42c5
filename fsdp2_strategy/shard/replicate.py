"""`replicate`: "shard part, replicate the rest" - data parallelism for what FSDP does not own.

FSDP1 code often shards the big blocks and wraps the whole model in DDP for the rest
(`fully_shard(model.layers); model = DDP(model)`). torch's DDP cannot take DTensor
parameters (`aten.cat.default got mixed torch.Tensor and DTensor`) unless told to ignore
them. `replicate(model)` is the FSDP2 form: every parameter that no `fully_shard` group owns
(a plain tensor, not a DTensor) is made identical on all ranks (broadcast from rank 0, as
DDP does at construction) and its gradient is averaged over the mesh after each backward,
the same average FSDP's reduce-scatter takes. The model is changed in place, so
`f2.no_sync`, `f2.clip_grad_norm_`, `f2.Checkpointer` and `f2.sharding_plan` see it as they
see scalar parameters that `shard_model` replicates.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from ..distributed import log_rank_zero
from ..mesh import mesh_device, mesh_device_type
from ..train import ReplicatedParams, engine_state, replicated_params_of

REPLICATE_REASON = "no fully_shard group owns it: f2.replicate averages grads"


def unowned_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters of `model` that are plain tensors (no FSDP group manages them), by name."""
    return {n: p for n, p in model.named_parameters() if not isinstance(p, DTensor)}


def _check_ready(model: nn.Module, params: dict[str, nn.Parameter]) -> None:
    if not dist.is_initialized():
        raise RuntimeError(
            "f2.replicate needs an initialised process group: call f2.init_distributed() or "
            "torch.distributed.init_process_group() first."
        )
    meta = [n for n, p in params.items() if p.device.type == "meta"]
    if meta:
        raise ValueError(
            f"f2.replicate: parameters {meta[:4]} of {type(model).__name__} are on the meta device; "
            "materialise them first (model.to_empty(device=...) and initialise, or f2.shard_model, which does both)."
        )


def replicate(model: nn.Module, *, mesh: DeviceMesh | None = None) -> nn.Module:
    """Data-parallelise the parameters of `model` that no `fully_shard` group owns.

    Call it after every `fully_shard`/`shard_model` on parts of the model and before building
    the optimizer. The parameters are broadcast from rank 0 and their gradients averaged over
    `mesh`. Buffers are broadcast from rank 0 once here (DDP re-broadcasts them every forward;
    FSDP never does, and this follows FSDP). Every replicated parameter that requires a
    gradient must receive one in each synchronised backward, on every rank.

    Args:
        model: The partly sharded model; calling it again adds parameters that became unowned.
        mesh: The ranks to replicate over. None: a 1-D mesh over all ranks, which is the right one
            whenever the sharded groups also span all ranks (FSDP and HSDP both average over
            every rank).

    Returns:
        `model`, its unowned parameters replicated.

    Raises:
        RuntimeError: If no process group is initialised.
        ValueError: If an unowned parameter is on the meta device, or `mesh` spans another number
            of ranks than the mesh the model's replicated parameters already use.
    """
    params = unowned_params(model)
    _check_ready(model, params)
    if mesh is None:
        mesh = init_device_mesh(mesh_device_type(), (dist.get_world_size(),))
    existing = replicated_params_of(model)
    new = {n: p for n, p in params.items() if existing is None or n not in existing.params}
    if not new:
        log_rank_zero("f2.replicate: every parameter of %s is already sharded or replicated.", type(model).__name__)
        return model
    if existing is None:
        replicated = ReplicatedParams(new, mesh, REPLICATE_REASON)
        engine_state(model).replicated = replicated
    else:
        if existing.mesh.size() != mesh.size():
            raise ValueError(
                f"f2.replicate(mesh=...) spans {mesh.size()} ranks but this model's replicated parameters use "
                f"a mesh of {existing.mesh.size()}; pass the same mesh (or none)."
            )
        existing.add(new, REPLICATE_REASON)
        replicated = existing
    replicated.move_to(mesh_device(mesh))
    replicated.broadcast()
    _broadcast_buffers(model, mesh)
    return model


@torch.no_grad()
def _broadcast_buffers(model: nn.Module, mesh: DeviceMesh) -> None:
    device = mesh_device(mesh)
    group = mesh.get_group(0) if mesh.ndim == 1 else None
    for owner in model.modules():
        for name, buf in owner.named_buffers(recurse=False):
            if buf is None:
                continue
            if buf.device != device:
                setattr(owner, name, buf.to(device))
                buf = getattr(owner, name)
            if group is None:
                dist.broadcast(buf, src=0)
            else:
                dist.broadcast(buf, group=group, group_src=0)

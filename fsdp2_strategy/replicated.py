"""Parameters FSDP2 cannot shard, kept replicated and synchronised by hand.

`fully_shard` refuses 0-dim parameters ("fully_shard doesn't support scalar parameters"),
e.g. a learned temperature. Instead of refusing the model, such parameters are passed to
FSDP as ignored, made identical on every rank (broadcast from rank 0), and their gradients
are averaged over the mesh after each backward, as FSDP does for the sharded ones. Sync is
skipped under `no_sync`, like FSDP's reduce-scatter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

ATTR = "_fsdp2_replicated"


class ReplicatedParams:
    """Plain parameters replicated over `mesh`, gradients averaged after accumulation."""

    def __init__(self, params: dict[str, nn.Parameter], mesh: DeviceMesh):
        self.params = params
        self.mesh = mesh
        self.requires_sync = True
        self._groups = [mesh.get_group(d) for d in range(mesh.ndim)]
        for p in params.values():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._average_grad)

    def move_to(self, device: torch.device) -> None:
        """FSDP leaves ignored parameters where they are; put them on the mesh device."""
        for p in self.params.values():
            if p.device != device and p.device.type != "meta":
                p.data = p.data.to(device)

    @torch.no_grad()
    def broadcast(self) -> None:
        """Make every rank hold rank 0's values (each mesh dim in turn covers the whole mesh)."""
        for p in self.params.values():
            for group in self._groups:
                if dist.get_world_size(group) > 1:
                    dist.broadcast(p.data, group=group, group_src=0)

    def _average_grad(self, param: torch.Tensor) -> None:
        if not self.requires_sync or param.grad is None:
            return
        grad = param.grad
        for group in self._groups:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
        grad.div_(self.mesh.size())


def replicated_params_of(model: nn.Module) -> ReplicatedParams | None:
    """The `ReplicatedParams` that `shard_model` attached to `model`, if any."""
    return getattr(model, ATTR, None)


def find_scalar_params(model: nn.Module, exclude: set[int]) -> dict[str, nn.Parameter]:
    """0-dim parameters by qualified name, skipping ids in `exclude` (ignored modules)."""
    return {n: p for n, p in model.named_parameters() if p.ndim == 0 and id(p) not in exclude}

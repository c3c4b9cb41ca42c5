"""Parameters FSDP2 cannot shard, kept replicated and synchronised by hand.

`fully_shard` refuses 0-dim parameters ("fully_shard doesn't support scalar parameters"),
e.g. a learned temperature. Instead of refusing the model, such parameters are passed to
FSDP as ignored, made identical on every rank (broadcast from rank 0), and their gradients
are averaged over the mesh after each backward, as FSDP does for the sharded ones. Sync is
skipped under `no_sync`, like FSDP's reduce-scatter. `f2.replicate` adds the parameters no
FSDP group owns to the same object, with its own reason (one plan row per reason).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

SCALAR_REASON = "0-dim: fully_shard cannot shard it; grads averaged"


class ReplicatedParams:
    """Plain parameters replicated over `mesh`, gradients averaged after accumulation."""

    def __init__(self, params: dict[str, nn.Parameter], mesh: DeviceMesh, reason: str = SCALAR_REASON):
        self.params: dict[str, nn.Parameter] = {}
        self.reasons: dict[str, str] = {}
        """Why each parameter is replicated (one plan row per reason)."""
        self.mesh = mesh
        self.requires_sync = True
        self._groups = [mesh.get_group(d) for d in range(mesh.ndim)]
        self.add(params, reason)

    def add(self, params: dict[str, nn.Parameter], reason: str) -> None:
        """Replicate more parameters over the same mesh (hooks registered once per parameter)."""
        for name, p in params.items():
            if name in self.params:
                continue
            self.params[name] = p
            self.reasons[name] = reason
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._average_grad)

    def by_reason(self) -> dict[str, dict[str, nn.Parameter]]:
        """Parameters grouped by why they are replicated, in insertion order."""
        rows: dict[str, dict[str, nn.Parameter]] = {}
        for name, p in self.params.items():
            rows.setdefault(self.reasons[name], {})[name] = p
        return rows

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


def find_scalar_params(model: nn.Module, exclude: set[int]) -> dict[str, nn.Parameter]:
    """0-dim parameters by qualified name, skipping ids in `exclude` (ignored modules)."""
    return {n: p for n, p in model.named_parameters() if p.ndim == 0 and id(p) not in exclude}

"""Materialising a meta-device model after sharding.

A model built under `torch.device("meta")` has shapes but no storage. After `fully_shard`
its parameters are sharded DTensors, so `to_empty` allocates only each rank's shard; the
model's own initialisation then fills them (DTensor random ops keep ranks consistent).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from . import _torch_compat as tc
from .mesh import mesh_device


def has_meta_tensors(model: nn.Module) -> bool:
    """True when any parameter or buffer lives on the meta device."""
    return any(t.is_meta for t in model.parameters()) or any(b.is_meta for b in model.buffers())


def move_to_meta(model: nn.Module) -> None:
    """Replace every parameter and buffer by a meta tensor of the same shape, keeping ties.

    `model.to("meta")` makes one new Parameter per module attribute, so a weight shared by
    two modules (an embedding tied to the head) would come back as two parameters.
    """
    memo: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table, make in zip(tc.tensor_tables(module), (_meta_param, _meta_buffer)):
            for name, tensor in list(table.items()):
                if tensor is not None:
                    if id(tensor) not in memo:
                        memo[id(tensor)] = make(tensor)
                    table[name] = memo[id(tensor)]


def _meta_param(p: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)


def _meta_buffer(b: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(b, device="meta")


def _has_init_weights(model: nn.Module) -> bool:
    return callable(getattr(model, "init_weights", None))


def check_initialisable(model: nn.Module) -> None:
    """Refuse, before any sharding, a meta model that nothing could initialise.

    Without `init_weights()` on the model, every module that directly owns parameters or
    buffers must define `reset_parameters()`; otherwise those tensors would silently keep
    the uninitialised memory `to_empty` returns.
    """
    if _has_init_weights(model):
        return
    missing = [
        f"{name or '<root>'} ({type(m).__name__})"
        for name, m in model.named_modules()
        if (any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False)))
        and not callable(getattr(m, "reset_parameters", None))
    ]
    if missing:
        raise ValueError(
            "The model is on the meta device but these modules own tensors and define no "
            f"reset_parameters(): {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}. "
            "Define init_weights() on the model (it is called after sharding) or reset_parameters() on them, "
            "or load real weights with fsdp2_strategy.load_full_weights after building it on the meta device."
        )


@torch.no_grad()
def materialize(model: nn.Module, mesh: DeviceMesh) -> None:
    """Allocate each rank's shards on the mesh device and run the model's initialisation."""
    model.to_empty(device=mesh_device(mesh))
    if _has_init_weights(model):
        model.init_weights()
        return
    for module in model.modules():
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()

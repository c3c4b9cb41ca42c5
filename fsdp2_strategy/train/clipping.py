"""Gradient clipping for sharded models: one global norm over DTensor (any meshes) and plain gradients."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from .. import _torch_compat as tc


def _grads(parameters: torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    seen: set[int] = set()
    grads = []
    for p in parameters:
        if p.grad is not None and id(p) not in seen:
            seen.add(id(p))
            grads.append(p.grad)
    return grads


def _mesh_key(grad: torch.Tensor):
    if isinstance(grad, DTensor):
        return (id(grad.device_mesh), tuple(grad.placements))
    return ("plain", grad.device)


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip gradients by their global norm, over DTensor (any meshes) and plain parameters.

    The norm is computed per mesh/placement group (the DTensor norm reduces over the shards),
    then combined, so groups on different meshes (per-module strategies, HSDP) and replicated
    plain parameters count exactly once. No host sync happens unless the caller asks for
    `.item()` of the result.

    Args:
        parameters: A tensor or an iterable of tensors (a model's parameters) whose gradients are
            clipped in place; parameters without a gradient are skipped, repeated ones counted once.
        max_norm: The largest total norm the gradients keep.
        norm_type: The order of the norm (`float("inf")` for the largest absolute value).
        error_if_nonfinite: Raise when the total norm is NaN or infinite instead of scaling by it.
        foreach: Passed to `torch.nn.utils.get_total_norm` (None: torch's default).

    Returns:
        The total norm before clipping, a plain 0-dim tensor on the gradients' device (a CPU
        `tensor(0.0)` when no parameter has a gradient).

    Raises:
        RuntimeError: If `error_if_nonfinite` is True and the total norm is NaN or infinite.
    """
    grads = _grads(parameters)
    norm_type = float(norm_type)
    if not grads:
        return torch.tensor(0.0)
    buckets: dict = defaultdict(list)
    for g in grads:
        buckets[_mesh_key(g)].append(g)
    norms = []
    for bucket in buckets.values():
        norm = torch.nn.utils.get_total_norm(bucket, norm_type, error_if_nonfinite=False, foreach=foreach)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norms.append(norm)
    device = norms[0].device
    stacked = torch.stack([n.to(device=device, dtype=torch.float32) for n in norms])
    total = stacked.max() if math.isinf(norm_type) else torch.linalg.vector_norm(stacked, norm_type)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} of the gradients is non-finite; set error_if_nonfinite=False to skip this check."
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    _scale_(grads, coef)
    return total


def _scale_(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    by_device: dict = defaultdict(list)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        by_device[(local.device, local.dtype)].append(local)
    for (device, _), tensors in by_device.items():
        tc.foreach_mul_(tensors, coef.to(device))


def clip_grad_value_(parameters: torch.Tensor | Iterable[torch.Tensor], clip_value: float) -> None:
    """Clamp every gradient element to [-clip_value, clip_value] (elementwise, no communication).

    Args:
        parameters: A tensor or an iterable of tensors whose gradients are clamped in place
            (the local shards of DTensor gradients); parameters without a gradient are skipped.
        clip_value: The largest absolute value a gradient element keeps.
    """
    for g in _grads(parameters):
        local = g.to_local() if isinstance(g, DTensor) else g
        local.clamp_(-clip_value, clip_value)

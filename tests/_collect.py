"""What the flow scripts (tests/*_scripts/) and the tests reading their reports share: full copies of
sharded values, per-rank results gathered in rank order, relative differences, rank 0's JSON report."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def full(t: torch.Tensor) -> torch.Tensor:
    """Unsharded float copy (full_tensor() is a collective: every rank calls this)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().clone()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p) for n, p in model.named_parameters()}


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p.grad) for n, p in model.named_parameters()}


def gather(obj):
    """Every rank's `obj`, in rank order (a plain list in one process)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def max_rel_diff(a: dict, b: dict) -> float:
    """Largest relative difference ||a[k] - b[k]|| / ||b[k]|| over the keys of `b`."""
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)).item() for k in b)


def close_lists(a: list[float], b: list[float], tol: float) -> bool:
    """Same length and every a[i] within `tol` of b[i], relatively."""
    return len(a) == len(b) and all(abs(x - y) <= tol * max(abs(y), 1e-8) for x, y in zip(a, b))


def write_json(path: str, result: dict) -> None:
    """Rank 0 (or the only process) writes `result`."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(path).write_text(json.dumps(result, indent=1, default=str))

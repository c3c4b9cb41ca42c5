"""Shared pieces of the Fabric flow scripts: a small model, data, one-process references."""

from __future__ import annotations

import copy

import torch
from helpers.collect import full_params, max_rel_diff  # noqa: F401  (re-exported to the scripts)
from helpers.models import MLP  # noqa: F401  (re-exported to the scripts)
from torch import nn

import fsdp2_strategy.integrations.fabric  # noqa: F401  registers "fsdp2" in Fabric

LR = 0.1
N_SAMPLES = 16


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(N_SAMPLES, 8, generator=g), torch.randn(N_SAMPLES, 1, generator=g)


def fresh(seed: int = 0) -> tuple[MLP, MLP]:
    """A model and an identical copy (the one-process reference)."""
    torch.manual_seed(seed)
    model = MLP()
    return model, copy.deepcopy(model)


def rank_slice(rank: int, world: int, batch: slice) -> slice:
    """This rank's contiguous part of the global batch `batch`."""
    per = (batch.stop - batch.start) // world
    return slice(batch.start + rank * per, batch.start + (rank + 1) * per)


def loss_on(model: nn.Module, sl: slice) -> torch.Tensor:
    xs, ys = data()
    return nn.functional.mse_loss(model(xs[sl]).float(), ys[sl])


def reference_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[slice], clip: tuple | None = None
) -> list[float | None]:
    """One process: one optimizer step per global batch; returns the grad norms (norm clipping)."""
    norms = []
    for sl in batches:
        loss_on(model, sl).backward()
        norm = None
        if clip and clip[0] == "norm":
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip[1]).item()
        elif clip:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip[1])
        optimizer.step()
        optimizer.zero_grad()
        norms.append(norm)
    return norms


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}

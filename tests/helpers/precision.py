"""Independent references for mixed precision: what a policy promises, written out in one process
without the engine, so that a precision bug in the engine cannot cancel out against itself.

A policy with compute dtype `dtype`, fp32 master weights and fp32 reduction promises: each rank runs
its micro-batch on a copy of the fp32 weights cast to `dtype`; its gradients, cast to fp32, are
averaged over the ranks (and summed over micro-batches) in fp32; the optimizer updates the fp32
weights with fp32 state. Two details follow the engine: replicated scalars (0-dim, outside FSDP's
groups) are not cast, and each use of a tied weight gets its own leaf, so its contributions are
added in fp32. torch adds them in `dtype` within one backward (2.13; 2.15 when gradient sync is on):
tied weights differ from the reference by at most one rounding of `dtype`, `TIED_TOL` for bf16.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

TIED_TOL = 2.0**-8  # bf16's unit roundoff: one rounding of a sum
UPDATE_TOL = 1e-6  # the same optimizer arithmetic on the same fp32 inputs (measured 0)


def cast_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` with every parameter of 1 or more dims cast to `dtype`, tied weights untied."""
    low = copy.deepcopy(model)
    for name, param in model.named_parameters(remove_duplicate=False):
        owner, _, attr = name.rpartition(".")
        value = param.detach().clone() if param.ndim == 0 else param.detach().to(dtype)
        setattr(low.get_submodule(owner), attr, nn.Parameter(value, requires_grad=param.requires_grad))
    return low


def tied_names(model: nn.Module) -> list[str]:
    """The names `named_parameters()` reports for parameters that have more than one name."""
    counts: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        counts[id(param)] = counts.get(id(param), 0) + 1
    return [n for n, p in model.named_parameters() if counts[id(p)] > 1]


def policy_grads(
    model: nn.Module,
    rank_batches: Sequence[Sequence[tuple]],
    loss: Callable[..., torch.Tensor],
    dtype: torch.dtype,
    scale: float = 1.0,
    cast: Callable[[nn.Module], nn.Module] | None = None,
) -> dict[str, torch.Tensor]:
    """fp32 gradients of `model`'s weights as the policy promises them.

    `rank_batches[r]` lists rank r's micro-batches, each the argument tuple of `loss(low_model, *args)`;
    every micro-batch loss is multiplied by `scale` (1/k for k micro-batches). `cast(model)` makes the
    low-precision copy (default `cast_copy(model, dtype)`; per-module policies write their own).
    """
    canonical = {}  # every name a parameter has -> the name named_parameters() reports
    for name, param in model.named_parameters(remove_duplicate=False):
        canonical[name] = next(n for n, p in model.named_parameters() if p is param)
    total = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in model.named_parameters()}
    world = len(rank_batches)
    for batches in rank_batches:
        for args in batches:
            low = cast(model) if cast is not None else cast_copy(model, dtype)
            (loss(low, *args) * scale).backward()
            for name, param in low.named_parameters(remove_duplicate=False):
                if param.grad is not None:
                    total[canonical[name]] += param.grad.float() / world
    return total


def true_precision_update(
    model: nn.Module, rank_batches: Sequence[tuple], loss: Callable[..., torch.Tensor], dtype: torch.dtype, lr: float
) -> dict[str, torch.Tensor]:
    """The weights (as fp32) one SGD step gives in pure `dtype` ("bf16-true"): weights, compute, the
    average over ranks and the update all in `dtype`. `rank_batches[r]` is rank r's argument tuple of
    `loss(low_model, *args)`."""
    low = copy.deepcopy(model).to(dtype)
    grads = {n: torch.zeros_like(p) for n, p in low.named_parameters()}
    for args in rank_batches:
        step = copy.deepcopy(low)
        loss(step, *args).backward()
        for n, p in step.named_parameters():
            grads[n] += p.grad / len(rank_batches)
    return {n: p.detach().clone().add_(grads[n], alpha=-lr).float() for n, p in low.named_parameters()}


def with_weights(template: nn.Module, weights: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of `template` holding `weights` (full fp32 tensors by parameter name)."""
    model = copy.deepcopy(template)
    for name, param in model.named_parameters():
        param.data.copy_(weights[name])
    return model

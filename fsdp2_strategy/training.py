"""Training-loop helpers that understand sharded models: accumulation, clipping, optimizer checks."""

from __future__ import annotations

import contextlib
import math
import weakref
from collections import defaultdict
from typing import Iterable, Iterator, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from . import _torch_compat as tc
from . import accumulation

_REPLACED = "_fsdp2_replaced_by_sharding"


# --------------------------------------------------------------------------- accumulation
def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn gradient reduction off before a non-final micro-batch, on before the last one.

    What "off" skips follows the model's `FSDP2Config.accumulation` mode: the reduce-scatter
    ("sync_last"), also the re-gathering of parameters ("keep_gathered"), or only HSDP's
    replicate all-reduce ("sync_each"). Replicated scalar parameters sync on the last only.
    """
    if enabled:
        accumulation.resume_sync(model)
    else:
        accumulation.pause_sync(model)


@contextlib.contextmanager
def no_sync(*models: nn.Module) -> Iterator[None]:
    """Accumulate without the full reduction inside the context (all micro-batches but the last).

    Follows each model's `FSDP2Config.accumulation` mode (default "sync_last": gradients
    accumulate unreduced on each rank and the first backward outside the context reduces the
    sum). Sync is switched back on when the context exits; on an exception, parameters that
    "keep_gathered" held unsharded are also resharded.
    """
    try:
        for model in models:
            set_gradient_sync(model, False)
        yield
    except BaseException:
        for model in models:
            accumulation.abandon(model)
        raise
    else:
        for model in models:
            set_gradient_sync(model, True)


# --------------------------------------------------------------------------- clipping
def _grads(parameters: Union[torch.Tensor, Iterable[torch.Tensor]]) -> list[torch.Tensor]:
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
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip gradients by their global norm, over DTensor (any meshes) and plain parameters.

    The norm is computed per mesh/placement group (the DTensor norm reduces over the shards),
    then combined, so groups on different meshes (per-module strategies, HSDP) and replicated
    plain parameters count exactly once. Returns the total norm as a plain 0-dim tensor on the
    gradients' device: no host sync happens unless the caller asks for `.item()`.
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


def clip_grad_value_(parameters: Union[torch.Tensor, Iterable[torch.Tensor]], clip_value: float) -> None:
    """Clamp every gradient element to [-clip_value, clip_value] (elementwise, no communication)."""
    for g in _grads(parameters):
        local = g.to_local() if isinstance(g, DTensor) else g
        local.clamp_(-clip_value, clip_value)


# --------------------------------------------------------------------------- optimizer check
_checked: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_hook_handle = None


def mark_replaced_params(before: list[nn.Parameter], model: nn.Module) -> None:
    """Mark parameters that sharding replaced, so an optimizer still holding them is caught."""
    current = {id(p) for p in model.parameters()}
    for p in before:
        if id(p) not in current:
            setattr(p, _REPLACED, True)
    _install_optimizer_check()


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise if `optimizer` holds parameters that `shard_model` replaced (built too early)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, _REPLACED, False):
                raise ValueError(
                    f"{type(optimizer).__name__} was created before shard_model(): it holds the original, "
                    "unsharded parameters, which no longer receive gradients. Create the optimizer after "
                    "shard_model(model), from model.parameters()."
                )


def _optimizer_pre_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    # Checked once per optimizer, at its first step: later steps cost nothing.
    if optimizer in _checked:
        return
    check_optimizer(optimizer)
    _checked.add(optimizer)


def _install_optimizer_check() -> None:
    global _hook_handle
    if _hook_handle is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _hook_handle = register_optimizer_step_pre_hook(_optimizer_pre_step)

"""Optimizer state and step temporaries, measured by stepping the optimizer on meta tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import _torch_compat as tc
from .sim_sizes import GroupSizes
from .simulate import LiveBytes

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps),
    "adam": lambda ps: torch.optim.Adam(ps),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd_plain": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "adagrad": lambda ps: torch.optim.Adagrad(ps),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps),
}


def optimizer_factory(spec: Any) -> Callable[[list], torch.optim.Optimizer] | None:
    """Turn an optimizer name, class or factory into `params -> optimizer` (None: no optimizer)."""
    if spec is None or spec == "none":
        return None
    if isinstance(spec, str):
        if spec.lower() not in OPTIMIZERS:
            raise ValueError(
                f"optimizer={spec!r} is unknown; use one of {sorted(OPTIMIZERS) + ['none']}, "
                "an optimizer class or a callable params -> optimizer."
            )
        return OPTIMIZERS[spec.lower()]
    if isinstance(spec, type) and issubclass(spec, torch.optim.Optimizer):
        optimizer_cls: Any = spec  # SGD needs an lr; the others have defaults
        return lambda ps: optimizer_cls(ps, lr=0.1) if optimizer_cls is torch.optim.SGD else optimizer_cls(ps)
    if callable(spec):
        return spec
    raise ValueError(
        f"optimizer={spec!r} is invalid; use a name, an optimizer class or a callable params -> optimizer."
    )


def measure_optimizer(spec: Any, sizes: dict[str, GroupSizes], device_type: str = "cpu") -> tuple[int, int]:
    """(state bytes, step temporaries) of the optimizer on this rank's shards, stepped on meta.

    The trainable shards are stood in for by one flat meta tensor per group and dtype-size (the state is
    elementwise for the optimizers named here; a factory given by the user is measured the same way).
    `device_type` is where the step runs (the host under CPU offload): it decides the kernels, as below.
    """
    factory = optimizer_factory(spec)
    if factory is None:
        return 0, 0
    params = [
        nn.Parameter(torch.empty(g.trainable_sharded // 4, device="meta"))
        for g in sizes.values()
        if g.trainable_sharded
    ]
    for p in params:
        p.grad = torch.empty_like(p)
    opt = factory(params)
    _choose_kernels_as_on(opt, device_type)
    opt.step()  # creates the state
    state = sum(
        t.untyped_storage().nbytes()
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.device.type == "meta"
    )
    tracker = LiveBytes()
    tracker.ignore(
        [
            *params,
            *(p.grad for p in params),
            *(t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)),
        ]
    )
    with tracker:
        opt.step()
    return state, tracker.peak


def _choose_kernels_as_on(opt: torch.optim.Optimizer, device_type: str) -> None:
    """Set the foreach choice torch makes on `device_type` where the optimizer leaves it to torch.

    On devices with foreach kernels (CUDA, XPU, ...) an optimizer with `foreach=None` steps all its
    parameters at once: AdamW's `sqrt(v)` is one temporary the size of every parameter together
    (4 bytes a parameter: a quarter of the state, the peak of a large model's step). Meta tensors
    would take the one-parameter-at-a-time path, whose temporary is one parameter's size.
    """
    if device_type not in tc.foreach_devices():
        return
    for group in opt.param_groups:
        if "foreach" in group and group["foreach"] is None and not group.get("fused"):
            group["foreach"] = True

"""Frozen parameters (`requires_grad=False`, e.g. a LoRA model's base) stored in their compute dtype.

FSDP2 allocates gradients and reduce-scatters only for parameters that require them, and an
optimizer built from the trainable parameters keeps no state for the rest; so a frozen parameter
costs only its own storage. Under "bf16" mixed precision FSDP casts every parameter to bf16 before
the all-gather: keeping the frozen ones in bf16 from the start computes exactly the same numbers
and halves their bytes (`FSDP2Config.frozen_dtype`). Trainable parameters in the same group keep
fp32 (torch requires one original dtype among a group's trainable parameters only).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from ..groups import GroupSpec
from ..precision import frozen_storage_dtype


def cast_frozen(model: nn.Module, specs: Iterable[GroupSpec], frozen_dtype: Any, skip: set) -> None:
    """Cast each frozen parameter of a group to `frozen_dtype` ("auto": the owning group's compute
    dtype, if it has one) in place (ties kept: the same Parameter object changes). Parameters in
    `skip` (ignored, replicated, quantised) are left."""
    if frozen_dtype is None:
        return
    seen: set[int] = set()
    for spec in reversed(list(specs)):  # children first: a parameter's owner is its deepest group
        params = [p for member in spec.modules for p in model.get_submodule(member).parameters()]
        for p in params:
            if id(p) in seen or p in skip:
                continue
            seen.add(id(p))
            dtype = frozen_storage_dtype(frozen_dtype, spec.settings.mp_policy.param_dtype, p)
            if not p.requires_grad and p.dtype != dtype:
                p.data = p.data.to(dtype)

"""Lightning precision plugins for `strategy="fsdp2"`: precision strings onto FSDP2 policies.

| `Trainer(precision=...)` | weights (sharded) | compute                      | gradient reduction |
|--------------------------|-------------------|------------------------------|--------------------|
| "32-true"                | fp32              | fp32                         | fp32               |
| "bf16-mixed"             | fp32              | bf16 (FSDP2 policy+autocast) | fp32               |
| "16-mixed"               | fp32              | fp16 (FSDP2 policy+autocast) | fp32, loss scaled by `ShardedGradScaler` |
| "bf16-true" / "16-true"  | bf16 / fp16       | bf16 / fp16                  | bf16 / fp16        |

Every plugin clips gradients through the core (`fsdp2_strategy.clip_grad_norm_`): one
global norm over all shards and meshes, equal to the single-process norm.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch.optim import Optimizer

import fsdp2_strategy as f2

from .._lightning_shared import MIXED_POLICY, SUPPORTED_PRECISION, mixed_scaler, swap_plugin

__all__ = ["SUPPORTED_PRECISION", "FSDP2Precision", "FSDP2MixedPrecision", "FSDP2HalfPrecision", "to_fsdp2_precision"]


class _ShardedClipping:
    """Clip with the core: Lightning's default (`torch.nn.utils.clip_grad_norm_`) fails on
    parameters of several meshes, and Lightning's FSDP plugin refuses norm clipping outright."""

    fsdp2_mixed_precision: str | None = None
    """The core mixed-precision policy the strategy applies when sharding (None: none)."""

    last_grad_norm: torch.Tensor | None = None
    """Total gradient norm (before clipping) of the last `gradient_clip_algorithm="norm"` step."""

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        self.last_grad_norm = f2.clip_grad_norm_(list(self.main_params(optimizer)), clip_val)

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: float) -> None:
        f2.clip_grad_value_(list(self.main_params(optimizer)), clip_val)


class FSDP2Precision(_ShardedClipping, Precision):
    """FSDP2 precision plugin for "32-true": fp32 everywhere."""


class FSDP2MixedPrecision(_ShardedClipping, MixedPrecision):
    """FSDP2 precision plugin for "bf16-mixed" / "16-mixed": fp32 weights, low-precision compute.

    The sharded weights and the gradient reduction stay in fp32.

    FSDP2 casts each group's gathered parameters (its mixed-precision policy) and autocast
    keeps numerically sensitive ops (softmax, norms, losses) in fp32. "16-mixed" scales the
    loss with `ShardedGradScaler`, which agrees on inf/NaN across ranks so that every rank
    skips the same steps.
    """

    def __init__(self, precision: str, device: str = "cpu", scaler: Any | None = None) -> None:
        scaler = mixed_scaler("FSDP2MixedPrecision", precision, device, scaler)
        super().__init__(precision, device, scaler)
        self.fsdp2_mixed_precision = MIXED_POLICY[precision]


class FSDP2HalfPrecision(_ShardedClipping, HalfPrecision):
    """FSDP2 precision plugin for "bf16-true" / "16-true": everything in that dtype.

    The module is cast before sharding, so shards, compute and reduction are all in that dtype."""


def to_fsdp2_precision(plugin: Precision | None) -> Precision | None:
    """The FSDP2 plugin for the one Lightning chose from `Trainer(precision=...)`.

    Raises ValueError for plugins FSDP2 cannot honour (64-bit, Transformer Engine,
    bitsandbytes, custom plugins), naming the precision strings that work.
    """
    swaps = {Precision: FSDP2Precision, MixedPrecision: FSDP2MixedPrecision, HalfPrecision: FSDP2HalfPrecision}
    return swap_plugin(plugin, _ShardedClipping, swaps, "Trainer")

"""Fabric precision plugins for `strategy="fsdp2"`: the Trainer adapter's precision table, in Fabric.

| `Fabric(precision=...)` | weights (sharded) | compute                      | gradient reduction |
|-------------------------|-------------------|------------------------------|--------------------|
| "32-true"               | fp32              | fp32                         | fp32               |
| "bf16-mixed"            | fp32              | bf16 (FSDP2 policy+autocast) | fp32               |
| "16-mixed"              | fp32              | fp16 (FSDP2 policy+autocast) | fp32, loss scaled by `ShardedGradScaler` |
| "bf16-true" / "16-true" | bf16 / fp16       | bf16 / fp16                  | bf16 / fp16        |

Clipping is the strategy's (`FSDP2FabricStrategy.clip_gradients_norm`), not the plugin's: in
Fabric the strategy clips.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision

from .._lightning_shared import MIXED_POLICY, SUPPORTED_PRECISION, mixed_scaler, swap_plugin

__all__ = [
    "FSDP2FabricHalfPrecision",
    "FSDP2FabricMixedPrecision",
    "FSDP2FabricPrecision",
    "precision_for",
    "to_fsdp2_precision",
]


class _FSDP2Policy:
    fsdp2_mixed_precision: str | None = None
    """The core mixed-precision policy the strategy applies when sharding (None: none)."""


class FSDP2FabricPrecision(_FSDP2Policy, Precision):
    """FSDP2 precision plugin for "32-true": fp32 everywhere."""


class FSDP2FabricMixedPrecision(_FSDP2Policy, MixedPrecision):
    """FSDP2 precision plugin for "bf16-mixed" / "16-mixed": fp32 weights, low-precision compute.

    The sharded weights and the gradient reduction stay in fp32.

    "16-mixed" scales the loss with `ShardedGradScaler`, which agrees on inf/NaN across ranks so
    that every rank skips the same steps (Fabric's default `torch.amp.GradScaler` checks per rank).
    """

    def __init__(self, precision: str, device: str = "cpu", scaler: Any | None = None) -> None:
        scaler = mixed_scaler("FSDP2FabricMixedPrecision", precision, device, scaler)
        super().__init__(precision, device, scaler)  # type: ignore[arg-type]
        self.fsdp2_mixed_precision = MIXED_POLICY[precision]


class FSDP2FabricHalfPrecision(_FSDP2Policy, HalfPrecision):
    """FSDP2 precision plugin for "bf16-true" / "16-true": everything in that dtype.

    The module is cast before sharding (Fabric's `setup` calls `convert_module` first), so
    shards, compute and reduction are all in that dtype."""


def precision_for(precision: str | None, device_type: str) -> Precision:
    """The FSDP2 plugin for a `Fabric(precision=...)` string (None: "32-true").

    Raises ValueError for strings FSDP2 cannot honour ("64-true", Transformer Engine), naming
    the ones that work.
    """
    if precision in (None, "32-true"):
        return FSDP2FabricPrecision()
    if precision in MIXED_POLICY:
        return FSDP2FabricMixedPrecision(precision, device_type)
    if precision in ("bf16-true", "16-true"):
        return FSDP2FabricHalfPrecision(precision)  # type: ignore[arg-type]
    raise ValueError(
        f"Fabric(strategy='fsdp2', precision={precision!r}) is not supported by FSDP2; use one of: "
        + ", ".join(SUPPORTED_PRECISION)
        + "."
    )


def to_fsdp2_precision(plugin: Precision | None) -> Precision | None:
    """The FSDP2 plugin for a plain Fabric plugin (`plugins=...`, or chosen by Fabric); FSDP2
    plugins pass through. Raises ValueError for plugins FSDP2 cannot honour (64-bit,
    Transformer Engine, bitsandbytes, custom), naming the precision strings that work."""
    swaps = {
        Precision: FSDP2FabricPrecision,
        MixedPrecision: FSDP2FabricMixedPrecision,
        HalfPrecision: FSDP2FabricHalfPrecision,
    }
    return swap_plugin(plugin, _FSDP2Policy, swaps, "Fabric")

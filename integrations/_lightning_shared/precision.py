"""Precision strings and plugins for `strategy="fsdp2"`, the same in the Trainer and in Fabric:
what each string means for the core, and Lightning's own plugins swapped for the FSDP2 ones."""

from __future__ import annotations

from typing import Any

from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
"""The precision strings `strategy="fsdp2"` honours, in the Trainer and in Fabric."""

MIXED_POLICY = {"bf16-mixed": "bf16", "16-mixed": "fp16"}
"""Precision string -> core `FSDP2Config.mixed_precision` name (the "-mixed" strings only)."""


def plugin_property(attribute: str, default: type, swap: Any) -> property:
    """The strategy's precision-plugin property (Fabric: `precision`, the Trainer: `precision_plugin`),
    stored in `attribute`: reads the plugin or a `default()` one; a plugin assigned to it (Lightning
    picks one from `precision=...`, or the user passes `plugins=`) is swapped by `swap` for its FSDP2
    equivalent, or refused naming the precision strings that work."""

    def get(self: Any) -> Any:
        plugin = getattr(self, attribute)
        return plugin if plugin is not None else default()

    def set_(self: Any, plugin: Any) -> None:
        setattr(self, attribute, swap(plugin))

    return property(get, set_, doc=f"The FSDP2 precision plugin (stored in `{attribute}`).")


def mixed_scaler(owner: str, precision: str, device: str, scaler: Any | None) -> Any | None:
    """The loss scaler of a "-mixed" plugin: `ShardedGradScaler` for "16-mixed" (it agrees on
    inf/NaN across ranks, so every rank skips the same steps; Lightning's default
    `torch.amp.GradScaler` checks per rank). Raises ValueError for a string that is not "-mixed"."""
    if precision not in MIXED_POLICY:
        raise ValueError(f"{owner}(precision={precision!r}) is invalid; use 'bf16-mixed' or '16-mixed'.")
    if precision == "16-mixed" and scaler is None:
        return ShardedGradScaler(device=device)
    return scaler


def swap_plugin(plugin: Any, ours: type, swaps: dict[type, type], front_door: str) -> Any:
    """The FSDP2 plugin for one of Lightning's: `swaps` maps Lightning's Precision, MixedPrecision
    and HalfPrecision (exact types) to ours; FSDP2 plugins (`ours`) and None pass through.

    Raises ValueError for plugins FSDP2 cannot honour (64-bit, Transformer Engine, bitsandbytes,
    custom), naming the precision strings that work (`front_door`: "Trainer" or "Fabric").
    """
    if plugin is None or isinstance(plugin, ours):
        return plugin
    kind = type(plugin)
    target = swaps.get(kind)
    if target is None:
        raise ValueError(
            f"strategy='fsdp2' cannot honour the precision plugin {kind.__name__}"
            f" (precision={getattr(plugin, 'precision', None)!r}). Use {front_door}(precision=...) with one of: "
            + ", ".join(SUPPORTED_PRECISION)
            + "."
        )
    precision = getattr(plugin, "precision", None)
    if precision in MIXED_POLICY:
        return target(precision, plugin.device)  # its scaler replaced by the sharded one
    return target(precision) if precision not in (None, "32-true") else target()

"""Per-step throughput for `FSDP2Accelerator(log_throughput_every=N)`: the core's hooks on the first
prepared model and optimizer, reports through `Accelerator.log` (the configured trackers, main
process only)."""

from __future__ import annotations

from typing import Any

import fsdp2_strategy as f2

from . import _compat as compat


def attach(accelerator: Any, every: int | None) -> f2.ThroughputTracker | None:
    """A tracker on the first prepared model and optimizer once both exist (None before, or when `every`
    is None); the first optimizer step starts its clock."""
    if every is None:
        return None
    prepared = compat.registries(accelerator)
    if not prepared.models or not prepared.optimizers:
        return None

    def log(metrics: f2.StepMetrics) -> None:
        accelerator.log(metrics.as_log(f2.StepMetrics.TRACKER_PREFIX), step=metrics.step)

    model = prepared.models[0]
    meter = f2.ThroughputMeter(model=model, every=every, log=log, device=accelerator.device)
    return f2.ThroughputTracker(model, prepared.optimizers[0].optimizer, meter)

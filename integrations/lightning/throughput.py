"""`FSDP2ThroughputMonitor`: tokens/s, MFU and peak memory in the Trainer's loggers.

Lightning's own `ThroughputMonitor` needs the FLOPs of a batch from the user, knows no CPU peak
(no MFU there) and reports no memory; this callback asks the core (`f2.ThroughputMeter`) for all
three, counting tokens from the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

import fsdp2_strategy as f2

__all__ = ["FSDP2ThroughputMonitor"]


class FSDP2ThroughputMonitor(pl.Callback):
    """Log tokens/s, MFU and peak memory every `every` optimizer steps (rank 0, the Trainer's loggers).

    Works with any strategy; add it to `Trainer(callbacks=[...])`. Metrics are per rank:
    `throughput/tokens_per_s`, `throughput/step_time_s`, `throughput/mfu` (model FLOPs over the
    device's peak: `f2.flops_per_token` of the LightningModule, `f2.peak_flops`) and
    `throughput/peak_memory_gib`.

    Args:
        every: optimizer steps per report (micro-batches of one step under `accumulate_grad_batches`
            are summed).
        tokens_fn: `batch -> int` tokens of one micro-batch on this rank; default: the elements of
            the batch's "input_ids" (or its first integer tensor), whose last dimension is also the
            sequence length MFU uses.
        flops_per_token: the model's training FLOPs per token, if `f2.flops_per_token` (6 x non-
            embedding parameters + attention, from a Hugging Face config when the module holds one)
            does not fit the model.
        prefix: prepended to each metric's name.

    Raises:
        ValueError: `every` below 1.
    """

    def __init__(
        self,
        every: int = 10,
        *,
        tokens_fn: Callable[[Any], int] | None = None,
        flops_per_token: float | None = None,
        prefix: str = f2.StepMetrics.TRACKER_PREFIX,
    ):
        if every < 1:
            raise ValueError(f"FSDP2ThroughputMonitor(every={every}) is invalid; use a step count of 1 or more.")
        self.every, self.tokens_fn, self.flops_per_token, self.prefix = every, tokens_fn, flops_per_token, prefix
        self.meter: f2.ThroughputMeter | None = None
        self._step = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.meter = f2.ThroughputMeter(
            model=pl_module, flops_per_token=self.flops_per_token, every=self.every, device=pl_module.device
        )
        self.meter.start()
        self._step = trainer.global_step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *_: Any) -> None:
        assert self.meter is not None
        self.meter.add_tokens(self.tokens_fn(batch) if self.tokens_fn is not None else batch)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if self.meter is None or trainer.global_step == self._step:
            return  # no optimizer step in this batch (accumulating)
        self._step = trainer.global_step
        metrics = self.meter.step()
        if metrics is not None and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics.as_log(self.prefix), step=trainer.global_step)

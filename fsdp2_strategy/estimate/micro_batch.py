"""`largest_micro_batch`: the most rows per rank whose training step fits the memory budget.

Memory a setting frees (a sharded optimizer state, the chunked loss, activation checkpointing) turns
into throughput as a larger micro-batch: fewer, larger matrix products and fewer collectives per
token. The estimate of one step (`estimate_memory`) is played for batches of growing size (doubling,
then bisecting between the last that fitted and the first that did not), the example batch's first
dimension resized on the meta device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import _torch_compat as tc
from ..config import FSDP2Config
from ..config_checks import parse_bytes
from .compare import default_budget
from .memory import estimate_memory, human_bytes


@dataclass(frozen=True)
class MicroBatchFit:
    """The largest micro-batch that fits, with the peaks either side of the limit."""

    batch_size: int
    """Rows per rank per micro-batch (the example batch's first dimension)."""
    peak_bytes: int
    """The estimated per-rank peak of a step at `batch_size`."""
    budget_bytes: int
    """The per-rank budget it was fitted to."""
    next_peak_bytes: int | None
    """The estimated peak at `batch_size + 1` (over the budget); None when `max_batch` stopped the search."""

    def __str__(self) -> str:
        over = (
            f"; {self.batch_size + 1} rows need {human_bytes(self.next_peak_bytes)}"
            if self.next_peak_bytes is not None
            else " (the largest tried)"
        )
        return (
            f"largest micro-batch within {human_bytes(self.budget_bytes)} per rank: {self.batch_size} rows "
            f"(peak {human_bytes(self.peak_bytes)}{over})"
        )


def largest_micro_batch(
    model: nn.Module,
    config: FSDP2Config | Mapping[str, Any] | str | None = None,
    *,
    world_size: int,
    example_batch: Any,
    nodes: int = 1,
    optimizer: Any = "adamw",
    memory_budget: int | str | None = None,
    device_type: str | None = None,
    max_batch: int = 4096,
) -> MicroBatchFit:
    """The most rows per rank per micro-batch whose training step fits `memory_budget`.

    Args:
        model: The unsharded model (any device; only copied onto meta), as for `estimate_memory`.
        config: The config the job will shard with (a concrete `sharding_strategy`).
        world_size: Ranks of the job.
        example_batch: One batch (tensors, or a dict/tuple of them) whose first dimension is the
            batch: its other dimensions (the sequence length) are kept, the first one is searched.
        nodes: Machines the ranks span.
        optimizer: As for `estimate_memory`.
        memory_budget: Bytes per rank (an int or text like "80GiB"); None: `config.memory_budget`,
            else the accelerator's memory (on CPU the available RAM per local rank) less 10 %.
        device_type: As for `estimate_memory`.
        max_batch: The largest batch tried.

    Returns:
        The largest batch that fits, its peak and the peak one row more would need.

    Raises:
        ValueError: Even one row does not fit (the message names the peak, the budget and what
            lowers the peak), or an argument is invalid (as `estimate_memory` raises).
    """
    config = FSDP2Config.coerce(config, log_plan=False)
    budget = parse_bytes(memory_budget, "largest_micro_batch(memory_budget)") or config.memory_budget
    budget = budget or default_budget(world_size // max(nodes, 1))
    if max_batch < 1:
        raise ValueError(f"largest_micro_batch(max_batch={max_batch}): use an int >= 1.")

    def peak(rows: int) -> int:
        batch = _with_rows(example_batch, rows)
        return estimate_memory(
            model, config, world_size=world_size, nodes=nodes, optimizer=optimizer, example_batch=batch,
            device_type=device_type,
        ).peak_bytes  # fmt: skip

    return _search(peak, budget, max_batch)


def _search(peak: Callable[[int], int], budget: int, max_batch: int) -> MicroBatchFit:
    """Double while the peak fits, then bisect between the last fit and the first miss."""
    peaks = {1: peak(1)}
    if peaks[1] > budget:
        raise ValueError(
            f"largest_micro_batch: one row needs {human_bytes(peaks[1])} per rank, over the budget of "
            f"{human_bytes(budget)}. Lower the peak (sharding_strategy='FULL_SHARD', activation_checkpointing="
            "'auto', cpu_offload=True, a shorter sequence or context_parallel_size > 1), or raise memory_budget."
        )
    fit, miss = 1, None
    while miss is None and fit < max_batch:
        rows = min(2 * fit, max_batch)
        peaks[rows] = peak(rows)
        fit, miss = (rows, None) if peaks[rows] <= budget else (fit, rows)
    while miss is not None and miss - fit > 1:
        rows = (fit + miss) // 2
        peaks[rows] = peak(rows)
        fit, miss = (rows, miss) if peaks[rows] <= budget else (fit, rows)
    return MicroBatchFit(fit, peaks[fit], budget, peaks[miss] if miss is not None else None)


def _with_rows(batch: Any, rows: int) -> Any:
    """`batch` with the first dimension of every tensor `rows` long, on the meta device."""

    def resized(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t
        return torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device="meta")

    return tc.tree_map_only(torch.Tensor, resized, batch)

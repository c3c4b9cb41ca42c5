"""Compare sharding strategies, recommend one, and choose `sharding_strategy="auto"` by memory
(`resolve_auto`; `fsdp2_strategy.choose` calls it, and the tuner for `objective="throughput"`).

Every row is one `estimate_memory` call on a meta copy; the recommendation is the setting with
the least communication per step that fits the memory budget (ties: no offload, no activation
checkpointing, then the smaller peak), since offload and recomputation cost time too.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..config import SHARDING_STRATEGIES, FSDP2Config
from ..config_checks import parse_bytes
from ..sharding_strategies import strategy as strategy_spec
from .memory import MemoryEstimate, estimate_memory, human_bytes
from .step_time import StepTimeModel, StepTimePrediction

BUDGET_MARGIN = 0.10
"""Share of the device (or of this rank's part of the RAM) kept free when `memory_budget` is not
given: allocator fragmentation, the CUDA context, communication library buffers, and - when no
example batch is known, as inside `shard_model` - the activations."""


@dataclass
class PlanRow:
    """One setting of the comparison."""

    strategy: str
    """Sharding strategy."""
    cpu_offload: bool
    """CPU offload of sharded state."""
    activation_checkpointing: bool
    """Activation checkpointing of the wrapped blocks."""
    estimate: MemoryEstimate
    """Per-rank memory and communication of this setting."""
    fits: bool | None
    """Whether the peak fits the budget (None when no budget was given)."""
    predicted: StepTimePrediction | None = None
    """Predicted step time (`compare_strategies(time=...)`; None without)."""

    @property
    def label(self) -> str:
        extras = [x for x, on in (("offload", self.cpu_offload), ("AC", self.activation_checkpointing)) if on]
        return self.strategy + ("+" + "+".join(extras) if extras else "")


@dataclass
class StrategyComparison:
    """Rows per setting, the budget they were checked against, and the recommendation."""

    rows: list[PlanRow] = field(default_factory=list)
    """Every setting estimated, in the order tried."""
    budget: int | None = None
    """Bytes per rank available (None: no budget, nothing is judged)."""
    recommended: PlanRow | None = None
    """The fitting row with the least communication (None when nothing fits or no budget)."""
    reason: str = ""
    """Why the recommendation was chosen, or why nothing fits."""

    def __str__(self) -> str:
        gib = 2**30
        header: tuple = ("setting", "peak GiB/rank", "host GiB", "comm GiB/step", "peak in", "fits")
        timed = any(r.predicted is not None for r in self.rows)
        header += ("predicted s/step",) if timed else ()
        lines = [header]
        for r in self.rows:
            e = r.estimate
            fits = "-" if r.fits is None else ("yes" if r.fits else "no")
            mark = " <-" if r is self.recommended else ""
            lines.append(
                (
                    r.label,
                    f"{e.peak_bytes / gib:.3f}",
                    f"{e.host_bytes / gib:.3f}",
                    f"{e.communication_bytes / gib:.3f}",
                    e.peak_phase,
                    fits + mark,
                )
                + ((f"{r.predicted.total_s:.4f}" if r.predicted else "-",) if timed else ())
            )
        widths = [max(len(str(row[i])) for row in lines) for i in range(len(header))]
        text = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in lines]
        if self.budget is not None:
            text.append(f"budget {human_bytes(self.budget)} per rank. {self.reason}")
        return "\n".join(text)


def default_budget(local_ranks: int = 1) -> int:
    """The accelerator's total memory, or on CPU the available RAM divided by the local ranks,
    minus `BUDGET_MARGIN`."""
    device = torch.accelerator.current_accelerator(check_available=True)  # None without a usable one
    if device is not None:
        module = getattr(torch, device.type)
        total = module.get_device_properties(torch.accelerator.current_device_index()).total_memory
    else:
        total = _available_ram() // max(local_ranks, 1)
    return int(total * (1 - BUDGET_MARGIN))


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def compare_strategies(
    model: nn.Module,
    config: FSDP2Config | dict | str | None = None,
    *,
    world_size: int,
    nodes: int = 1,
    device_memory: Any = None,
    strategies: tuple[str, ...] = SHARDING_STRATEGIES,
    offload: tuple[bool, ...] = (False, True),
    checkpointing: tuple[bool, ...] = (False, True),
    time: StepTimeModel | bool | None = None,
    **estimate_kwargs: Any,
) -> StrategyComparison:
    """Estimate every strategy x CPU offload x activation checkpointing and recommend one.

    Each setting is `config` with that strategy, offload and checkpointing, estimated by
    `estimate_memory`. Activation checkpointing rows need wrapped blocks; a model whose wrap
    policy selects none gets no such rows. The recommendation is the fitting setting with the
    least communication; `f2.tune` picks by measured time instead.

    Args:
        model: The unsharded model, on any device (it is only copied onto meta).
        config: The base `FSDP2Config`, a dict of its fields, a YAML path, or None for the defaults.
        world_size: Ranks in the job being planned.
        nodes: Nodes the ranks are spread over (it must divide `world_size`).
        device_memory: The budget per rank, bytes or text like "80GiB"; None judges nothing and
            recommends nothing.
        strategies: The sharding strategies to compare.
        offload: The `cpu_offload` values to compare.
        checkpointing: Whether to compare without and with activation checkpointing (the config's
            own `activation_checkpointing`, or "auto").
        time: Adds a predicted step time per row (`PlanRow.predicted`) from this `StepTimeModel`
            (e.g. `f2.tune(...).time_model`; `f2.compare_strategies(time=True)` measures one first).
            None or False: no times.
        **estimate_kwargs: Passed to `estimate_memory` (`optimizer`, `example_batch`, `loss_fn`,
            `accumulation`, `micro_batches`, `device_type`).

    Returns:
        Every row in the order tried, the budget, and the recommended row with the reason (or why
        nothing fits).

    Raises:
        ValueError: If `config`, `device_memory`, `time` or an argument of `estimate_memory` is
            invalid.
    """
    base = FSDP2Config.coerce(config, log_plan=False)
    budget = parse_bytes(device_memory, "device_memory")
    time_model = _time_model(time)
    rows = []
    if base.context_parallel_size > 1:  # the context-parallel ranks shard parameters between them
        strategies = tuple(s for s in strategies if strategy_spec(s).layout != "replicate")
    for strategy in strategies:
        for off in offload:
            for ac in checkpointing:
                cfg = dataclasses.replace(
                    base,
                    sharding_strategy=strategy,
                    cpu_offload=off,
                    activation_checkpointing=(base.activation_checkpointing or "auto") if ac else None,
                )
                try:
                    est = estimate_memory(model, cfg, world_size=world_size, nodes=nodes, **estimate_kwargs)
                except ValueError as exc:
                    if ac and "activation_checkpointing" in str(exc):
                        continue  # no blocks to checkpoint in this model
                    raise
                fits = None if budget is None else est.peak_bytes <= budget
                predicted = time_model.predict(est) if time_model is not None else None
                rows.append(PlanRow(strategy, off, ac, est, fits, predicted))
    return _recommend(StrategyComparison(rows=rows, budget=budget), world_size)


def _time_model(time: Any) -> StepTimeModel | None:
    if time is None or time is False:
        return None
    if isinstance(time, StepTimeModel):
        return time
    if time is True:  # measuring needs the tuner, a layer above this one
        raise ValueError("compare_strategies: time=True measures on the process group: call f2.compare_strategies.")
    raise ValueError(
        f"compare_strategies: time={time!r} is invalid; use None/False, True (measure on the process group) "
        "or a StepTimeModel (e.g. f2.tune(...).time_model)."
    )


def _cost(row: PlanRow) -> tuple:
    return (row.estimate.communication_bytes, row.cpu_offload, row.activation_checkpointing, row.estimate.peak_bytes)


def _recommend(comparison: StrategyComparison, world_size: int) -> StrategyComparison:
    if comparison.budget is None or not comparison.rows:
        return comparison
    fitting = [r for r in comparison.rows if r.fits]
    if fitting:
        best = min(fitting, key=_cost)
        comparison.recommended = best
        comparison.reason = (
            f"Recommended {best.label}: the least communication "
            f"({best.estimate.communication_bytes / 2**30:.3f} GiB/step) of the "
            f"{len(fitting)} settings that fit."
        )
    else:
        comparison.reason = nothing_fits_message(comparison.rows, comparison.budget, world_size)
    return comparison


def nothing_fits_message(rows: list[PlanRow], budget: int, world_size: int) -> str:
    """What to change when no setting fits: the smallest peak found and the levers left."""
    smallest = min(rows, key=lambda r: r.estimate.peak_bytes)
    more = ""
    for row in sorted(rows, key=lambda r: r.estimate.peak_bytes):
        est = row.estimate
        # Sharded state shrinks with more ranks; gathered groups, buffers and activations do not.
        states = est.param_bytes + est.grad_bytes + est.optimizer_bytes
        fixed = est.peak_bytes - states
        if row.estimate.shard_size > 1 and states and fixed < budget:
            ranks = world_size
            while fixed + states * world_size / ranks > budget:
                ranks *= 2
            more = f" about {ranks} ranks with {row.label} (its sharded state shrinks with the rank count);"
            break
    return (
        f"No setting fits {human_bytes(budget)} per rank: the smallest peak is "
        f"{human_bytes(smallest.estimate.peak_bytes)} ({smallest.label}). Options:{more} CPU offload and "
        "activation checkpointing (if not tried), a smaller micro-batch or sequence, mixed_precision='bf16', "
        "or a larger memory_budget."
    )


def context_parallel_proposal(
    model: nn.Module, config: FSDP2Config, budget: int, world_size: int, nodes: int, inputs: dict[str, Any]
) -> str:
    """When whole sequences do not fit: the smallest `context_parallel_size` with which FULL_SHARD
    (the config's offload and checkpointing) fits, as a sentence ("" without an example batch, with
    context parallelism already on, or when no size fits).

    Proposed, not chosen: with context parallelism the ranks of a "cp" group take the same batch,
    which the data loader must know before the first step (`f2.context_parallel`, the adapters)."""
    if inputs.get("example_batch") is None or config.context_parallel_size != 1:
        return ""
    for cp in (n for n in range(2, world_size + 1) if world_size % (n * config.tensor_parallel_size) == 0):
        try:
            candidate = dataclasses.replace(config, sharding_strategy="FULL_SHARD", context_parallel_size=cp)
            estimate = estimate_memory(model, candidate, world_size=world_size, nodes=nodes, **inputs)
        except ValueError:
            continue
        if estimate.peak_bytes <= budget:
            return (
                f" Or split each sequence across ranks: with context_parallel_size={cp} FULL_SHARD peaks at "
                f"{human_bytes(estimate.peak_bytes)} per rank (each rank holds 1/{cp} of every sequence; run each "
                "step inside f2.context_parallel, and give the ranks of a cp group the same batch)."
            )
    return ""


def resolve_auto(
    model: nn.Module,
    config: FSDP2Config,
    world_size: int,
    nodes: int,
    *,
    example_batch: Any = None,
    loss_fn: Any = None,
    device_type: str | None = None,
) -> tuple[FSDP2Config, str]:
    """The config with `sharding_strategy="auto"` replaced by the chosen strategy, and the reason.

    The user's offload and checkpointing choices are kept; only the strategy is chosen. With
    `example_batch` (one rank's micro-batch, as `estimate_memory` takes it; `loss_fn` likewise)
    the activations are measured and count against the budget; without one they are not
    estimated (they are left to `BUDGET_MARGIN`). The optimizer is assumed to be AdamW (two
    states per parameter, the common worst case).
    """
    budget = parse_bytes(config.memory_budget) or default_budget(world_size // nodes)
    strategies = tuple(s for s in SHARDING_STRATEGIES if nodes > 1 or not s.startswith("HYBRID"))
    inputs = dict(
        optimizer="adamw",
        example_batch=example_batch,
        loss_fn=loss_fn,
        device_type=device_type,
    )
    base = dataclasses.replace(config, sharding_strategy="FULL_SHARD")
    comparison = compare_strategies(
        model,
        base,
        world_size=world_size,
        nodes=nodes,
        device_memory=budget,
        strategies=strategies,
        offload=(config.cpu_offload,),
        checkpointing=(config.activation_checkpointing is not None,),
        **inputs,
    )
    if comparison.recommended is None:
        extra = compare_strategies(
            model,
            base,
            world_size=world_size,
            nodes=nodes,
            device_memory=budget,
            strategies=("FULL_SHARD",),
            offload=(True,),
            checkpointing=(False, True),
            **inputs,
        )
        raise ValueError(
            "FSDP2Config(sharding_strategy='auto'): "
            + nothing_fits_message(comparison.rows + extra.rows, budget, world_size)
            + context_parallel_proposal(model, base, budget, world_size, nodes, inputs)
        )
    best = comparison.recommended
    counted = "with the example batch's activations" if example_batch is not None else "without activations"
    reason = (
        f"sharding_strategy='auto' chose {best.strategy} for a budget of {human_bytes(budget)} per rank "
        f"(estimated peak {human_bytes(best.estimate.peak_bytes)} {counted}, AdamW): "
        + comparison.reason
        + "\n"
        + str(comparison)
    )
    return dataclasses.replace(config, sharding_strategy=best.strategy), reason

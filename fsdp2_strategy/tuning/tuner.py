"""`tune`: measure every fitting candidate on the process group and pick the fastest.

Order: every candidate is estimated (`estimate_memory`: those over the budget are not run); the
collectives are swept once (`measure_link`); the fitting candidates run one after another on a
fresh copy of the model (`measure_candidate`); a second pass measures the contenders' step time
again (two warm-up steps, no probe), all alive at once and stepped in turn, and each takes that
pass's median (`interleaved_pass`; those within `CLOSE_CALL` of the fastest, or whose first
pass beat its first pass by more, take twice the steps; the step-time model's third reference
joins them, `model_reference`); where they do not fit in memory together, one after another in
reverse order, each keeping its faster pass (`second_pass`), and while the fastest row's two
passes disagree, it is measured a third time and takes their median (`third_pass`).
Up to three measured rows (`references`) give the compute profile (`ComputeProfile.fit`) from
which every row's step time is predicted. A candidate that fails on any rank (out of memory, an
error while sharding) is skipped on every rank, with the reason. The pick is made on rank 0 and
broadcast; every rank returns the same result.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from .. import _torch_compat as tc
from ..config import FSDP2Config
from ..config_checks import parse_bytes
from ..distributed import from_rank_zero, log_rank_zero
from ..estimate import (
    ComputeProfile,
    PlanRow,
    StepTimeModel,
    default_budget,
    default_loss,
    estimate_memory,
    fit_offload,
    nothing_fits_message,
    offload_moves_state,
    optimizer_factory,
)
from ..groups import block_count
from ..mesh import collective_device, detect_num_nodes, mesh_device_type
from .candidates import Candidate, coerce_candidates, default_candidates, with_memory_savers
from .link import measure_link
from .measure import Measurement, collect_only_new_objects, measure_candidate, measure_interleaved
from .passes import (
    CLOSE_CALL,
    SECOND_PASS_WARMUP,
    first_pass,
    interleaved_pass,
    offload_reference,
    references,
    second_pass,
    third_pass,
)
from .result import TuneResult, TuneRow

WARMUP_STEPS = 2
"""Default untimed optimizer steps per candidate before its timed ones (`measure_candidate`)."""

TIMED_STEPS = 3
"""Default timed optimizer steps per candidate and pass: the steps of one pass stay close to their
median; what moves a median is time between passes."""

SKIPPABLE = (RuntimeError, ValueError, torch.OutOfMemoryError)
"""Errors that skip a candidate (on every rank) instead of ending the tuning."""


def tune(
    model: nn.Module,
    example_batch: Any,
    *,
    config: FSDP2Config | dict | str | None = None,
    candidates: Sequence[Candidate | dict] | None = None,
    optimizer: Any = "adamw",
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    micro_batches: int = 1,
    warmup: int = WARMUP_STEPS,
    steps: int = TIMED_STEPS,
    passes: int = 2,
    memory_budget: int | str | None = None,
) -> TuneResult:
    """Measure candidate settings of `model` on the process group and pick the fastest.

    Every rank must call it with the same arguments (each rank's own micro-batch), on an
    initialised process group. `model` is copied per candidate, never changed; nor is the random
    number generator state. Candidates whose estimated peak exceeds the budget are not run.

    Args:
        model: The unsharded model, holding real weights.
        example_batch: One rank's micro-batch (a tensor, a tuple of positional inputs or a dict of
            keyword inputs, real tensors).
        config: The base settings every candidate keeps (precision, offload, checkpointing, ...):
            an `FSDP2Config`, a dict of its fields, a YAML path, or None for the defaults.
        candidates: Dicts of FSDP2Config fields (`TUNABLE_FIELDS`, an optional "label") or
            `Candidate`s; None: `default_candidates`.
        optimizer: A name ("adamw", "sgd", ...), an optimizer class or `params -> optimizer`,
            built fresh per candidate.
        loss_fn: `loss_fn(model, batch)` computes the loss (default: the output's `.loss`, else its
            first tensor's mean).
        micro_batches: Micro-batches per optimizer step (gradient accumulation under the
            candidate's `accumulation` mode).
        warmup: Untimed optimizer steps per candidate in the first pass (the last is the probe for
            memory and collectives; with fewer than 2, one more step after the timed ones).
        steps: Timed optimizer steps per candidate in the first pass, and again after
            `passes.SECOND_PASS_WARMUP` in the second (twice for a close call,
            `passes.CLOSE_CALL`).
        passes: 2 measures the contenders (within `passes.RECHECK_WITHIN` of the fastest) again,
            stepped in turn, and picks among them by that pass (where they do not fit together:
            one after another, each keeping its faster pass, the fastest the median of three when
            its two disagree, `passes.DISAGREE`); 1 measures each candidate once.
        memory_budget: Bytes per rank, or text like "80GiB" (default `config.memory_budget`, else
            the device's memory or this rank's share of RAM, less 10 %).

    Returns:
        The table of every candidate (estimate, measurement, prediction, or why it was skipped),
        the fastest row, its config (`TuneResult.best_config`, for `shard_model`) and the fitted
        step-time model; the same on every rank.

    Raises:
        RuntimeError: If no process group is initialised.
        ValueError: If an argument is invalid, `model` is sharded already, the ranks disagree on
            the arguments, or no candidate fits in the budget.
    """
    start = time.perf_counter()
    _check_inputs(model, example_batch, micro_batches, warmup, steps, passes)
    base = FSDP2Config.coerce(config, log_plan=False)
    if base.sharding_strategy == "auto":
        base = dataclasses.replace(base, sharding_strategy="FULL_SHARD", objective="memory")
    world, device_type = dist.get_world_size(), mesh_device_type()
    nodes = detect_num_nodes(world)
    given = candidates is not None
    cands = (
        coerce_candidates(candidates)
        if candidates is not None
        else default_candidates(base, nodes, micro_batches, block_count(model, base))
    )
    batch = tc.tree_map_only(torch.Tensor, lambda t: t.to(collective_device()), example_batch)
    _check_agreement(cands, batch, model, micro_batches, warmup, steps)
    budget = parse_bytes(memory_budget, "tune: memory_budget") or base.memory_budget or default_budget(world // nodes)
    loss = loss_fn or default_loss
    inputs = dict(
        world_size=world,
        nodes=nodes,
        optimizer=optimizer,
        example_batch=batch,
        loss_fn=loss,
        micro_batches=micro_batches,
        device_type=device_type,
    )
    rows = _plan(model, base, cands, budget, inputs)
    if not any(r.fits for r in rows) and not given:
        rows += _plan(model, base, with_memory_savers(cands), budget, inputs)
    if not any(r.fits for r in rows):
        estimated = [r for r in rows if r.estimate is not None]
        raise ValueError("tune: " + (_nothing_fits(estimated, budget, world) if estimated else rows[0].skipped))
    sweep_start = time.perf_counter()
    link = measure_link(collectives=base.collectives)
    sweep_s = time.perf_counter() - sweep_start
    run = dict(micro_batches=micro_batches, warmup=warmup, steps=steps)
    measure, together = _measurer(model, base, batch, loss, optimizer_factory(optimizer), run)
    rng = torch.get_rng_state()
    with collect_only_new_objects():
        first_pass(rows, measure, warmup)
        if passes == 2 and not interleaved_pass(rows, together, budget):
            second_pass(rows, measure)
            third_pass(rows, measure)
    torch.set_rng_state(rng)
    time_model, reference = _predict_rows(rows, link)
    best = _pick(rows)
    samples, tokens = _per_step(batch, micro_batches, world)
    sweep_s, cost_s = from_rank_zero((sweep_s, time.perf_counter() - start))  # one table on every rank
    result = TuneResult(
        rows=rows,
        best=best,
        base_config=base,
        time_model=time_model,
        reference=reference,
        world_size=world,
        device_type=device_type,
        budget=budget,
        samples_per_step=samples,
        tokens_per_step=tokens,
        sweep_s=sweep_s,
        cost_s=cost_s,
    )
    log_rank_zero("f2.tune: %d candidate(s), %d run:\n%s", len(rows), sum(r.measured is not None for r in rows), result)
    return result


def _check_inputs(model: nn.Module, batch: Any, micro_batches: Any, warmup: Any, steps: Any, passes: Any) -> None:
    if not dist.is_initialized():
        raise RuntimeError("tune needs an initialised process group: call f2.init_distributed() on every rank first.")
    if batch is None:
        raise ValueError("tune: example_batch is None; pass one rank's micro-batch (a tensor, tuple or dict).")
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("tune: the model is sharded already; tune the model before f2.shard_model (it shards copies).")
    for name, value, low in (("micro_batches", micro_batches, 1), ("warmup", warmup, 0), ("steps", steps, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"tune: {name}={value!r} is invalid; use an int >= {low}.")
    if passes not in (1, 2) or isinstance(passes, bool):
        raise ValueError(f"tune: passes={passes!r} is invalid; use 1 or 2.")


def _signature(cands: list[Candidate], batch: Any, model: nn.Module, *numbers: int) -> dict[str, Any]:
    leaves = [t for t in tc.tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    return {
        "candidates": [c.label for c in cands],
        "example_batch shapes": [(tuple(t.shape), str(t.dtype)) for t in leaves],
        "model parameters": sum(p.numel() for p in model.parameters()),
        "micro_batches, warmup, steps": list(numbers),
    }


def _check_agreement(cands: list[Candidate], batch: Any, model: nn.Module, *numbers: int) -> None:
    """Every rank must tune the same things; a difference is an error on every rank (no rank is
    left waiting in a collective the others never start)."""
    mine = _signature(cands, batch, model, *numbers)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for rank, theirs in enumerate(every):
        for key in mine:
            if theirs[key] != every[0][key]:
                raise ValueError(
                    f"tune: ranks disagree on {key}: rank 0 has {every[0][key]!r}, rank {rank} has {theirs[key]!r}; "
                    "every rank must pass the same model, candidates and counts (and same-shaped batches)."
                )


def _plan(model: nn.Module, base: FSDP2Config, cands: list[Candidate], budget: int, inputs: dict) -> list[TuneRow]:
    rows = []
    for cand in cands:
        try:
            cfg = cand.config(base)
            est = estimate_memory(model, cfg, **inputs)
        except ValueError as exc:
            rows.append(TuneRow(cand, skipped=f"not estimated: {exc}"))
            continue
        fits = est.peak_bytes <= budget
        skipped = "" if fits else f"estimated peak {est.peak_bytes:,} B is over the budget of {budget:,} B per rank"
        rows.append(TuneRow(cand, est, fits, skipped=skipped))
    return rows


def _nothing_fits(rows: list[TuneRow], budget: int, world: int) -> str:
    plan_rows = [
        PlanRow(r.label, r.estimate.cpu_offload, r.estimate.activation_checkpointing, r.estimate, False)
        for r in rows
        if r.estimate
    ]
    return nothing_fits_message(plan_rows, budget, world)


def _agreed(fn: Callable[[], Any]) -> tuple[Any, str]:
    """`fn()` on every rank; (its value, "") when it succeeded everywhere, else (None, the reasons)."""
    error, value = None, None
    try:
        value = fn()
    except SKIPPABLE as exc:
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if torch.accelerator.is_available():
            torch.accelerator.empty_cache()
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    return (None, "failed: " + "; ".join(failed)) if failed else (value, "")


def _measurer(model, base, batch, loss, make_opt, run) -> tuple[Callable[..., tuple[Any, str]], Callable]:
    """`measure(row, warmup, probe, **more)`: the row's candidate measured on every rank (`more`:
    `measure_candidate`'s `process_warmup`, `stop_above_s`), or why it failed; `together(rows)`:
    the rows' candidates measured in turn (`measure_interleaved`), or why that failed."""

    def measure(row: TuneRow, warmup: int, probe: bool, **more: Any) -> tuple[Any, str]:
        cfg = row.candidate.config(base)
        steps = {**run, "warmup": warmup, "probe": probe, **more}
        return _agreed(lambda: measure_candidate(model, cfg, batch, loss, make_opt, **steps))

    def together(rows: list[TuneRow]) -> tuple[Any, str]:
        cfgs = [r.candidate.config(base) for r in rows]
        first_s = [r.measured.step_s for r in rows]  # type: ignore[union-attr]
        steps = {**run, "warmup": SECOND_PASS_WARMUP, "close": CLOSE_CALL, "first_s": first_s}
        return _agreed(lambda: measure_interleaved(model, cfgs, batch, loss, make_opt, **steps))

    return measure, together


def _predict_rows(rows: list[TuneRow], link: Any) -> tuple[StepTimeModel | None, str]:
    """Predict every estimated row from up to three measured ones (`passes.references`,
    `ComputeProfile.fit`), and the offloaded ones with the offload terms of a fourth
    (`passes.offload_reference`, `fit_offload`); the second value names them."""
    measured = [r for r in rows if r.measured is not None and r.estimate is not None]
    if not measured:
        return None, ""
    ref, other, third = references(measured)
    m, o = ref.measured, other.measured
    assert m is not None and ref.estimate is not None and o is not None and other.estimate is not None
    third_ref = None
    if third is not None:
        assert third.measured is not None and third.estimate is not None
        third_ref = (_expected_phases(third.measured)[2], third.measured.expected_s, third.estimate)
    device_type = mesh_device_type()
    phases = _expected_phases(m)
    compute = ComputeProfile.fit(phases, ref.estimate, o.expected_s, other.estimate, link, device_type, third=third_ref)
    host = offload_reference(measured) if offload_moves_state(device_type) else None
    if host is not None:
        h = host.measured
        assert h is not None and host.estimate is not None
        compute = fit_offload(compute, _expected_phases(h)[2], h.expected_s, host.estimate, link, device_type)
    time_model = StepTimeModel(link, compute, device_type)
    for row in rows:
        if row.estimate is not None:
            row.predicted = time_model.predict(row.estimate)
    used = (
        [ref]
        + ([other] if other.estimated_calls != ref.estimated_calls else [])
        + ([third] if third is not None else [])
        + ([host] if host is not None else [])
    )
    return time_model, " + ".join(dict.fromkeys(r.label for r in used))


def _expected_phases(m: Measurement) -> tuple[float, float, float]:
    """Forward, backward (per micro-batch) and optimizer seconds of `m`'s median step, scaled to
    add up to its expected step (`Measurement.expected_s`) instead of the pass it was taken in."""
    scale = m.expected_s / m.step_s if m.step_s > 0 else 1.0
    return m.forward_s * scale, m.backward_s * scale, m.optimizer_s * scale


def _pick(rows: list[TuneRow]) -> TuneRow:
    """The fastest measured row, among those measured in turn where there are (`interleaved_pass`),
    decided on rank 0."""
    measured = [r for r in rows if r.measured is not None]
    if not measured:
        raise RuntimeError(
            "tune: every fitting candidate failed:\n" + "\n".join(f"  {r.label}: {r.skipped}" for r in rows)
        )
    final = [r for r in measured if r.measured.interleaved] or measured  # type: ignore[union-attr]
    label = min(final, key=lambda r: r.measured.step_s).label if dist.get_rank() == 0 else None  # type: ignore[union-attr]
    box = [label]
    dist.broadcast_object_list(box, src=0)
    return next(r for r in rows if r.label == box[0])


def _per_step(batch: Any, micro_batches: int, world: int) -> tuple[int, int]:
    leaves = [t for t in tc.tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    if not leaves or leaves[0].ndim == 0:
        return micro_batches * world, 0
    first = leaves[0]
    tokens = first.numel() if not first.is_floating_point() and first.ndim >= 2 else 0
    return first.shape[0] * micro_batches * world, tokens * micro_batches * world

"""The tuner's passes over the fitting rows: `first_pass` measures each (with the probe for memory
and collectives); `interleaved_pass` measures the contenders again, all alive at once and
stepped in turn (with the step-time model's third reference, `model_reference`); where they do
not fit in memory together, `second_pass` measures them again one after another and
`third_pass` settles a leader whose two passes disagree. `references` names the rows the
step-time model is fitted to. `measure(row, warmup, probe, **more)` and `together(rows)` run on
every rank and agree on the outcome: (a Measurement, or one per row, or None; why)
(`tuner._measurer`)."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

from ..distributed import log_rank_zero
from .measure import Measurement
from .result import TuneRow

FIRST_EXTRA_WARMUP = 3
"""Steps of one micro-batch the first measured candidate takes before its warm-up: a process's
first steps run slower than its later ones. One micro-batch warms the process as well as k do,
for a k-th of the time."""

RECHECK_WITHIN = 1.3
"""The second pass measures again the rows whose first-pass step time is within this factor of
the fastest one's. A setting's median step moves more between passes a few seconds apart than
the steps within one pass move around their median, so a contender is timed twice, apart,
rather than for longer."""

DISAGREE = 1.15
"""While the fastest row's two passes differ by more than this factor, it is measured a third time
and takes the median of its three passes (`third_pass`), so that one fast pass alone does not
make a slower setting the pick."""

CLOSE_CALL = 1.05
"""In the pass in turn, the contenders whose medians are within this factor of the fastest one's
take as many rounds again, so a close call is decided on twice the steps: a median of a few
steps in turn moves by about as much as this margin. So do those whose first pass beat the
fastest one's by more than this factor (`measure.unsettled`)."""

SECOND_PASS_WARMUP = 2
"""Warm-up steps of a second-pass measurement: the process is warm by then, but the first step of
a fresh copy creates the optimizer state, and its second step still runs slower than the later
ones."""


def first_pass(rows: list[TuneRow], measure: Callable, warmup: int) -> None:
    """Measure every fitting row, in `measuring_order`. A row whose first two timed steps are over
    `RECHECK_WITHIN` times the fastest median so far takes no more timed steps, timed by the
    second (`measure._first_timed_steps`): it would not be measured again, and one step is close
    to a pass's median. The `per_call_row` takes all its steps: the step-time
    model's cost per collective call is fitted to it."""
    full = per_call_row(rows)
    for row in measuring_order(rows):
        done = [r.measured.step_s for r in rows if r.measured is not None]
        # The first candidate also warms the process (allocator, thread pools).
        extra = 0 if done else FIRST_EXTRA_WARMUP
        limit = RECHECK_WITHIN * min(done) if done and row is not full else None
        row.measured, row.skipped = measure(row, warmup, True, process_warmup=extra, stop_above_s=limit)


def per_call_row(rows: list[TuneRow]) -> TuneRow | None:
    """The fitting row of the largest shard size with the most estimated calls (the
    first such in table order): the one whose calls differ most from the few-call rows that lead
    (`references`). A stopped row is timed by one step, taken after a slow one."""
    largest = of_largest_shard([r for r in rows if r.fits])
    return max(largest, key=lambda r: r.estimated_calls) if largest else None


def of_largest_shard(rows: list[TuneRow]) -> list[TuneRow]:
    """The rows of the largest estimated shard size (FULL_SHARD's and SHARD_GRAD_OP's: most rows),
    in the given order; the step-time model's phase and per-call references come from these."""
    size = max((r.shard_size for r in rows), default=0)
    return [r for r in rows if r.shard_size == size]


def measuring_order(rows: list[TuneRow]) -> list[TuneRow]:
    """The fitting rows, fewest estimated collective calls first, then fewest calls in all (local
    ones too: world size 1, where none is collective), then in table order: the fastest setting
    tends to be among them, and the sooner it is measured, the sooner a slower row stops after
    one timed step. Where the fastest is not among them, only the tuning costs more."""
    return sorted((r for r in rows if r.fits), key=lambda r: (r.estimated_collective_calls, r.estimated_calls))


def references(measured: list[TuneRow]) -> tuple[TuneRow, TuneRow, TuneRow | None]:
    """The rows the compute profile comes from: rows without CPU offload where any is measured
    (an offloaded step adds host-device copies and a host optimizer step, `offload_reference`).
    Of the largest shard size (FULL_SHARD's and SHARD_GRAD_OP's, most rows): the first in
    `measuring_order` that took all its timed steps (its phases) and, of those that took all
    theirs, the one whose calls (`fsdp_calls`) differ most from it (the cost per call; within one
    shard size, the optimizer step stays out of it; `first_pass` never stops the one with the
    most calls). A stopped row is timed by one step, possibly the slow step it was stopped for, so
    it is a reference only where no row took all its steps. Of another shard size, the first that took all its
    timed steps (its optimizer step: the part that does not shrink with the shard; its step: the
    cost per byte of a collective only it calls, NO_SHARD's all-reduce)."""
    measured = measuring_order([r for r in measured if not _offloaded(r)] or measured)
    largest = of_largest_shard(measured)
    ref = min(largest, key=_stopped)
    same = [r for r in largest if r.estimated_calls != ref.estimated_calls]
    other = max(same or measured, key=lambda r: (not _stopped(r), abs(r.estimated_calls - ref.estimated_calls)))
    third = min((r for r in measured if r not in largest), key=_stopped, default=None)
    return ref, other, third


def offload_reference(measured: list[TuneRow]) -> TuneRow | None:
    """The offloaded row the offload terms are fitted to (`fit_offload`) where `references` are
    not offloaded: the first in `measuring_order` that took all its timed steps, else the first;
    None where no row or every row is offloaded (the compute profile is then the host's)."""
    offloaded = [r for r in measuring_order(measured) if _offloaded(r)]
    if not offloaded or len(offloaded) == len(measured):
        return None
    return min(offloaded, key=_stopped)


def _offloaded(row: TuneRow) -> bool:
    return bool(row.estimate and row.estimate.cpu_offload)


def _stopped(row: TuneRow) -> bool:
    return bool(row.measured and row.measured.stopped)


def contenders(rows: list[TuneRow]) -> list[TuneRow]:
    """The measured rows within `RECHECK_WITHIN` of the fastest one's step time."""
    measured = [r for r in rows if r.measured is not None]
    fastest = min((r.measured.step_s for r in measured), default=0.0)  # type: ignore[union-attr]
    return [r for r in measured if r.measured.step_s <= RECHECK_WITHIN * fastest]  # type: ignore[union-attr]


def interleaved_pass(rows: list[TuneRow], together: Callable, budget: int) -> bool:
    """Measure the contenders again, stepped in turn (`measure_interleaved`): each takes that
    pass's median, so the pick compares them over the same seconds of the machine's time (a
    setting's median moves more between runs minutes apart than settings differ); those within
    `CLOSE_CALL` of the
    fastest, or whose first pass beat its first pass by more, take twice the steps. The pick is
    among these rows. The third reference (`references`), when not a contender, joins them where
    it fits beside them (`model_reference`).
    False, with nothing changed, when their estimated peaks together exceed `budget` or the pass
    failed: the caller then measures them one after another (`second_pass`)."""
    again = contenders(rows)
    if len(again) < 2:
        return True
    together_bytes = sum(_peak(r) for r in again)
    if together_bytes > budget:
        log_rank_zero(
            "f2.tune: the %d contenders' estimated peaks together (%d B) exceed the budget (%d B); "
            "they are measured again one after another, not in turn",
            len(again),
            together_bytes,
            budget,
        )
        return False
    again += model_reference(rows, again, budget - together_bytes)
    got, why = together(again)
    if got is None:
        log_rank_zero("f2.tune: the contenders are measured again one after another; in turn, %s", why)
        return False
    for row, m in zip(again, got):
        kept = row.measured
        assert kept is not None
        row.measured = _merged(kept, m, m, m.step_s)
    return True


def model_reference(rows: list[TuneRow], contending: list[TuneRow], room: int) -> list[TuneRow]:
    """The third reference (`references`: of another shard size, NO_SHARD's one group on CPU, whose
    step gives the cost per byte of the collective only it calls), as a list of one when it is not
    among `contending` and its estimated peak fits in `room`; else empty. It is measured again
    because it is the first candidate measured (the fewest collective calls) and seldom a
    contender: taken from one pass, one slow pass would mislead every NO_SHARD prediction."""
    measured = [r for r in rows if r.measured is not None and r.estimate is not None]
    third = references(measured)[2] if measured else None
    if third is None or third in contending or _peak(third) > room:
        return []
    return [third]


def _peak(row: TuneRow) -> int:
    return row.estimate.peak_bytes if row.estimate is not None else 0


def second_pass(rows: list[TuneRow], measure: Callable) -> None:
    """Measure the contenders' step time again, last first, so no row gains from its place in
    the order; each keeps its faster pass (a slower pass is noise from outside, not the
    setting's cost) and its first pass's peak and collectives (the second takes no probe)."""
    contending = contenders(rows)
    if len(contending) < 2:
        return
    for row in reversed(contending):
        first = row.measured
        assert first is not None
        again, why = measure(row, SECOND_PASS_WARMUP, False)
        if again is None:  # it ran once: keep that, and say why the second pass did not
            log_rank_zero("f2.tune: %s keeps its first pass; the second %s", row.label, why)
            continue
        faster = min(first, again, key=lambda m: m.step_s)
        row.measured = _merged(first, again, faster, faster.step_s)


def third_pass(rows: list[TuneRow], measure: Callable) -> None:
    """While the fastest row's two passes disagree (`DISAGREE`), measure it once more: it takes the
    median of its three passes, so one lucky pass does not make the pick. A slower row with a
    lucky pass needs no third: it is not the pick even so. Each row at most once."""
    done: set[str] = set()
    while True:
        best = min((r for r in rows if r.measured is not None), key=lambda r: r.measured.step_s, default=None)  # type: ignore[union-attr]
        kept = best.measured if best is not None else None
        if best is None or kept is None or best.label in done or len(kept.passes) != 2:
            return
        if max(kept.passes) <= DISAGREE * min(kept.passes):
            return
        done.add(best.label)
        again, why = measure(best, SECOND_PASS_WARMUP, False)
        if again is None:
            log_rank_zero("f2.tune: %s keeps its faster pass; the third %s", best.label, why)
            continue
        middle = statistics.median(kept.passes + again.passes)
        base = again if again.step_s == middle else kept  # the phases and steps of that pass, if kept
        best.measured = _merged(kept, again, base, middle)


def _merged(kept: Measurement, again: Measurement, base: Measurement, step_s: float) -> Measurement:
    """`base`'s phases and steps with the row's `step_s`, the phases scaled to add up to it (a
    third pass's median can be the second pass, of which only the time was kept; unscaled, the
    phases would add up to another pass than the median); every pass and its cost so far; the peak and collectives of
    `kept`, whose first pass took the probe (the later ones take none)."""
    scale = step_s / base.step_s if base.step_s > 0 else 1.0
    return dataclasses.replace(
        base,
        step_s=step_s,
        forward_s=base.forward_s * scale,
        backward_s=base.backward_s * scale,
        optimizer_s=base.optimizer_s * scale,
        peak_bytes=kept.peak_bytes,
        collectives=kept.collectives,
        cost_s=kept.cost_s + again.cost_s,
        passes=kept.passes + again.passes,
    )

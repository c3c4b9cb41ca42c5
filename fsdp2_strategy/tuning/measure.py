"""Run one candidate for real: shard a copy of the model, take warm-up and timed optimizer steps;
the last warm-up step is the probe for the peak memory and the collectives.

Times are per rank with a barrier before each step; every step's time is the slowest rank's (one
all-reduce at the end). The peak is the device allocator's on accelerators and the live tensor
bytes on CPU (`probe.LiveTensorBytes`); collectives are counted by the c10d operations dispatched.
Both in the probe step, the last warm-up step when there are two or more (the first creates the
optimizer state, so the probe sees a steady step), else one more step after the timed ones. The
probe's counting mode leaves the timed step after it about as fast as one after a plain step
(torch's MemTracker slowed the steps after it). Two warm-up steps before timing: a model's second
step still runs slower than its later ones. Warm-up steps take all k micro-batches: a sharded
model's first step of k > 1 makes more collectives than its later ones, also after a step of one
micro-batch.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import FSDP2Config
from ..mesh import collective_device
from ..shard import shard_model
from ..train import no_sync
from .probe import CountCollectives, LiveTensorBytes


@dataclass
class Measurement:
    """What one candidate's timed steps measured (every rank holds the same numbers)."""

    step_s: float
    """Median seconds per optimizer step (each step the slowest rank's) of the pass the pick
    compares (`interleaved`: the pass in turn); `expected_s` is what training is expected to see."""
    forward_s: float
    """Seconds of forward per micro-batch (loss included) in the median step, whose phases add up
    to `step_s` (`_median_step_phases`)."""
    backward_s: float
    """Seconds of backward per micro-batch in the median step."""
    optimizer_s: float
    """Seconds of the optimizer step (and zeroing the gradients) in the median step."""
    peak_bytes: int
    """Measured peak on the device (highest rank); 0 when the pass took no probe step."""
    collectives: dict[str, int] = field(default_factory=dict)
    """Collective operations per optimizer step (`probe.C10D_NAMES`); empty when the pass took no probe step."""
    cost_s: float = 0.0
    """Seconds this candidate took to tune: build, warm-up, timed and probe steps (slowest rank)."""
    steps: list[float] = field(default_factory=list)
    """Every timed step (seconds) of the pass kept."""
    passes: list[float] = field(default_factory=list)
    """Median step time of each pass (the tuner takes the pass in turn's, else the faster one's)."""
    stopped: bool = False
    """The pass stopped after its first two timed steps, both over `stop_above_s`; the second
    alone times it (`steps`)."""
    interleaved: bool = False
    """`step_s` is from steps taken in turn with the other contenders' (`measure_interleaved`)."""

    @property
    def expected_s(self) -> float:
        """The step time training with this setting alone is expected to take: `step_s`, but for a
        row measured in turn the geometric mean of its first pass and its pass in turn. The pass in
        turn compares the contenders over the same seconds (the pick); beside the others it runs
        slower than alone, the first pass a few seconds apart from the rest. Against separate
        runs of each setting, the geometric mean of the two is closer than either pass alone."""
        if self.interleaved and len(self.passes) >= 2:
            return math.sqrt(self.passes[0] * self.passes[-1])
        return self.step_s


@contextlib.contextmanager
def collect_only_new_objects() -> Iterator[None]:
    """Inside, `gc.collect()` scans only the objects made since entering (`gc.freeze`): each
    candidate's copy is collected for its memory to be free for the next, and a full collection
    over the process's objects (torch, transformers, Lightning) is slow each time. Left as it is
    when the caller froze objects itself."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _sync() -> None:
    if torch.accelerator.is_available() and collective_device().type != "cpu":
        torch.accelerator.synchronize()


def train_step(
    model: nn.Module,
    opt: Any,
    batch: Any,
    loss_fn: Callable,
    micro_batches: int,
) -> tuple[float, float, float]:
    """One optimizer step of `micro_batches` micro-batches, `no_sync` on all but the last (it follows
    the model's accumulation mode, as in training); seconds of forward, backward (both summed over
    the micro-batches) and the optimizer step."""
    fwd = bwd = 0.0
    for i in range(micro_batches):
        with no_sync(model) if i < micro_batches - 1 else contextlib.nullcontext():
            t0 = time.perf_counter()
            loss = loss_fn(model, batch)
            if micro_batches > 1:
                loss = loss / micro_batches
            _sync()
            t1 = time.perf_counter()
            loss.backward()
            _sync()
            fwd, bwd = fwd + t1 - t0, bwd + time.perf_counter() - t1
    t2 = time.perf_counter()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    _sync()
    return fwd, bwd, time.perf_counter() - t2


def _probe(model, opt, batch, loss_fn, micro_batches) -> tuple[int, dict[str, int]]:
    """Peak bytes (CPU: live tensors; accelerators: the allocator's peak) and collective counts
    of one step."""
    on_cpu = collective_device().type == "cpu"
    counter = LiveTensorBytes(model, opt, batch) if on_cpu else CountCollectives()
    if not on_cpu:
        torch.accelerator.reset_peak_memory_stats()
    with counter:
        train_step(model, opt, batch, loss_fn, micro_batches)
    peak = counter.peak if isinstance(counter, LiveTensorBytes) else torch.accelerator.max_memory_allocated()
    return int(peak), dict(counter.counts)


def measure_candidate(
    model: nn.Module,
    config: FSDP2Config,
    batch: Any,
    loss_fn: Callable,
    make_optimizer: Callable | None,
    *,
    micro_batches: int,
    warmup: int,
    steps: int,
    probe: bool = True,
    process_warmup: int = 0,
    stop_above_s: float | None = None,
) -> Measurement:
    """Shard a copy of `model` with `config`, step it, and free it again; `model` is untouched.
    `probe`: the last of 2 or more warm-up steps is the probe (with fewer, one more step after the
    timed ones); without it the peak is 0 and no collectives are counted. `process_warmup`: steps
    of one micro-batch before the warm-up, which warm the process (allocator, thread pools) for a
    k-th of a step's cost.
    `stop_above_s`: take no more timed steps when the first two (the slowest rank's) took longer,
    timed by the second (`_first_timed_steps`); every rank stops at the same step."""
    start = time.perf_counter()
    args = _built(model, config, make_optimizer, batch, loss_fn, micro_batches)
    for _ in range(process_warmup):
        train_step(args[0], args[1], batch, loss_fn, 1)
    # The probe needs a step before it (the optimizer state exists); the last warm-up step has one.
    probe_in_warmup = probe and warmup >= 2
    for _ in range(warmup - probe_in_warmup):
        train_step(*args)
    peak, counts = _probe(*args) if probe_in_warmup else (0, {})
    rows, stopped = _first_timed_steps(args, steps, stop_above_s)
    while len(rows) < steps and not stopped:
        rows.append(_timed_step(args))
    if probe and not probe_in_warmup:
        peak, counts = _probe(*args)
    del args
    gc.collect()
    (m,) = _agreed_measurements([rows], [time.perf_counter() - start], micro_batches, peak)
    return dataclasses.replace(m, collectives=counts, stopped=stopped)


def _first_timed_steps(args: tuple, steps: int, limit: float | None) -> tuple[list[list[float]], bool]:
    """The first timed step, and whether the pass stops there: when it was over `limit` (with
    `steps` >= 2), a second step decides, and if that is over too, it alone times the row. The
    first is not used: it was chosen for being slow, and such a step is sometimes far slower than
    the setting's usual step."""
    rows = [_timed_step(args)]
    if steps < 2 or not _slower_than(rows[0][0], limit):
        return rows, False
    rows.append(_timed_step(args))
    if _slower_than(rows[1][0], limit):
        return rows[1:], True
    return rows, False


def measure_interleaved(
    model: nn.Module,
    configs: list[FSDP2Config],
    batch: Any,
    loss_fn: Callable,
    make_optimizer: Callable | None,
    *,
    micro_batches: int,
    warmup: int,
    steps: int,
    close: float | None = None,
    first_s: list[float] | None = None,
) -> list[Measurement]:
    """Shard a copy of `model` per config, all alive at once, take `warmup` steps of each, then
    `steps` rounds of one step each, in turn (A B C, C B A, A B C, ...): a change in the machine's
    speed falls on every config alike, as in an interleaved benchmark. `close`: then the configs
    the rounds left `unsettled` (given each config's earlier median, `first_s`) take `steps` more
    rounds (every rank decides alike, on the slowest rank's steps). No probe (peak 0, no
    collectives counted). One `Measurement` per config, in order; `model` is untouched."""
    built, costs = [], []
    for cfg in configs:
        start = time.perf_counter()
        built.append(_built(model, cfg, make_optimizer, batch, loss_fn, micro_batches))
        for _ in range(warmup):
            train_step(*built[-1])
        costs.append(time.perf_counter() - start)
    rows: list[list[list[float]]] = [[] for _ in configs]
    _rounds_in_turn(built, rows, costs, list(range(len(configs))), steps)
    if close is not None:
        medians = [m.step_s for m in _agreed_measurements(rows, costs, micro_batches, 0)]
        near = unsettled(medians, first_s, close)
        if near:
            _rounds_in_turn(built, rows, costs, near, steps)
    del built
    gc.collect()
    return [dataclasses.replace(m, interleaved=True) for m in _agreed_measurements(rows, costs, micro_batches, 0)]


def unsettled(medians: list[float], first_s: list[float] | None, close: float) -> list[int]:
    """Indices of the configs whose order the rounds in turn have not settled: the fastest in turn,
    those within `close` of its median (a close call), and those whose earlier median (`first_s`)
    beat the fastest's by more than `close` (the two measurements disagree on the order, and a few
    rounds in turn can get it wrong). Empty when that leaves the fastest alone."""
    lead = min(range(len(medians)), key=medians.__getitem__)
    near = [
        i
        for i, median in enumerate(medians)
        if median <= close * medians[lead] or (first_s is not None and first_s[i] * close < first_s[lead])
    ]
    return near if len(near) > 1 else []


def _rounds_in_turn(built: list, rows: list, costs: list[float], which: list[int], rounds: int) -> None:
    """`rounds` rounds of one timed step of each of `which` (indices into `built`), the order
    reversed every other round; each step's row goes to `rows[i]`, its seconds to `costs[i]`."""
    for round_ in range(rounds):
        for i in which if round_ % 2 == 0 else which[::-1]:
            rows[i].append(_timed_step(built[i]))
            costs[i] += rows[i][-1][0]


def _built(model: nn.Module, config: FSDP2Config, make_optimizer, batch, loss_fn, micro_batches: int) -> tuple:
    """`train_step`'s arguments for a sharded copy of `model` and a fresh optimizer on it."""
    sharded = shard_model(copy.deepcopy(model), config, log_plan=False)
    sharded.train()
    opt = make_optimizer(list(sharded.parameters())) if make_optimizer is not None else None
    return sharded, opt, batch, loss_fn, micro_batches


def _timed_step(args: tuple) -> list[float]:
    """[seconds of the step, forward, backward, optimizer]; after a barrier, so every rank starts
    the step together and the slowest rank's time is the step's."""
    dist.barrier()
    t0 = time.perf_counter()
    phases = train_step(*args)
    return [time.perf_counter() - t0, *phases]


def _agreed_measurements(
    runs: list[list[list[float]]], costs: list[float], micro_batches: int, peak: int
) -> list[Measurement]:
    """Each run's timed steps (`_timed_step` rows) as a `Measurement`, every number the slowest
    rank's (one all-reduce for all runs: every rank then holds the same)."""
    flat = [step for run in runs for step in run] + [[float(peak), cost, 0.0, 0.0] for cost in costs]
    slowest = torch.tensor(flat, dtype=torch.float64, device=collective_device())
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    table = slowest.tolist()
    out, at = [], 0
    for i, run in enumerate(runs):
        mine = table[at : at + len(run)]
        at += len(run)
        steps = [row[0] for row in mine]
        forward_s, backward_s, optimizer_s = _median_step_phases(mine)
        extra = table[len(table) - len(runs) + i]
        step_s = statistics.median(steps)
        out.append(
            Measurement(
                step_s=step_s,
                forward_s=forward_s / micro_batches,
                backward_s=backward_s / micro_batches,
                optimizer_s=optimizer_s,
                peak_bytes=int(extra[0]),
                cost_s=extra[1],
                steps=steps,
                passes=[step_s],
            )
        )
    return out


def _median_step_phases(steps: list[list[float]]) -> tuple[float, float, float]:
    """Forward, backward and optimizer seconds of the median step (the mean of the two middle
    steps' for an even count), each step's phases scaled to add up to its time. Each phase is the
    slowest rank's, and ranks sharing a core are slowest in different phases: unscaled, the
    phases' medians would add up to more than the median step, and the step-time model fitted to
    them would predict that much above it."""
    scaled = []
    for step, *phases in sorted(steps, key=lambda row: row[0]):
        total = sum(phases)
        scaled.append([p * step / total if total > 0 else 0.0 for p in phases])
    middle = scaled[(len(scaled) - 1) // 2 : len(scaled) // 2 + 1]
    fwd, bwd, opt = (statistics.fmean(column) for column in zip(*middle))
    return fwd, bwd, opt


def _slower_than(seconds: float, limit: float | None) -> bool:
    """Whether the slowest rank's `seconds` exceed `limit` (the same answer on every rank)."""
    if limit is None:
        return False
    slowest = torch.tensor([seconds], dtype=torch.float64, device=collective_device())
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item() > limit

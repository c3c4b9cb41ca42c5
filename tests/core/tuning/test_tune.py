"""`f2.tune`, `fsdp2-strategy tune`, the step-time model and `FSDP2Config(objective="throughput")`.

One 2-rank world runs every distributed check on a tiny model (few candidates, 1-2 steps each), as
named scenarios in turn (`SCENARIOS`): each records its result or its traceback under its name, and a
test reading a scenario that failed names it and why (`world["meta"]`), while the other scenarios'
tests still pass. The formula tests need no world. No assertion here depends on how fast anything ran.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers.harness import _first_difference, run_distributed
from torch import nn
from torch.distributed.fsdp import FSDPModule

import fsdp2_strategy as f2
from fsdp2_strategy.cli.main import main
from fsdp2_strategy.estimate import CollectiveFit, ComputeProfile, Link, MemoryEstimate
from fsdp2_strategy.estimate.step_time import predict_step_time
from fsdp2_strategy.tuning.cache import cache_key, read_decision, write_decision
from fsdp2_strategy.tuning.link import fit_line


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class Tiny(nn.Module):
    def __init__(self, dim: int = 64, layers: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def tiny_with_batch():
    """A `tune` CLI factory: the model, one rank's batch and the loss."""
    torch.manual_seed(0)
    return Tiny(), torch.randn(8, 64), lambda model, batch: model(batch).square().mean()


SLOW_STEP_S = 1.0
STOPS = {"all over": (0.0, 0), "none over": (60.0, 0), "first over": (0.5, 1), "second over": (0.5, 2)}
"""measure_candidate's stop_above_s, and how many of the first timed steps sleep SLOW_STEP_S."""

FEW = [
    {"sharding_strategy": "FULL_SHARD"},
    {"sharding_strategy": "FULL_SHARD", "wrap_policy": None},
    {"sharding_strategy": "NO_SHARD", "wrap_policy": None},
]


def _fails_without_block_groups(model, batch):
    if batch.device.type != "meta" and not isinstance(model.blocks[0], FSDPModule):  # one group, when run
        raise torch.OutOfMemoryError("simulated: out of memory in forward")
    return model(batch).square().mean()


class _World:
    """What the scenarios share: the trained tiny model, its batch and optimizer, the cache path, and the
    counting loss functions (`forwards`: one entry per forward; `order`: which candidate each ran)."""

    def __init__(self, cache: str):
        torch.manual_seed(0)
        self.model, self.batch = Tiny(), torch.randn(8, 64)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.model(self.batch).sum().backward()
        self.opt.step()
        self.cache = cache
        self.cfg = f2.FSDP2Config(log_plan=False)
        self.both = [self.cfg, f2.FSDP2Config(wrap_policy=None, log_plan=False)]
        self.forwards: list[int] = []
        self.order: list[str] = []

    def loss(self, m, b):
        self.forwards.append(1)
        return m(b).square().mean()

    def in_turn(self, m, b):
        self.order.append("blocks" if isinstance(m.blocks[0], FSDPModule) else "one")
        return self.loss(m, b)


SCENARIOS: dict[str, Callable[[_World], dict]] = {}
"""The world's named sub-checks, run in this order on one world (`_tune_world`)."""


def _scenario(fn: Callable[[_World], dict]) -> Callable[[_World], dict]:
    SCENARIOS[fn.__name__.removeprefix("_")] = fn
    return fn


@_scenario
def _budget(w: _World) -> dict:
    """Budget between FULL_SHARD's estimate and NO_SHARD's: NO_SHARD is reported, not run. Tuning
    leaves the model, the optimizer, the gradients and the RNG as they were."""
    model, batch, opt = w.model, w.batch, w.opt
    grads = [p.grad.clone() for p in model.parameters()]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before = {k: v.clone() for k, v in opt.state[model.head.weight].items()}
    rng = torch.get_rng_state()
    out: dict = {}
    peaks = {
        c["sharding_strategy"] + str("wrap_policy" in c): f2.estimate_memory(
            model, c, world_size=2, example_batch=batch
        ).peak_bytes
        for c in FEW
    }
    budget = (peaks["NO_SHARDTrue"] + max(peaks["FULL_SHARDFalse"], peaks["FULL_SHARDTrue"])) // 2
    result = f2.tune(model, batch, candidates=FEW, steps=2, warmup=1, memory_budget=budget)
    out["rows"] = [(r.label, r.fits, r.measured is not None, r.skipped) for r in result.rows]
    out["best"] = result.best.label
    out["predicted"] = [r.predicted is not None and r.predicted.total_s > 0 for r in result.rows]
    out["table"] = str(result)
    out["unchanged"] = all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and all(
        torch.equal(opt_before[k], v) for k, v in opt.state[model.head.weight].items()
    )
    out["rng_unchanged"] = torch.equal(rng, torch.get_rng_state())
    out["grads_unchanged"] = all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    return out


@_scenario
def _meta(w: _World) -> dict:
    """A model built on the meta device: each candidate is materialised on its copy and measured;
    the model itself stays on meta."""
    with torch.device("meta"):
        on_meta = Tiny()
    tuned = f2.tune(on_meta, w.batch, candidates=FEW[:2], steps=1, warmup=0, passes=1)
    return {
        "meta": [(r.label, r.measured is not None and r.measured.peak_bytes > 0) for r in tuned.rows],
        "still_meta": all(p.is_meta for p in on_meta.parameters()),
    }


@_scenario
def _failing(w: _World) -> dict:
    """A candidate failing on every rank is skipped with its reason; the tuning goes on."""
    failing = f2.tune(w.model, w.batch, candidates=FEW[:2], loss_fn=_fails_without_block_groups, steps=1, warmup=0)
    return {
        "failing": [(r.label, r.measured is not None, r.skipped.split(":")[0]) for r in failing.rows],
        "failing_reason": failing.rows[1].skipped,
    }


@_scenario
def _probes(w: _World) -> dict:
    """The probe measures a steady step, as the last of 2 warm-up steps (after the first, which creates
    the optimizer state) as after the timed step with 1 warm-up step; in both, no step more than
    asked for. Without a probe, nothing is measured."""
    from fsdp2_strategy.estimate import optimizer_factory
    from fsdp2_strategy.tuning.measure import measure_candidate

    probes = {}
    for name, warmup, probe in (("warm-up 2", 2, True), ("warm-up 1", 1, True), ("none", 2, False)):
        w.forwards.clear()
        m = measure_candidate(
            w.model,
            w.cfg,
            w.batch,
            w.loss,
            optimizer_factory("adamw"),
            micro_batches=2,
            warmup=warmup,
            steps=1,
            probe=probe,
        )
        probes[name] = (m.peak_bytes, m.collectives, len(w.forwards))
    return {"probes": probes}


@_scenario
def _probe_vs_memtracker(w: _World) -> dict:
    """The probe's live-bytes peak and MemTracker's for the same steady step."""
    return {"probe_vs_memtracker": _probe_and_memtracker_peaks()}


@_scenario
def _stops(w: _World) -> dict:
    """Two first timed steps over stop_above_s (the slowest rank's) end the timed steps on every
    rank, and the second alone times the row; a slow first step followed by one under the limit
    does not. Steps made slow by sleeping in the first forwards of a step (k=2: forwards 1-2 are
    the first timed step; warmup=0, so the probe step comes after the timed ones). The phases are
    the median step's (each the slowest rank's, scaled to the step's time): they add up to the
    median step, not more."""
    from fsdp2_strategy.tuning.measure import measure_candidate

    def stopping(limit: float, slow_steps: int):
        """measure_candidate with the first `slow_steps` timed steps sleeping SLOW_STEP_S."""

        def loss_fn(m, b):
            w.forwards.append(1)
            if len(w.forwards) <= 2 * slow_steps and len(w.forwards) % 2:
                time.sleep(SLOW_STEP_S)
            return m(b).square().mean()

        w.forwards.clear()
        m = measure_candidate(
            w.model, w.cfg, w.batch, loss_fn, None, micro_batches=2, warmup=0, steps=3, stop_above_s=limit
        )
        return m, (len(m.steps), m.stopped, len(w.forwards))

    stops = {name: stopping(*how) for name, how in STOPS.items()}
    m = stops["none over"][0]
    return {
        "stops": {name: seen for name, (_, seen) in stops.items()},
        "stopped_s": stops["second over"][0].step_s,
        "phases_add_up": (2 * (m.forward_s + m.backward_s) + m.optimizer_s, m.step_s),
    }


@_scenario
def _in_turn(w: _World) -> dict:
    """Candidates measured in turn: each built and given its warm-up step, then one step of each per
    round, the order reversed every other round."""
    from fsdp2_strategy.estimate import optimizer_factory
    from fsdp2_strategy.tuning.measure import measure_interleaved

    w.order.clear()
    got = measure_interleaved(
        w.model, w.both, w.batch, w.in_turn, optimizer_factory("sgd"), micro_batches=1, warmup=1, steps=3
    )
    return {"in_turn": (list(w.order), [(len(m.steps), m.peak_bytes, m.collectives, m.interleaved) for m in got])}


@_scenario
def _close_calls(w: _World) -> dict:
    """A close call takes as many rounds again. Within 100x of the fastest both are close; within
    1.0x only the fastest itself, so none takes more (factors that no machine's speed decides:
    a 0.1 s sleep against 1.5x of a step of a few ms was close on a loaded CI machine)."""
    from fsdp2_strategy.estimate import optimizer_factory
    from fsdp2_strategy.tuning.measure import measure_interleaved

    close_calls = {}
    for close in (100.0, 1.0):
        w.order.clear()
        got = measure_interleaved(
            w.model,
            w.both,
            w.batch,
            w.in_turn,
            optimizer_factory("sgd"),
            micro_batches=1,
            warmup=0,
            steps=2,
            close=close,
        )
        close_calls[close] = (list(w.order), [len(m.steps) for m in got])
    return {"close_calls": close_calls}


@_scenario
def _disagreements(w: _World) -> dict:
    """Where the earlier passes disagree with the rounds in turn, both take as many rounds again: one
    group sleeps 0.2 s a step, so blocks leads in turn (steps of a few ms); one group's earlier
    pass beat blocks' (first_s), or did not."""
    from fsdp2_strategy.tuning.measure import measure_interleaved

    def one_sleeps(m, b):
        if not isinstance(m.blocks[0], FSDPModule):
            time.sleep(0.2)
        return w.in_turn(m, b)

    disagreements = {}
    for first_s in ((1.0, 0.5), (0.5, 1.0)):
        w.order.clear()
        got = measure_interleaved(
            w.model,
            w.both,
            w.batch,
            one_sleeps,
            None,
            micro_batches=1,
            warmup=0,
            steps=2,
            close=1.05,
            first_s=list(first_s),
        )
        disagreements[first_s] = [len(m.steps) for m in got]
    return {"disagreements": disagreements}


@_scenario
def _pick_in_turn(w: _World) -> dict:
    """The pick is among the rows measured in turn, though another's single pass was faster."""
    from fsdp2_strategy.tuning import tuner
    from fsdp2_strategy.tuning.candidates import Candidate
    from fsdp2_strategy.tuning.measure import Measurement
    from fsdp2_strategy.tuning.result import TuneRow

    timings = {"alone": (0.1, False), "slow": (0.3, True), "quick": (0.2, True)}
    picks = [
        TuneRow(Candidate(name, {}), measured=Measurement(s, 0, 0, 0, 0, interleaved=turn))
        for name, (s, turn) in timings.items()
    ]
    return {"pick_in_turn": tuner._pick(picks).label}


@_scenario
def _disagree(w: _World) -> dict:
    """Ranks that disagree get one error each, not a hang."""
    mine = FEW[:1] if torch.distributed.get_rank() == 0 else FEW[1:2]
    try:
        f2.tune(w.model, w.batch, candidates=mine, steps=1, warmup=0)
    except ValueError as exc:
        return {"disagree": str(exc)}
    raise AssertionError("tune raised no ValueError for candidates that differ between the ranks")


@_scenario
def _timed(w: _World) -> dict:
    """compare_strategies(time=True): a predicted column from a sweep and one measured step."""
    timed = f2.compare_strategies(
        w.model,
        world_size=2,
        example_batch=w.batch,
        strategies=("FULL_SHARD", "NO_SHARD"),
        offload=(False,),
        checkpointing=(False,),
        time=True,
    )
    return {
        "timed_rows": [r.predicted is not None and r.predicted.total_s > 0 for r in timed.rows],
        "timed_header": "predicted s/step" in str(timed),
    }


@_scenario
def _throughput(w: _World) -> dict:
    """objective="throughput": tuned and cached once, reused on the next call without tuning."""
    import fsdp2_strategy.tuning.resolve as resolve

    os.environ["FSDP2_TUNE_CACHE"] = w.cache
    cfg = {"sharding_strategy": "auto", "objective": "throughput", "log_plan": False}
    first = f2.shard_model(Tiny(), cfg, example_batch=w.batch)
    with open(w.cache) as f:
        (entry,) = json.load(f).values()
    out: dict = {"cached": sorted(entry)}

    def no_tuning(*args, **kwargs):
        raise AssertionError("tuned again although the decision was cached")

    resolve.tune, original = no_tuning, resolve.tune
    try:
        second = f2.shard_model(Tiny(), cfg, example_batch=w.batch)
    finally:
        resolve.tune = original
    out["same_choice"] = str(f2.sharding_plan(first)) == str(f2.sharding_plan(second))
    return out


@_scenario
def _cli(w: _World) -> dict:
    """The command line, on the same world."""
    args = ["--steps", "1", "--warmup", "0", "--candidates", json.dumps(FEW[:2]), "--json", w.cache + ".cli.json"]
    return {"cli": main(["tune", "test_tune:tiny_with_batch", *args])}


SCENARIO_SKEW_S = 60.0
"""How long a rank that ended a scenario waits for the others to end it too (they end it within
moments of each other: each scenario's collectives keep the ranks in step)."""


def _tune_world(cache: str) -> dict[str, tuple[str, Any]]:
    """Every scenario in turn on one world (as PyTorch's `run_subtests`): {name: ("ok", its result)
    or ("error", its traceback) or ("not run", why)}. A scenario that raises on every rank is
    recorded and the next one runs; one that raised on some ranks only ends the world's scenarios
    (the ranks' collectives may no longer match): the others are recorded as not run. Where the
    ranks that did not raise wait in a collective of that scenario, the ones that raised fail the
    world after SCENARIO_SKEW_S, with every scenario's traceback so far."""
    from datetime import timedelta

    import torch.distributed as dist

    # The ranks tell each other how each scenario ended on a group of its own, whose collectives
    # cannot pair with one that a failing scenario left behind on the default group.
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=SCENARIO_SKEW_S))
    w = _World(cache)
    results: dict[str, tuple[str, Any]] = {}
    for name, check in SCENARIOS.items():
        try:
            results[name] = ("ok", check(w))
        except KeyboardInterrupt:
            raise
        except BaseException:  # DCP's CheckpointException is a BaseException
            results[name] = ("error", traceback.format_exc())
        ended = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(ended, results[name][0], group=side)
        except Exception as exc:
            raised = "".join(f"\nscenario {n} raised:\n{v}" for n, (status, v) in results.items() if status == "error")
            raise RuntimeError(
                f"scenario {name}: the other ranks did not end it within {SCENARIO_SKEW_S:.0f}s of this one (a "
                f"scenario that raised on some ranks only leaves the others waiting in its collectives){raised}"
            ) from exc
        if "error" in ended and "ok" in ended:
            failed = [rank for rank, status in enumerate(ended) if status == "error"]
            why = f"not run: scenario {name} raised on rank(s) {failed} only"
            results.update({later: ("not run", why) for later in SCENARIOS if later not in results})
            break
    return results


class Scenarios:
    """The world's scenarios as each rank ended them; `world[name]` is a scenario's result (rank 0's),
    after asserting that it returned on every rank with the same result, naming the scenario and why
    otherwise."""

    def __init__(self, per_rank: list[dict[str, tuple[str, Any]]], cache: str):
        self.per_rank, self.cache = per_rank, cache

    def __getitem__(self, name: str) -> dict:
        ended = [results[name] for results in self.per_rank]
        problems = [
            f"rank {rank} raised:\n{value}" if status == "error" else f"rank {rank}: {value}"
            for rank, (status, value) in enumerate(ended)
            if status != "ok"
        ]
        assert not problems, f"scenario {name} of the tune world failed:\n" + "\n".join(problems)
        for rank, (_, value) in enumerate(ended[1:], start=1):
            difference = _first_difference(ended[0][1], value)
            assert difference is None, f"scenario {name}: rank {rank} disagrees with rank 0: {difference}"
        return ended[0][1]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Scenarios:
    cache = str(tmp_path_factory.mktemp("tune") / "fsdp2_tune.json")
    return Scenarios(run_distributed(_tune_world, 2, cache, timeout=240), cache)


def test_candidates_over_the_budget_are_reported_not_run(world):
    out = world["budget"]
    rows = {label: (fits, ran, why) for label, fits, ran, why in out["rows"]}
    assert rows["NO_SHARD/one group"][:2] == (False, False) and "over the budget" in rows["NO_SHARD/one group"][2]
    assert rows["FULL_SHARD/blocks"][:2] == (True, True) and rows["FULL_SHARD/one group"][:2] == (True, True)
    assert out["best"] in ("FULL_SHARD/blocks", "FULL_SHARD/one group")
    assert all(out["predicted"]), "every estimated row gets a prediction"
    assert "<-" in out["table"] and "NO_SHARD/one group: estimated peak" in out["table"]


def test_tuning_leaves_the_model_the_optimizer_and_the_rng_as_they_were(world):
    out = world["budget"]
    assert out["unchanged"] and out["rng_unchanged"] and out["grads_unchanged"]


def test_a_model_on_the_meta_device_is_materialised_per_candidate_and_stays_on_meta(world):
    out = world["meta"]
    assert out["meta"] == [("FULL_SHARD/blocks", True), ("FULL_SHARD/one group", True)]
    assert out["still_meta"]


def test_a_failing_candidate_is_skipped_with_its_reason_and_disagreeing_ranks_get_an_error(world):
    out = world["failing"] | world["disagree"]
    assert out["failing"] == [("FULL_SHARD/blocks", True, ""), ("FULL_SHARD/one group", False, "failed")]
    assert "rank 0: OutOfMemoryError" in out["failing_reason"] and "rank 1: OutOfMemoryError" in out["failing_reason"]
    assert out["disagree"].startswith("tune: ranks disagree on candidates: rank 0 has ['FULL_SHARD/blocks'], rank 1")


def test_the_probe_measures_a_steady_step_within_the_steps_asked_for(world):
    out = world["probes"]
    peak, collectives, forwards = out["probes"]["warm-up 2"]
    assert peak > 0 and sum(collectives.values()) > 0
    assert forwards == (2 + 1) * 2  # 2 micro-batches per step: the probe is the second warm-up step
    assert out["probes"]["warm-up 1"] == (peak, collectives, (1 + 1 + 1) * 2)  # the probe after the timed step
    assert out["probes"]["none"] == (0, {}, (2 + 1) * 2)


def _probe_and_memtracker_peaks() -> tuple[int, int]:
    """The probe's live-bytes peak and torch's MemTracker's (`helpers.memtrack.measure_peak`) for the same
    steady step: TinyGPT, per-block FULL_SHARD (FSDP2 frees each gathered block with a storage
    resize), 2 micro-batches, AdamW."""
    from helpers.memtrack import MODELS, measure_peak

    from fsdp2_strategy.estimate import optimizer_factory
    from fsdp2_strategy.tuning.measure import _built, _probe, train_step

    make_model, make_batch, loss_fn = MODELS["gpt"]
    cfg = f2.FSDP2Config(log_plan=False)
    args = _built(make_model(), cfg, optimizer_factory("adamw"), make_batch(8), loss_fn, 2)
    train_step(*args)
    return _probe(*args)[0], measure_peak("gpt", {}, micro_batches=2)


def test_the_probe_counts_the_live_bytes_memtracker_counts(world):
    out = world["probe_vs_memtracker"]
    probe, memtracker = out["probe_vs_memtracker"]
    assert probe == pytest.approx(memtracker, rel=1e-3)


def test_live_tensor_bytes_counts_each_storage_once_until_it_dies_or_is_resized():
    from fsdp2_strategy.tuning.probe import LiveTensorBytes

    resize = torch.UntypedStorage.resize_
    kept = torch.zeros(100, dtype=torch.uint8)
    with LiveTensorBytes([kept]) as live:
        assert live.now == 100  # a root's storage, alive from the start
        a = torch.empty(1000, dtype=torch.uint8)
        view = a[10:]
        assert live.now == 1100  # a view shares its base's storage
        del a, view
        assert live.now == 100
        b = torch.empty(2000, dtype=torch.uint8)
        b.untyped_storage().resize_(0)  # how FSDP2 frees a gathered parameter, unseen by dispatch
        assert live.now == 100
        b.untyped_storage().resize_(500)
        assert live.now == 600
    assert live.peak == 2100
    assert torch.UntypedStorage.resize_ is resize


def test_a_candidate_whose_first_two_timed_steps_are_over_the_limit_takes_no_more(world):
    out = world["stops"]
    # (timed steps kept, stopped, forwards run: 2 per step, the probe step's included)
    assert out["stops"] == {
        "all over": (1, True, 6),  # two timed steps and the probe; the second step kept
        "none over": (3, False, 8),
        "first over": (3, False, 8),  # the second step was under the limit: the first was noise
        "second over": (1, True, 6),
    }
    assert out["stopped_s"] >= SLOW_STEP_S  # timed by the second step, which slept


def test_a_measurement_s_phases_add_up_to_its_median_step(world):
    out = world["stops"]
    phases, step = out["phases_add_up"]
    assert phases == pytest.approx(step, rel=1e-9)


def test_the_phases_are_the_median_step_s_scaled_to_its_time():
    from fsdp2_strategy.tuning.measure import _median_step_phases

    # [step, forward, backward, optimizer], each column the slowest rank's: phases over the step
    steps = [[2.0, 1.0, 2.0, 1.0], [1.0, 0.3, 0.6, 0.6], [0.5, 0.1, 0.3, 0.1]]
    assert _median_step_phases(steps) == pytest.approx((0.2, 0.4, 0.4))
    # an even count: the mean of the two middle steps' (1.0 and 2.0 s, scaled), adding up to 1.5 s
    assert _median_step_phases(steps + [[4.0, 1.0, 1.0, 2.0]]) == pytest.approx((0.35, 0.7, 0.45))


def test_candidates_measured_in_turn_step_alternately_close_calls_twice_and_the_pick_is_among_them(world):
    out = world["in_turn"] | world["close_calls"] | world["disagreements"] | world["pick_in_turn"]
    order, got = out["in_turn"]
    assert order == ["blocks", "one"] + ["blocks", "one", "one", "blocks", "blocks", "one"]
    assert got == [(3, 0, {}, True), (3, 0, {}, True)]
    twice = ["blocks", "one", "one", "blocks"]
    assert out["close_calls"] == {100.0: (twice + twice, [4, 4]), 1.0: (twice, [2, 2])}
    assert out["disagreements"] == {(1.0, 0.5): [4, 4], (0.5, 1.0): [2, 2]}
    assert out["pick_in_turn"] == "quick"


def test_the_rounds_in_turn_are_unsettled_for_close_calls_and_where_the_first_pass_disagrees():
    from fsdp2_strategy.tuning.measure import unsettled

    in_turn = [0.30, 0.32, 0.40, 0.50]
    # close calls only: within 1.1x of the fastest in turn (0.30); none but the fastest itself
    assert unsettled(in_turn, None, 1.1) == [0, 1] and unsettled(in_turn, None, 1.05) == []
    # c's first pass beat the leader's by more than 1.05x (0.20 against 0.25): c takes more rounds
    assert unsettled(in_turn, [0.25, 0.30, 0.20, 0.24], 1.05) == [0, 2]
    # by less (d: 0.24 * 1.05 > 0.25), or slower: settled
    assert unsettled(in_turn, [0.25, 0.30, 0.26, 0.24], 1.05) == []


def test_compare_strategies_time_true_adds_predictions(world):
    out = world["timed"]
    assert out["timed_rows"] == [True, True] and out["timed_header"]


def test_throughput_objective_caches_and_reuses_the_decision(world):
    out, cache = world["throughput"] | world["cli"], world.cache
    assert out["cached"] == ["changes", "label", "step_s", "table"]
    assert out["same_choice"]
    assert out["cli"] == 0
    written = json.load(open(cache + ".cli.json"))
    assert [r["label"] for r in written["rows"]] == ["FULL_SHARD/blocks", "FULL_SHARD/one group"]
    assert written["best"] in ("FULL_SHARD/blocks", "FULL_SHARD/one group")


# --------------------------------------------------------------------------- no world needed
def _estimate(**fields) -> MemoryEstimate:
    base = dict.fromkeys(
        (
            "param_bytes",
            "gathered_param_bytes",
            "grad_bytes",
            "optimizer_bytes",
            "mixed_precision_bytes",
            "buffer_bytes",
            "activation_bytes",
            "activation_peak_bytes",
            "communication_buffer_bytes",
            "peak_bytes",
        ),
        0,
    )
    defaults = dict(strategy="FULL_SHARD", world_size=2, shard_size=2, cpu_offload=False, accumulation="sync_last")
    return MemoryEstimate(**{**base, **defaults, "peak_phase": "forward", **fields})


LINK = Link(
    {
        "all_gather": CollectiveFit(latency_s=1e-3, bytes_per_s=1e9),
        "reduce_scatter": CollectiveFit(latency_s=2e-3, bytes_per_s=5e8),
        "all_reduce": CollectiveFit(latency_s=3e-3, bytes_per_s=2e9),
    },
    world_size=2,
)


def test_the_step_time_formula():
    est = _estimate(
        activation_checkpointing=True,
        micro_batches=2,
        collective_calls={"all_gather": 6, "reduce_scatter": 2, "all_reduce": 0},
        communication={"all_gather": 4_000_000, "reduce_scatter": 1_000_000, "all_reduce": 0},
        gathering_groups=2,
    )
    compute = ComputeProfile(forward_s=0.1, backward_s=0.2, optimizer_s=0.4, per_call_s=0.01)
    p = predict_step_time(est, LINK, compute, "cpu")
    # 2 x (0.1 + 0.2 + 0.1 recomputed); 0.4 / 2 ranks; 6 x (1 ms + 10 ms) + 4 MB / 1 GB/s;
    # 2 x (2 ms + 10 ms) + 1 MB / 0.5 GB/s; nothing overlaps on CPU.
    assert p.compute_s == pytest.approx(0.8) and p.optimizer_s == pytest.approx(0.2)
    assert p.communication_s == pytest.approx(0.066 + 0.004 + 0.024 + 0.002)
    assert p.exposed_s == p.communication_s and p.total_s == pytest.approx(0.8 + 0.2 + 0.096)
    # On an accelerator only one all-gather is exposed when compute covers the rest, but all of
    # FSDP's per-call overhead is (8 calls x 10 ms): it delays the compute.
    cuda = predict_step_time(est, LINK, compute, "cuda")
    assert cuda.exposed_s == pytest.approx(0.001 + 0.004 / 6 + 8 * 0.01)
    assert cuda.total_s == pytest.approx(0.8 + 0.2 + cuda.exposed_s)


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_the_per_call_cost_is_fitted_from_local_calls_where_nothing_is_communicated(device_type):
    """World size 1: no collective runs, but every unshard and sync is a copy with FSDP's hooks
    around it (one group per block was 1.27x one group in all on an H200)."""

    def estimate(unshards: int, syncs: int, groups: int) -> MemoryEstimate:
        return _estimate(
            world_size=1,
            shard_size=1,
            micro_batches=2,
            activation_checkpointing=False,
            collective_calls={"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0},
            local_calls={"all_gather": unshards, "reduce_scatter": syncs},
            local_groups=groups,
        )

    blocks, one_group, groups_of_4 = estimate(84, 21, 21), estimate(2, 1, 1), estimate(22, 6, 6)
    no_link = Link({}, world_size=1)
    truth = ComputeProfile(forward_s=0.02, backward_s=0.03, optimizer_s=0.01, local_call_s=3e-4)
    # The phases a step of `one_group` shows: its 2 forward unshards in forward, the sync in backward.
    phases = (0.02 + 3e-4, 0.03 + 3e-4 / 2, 0.01)
    measured_blocks = predict_step_time(blocks, no_link, truth, device_type).total_s
    assert measured_blocks == pytest.approx(2 * 0.05 + 0.01 + 105 * 3e-4)
    fitted = ComputeProfile.fit(phases, one_group, measured_blocks, blocks, no_link, device_type)
    assert fitted.local_call_s == pytest.approx(3e-4) and fitted.per_call_s == 0
    assert (fitted.forward_s, fitted.backward_s) == pytest.approx((0.02, 0.03))
    assert predict_step_time(groups_of_4, no_link, fitted, device_type).total_s == pytest.approx(0.11 + 28 * 3e-4)


def test_local_calls_are_the_unshards_and_syncs_no_collective_carries():
    model, batch = Tiny(layers=3), torch.randn(8, 64)

    def estimate(strategy: str, world: int, mode: str = "sync_last"):
        return f2.estimate_memory(
            model,
            {"sharding_strategy": strategy},
            world_size=world,
            example_batch=batch,
            accumulation=mode,
            micro_batches=2,
        )

    for mode in ("sync_last", "sync_each", "keep_gathered"):
        one, two = estimate("FULL_SHARD", 1, mode), estimate("FULL_SHARD", 2, mode)
        # One rank makes every unshard and sync two ranks make, none of them a collective.
        assert sum(one.collective_calls.values()) == 0 and sum(two.local_calls.values()) == 0
        assert one.local_calls == {k: two.collective_calls[k] for k in ("all_gather", "reduce_scatter")}
        assert one.local_groups == two.gathering_groups == 4 and one.gathering_groups == two.local_groups == 0
    # NO_SHARD on 2 ranks: the unshards are local (3 blocks and the root, once per forward), the
    # syncs are all-reduces.
    replicated = estimate("NO_SHARD", 2)
    assert replicated.local_calls == {"all_gather": 4 * 2, "reduce_scatter": 0}
    assert replicated.collective_calls == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 4}


@pytest.mark.parametrize("per_call", [0.004, -0.0005])
def test_per_call_and_per_byte_costs_and_fixed_optimizer_part_are_recovered_from_three_measured_steps(per_call):
    def estimate(**fields):
        return _estimate(activation_checkpointing=False, micro_batches=1, **fields)

    many = estimate(
        collective_calls={"all_gather": 7, "reduce_scatter": 4, "all_reduce": 0},
        communication={"all_gather": 3_000_000, "reduce_scatter": 2_000_000, "all_reduce": 0},
        gathering_groups=4,
    )
    one = estimate(
        collective_calls={"all_gather": 1, "reduce_scatter": 1, "all_reduce": 0},
        communication={"all_gather": 1_500_000, "reduce_scatter": 2_000_000, "all_reduce": 0},
        gathering_groups=1,
    )
    # NO_SHARD's unshards are local calls: on several ranks they cost nothing of their own (its
    # per-byte cost takes them in).
    replicated = estimate(
        strategy="NO_SHARD",
        shard_size=1,
        collective_calls={"all_gather": 0, "reduce_scatter": 0, "all_reduce": 3},
        communication={"all_gather": 0, "reduce_scatter": 0, "all_reduce": 4_000_000},
        local_calls={"all_gather": 3, "reduce_scatter": 0},
        local_groups=3,
    )
    # AdamW's per-tensor work does not shrink with the shard: 0.01 s + 0.08 s / shard size; the
    # all-reduce costs 2 ns per byte more in a step than in the sweep.
    truth = ComputeProfile(
        forward_s=0.05,
        backward_s=0.1,
        optimizer_s=0.08,
        per_call_s=per_call,
        optimizer_fixed_s=0.01,
        per_byte_s={"all_reduce": 2e-9},
    )
    # The phases a step of `many` would show: forward holds 4 of the 7 all-gathers.
    ag = 7 * (1e-3 + per_call) + 3_000_000 / 1e9
    rs = 4 * (2e-3 + per_call) + 2_000_000 / 5e8
    phases = (0.05 + ag * 4 / 7, 0.1 + ag * 3 / 7 + rs, 0.01 + 0.08 / 2)
    measured_one = predict_step_time(one, LINK, truth).total_s
    third = (0.01 + 0.08, predict_step_time(replicated, LINK, truth).total_s, replicated)
    fitted = ComputeProfile.fit(phases, many, measured_one, one, LINK, third=third)
    assert fitted.per_call_s == pytest.approx(per_call, rel=1e-6) and fitted.local_call_s == 0
    assert (fitted.forward_s, fitted.backward_s) == pytest.approx((0.05, 0.1))
    assert (fitted.optimizer_s, fitted.optimizer_fixed_s) == pytest.approx((0.08, 0.01))
    assert fitted.per_byte_s == {"all_reduce": pytest.approx(2e-9)}
    # Without the third step the whole optimizer step is taken to shrink with the shard.
    alone = ComputeProfile.fit(phases, many, measured_one, one, LINK)
    assert (alone.optimizer_s, alone.optimizer_fixed_s) == pytest.approx((0.1, 0.0)) and alone.per_byte_s == {}


def test_the_per_call_cost_is_never_below_minus_the_least_latency():
    many = _estimate(
        micro_batches=1,
        collective_calls={"all_gather": 7, "reduce_scatter": 4},
        gathering_groups=4,
        activation_checkpointing=False,
    )
    one = _estimate(
        micro_batches=1,
        collective_calls={"all_gather": 1, "reduce_scatter": 1},
        gathering_groups=1,
        activation_checkpointing=False,
    )
    phases = (0.05, 0.1, 0.04)
    # `one` measured far slower than any per-call cost explains: the fit stops at -1 ms (the
    # all-gather's latency; reduce-scatter's is 2 ms), so no call is predicted to cost less than 0.
    fitted = ComputeProfile.fit(phases, many, 10.0, one, LINK)
    assert fitted.per_call_s == pytest.approx(-1e-3)


def test_second_pass_remeasures_contenders_last_first_and_keeps_the_faster_pass():
    from fsdp2_strategy.tuning import passes
    from fsdp2_strategy.tuning.candidates import Candidate
    from fsdp2_strategy.tuning.measure import Measurement
    from fsdp2_strategy.tuning.result import TuneRow

    # a and e: over 1.3 x the fastest (0.20): not contenders.
    first = {"a": 0.40, "b": 0.20, "c": 0.25, "d": 0.255, "e": 0.27}
    again = {"b": 0.21, "c": None, "d": 0.25}  # c fails on its second run
    rows = []
    for label, s in first.items():
        row = TuneRow(Candidate(label, {}), fits=True)
        row.measured = Measurement(
            step_s=s,
            forward_s=0,
            backward_s=0,
            optimizer_s=0,
            peak_bytes=100,
            collectives={"x": 3},
            cost_s=1.0,
            passes=[s],
        )
        rows.append(row)
    calls = []

    def measure(row, warmup, probe):  # the second pass sets no stop_above_s: it keeps the faster pass
        calls.append((row.label, warmup, probe))
        s = again[row.label]
        if s is None:
            return None, "failed: rank 0: RuntimeError: out of memory"
        m = Measurement(step_s=s, forward_s=0, backward_s=0, optimizer_s=0, peak_bytes=0, cost_s=2.0, passes=[s])
        return m, ""

    passes.second_pass(rows, measure)
    # last first, SECOND_PASS_WARMUP warm-up steps, no probe; a and e are not contenders
    w = passes.SECOND_PASS_WARMUP
    assert calls == [("d", w, False), ("c", w, False), ("b", w, False)]
    got = {r.label: (r.measured.step_s, r.measured.passes, r.measured.cost_s) for r in rows}
    assert got["b"] == (0.20, [0.20, 0.21], 3.0) and got["d"] == (0.25, [0.255, 0.25], 3.0)
    assert got["c"] == (0.25, [0.25], 1.0) and got["e"] == (0.27, [0.27], 1.0)  # c keeps its only pass
    assert got["a"] == (0.40, [0.40], 1.0)
    # d's faster pass is the second, which took no probe: the first pass's peak and collectives stay.
    assert all(r.measured.peak_bytes == 100 and r.measured.collectives == {"x": 3} for r in rows)
    assert all(r.skipped == "" for r in rows)


def _first_passes(times: dict, peak: int = 100) -> list:
    from fsdp2_strategy.tuning.candidates import Candidate
    from fsdp2_strategy.tuning.measure import Measurement
    from fsdp2_strategy.tuning.result import TuneRow

    return [
        TuneRow(
            Candidate(label, {}),
            _estimate(peak_bytes=peak, activation_checkpointing=False, micro_batches=1),
            fits=True,
            measured=Measurement(s, 0, 0, 0, peak_bytes=7, collectives={"x": 3}, cost_s=1.0, passes=[s]),
        )
        for label, s in times.items()
    ]


def test_interleaved_pass_measures_the_contenders_in_turn_when_they_fit_together():
    from fsdp2_strategy.tuning import passes
    from fsdp2_strategy.tuning.measure import Measurement

    first = {"a": 0.40, "b": 0.20, "c": 0.25, "d": 0.255}  # a: over 1.3 x the fastest, not a contender
    in_turn = {"b": 0.24, "c": 0.22, "d": 0.26}
    asked = []

    def together(rows):
        asked.append([r.label for r in rows])
        return [
            Measurement(in_turn[r.label], 0.01, 0, 0, 0, cost_s=2.0, passes=[in_turn[r.label]], interleaved=True)
            for r in rows
        ], ""

    rows = _first_passes(first)
    assert passes.interleaved_pass(rows, together, budget=300)  # three peaks of 100 fit in 300
    assert asked == [["b", "c", "d"]]
    got = {r.label: (r.measured.step_s, r.measured.passes, r.measured.cost_s, r.measured.interleaved) for r in rows}
    assert got["a"] == (0.40, [0.40], 1.0, False)
    assert got["b"] == (0.24, [0.20, 0.24], 3.0, True) and got["c"] == (0.22, [0.25, 0.22], 3.0, True)
    # the in-turn pass's phases, the first pass's peak and collectives (it took the probe)
    assert all((r.measured.peak_bytes, r.measured.collectives) == (7, {"x": 3}) for r in rows)
    assert rows[1].measured.forward_s == 0.01

    # Over the budget together (three of 100 B against 299 B), or failed: nothing changes, and the
    # caller measures them one after another.
    for budget, answer, calls in ((299, None, 0), (300, (None, "failed: rank 1: OutOfMemoryError"), 1)):
        asked.clear()
        rows = _first_passes(first)
        assert not passes.interleaved_pass(rows, lambda rows, answer=answer: asked.append(1) or answer, budget=budget)
        assert len(asked) == calls and [r.measured.passes for r in rows] == [[s] for s in first.values()]


def test_the_third_reference_joins_the_pass_in_turn_where_it_fits_beside_the_contenders():
    from fsdp2_strategy.tuning import passes
    from fsdp2_strategy.tuning.candidates import Candidate
    from fsdp2_strategy.tuning.measure import Measurement
    from fsdp2_strategy.tuning.result import TuneRow

    # label: (shard size, all-gathers, first pass s, estimated peak B). b and c lead (shard size 2);
    # of shard size 1, d makes the fewest calls: the third reference, over 1.3 x the fastest.
    shapes = {"b": (2, 2, 0.20, 100), "c": (2, 10, 0.25, 100), "d": (1, 1, 0.40, 150), "e": (1, 9, 0.45, 150)}

    def rows_():
        return [
            TuneRow(
                Candidate(label, {}),
                _estimate(
                    shard_size=size,
                    collective_calls={"all_gather": calls},
                    peak_bytes=peak,
                    activation_checkpointing=False,
                    micro_batches=1,
                ),
                fits=True,
                measured=Measurement(s, 0, 0, 0, peak_bytes=7, cost_s=1.0, passes=[s]),
            )
            for label, (size, calls, s, peak) in shapes.items()
        ]

    asked = []

    def together(rows):
        asked.append([r.label for r in rows])
        return [Measurement(0.3, 0, 0, 0, 0, cost_s=2.0, passes=[0.3], interleaved=True) for r in rows], ""

    rows = rows_()
    assert passes.references(rows)[2].label == "d"
    assert passes.interleaved_pass(rows, together, budget=350)
    assert asked == [["b", "c", "d"]]
    d = rows[2].measured
    assert d.interleaved and d.passes == [0.40, 0.3] and d.expected_s == pytest.approx((0.40 * 0.3) ** 0.5)
    assert rows[3].measured.passes == [0.45]  # e: neither a contender nor a reference
    # No room for d beside the contenders (200 of 349 B taken, d's peak 150): the contenders alone.
    asked.clear()
    assert passes.interleaved_pass(rows_(), together, budget=349)
    assert asked == [["b", "c"]]
    # One contender: no pass in turn, and none for the reference alone.
    asked.clear()
    rows = rows_()
    rows[1].measured = Measurement(0.5, 0, 0, 0, 0, passes=[0.5])
    assert passes.interleaved_pass(rows, together, budget=10**6) and asked == []
    # The reference a contender already: measured once in turn, not twice.
    rows = rows_()
    rows[2].measured = Measurement(0.22, 0, 0, 0, 0, passes=[0.22])
    assert passes.interleaved_pass(rows, together, budget=10**6) and asked == [["b", "c", "d"]]


def test_third_pass_settles_the_fastest_row_while_its_passes_disagree():
    from fsdp2_strategy.tuning import passes
    from fsdp2_strategy.tuning.candidates import Candidate
    from fsdp2_strategy.tuning.measure import Measurement
    from fsdp2_strategy.tuning.result import TuneRow

    def measurement(step, passes, peak=0):
        return Measurement(step_s=step, forward_s=step, backward_s=0, optimizer_s=0, peak_bytes=peak, passes=passes)

    # a leads on a lucky pass (0.30 against 0.42); once it takes its median, b leads on one; then c,
    # whose passes agree, leads and nothing more is measured.
    kept = {"a": [0.30, 0.42], "b": [0.33, 0.45], "c": [0.37, 0.38], "d": [0.50, 0.90]}
    rows = [
        TuneRow(Candidate(label, {}), fits=True, measured=measurement(min(p), p, peak=100)) for label, p in kept.items()
    ]
    calls = []

    def measure(row, warmup, probe):
        calls.append((row.label, warmup, probe))
        return measurement(0.40, [0.40]), ""

    passes.third_pass(rows, measure)
    assert calls == [("a", passes.SECOND_PASS_WARMUP, False), ("b", passes.SECOND_PASS_WARMUP, False)]
    a = rows[0].measured
    # the median of three; its phases are those of the pass it came from (the third)
    assert (a.step_s, a.passes, a.forward_s, a.peak_bytes) == (0.40, [0.30, 0.42, 0.40], 0.40, 100)
    assert [r.measured.step_s for r in rows[1:]] == [0.40, 0.37, 0.50]


def test_a_third_pass_whose_median_is_the_discarded_pass_scales_the_kept_phases_to_it():
    from fsdp2_strategy.tuning import passes
    from fsdp2_strategy.tuning.candidates import Candidate
    from fsdp2_strategy.tuning.measure import Measurement
    from fsdp2_strategy.tuning.result import TuneRow

    # The faster pass (0.30 s: 0.10 + 0.15 + 0.05) was kept, the second (0.42 s) only as a time;
    # the third (0.50 s) makes the second the median: the kept phases are scaled to add up to it.
    kept = Measurement(
        step_s=0.30, forward_s=0.10, backward_s=0.15, optimizer_s=0.05, peak_bytes=7, passes=[0.30, 0.42]
    )
    rows = [TuneRow(Candidate("a", {}), fits=True, measured=kept)]
    again = Measurement(step_s=0.50, forward_s=0.2, backward_s=0.2, optimizer_s=0.1, peak_bytes=0, passes=[0.50])
    passes.third_pass(rows, lambda row, warmup, probe: (again, ""))
    m = rows[0].measured
    assert (m.step_s, m.passes, m.peak_bytes) == (0.42, [0.30, 0.42, 0.50], 7)
    assert (m.forward_s, m.backward_s, m.optimizer_s) == pytest.approx((0.14, 0.21, 0.07))


def test_first_pass_measures_fewest_calls_first_and_stops_a_row_over_the_recheck_factor():
    from fsdp2_strategy.tuning import passes
    from fsdp2_strategy.tuning.candidates import Candidate
    from fsdp2_strategy.tuning.measure import Measurement
    from fsdp2_strategy.tuning.result import TuneRow

    times = {"a": 0.40, "b": 0.20, "c": 0.30, "d": 0.10, "e": 0.50, "f": 0.60}
    calls = {"a": 30, "b": 5, "c": 1, "d": 10, "e": 40, "f": 50}
    sizes = {"f": 1}  # the others shard over 2 ranks
    rows = [
        TuneRow(
            Candidate(label, {}),
            _estimate(
                shard_size=sizes.get(label, 2),
                collective_calls={"all_gather": calls[label]},
                activation_checkpointing=False,
                micro_batches=1,
            ),
            fits=label != "c",  # c does not fit: never measured, though it has the fewest calls
        )
        for label in times
    ]
    seen = []

    def measure(row, warmup, probe, process_warmup, stop_above_s):
        seen.append((row.label, process_warmup, stop_above_s))
        s = times[row.label]
        return Measurement(step_s=s, forward_s=0, backward_s=0, optimizer_s=0, peak_bytes=1, passes=[s]), ""

    passes.first_pass(rows, measure, 2)
    # fewest calls first; the first warms the process and is never stopped; then 1.3 x the fastest
    # so far, but for e, the most calls of the largest shard size (f makes more on a smaller one)
    assert [(label, extra) for label, extra, _ in seen] == [
        ("b", passes.FIRST_EXTRA_WARMUP),
        ("d", 0),
        ("a", 0),
        ("e", 0),
        ("f", 0),
    ]
    limits = [limit for _, _, limit in seen]
    assert limits[0] is None and limits[1:3] == pytest.approx([0.26, 0.13]) and limits[3] is None
    assert limits[4] == pytest.approx(0.13)
    assert passes.per_call_row(rows).label == "e" and rows[2].measured is None


def test_reference_rows_follow_the_measuring_order():
    from fsdp2_strategy.tuning import passes
    from fsdp2_strategy.tuning.candidates import Candidate
    from fsdp2_strategy.tuning.measure import Measurement
    from fsdp2_strategy.tuning.result import TuneRow

    # label: (shard size, collective calls, stopped after one step), in table order
    shapes = {"a": (2, 25, True), "b": (2, 2, False), "c": (2, 10, False), "d": (1, 1, False), "e": (1, 9, False)}
    rows = [
        TuneRow(
            Candidate(label, {}),
            _estimate(
                shard_size=size, collective_calls={"all_gather": calls}, activation_checkpointing=False, micro_batches=1
            ),
            fits=True,
            measured=Measurement(0.1, 0, 0, 0, 0, stopped=stopped),
        )
        for label, (size, calls, stopped) in shapes.items()
    ]
    # Of the largest shard size (2), in measuring order b, c, a: b, the first that took all its
    # steps, and of those that took all theirs, c, whose calls differ most (a stopped after one
    # step); of another size, d, the first in measuring order.
    ref, other, third = passes.references(rows)
    assert (ref.label, other.label, third.label) == ("b", "c", "d")
    rows[0].measured.stopped = False  # a took all its steps: a, 23 calls apart
    assert passes.references(rows)[1].label == "a"
    # b and a stopped after one step: c, then a stopped one rather than none (15 calls apart,
    # against b's 8); d stopped: e.
    for row in (rows[0], rows[1], rows[3]):
        row.measured.stopped = True
    ref, other, third = passes.references(rows)
    assert (ref.label, other.label, third.label) == ("c", "a", "e")
    # One shard size: no third.
    assert passes.references(rows[:3])[2] is None


def test_a_row_measured_in_turn_is_expected_at_the_geometric_mean_of_its_passes():
    from fsdp2_strategy.tuning.measure import Measurement

    in_turn = Measurement(0.9, 0.2, 0.6, 0.1, 0, passes=[0.4, 0.9], interleaved=True)
    assert in_turn.expected_s == pytest.approx(0.6)
    # one after another (the faster or median pass), or one pass only: the step time itself
    assert Measurement(0.4, 0, 0, 0, 0, passes=[0.4, 0.9]).expected_s == 0.4
    assert Measurement(0.5, 0, 0, 0, 0, passes=[0.5], interleaved=True).expected_s == 0.5


def test_the_step_time_model_takes_the_reference_rows_at_their_expected_step():
    from fsdp2_strategy.tuning import tuner
    from fsdp2_strategy.tuning.candidates import Candidate
    from fsdp2_strategy.tuning.measure import Measurement
    from fsdp2_strategy.tuning.result import TuneRow

    def estimate(**fields):
        return _estimate(activation_checkpointing=False, micro_batches=1, **fields)

    few = estimate(
        collective_calls={"all_gather": 1, "reduce_scatter": 1, "all_reduce": 0},
        communication={"all_gather": 1_500_000, "reduce_scatter": 2_000_000, "all_reduce": 0},
    )
    many = estimate(
        collective_calls={"all_gather": 7, "reduce_scatter": 4, "all_reduce": 0},
        communication={"all_gather": 3_000_000, "reduce_scatter": 2_000_000, "all_reduce": 0},
    )
    replicated = estimate(
        strategy="NO_SHARD",
        shard_size=1,
        collective_calls={"all_gather": 0, "reduce_scatter": 0, "all_reduce": 3},
        communication={"all_gather": 0, "reduce_scatter": 0, "all_reduce": 4_000_000},
    )
    # label: (estimate, phases of the kept pass's median step, passes, measured in turn)
    shapes = {
        "few": (few, (0.12, 0.28, 0.1), [0.45, 0.5], True),  # expected 0.474...
        "many": (many, (0.2, 0.5, 0.1), [0.4, 0.8], True),  # expected 0.566...
        "replicated": (replicated, (0.15, 0.35, 0.2), [0.7], False),
    }
    rows = [
        TuneRow(
            Candidate(label, {}),
            est,
            fits=True,
            measured=Measurement(sum(phases), *phases, 0, passes=passes, interleaved=in_turn),
        )
        for label, (est, phases, passes, in_turn) in shapes.items()
    ]
    _, reference = tuner._predict_rows(rows, LINK)
    assert reference == "few + many + replicated"
    # Each reference row is predicted at its expected step, the geometric mean of its first pass
    # and its pass in turn (in turn alone: 0.5 and 0.8 s), its phases scaled to it.
    expected = [(0.45 * 0.5) ** 0.5, (0.4 * 0.8) ** 0.5, 0.7]
    assert [r.predicted.total_s for r in rows] == pytest.approx(expected, rel=1e-9)
    assert [r.error for r in rows] == pytest.approx([0, 0, 0], abs=1e-9)


def test_offload_copies_each_unshard_from_the_shard_and_each_gradient_shard_back():
    model, batch = Tiny(layers=3), torch.randn(8, 64)

    def estimate(mode: str, offload: bool, **config) -> MemoryEstimate:
        return f2.estimate_memory(
            model,
            {"sharding_strategy": "FULL_SHARD", "cpu_offload": offload, **config},
            world_size=2,
            example_batch=batch,
            accumulation=mode,
            micro_batches=2,
        )

    shard = estimate("sync_last", False).param_bytes  # every parameter sharded and trainable
    assert shard > 0 and estimate("sync_last", False).host_copy_bytes == 0
    # keep_gathered: each group copied to the device once a step and its gradient shard back once.
    assert estimate("keep_gathered", True).host_copy_bytes == 2 * shard
    # sync_each: a gradient shard back per micro-batch, one more than sync_last.
    assert estimate("sync_each", True).host_copy_bytes - estimate("sync_last", True).host_copy_bytes == shard
    # On 2 ranks in fp32 each rank sends its shard in every all-gather and receives its gradient
    # shard from every reduce-scatter: the copies are the bytes those collectives send (the groups
    # kept gathered after forward, the root and the last block, gather and copy only in forward).
    for mode, more in [("sync_last", {}), ("sync_each", {}), ("sync_last", {"reshard_after_forward": False})]:
        sent = estimate(mode, False, **more).communication
        assert estimate(mode, True, **more).host_copy_bytes == sent["all_gather"] + sent["reduce_scatter"]
    assert estimate("sync_last", True).host_copy_bytes < 5 * shard


def _offload_estimate(calls: int, copied: int, offload: bool = True) -> MemoryEstimate:
    """A k=1 estimate with `calls` all-gathers of 1 MB, half as many reduce-scatters, and `copied`
    bytes between host and device under offload."""
    return _estimate(
        micro_batches=1,
        activation_checkpointing=False,
        cpu_offload=offload,
        collective_calls={"all_gather": calls, "reduce_scatter": calls // 2},
        communication={"all_gather": 1_000_000 * calls, "reduce_scatter": 500_000 * calls},
        gathering_groups=calls // 2,
        host_copy_bytes=copied if offload else 0,
    )


def test_the_offload_terms_are_fitted_to_one_offloaded_setting_and_predict_the_others():
    estimate = _offload_estimate
    base = ComputeProfile(forward_s=0.05, backward_s=0.1, optimizer_s=0.08, per_call_s=1e-3, optimizer_fixed_s=0.01)
    # The host's optimizer step 6x the device's; 40 ns per byte copied between host and device.
    truth = dataclasses.replace(base, host_optimizer_scale=6.0, host_copy_s_per_byte=4e-8)
    blocks, one_group = estimate(8, 24_000_000), estimate(2, 6_000_000)
    on_host = predict_step_time(one_group, LINK, truth, "cuda")
    assert on_host.optimizer_s == pytest.approx(6 * (0.01 + 0.08 / 2)) and on_host.host_copy_s == pytest.approx(0.24)
    fitted = f2.estimate.fit_offload(base, on_host.optimizer_s, on_host.total_s, one_group, LINK, "cuda")
    assert (fitted.host_optimizer_scale, fitted.host_copy_s_per_byte) == pytest.approx((6.0, 4e-8))
    assert predict_step_time(blocks, LINK, fitted, "cuda").total_s == pytest.approx(
        predict_step_time(blocks, LINK, truth, "cuda").total_s
    )
    # A setting without offload is predicted as before; so is every setting on a CPU mesh, where
    # offloaded state already is where it is used (and nothing is fitted there).
    plain = estimate(8, 0, offload=False)
    assert (
        predict_step_time(plain, LINK, fitted, "cuda").total_s == predict_step_time(plain, LINK, base, "cuda").total_s
    )
    assert (
        predict_step_time(blocks, LINK, fitted, "cpu").total_s == predict_step_time(blocks, LINK, base, "cpu").total_s
    )
    assert f2.estimate.fit_offload(base, 1.0, 5.0, one_group, LINK, "cpu") is base
    # Copies cost no less than nothing: a step faster than the host's optimizer explains.
    assert f2.estimate.fit_offload(base, on_host.optimizer_s, 0.1, one_group, LINK, "cuda").host_copy_s_per_byte == 0


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_offloaded_rows_are_not_references_and_one_fits_the_offload_terms_on_an_accelerator(device_type, monkeypatch):
    from fsdp2_strategy.tuning import passes, tuner
    from fsdp2_strategy.tuning.candidates import Candidate
    from fsdp2_strategy.tuning.measure import Measurement
    from fsdp2_strategy.tuning.result import TuneRow

    def row(label: str, calls: int, offload: bool, phases: tuple, stopped: bool = False) -> TuneRow:
        est = _offload_estimate(calls, 3_000_000 * calls, offload)
        measured = Measurement(sum(phases), *phases, 0, stopped=stopped)
        return TuneRow(Candidate(label, {}), est, fits=True, measured=measured)

    # In measuring order (fewest calls first) the offloaded one group comes first, but stopped.
    rows = [
        row("blocks", 8, False, (0.1, 0.2, 0.05)),
        row("one group", 2, False, (0.08, 0.15, 0.05)),
        row("one group/offload", 2, True, (0.3, 0.5, 0.9), stopped=True),
        row("blocks/offload", 8, True, (0.5, 0.9, 0.9)),
    ]
    ref, other, _ = passes.references(rows)
    assert (ref.label, other.label) == ("one group", "blocks")
    assert passes.offload_reference(rows).label == "blocks/offload"
    assert passes.offload_reference(rows[:2]) is None and passes.offload_reference(rows[2:]) is None
    # Every row offloaded: the references are offloaded ones.
    assert [r.label for r in passes.references(rows[2:])[:2]] == ["blocks/offload", "one group/offload"]
    monkeypatch.setattr(tuner, "mesh_device_type", lambda: device_type)
    tuner._predict_rows(rows[:2], LINK)
    alone = [r.predicted.total_s for r in rows[:2]]
    _, reference = tuner._predict_rows(rows, LINK)
    if device_type == "cpu":
        assert reference == "one group + blocks"
        assert rows[3].predicted.total_s == pytest.approx(rows[0].predicted.total_s)
    else:
        # The offload reference is predicted at its step; the rows without offload as without it.
        assert reference == "one group + blocks + blocks/offload"
        assert rows[3].predicted.total_s == pytest.approx(1.4 + 0.9)
        assert rows[2].predicted.host_copy_s == pytest.approx(rows[3].predicted.host_copy_s / 4)
    assert [r.predicted.total_s for r in rows[:2]] == alone


def test_fit_line_recovers_latency_and_bandwidth():
    points = [(x, 2e-4 + x / 3e8) for x in (1e4, 1e6, 8e6)]
    fit = fit_line(points)
    assert fit.latency_s == pytest.approx(2e-4) and fit.bytes_per_s == pytest.approx(3e8)


def test_collective_calls_follow_the_accumulation_mode():
    model, batch = Tiny(layers=3), torch.randn(8, 64)
    calls = {
        mode: f2.estimate_memory(
            model, {"accumulation": mode}, world_size=2, example_batch=batch, accumulation=mode, micro_batches=4
        ).collective_calls
        for mode in ("sync_each", "sync_last", "keep_gathered")
    }
    assert calls["sync_each"]["reduce_scatter"] == 4 * calls["sync_last"]["reduce_scatter"]
    assert calls["keep_gathered"]["all_gather"] < calls["sync_last"]["all_gather"] == calls["sync_each"]["all_gather"]


def test_objective_is_validated():
    with pytest.raises(ValueError, match=r"FSDP2Config.objective='fast'.*memory, throughput"):
        f2.FSDP2Config(sharding_strategy="auto", objective="fast")
    with pytest.raises(ValueError, match=r"FSDP2Config.objective='throughput'.*sharding_strategy='auto'"):
        f2.FSDP2Config(sharding_strategy="FULL_SHARD", objective="throughput")


def test_bad_input_is_refused_before_anything_runs():
    with pytest.raises(RuntimeError, match="initialised process group"):
        f2.tune(Tiny(), torch.randn(2, 64))
    with pytest.raises(ValueError, match="needs one rank's micro-batch"):
        from fsdp2_strategy.tuning import resolve_throughput

        resolve_throughput(Tiny(), f2.FSDP2Config(sharding_strategy="auto", objective="throughput"), 2, 1)
    with pytest.raises(ValueError, match="does not vary"):
        from fsdp2_strategy.tuning.candidates import coerce_candidates

        coerce_candidates([{"memory_budget": "1GiB"}])


def test_cache_key_depends_on_model_world_and_device(tmp_path):
    cfg = f2.FSDP2Config()
    key = cache_key(Tiny(), torch.randn(8, 64), cfg, 2, 1, "cpu")
    assert key == cache_key(Tiny(), torch.randn(8, 64), cfg, 2, 1, "cpu")
    assert key != cache_key(Tiny(layers=4), torch.randn(8, 64), cfg, 2, 1, "cpu")
    assert key != cache_key(Tiny(), torch.randn(8, 64), cfg, 4, 1, "cpu")
    assert key != cache_key(Tiny(), torch.randn(8, 64), cfg, 2, 1, "cuda")
    path = tmp_path / "c.json"
    assert read_decision(path, key) is None
    write_decision(path, key, {"label": "x", "changes": {"sharding_strategy": "NO_SHARD"}, "step_s": 0.1})
    write_decision(path, "other", {"label": "y", "changes": {}, "step_s": 0.2})
    assert read_decision(path, key)["changes"] == {"sharding_strategy": "NO_SHARD"}
    path.write_text("not json")
    assert read_decision(path, key) is None


def test_config_of_applies_a_rows_settings_to_the_base_not_to_the_pick():
    """A "blocks" row leaves wrap_policy to the base: applied over the pick (one group) it would be
    one group too, which is how the interleaved benchmark once timed the wrong settings."""
    from fsdp2_strategy.tuning.candidates import Candidate
    from fsdp2_strategy.tuning.result import TuneResult, TuneRow

    base = f2.FSDP2Config(log_plan=False)
    blocks = TuneRow(Candidate("FULL_SHARD/blocks", {"sharding_strategy": "FULL_SHARD"}))
    one = TuneRow(Candidate("FULL_SHARD/one group", {"sharding_strategy": "FULL_SHARD", "wrap_policy": None}))
    result = TuneResult(
        rows=[blocks, one],
        best=one,
        base_config=base,
        time_model=None,
        reference="",
        world_size=2,
        device_type="cpu",
        budget=1,
        samples_per_step=1,
    )
    assert base.wrap_policy is not None and result.best_config.wrap_policy is None
    assert result.config_of("FULL_SHARD/blocks").wrap_policy == base.wrap_policy
    assert result.config_of("FULL_SHARD/one group").wrap_policy is None
    with pytest.raises(KeyError, match="no row 'NO_SHARD/blocks'"):
        result.config_of("NO_SHARD/blocks")


def test_default_candidates_leave_sync_each_to_a_base_that_asks_for_it():
    from fsdp2_strategy.tuning import default_candidates

    def labels(mode: str) -> list[str]:
        return [c.label for c in default_candidates(f2.FSDP2Config(accumulation=mode, log_plan=False), 1, 4)]

    five = [
        "FULL_SHARD/blocks",
        "FULL_SHARD/one group",
        "SHARD_GRAD_OP/blocks",
        "NO_SHARD/blocks",
        "NO_SHARD/one group",
    ]
    keep = ["FULL_SHARD/blocks/keep_gathered", "FULL_SHARD/one group/keep_gathered"]
    # "sync_each" only adds reduce-scatters to "sync_last": never the faster one, so not tried over it.
    # Under "keep_gathered" SHARD_GRAD_OP would repeat FULL_SHARD: the same peak and collectives.
    assert labels("sync_last") == five + keep
    assert labels("sync_each") == five + ["FULL_SHARD/blocks/sync_last"] + keep
    assert [c.label for c in default_candidates(f2.FSDP2Config(log_plan=False), 1, 1)] == five


def test_shard_grad_op_under_keep_gathered_would_repeat_full_shard():
    model, batch = Tiny(layers=4), torch.randn(8, 64)
    est = {
        s: f2.estimate_memory(
            model,
            {"sharding_strategy": s},
            world_size=2,
            example_batch=batch,
            accumulation="keep_gathered",
            micro_batches=4,
        )
        for s in ("FULL_SHARD", "SHARD_GRAD_OP")
    }
    same = ("peak_bytes", "collective_calls", "communication")
    assert [getattr(est["FULL_SHARD"], f) for f in same] == [getattr(est["SHARD_GRAD_OP"], f) for f in same]
    # One all-gather per group per step, as test_accumulation counts them: 4 blocks and the root.
    assert est["FULL_SHARD"].collective_calls["all_gather"] == 5


def test_groups_of_several_blocks_are_a_candidate_between_blocks_and_one_group():
    from fsdp2_strategy.tuning.candidates import default_candidates, middle_group_size

    assert [middle_group_size(b) for b in (2, 3, 6, 8, 16)] == [None, 2, 2, 3, 4]
    labels = [c.label for c in default_candidates(f2.FSDP2Config(log_plan=False), 1, 1, blocks=8)]
    assert labels[:3] == ["FULL_SHARD/blocks", "FULL_SHARD/one group", "FULL_SHARD/groups of 3"]
    grouped = next(c for c in default_candidates(f2.FSDP2Config(log_plan=False), 1, 1, blocks=8) if "groups" in c.label)
    assert grouped.config(f2.FSDP2Config(log_plan=False)).blocks_per_group == 3
    # A base that groups blocks already is not offered another grouping; its rows say its groups.
    base = f2.FSDP2Config(blocks_per_group=2, log_plan=False)
    rows = default_candidates(base, 1, 2, blocks=8)
    assert [c.label for c in rows] == [
        "FULL_SHARD/groups of 2",
        "FULL_SHARD/one group",
        "SHARD_GRAD_OP/groups of 2",
        "NO_SHARD/groups of 2",
        "NO_SHARD/one group",
        "FULL_SHARD/groups of 2/keep_gathered",
        "FULL_SHARD/one group/keep_gathered",
    ]
    assert all(c.config(base).blocks_per_group == 2 for c in rows)

"""Accumulation modes (`FSDP2Config.accumulation`): same numbers as one process, counted communication.

One spawned 2-rank world trains every mode x variant for several optimizer steps with k
micro-batches per step and compares every step's gradients and the final parameters with a
one-process run on the same global batch; it also counts the collectives of the last step.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from helpers import ROOT
from helpers.comm import collective_dtypes, count_collectives
from helpers.harness import launch, run_agreeing
from helpers.models import TinyGPT, loss_fn, make_batch, rel_diff
from helpers.precision import TIED_TOL, policy_grads, with_weights

MODES = ("sync_each", "sync_last", "keep_gathered")
K = 3  # micro-batches per optimizer step
STEPS = 3
MICRO = 2  # samples per rank per micro-batch
GROUPS = 4  # blocks.0, blocks.1, blocks.2 and the root
TOL = 1e-5
LR = 0.5
TIED = ["tok.weight"]  # TinyGPT's embedding, tied to its head


class SkipGPT(TinyGPT):
    """TinyGPT whose forward can skip one block (a micro-batch that does not use it)."""

    def forward(self, idx, skip: int = -1):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for i, block in enumerate(self.blocks):
            if i != skip:
                x = block(x)
        logits = self.head(self.ln_f(x))
        return logits / self.temperature if self.temperature is not None else logits


# Micro-batch i of every step skips SKIPS[i]: blocks.1 is first used on the second micro-batch,
# blocks.2 is not used on the last one.
SKIPS = (1, -1, 2)

VARIANTS = {
    "fp32": {},
    "bf16": {"mixed_precision": "bf16"},
    "hsdp_2x1": {"sharding_strategy": "HYBRID_SHARD", "mesh_shape": (2, 1)},
    "override": {"module_overrides": {"blocks.1": {"sharding_strategy": "HYBRID_SHARD"}}},
    "checkpointing": {"activation_checkpointing": "auto"},
    "skip_block": {"mixed_precision": "bf16"},
    "compile": {"compile": True},
    # blocks.0 and blocks.1 sharded together (one fully_shard call), blocks.2 alone: 3 groups.
    "two_blocks": {"blocks_per_group": 2},
}


def _ce(model, idx, target, skip=-1):
    logits = model(idx, skip) if skip != -1 else model(idx)
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


def _global_micro(step: int, i: int, world: int) -> slice:
    start = (step * K + i) * MICRO * world
    return slice(start, start + MICRO * world)


def _reference(model: torch.nn.Module, idx, target, world: int, skips) -> tuple[list[dict], dict]:
    """One process, the whole global micro-batches: per-step gradients and final parameters."""
    from helpers.collect import full_grads, full_params

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    for step in range(STEPS):
        for i in range(K):
            sl = _global_micro(step, i, world)
            (_ce(model, idx[sl], target[sl], skips[i]) / K).backward()
        grads.append(full_grads(model))
        opt.step()
        opt.zero_grad()
    return grads, full_params(model)


def _step_grads_in_dtype(
    template: torch.nn.Module, weights: dict, idx, target, world: int, skips, step: int, dtype: torch.dtype
) -> dict:
    """The gradients of optimizer step `step` from `weights` as the policy promises them (tests/helpers/precision.py)."""

    def loss(model, rank, i):
        start = _global_micro(step, i, world).start + rank * MICRO
        return _ce(model, idx[start : start + MICRO], target[start : start + MICRO], skips[i])

    rank_batches = [[(r, i) for i in range(K)] for r in range(world)]
    return policy_grads(with_weights(template, weights), rank_batches, loss, dtype, scale=1 / K)


def _train(model, idx, target, rank: int, world: int, skips) -> dict:
    """k micro-batches per step, `f2.no_sync` on all but the last. Returns every step's gradients,
    the weights before each step and after the last, the collectives of the last step, the dtypes
    of the sharded gradients and the (collective, dtype) of the last step's reductions."""
    from helpers.collect import full_grads, full_params

    import fsdp2_strategy as f2

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads, weights, grad_dtypes = [], [], set()
    for step in range(STEPS):
        weights.append(full_params(model))
        with count_collectives() as counts, collective_dtypes() as reductions:
            for i in range(K):
                sl = _global_micro(step, i, world)
                local = slice(sl.start + rank * MICRO, sl.start + (rank + 1) * MICRO)
                with f2.no_sync(model) if i < K - 1 else contextlib.nullcontext():
                    (_ce(model, idx[local], target[local], skips[i]) / K).backward()
        grads.append(full_grads(model))
        grad_dtypes |= {str(p.grad.dtype) for p in model.parameters()}
        opt.step()
        opt.zero_grad()
    weights.append(full_params(model))
    return {"grads": grads, "weights": weights, "counts": counts, "grad_dtypes": grad_dtypes, "reductions": reductions}


def _errors(trace: dict, ref_grads: list[dict], ref_params: dict | None, names: list[str]) -> dict:
    """Largest relative differences over `names`: every step's gradients against `ref_grads`, the
    first step's, and the final weights against `ref_params` (None: each step's update against SGD
    applied to the engine's own gradients, in fp32 on the fp32 weights)."""
    grads, weights = trace["grads"], trace["weights"]
    if ref_params is None:
        param_err = max(
            rel_diff(weights[s + 1][n], weights[s][n] - LR * grads[s][n]) for s in range(STEPS) for n in names
        )
    else:
        param_err = max(rel_diff(weights[-1][n], ref_params[n]) for n in names)
    return {
        "grad": max(rel_diff(g[n], r[n]) for g, r in zip(grads, ref_grads) for n in names),
        "first_grad": max(rel_diff(grads[0][n], ref_grads[0][n]) for n in names),
        "param": param_err,
    }


def _modes_world():
    import torch.distributed as dist

    import fsdp2_strategy as f2

    rank, world = dist.get_rank(), dist.get_world_size()
    idx, target = make_batch(n=STEPS * K * MICRO * world)
    torch.manual_seed(0)
    ref = SkipGPT(temperature=True)
    out = {}
    for variant, cfg in VARIANTS.items():
        finals = {}
        skips = SKIPS if variant == "skip_block" else (-1,) * K
        low = cfg.get("mixed_precision") and torch.bfloat16
        if not low:  # fp32: a plain module trained on the global batch
            ref_grads, ref_params = _reference(copy.deepcopy(ref), idx, target, world, skips)
        for mode in MODES:
            model = f2.shard_model(copy.deepcopy(ref), cfg, accumulation=mode, log_plan=False)
            trace = _train(model, idx, target, rank, world, skips)
            if low:  # bf16: each step's gradients from the engine's own weights, the policy written out
                ref_grads = [
                    _step_grads_in_dtype(ref, trace["weights"][s], idx, target, world, skips, s, low)
                    for s in range(STEPS)
                ]
                ref_params = None
            untied = [n for n in trace["weights"][0] if n not in TIED]
            errors = _errors(trace, ref_grads, ref_params, untied)
            tied = _errors(trace, ref_grads, ref_params, TIED)
            sharded = all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters() if p.ndim)
            finals[mode] = trace["weights"][-1]
            counts = trace["counts"]
            out[(variant, mode)] = {
                "grad_err": errors["grad"],
                "first_grad_err": errors["first_grad"],
                "param_err": errors["param"],
                "tied_grad_err": tied["grad"],
                "tied_param_err": tied["param"],
                "sharded_after_step": sharded,
                "reductions": sorted(trace["reductions"]),
                "grad_dtypes": sorted(trace["grad_dtypes"]),
                "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
                "all_gathers": counts["all_gather_into_tensor"] + counts["all_gather_single"],
                "reduce_scatters": counts["reduce_scatter_tensor"] + counts["reduce_scatter_single"],
                "all_reduces": counts["all_reduce"],
            }
        # The modes change communication, never numbers: final parameters agree across modes.
        out[(variant, "mode_spread")] = max(
            rel_diff(finals[m][n], finals["sync_last"][n]) for m in MODES for n in finals[m]
        )
    out["plan"] = next(
        line for line in str(f2.sharding_plan(model)).splitlines() if line.startswith("gradient accumulation")
    )
    out["exception"] = _exception_checks(ref, idx, target)
    out["gathered_on_entry"] = _gathered_on_entering_no_sync(ref)
    return out


def _gathered_on_entering_no_sync(ref) -> dict:
    """Per mode: which groups are gathered inside `f2.no_sync` before any forward has run."""
    import fsdp2_strategy as f2
    from fsdp2_strategy import _torch_compat as tc

    out = {}
    for mode in MODES:
        model = f2.shard_model(copy.deepcopy(ref), accumulation=mode, log_plan=False)
        groups = [g for m in model.modules() for g in tc.param_groups(m)]
        with f2.no_sync(model):
            out[mode] = sum(g.is_unsharded for g in groups)
    return out


def _exception_checks(ref, idx, target) -> dict:
    """An exception inside a micro-batch (after a forward, or before any) leaves no group gathered,
    sync on, and the next step as it would have been: same collectives, same gradients."""
    import torch.distributed as dist
    from helpers.collect import full_grads
    from torch.distributed.tensor import DTensor

    import fsdp2_strategy as f2

    rank = dist.get_rank()
    mine, both = slice(rank * 2, rank * 2 + 2), slice(0, 4)
    expected = copy.deepcopy(ref)
    loss_fn(expected, idx[both], target[both]).backward()
    expected_grads = {n: p.grad for n, p in expected.named_parameters()}
    out = {}
    for mode in MODES:
        for when in ("after_forward", "before_forward"):
            model = f2.shard_model(copy.deepcopy(ref), accumulation=mode, log_plan=False)
            fresh = f2.shard_model(copy.deepcopy(ref), accumulation=mode, log_plan=False)
            with count_collectives() as baseline:  # one ordinary k=1 step (its second: after lazy init)
                for _ in range(2):
                    loss_fn(fresh, idx[mine], target[mine]).backward()
            if when == "after_forward":
                loss_fn(model, idx[mine], target[mine]).backward()  # an earlier, finished step
            model.zero_grad()
            try:
                with f2.no_sync(model):
                    if when == "after_forward":
                        loss_fn(model, idx[mine], target[mine]).backward()  # "keep_gathered": all gathered now
                        loss_fn(model, idx[mine], target[mine])
                    raise RuntimeError("user error in the middle of a micro-batch")
            except RuntimeError:
                pass
            sharded = all(isinstance(p, DTensor) for p in model.parameters() if p.ndim)
            model.zero_grad()  # the aborted step's gradients are lost, as documented
            with count_collectives() as after:
                loss_fn(model, idx[mine], target[mine]).backward()
                loss_fn(model, idx[mine], target[mine]).backward()
            grads = {n: g / 2 for n, g in full_grads(model).items()}
            out[(mode, when)] = {
                "sharded": sharded,
                "baseline": dict(baseline),
                "after": dict(after),
                "grad_err": max(rel_diff(grads[n], expected_grads[n]) for n in expected_grads),
            }
    return out


@pytest.fixture(scope="module")
def results():
    return run_agreeing(_modes_world, 2, timeout=600)


# Collectives of one optimizer step (K=3 micro-batches, 2 ranks, 4 groups; the root and the last block
# keep their parameters from forward to backward, the other two blocks are gathered twice per micro-batch).
ALL_GATHERS = {"sync_each": K * (1 + 1 + 2 + 2), "sync_last": K * (1 + 1 + 2 + 2), "keep_gathered": GROUPS}
REDUCE_SCATTERS = {"sync_each": K * GROUPS, "sync_last": GROUPS, "keep_gathered": GROUPS}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_equals_one_process(results, variant, mode):
    r = results[(variant, mode)]
    # fp32: the whole run against one process (measured 6.3e-07). bf16: each step's gradients against
    # the policy written out from the same weights (measured <= 1.1e-09: only the fp32 summation order
    # differs), and each update against fp32 SGD on fp32 weights (measured 0).
    assert r["grad_err"] < TOL and r["param_err"] < TOL, r
    # The tied embedding: its two contributions per backward are added in bf16 by torch (2.13; and
    # partly in 2.15), in fp32 by the reference: at most one bf16 rounding (measured 1.1e-3 to 1.6e-3).
    assert r["tied_grad_err"] < (TIED_TOL if VARIANTS[variant].get("mixed_precision") else TOL), r
    assert r["tied_param_err"] < TOL, r
    assert r["sharded_after_step"], r  # nothing stays gathered after the last backward
    # The policy's dtypes: fp32 master weights and sharded gradients, reductions in fp32.
    assert r["param_dtypes"] == r["grad_dtypes"] == ["torch.float32"], r
    assert r["reductions"] and all(dtype == "float32" for _, dtype in r["reductions"]), r


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_modes_change_communication_not_numbers(results, variant):
    # fp32: the modes agree to rounding. bf16: torch 2.15 adds a tied weight's contributions in fp32
    # under sync_last and in bf16 under sync_each; the runs then drift apart by bf16 roundings
    # (measured 1.4e-3 after 3 steps; 1.6e-9 on torch 2.13).
    bound = TIED_TOL if VARIANTS[variant].get("mixed_precision") else 1e-6
    assert results[(variant, "mode_spread")] < bound


@pytest.mark.parametrize("variant", ["fp32", "bf16", "checkpointing", "compile", "override"])
@pytest.mark.parametrize("mode", MODES)
def test_collectives_per_optimizer_step(results, variant, mode):
    r = results[(variant, mode)]
    # keep_gathered: each group all-gathered exactly once per step, also with activation
    # checkpointing (recomputation finds the parameters gathered) and compiled blocks.
    assert r["all_gathers"] == ALL_GATHERS[mode], r
    assert r["reduce_scatters"] == REDUCE_SCATTERS[mode], r
    # The replicated scalar follows the mode: averaged on every micro-batch under "sync_each" (as the
    # sharded gradients are reduce-scattered), on the last one only otherwise; "override" adds
    # blocks.1's HSDP all-reduce (over a replicate group of one), on the last micro-batch only.
    scalar = K if mode == "sync_each" else 1
    assert r["all_reduces"] == scalar + (1 if variant == "override" else 0), r


@pytest.mark.parametrize("variant", ["fp32", "bf16", "hsdp_2x1", "checkpointing", "two_blocks"])
@pytest.mark.parametrize("mode", MODES)
def test_the_estimator_counts_the_collectives_each_mode_runs(results, variant, mode):
    # The estimator asks the same AccumulationMode as no_sync: its counts are the measured ones (the
    # replicated scalar's all-reduces aside: the estimator leaves 0-dim parameters out).
    import fsdp2_strategy as f2

    r = results[(variant, mode)]
    estimate = f2.estimate_memory(
        SkipGPT(temperature=True), {**VARIANTS[variant], "accumulation": mode}, world_size=2, micro_batches=K
    )
    scalar = K if mode == "sync_each" else 1
    measured = {
        "all_gather": r["all_gathers"],
        "reduce_scatter": r["reduce_scatters"],
        "all_reduce": r["all_reduces"] - scalar,
    }
    assert estimate.collective_calls == measured


@pytest.mark.parametrize("mode", MODES)
def test_blocks_sharded_together_gather_and_reduce_once_per_group(results, mode):
    r = results[("two_blocks", mode)]
    # Groups: the root and blocks.2 (the last block) kept from forward to backward, blocks.0 + blocks.1
    # gathered twice per micro-batch: one call for the two blocks where "fp32" makes two.
    per_micro_batch = 1 + 1 + 2
    assert r["all_gathers"] == (3 if mode == "keep_gathered" else K * per_micro_batch), r
    assert r["reduce_scatters"] == (K * 3 if mode == "sync_each" else 3), r


@pytest.mark.parametrize("mode", MODES)
def test_hsdp_all_reduces_on_the_last_micro_batch_only(results, mode):
    # HSDP 2x1: no shards to scatter; 4 group all-reduces once per step (K times as many if sync_each
    # did not defer them with set_requires_all_reduce), plus the scalar's (every micro-batch under sync_each).
    r = results[("hsdp_2x1", mode)]
    scalar = K if mode == "sync_each" else 1
    assert (r["all_reduces"], r["reduce_scatters"], r["all_gathers"]) == (GROUPS + scalar, 0, 0), r


@pytest.mark.parametrize("mode", MODES)
def test_micro_batch_that_skips_a_block(results, mode):
    # blocks.1 first used on micro-batch 2, blocks.2 unused on the last one, with bf16: torch 2.13
    # fails in "sync_last" without the one-time gather of every group (AttributeError
    # '_unsharded_param', checked by disabling it); "keep_gathered" still gathers each group once
    # per step, blocks.1 included.
    r = results[("skip_block", mode)]
    assert r["reduce_scatters"] == {"sync_each": 3 + 4 + 3, "sync_last": GROUPS, "keep_gathered": GROUPS}[mode], r
    if mode == "keep_gathered":
        assert r["all_gathers"] == GROUPS, r


def test_keep_gathered_gathers_every_group_up_front_on_cpu(results):
    # All-gathers started together when the step's first no_sync begins, not one per forward;
    # the other modes gather nothing before the forward.
    assert results["gathered_on_entry"] == {"sync_each": 0, "sync_last": 0, "keep_gathered": GROUPS}


def test_plan_names_the_mode(results):
    assert results["plan"].startswith("gradient accumulation: keep_gathered"), results["plan"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("when", ["after_forward", "before_forward"])
def test_exception_inside_a_micro_batch(results, mode, when):
    r = results["exception"][(mode, when)]
    assert r["sharded"], r  # no group left gathered
    assert r["after"] == r["baseline"], r  # sync on, reshard choices back: the same collectives as before
    assert r["grad_err"] < TOL, r  # the aborted micro-batches' unreduced gradients are not added in


def test_invalid_mode_names_the_field():
    import fsdp2_strategy as f2

    with pytest.raises(ValueError, match=r"FSDP2Config.accumulation='sync_never'.*sync_each, sync_last, keep_gathered"):
        f2.FSDP2Config(accumulation="sync_never")


def test_accumulation_benchmark_counts_each_mode():
    """benchmarks/accumulation.py at a tiny size: its counts show each mode's promise."""

    root = ROOT
    args = ["--dim", "64", "--layers", "2", "--batch", "2", "--ks", "1", "4", "--part", "counts"]
    proc = launch("torchrun", "benchmarks/accumulation.py", *args, cwd=root, nproc=2, timeout=300)
    rows = {
        (line.split()[0], int(line.split()[1])): [float(v) for v in line.split()[2:]]
        for line in proc.stdout.splitlines()
        if line.split()[:1] and line.split()[0] in MODES + ("one_group",)
    }
    # columns: all-gathers/group, reduce-scatters/group, AG MiB, RS MiB, held gradient MiB, peak MiB
    assert rows[("keep_gathered", 4)][:2] == [1.0, 1.0]  # each group gathered and reduced once per step
    assert rows[("one_group", 4)][:4] == rows[("keep_gathered", 4)][:4]  # the same bytes, in one group
    assert rows[("sync_each", 4)][1] == 4.0 and rows[("sync_last", 4)][1] == 1.0
    # Held gradients: sync_each keeps only the shards, half of sync_last's full gradients on 2 ranks.
    each, last = rows[("sync_each", 4)][4], rows[("sync_last", 4)][4]
    assert abs(2 * each - last) < 0.02 * last, (each, last)

"""FSDP2Accelerator flows on 2 ranks in one world; each flow checks what it claims (`helpers.checks.Checks`)
and every rank writes its report (OUT.rankN.json).

Usage (tests/ on the path, as `helpers.harness.launch` puts it), in tests/integrations/accelerate/scripts/:

    PYTHONPATH=.. accelerate launch --config_file fsdp2.yaml flows.py OUT.json WORKDIR [FLOW,FLOW... [EARLIER]]

Launched by `accelerate launch` with an ordinary accelerate FSDP config, so the plugin's
defaults come from the `FSDP_*` variables that config produces. Each flow records its named checks
(and the numbers they judged) under its own key; tests/integrations/accelerate/test_accelerate.py launches and reports.
EARLIER: rank 0's report of the fsdp2.yaml launch, for the variant launch's flows that continue it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.tracking import GeneralTracker
from accelerate.utils import GradScalerKwargs, InitProcessGroupKwargs
from common import (
    PER_RANK,
    VOCAB,
    all_indices,
    dataset,
    fresh,
    full_grads,
    full_params,
    gather,
    lm_loss,
    loader,
    max_rel_diff,
    rank_batch,
    reduce_scatters,
    reference,
    setup_resumable,
    train,
    update_rel_diff,
)
from helpers.checks import Checks
from helpers.collect import run_flows
from helpers.comm import collective_dtypes, count_collectives
from helpers.precision import TIED_TOL, policy_grads, tied_names
from helpers.slow_staging import copied_by, differing, full_state, slow_staging
from resume_flows import EARLIER, resume_from_one, resume_on_two
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Subset

import fsdp2_strategy as f2
from fsdp2_strategy.integrations.accelerate import FSDP2Accelerator, FSDP2Plugin
from fsdp2_strategy.integrations.accelerate.plugin import STOCK_ACCELERATOR_ERROR

TOL = 1e-5  # fp32 parity, relative
GROUPS = ["<root>", "blocks.0", "blocks.1", "blocks.2"]  # TinyGPT wrapped per block


def _rank0s(value):
    """Rank 0's `value` on every rank (what rank 0 alone measured, from the files it alone reads)."""
    return gather(value)[0]


def _missing(wanted, present) -> list:
    """The names of `wanted` not in `present` (checked equal to [] to show what is missing)."""
    return [name for name in wanted if name not in present]


def _plan(model) -> dict:
    plan = f2.sharding_plan(model)
    return {
        "groups": [g.name for g in plan.groups],
        "precision": sorted({g.precision for g in plan.groups}),
        "offload": sorted({g.cpu_offload for g in plan.groups}),
    }


def _launch_config(out: dict) -> Checks:
    """What `accelerate launch --config_file` handed to FSDP2Plugin() and FSDP2Accelerator(), recorded in
    `out`; checks what every config file gives (real FSDP on gloo, where stock Accelerate would run DDP,
    and the stock Accelerator refusing the plugin) and returns the checks for the file's own values."""
    cfg = FSDP2Plugin().fsdp2_config
    out.update(
        wrap_policy=cfg.wrap_policy,
        reshard_after_forward=cfg.reshard_after_forward,
        cpu_offload=cfg.cpu_offload,
        activation_checkpointing=cfg.activation_checkpointing,
        mixed_precision=cfg.mixed_precision,
        sharding_strategy=cfg.sharding_strategy,
        env={k: v for k, v in os.environ.items() if k.startswith("FSDP_") or k == "ACCELERATE_MIXED_PRECISION"},
    )
    acc = FSDP2Accelerator()
    out.update(
        distributed_type=str(acc.distributed_type),
        num_processes=acc.num_processes,
        accelerator_precision=acc.mixed_precision,
        is_fsdp2=acc.is_fsdp2,
        backend=dist.get_backend(),
    )
    check = Checks(out)
    check.equal("FSDP distributed type", out["distributed_type"], "DistributedType.FSDP")
    check.that("is_fsdp2", out["is_fsdp2"] is True, out["is_fsdp2"])
    check.equal("2 processes", out["num_processes"], 2)
    check.equal("gloo backend", out["backend"], "gloo")
    out["stock_error"] = check.raises(
        "the stock Accelerator refuses the plugin by name", lambda: Accelerator(fsdp_plugin=FSDP2Plugin()), TypeError
    )
    check.equal("the stock refusal is the documented message", out["stock_error"], STOCK_ACCELERATOR_ERROR)
    return check


def config_from_launch(out: dict, work: Path) -> None:
    """fsdp2.yaml's keys reach the core: Block wrapping, reshard, no offload, checkpointing or precision."""
    check = _launch_config(out)
    check.equal("wrap policy Block", out["wrap_policy"], ["Block"])
    check.that("reshard_after_forward True", out["reshard_after_forward"] is True, out["reshard_after_forward"])
    check.that("no cpu offload", out["cpu_offload"] is False, out["cpu_offload"])
    check.equal("no activation checkpointing", out["activation_checkpointing"], None)
    check.equal("no mixed precision", out["mixed_precision"], None)
    check.equal("accelerator precision no", out["accelerator_precision"], "no")


def config_from_variant_launch(out: dict, work: Path) -> None:
    """fsdp2_variant.yaml's keys reach the core: size-based wrap, no reshard, offload, checkpointing, bf16."""
    check = _launch_config(out)
    check.equal("size-based wrap 10000", out["wrap_policy"], 10000)
    check.that("reshard_after_forward False", out["reshard_after_forward"] is False, out["reshard_after_forward"])
    check.that("cpu offload", out["cpu_offload"] is True, out["cpu_offload"])
    check.equal("activation checkpointing auto", out["activation_checkpointing"], "auto")
    check.equal("mixed precision bf16", out["mixed_precision"], "bf16")
    check.equal("accelerator precision bf16", out["accelerator_precision"], "bf16")


def parity(out: dict, work: Path) -> None:
    """One SGD step, optimizer built before prepare (rebound), batches from a prepared DataLoader."""
    model, initial = fresh(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = FSDP2Accelerator(mixed_precision="no")
    model, opt, dl = acc.prepare(model, opt, loader(PER_RANK))
    idx, x, y = next(iter(dl))
    acc.backward(lm_loss(model, x, y))
    grads = full_grads(model)
    opt.step()
    params = full_params(model)
    ref_params, ref_grads, _ = reference(initial, [all_indices(idx.tolist())])
    out.update(
        _plan(model),
        grad_rel=max_rel_diff(grads, ref_grads),
        param_rel=max_rel_diff(params, ref_params),
        root_is_fsdp=isinstance(model, FSDPModule),
        indices=gather(idx.tolist()),
        optimizer_params_dtensor=all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"]),
    )
    # The other order: optimizer built after prepare(model), prepared on its own.
    model2, initial2 = fresh(1)
    model2 = acc.prepare(model2)
    opt2 = acc.prepare(torch.optim.SGD(model2.parameters(), lr=0.1))
    idx, x, y = rank_batch()
    acc.backward(lm_loss(model2, x, y))
    opt2.step()
    ref2, _, _ = reference(initial2, [all_indices(idx)])
    out["after_prepare_param_rel"] = max_rel_diff(full_params(model2), ref2)
    check = Checks(out)
    check.that("the root is an FSDP module", out["root_is_fsdp"])
    check.equal("groups by the config file's policy", out["groups"], GROUPS)
    check.that("the optimizer built before prepare holds the shards", out["optimizer_params_dtensor"])
    check.equal("the prepared DataLoader splits the batch", out["indices"], [[0, 1, 2, 3], [4, 5, 6, 7]])
    check.below("gradients equal one process's (relative)", out["grad_rel"], TOL)
    check.below("parameters equal one process's (relative)", out["param_rel"], TOL)
    check.below("optimizer built after prepare: parameters equal one process's", out["after_prepare_param_rel"], TOL)


def variants(out: dict, work: Path) -> None:
    """Plugin keyword arguments over the config file: CPU offload + activation checkpointing."""
    model, initial = fresh(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = FSDP2Accelerator(
        fsdp_plugin=FSDP2Plugin(cpu_offload=True, activation_checkpointing="auto"), mixed_precision="no"
    )
    model, opt = acc.prepare(model, opt)
    idx, x, y = rank_batch()
    acc.backward(lm_loss(model, x, y))
    opt.step()
    ref, _, _ = reference(initial, [all_indices(idx)])
    out.update(_plan(model), param_rel=max_rel_diff(full_params(model), ref))
    check = Checks(out)
    check.equal("every group offloaded", out["offload"], [True])
    check.below("parameters equal one process's (relative)", out["param_rel"], TOL)


def accumulation(out: dict, work: Path) -> None:
    """gradient_accumulation_steps=2: no reduce-scatter on the first micro-batch."""
    model, initial = fresh(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = FSDP2Accelerator(mixed_precision="no", gradient_accumulation_steps=2)
    dl = DataLoader(Subset(dataset(), range(16)), batch_size=PER_RANK)  # 2 micro-batches per rank
    model, opt, dl = acc.prepare(model, opt, dl)
    after_backward, sync_flags, micro = [], [], []
    with count_collectives() as counts:
        for idx, x, y in dl:
            with acc.accumulate(model):
                acc.backward(lm_loss(model, x, y))
                after_backward.append(reduce_scatters(counts))
                sync_flags.append(acc.sync_gradients)
                opt.step()
                opt.zero_grad()
            micro.append(idx.tolist())
    groups = len(f2.sharding_plan(model).groups)
    params = full_params(model)
    per_rank = gather(micro)
    micro_batches = [[i for rank in per_rank for i in rank[m]] for m in range(len(micro))]
    ref, _, _ = reference(initial, micro_batches)
    with count_collectives() as plain:  # the same two backward passes without accumulate()
        for _ in range(2):
            _, x, y = rank_batch()
            acc.backward(lm_loss(model, x, y))
    opt.zero_grad()
    out.update(
        reduce_scatters_after_each_backward=after_backward,
        sync_gradients=sync_flags,
        groups=groups,
        reduce_scatters_two_plain_backwards=reduce_scatters(plain),
        param_rel=max_rel_diff(params, ref),
        micro_batches=len(micro),
    )
    check = Checks(out)
    check.equal("2 micro-batches", out["micro_batches"], 2)
    check.equal("sync_gradients on the last micro-batch only", out["sync_gradients"], [False, True])
    check.equal(
        "one reduce-scatter per group, on the last micro-batch only",
        out["reduce_scatters_after_each_backward"],
        [0, groups],
    )
    check.equal(
        "two plain backwards reduce-scatter every group twice", out["reduce_scatters_two_plain_backwards"], 2 * groups
    )
    check.below("parameters equal one process's (relative)", out["param_rel"], TOL)


def accumulation_modes(out: dict, work: Path) -> None:
    """2 micro-batches per step under FSDP2Plugin(accumulation="keep_gathered"), and under
    GradientAccumulationPlugin(sync_each_batch=True) ("sync_each"); last in FLOWS, because
    accelerate keeps the gradient plugin's settings in shared state."""
    from accelerate.utils import GradientAccumulationPlugin

    cases = {
        "keep_gathered": dict(fsdp_plugin=FSDP2Plugin(accumulation="keep_gathered"), gradient_accumulation_steps=2),
        "sync_each_batch": dict(
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2, sync_each_batch=True)
        ),
    }
    for name, kwargs in cases.items():
        model, initial = fresh(3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        acc = FSDP2Accelerator(mixed_precision="no", **kwargs)
        dl = DataLoader(Subset(dataset(), range(16)), batch_size=PER_RANK)  # 2 micro-batches per rank
        model, opt, dl = acc.prepare(model, opt, dl)
        micro = []
        with count_collectives() as counts:
            for idx, x, y in dl:
                with acc.accumulate(model):
                    acc.backward(lm_loss(model, x, y))
                    opt.step()
                    opt.zero_grad()
                micro.append(idx.tolist())
        per_rank = gather(micro)
        ref, _, _ = reference(initial, [[i for rank in per_rank for i in rank[m]] for m in range(len(micro))])
        plan = f2.sharding_plan(model)
        out[name] = dict(
            mode=plan.accumulation,
            groups=len(plan.groups),
            reduce_scatters=reduce_scatters(counts),
            all_gathers=sum(v for k, v in counts.items() if k.startswith("all_gather")),
            param_rel=max_rel_diff(full_params(model), ref),
        )
    out["scalar_sync_each"] = scalars = _scalars_under_sync_each_batch()
    check = Checks(out)
    kept, each = out["keep_gathered"], out["sync_each_batch"]
    check.equal("keep_gathered: the plan's mode", kept["mode"], "keep_gathered")
    # Every FSDP group reduce-scattered once and all-gathered once per optimizer step, plus the one-time
    # gather of every group before the first unsynchronised backward.
    check.that("keep_gathered: reduce-scatters ran", kept["reduce_scatters"] > 0, kept["reduce_scatters"])
    check.equal(
        "keep_gathered: twice as many all-gathers as reduce-scatters", kept["all_gathers"], 2 * kept["reduce_scatters"]
    )
    check.equal("sync_each_batch=True is the sync_each mode", each["mode"], "sync_each")
    check.equal(
        "sync_each: a reduce-scatter per group on both micro-batches",
        each["reduce_scatters"],
        2 * kept["reduce_scatters"],
    )
    check.that(
        "sync_each all-gathers more than keep_gathered",
        each["all_gathers"] > kept["all_gathers"],
        (each["all_gathers"], kept["all_gathers"]),
    )
    check.below("keep_gathered: parameters equal one process's", kept["param_rel"], TOL)
    check.below("sync_each: parameters equal one process's", each["param_rel"], TOL)
    out["conflict_error"] = check.raises(
        "sync_each_batch with keep_gathered is refused naming both",
        lambda: (
            FSDP2Accelerator(
                fsdp_plugin=FSDP2Plugin(accumulation="keep_gathered"),
                mixed_precision="no",
                gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2, sync_each_batch=True),
            ).fsdp2_config
        ),
        ValueError,
        "sync_each_batch=True",
        "accumulation='keep_gathered'",
    )
    # Accelerate's RegressionModel scalars (replicated by the core) follow sync_each too: averaged on the
    # first micro-batch already, equal on every rank and to one process (its test_sync.py checks this).
    check.that("scalars: the first micro-batch is not a sync step", not scalars["sync_step"], scalars["sync_step"])
    check.equal("scalars: gradients equal on both ranks", scalars["grads"][0], scalars["grads"][1])
    check.close("scalars: gradients averaged as one process's", scalars["grads"][0], scalars["ref"], 1e-6)
    FSDP2Accelerator(mixed_precision="no", gradient_accumulation_steps=1)  # sync_each_batch back off for later flows


class _Regression(torch.nn.Module):
    """Accelerate's test RegressionModel (0-dim `a` and `b`, which the core replicates) plus a Linear
    for FSDP to shard."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Parameter(torch.tensor(2.0)), torch.nn.Parameter(torch.tensor(3.0))
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.a * self.lin(x) + self.b


def _scalars_under_sync_each_batch() -> dict:
    """First of 2 micro-batches with sync_each_batch=True: the scalars' gradients are averaged already."""
    from accelerate.utils import GradientAccumulationPlugin

    torch.manual_seed(0)
    model = _Regression()
    ref = copy.deepcopy(model)
    acc = FSDP2Accelerator(
        mixed_precision="no",
        fsdp_plugin=FSDP2Plugin(wrap_policy=["Linear"]),
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2, sync_each_batch=True),
    )
    model = acc.prepare(model)
    xs = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    rank, world = dist.get_rank(), dist.get_world_size()
    with acc.accumulate(model):
        acc.backward(model(xs[rank * 2 : rank * 2 + 2]).pow(2).mean())
    first = {"grads": gather([float(model.a.grad), float(model.b.grad)]), "sync_step": acc.sync_gradients}
    with acc.accumulate(model):  # the second micro-batch ends the cycle (Accelerate's step counter is shared)
        acc.backward(model(xs[4 + rank * 2 : 4 + rank * 2 + 2]).pow(2).mean())
    for r in range(world):  # one process: each rank's loss / ranks / micro-batches
        (ref(xs[r * 2 : r * 2 + 2]).pow(2).mean() / world / 2).backward()
    return {**first, "ref": [float(ref.a.grad), float(ref.b.grad)]}


def clipping(out: dict, work: Path) -> None:
    model, initial = fresh(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = FSDP2Accelerator(mixed_precision="no")
    model, opt = acc.prepare(model, opt)
    idx, x, y = rank_batch()
    acc.backward(lm_loss(model, x, y))
    norm = acc.clip_grad_norm_(model.parameters(), 0.05)
    opt.step()
    ref, _, ref_norm = reference(initial, [all_indices(idx)], clip=0.05)
    unclipped, _, _ = reference(initial, [all_indices(idx)])
    out.update(
        norm=norm.item(),
        ref_norm=ref_norm,
        norm_is_plain=not isinstance(norm, DTensor),
        param_rel=max_rel_diff(full_params(model), ref),
        unclipped_rel=max_rel_diff(unclipped, ref),
    )
    check = Checks(out)
    check.that("the norm is a plain tensor", out["norm_is_plain"])
    check.close("the norm is the global norm", out["norm"], out["ref_norm"], TOL)
    check.below("parameters equal one process's clipped step", out["param_rel"], TOL)
    check.that("clipping changed the step", out["unclipped_rel"] > 1, out["unclipped_rel"])


def _policy_step(initial, idx: list[int], dtype: torch.dtype, scale: float = 1.0, clip: float | None = None) -> tuple:
    """The weights one SGD step (lr 0.1) should give under a mixed policy, written out without the engine
    (tests/helpers/precision.py): each rank's samples on a `dtype` copy under autocast, fp32 gradients averaged
    (the loss multiplied by `scale`, the gradients divided by it), clipped to `clip` by the global norm,
    fp32 SGD. Returns (weights, norm before clipping)."""
    _, xs, ys = dataset().tensors

    def loss(model, samples):
        with torch.autocast("cpu", dtype=dtype):
            return lm_loss(model, xs[samples], ys[samples])

    grads = policy_grads(initial, [[(samples,)] for samples in gather(idx)], loss, dtype, scale)
    grads = {n: g / scale for n, g in grads.items()}
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])).item()
    coef = min(1.0, clip / (norm + 1e-6)) if clip else 1.0
    return {n: p.detach() - 0.1 * coef * grads[n] for n, p in initial.named_parameters()}, norm


def _untied_and_tied(got: dict, want: dict, model) -> tuple[float, float]:
    tied = tied_names(model)
    return (
        max_rel_diff({k: v for k, v in got.items() if k not in tied}, {k: v for k, v in want.items() if k not in tied}),
        max_rel_diff({k: got[k] for k in tied}, {k: want[k] for k in tied}) if tied else 0.0,
    )


def bf16(out: dict, work: Path) -> None:
    model, initial = fresh(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = FSDP2Accelerator(mixed_precision="bf16")
    model, opt = acc.prepare(model, opt)
    idx, x, y = rank_batch()
    logits = model(x)
    loss = lm_loss(model, x, y)
    with collective_dtypes() as reductions:
        acc.backward(loss)
    grad_dtypes = sorted({str(p.grad.dtype) for p in model.parameters()})
    opt.step()
    expected, _ = _policy_step(initial, idx, torch.bfloat16)
    update_diff, tied_diff = _untied_and_tied(full_params(model), expected, initial)
    out.update(
        _plan(model),
        accelerator_precision=acc.mixed_precision,
        out_dtype=str(logits.dtype),
        stored_dtypes=sorted({str(p.dtype) for p in model.parameters()}),
        grad_dtypes=grad_dtypes,
        reductions=sorted(reductions),
        update_diff=update_diff,
        tied_update_diff=tied_diff,
    )
    check = Checks(out)
    check.equal("bf16/fp32 policy", out["precision"], ["bf16/fp32"])
    check.equal("accelerator precision bf16", out["accelerator_precision"], "bf16")
    check.equal("bf16 output", out["out_dtype"], "torch.bfloat16")
    check.equal("fp32 parameters stored", out["stored_dtypes"], ["torch.float32"])
    check.equal("fp32 gradients", out["grad_dtypes"], ["torch.float32"])
    # One SGD step against the policy written out without the engine (tests/helpers/precision.py: bf16 copy under
    # autocast, fp32 gradients averaged, fp32 update): untied weights up to fp32 summation order (measured
    # 3.9e-08), the tied embedding within one bf16 rounding of its gradient (4.4e-06); reductions in fp32.
    check.below("untied weights equal the policy's step", update_diff, TOL)
    check.below("the tied embedding within one bf16 rounding", tied_diff, TIED_TOL)
    check.equal("gradients reduced in fp32", sorted({d for _, d in out["reductions"]}), ["float32"])


def fp16(out: dict, work: Path) -> None:
    """fp16 compute with the sharded grad scaler, on CPU too (stock Accelerate refuses fp16 there).

    Default scale (65536): the scaled gradients overflow fp16, every rank skips the step and the
    scale halves. GradScalerKwargs(init_scale=1024): unscaled before clipping, the step matches the
    policy written out."""
    for name, handlers in (("default", []), ("init_1024", [GradScalerKwargs(init_scale=1024)])):
        model, initial = fresh(13)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        acc = FSDP2Accelerator(mixed_precision="fp16", kwargs_handlers=handlers)
        model, opt = acc.prepare(model, opt)
        idx, x, y = rank_batch()
        logits = model(x)
        with collective_dtypes() as reductions:
            acc.backward(lm_loss(model, x, y))
        norm = acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        start, got = full_params(initial), full_params(model)
        entry = dict(
            _plan(model),
            out_dtype=str(logits.dtype),
            scaler=type(acc.scaler).__name__,
            scale=acc.scaler.get_scale(),
            norm=norm.item(),
            reductions=sorted(reductions),
            unchanged=all(torch.equal(got[k], start[k]) for k in start),
            skipped=gather(opt.step_was_skipped),
        )
        if name == "init_1024":
            expected, entry["ref_norm"] = _policy_step(initial, idx, torch.float16, scale=1024.0, clip=1.0)
            entry["update_diff"], entry["tied_update_diff"] = _untied_and_tied(got, expected, initial)
        out[name] = entry
    check = Checks(out)
    default, small = out["default"], out["init_1024"]
    for name, entry in out.items():
        if name != "checks":
            check.equal(f"{name}: the sharded grad scaler", entry["scaler"], "ShardedGradScaler")
            check.equal(f"{name}: fp16 output", entry["out_dtype"], "torch.float16")
    # 65536 x a loss of ~26 overflows fp16: every rank skips the step, the scale halves.
    check.equal("default scale: every rank skips the step", default["skipped"], [True, True])
    check.that("default scale: the weights are unchanged", default["unchanged"])
    check.equal("default scale: the scale halves", default["scale"], 32768.0)
    check.that("default scale: the norm is infinite", math.isinf(default["norm"]), default["norm"])
    # GradScalerKwargs(init_scale=1024) is honoured: no step skipped, unscaled before clipping (the global
    # norm equals the policy's, measured 1e-7 relative), and the step equals the policy written out with
    # the loss scaled by 1024 (measured 7.6e-08); reductions in fp32.
    check.equal("init_scale=1024: no step skipped", small["skipped"], [False, False])
    check.equal("init_scale=1024: the scale stays", small["scale"], 1024.0)
    check.below(
        "init_scale=1024: the norm is the policy's global norm (relative)",
        abs(small["norm"] - small["ref_norm"]) / small["ref_norm"],
        TOL,
    )
    check.below("init_scale=1024: untied weights equal the policy's step", small["update_diff"], TOL)
    check.below("init_scale=1024: the tied embedding within TIED_TOL", small["tied_update_diff"], TIED_TOL)
    check.equal("init_scale=1024: gradients reduced in fp32", sorted({d for _, d in small["reductions"]}), ["float32"])


def multi_model(out: dict, work: Path) -> None:
    a, a0 = fresh(6)
    b, b0 = fresh(7, layers=2, tied=False)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    acc = FSDP2Accelerator(mixed_precision="no")
    a, b, oa, ob = acc.prepare(a, b, oa, ob)
    idx, x, y = rank_batch()
    for model, opt in ((a, oa), (b, ob)):
        acc.backward(lm_loss(model, x, y))
        opt.step()
    ref_a, _, _ = reference(a0, [all_indices(idx)])
    ref_b, _, _ = reference(b0, [all_indices(idx)])
    out.update(
        models=len(acc._models),
        both_fsdp=isinstance(a, FSDPModule) and isinstance(b, FSDPModule),
        a_rel=max_rel_diff(full_params(a), ref_a),
        b_rel=max_rel_diff(full_params(b), ref_b),
    )
    check = Checks(out)
    check.equal("two models prepared", out["models"], 2)
    check.that("both are FSDP modules", out["both_fsdp"])
    check.below("the first model equals one process's", out["a_rel"], TOL)
    check.below("the second model equals one process's", out["b_rel"], TOL)


def evaluation(out: dict, work: Path) -> None:
    model, initial = fresh(8)
    # Groups stay gathered after forward (the config file reshards them: not here), so the save
    # below has something to reshard.
    acc = FSDP2Accelerator(fsdp_plugin=FSDP2Plugin(reshard_after_forward=False), mixed_precision="no")
    model = acc.prepare(model)
    model.eval()
    _, x, _ = rank_batch()
    with torch.no_grad():
        got, want = model(x), initial.eval()(x)
    gathered = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]  # the root, after forward
    acc.save_state(work / "after_eval")  # a save outside a step reshards first
    out.update(
        root_is_fsdp=isinstance(model, FSDPModule),
        rel=((got - want).norm() / want.norm()).item(),
        gathered_after_forward=gathered,
        plain_after_save=[n for n, p in model.named_parameters() if not isinstance(p, DTensor)],
    )
    check = Checks(out)
    check.that("the root is an FSDP module", out["root_is_fsdp"])
    check.below("the output equals the unsharded model's (relative)", out["rel"], 1e-6)
    # The forward left the root gathered; save_state resharded it: only shards remain.
    check.that("the forward left the root gathered", bool(gathered), gathered)
    check.equal("save_state resharded: only shards remain", out["plain_after_save"], [])


def checkpoints(out: dict, work: Path) -> None:
    acc, model, opt, sched = setup_resumable(9, state_dict_type="full")
    first = train(acc, model, opt, sched, range(0, 2))
    path = Path(acc.save_state(work / "state"))
    lr_saved = sched.get_last_lr()
    if dist.get_rank() == 0:  # kept for resume.py (one process); `state` itself is saved over below
        shutil.copytree(path, work / "state_step2")
    saved_params = full_params(model)
    cont = train(acc, model, opt, sched, range(2, 4))
    out.update(
        first=first,
        continued=cont,
        lr_saved=lr_saved,
        lr_continued=sched.get_last_lr(),
        listing=sorted(p.name for p in path.iterdir()),
        parent=sorted(p.name for p in path.parent.iterdir()),
    )
    if dist.get_rank() == 0:
        from safetensors.torch import load_file

        exported = load_file(str(path / "model.safetensors"))
        out["export_diff"] = max((exported[k].float() - v).abs().max().item() for k, v in saved_params.items())
    out["export_diff"] = _rank0s(out.get("export_diff"))
    # A fresh model, optimizer and scheduler (different init) resumed from the directory.
    acc2, model2, opt2, sched2 = setup_resumable(99)
    acc2.load_state(path)
    out.update(resumed=train(acc2, model2, opt2, sched2, range(2, 4)), lr_resumed=sched2.get_last_lr())
    # Saving again into the same directory replaces it whole (no .tmp-* left behind).
    acc2.save_state(path)
    out["parent_after_resave"] = sorted(p.name for p in path.parent.iterdir())
    dist.barrier()  # every rank has listed before rank 0 adds the damaged copies below
    # A directory that never committed, and a damaged one, are refused before anything loads.
    partial = work / "partial"
    if dist.get_rank() == 0:
        shutil.copytree(path, partial)
        (partial / ".metadata").unlink()
        damaged = work / "damaged"
        shutil.copytree(path, damaged)
        with open(damaged / "__1_0.distcp", "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    check = Checks(out)
    out["partial_error"] = check.raises(
        "a directory that never committed is refused",
        lambda: acc2.load_state(work / "partial"),
        FileNotFoundError,
        "not a committed",
    )
    out["damaged_error"] = check.raises(
        "a damaged shard is refused naming the file and the checksum",
        lambda: acc2.load_state(work / "damaged"),
        ValueError,
        "__1_0.distcp",
        "checksum",
    )
    # Automatic naming with keep_last: only the newest committed checkpoints stay.
    from accelerate.utils import ProjectConfiguration

    acc3, model3, opt3, sched3 = setup_resumable(9, keep_last=2)
    acc3.project_configuration = ProjectConfiguration(project_dir=str(work / "auto"), automatic_checkpoint_naming=True)
    for _ in range(3):
        acc3.save_state()
    out["auto_listing"] = sorted(p.name for p in (work / "auto" / "checkpoints").iterdir())
    # A new run resumes from the newest and numbers its next save after it (no clash with checkpoint_0).
    acc4, *_ = setup_resumable(9, keep_last=2)
    acc4.project_configuration = ProjectConfiguration(project_dir=str(work / "auto"), automatic_checkpoint_naming=True)
    acc4.load_state()
    out["auto_after_resume"] = Path(acc4.save_state()).name
    # A save before the first optimizer step changes nothing (torch's state-dict call would step
    # Adam once), and resuming from it starts like a fresh run.
    acc5, model5, opt5, sched5 = setup_resumable(9)
    acc5.save_state(work / "early")
    out["early_state_entries"] = len(opt5.optimizer.state)
    out["early_trained"] = train(acc5, model5, opt5, sched5, range(0, 4))
    acc6, model6, opt6, sched6 = setup_resumable(99)
    acc6.load_state(work / "early")
    out["early_state_after_load"] = len(opt6.optimizer.state)
    out["early_resumed"] = train(acc6, model6, opt6, sched6, range(0, 4))
    # Accelerate's own `merge_fsdp_weights` (`accelerate merge-weights`) reads the model view
    # `pytorch_model_fsdp_0/` of a save_state directory; the top level is not one model.
    from accelerate.utils import merge_fsdp_weights

    merge_fsdp_weights(str(work / "state_step2" / "pytorch_model_fsdp_0"), str(work / "merged"))
    if dist.get_rank() == 0:
        from safetensors.torch import load_file

        merged, exported = (
            load_file(str(work / "merged" / "model.safetensors")),
            load_file(str(work / "state_step2" / "model.safetensors")),
        )
        out["merged_keys_match"] = sorted(merged) == sorted(exported)
        out["merged_equal"] = all(torch.equal(merged[k], exported[k]) for k in exported)
    out["merged_keys_match"], out["merged_equal"] = _rank0s([out.get("merged_keys_match"), out.get("merged_equal")])
    # save_state then load_state resume exactly.
    check.close("the resumed losses are the continued run's", out["resumed"], out["continued"], TOL)
    check.equal("the resumed learning rate is the continued run's", out["lr_resumed"], out["lr_continued"])
    files = [".metadata", "checksums.json", "__0_0.distcp", "__1_0.distcp", "scheduler.bin"]
    files += ["random_states_0.pkl", "random_states_1.pkl", "model.safetensors"]
    check.equal("save_state wrote every file", _missing(files, out["listing"]), [])
    check.equal("state_dict_type full: the consolidated weights equal the model's", out["export_diff"], 0.0)
    leftovers = [p for p in out["parent"] + out["parent_after_resave"] if p.startswith(".tmp")]
    check.equal("no .tmp directory left, also after saving over", leftovers, [])
    # A save before the first step changes nothing: the same seed-9 run without that save.
    check.equal("a save before the first step holds no optimizer state", out["early_state_entries"], 0)
    uninterrupted = out["first"] + out["continued"]
    check.close("a save before the first step changes no loss", out["early_trained"], uninterrupted, TOL)
    check.equal("resuming that save loads no optimizer state", out["early_state_after_load"], 0)
    check.close("resuming that save trains as a fresh run", out["early_resumed"], uninterrupted, TOL)
    # Accelerate's merge_fsdp_weights reads the model view.
    check.equal("the model view pytorch_model_fsdp_0 is saved", _missing(["pytorch_model_fsdp_0"], out["listing"]), [])
    check.that("merge_fsdp_weights gives the exported keys", out["merged_keys_match"] is True, out["merged_keys_match"])
    check.that("merge_fsdp_weights gives the exported values", out["merged_equal"] is True, out["merged_equal"])
    # Automatic naming keeps the newest, and a resumed run numbers its next save after them.
    check.equal("keep_last=2 keeps the newest two", out["auto_listing"], ["checkpoint_1", "checkpoint_2"])
    check.equal("the next save after a resume is numbered after the newest", out["auto_after_resume"], "checkpoint_3")


def overlap_save(out: dict, work: Path) -> None:
    """checkpoint_async_save="overlap": save_state returns before its (held back) copy, the next step
    waits for it, wait_for_checkpoint() commits the directory (end_training() calls it, then destroys
    the process group), which holds the state of the save bit for bit, and training from it continues
    exactly."""
    acc, model, opt, sched = setup_resumable(9, checkpoint_async_save="overlap")
    train(acc, model, opt, sched, range(0, 2))
    at_save = full_state(model, opt)
    with slow_staging(0.5):
        start = time.perf_counter()
        path = Path(acc.save_state(work / "overlap_state"))
        returned_at = time.perf_counter()
        out["returned"], out["copied_before_return"] = returned_at - start, copied_by(returned_at)
        continued = train(acc, model, opt, sched, range(2, 4))
        out["waited"] = time.perf_counter() - start
    out["changed_by_next_step"] = len(differing(full_state(model, opt), at_save)) == len(at_save)
    out["committed_before_end"] = path.exists()
    acc.wait_for_checkpoint()
    out["committed_after_wait"] = path.exists()
    acc2, model2, opt2, sched2 = setup_resumable(99)
    train(acc2, model2, opt2, sched2, range(0, 1))  # optimizer state to overwrite
    acc2.load_state(path)
    out["differs"] = differing(full_state(model2, opt2), at_save)
    out["resumed"], out["continued"] = train(acc2, model2, opt2, sched2, range(2, 4)), continued
    check = Checks(out)
    check.that("save_state returned before the copy ended", not out["copied_before_return"])
    check.within("the next step waited for the copy (seconds)", out["waited"], 0.45, math.inf)
    check.that("the next step changed every saved tensor", out["changed_by_next_step"])
    check.that("not committed before the wait", not out["committed_before_end"])
    check.that("committed after wait_for_checkpoint", out["committed_after_wait"])
    check.equal("the directory holds the state of the save (tensors that differ)", out["differs"], [])
    check.equal("training from it continues exactly", out["resumed"], out["continued"])


def preemption(out: dict, work: Path) -> None:
    """checkpoint_on_preemption: SIGTERM to rank 1 during step 3 sets Accelerate's trigger on every rank
    at the step's check_trigger(); the loop saves and stops there."""
    acc, model, opt, sched = setup_resumable(9, checkpoint_on_preemption=True)
    triggers = []
    for step in range(4):
        if step == 2 and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the default action would kill this rank
        train(acc, model, opt, sched, range(step, step + 1))
        triggers.append(acc.check_trigger())
        if triggers[-1]:
            acc.save_state(work / "preempted")
            break
    acc._preemption.close()  # the flows after this one run in the same processes
    out.update(triggers=gather(triggers), committed=(work / "preempted" / ".metadata").is_file())
    check = Checks(out)
    check.equal("both ranks stop after step 3", out["triggers"], [[False, False, True]] * 2)
    check.that("the preemption save committed", out["committed"])


def hf_export(out: dict, work: Path) -> None:
    """A transformers GPT-2: save_model -> from_pretrained; get_state_dict full on rank 0 only."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(10)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # The launch config wraps "Block" (TinyGPT); a keyword overrides it: "auto" finds GPT2Block.
    acc = FSDP2Accelerator(fsdp_plugin=FSDP2Plugin(wrap_policy="auto"), mixed_precision="no")
    model, opt = acc.prepare(model, opt)
    _, x, _ = rank_batch()
    acc.backward(model(input_ids=x, labels=x).loss)
    opt.step()
    state = acc.get_state_dict(model)
    acc.save_model(model, work / "hf")
    params = full_params(model)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=x).logits
    out.update(
        _plan(model),
        state_sizes=gather(len(state)),
        state_keys=len(model.state_dict()),
        files=sorted(p.name for p in (work / "hf").iterdir()),
    )
    if dist.get_rank() == 0:
        loaded = GPT2LMHeadModel.from_pretrained(work / "hf").eval()
        got = dict(loaded.named_parameters())
        out["weight_diff"] = max((got[k] - v).abs().max().item() for k, v in params.items())
        with torch.no_grad():
            ref = loaded(input_ids=x).logits
        out["logits_rel"] = ((ref - logits).norm() / ref.norm()).item()
        out["state_diff"] = max((state[k] - got[k]).abs().max().item() for k in got)
    for key in ("weight_diff", "logits_rel", "state_diff"):
        out[key] = _rank0s(out.get(key))
    check = Checks(out)
    check.equal('"auto" wraps GPT2Block', out["groups"], ["<root>", "transformer.h.0", "transformer.h.1"])
    check.equal("save_model wrote config and weights", _missing(["config.json", "model.safetensors"], out["files"]), [])
    check.equal("from_pretrained loads the trained weights (max abs diff)", out["weight_diff"], 0.0)
    check.below("the loaded model's logits equal the live model's (relative)", out["logits_rel"], 1e-6)
    check.equal("get_state_dict: full on rank 0, empty elsewhere", out["state_sizes"], [out["state_keys"], 0])
    check.equal("get_state_dict holds the trained weights (max abs diff)", out["state_diff"], 0.0)


def peft_lora(out: dict, work: Path) -> None:
    """LoRA (PEFT) on a GPT-2 (Conv1D: fan-in-fan-out; the head tied to the frozen embedding):
    save_state holds the adapter only, and
    Accelerate's documented adapter recipe, save_model and f2.save_merged write files that PEFT and
    transformers load with the live model's logits."""
    import peft
    from transformers import GPT2Config, GPT2LMHeadModel

    def base() -> GPT2LMHeadModel:
        torch.manual_seed(10)
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4))

    torch.manual_seed(11)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights="gaussian"
    )
    model = peft.get_peft_model(base(), config)
    acc = FSDP2Accelerator(fsdp_plugin=FSDP2Plugin(wrap_policy="auto"), mixed_precision="no")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model, opt = acc.prepare(model, opt)
    _, x, _ = rank_batch()
    for _ in range(2):
        acc.backward(model(input_ids=x, labels=x).loss)
        opt.step()
        opt.zero_grad()
    state_dir = Path(acc.save_state(work / "peft_state"))
    names = f2.inspect_checkpoint(state_dir)
    out["saved_model_keys"] = sorted(k for k in names.tensors if k.startswith("model."))
    out["fingerprint"] = "frozen_base.model" in names.other_keys
    # Accelerate's documented recipe for PEFT models under FSDP.
    acc.unwrap_model(model).save_pretrained(
        work / "peft_recipe",
        is_main_process=acc.is_main_process,
        save_function=acc.save,
        state_dict=acc.get_state_dict(model),
    )
    acc.save_model(model, work / "peft_save_model")
    f2.save_merged(model, work / "peft_merged")
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=x).logits
        for p in model.parameters():
            if p.requires_grad:
                p.zero_()
        acc.load_state(state_dir)  # the adapter back; the frozen base checked by its fingerprint
        out["reloaded_rel"] = max_rel_diff({"l": model(input_ids=x).logits}, {"l": logits})
    if dist.get_rank() == 0:
        with torch.no_grad():
            for name in ("peft_recipe", "peft_save_model"):
                loaded = peft.PeftModel.from_pretrained(base(), work / name).eval()
                out[f"{name}_rel"] = max_rel_diff({"l": loaded(input_ids=x).logits}, {"l": logits})
            merged = GPT2LMHeadModel.from_pretrained(work / "peft_merged").eval()
            out["merged_rel"] = max_rel_diff({"l": merged(input_ids=x).logits}, {"l": logits})
    for key in ("peft_recipe_rel", "peft_save_model_rel", "merged_rel"):
        out[key] = _rank0s(out.get(key))
    check = Checks(out)
    keys = out["saved_model_keys"]
    check.that("save_state holds the adapter only", bool(keys) and all("lora_" in k for k in keys), keys)
    check.that("save_state holds the frozen base's fingerprint", out["fingerprint"])
    check.equal("load_state of the adapter-only directory restores the logits", out["reloaded_rel"], 0.0)
    check.below("Accelerate's adapter recipe loads with the live logits", out["peft_recipe_rel"], TOL)
    check.below("save_model's adapter loads with the live logits", out["peft_save_model_rel"], TOL)
    check.below("f2.save_merged loads with the live logits", out["merged_rel"], TOL)


def rank0_loading(out: dict, work: Path) -> None:
    """cpu_ram_efficient_loading: real weights on rank 0, the meta device elsewhere (runs last: the
    plugin exports FSDP_CPU_RAM_EFFICIENT_LOADING=true for transformers, as Accelerate's does)."""
    from helpers.models import TinyGPT

    acc = FSDP2Accelerator(fsdp_plugin=FSDP2Plugin(cpu_ram_efficient_loading=True), mixed_precision="no")
    if dist.get_rank() == 0:
        model, initial = fresh(11)
    else:
        with torch.device("meta"):
            model, initial = TinyGPT(vocab=VOCAB, seq=16), None
    model = acc.prepare(model)
    params = full_params(model)
    if dist.get_rank() == 0:
        ref = dict(initial.named_parameters())
        out["diff"] = max((params[k] - ref[k]).abs().max().item() for k in ref)
    out["diff"] = _rank0s(out.get("diff"))
    out["meta_after"] = gather(any(p.is_meta for p in model.parameters()))
    check = Checks(out)
    check.equal("every shard holds rank 0's weights (max abs diff)", out["diff"], 0.0)
    check.equal("no parameter left on meta", out["meta_after"], [False, False])


def launch_variant(out: dict, work: Path) -> None:
    """Under fsdp2_variant.yaml: size-based wrap, no reshard, offload, activation checkpointing,
    full state dict, rank-0 loading and bf16, all from the config file alone."""
    acc = FSDP2Accelerator()
    if dist.get_rank() == 0:
        model, initial = fresh(12)
    else:
        with torch.device("meta"):  # as transformers loads it on ranks > 0 with rank-0 loading
            model, initial = fresh(12)
    model = acc.prepare(model)
    opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []
    # A pre-hook: checkpoint's recomputation may stop inside mlp once it has what backward needs.
    model.blocks[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    idx, x, y = rank_batch()
    loss = lm_loss(model, x, y)
    acc.backward(loss)
    opt.step()
    plan = f2.sharding_plan(model)
    params = full_params(model)
    path = Path(acc.save_state(work / "variant_state"))
    out.update(
        _plan(model),
        reshard=sorted({str(g.reshard_after_forward) for g in plan.groups}),
        mlp_forward_calls=len(calls),
        accelerator_precision=acc.mixed_precision,
        listing=sorted(p.name for p in path.iterdir()),
        loss=sum(gather(loss.item())) / dist.get_world_size(),
    )
    global_idx = all_indices(idx)
    if dist.get_rank() == 0:  # only rank 0 has the real initial weights
        ref, _, _ = reference(initial, [global_idx])
        out["update_rel"] = update_rel_diff(dict(initial.named_parameters()), params, ref)
        _, xs, ys = dataset().tensors
        out["fp32_loss"] = lm_loss(initial, xs[global_idx], ys[global_idx]).item()
    out["update_rel"], out["fp32_loss"] = _rank0s([out.get("update_rel"), out.get("fp32_loss")])
    check = Checks(out)
    check.equal("SIZE_BASED_WRAP 10000 wraps each block", out["groups"], GROUPS)
    check.equal("every group offloaded", out["offload"], [True])
    check.equal("no reshard after forward", out["reshard"], ["False"])
    check.equal("bf16/fp32 policy", out["precision"], ["bf16/fp32"])
    check.equal("activation checkpointing recomputes the block in backward", out["mlp_forward_calls"], 2)
    check.equal("FULL_STATE_DICT writes model.safetensors", _missing(["model.safetensors"], out["listing"]), [])
    # Rank 0's real weights reached every shard (rank 1 built on meta): bf16 step close to fp32.
    check.below(
        "the bf16 loss is close to fp32 (relative)", abs(out["loss"] - out["fp32_loss"]) / out["fp32_loss"], 1e-2
    )
    check.below("the bf16 update is close to fp32 (relative)", out["update_rel"], 2e-2)


def auto_strategy(out: dict, work: Path) -> None:
    """FSDP2Plugin(sharding_strategy="auto", memory_budget=...): the planner's pick per budget reaches
    the prepared model; one SGD step against one process; a budget below every estimate fails.

    Budgets come from the core planner's estimates (2 ranks, AdamW, no batch: what "auto" uses) of
    this config: one that FULL_SHARD fits and SHARD_GRAD_OP (less communication) does not, one
    that SHARD_GRAD_OP fits (NO_SHARD communicates as much with a larger peak), one below all.
    The config file's `fsdp_reshard_after_forward: true` would override either strategy's
    reshard choice, so the plugins unset it.
    """
    layers = dict(layers=8)  # enough blocks that FULL_SHARD's peak is below SHARD_GRAD_OP's
    probe = FSDP2Plugin(reshard_after_forward=None).fsdp2_config
    est = {
        s: f2.estimate_memory(
            fresh(0, **layers)[0], dataclasses.replace(probe, sharding_strategy=s), world_size=2
        ).peak_bytes
        for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
    }
    budgets = {"FULL_SHARD": (est["FULL_SHARD"] + est["SHARD_GRAD_OP"]) // 2, "SHARD_GRAD_OP": 2 * est["NO_SHARD"]}
    out["estimates"] = est
    for expected, budget in budgets.items():
        plugin = FSDP2Plugin(sharding_strategy="auto", memory_budget=budget, reshard_after_forward=None)
        out[f"{expected}_plugin_reshard"] = plugin.reshard_after_forward
        acc = FSDP2Accelerator(fsdp_plugin=plugin, mixed_precision="no")
        model, initial = fresh(20, **layers)
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        idx, x, y = rank_batch()
        acc.backward(lm_loss(model, x, y))
        opt.step()
        ref, _, _ = reference(initial, [all_indices(idx)])
        plan = f2.sharding_plan(model)
        out[expected] = {
            "strategies": sorted({g.strategy for g in plan.groups}),
            "mesh_shapes": sorted({str(g.mesh_shape) for g in plan.groups}),
            "reshard": {g.name: g.reshard_after_forward for g in plan.groups},
            "param_rel": max_rel_diff(full_params(model), ref),
        }
    acc = FSDP2Accelerator(
        fsdp_plugin=FSDP2Plugin(sharding_strategy="auto", memory_budget=est["FULL_SHARD"] // 2), mixed_precision="no"
    )
    check = Checks(out)
    out["too_small_error"] = check.raises(
        "a budget below every estimate fails in prepare naming memory_budget",
        lambda: acc.prepare(fresh(21, **layers)[0]),
        ValueError,
        "sharding_strategy='auto'",
        "smallest peak",
        "memory_budget",
    )
    check.that(
        "estimates: FULL_SHARD < SHARD_GRAD_OP < NO_SHARD",
        est["FULL_SHARD"] < est["SHARD_GRAD_OP"] < est["NO_SHARD"],
        est,
    )
    full, zero2 = out["FULL_SHARD"], out["SHARD_GRAD_OP"]
    check.equal("the FULL_SHARD budget picks FULL_SHARD", full["strategies"], ["FULL_SHARD"])
    check.equal("FULL_SHARD on a (2,) mesh", full["mesh_shapes"], ["(2,)"])
    check.equal(
        "FULL_SHARD reshards every block but the last",
        [full["reshard"].get(f"blocks.{i}") for i in range(8)],
        [True] * 7 + [False],
    )
    check.equal("the SHARD_GRAD_OP budget picks SHARD_GRAD_OP", zero2["strategies"], ["SHARD_GRAD_OP"])
    check.equal("SHARD_GRAD_OP reshards no group", sorted(set(zero2["reshard"].values())), [False])
    check.equal("the plugin's reshard is unknown until prepare picks", out["FULL_SHARD_plugin_reshard"], None)
    check.below("FULL_SHARD: parameters equal one process's", full["param_rel"], TOL)
    check.below("SHARD_GRAD_OP: parameters equal one process's", zero2["param_rel"], TOL)
    _throughput(out, work, check)


def _throughput(out: dict, work: Path, check: Checks) -> None:
    """objective="throughput": prepare(model, optimizer, loader) tunes on the loader's first batch,
    caches the pick and shards with it on both ranks (one SGD step against one process);
    prepare(model) alone names the loader it needs."""
    import json

    cache = work / "accelerate_tune.json"
    cache.unlink(missing_ok=True)  # both ranks, before prepare's first collective
    os.environ["FSDP2_TUNE_CACHE"] = str(cache)
    # cpu_ram_efficient_loading=False: rank0_loading, an earlier flow, exported it as true to the environment.
    plugin = dict(
        sharding_strategy="auto", objective="throughput", reshard_after_forward=None, cpu_ram_efficient_loading=False
    )
    try:
        acc = FSDP2Accelerator(fsdp_plugin=FSDP2Plugin(**plugin), mixed_precision="no")
        model, initial = fresh(20, layers=4)
        inputs = DataLoader(torch.utils.data.TensorDataset(dataset().tensors[1]), batch_size=PER_RANK, shuffle=True)
        model, opt, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), inputs)
        idx, x, y = rank_batch()
        acc.backward(lm_loss(model, x, y))
        opt.step()
        ref, _, _ = reference(initial, [all_indices(idx)])
        (entry,) = json.loads(cache.read_text()).values()
        out["throughput"] = dict(
            _plan(model),
            every_rank=gather(str(f2.sharding_plan(model))),
            strategies=sorted({g.strategy for g in f2.sharding_plan(model).groups}),
            entry={k: entry[k] for k in ("label", "changes")},
            rows=[r["label"] for r in entry["table"]["rows"]],
            param_rel=max_rel_diff(full_params(model), ref),
        )
        t = out["throughput"]
        t["no_loader_error"] = check.raises(
            "throughput: prepare(model) alone names the loader it needs",
            lambda: acc.prepare(fresh(21, layers=4)[0]),
            ValueError,
            "prepare(model, optimizer, train_dataloader)",
        )
    finally:
        del os.environ["FSDP2_TUNE_CACHE"]
    check.equal(
        "throughput: the default candidates measured first",
        t["rows"][:2],
        ["FULL_SHARD/blocks", "FULL_SHARD/one group"],
    )
    picked = t["entry"]["changes"]
    check.equal(
        "throughput: the cached pick's strategy shards the model", t["strategies"], [picked.get("sharding_strategy")]
    )
    check.equal(
        "throughput: one group exactly when the pick has no wrap policy",
        t["groups"] == ["<root>"],
        "wrap_policy" in picked and picked["wrap_policy"] is None,
    )
    check.equal("throughput: both ranks shard alike", t["every_rank"][0], t["every_rank"][1])
    check.below("throughput: parameters equal one process's", t["param_rel"], TOL)


class _MemoryTracker(GeneralTracker):
    """Keeps what `Accelerator.log` hands it (on every rank it is called on: it logs on the main one)."""

    name, requires_logging_directory, main_process_only = "memory", False, False

    def __init__(self):
        super().__init__()
        self.rows: list = []

    @property
    def tracker(self):
        return self.rows

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        self.rows.append([step, dict(values)])


def throughput_logging(out: dict, work: Path) -> None:
    """log_throughput_every=2 over 5 SGD steps of 4 sequences of 16 tokens per rank: the first step
    starts the clock, then one report per 2 steps, through the trackers, on the main process."""
    model, _ = fresh(4)
    tracker = _MemoryTracker()
    acc = FSDP2Accelerator(mixed_precision="no", log_throughput_every=2, log_with=[tracker])
    acc.init_trackers("flows")
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(5):
        _, x, y = rank_batch(step)
        acc.backward(lm_loss(model, x, y))
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        model(x)  # an evaluation forward: no training tokens
    out["rows"] = gather(tracker.rows)
    out["pending_after_eval"] = acc.throughput.meter._pending
    out["last_step"] = acc.throughput.meter.last.step
    acc.throughput.remove()
    check = Checks(out)
    main_rows, other = out["rows"]
    check.equal("Accelerator.log: nothing on the other process", other, [])
    # 5 optimizer steps: the first starts the clock, then a report every 2 (optimizer steps 3 and 5).
    check.equal("reports at optimizer steps 3 and 5", [step for step, _ in main_rows], [3, 5])
    check.equal("the meter's last step is 5", out["last_step"], 5)
    names = ["throughput/mfu", "throughput/peak_memory_gib", "throughput/step_time_s", "throughput/tokens_per_s"]
    for step, m in main_rows:
        check.equal(f"step {step}: the four throughput metrics", sorted(m), names)
        # 4 sequences of 16 tokens a step on this rank, counted by the model's forward.
        tokens = m.get("throughput/tokens_per_s", math.nan) * m.get("throughput/step_time_s", math.nan)
        check.close(f"step {step}: tokens_per_s x step_time_s = 64 tokens", tokens, 64, 1e-6)
        mfu = m.get("throughput/mfu", math.nan)
        check.that(f"step {step}: 0 < mfu < 1 (against the CPU's measured peak)", 0 < mfu < 1, mfu)
    check.equal("a forward under no_grad counts no training tokens", out["pending_after_eval"], 0)


def deepspeed_launch(out: dict, work: Path) -> None:
    """The variables `accelerate launch` sets for `distributed_type: DEEPSPEED` (ZeRO-2, inline keys)
    instead of this launch's FSDP ones: FSDP2Accelerator() trains with the translation, SHARD_GRAD_OP,
    where the stock path would import DeepSpeed."""
    saved = dict(os.environ)
    for key in [k for k in os.environ if k.startswith("FSDP_") or k == "ACCELERATE_USE_FSDP"]:
        del os.environ[key]
    os.environ.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE="2")
    try:
        model, initial = fresh(5)
        acc = FSDP2Accelerator(mixed_precision="no")
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        idx, x, y = rank_batch()
        acc.backward(lm_loss(model, x, y))
        opt.step()
        ref, _, _ = reference(initial, [all_indices(idx)])
        out.update(_plan(model), param_rel=max_rel_diff(full_params(model), ref))
        out["strategies"] = sorted({g.strategy for g in f2.sharding_plan(model).groups})
        out["use_deepspeed_after"] = os.environ.get("ACCELERATE_USE_DEEPSPEED")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    check = Checks(out)
    check.equal("ZeRO-2 is SHARD_GRAD_OP", out["strategies"], ["SHARD_GRAD_OP"])
    check.below("parameters equal one process's", out["param_rel"], TOL)
    check.equal(
        "ACCELERATE_USE_DEEPSPEED hidden only while the accelerator was built", out["use_deepspeed_after"], "true"
    )


FLOWS = [
    config_from_launch,
    parity,
    variants,
    accumulation,
    clipping,
    bf16,
    fp16,
    multi_model,
    evaluation,
    checkpoints,
    overlap_save,
    preemption,
    hf_export,
    peft_lora,
    rank0_loading,
    accumulation_modes,
    auto_strategy,
    resume_on_two,
    throughput_logging,
    deepspeed_launch,
]
"""Run under fsdp2.yaml (the default when no flow names are given)."""
VARIANT_FLOWS = [config_from_variant_launch, launch_variant, resume_from_one]
"""Run under fsdp2_variant.yaml."""


def main() -> None:
    out_path, work = sys.argv[1], Path(sys.argv[2])
    by_name = {f.__name__: f for f in FLOWS + VARIANT_FLOWS}
    flows = [by_name[n] for n in sys.argv[3].split(",")] if len(sys.argv) > 3 else FLOWS
    if len(sys.argv) > 4:  # the earlier launch's report, which resume_from_one continues
        EARLIER.update(json.loads(Path(sys.argv[4]).read_text()))
    # The first accelerator starts the process group: a timeout, so a stuck rank fails the run.
    FSDP2Accelerator(mixed_precision="no", kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=90))])
    run_flows(flows, out_path, work)  # every rank writes its report (OUT.rankN.json)
    f2.shutdown()


if __name__ == "__main__":
    main()

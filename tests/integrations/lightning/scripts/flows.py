"""Lightning flows on 2 ranks under torchrun, in one world; each flow checks what it claims.

Usage: torchrun --nproc_per_node=2 flows.py OUT.json WORKDIR SINGLE.rank0.json

SINGLE.rank0.json is the report of `single.py train` (one process, run before): its reference losses
and mid-epoch runs are compared here, and its checkpoints (WORKDIR/single_ckpts, WORKDIR/lit_one) are
resumed on 2 ranks.

Each flow records its named checks (`helpers.checks.Checks`, on every rank) and the raw numbers under its own
key. Every rank writes its own report (OUT.rank0.json, OUT.rank1.json) after each flow; an exception
is recorded as "error" for that flow and ends that rank (`helpers.collect.run_flows`): the test fails naming
the flow and the rank. The test file only launches and calls `assert_passed` per flow.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed.checkpoint as dcp
from common import (
    LR,
    LitMLP,
    dataset,
    full_params,
    gather,
    loader,
    max_rel_diff,
    reference_step,
    trainer,
)
from helpers.checks import Checks
from helpers.collect import full, run_flows
from helpers.comm import collective_dtypes, count_collectives
from helpers.models import ResidualBlock, tiny_llama
from helpers.precision import policy_grads, true_precision_update
from helpers.slow_staging import copied_by, differing, full_state, slow_staging
from helpers.untrusted import OwnType, add_entry, plant
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from resume_flows import check_resumed, checkpoint, one_and_two_agree, record
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

import fsdp2_strategy as f2
from fsdp2_strategy import _torch_compat as tc
from fsdp2_strategy.integrations.lightning import FSDP2MixedPrecision, FSDP2Strategy, FSDP2ThroughputMonitor

BATCH = 4  # per rank
TOL = 1e-5  # fp32 parity, relative
SINGLE: dict = {}
"""The report of `single.py train` (one process, run before this launch), set by `main`."""


def _all_indices(model: LitMLP, steps: slice = slice(None)) -> list[int]:
    return [i for rank in gather(model.indices[steps]) for batch in rank for i in batch]


def _global_losses(model: LitMLP) -> list[float]:
    per_rank = gather(model.losses)
    return [sum(v) / len(v) for v in zip(*per_rank)]


def _fresh(seed: int = 0, **kwargs) -> tuple[LitMLP, LitMLP]:
    torch.manual_seed(seed)
    model = LitMLP(**kwargs)
    return model, copy.deepcopy(model)


def _rs(counts) -> int:
    return sum(v for k, v in counts.items() if k.startswith("reduce_scatter"))


def one_step_parity(out: dict, work: Path) -> None:
    """One step of `Trainer(strategy="fsdp2")` on 2 ranks against one process on the same global batch,
    after Lightning's sanity check (validation batches under no_grad before the first step)."""
    check = Checks(out)
    model, initial = _fresh()
    fit = trainer(max_steps=1, num_sanity_val_steps=2)
    fit.fit(model, loader(BATCH), val_dataloaders=loader(BATCH, shuffle=False))
    full = full_params(model)
    ref, _ = reference_step(initial, _all_indices(model))
    seen = model.seen
    check.equal("the sanity check ran 2 validation batches", list(fit.num_sanity_val_batches), [2])
    check.equal("strategy is FSDP2Strategy", seen["strategy"], "FSDP2Strategy")
    check.that("the root module is sharded", isinstance(model, FSDPModule))
    check.equal("mesh dims", seen["mesh_dims"], ["data_parallel", "tensor_parallel"])
    check.equal("mesh shape", seen["mesh_shape"], [2, 1])
    check.equal(
        "groups by policy",
        [g.name for g in f2.sharding_plan(model).groups],
        ["<root>", "blocks.0", "blocks.1", "blocks.2"],
    )
    check.that("optimizer built on the shards", all(seen["optimizer_params_dtensor"]), seen["optimizer_params_dtensor"])
    first = gather(model.indices[0])
    check.that("each rank saw different samples", not set(first[0]) & set(first[1]), first)
    check.below("parameters equal one process's (relative)", max_rel_diff(full, ref), TOL)
    check.raises(
        "unknown wrap class named with its close match",
        lambda: trainer(FSDP2Strategy(wrap_policy=["ResidualBlok"]), max_steps=1).fit(LitMLP(), loader(BATCH)),
        ValueError,
        "'ResidualBlok'",
        "Did you mean 'ResidualBlock'",
    )


def registry_variants(out: dict, work: Path) -> None:
    """ "fsdp2_hybrid" and "fsdp2_cpu_offload": one step each, against one process."""
    check = Checks(out)
    for name in ("fsdp2_hybrid", "fsdp2_cpu_offload"):
        model, initial = _fresh()
        trainer(name, max_steps=1).fit(model, loader(BATCH))
        ref, _ = reference_step(initial, _all_indices(model))
        plan = f2.sharding_plan(model)
        out[name] = dict(
            mesh_shapes=sorted({str(g.mesh_shape) for g in plan.groups}),
            strategies=sorted({g.strategy for g in plan.groups}),
            offload=sorted({g.cpu_offload for g in plan.groups}),
            max_rel_diff=max_rel_diff(full_params(model), ref),
        )
        check.below(f"{name}: parameters equal one process's (relative)", out[name]["max_rel_diff"], TOL)
    hybrid, offload = out["fsdp2_hybrid"], out["fsdp2_cpu_offload"]
    check.equal("fsdp2_hybrid: mesh is (nodes, devices per node)", hybrid["mesh_shapes"], ["(1, 2)"])
    check.equal("fsdp2_hybrid: every group HYBRID_SHARD", hybrid["strategies"], ["HYBRID_SHARD"])
    check.equal("fsdp2_cpu_offload: every group offloaded", offload["offload"], [True])
    check.equal("fsdp2_cpu_offload: one mesh dim of 2", offload["mesh_shapes"], ["(2,)"])


def accumulation(out: dict, work: Path) -> None:
    """accumulate_grad_batches=2: one reduce-scatter per group per optimizer step (no_sync on the first
    micro-batch), and the accumulated step equals one step on the whole batch."""
    check = Checks(out)
    model, initial = _fresh()
    with count_collectives() as counts:
        trainer(max_steps=1, accumulate_grad_batches=2).fit(model, loader(BATCH))
    ref, _ = reference_step(initial, _all_indices(model))
    plain, _ = _fresh()
    with count_collectives() as plain_counts:
        trainer(max_steps=2).fit(plain, loader(BATCH))
    out.update(
        groups=len(f2.sharding_plan(model).groups),
        micro_batches=len(model.losses),
        reduce_scatters=_rs(counts),
        reduce_scatters_two_plain_steps=_rs(plain_counts),
        max_rel_diff=max_rel_diff(full_params(model), ref),
    )
    groups = out["groups"]
    check.equal("two micro-batches per optimizer step", out["micro_batches"], 2)
    check.equal("four FSDP groups", groups, 4)
    # Without no_sync it would be one per group per micro-batch.
    check.equal("one reduce-scatter per group per optimizer step", out["reduce_scatters"], groups)
    check.equal(
        "two plain steps: one reduce-scatter per group per step", out["reduce_scatters_two_plain_steps"], 2 * groups
    )
    check.below("the accumulated step equals one step on the whole batch (relative)", out["max_rel_diff"], TOL)


def accumulation_modes(out: dict, work: Path) -> None:
    """accumulate_grad_batches=2 under each FSDP2Config.accumulation mode: collectives and parity."""
    check = Checks(out)
    for mode in ("sync_each", "sync_last", "keep_gathered"):
        model, initial = _fresh()
        with count_collectives() as counts:
            trainer(FSDP2Strategy(accumulation=mode), max_steps=1, accumulate_grad_batches=2).fit(model, loader(BATCH))
        ref, _ = reference_step(initial, _all_indices(model))
        plan = f2.sharding_plan(model)
        out[mode] = dict(
            plan_mode=plan.accumulation,
            groups=len(plan.groups),
            reduce_scatters=_rs(counts),
            all_gathers=sum(v for k, v in counts.items() if k.startswith("all_gather")),
            max_rel_diff=max_rel_diff(full_params(model), ref),
        )
        check.equal(f"{mode}: the plan's accumulation mode", out[mode]["plan_mode"], mode)
        check.below(f"{mode}: parameters equal one process's (relative)", out[mode]["max_rel_diff"], TOL)
    each, last, kept = out["sync_each"], out["sync_last"], out["keep_gathered"]
    g, k = kept["groups"], 2
    check.equal("sync_each reduce-scatters every micro-batch (k x groups)", each["reduce_scatters"], k * g)
    check.equal("sync_last reduce-scatters the last micro-batch only (groups)", last["reduce_scatters"], g)
    check.equal("keep_gathered reduce-scatters the last micro-batch only (groups)", kept["reduce_scatters"], g)
    # Per step, sync modes gather k * (2 per resharded block + 1 for the root and 1 for the last block),
    # keep_gathered each group once; sync_last and keep_gathered add a one-time gather of every group.
    # The rest of the fit (the same in every mode) cancels out.
    check.equal(
        "sync_last gathers k(2(g-2)+2) - g more than keep_gathered",
        last["all_gathers"] - kept["all_gathers"],
        k * (2 * (g - 2) + 2) - g,
    )
    check.equal(
        "sync_last gathers g more than sync_each (its one-time gather)", last["all_gathers"] - each["all_gathers"], g
    )


def clipping(out: dict, work: Path) -> None:
    """gradient_clip_val by norm and by value: the clipped step of one process, and the clip was active."""
    check = Checks(out)
    for algorithm, value in (("norm", 0.05), ("value", 0.002)):
        model, initial = _fresh()
        fit = trainer(max_steps=1, gradient_clip_val=value, gradient_clip_algorithm=algorithm)
        fit.fit(model, loader(BATCH))
        ref, ref_norm = reference_step(initial, _all_indices(model), clip=(algorithm, value))
        unclipped, _ = reference_step(initial, _all_indices(model))
        norm = fit.strategy.precision_plugin.last_grad_norm
        out[algorithm] = dict(
            max_rel_diff=max_rel_diff(full_params(model), ref),
            unclipped_diff=max_rel_diff(full_params(model), unclipped),
            norm=None if norm is None else float(norm),
            ref_norm=ref_norm,
        )
        r = out[algorithm]
        check.below(f"{algorithm}: parameters equal one clipping process's (relative)", r["max_rel_diff"], TOL)
        unclipped_diff = r["unclipped_diff"]
        check.that(
            f"{algorithm}: the clip changed the step (> 0.1 from unclipped)", unclipped_diff > 0.1, unclipped_diff
        )
        if algorithm == "norm":
            got = float("nan") if r["norm"] is None else r["norm"]
            check.close("norm: the strategy's grad norm is one process's (relative)", got, r["ref_norm"], TOL)


def _policy_update(initial: LitMLP, model: LitMLP, dtype: torch.dtype, scale: float = 1.0) -> dict:
    """The weights one SGD step should give under a mixed policy, written out without the engine
    (tests/helpers/precision.py): each rank's batch on a `dtype` copy under autocast, fp32 gradients averaged
    over the ranks (the loss multiplied by `scale`, the gradients divided by it), fp32 SGD."""
    _, xs, ys = dataset().tensors

    def loss(low, x, y):
        with torch.autocast("cpu", dtype=dtype):
            return nn.functional.mse_loss(low(x.to(dtype)).float(), y)

    batches = [[(xs[rank[0]], ys[rank[0]])] for rank in gather(model.indices)]
    grads = policy_grads(initial, batches, loss, dtype, scale)
    return {n: p.detach() - LR * grads[n] / scale for n, p in initial.named_parameters()}, grads


def _state_dtypes(fit) -> list[str]:
    return sorted({str(v.dtype) for s in fit.optimizers[0].state.values() for v in s.values() if torch.is_tensor(v)})


def _reduced_in(reductions: list) -> list[str]:
    """The dtypes the step's gradient reduce-scatters ran in (Lightning's own all-reduces are int64 flags)."""
    return sorted({d for name, d in reductions if name.startswith("reduce_scatter")})


def precision(out: dict, work: Path) -> None:
    """Precision strings -> FSDP2 policies: dtypes of weights, compute, state and reductions, and one
    step against the policy written out without the engine (tests/helpers/precision.py)."""
    check = Checks(out)
    # bf16-mixed: the update against the policy written out; dtypes of weights, state and reductions.
    model, initial = _fresh(optimizer="momentum")
    fit = trainer(max_steps=1, precision="bf16-mixed")
    with collective_dtypes() as reductions:
        fit.fit(model, loader(BATCH))
    plan = f2.sharding_plan(model)
    expected, grads = _policy_update(initial, model, torch.bfloat16)
    momentum = {n: full(fit.optimizers[0].state[p]["momentum_buffer"]) for n, p in model.named_parameters()}
    out["bf16_mixed"] = dict(
        model.seen,
        plugin=type(fit.precision_plugin).__name__,
        stored_dtypes=sorted({str(p.dtype) for p in model.parameters()}),
        state_dtypes=_state_dtypes(fit),
        reductions=sorted(reductions),
        precision=sorted({g.precision for g in plan.groups}),
        update_diff=max_rel_diff(full_params(model), expected),
        momentum_diff=max_rel_diff(momentum, grads),
        fp32_update_diff=max_rel_diff(full_params(model), reference_step(initial, _all_indices(model))[0]),
    )
    bf16 = out["bf16_mixed"]
    check.equal("bf16-mixed: the plugin is FSDP2MixedPrecision", bf16["plugin"], "FSDP2MixedPrecision")
    check.equal("bf16-mixed: every group bf16/fp32", bf16["precision"], ["bf16/fp32"])
    check.equal("bf16-mixed: the output is bf16", bf16["out_dtype"], "torch.bfloat16")
    check.equal("bf16-mixed: parameters stored fp32", bf16["stored_dtypes"], ["torch.float32"])
    # The root is gathered around training_step without casting the batch: float targets stay fp32.
    check.equal("bf16-mixed: the batch's input is not cast (fp32)", bf16["input_dtype"], "torch.float32")
    check.equal("bf16-mixed: the batch's target is not cast (fp32)", bf16["target_dtype"], "torch.float32")
    # One SGD step against the policy written out (bf16 copy under autocast, fp32 gradients averaged,
    # fp32 update): the same arithmetic up to fp32 summation order (measured 2.2e-08); the fp32 update
    # is measurably different (6.0e-03), so compute was bf16.
    check.below("bf16-mixed: the update is the policy's (relative)", bf16["update_diff"], TOL)
    fp32_diff = bf16["fp32_update_diff"]
    check.that("bf16-mixed: the update differs from fp32's (> 1e-3): compute was bf16", fp32_diff > 1e-3, fp32_diff)
    # fp32 optimizer state holding the fp32 gradient; gradients reduce-scattered in fp32.
    check.equal("bf16-mixed: optimizer state fp32", bf16["state_dtypes"], ["torch.float32"])
    check.below("bf16-mixed: momentum is the fp32 gradient (relative)", bf16["momentum_diff"], TOL)
    check.equal("bf16-mixed: gradients reduce-scattered in fp32", _reduced_in(bf16["reductions"]), ["float32"])

    # 16-mixed: an initial scale that does not overflow, so no step is skipped; then the update.
    model, initial = _fresh()
    scaler = ShardedGradScaler(device="cpu", init_scale=2.0**10, growth_interval=1000)
    fit = trainer(FSDP2Strategy(), max_steps=1, plugins=[FSDP2MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    with collective_dtypes() as reductions:
        fit.fit(model, loader(BATCH))
    expected, _ = _policy_update(initial, model, torch.float16, scale=2.0**10)
    out["fp16_mixed"] = dict(
        model.seen,
        scaler=type(fit.precision_plugin.scaler).__name__,
        sharded_scaler=isinstance(fit.precision_plugin.scaler, ShardedGradScaler),
        scale_after=float(scaler.get_scale()),
        reductions=sorted(reductions),
        stored_dtypes=sorted({str(p.dtype) for p in model.parameters()}),
        update_diff=max_rel_diff(full_params(model), expected),
    )
    # An initial scale of 2**10 does not overflow, so the step ran (scale unchanged), and the update
    # equals the policy written out with the loss scaled by 2**10 and unscaled in fp32 (5.3e-09).
    fp16 = out["fp16_mixed"]
    check.that("16-mixed: the scaler is a ShardedGradScaler", fp16["sharded_scaler"], fp16["scaler"])
    check.equal("16-mixed: the output is fp16", fp16["out_dtype"], "torch.float16")
    check.equal("16-mixed: parameters stored fp32", fp16["stored_dtypes"], ["torch.float32"])
    check.equal("16-mixed: the scale is unchanged (the step was not skipped)", fp16["scale_after"], 2.0**10)
    check.below("16-mixed: the update is the policy's (relative)", fp16["update_diff"], TOL)
    check.equal("16-mixed: gradients reduce-scattered in fp32", _reduced_in(fp16["reductions"]), ["float32"])

    # bf16-true: weights, compute and reduction in bf16; the update against one bf16 process.
    model, initial = _fresh()
    fit = trainer(max_steps=1, precision="bf16-true")
    with collective_dtypes() as reductions:
        fit.fit(model, loader(BATCH))
    _, xs, ys = dataset().tensors
    batches = [(xs[rank[0]].to(torch.bfloat16), ys[rank[0]].to(torch.bfloat16)) for rank in gather(model.indices)]
    expected = true_precision_update(
        initial, batches, lambda m, x, y: nn.functional.mse_loss(m(x).float(), y.float()), torch.bfloat16, LR
    )  # Lightning casts the whole batch, targets too
    out["bf16_true"] = true = dict(
        model.seen, reductions=sorted(reductions), update_diff=max_rel_diff(full_params(model), expected)
    )
    # Weights, batch, compute, reduction and update all bf16; equal to one bf16 process (measured 0).
    check.equal("bf16-true: parameters bf16", true["param_dtypes"], ["torch.bfloat16"])
    check.equal("bf16-true: the batch's target cast to bf16", true["target_dtype"], "torch.bfloat16")
    check.below("bf16-true: the update is one bf16 process's (relative)", true["update_diff"], TOL)
    check.equal("bf16-true: gradients reduce-scattered in bf16", _reduced_in(true["reductions"]), ["bfloat16"])
    out["double_error"] = check.raises(
        "64-true refused, naming it and the supported precisions",
        lambda: trainer(precision="64-true"),
        ValueError,
        "64-true",
        "bf16-mixed",
    )


def _plain_params(model: nn.Module) -> list[str]:
    """Managed parameters that are not DTensor shards (gathered, left so by a forward-only pass)."""
    return [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]


def evaluation(out: dict, work: Path) -> None:
    """validate/test/predict on a model that never trained, against one process; after each entry
    point (and a fit whose validation runs last) every parameter is its shard again."""
    check = Checks(out)
    model, initial = _fresh()
    fit = trainer()
    val = fit.validate(model, loader(BATCH, shuffle=False), verbose=False)[0]["val_sum"]
    plain = {"validate": _plain_params(model)}
    test = fit.test(model, loader(BATCH, shuffle=False), verbose=False)[0]["val_sum"]
    plain["test"] = _plain_params(model)
    preds = fit.predict(model, loader(BATCH, shuffle=False))
    plain["predict"] = _plain_params(model)
    trainer(max_steps=2, val_check_interval=2, limit_val_batches=1).fit(
        model, loader(BATCH), val_dataloaders=loader(BATCH, shuffle=False)
    )
    plain["fit"] = _plain_params(model)
    with torch.no_grad():
        model(dataset().tensors[1][:2])  # a forward outside the Trainer: the root stays gathered
    plain["own_forward"] = _plain_params(model)
    _, xs, ys = dataset().tensors
    with torch.no_grad():
        ref_out = initial(xs)
        ref_sum = torch.nn.functional.mse_loss(ref_out, ys, reduction="sum").item()
        pred_diff = max((p - ref_out[i]).abs().max().item() for i, p in preds)
    out.update(
        val=float(val),
        test=float(test),
        ref=ref_sum,
        pred_diff=pred_diff,
        root_is_fsdp=isinstance(model, FSDPModule),
        predicted=sum(len(i) for i, _ in preds),
        plain_after=plain,
    )
    check.that("the root module is sharded", out["root_is_fsdp"])
    # Each entry point ends resharded; a forward outside them leaves the root gathered (what they undo).
    check.equal(
        "validate, test, predict and fit end with every parameter sharded",
        {k: v for k, v in plain.items() if k != "own_forward"},
        {"validate": [], "test": [], "predict": [], "fit": []},
    )
    check.that("a forward outside the Trainer leaves the root gathered", "inp.weight" in plain["own_forward"], plain)
    check.close("validate's loss sum is one process's (relative)", out["val"], out["ref"], TOL)
    check.close("test's loss sum is one process's (relative)", out["test"], out["ref"], TOL)
    check.equal("predict ran this rank's half of the 32 samples", out["predicted"], 16)
    check.below("predictions equal one process's (absolute)", pred_diff, 1e-5)


class ManualBlocks(LitMLP):
    """Written for ModelParallelStrategy: shards its blocks itself in configure_model."""

    def configure_model(self):
        for block in self.blocks:
            if not isinstance(block, FSDPModule):
                fully_shard(block, mesh=self.device_mesh["data_parallel"], reshard_after_forward=False)


class OwnTensorParallel(LitMLP):
    """Written for ModelParallelStrategy's default (TP over a node): parallelises a block itself."""

    def configure_model(self):
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        if not isinstance(self.blocks[0].fc.weight, DTensor):
            parallelize_module(self.blocks[0].fc, self.device_mesh["tensor_parallel"], ColwiseParallel())


def own_tp_with_default_strategy(out: dict, work: Path) -> None:
    """FSDP2Strategy() keeps tensor_parallel_size=1 and says so, once, when the module does TP itself."""
    import logging

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("fsdp2_strategy").addHandler(handler)
    try:
        for _ in range(2):  # a second fit in the same process does not repeat it
            torch.manual_seed(0)
            trainer(FSDP2Strategy(), max_steps=1).fit(OwnTensorParallel(), loader(BATCH))
    finally:
        logging.getLogger("fsdp2_strategy").removeHandler(handler)
    out["tp_notes"] = rank0, rank1 = gather([m for m in records if "tensor_parallel_size=1" in m])
    check = Checks(out)
    check.equal("one note on rank 0 over two fits", len(rank0), 1)
    check.equal("no note on rank 1", rank1, [])
    note = rank0[0] if rank0 else ""
    check.that(
        "the note names the module and tensor_parallel_size='auto'",
        "OwnTensorParallel" in note and "tensor_parallel_size='auto'" in note,
        rank0,
    )


def manual_configure_model(out: dict, work: Path) -> None:
    torch.manual_seed(0)
    model = ManualBlocks()
    initial = LitMLP()
    initial.load_state_dict(model.state_dict())
    trainer(max_steps=1).fit(model, loader(BATCH))
    ref, _ = reference_step(initial, _all_indices(model))
    # The user's reshard_after_forward=False survives: no post-forward mesh (a private attribute).
    kept = [tc.post_forward_mesh_info(tc.param_groups(blk)[0]) is None for blk in model.blocks]
    out.update(
        groups=[g.name for g in f2.sharding_plan(model).groups],
        user_settings_kept=kept,
        max_rel_diff=max_rel_diff(full_params(model), ref),
    )
    check = Checks(out)
    check.equal("configure_model's groups kept", out["groups"], ["<root>", "blocks.0", "blocks.1", "blocks.2"])
    check.that("the user's reshard_after_forward=False kept on every block", all(kept), kept)
    check.below("parameters equal one process's (relative)", out["max_rel_diff"], TOL)


class _WeightsAtStart(pl.Callback):
    """The full weights when training starts: sharded and materialised, not yet updated."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.weights = full_params(pl_module)


def meta_init(out: dict, work: Path) -> None:
    start = _WeightsAtStart()
    fit = trainer(max_steps=1, callbacks=[start])
    torch.manual_seed(3)
    with fit.init_module(empty_init=True):
        model = LitMLP()
    out["meta_before"] = all(p.is_meta for p in model.parameters())
    fit.fit(model, loader(BATCH))
    # The module's own initialisation, reproduced in one process from the same generator state
    # (building on meta draws nothing); then one step from those weights against one process.
    own = LitMLP()
    torch.manual_seed(3)
    for module in own.modules():
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
    ref, _ = reference_step(own, _all_indices(model))
    out.update(
        meta_after=any(p.is_meta for p in model.parameters()),
        init_diff=max_rel_diff(start.weights, full_params(own)),
        max_rel_diff=max_rel_diff(full_params(model), ref),
    )
    check = Checks(out)
    check.that("init_module(empty_init=True) builds on meta", out["meta_before"])
    check.that("no meta parameter left after setup", not out["meta_after"])
    # Materialised weights are the modules' own reset_parameters() draws, as in one process (exactly:
    # shards of one draw, not each rank's own), and the first step from them matches one process.
    check.equal("materialised weights are one process's draws (exactly)", out["init_diff"], 0.0)
    check.below("the first step equals one process's (relative)", out["max_rel_diff"], TOL)


def _ckpt_trainer(dirpath: Path, epochs: int, **kwargs) -> pl.Trainer:
    callback = ModelCheckpoint(dirpath=dirpath, save_last=True, save_top_k=-1)
    return trainer(max_epochs=epochs, enable_checkpointing=True, callbacks=[callback], **kwargs)


class _SaveAtStart(pl.Callback):
    def __init__(self, path: Path):
        self.path = path

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)
        self.state_entries = len(trainer.optimizers[0].state)
        assert self.state_entries == 0, f"the save gave the optimizer state ({self.state_entries} entries)"


def checkpoints(out: dict, work: Path) -> None:
    """Sharded checkpoints through ModelCheckpoint: Lightning's layout, exact resume (from "last", from
    ModelParallelStrategy's layout, from a full file, from one process's checkpoint), a save before the
    first step, and a damaged checkpoint refused on every rank."""
    check = Checks(out)
    ckpt_dir = work / "ckpts"
    # Uninterrupted reference: two epochs.
    ref, _ = _fresh(optimizer="adam")
    trainer(max_epochs=2).fit(ref, loader(BATCH))
    out["ref_losses"] = ref_losses = _global_losses(ref)
    ref_params = full_params(ref)
    # 1 process with batch 8 == 2 ranks x 4 (single.py train's reference run).
    check.close("one process's losses equal two ranks' (relative)", SINGLE["reference"]["ref_losses"], ref_losses, TOL)

    first, _ = _fresh(optimizer="adam")
    _ckpt_trainer(ckpt_dir, 1).fit(first, loader(BATCH))
    out["first_losses"] = _global_losses(first)
    out["epoch0_params"] = {k: v.tolist() for k, v in full_params(first).items()}
    out["listing"] = sorted(p.name for p in ckpt_dir.iterdir())
    out["step_files"] = sorted(p.name for p in (ckpt_dir / "epoch=0-step=4.ckpt").iterdir())
    check.equal("the first epoch's losses are the reference's", out["first_losses"], ref_losses[:4])
    check.equal(
        "ModelCheckpoint's listing (no .tmp-* left behind)", out["listing"], ["epoch=0-step=4.ckpt", "last.ckpt"]
    )
    check.equal(
        "a checkpoint directory's files",
        out["step_files"],
        [".metadata", "__0_0.distcp", "__1_0.distcp", "checksums.json", "meta.pt"],
    )

    # ModelParallelStrategy's layout (the model under "state_dict", plain DCP, no checksums), as its
    # save_checkpoint writes it: FSDP2Strategy resumes from it too.
    mps = work / "mps_style.ckpt"
    optimizer = first.trainer.optimizers[0]
    dcp.save(
        {"state_dict": get_model_state_dict(first), "optimizer_0": get_optimizer_state_dict(first, optimizer)},
        checkpoint_id=mps,
    )
    if torch.distributed.get_rank() == 0:
        torch.save(torch.load(ckpt_dir / "last.ckpt" / "meta.pt", weights_only=False), mps / "meta.pt")
    torch.distributed.barrier()
    from_mps, _ = _fresh(seed=7, optimizer="adam")
    trainer(max_epochs=2).fit(from_mps, loader(BATCH), ckpt_path=mps)
    out["mps_resumed_diff"] = max_rel_diff(full_params(from_mps), ref_params)
    check.equal(
        "resumed from ModelParallelStrategy's layout: the reference's parameters (exactly)",
        out["mps_resumed_diff"],
        0.0,
    )

    resumed, _ = _fresh(seed=7, optimizer="adam")  # other init: everything must come from the checkpoint
    _ckpt_trainer(ckpt_dir, 2).fit(resumed, loader(BATCH), ckpt_path="last")
    out["resumed_losses"] = _global_losses(resumed)
    out["resumed_diff"] = max_rel_diff(full_params(resumed), ref_params)
    check.equal("resumed from last: the reference's second-epoch losses", out["resumed_losses"], ref_losses[4:])
    check.equal("resumed from last: the reference's parameters (exactly)", out["resumed_diff"], 0.0)

    top1 = work / "top1"  # save_top_k=1: the strategy removes the older sharded directory
    model, _ = _fresh(optimizer="adam")
    trainer(max_epochs=2, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=top1, save_top_k=1)]).fit(
        model, loader(BATCH)
    )
    torch.distributed.barrier()  # rank 0 removes the older directory: every rank lists after it did
    out["top1_listing"] = sorted(p.name for p in top1.iterdir())
    check.equal("save_top_k=1 removed the older directory whole", out["top1_listing"], ["epoch=1-step=8.ckpt"])

    explicit = work / "explicit.ckpt"
    fit = trainer(max_epochs=1)
    model, _ = _fresh(optimizer="adam")
    fit.fit(model, loader(BATCH))
    fit.save_checkpoint(explicit)
    out["explicit_is_dir"] = explicit.is_dir() and (explicit / ".metadata").is_file()
    check.that("trainer.save_checkpoint(path) writes a sharded directory", out["explicit_is_dir"])

    full_file = work / "full.ckpt"
    fit = trainer(FSDP2Strategy(state_dict_type="full"), max_epochs=1)
    model, _ = _fresh(optimizer="adam")
    fit.fit(model, loader(BATCH))
    fit.save_checkpoint(full_file)
    out["full_is_file"] = full_file.is_file()
    check.that('state_dict_type="full" writes one file', out["full_is_file"])
    resumed, _ = _fresh(seed=7, optimizer="adam")
    trainer(FSDP2Strategy(state_dict_type="full"), max_epochs=2).fit(resumed, loader(BATCH), ckpt_path=full_file)
    out["full_resumed_losses"] = _global_losses(resumed)
    check.close(
        "resumed from the full file: the reference's second-epoch losses (relative)",
        out["full_resumed_losses"],
        ref_losses[4:],
        TOL,
    )

    # 1 -> 2 ranks: the checkpoint single.py train (one process) wrote.
    resumed, _ = _fresh(seed=7, optimizer="adam")
    trainer(max_epochs=2).fit(resumed, loader(BATCH), ckpt_path=work / "single_ckpts" / "epoch=0-step=4.ckpt")
    out["from_single_losses"] = _global_losses(resumed)
    out["from_single_diff"] = max_rel_diff(full_params(resumed), ref_params)
    check.close(
        "1 -> 2 ranks: the reference's second-epoch losses (relative)", out["from_single_losses"], ref_losses[4:], TOL
    )
    check.below("1 -> 2 ranks: the reference's parameters (relative)", out["from_single_diff"], TOL)

    # A save before the first optimizer step (on_train_start) changes nothing, sharded or full
    # (torch's state-dict call would step Adam once), and a resume from it runs like `ref`.
    for kind in ("sharded", "full"):
        early = work / f"early_{kind}.ckpt"
        model, _ = _fresh(optimizer="adam")
        trainer(FSDP2Strategy(state_dict_type=kind), max_epochs=2, callbacks=[_SaveAtStart(early)]).fit(
            model, loader(BATCH)
        )
        out[f"early_{kind}_diff"] = max_rel_diff(full_params(model), ref_params)
        check.below(f"a {kind} save before the first step changes nothing (relative)", out[f"early_{kind}_diff"], 1e-6)
    resumed, _ = _fresh(seed=7, optimizer="adam")
    trainer(max_epochs=2).fit(resumed, loader(BATCH), ckpt_path=work / "early_sharded.ckpt")
    out["early_resumed_diff"] = max_rel_diff(full_params(resumed), ref_params)
    check.below(
        "resumed from the save before the first step: the reference (relative)", out["early_resumed_diff"], 1e-6
    )

    damaged = work / "damaged.ckpt"
    if torch.distributed.get_rank() == 0:
        shutil.copytree(ckpt_dir / "last.ckpt", damaged)
        shard = damaged / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    torch.distributed.barrier()
    model, _ = _fresh(seed=7, optimizer="adam")
    out["damaged_error"] = check.raises(
        "a damaged checkpoint refused, naming the damaged file",
        lambda: trainer(max_epochs=2).fit(model, loader(BATCH), ckpt_path=damaged),
        ValueError,
        "damaged",
        "__1_0.distcp",
    )
    out["damaged_errors_all_ranks"] = gather(out["damaged_error"] is not None)
    check.equal("the damaged checkpoint refused on every rank", out["damaged_errors_all_ranks"], [True, True])

    # A meta.pt that runs code when unpickled (checksums rewritten to match): refused on every rank,
    # nothing run or changed; admitted (the user trusts it), it resumes exactly.
    untrusted, marker = work / "untrusted.ckpt", work / "untrusted_ran"
    if torch.distributed.get_rank() == 0:
        shutil.copytree(ckpt_dir / "last.ckpt", untrusted)
        plant(untrusted / "meta.pt", marker)
    torch.distributed.barrier()
    model, _ = _fresh(seed=7, optimizer="adam")
    before = full_params(model)
    out["untrusted_error"] = check.raises(
        "a meta.pt that runs code is refused, naming the file, the type and the switch",
        lambda: trainer(max_epochs=2).fit(model, loader(BATCH), ckpt_path=untrusted),
        f2.UntrustedCheckpointError,
        "meta.pt",
        "system",
        "add_safe_globals",
    )
    out["untrusted_errors_all_ranks"] = gather(out["untrusted_error"] is not None)
    out["untrusted_ran"] = marker.exists()
    out["untrusted_changed"] = max_rel_diff(full_params(model), before)
    check.equal("refused on every rank", out["untrusted_errors_all_ranks"], [True, True])
    check.that("the payload did not run", not out["untrusted_ran"])
    check.equal("the model is unchanged", out["untrusted_changed"], 0.0)
    # A type of the user's own in meta.pt: refused, then admitted with torch's safe globals (Lightning
    # does not pass fit's weights_only to a strategy that restores after setup, as ModelParallelStrategy).
    own = work / "own_type.ckpt"
    if torch.distributed.get_rank() == 0:
        shutil.copytree(ckpt_dir / "last.ckpt", own)
        add_entry(own / "meta.pt", "settings", OwnType(0.25))
    torch.distributed.barrier()
    model, _ = _fresh(seed=7, optimizer="adam")
    check.raises(
        "a type of the user's own is refused, naming it",
        lambda: trainer(max_epochs=2).fit(model, loader(BATCH), ckpt_path=own),
        f2.UntrustedCheckpointError,
        "OwnType",
    )
    trusted, _ = _fresh(seed=7, optimizer="adam")
    with torch.serialization.safe_globals([OwnType]):
        trainer(max_epochs=2).fit(trusted, loader(BATCH), ckpt_path=own)
    out["trusted_diff"] = max_rel_diff(full_params(trusted), ref_params)
    check.below("admitted with safe_globals, it resumes exactly (relative)", out["trusted_diff"], 1e-6)


class LitLoRA(LitMLP):
    """LitMLP with PEFT LoRA injected into each block's `fc`; only the adapters train. The base comes
    from `base_seed`, the adapters' initial values from `lora_seed`."""

    def __init__(self, base_seed: int = 0, lora_seed: int = 1, **kwargs):
        import peft

        torch.manual_seed(base_seed)
        super().__init__(**kwargs)
        torch.manual_seed(lora_seed)
        config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["fc"], init_lora_weights="gaussian")
        peft.inject_adapter_in_model(config, self)
        for name, p in self.named_parameters():
            p.requires_grad = "lora_" in name


def peft_checkpoints(out: dict, work: Path) -> None:
    """Trainable-only sharded checkpoints through the Trainer ("auto" for PEFT layers): resume exactly
    on the same base, refuse another base, and store only the adapters."""
    check = Checks(out)
    ckpt_dir = work / "lora_ckpts"
    ref = LitLoRA(optimizer="adam")
    trainer(max_epochs=2).fit(ref, loader(BATCH))
    first = LitLoRA(optimizer="adam")
    _ckpt_trainer(ckpt_dir, 1).fit(first, loader(BATCH))
    names = dcp.FileSystemReader(str(ckpt_dir / "last.ckpt")).read_metadata().state_dict_metadata
    out["saved_model_keys"] = sorted(k for k in names if k.startswith("model."))
    out["frozen_base_entry"] = "frozen_base.model" in names
    keys = out["saved_model_keys"]
    check.that(
        "the checkpoint's model entries are the LoRA adapters only",
        bool(keys) and all("lora_" in k for k in keys),
        keys,
    )
    check.that("the checkpoint holds the frozen base's fingerprint", out["frozen_base_entry"])
    resumed = LitLoRA(lora_seed=9, optimizer="adam")  # same base, other adapter values: all from the checkpoint
    _ckpt_trainer(ckpt_dir, 2).fit(resumed, loader(BATCH), ckpt_path="last")
    out["resumed_diff"] = max_rel_diff(full_params(resumed), full_params(ref))
    check.below("resumed on the same base: the uninterrupted run (relative)", out["resumed_diff"], TOL)
    out["other_base_error"] = check.raises(
        "another base refused, naming a differing module",
        lambda: trainer(max_epochs=2).fit(
            LitLoRA(base_seed=5, optimizer="adam"), loader(BATCH), ckpt_path=ckpt_dir / "last.ckpt"
        ),
        ValueError,
        "another frozen base",
        "blocks.0.fc",
    )


def _auto_budgets(config: f2.FSDP2Config, model) -> dict:
    """Budgets from the core planner's estimates (2 ranks, AdamW, no batch: what "auto" uses):
    one that FULL_SHARD fits and SHARD_GRAD_OP (less communication) does not, one that
    SHARD_GRAD_OP fits (NO_SHARD communicates as much with a larger peak), one below all."""
    est = {
        s: f2.estimate_memory(model, dataclasses.replace(config, sharding_strategy=s), world_size=2).peak_bytes
        for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
    }
    return {
        "estimates": est,
        "FULL_SHARD": (est["FULL_SHARD"] + est["SHARD_GRAD_OP"]) // 2,
        "SHARD_GRAD_OP": est["NO_SHARD"] * 2,
        "too_small": est["FULL_SHARD"] // 2,
    }


def _chosen(model) -> dict:
    """What the sharded model shows of the strategy: plan strategies, mesh shapes, reshard choices."""
    plan = f2.sharding_plan(model)
    return {
        "strategies": sorted({g.strategy for g in plan.groups}),
        "mesh_shapes": sorted({str(g.mesh_shape) for g in plan.groups}),
        "reshard": {g.name: g.reshard_after_forward for g in plan.groups},
    }


class AutoMLP(LitMLP):
    """LitMLP with 8 blocks of width 64: enough blocks that FULL_SHARD's peak is below SHARD_GRAD_OP's."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(8, 64), nn.Linear(64, 1)
        self.blocks = nn.ModuleList(ResidualBlock(64) for _ in range(8))


def auto_strategy(out: dict, work: Path) -> None:
    """FSDP2Strategy(sharding_strategy="auto", memory_budget=...): the planner's pick per budget."""
    check = Checks(out)
    budgets = _auto_budgets(FSDP2Strategy(sharding_strategy="FULL_SHARD").fsdp2_config, AutoMLP())
    out["estimates"] = est = budgets["estimates"]
    check.that(
        "estimated peaks: FULL_SHARD < SHARD_GRAD_OP < NO_SHARD",
        est["FULL_SHARD"] < est["SHARD_GRAD_OP"] < est["NO_SHARD"],
        est,
    )
    for expected in ("FULL_SHARD", "SHARD_GRAD_OP"):
        torch.manual_seed(0)
        model = AutoMLP()
        initial = copy.deepcopy(model)
        trainer(FSDP2Strategy(sharding_strategy="auto", memory_budget=budgets[expected]), max_steps=1).fit(
            model, loader(BATCH)
        )
        ref, _ = reference_step(initial, _all_indices(model))
        out[expected] = dict(_chosen(model), max_rel_diff=max_rel_diff(full_params(model), ref))
        out[expected]["rng_after"] = torch.get_rng_state().sum().item()
        check.equal(f"budget for {expected}: every group {expected}", out[expected]["strategies"], [expected])
        check.below(
            f"budget for {expected}: parameters equal one process's (relative)", out[expected]["max_rel_diff"], TOL
        )
    full, zero2 = out["FULL_SHARD"], out["SHARD_GRAD_OP"]
    check.equal("budget for FULL_SHARD: one mesh dim of 2", full["mesh_shapes"], ["(2,)"])
    # FULL_SHARD frees the blocks after forward (not the last, which backward needs at once).
    check.equal(
        "FULL_SHARD reshards blocks 0-6 after forward, not the last",
        [full["reshard"].get(f"blocks.{i}") for i in range(8)],
        [True] * 7 + [False],
    )
    check.equal("SHARD_GRAD_OP reshards no group after forward", sorted(set(zero2["reshard"].values())), [False])
    out["too_small_error"] = check.raises(
        "a budget below every estimate refused by the planner, naming memory_budget",
        lambda: trainer(FSDP2Strategy(sharding_strategy="auto", memory_budget=budgets["too_small"]), max_steps=1).fit(
            AutoMLP(), loader(BATCH)
        ),
        ValueError,
        "sharding_strategy='auto'",
        "smallest peak",
        "memory_budget",
    )
    _throughput(out, work, check)


class TuneMLP(AutoMLP):
    """AutoMLP whose training_step reads nothing of the Trainer (the tuner's copies have none) and no
    values of meta tensors (the memory planner runs it on them)."""

    def training_step(self, batch, batch_idx):
        idx, x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if not idx.is_meta:
            self.indices.append(idx.tolist())
        self.log("loss", loss)
        return loss


def _throughput(out: dict, work: Path, check: Checks) -> None:
    """objective="throughput": the core tunes on the train loader's first batch and training_step's
    loss, caches the pick, shards with it on both ranks; a second fit reuses the cached pick."""
    import fsdp2_strategy.tuning.resolve as resolve

    cache = work / "lightning_tune.json"
    cache.unlink(missing_ok=True)  # both ranks, before the fit's first collective
    os.environ["FSDP2_TUNE_CACHE"] = str(cache)
    strategy = dict(sharding_strategy="auto", objective="throughput")
    torch.manual_seed(0)
    model = TuneMLP()
    initial = copy.deepcopy(model)
    trainer(FSDP2Strategy(**strategy), max_steps=1).fit(model, loader(BATCH))
    ref, _ = reference_step(initial, _all_indices(model))
    (entry,) = json.loads(cache.read_text()).values()
    out["throughput"] = dict(
        _chosen(model),
        groups=len(f2.sharding_plan(model).groups),
        every_rank=gather(str(f2.sharding_plan(model))),
        entry={k: entry[k] for k in ("label", "changes")},
        rows=[r["label"] for r in entry["table"]["rows"]],
        max_rel_diff=max_rel_diff(full_params(model), ref),
        rng_after=torch.get_rng_state().sum().item(),
    )
    t = out["throughput"]
    check.equal(
        "throughput: the default candidates measured first",
        t["rows"][:2],
        ["FULL_SHARD/blocks", "FULL_SHARD/one group"],
    )
    picked = t["entry"]["changes"]
    # NO_SHARD is a (replicate 2, shard 1) mesh; the others shard over both ranks.
    mesh = "(2, 1)" if picked.get("sharding_strategy") == "NO_SHARD" else "(2,)"
    check.equal(
        "throughput: the model sharded with the cached pick", t["strategies"], [picked.get("sharding_strategy")]
    )
    check.equal("throughput: the pick's mesh", t["mesh_shapes"], [mesh])
    one_group = "wrap_policy" in picked and picked["wrap_policy"] is None
    check.equal("throughput: one group exactly when the pick wraps nothing", t["groups"] == 1, one_group)
    check.equal("throughput: the same plan on both ranks", t["every_rank"][0], t["every_rank"][1])
    check.below("throughput: parameters equal one process's (relative)", t["max_rel_diff"], TOL)
    check.equal(
        "throughput: tuning leaves the random state of an untuned run", t["rng_after"], out["FULL_SHARD"]["rng_after"]
    )

    def no_tuning(*args, **kwargs):
        raise AssertionError("tuned again although the decision was cached")

    resolve.tune, original = no_tuning, resolve.tune
    try:
        again = TuneMLP()
        trainer(FSDP2Strategy(**strategy), max_steps=1).fit(again, loader(BATCH))
        out["throughput"]["reused_same_plan"] = str(f2.sharding_plan(again)) == str(f2.sharding_plan(model))
        check.that(
            "throughput: a second fit takes the cached pick without tuning", out["throughput"]["reused_same_plan"]
        )
    finally:
        resolve.tune = original
        del os.environ["FSDP2_TUNE_CACHE"]


class _AtEpochEnd(pl.Callback):
    """Records the whole training state when epoch 0 ends (before ModelCheckpoint saves it: Lightning
    runs checkpoint callbacks last) and when training ends, when each `strategy.save_checkpoint`
    returned, whether that save was still uncommitted when the next step began, and the mode of the
    strategy's background writer."""

    def __init__(self, path: Path):
        self.path, self.state, self.final, self.pending_next_step, self.mode = path, None, None, None, None
        self.save_returned: list[float] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        save = trainer.strategy.save_checkpoint

        def timed(*args, **kwargs):  # what ModelCheckpoint's trainer.save_checkpoint calls
            save(*args, **kwargs)
            self.save_returned.append(time.perf_counter())

        trainer.strategy.save_checkpoint = timed

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == 0:
            self.state = full_state(pl_module, trainer.optimizers[0])

    def on_train_batch_start(self, trainer: pl.Trainer, *_) -> None:
        if trainer.current_epoch == 1 and self.pending_next_step is None:
            self.pending_next_step = not self.path.exists()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.final = full_state(pl_module, trainer.optimizers[0])
        self.mode = getattr(trainer.strategy._saver, "mode", None)


def _saved_state(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the sharded checkpoint at `path`, whole, named as `full_state` names them: the
    model's entries by their names, the optimizer's as "optim.<parameter>.<state key>" (every rank
    reads all of it)."""
    reader = dcp.FileSystemReader(str(path))
    saved = reader.read_metadata().state_dict_metadata
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in saved.items()
        if isinstance(m, TensorStorageMetadata)
    }
    dcp.load(state, storage_reader=reader)
    names = {"model.": "", "optimizer_0.state.": "optim."}
    return {
        next((new + k[len(old) :] for old, new in names.items() if k.startswith(old)), k): v for k, v in state.items()
    }


def async_checkpoints(out: dict, work: Path) -> None:
    """checkpoint_async_save="overlap" through ModelCheckpoint: the epoch-0 save (its copy held back)
    is committed later (at teardown), holds the state of the save bit for bit although epoch 1 ran
    meanwhile, training is unchanged and a resume continues exactly. AsyncCheckpointIO (Lightning's
    own switch) means async_save=True."""
    check = Checks(out)
    ck = work / "async_ckpts"
    ref, _ = _fresh(optimizer="momentum")
    trainer(max_epochs=2).fit(ref, loader(BATCH, shuffle=False))
    probe = _AtEpochEnd(ck / "epoch=0-step=4.ckpt")
    model, _ = _fresh(optimizer="momentum")
    with slow_staging(0.5):
        trainer(
            FSDP2Strategy(checkpoint_async_save="overlap"),
            max_epochs=2,
            enable_checkpointing=True,
            callbacks=[probe, ModelCheckpoint(dirpath=ck, save_top_k=-1)],
        ).fit(model, loader(BATCH, shuffle=False))
    out["listing"] = sorted(p.name for p in ck.iterdir())
    out["pending_at_next_step"], out["mode"] = probe.pending_next_step, probe.mode
    # The epoch-0 save returned before its (held back) copy ended: it did not wait for it.
    out["copied_before_return"] = copied_by(probe.save_returned[0])
    # Parameters and optimizer state (momentum), bit for bit those of the save, although epoch 1
    # changed every one of them.
    out["saved_differs"] = differing(_saved_state(ck / "epoch=0-step=4.ckpt"), probe.state)
    out["keys"], out["changed_by_epoch_1"] = sorted(probe.state), differing(probe.final, probe.state)
    out["trained_diff"] = max_rel_diff(full_params(model), full_params(ref))
    check.equal(
        "both saves committed by the end of fit", out["listing"], ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]
    )
    check.equal("the strategy's writer is in overlap mode", out["mode"], "overlap")
    check.that("the save returned before its held-back copy", not out["copied_before_return"])
    check.that("epoch 1 began while the save was written", out["pending_at_next_step"], out["pending_at_next_step"])
    # Bit for bit the state at the save (parameters and momentum), although epoch 1 changed all of it.
    check.that("the state holds optimizer entries", any(k.startswith("optim.") for k in out["keys"]), out["keys"])
    check.equal("epoch 1 changed every entry of the state", out["changed_by_epoch_1"], out["keys"])
    check.equal("the checkpoint holds the state at the save, bit for bit", out["saved_differs"], [])
    check.equal("training unchanged by the overlap save (exactly)", out["trained_diff"], 0.0)
    resumed, _ = _fresh(seed=7, optimizer="momentum")
    probe = _AtEpochEnd(work / "none")
    trainer(
        max_epochs=2,
        plugins=[AsyncCheckpointIO()],
        enable_checkpointing=True,
        callbacks=[probe, ModelCheckpoint(dirpath=work / "asyncio_ckpts")],
    ).fit(resumed, loader(BATCH, shuffle=False), ckpt_path=ck / "epoch=0-step=4.ckpt")
    out["resumed_diff"] = max_rel_diff(full_params(resumed), full_params(ref))
    out["checkpoint_io_mode"] = probe.mode
    check.below("resumed from the overlap save: the uninterrupted run (relative)", out["resumed_diff"], 1e-6)
    check.equal("Trainer(plugins=[AsyncCheckpointIO()]) means async_save=True", out["checkpoint_io_mode"], True)


class _MemoryLogger(Logger):
    """Keeps what it is given, on whichever rank calls it (Lightning's own loggers write on rank 0
    only by decoration; this one shows which ranks the callback logs from)."""

    name, version = "memory", 0

    def __init__(self):
        super().__init__()
        self.rows: list = []

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self.rows.append([step, dict(metrics)])


def throughput_monitor(out: dict, work: Path) -> None:
    """FSDP2ThroughputMonitor(every=2) over 4 optimizer steps of 2 micro-batches: what each rank logged."""
    logger = _MemoryLogger()
    model, _ = _fresh()
    trainer(max_steps=4, accumulate_grad_batches=2, logger=logger, callbacks=[FSDP2ThroughputMonitor(every=2)]).fit(
        model, loader(BATCH)
    )
    out["rows"] = rank0, rank1 = gather(logger.rows)
    out["cpu_peak"] = f2.peak_flops("cpu").flops
    check = Checks(out)
    check.equal("nothing logged on rank 1", rank1, [])
    check.equal("rank 0 logs every 2 optimizer steps", [step for step, _ in rank0], [2, 4])
    metrics = ["throughput/mfu", "throughput/peak_memory_gib", "throughput/step_time_s", "throughput/tokens_per_s"]
    for i, (_, m) in enumerate(rank0):
        check.equal(f"report {i}: the four throughput metrics", sorted(m), metrics)
        # A report averages its 2 steps; each step saw 2 micro-batches of 4 samples (the batch's
        # integer tensor: one "token" a sample): 8 tokens a step on this rank.
        tokens = m.get("throughput/tokens_per_s", float("nan")) * m.get("throughput/step_time_s", float("nan"))
        check.close(f"report {i}: tokens/s x step time is 8 tokens a step", tokens, 8, 1e-6)
        mfu, peak = m.get("throughput/mfu", float("nan")), m.get("throughput/peak_memory_gib", float("nan"))
        check.that(f"report {i}: 0 < MFU < 1 (against the CPU's measured peak)", 0 < mfu < 1, mfu)
        check.that(f"report {i}: peak memory > 0.01 GiB (the process's resident peak)", peak > 0.01, peak)


def resume_other_world_sizes(out: dict, work: Path) -> None:
    """The uninterrupted 2-rank run (single.py resume continues its checkpoint on 1 process, 2 -> 1), and
    single.py train's 1-process mid-epoch checkpoint continued on 2 ranks (1 -> 2): global step,
    scheduler, data position and end state as the uninterrupted run's."""
    check = Checks(out)
    one = SINGLE["other_world_sizes"]["one"]
    out["two"] = two = record(work, "lit_two", 2)
    out["from_one"] = from_one = record(work, "", 2, checkpoint(work, "lit_one"))
    one_and_two_agree(check, one, two)
    check_resumed(check, "1 -> 2", from_one, two)


CP_SEQ = 128


def _cp_rows() -> list[dict]:
    """4 sequences; the first 20 labels of row 0 have no target (the ranks' token counts differ)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 64, (4, CP_SEQ), generator=g)
    labels = ids.clone()
    labels[0, :20] = -100
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(4)]


def _cp_llama():
    return tiny_llama(
        64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CP_SEQ, attn_implementation="sdpa"
    )


class LitLlama(pl.LightningModule):
    """A Hugging Face Llama whose training_step uses the batch the strategy hands it."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _cp_llama()
        self.shapes: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.shapes.append(list(batch["input_ids"].shape))
        logits = self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        return batch.loss(logits)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def context_parallel(out: dict, work: Path) -> None:
    """`FSDP2Strategy(context_parallel_size=2)`: each rank's training_step gets half of every
    sequence; 2 steps equal one process on whole sequences."""
    check = Checks(out)
    rows = _cp_rows()
    reference = _cp_llama()
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(2):
        batch = torch.utils.data.default_collate(rows[2 * step : 2 * step + 2])
        reference(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    model = LitLlama()
    trainer(FSDP2Strategy(context_parallel_size=2), max_steps=2).fit(
        model, torch.utils.data.DataLoader(rows, batch_size=2)
    )
    check.equal("each rank's step holds half of every sequence", model.shapes, [[2, CP_SEQ // 2]] * 2)
    check.below(
        "parameters after 2 steps equal one process on whole sequences (relative)",
        max_rel_diff(full_params(model.model), {n: p.detach() for n, p in reference.named_parameters()}),
        TOL,
    )


class LitCausalLM(pl.LightningModule):
    """A Hugging Face causal LM whose training_step returns the model's own `.loss` (labels passed)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _cp_llama()
        self.logits_seen: list[str] = []

    def training_step(self, batch, batch_idx):
        out = self.model(input_ids=batch["input_ids"], labels=batch["labels"])
        self.logits_seen.append(type(out.logits).__name__)
        return out.loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def chunked_loss(out: dict, work: Path) -> None:
    """`Trainer(strategy="fsdp2")` on a LightningModule holding a Hugging Face causal LM: the chunked
    loss is installed on the held model (the plan says so, the training output has no logits) and
    2 steps equal one process (each rank's mean loss, averaged, as the reference computes it)."""
    check = Checks(out)
    rows = _cp_rows()
    reference = _cp_llama()
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(2):
        pair = [torch.utils.data.default_collate(rows[i : i + 1]) for i in (2 * step, 2 * step + 1)]
        (sum(reference(**row).loss for row in pair) / 2).backward()
        opt.step()
        opt.zero_grad()
    model = LitCausalLM()
    trainer("fsdp2", max_steps=2).fit(model, torch.utils.data.DataLoader(rows, batch_size=1))
    check.that("the plan says the loss is chunked", f2.sharding_plan(model).loss.startswith("chunked"), "")
    check.equal("training outputs carry no logits", model.logits_seen, ["LogitsNotBuilt"] * 2)
    check.below(
        "parameters after 2 steps equal one process (relative)",
        max_rel_diff(full_params(model.model), {n: p.detach() for n, p in reference.named_parameters()}),
        TOL,
    )


FLOWS = [
    one_step_parity,
    registry_variants,
    accumulation,
    accumulation_modes,
    clipping,
    precision,
    evaluation,
    manual_configure_model,
    own_tp_with_default_strategy,
    meta_init,
    checkpoints,
    peft_checkpoints,
    async_checkpoints,
    auto_strategy,
    throughput_monitor,
    resume_other_world_sizes,
    context_parallel,
    chunked_loss,
]


def main(out_path: str, work: str, single_report: str) -> None:
    SINGLE.update(json.loads(Path(single_report).read_text()))
    run_flows(FLOWS, out_path, Path(work))
    f2.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])

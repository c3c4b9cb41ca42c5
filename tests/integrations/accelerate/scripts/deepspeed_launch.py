"""Run by `accelerate launch --config_file deepspeed.yaml` with DeepSpeed installed: the launcher takes
its DeepSpeed path (torchrun, ACCELERATE_USE_DEEPSPEED, ACCELERATE_DEEPSPEED_CONFIG_FILE,
ACCELERATE_MIXED_PRECISION=no, ACCELERATE_CONFIG_DS_FIELDS) and `FSDP2Accelerator()` trains what
ds_config.json says: ZeRO-3 as FULL_SHARD, bf16 compute over the launcher's "no", 2 micro-batches a
step, gradients clipped to global norm 0.05 before the step; one WARNING block says all of it.

Usage: deepspeed_launch.py OUT.json WORK
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch
from common import dataset, fresh, gather, lm_loss, reference, update_rel_diff
from helpers.checks import Checks
from helpers.collect import full_params, run_flows
from torch.utils.data import DataLoader, Subset

import fsdp2_strategy as f2
from fsdp2_strategy.integrations.accelerate import FSDP2Accelerator

CLIP = 0.05  # ds_config.json's gradient_clipping
BF16_TOL = 0.02
"""Relative difference of the whole bf16 update from the fp32 one-process update (measured 0.005;
leaving out the clipping gives 0.99, leaving out the first micro-batch 0.39)."""


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def deepspeed_file(out: dict, work: Path) -> None:
    captured = _Warnings()
    logging.getLogger("fsdp2_strategy").addHandler(captured)
    launcher_env = {k: os.environ.get(k) for k in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_MIXED_PRECISION")}
    model, initial = fresh(6)
    acc = FSDP2Accelerator()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = DataLoader(Subset(dataset(), range(16)), batch_size=4)  # 2 micro-batches of 4 per rank
    model, opt, dl = acc.prepare(model, opt, dl)
    forward_dtypes = set()
    model.blocks[0].mlp[0].register_forward_pre_hook(lambda m, args: forward_dtypes.add(str(m.weight.dtype)))
    params = [p for p in model.parameters()]
    sync, micro, norm_before = [], [], None
    for idx, x, y in dl:
        with acc.accumulate(model):
            acc.backward(lm_loss(model, x, y))
            sync.append(acc.sync_gradients)
            if acc.sync_gradients:
                norm_before = f2.clip_grad_norm_(params, float("inf")).item()  # measures, clips nothing
            opt.step()
            if acc.sync_gradients:
                norm_after = f2.clip_grad_norm_(params, float("inf")).item()
            opt.zero_grad()
        micro.append(idx.tolist())
    per_rank = gather(micro)
    batches = [[i for rank in per_rank for i in rank[m]] for m in range(len(micro))]
    start = {n: p.detach().clone() for n, p in initial.named_parameters()}
    got = full_params(model)
    want, _, _ = reference(initial, batches, clip=CLIP)
    unclipped, _, _ = reference(initial, batches)
    last_only, _, _ = reference(initial, batches[-1:], clip=CLIP)
    summary = gather(captured.messages)[0]  # rank 0 logs
    out.update(
        launcher_env=launcher_env,
        precision=acc.mixed_precision,
        strategies=sorted({g.strategy for g in f2.sharding_plan(model).groups}),
        forward_dtypes=sorted(forward_dtypes),
        accumulation_steps=acc.gradient_accumulation_steps,
        sync_gradients=sync,
        norm_before=norm_before,
        norm_after=norm_after,
        update_rel=update_rel_diff(start, got, want),
        unclipped_rel=update_rel_diff(start, got, unclipped),
        last_only_rel=update_rel_diff(start, got, last_only),
        summary=[m for m in summary if "DEEPSPEED runs on FSDP2" in m],
    )
    check = Checks(out)
    check.equal("the launcher took its DeepSpeed path", out["launcher_env"]["ACCELERATE_USE_DEEPSPEED"], "true")
    check.equal("the launcher said mixed_precision no", out["launcher_env"]["ACCELERATE_MIXED_PRECISION"], "no")
    check.equal("ZeRO-3 is FULL_SHARD", out["strategies"], ["FULL_SHARD"])
    check.equal("bf16.enabled wins: the accelerator's precision", out["precision"], "bf16")
    check.equal("bf16.enabled wins: blocks compute in bf16", out["forward_dtypes"], ["torch.bfloat16"])
    check.equal("gradient_accumulation_steps: 2", out["accumulation_steps"], 2)
    check.equal("a step on every second micro-batch", out["sync_gradients"], [False, True])
    check.that("the gradients exceeded the clipping norm", out["norm_before"] > 4 * CLIP, out["norm_before"])
    check.close("gradient_clipping: clipped to 0.05 before the step", out["norm_after"], CLIP, 1e-4)
    check.below("the step is one process's fp32 step over both micro-batches, clipped", out["update_rel"], BF16_TOL)
    check.that("without the clipping the step differs", out["unclipped_rel"] > 5 * BF16_TOL, out["unclipped_rel"])
    check.that("with one micro-batch the step differs", out["last_only_rel"] > 5 * BF16_TOL, out["last_only_rel"])
    check.equal("one summary block", len(out["summary"]), 1)
    block = out["summary"][0] if out["summary"] else ""
    for line in (
        "deepspeed_config_file ds_config.json",
        "zero_optimization.stage -> sharding_strategy=FULL_SHARD",
        "bf16.enabled -> mixed_precision=bf16",
        "mixed precision: bf16 (the DeepSpeed config's, over the accelerate config's 'no')",
        "gradient accumulation: 2 micro-batches a step (over the accelerator's 1)",
        "gradient clipping: global norm 0.05, before each optimizer step",
        "train_micro_batch_size_per_gpu=4: your DataLoader's batch_size decides",
        "zero_optimization.overlap_comm: not translated",
        "steps_per_print: not translated",
    ):
        check.that(f"the summary says {line!r}", line in block, block)


if __name__ == "__main__":
    run_flows([deepspeed_file], sys.argv[1], Path(sys.argv[2]))
    f2.shutdown()

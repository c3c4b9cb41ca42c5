"""DeepSpeed trains the shared model with ZeRO-1, 2 and 3 in one 2-process world (torchrun, CPU, gloo,
fp32, torch AdamW, a LinearLR schedule): K steps, `save_checkpoint` (with client state), then M more
steps on the same data. Rank 0 writes what DeepSpeed holds at step K and after K+M steps (full fp32
parameters, exp_avg, exp_avg_sq, from DeepSpeed's own `safe_get_full_*` helpers) to `reference.pt`.

Usage: torchrun --nproc_per_node=2 train_zero.py OUT_DIR
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from helpers.deepspeed_models import (
    K_STEPS,
    M_STEPS,
    WORLD,
    batch_for,
    ds_config,
    lm_loss,
    make_model,
    make_optimizer,
    make_scheduler,
)


def snapshot(engine) -> dict:
    """Full fp32 trainable parameters and their Adam moments by name (collective under ZeRO-3)."""
    out: dict = {"param": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        out["param"][name] = safe_get_full_fp32_param(p).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[key][name] = safe_get_full_optimizer_state(p, key).clone()
    out["lr"] = engine.get_lr()[0]
    return out


def train(engine, steps: range) -> None:
    rank = dist.get_rank()
    for step in steps:
        idx, tgt = batch_for(step, rank, WORLD)
        loss = lm_loss(engine, idx, tgt)
        engine.backward(loss)
        engine.step()


def run_stage(stage: int, out: Path) -> dict:
    model = make_model()
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config(stage))
    train(engine, range(K_STEPS))
    engine.save_checkpoint(str(out / f"zero{stage}"), client_state={"epoch": 3, "data_position": 1234})
    at_save = snapshot(engine)
    train(engine, range(K_STEPS, K_STEPS + M_STEPS))
    return {"at_save": at_save, "continued": snapshot(engine)}


def main() -> None:
    out = Path(sys.argv[1])
    deepspeed.init_distributed(dist_backend="gloo")
    reference = {stage: run_stage(stage, out) for stage in (1, 2, 3)}
    if dist.get_rank() == 0:
        torch.save(reference, out / "reference.pt")
    dist.barrier()
    dist.destroy_process_group()
    # As the harness's ranks do: with torch 2.13 on gloo a process may abort at interpreter exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

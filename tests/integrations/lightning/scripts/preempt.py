"""SIGTERM to one rank with `FSDP2Strategy(checkpoint_on_preemption=True)`, then a resume from the save.

Usage: torchrun --nproc_per_node=2 preempt.py preempt WORKDIR   (rank 1 receives SIGTERM in step 4; exits 143)
       torchrun --nproc_per_node=2 preempt.py resume OUT.json WORKDIR   (uninterrupted run vs resumed from "hpc")

The resume checks on every rank what the preemption saved and what the resume did (`helpers.checks.Checks`),
and writes each rank's report (OUT.rank0.json, ...: `helpers.collect.run_flows`).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from common import LitMLP, full_params, loader, max_rel_diff, trainer
from helpers.checks import Checks
from helpers.collect import run_flows

import fsdp2_strategy as f2
from fsdp2_strategy.integrations.lightning import FSDP2Strategy

BATCH = 4  # per rank: 4 steps per epoch on 2 ranks
TOL = 1e-5  # fp32 parity, relative


class SignalledMLP(LitMLP):
    def training_step(self, batch, batch_idx):
        if self.global_step == 3 and self.global_rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the 4th step: the default action would kill this rank here
        return super().training_step(batch, batch_idx)


class StartStep(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step = trainer.global_step


def fresh(cls: type = LitMLP) -> LitMLP:
    torch.manual_seed(0)
    return cls(optimizer="momentum")


def preempt(work: Path) -> None:
    strategy = FSDP2Strategy(checkpoint_on_preemption=True)
    trainer(strategy, max_epochs=2, default_root_dir=work).fit(fresh(SignalledMLP), loader(BATCH, shuffle=False))
    raise SystemExit("fit returned: the preemption was not handled")


def resume_from_hpc(out: dict, work: Path) -> None:
    """What the preemption saved (hpc_ckpt_1.ckpt after step 4), and fit(ckpt_path="hpc") from it
    continuing from step 4 to the parameters of the uninterrupted run."""
    check = Checks(out)
    saved = work / "hpc_ckpt_1.ckpt"
    check.that("the preemption saved hpc_ckpt_1.ckpt, committed", (saved / ".metadata").is_file())
    meta = saved / "meta.pt"
    out["saved_step"] = torch.load(meta, weights_only=False)["global_step"] if meta.is_file() else None
    check.equal("the saved checkpoint is after step 4", out["saved_step"], 4)
    ref = fresh()
    trainer(max_epochs=2).fit(ref, loader(BATCH, shuffle=False))
    resumed, start = fresh(), StartStep()
    trainer(max_epochs=2, default_root_dir=work, callbacks=[start]).fit(
        resumed, loader(BATCH, shuffle=False), ckpt_path="hpc"
    )
    out.update(start_step=start.step, diff=max_rel_diff(full_params(resumed), full_params(ref)))
    check.equal("the resume starts at step 4", out["start_step"], 4)
    check.below("the resumed run ends at the uninterrupted run's parameters (relative)", out["diff"], TOL)


if __name__ == "__main__":
    if sys.argv[1] == "preempt":
        preempt(Path(sys.argv[2]))
    else:
        run_flows([resume_from_hpc], sys.argv[2], Path(sys.argv[3]))
        f2.shutdown()

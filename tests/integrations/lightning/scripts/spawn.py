"""Trainer(strategy="fsdp2_spawn"): ranks are spawned; the parent gets the trained full weights back.

Usage: python spawn.py OUT.json   (the parent's checks: OUT.rank0.json, `helpers.collect.run_flows`)
"""

from __future__ import annotations

import copy
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from common import LitMLP, full_params, gather, loader, max_rel_diff, reference_step, trainer
from helpers.checks import Checks
from helpers.collect import run_flows
from torch.distributed.tensor import DTensor

TOL = 1e-5  # fp32 parity, relative


class ReportFromRanks(pl.Callback):
    """The spawned ranks' view at the end of training: full weights and the samples they used."""

    def __init__(self, path: Path):
        self.path = path

    def on_train_end(self, trainer, module):
        params, indices = full_params(module), gather(module.indices)  # collectives: every rank
        if trainer.global_rank == 0:
            torch.save((params, [i for rank in indices for batch in rank for i in batch]), self.path)


def spawn(out: dict, work: Path) -> None:
    """The parent: no process group of its own, plain full weights back, equal to the ranks' and to one process."""
    check = Checks(out)
    torch.manual_seed(0)
    model = LitMLP()
    initial = copy.deepcopy(model)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "ranks.pt"
        trainer("fsdp2_spawn", max_steps=1, callbacks=[ReportFromRanks(report)]).fit(model, loader(4))
        rank_params, indices = torch.load(report)
    ref, _ = reference_step(initial, indices)
    out.update(
        parent_has_process_group=torch.distributed.is_initialized(),
        plain_tensors=not any(isinstance(p, DTensor) for p in model.parameters()),
        ranks_vs_single_process=max_rel_diff(rank_params, ref),
        parent_vs_ranks=max_rel_diff(full_params(model), rank_params),
    )
    check.that("the parent has no process group", not out["parent_has_process_group"])
    check.that("the parent's parameters are plain tensors", out["plain_tensors"])
    check.below("the ranks' weights equal one process's (relative)", out["ranks_vs_single_process"], TOL)
    check.equal("the parent's weights are the ranks' (exactly)", out["parent_vs_ranks"], 0.0)


if __name__ == "__main__":
    run_flows([spawn], sys.argv[1], Path(sys.argv[1]).parent)

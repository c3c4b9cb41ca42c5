"""One process: resume the 2-rank checkpoint of flows.py (2 -> 1) and continue one step; checks it
against what flows.py's continuing run did (`helpers.checks.Checks`) and writes OUT.rank0.json (`helpers.collect.run_flows`).

Usage: python single.py OUT.json WORKDIR FLOWS.rank0.json   (after flows.py wrote WORKDIR/fabric_ckpt and its report)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from common import fresh, full_params, max_rel_diff
from flows import BATCHES, TOL, Counter, _train
from helpers.checks import Checks
from helpers.collect import run_flows
from lightning.fabric import Fabric

import fsdp2_strategy as f2

FLOWS: dict = {}
"""flows.py's report (rank 0's), set by `main`."""


def resume_on_one_process(out: dict, work: Path) -> None:
    """2 ranks -> 1: DCP reshards the model and Adam state; the step continues as the 2-rank run did."""
    check = Checks(out)
    fabric = Fabric(strategy="fsdp2", accelerator="cpu", devices=1)
    fabric.launch()  # Fabric's own (subprocess-script) launcher: one process, nothing started
    raw, _ = fresh(6)
    model, optimizer = fabric.setup(raw, torch.optim.Adam(raw.parameters(), lr=0.01))
    counter = Counter()
    state = {"model": model, "optimizer": optimizer, "step": 0, "counter": counter}
    remainder = fabric.load(work / "fabric_ckpt", state)
    losses = _train(fabric, model, optimizer, batches=BATCHES[1:])
    continuing = torch.load(work / "continuing.pt")
    out.update(
        world=fabric.world_size,
        step=state["step"],
        counter=counter.n,
        remainder=remainder,
        losses=losses,
        continued_losses=continuing["losses"],
        resume_diff=max_rel_diff(full_params(raw), continuing["params"]),
    )
    check.equal("one process", out["world"], 1)
    check.equal("load restores the step", out["step"], 1)
    check.equal("load restores a stateful object", out["counter"], 7)
    check.equal("load returns what state did not ask for", out["remainder"], {"note": "hello"})
    check.below("the continuing 2-rank run's parameters (relative)", out["resume_diff"], TOL)
    check.close("the continuing 2-rank run's loss (relative)", losses[:1], continuing["losses"][:1], TOL)
    check.equal(
        "continuing.pt holds flows.py's continued losses",
        continuing["losses"],
        FLOWS["checkpoints"]["continued_losses"],
    )


def main(out_path: str, work: str, flows_report: str) -> None:
    FLOWS.update(json.loads(Path(flows_report).read_text()))
    run_flows([resume_on_one_process], out_path, Path(work))
    f2.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])

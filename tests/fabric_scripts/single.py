"""One process: resume the 2-rank checkpoint of flows.py (2 -> 1) and continue one step.

Usage: python single.py OUT.json WORKDIR   (after flows.py wrote WORKDIR/fabric_ckpt)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from common import fresh, full_params, max_rel_diff, write_json
from flows import BATCHES, Counter, _train
from lightning.fabric import Fabric

import fsdp2_strategy as f2


def main(out_path: str, work: str) -> None:
    fabric = Fabric(strategy="fsdp2", accelerator="cpu", devices=1)
    fabric.launch()  # Fabric's own (subprocess-script) launcher: one process, nothing started
    raw, _ = fresh(6)
    model, optimizer = fabric.setup(raw, torch.optim.Adam(raw.parameters(), lr=0.01))
    counter = Counter()
    state = {"model": model, "optimizer": optimizer, "step": 0, "counter": counter}
    remainder = fabric.load(Path(work) / "fabric_ckpt", state)
    losses = _train(fabric, model, optimizer, batches=BATCHES[1:])
    continuing = torch.load(Path(work) / "continuing.pt")
    write_json(
        out_path,
        dict(
            world=fabric.world_size,
            step=state["step"],
            counter=counter.n,
            remainder=remainder,
            losses=losses,
            continued_losses=continuing["losses"],
            resume_diff=max_rel_diff(full_params(raw), continuing["params"]),
        ),
    )
    f2.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])

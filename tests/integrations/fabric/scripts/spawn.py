"""`Fabric(strategy="fsdp2_spawn").launch(fn)`: ranks are spawned; rank 0's result comes back, and the
parent checks it (`helpers.checks.Checks`), writing OUT.rank0.json (`helpers.collect.run_flows`).

Usage (tests/ on the path, as `helpers.harness.launch` puts it): PYTHONPATH=tests python tests/integrations/fabric/scripts/spawn.py OUT.json WORKDIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from common import LR, fresh, full_params, max_rel_diff, params, reference_steps
from flows import BATCHES, TOL, _train
from helpers.checks import Checks
from helpers.collect import run_flows
from lightning.fabric import Fabric


def train(fabric: Fabric, work: str) -> dict:
    raw, _ = fresh(0)
    model, optimizer = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=LR))
    _train(fabric, model, optimizer)
    # A DCP save in the worker: it must still exit cleanly (the launcher ends it with f2.shutdown).
    fabric.save(Path(work) / "spawn_ckpt", {"model": model, "optimizer": optimizer})
    # Plain lists: Fabric's spawn launcher reads the queue after the workers exited, so tensors (shared
    # through the worker's file descriptors) cannot come back; stock "ddp_spawn" fails the same way.
    return {
        "params": {n: t.tolist() for n, t in full_params(raw).items()},
        "world": fabric.world_size,
        "strategy": type(fabric.strategy).__name__,
    }


def spawn(out: dict, work: Path) -> None:
    """The parent: 2 spawned ranks trained like one process and committed their save; no process group here."""
    check = Checks(out)
    fabric = Fabric(strategy="fsdp2_spawn", accelerator="cpu", devices=2)
    result = fabric.launch(train, str(work))
    _, ref = fresh(0)
    reference_steps(ref, torch.optim.SGD(ref.parameters(), lr=LR), BATCHES)
    out.update(
        world=result["world"],
        strategy=result["strategy"],
        parent_has_process_group=torch.distributed.is_initialized(),
        max_rel_diff=max_rel_diff({n: torch.tensor(v) for n, v in result["params"].items()}, params(ref)),
        committed=(work / "spawn_ckpt" / ".metadata").is_file(),
    )
    check.equal("a world of 2", out["world"], 2)
    check.equal("the strategy is FSDP2FabricStrategy", out["strategy"], "FSDP2FabricStrategy")
    check.that("the parent has no process group", not out["parent_has_process_group"])
    check.below("the ranks' weights equal one process's (relative)", out["max_rel_diff"], TOL)
    check.that("the workers' save committed", out["committed"])


if __name__ == "__main__":
    run_flows([spawn], sys.argv[1], Path(sys.argv[2]))

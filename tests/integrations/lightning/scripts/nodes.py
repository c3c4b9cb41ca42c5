"""Two "nodes" of one process each (two torchrun agents on this machine): Trainer(num_nodes=2).

Usage (once per node): torchrun --nnodes=2 --node_rank=R --nproc_per_node=1 --master_addr=127.0.0.1
                       --master_port=P nodes.py OUT.json

Each rank checks (`helpers.checks.Checks`) and writes its report (OUT.rank0.json, OUT.rank1.json: `helpers.collect.run_flows`).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from common import LitMLP, full_params, gather, loader, max_rel_diff, reference_step, trainer
from helpers.checks import Checks
from helpers.collect import run_flows

import fsdp2_strategy as f2

TOL = 1e-5  # fp32 parity, relative


def two_nodes(out: dict, work: Path) -> None:
    """fsdp2_hybrid over 2 nodes of 1 device: replicate across the nodes, shard within each; one step
    equals one process."""
    check = Checks(out)
    torch.manual_seed(0)
    model = LitMLP()
    initial = copy.deepcopy(model)
    fit = trainer("fsdp2_hybrid", devices=1, num_nodes=2, max_steps=1)
    fit.fit(model, loader(4))
    indices = [i for rank in gather(model.indices) for batch in rank for i in batch]
    ref, _ = reference_step(initial, indices)
    plan = f2.sharding_plan(model)
    out.update(
        node_ranks=gather(fit.node_rank),
        world_size=fit.world_size,
        mesh_shapes=sorted({str(g.mesh_shape) for g in plan.groups}),
        max_rel_diff=max_rel_diff(full_params(model), ref),
    )
    check.equal("node ranks 0 and 1", out["node_ranks"], [0, 1])
    check.equal("a world of 2", out["world_size"], 2)
    check.equal("replicated across the 2 nodes, sharded within each", out["mesh_shapes"], ["(2, 1)"])
    check.below("parameters equal one process's (relative)", out["max_rel_diff"], TOL)


if __name__ == "__main__":
    run_flows([two_nodes], sys.argv[1], Path(sys.argv[1]).parent)
    f2.shutdown()

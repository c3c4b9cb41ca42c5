"""Two "nodes" of one process each (two torchrun agents on this machine): Trainer(num_nodes=2).

Usage (once per node): torchrun --nnodes=2 --node_rank=R --nproc_per_node=1 --master_addr=127.0.0.1
                       --master_port=P nodes.py OUT.json
"""

from __future__ import annotations

import copy
import sys

import torch
from common import LitMLP, full_params, gather, loader, max_rel_diff, reference_step, trainer, write_json

import fsdp2_strategy as f2


def main(out_path: str) -> None:
    torch.manual_seed(0)
    model = LitMLP()
    initial = copy.deepcopy(model)
    fit = trainer("fsdp2_hybrid", devices=1, num_nodes=2, max_steps=1)
    fit.fit(model, loader(4))
    indices = [i for rank in gather(model.indices) for batch in rank for i in batch]
    ref, _ = reference_step(initial, indices)
    plan = f2.sharding_plan(model)
    write_json(
        out_path,
        {
            "node_ranks": gather(fit.node_rank),
            "world_size": fit.world_size,
            "mesh_shapes": sorted({str(g.mesh_shape) for g in plan.groups}),
            "max_rel_diff": max_rel_diff(full_params(model), ref),
        },
    )
    f2.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])

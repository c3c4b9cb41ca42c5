"""Fabric 2 dp x 2 tp on 4 CPU ranks (`fabric run --devices 4`): a plain GPT given
`tensor_parallel_plan`, trained with SGD, against one process on the same global batches.
Every rank checks it (`helpers.checks.Checks`) and writes its report (`helpers.collect.run_flows`); tests/integrations/fabric/test_fabric.py
reports the failed checks.

    PYTHONPATH=tests fabric run --accelerator cpu --devices 4 tests/integrations/fabric/scripts/tensor_parallel.py OUT.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from common import full_params, max_rel_diff
from helpers.checks import Checks
from helpers.collect import run_flows
from helpers.models import TP_PLAN, lm_data, lm_loss, sgd_reference  # (tests/ is on the path via `common`)
from helpers.models import TPGPT as GPT
from lightning.fabric import Fabric
from torch.distributed.tensor import DTensor

import fsdp2_strategy as f2
from fsdp2_strategy.integrations.fabric import FSDP2FabricStrategy

VOCAB, SEQ, N_SAMPLES, BATCH, STEPS, LR = 64, 12, 16, 4, 2, 0.1  # BATCH per data-parallel rank
TOL = 1e-5  # fp32 parity, relative


def plan_flow() -> dict:
    torch.manual_seed(0)
    initial = GPT()
    # Devices and accelerator come from `fabric run` (its --devices 4 --accelerator cpu).
    fabric = Fabric(strategy=FSDP2FabricStrategy(tensor_parallel_size=2, tensor_parallel_plan=TP_PLAN))
    raw = GPT()
    raw.load_state_dict(initial.state_dict())
    model, optimizer = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=LR))
    mesh = fabric.strategy.device_mesh
    dp_rank, dp_size = mesh["data_parallel"].get_local_rank(), mesh["data_parallel"].size()
    _, idx, target = lm_data(VOCAB, SEQ, N_SAMPLES, seed=7).tensors
    steps = [list(range(s * BATCH * dp_size, (s + 1) * BATCH * dp_size)) for s in range(STEPS)]
    for rows in steps:
        mine = rows[dp_rank * BATCH : (dp_rank + 1) * BATCH]  # both ranks of a TP group: the same rows
        fabric.backward(lm_loss(model, idx[mine], target[mine]))
        optimizer.step()
        optimizer.zero_grad()
    got = full_params(raw)
    expected = sgd_reference(initial, lm_data(VOCAB, SEQ, N_SAMPLES, seed=7), steps, LR)
    q = raw.blocks[0].attn.q.weight
    return {
        "max_rel_diff": max_rel_diff(got, expected),
        "same_names": sorted(got) == sorted(expected),
        "mesh_dims": list(mesh.mesh_dim_names),
        "mesh_shape": list(mesh.shape),
        "q_2d_dtensor": isinstance(q, DTensor) and q.device_mesh.ndim == 2,
        "plan": str(f2.sharding_plan(raw)),
    }


def plan(entry: dict, work: Path) -> None:
    """2 dp x 2 tp from `tensor_parallel_plan` equals one process; 2-D mesh and weights; the plan's styles."""
    check = Checks(entry)
    entry.update(plan_flow())
    check.that("the same parameter names as one process", entry["same_names"])
    check.below("parameters equal one process's (relative)", entry["max_rel_diff"], TOL)
    check.equal("mesh dims", entry["mesh_dims"], ["data_parallel", "tensor_parallel"])
    check.equal("mesh shape", entry["mesh_shape"], [2, 2])
    check.that("column-wise q: TP over tensor_parallel, FSDP over data_parallel (2-D DTensor)", entry["q_2d_dtensor"])
    check.that(
        "the sharding plan shows 'colwise' and 'rowwise'",
        "colwise" in entry["plan"] and "rowwise" in entry["plan"],
        entry["plan"],
    )


def main(out: str) -> None:
    run_flows([plan], out, Path(out).parent)  # every rank writes its report (OUT.rankN.json)
    f2.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])

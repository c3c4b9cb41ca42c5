"""Accelerate's ParallelismConfig on 4 CPU ranks (torchrun): dp_shard=2 x tp=2 through
`FSDP2Accelerator` equals one process, given as an object and as the environment `accelerate
launch` sets from a config file; unsupported sizes are refused with the field named.

Each flow checks what it claims on every rank (`helpers.checks.Checks`) and every rank writes its report
(`helpers.collect.run_flows`); tests/integrations/accelerate/test_accelerate_tp.py launches and reports.

    PYTHONPATH=tests torchrun --nproc_per_node=4 tests/integrations/accelerate/scripts/tensor_parallel.py OUT.json
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch
from accelerate.parallelism_config import ParallelismConfig
from helpers.checks import Checks
from helpers.collect import full_params, gather, max_rel_diff, run_flows
from helpers.models import TP_PLAN as PLAN  # the 2-D tests' small GPT (separate q/k/v)
from helpers.models import TPGPT as GPT
from helpers.models import lm_data, lm_loss, sgd_reference
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import fsdp2_strategy as f2
from fsdp2_strategy.integrations.accelerate import FSDP2Accelerator, FSDP2Plugin

VOCAB, SEQ, N_SAMPLES, PER_RANK, STEPS, LR = 64, 12, 16, 4, 2, 0.1
TOL = 1e-5  # fp32 parity, relative
ENV = {
    "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
    "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
    "PARALLELISM_CONFIG_TP_SIZE": "2",
}
"""What `accelerate launch` sets from a config file's parallelism_config (dp_shard 2, tp 2)."""


def data() -> TensorDataset:
    return lm_data(VOCAB, SEQ, N_SAMPLES, seed=3)


def train(parallelism_config) -> dict:
    torch.manual_seed(0)
    initial = GPT()
    model = copy.deepcopy(initial)
    acc = FSDP2Accelerator(
        fsdp_plugin=FSDP2Plugin(wrap_policy=["TPBlock"], tensor_parallel_plan=PLAN),
        parallelism_config=parallelism_config,
    )
    model, opt, loader = acc.prepare(
        model, torch.optim.SGD(model.parameters(), lr=LR), DataLoader(data(), batch_size=PER_RANK, shuffle=False)
    )
    rows_seen = []
    for step, (rows, idx, target) in enumerate(loader):
        if step == STEPS:
            break
        rows_seen.append(rows.tolist())
        opt.zero_grad()
        acc.backward(lm_loss(model, idx, target))
        opt.step()
    per_rank = gather(rows_seen)
    steps = [sorted({r for rank in per_rank for r in rank[s]}) for s in range(STEPS)]
    mesh = acc.state.device_mesh
    q = model.blocks[0].attn.q.weight
    return {
        "max_rel_diff": max_rel_diff(full_params(model), sgd_reference(initial, data(), steps, LR)),
        "global_batch_sizes": [len(s) for s in steps],
        "tp_group_same_rows": all(
            per_rank[r] == per_rank[r ^ 1] for r in range(len(per_rank))
        ),  # tp pairs (0,1), (2,3)
        "mesh": [list(mesh.mesh_dim_names), list(mesh.shape)],
        "config": [
            acc.fsdp2_config.tensor_parallel_size,
            list(acc.fsdp2_config.mesh_shape),
            acc.fsdp2_config.sharding_strategy,
        ],
        "q_mesh_ndim": q.device_mesh.ndim if isinstance(q, DTensor) else 0,
        "plan": str(f2.sharding_plan(model)),
    }


def flow_env() -> dict:
    os.environ.update(ENV)
    try:
        return train(None)
    finally:
        for name in ENV:
            os.environ.pop(name)


def check_dp2_tp2(entry: dict) -> None:
    """dp_shard 2 x tp 2 equals one process, and the sizes became the config and the mesh."""
    check = Checks(entry)
    check.equal("2 data-parallel ranks x 4: global batches of 8", entry["global_batch_sizes"], [8, 8])
    check.that("both ranks of a TP group get one batch", entry["tp_group_same_rows"])
    check.below("parameters equal one process's (relative)", entry["max_rel_diff"], TOL)
    check.equal("config: tp 2, mesh (2,), FULL_SHARD", entry["config"], [2, [2], "FULL_SHARD"])
    check.equal("mesh dp_shard x tp = 2 x 2", entry["mesh"], [["dp_shard", "tp"], [2, 2]])
    check.equal("q is a 2-D DTensor", entry["q_mesh_ndim"], 2)
    check.that("the plan has colwise and rowwise layers", "colwise" in entry["plan"] and "rowwise" in entry["plan"])


def as_object(entry: dict, work: Path) -> None:
    entry.update(train(ParallelismConfig(dp_shard_size=2, tp_size=2)))
    check_dp2_tp2(entry)


as_object.__name__ = "object"  # the flow's name in the report


def env(entry: dict, work: Path) -> None:
    entry.update(flow_env())
    check_dp2_tp2(entry)


def errors(entry: dict, work: Path) -> None:
    check = Checks(entry)
    entry["cp"] = check.raises(
        "cp is refused naming cp_size",
        lambda: FSDP2Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, cp_size=2)),
        ValueError,
        "cp_size=2",
        "cp_size=1",
    )
    entry["product"] = check.raises(
        "a wrong product is refused naming the sizes and processes",
        lambda: FSDP2Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=1, tp_size=2)),
        ValueError,
        "dp_shard_size=1",
        "tp_size=2",
        "4 processes",
    )


def main(out: str) -> None:
    run_flows([as_object, env, errors], out, Path(out).parent)  # every rank writes its report (OUT.rankN.json)
    f2.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])

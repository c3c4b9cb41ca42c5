"""Accelerate's ParallelismConfig on 4 CPU ranks (torchrun): dp_shard=2 x tp=2 through
`FSDP2Accelerator` equals one process, given as an object and as the environment `accelerate
launch` sets from a config file; Accelerate's own context-parallel recipe (dp_shard=2 x cp=2,
`maybe_context_parallel`) on a Hugging Face Llama equals one process on whole sequences;
unsupported sizes are refused with the field named.

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
from helpers.models import lm_data, lm_loss, sgd_reference, tiny_llama
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


CP_SEQ, CP_ROWS, CP_STEPS = 256, 2, 2


def packed_sequences(step: int, rows: int) -> dict[str, torch.Tensor]:
    """`rows` packed training sequences, as Accelerate's recipe feeds them: pre-shifted labels (every
    token has a target) and position ids."""
    g = torch.Generator().manual_seed(50 + step)
    tokens = torch.randint(3, VOCAB, (rows, CP_SEQ + 1), generator=g)
    ids = tokens[:, :-1].contiguous()
    return {
        "input_ids": ids,
        "labels": ids.clone(),
        "shift_labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(CP_SEQ).expand(rows, CP_SEQ).contiguous(),
    }


class PackedDataset(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 2 * CP_ROWS * CP_STEPS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        batch = packed_sequences(i // (2 * CP_ROWS), 2 * CP_ROWS)
        return {k: v[i % (2 * CP_ROWS)] for k, v in batch.items()}


def llama():
    return tiny_llama(
        VOCAB, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CP_SEQ, attn_implementation="sdpa"
    )


def cp_reference() -> dict[str, torch.Tensor]:
    """One process on whole sequences: each step's global batch (both data-parallel groups' rows)."""
    model = llama()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(CP_STEPS):
        model(**packed_sequences(step, 2 * CP_ROWS)).loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def cp_recipe(entry: dict, work: Path) -> None:
    """Accelerate's own context-parallel recipe, FSDP2Accelerator in place of Accelerator."""
    check = Checks(entry)
    acc = FSDP2Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, cp_size=2))
    model = llama()
    model, opt, loader = acc.prepare(
        model, torch.optim.SGD(model.parameters(), lr=LR), DataLoader(PackedDataset(), batch_size=CP_ROWS)
    )
    shapes = []
    for batch in loader:
        buffers = [batch["input_ids"], batch["labels"], batch["shift_labels"], batch["position_ids"]]
        with acc.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1, 1], no_restore_buffers=set(buffers)):
            shapes.append(list(batch["input_ids"].shape))
            acc.backward(model(**batch).loss)
        opt.step()
        opt.zero_grad()
    mesh = acc.state.device_mesh
    check.equal(
        "mesh dp_shard x cp = 2 x 2", [list(mesh.mesh_dim_names), list(mesh.shape)], [["dp_shard", "cp"], [2, 2]]
    )
    check.equal("each rank holds half of every sequence", shapes, [[CP_ROWS, CP_SEQ // 2]] * CP_STEPS)
    check.below(
        "parameters equal one process on whole sequences (relative)",
        max_rel_diff(full_params(model), cp_reference()),
        TOL,
    )


def errors(entry: dict, work: Path) -> None:
    check = Checks(entry)
    entry["sp"] = check.raises(
        "sp is refused naming sp_size",
        lambda: FSDP2Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, sp_size=2)),
        ValueError,
        "sp_size=2",
        "sp_size=1",
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
    run_flows(
        [as_object, env, cp_recipe, errors], out, Path(out).parent
    )  # every rank writes its report (OUT.rankN.json)
    f2.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])

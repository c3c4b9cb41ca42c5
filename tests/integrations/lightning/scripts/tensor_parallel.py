"""Lightning 2 dp x 2 tp on 4 CPU ranks (torchrun): a LightningModule written for
`ModelParallelStrategy`'s tensor parallelism run with `FSDP2Strategy` instead, and the same
model with no hand-written TP but `tensor_parallel_plan`; both against one process.

Each flow checks on every rank (`helpers.checks.Checks`) that the parameters after the steps equal a
one-process run on the same global batches, what the mesh and parameters look like, and that the
sharding plan shows the TP styles; every rank writes its report (`helpers.collect.run_flows`), and
tests/integrations/lightning/test_lightning_tp.py reports the failed checks.

    PYTHONPATH=tests torchrun --nproc_per_node=4 tests/integrations/lightning/scripts/tensor_parallel.py OUT.json
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from common import full_params, gather, max_rel_diff, trainer
from helpers.checks import Checks
from helpers.collect import run_flows
from helpers.models import (
    TP_PLAN,
    lm_data,
    lm_loss,
    sgd_reference,
)
from helpers.models import TPGPT as GPT
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

import fsdp2_strategy as f2
from fsdp2_strategy.integrations.lightning import FSDP2Strategy

VOCAB, SEQ, N_SAMPLES, BATCH, STEPS, LR = 64, 12, 16, 4, 2, 0.1  # BATCH per data-parallel rank
TOL = 1e-5  # fp32 parity, relative
PLAN = {f"model.{glob}": style for glob, style in TP_PLAN.items()}
"""Module-name globs relative to the LightningModule (the GPT is its `model`)."""


class LitGPT(pl.LightningModule):
    """Plain: no configure_model (the strategy's `tensor_parallel_plan` does TP)."""

    def __init__(self, initial: GPT):
        super().__init__()
        self.model = copy.deepcopy(initial)
        self.seen: dict = {}
        self.rows: list[list[int]] = []  # dataset rows of each step on this rank

    def training_step(self, batch, batch_idx):
        rows, idx, target = batch
        self.rows.append(rows.tolist())
        if not self.seen:
            w = self.model.blocks[0].attn.q.weight
            self.seen = {
                "q_mesh_dims": list(w.device_mesh.mesh_dim_names or ()) if isinstance(w, DTensor) else None,
                # (dp, tp) placements of a column-wise weight: dim 0 split over tp, then over dp.
                "q_dim0_over_dp_and_tp": isinstance(w, DTensor)
                and all(getattr(p, "dim", None) == 0 for p in w.placements),  # Shard or FSDP's _StridedShard
                "mesh_dims": list(self.device_mesh.mesh_dim_names),
                "mesh_shape": list(self.device_mesh.shape),
            }
        return lm_loss(self.model, idx, target)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


class LitGPTHandTP(LitGPT):
    """Written for ModelParallelStrategy, as Lightning's TP docs do: TP on the "tensor_parallel"
    sub-mesh, then `fully_shard` of each block on the "data_parallel" one, in configure_model."""

    def configure_model(self):
        tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            parallelize_module(
                block,
                tp_mesh,
                {
                    "attn.q": ColwiseParallel(),
                    "attn.k": ColwiseParallel(),
                    "attn.v": ColwiseParallel(),
                    "attn.proj": RowwiseParallel(),
                    "mlp.0": ColwiseParallel(),
                    "mlp.2": RowwiseParallel(),
                },
            )
            fully_shard(block, mesh=dp_mesh)


def data() -> TensorDataset:
    return lm_data(VOCAB, SEQ, N_SAMPLES, seed=7)


def global_batches(module: LitGPT) -> list[list[int]]:
    """Per step, the sorted rows of the global batch (ranks of one TP group saw the same rows)."""
    per_rank = gather(module.rows)
    return [sorted({r for rank in per_rank for r in rank[s]}) for s in range(len(module.rows))]


def run(module: LitGPT, strategy: FSDP2Strategy, initial: GPT, styles: tuple[str, ...], out: dict) -> None:
    """Fit `module` 2 x 2 and check it against one process; the plan must show each of `styles`."""
    check = Checks(out)
    t = trainer(strategy=strategy, devices=4, max_steps=STEPS)
    t.fit(module, DataLoader(data(), batch_size=BATCH, shuffle=True))
    got = full_params(module)  # collective: every rank
    steps = global_batches(module)
    expected = sgd_reference(initial, data(), steps, LR, prefix="model.")
    params = list(module.parameters())
    out.update(
        {
            **module.seen,
            "max_rel_diff": max_rel_diff(got, expected),
            "global_batch_sizes": [len(rows) for rows in steps],
            "same_names": sorted(got) == sorted(expected),
            "tp_weights_2d": all(
                isinstance(m.weight, DTensor) and m.weight.device_mesh.ndim == 2
                for b in module.model.blocks
                for m in (b.attn.q, b.attn.k, b.attn.v, b.attn.proj, b.mlp[0], b.mlp[2])
            ),
            "params_dtensor": all(isinstance(p, DTensor) for p in params),
            "plan": str(f2.sharding_plan(module)),
            "dp_size": strategy.distributed_sampler_kwargs["num_replicas"],
        }
    )
    check.that("the same parameter names as one process", out["same_names"])
    check.equal("2 dp ranks x 4 samples, 2 steps", out["global_batch_sizes"], [8, 8])
    check.below("parameters equal one process's (relative)", out["max_rel_diff"], TOL)
    check.equal("Lightning's mesh dims", out["mesh_dims"], ["data_parallel", "tensor_parallel"])
    check.equal("Lightning's mesh shape", out["mesh_shape"], [2, 2])
    check.equal("the sampler splits data over the data-parallel dim only", out["dp_size"], 2)
    check.that("every parameter a DTensor", out["params_dtensor"])
    check.that("TP weights on the 2-D mesh (FSDP over dp on top of TP)", out["tp_weights_2d"])
    check.that("column-wise q: dim 0 split over tp, then again over dp", out["q_dim0_over_dp_and_tp"])
    for style in styles:
        check.that(f"the sharding plan shows {style!r}", style in out["plan"], out["plan"])


def main(out: str) -> None:
    torch.manual_seed(0)
    initial = GPT()

    def hand_tp(entry: dict, work: Path) -> None:
        """The module's own TP, left as it was: the plan shows it as the user's."""
        strategy = FSDP2Strategy(data_parallel_size=2, tensor_parallel_size=2)
        run(LitGPTHandTP(initial), strategy, initial, ("user",), entry)

    def plan(entry: dict, work: Path) -> None:
        strategy = FSDP2Strategy(tensor_parallel_size=2, tensor_parallel_plan=PLAN)
        run(LitGPT(initial), strategy, initial, ("colwise", "rowwise"), entry)

    run_flows([hand_tp, plan], out, Path(out).parent)  # every rank writes its report (OUT.rankN.json)
    f2.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])

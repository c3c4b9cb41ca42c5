"""Fit a tiny LightningModule with Trainer(strategy="fsdp2") under torchrun; write checks to JSON.

Usage: python -m torch.distributed.run --standalone --nproc_per_node=2 fit_fsdp2.py OUT.json
"""

import copy
import json
import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import fsdp2_strategy as f2
from fsdp2_strategy.integrations.lightning import FSDP2Strategy

LR = 0.1
BATCH = 4  # per rank; the global batch is BATCH * world size


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class LitMLP(pl.LightningModule):
    """A plain LightningModule: no configure_model, layers built in __init__."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(Block(16) for _ in range(3))
        self.out = nn.Linear(16, 1)
        self.seen = {}

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)

    def training_step(self, batch, batch_idx):
        if not self.seen:
            self.seen = {
                "block_params_dtensor": [isinstance(p, DTensor) for p in self.blocks.parameters()],
                "optimizer_params_dtensor": [
                    isinstance(p, DTensor) for g in self.trainer.optimizers[0].param_groups for p in g["params"]
                ],
                "plan_groups": [g.name for g in f2.sharding_plan(self).groups],
                "mesh_dims": list(self.device_mesh.mesh_dim_names),
                "mesh_shape": list(self.device_mesh.shape),
                "strategy": type(self.trainer.strategy).__name__,
            }
        idx, x, y = batch
        self.seen.setdefault("indices", idx.tolist())
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def data():
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.arange(32), torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))


def reference(initial: nn.Module, indices: list) -> dict:
    """One SGD step of a single process on the global batch the ranks shared (equal halves, mean loss)."""
    model = copy.deepcopy(initial)
    _, xs, ys = data().tensors
    x, y = xs[indices], ys[indices]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def trainer(strategy, steps):
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def main(out_path: str) -> None:
    torch.manual_seed(0)
    model = LitMLP()
    initial = copy.deepcopy(model)
    fit = trainer("fsdp2", 1)
    fit.fit(model, DataLoader(data(), batch_size=BATCH))
    # Lightning's injected DistributedSampler shuffles training data (seed 0): ask the ranks.
    per_rank = [None] * fit.world_size
    torch.distributed.all_gather_object(per_rank, model.seen["indices"])
    # full_tensor() is a collective: every rank gathers.
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}
    result = dict(model.seen, world=fit.world_size, per_rank_indices=per_rank, root_is_fsdp=isinstance(model, torch.distributed.fsdp.FSDPModule))
    if fit.global_rank == 0:
        ref = reference(initial, [i for idx in per_rank for i in idx])
        result["max_rel_diff"] = {
            n: ((full[n] - ref[n]).norm() / ref[n].norm()).item() for n in full
        }
        result["changed"] = any(not torch.equal(full[n], initial.state_dict()[n]) for n in full)

    try:
        trainer(FSDP2Strategy(wrap_policy=["Blok"]), 1).fit(LitMLP(), DataLoader(data(), batch_size=BATCH))
        result["typo_error"] = None
    except ValueError as exc:
        result["typo_error"] = str(exc)

    if fit.global_rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    f2.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])

"""Shared pieces of the Lightning flow scripts: a small LightningModule, data, references."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import torch
from helpers.collect import full_params, gather, max_rel_diff  # noqa: F401
from helpers.models import add_mlp_layers, mlp_forward
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import fsdp2_strategy.integrations.lightning  # noqa: F401  registers "fsdp2"

LR = 0.1
N_SAMPLES = 32


class LitMLP(pl.LightningModule):
    """A plain LightningModule: layers built in __init__, SGD (or Adam), records what it sees."""

    def __init__(self, optimizer: str = "sgd", lr: float = LR):
        super().__init__()
        self.save_hyperparameters()
        add_mlp_layers(self)  # inp, blocks (the wrap policy's groups), out: as `helpers.models.MLP`
        self.losses: list[float] = []
        self.indices: list[list[int]] = []
        self.seen: dict = {}

    def forward(self, x):
        return mlp_forward(self, x)

    def training_step(self, batch, batch_idx):
        idx, x, y = batch
        out = self(x)
        if not self.seen:
            self.seen = {
                "out_dtype": str(out.dtype),
                "input_dtype": str(x.dtype),
                "target_dtype": str(y.dtype),  # the batch as the step received it
                "param_dtypes": sorted({str(p.dtype) for p in self.parameters()}),
                "block_params_dtensor": [isinstance(p, DTensor) for p in self.blocks.parameters()],
                "optimizer_params_dtensor": [
                    isinstance(p, DTensor) for g in self.trainer.optimizers[0].param_groups for p in g["params"]
                ],
                "mesh_dims": list(self.device_mesh.mesh_dim_names),
                "mesh_shape": list(self.device_mesh.shape),
                "strategy": type(self.trainer.strategy).__name__,
            }
        # y.float(): under "bf16-true" Lightning casts the whole batch, targets too, and torch 2.11's
        # mse_loss backward fails on mixed dtypes ("Found dtype BFloat16 but expected Float", pytorch#94086).
        loss = nn.functional.mse_loss(out.float(), y.float())
        self.losses.append(loss.item())
        self.indices.append(idx.tolist())
        return loss

    def validation_step(self, batch, batch_idx):
        idx, x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y.float(), reduction="sum")
        self.log("val_sum", loss, reduce_fx="sum", sync_dist=True, on_epoch=True)

    def test_step(self, batch, batch_idx):
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        idx, x, _ = batch
        return idx, self(x)

    def configure_optimizers(self):
        if self.hparams.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.hparams.lr * 0.1)
        momentum = 0.9 if self.hparams.optimizer == "momentum" else 0.0  # momentum: fp32 optimizer state to check
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=momentum)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.arange(N_SAMPLES), torch.randn(N_SAMPLES, 8, generator=g), torch.randn(N_SAMPLES, 1, generator=g)
    )


def loader(batch: int, shuffle: bool = True) -> DataLoader:
    return DataLoader(dataset(), batch_size=batch, shuffle=shuffle)


def trainer(strategy="fsdp2", devices=2, **kwargs) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return pl.Trainer(**{**defaults, **kwargs})


def reference_step(initial: nn.Module, indices: list[int], *, clip: tuple | None = None, lr: float = LR):
    """One SGD step of one process on the samples `indices` (mean loss); returns (params, grad norm)."""
    model = copy.deepcopy(initial)
    _, xs, ys = dataset().tensors
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    nn.functional.mse_loss(model(xs[indices]), ys[indices]).backward()
    norm = None
    if clip and clip[0] == "norm":
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip[1]).item()
    elif clip:
        torch.nn.utils.clip_grad_value_(model.parameters(), clip[1])
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norm

"""Resuming a Lightning run on another number of processes (issue 28, section 2): a mid-epoch
checkpoint saved by 1 process continues on 2 and one saved by 2 continues on 1, with an LR
scheduler stepped per optimizer step.

`record(work, name, devices, ckpt=None, resumable=True)` runs one fit of `STEPS` steps (2 epochs of
`STEPS_PER_EPOCH`) and returns, per step it ran: the global step, the learning rate, and the sample
indices of the whole global batch (all ranks); and the final parameters and momentum. The global
batch is `GLOBAL` samples for any world size. Without `ckpt` it also saves a checkpoint every
`EVERY` steps under `work/<name>/`; `checkpoint(work, name)` is the mid-epoch one a resume starts from.
With `resumable=False` the data loader is a plain `DataLoader` (what Lightning cannot resume
mid-epoch: it warns and starts the epoch's data again).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from common import LitMLP, dataset, full_params, gather
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

GLOBAL = 8  # samples per optimizer step, on any number of processes
STEPS_PER_EPOCH = 4  # 32 samples
STEPS = 2 * STEPS_PER_EPOCH
EVERY = 3  # checkpoint every 3 steps: step 6 is in the middle of epoch 1
RESUME_AT = 6


class LitScheduled(LitMLP):
    """LitMLP with SGD + momentum and a scheduler stepped every optimizer step; records the global
    step and learning rate each training step saw."""

    def __init__(self) -> None:
        super().__init__(optimizer="momentum")
        self.steps: list[int] = []
        self.lrs: list[float] = []

    def training_step(self, batch, batch_idx):
        self.steps.append(self.trainer.global_step)
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ResumableLoader(DataLoader):
    """A `DataLoader` Lightning resumes mid-epoch (it has `state_dict`/`load_state_dict`, as
    torchdata's `StatefulDataLoader` does): its state is the number of batches it yielded in the
    current epoch, and the first iteration after `load_state_dict` skips that many. Lightning's
    `DistributedSampler` orders an epoch's samples the same on any number of processes, so with the
    global batch held, skipping k batches on each rank skips the same k global batches anywhere."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.yielded = 0
        self.skip = 0

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip, self.yielded = self.skip, 0, self.skip
        for i, batch in enumerate(super().__iter__()):
            if i >= skip:
                self.yielded += 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip = state["yielded"]


def checkpoint(work: Path, name: str) -> Path:
    """The mid-epoch checkpoint (`RESUME_AT`, in epoch 1) of the recorded run `name`."""
    return work / name / f"epoch=1-step={RESUME_AT}.ckpt"


def _momentum(model: pl.LightningModule) -> dict[str, torch.Tensor]:
    opt = model.trainer.optimizers[0]
    out = {}
    for n, p in model.named_parameters():
        buf = opt.state[p]["momentum_buffer"]
        out[n] = (buf.full_tensor() if isinstance(buf, DTensor) else buf).detach().clone()
    return out


def record(work: Path, name: str, devices: int, ckpt: Path | None = None, resumable: bool = True) -> dict:
    """One fit on `devices` processes (from `ckpt` if given); what each step saw, and the end state."""
    torch.manual_seed(0 if ckpt is None else 7)  # a resumed run gets everything from the checkpoint
    model = LitScheduled()
    cls = ResumableLoader if resumable else DataLoader
    loader = cls(dataset(), batch_size=GLOBAL // devices, shuffle=True)
    callbacks = [] if ckpt else [ModelCheckpoint(dirpath=work / name, every_n_train_steps=EVERY, save_top_k=-1)]
    fit = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="fsdp2",
        max_epochs=STEPS // STEPS_PER_EPOCH,
        logger=False,
        enable_checkpointing=not ckpt,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    fit.fit(model, loader, ckpt_path=ckpt)
    ranks = gather(model.indices) if devices > 1 else [model.indices]
    return {
        "global_steps": model.steps,
        "lrs": model.lrs,
        "samples": [sorted(i for rank in ranks for i in rank[s]) for s in range(len(model.steps))],
        "final_global_step": fit.global_step,
        "params": {k: v.tolist() for k, v in full_params(model).items()},
        "momentum": {k: v.tolist() for k, v in _momentum(model).items()},
    }


def one_process_runs(work: Path) -> dict:
    """single.py train (before the 2-rank flows): the uninterrupted 1-process run that saves the
    checkpoint flows.py resumes on 2, and a plain-loader run resumed mid-epoch (data position lost)."""
    return {
        "one": record(work, "lit_one", 1),
        "plain": record(work, "lit_plain", 1, resumable=False),
        "plain_resumed": record(work, "", 1, checkpoint(work, "lit_plain"), resumable=False),
    }


def resume_other_world_sizes(out: dict, work: Path) -> None:
    """flows.py (2 ranks): the uninterrupted 2-rank run (single.py resume continues its checkpoint on
    1 process), and the 1-process checkpoint continued on 2 ranks."""
    out["two"] = record(work, "lit_two", 2)
    out["from_one"] = record(work, "", 2, checkpoint(work, "lit_one"))

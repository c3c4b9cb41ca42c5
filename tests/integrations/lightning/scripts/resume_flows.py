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

`one_and_two_agree` and `check_resumed` are the named checks comparing such records; each launch
checks the runs it made against those of the launches before it (single.py train -> flows.py ->
single.py resume).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from common import LitMLP, dataset, full_params, gather, max_rel_diff
from helpers.checks import Checks
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

TOL = 1e-5  # fp32 parity, relative
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


def state_rel(a: dict, b: dict) -> float:
    """Largest relative difference of parameters and momentum between two `record`s."""
    return max(
        max_rel_diff({k: torch.tensor(v) for k, v in a[part].items()}, {k: torch.tensor(v) for k, v in b[part].items()})
        for part in ("params", "momentum")
    )


def one_and_two_agree(check: Checks, one: dict, two: dict) -> None:
    """The uninterrupted runs on 1 process and on 2 ranks saw the same global batches and learning rates."""
    check.equal("1 process and 2 ranks: the same global batches", one["samples"], two["samples"])
    check.equal("1 process and 2 ranks: the same learning rates", one["lrs"], two["lrs"])
    check.equal("8 different global batches over the 2 epochs", len({tuple(s) for s in one["samples"]}), 8)


def check_resumed(check: Checks, label: str, resumed: dict, uninterrupted: dict) -> None:
    """`resumed` (from the mid-epoch checkpoint at step `RESUME_AT`) continued as `uninterrupted` did."""
    check.equal(f"{label}: resumed at global steps 6, 7", resumed["global_steps"], [6, 7])
    check.equal(
        f"{label}: the uninterrupted run's steps after 6 are 6, 7", uninterrupted["global_steps"][RESUME_AT:], [6, 7]
    )
    # StepLR(gamma=0.8), stepped every optimizer step.
    check.equal(f"{label}: the uninterrupted run's learning rates", resumed["lrs"], uninterrupted["lrs"][RESUME_AT:])
    check.equal(f"{label}: the uninterrupted run's samples", resumed["samples"], uninterrupted["samples"][RESUME_AT:])
    check.equal(f"{label}: final global step 8", resumed["final_global_step"], 8)
    check.equal(f"{label}: the uninterrupted run's final global step is 8", uninterrupted["final_global_step"], 8)
    check.below(
        f"{label}: the uninterrupted run's parameters and momentum (relative)", state_rel(resumed, uninterrupted), TOL
    )


def other_world_sizes(out: dict, work: Path) -> None:
    """single.py train (before the 2-rank flows): the uninterrupted 1-process run that saves the
    checkpoint flows.py resumes on 2 (flows.py compares the two)."""
    out["one"] = record(work, "lit_one", 1)


def plain_loader_resume(out: dict, work: Path) -> None:
    """single.py train: a plain-loader run resumed mid-epoch. What the docs warn about: a plain
    DataLoader has no position to restore, so Lightning (with a warning) starts epoch 1's data again:
    global step and learning rate are right, the samples are those of the epoch's first batches, and
    its last two batches are never seen."""
    check = Checks(out)
    out["plain"] = plain = record(work, "lit_plain", 1, resumable=False)
    out["plain_resumed"] = resumed = record(work, "", 1, checkpoint(work, "lit_plain"), resumable=False)
    check.equal("resumed at global steps 6, 7", resumed["global_steps"], [6, 7])
    check.equal("the uninterrupted run's learning rates", resumed["lrs"], plain["lrs"][RESUME_AT:])
    check.equal("the samples of epoch 1's first two batches", resumed["samples"], plain["samples"][4:6])
    check.that(
        "epoch 1's first two batches are not its last two",
        plain["samples"][4:6] != plain["samples"][6:],
        plain["samples"][4:],
    )

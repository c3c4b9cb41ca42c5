"""Resuming an Accelerate run on another number of processes (issue 28, section 2), the way a user's
loop does it: `load_state` restores model, optimizer, scheduler and the objects registered with
`register_for_checkpointing` (here `Progress`: optimizer steps and samples consumed); the loop then
finds its place in the data itself (`set_epoch` and `skip_first_batches`, which Accelerate leaves
to the user) from the samples consumed, a count that means the same on any number of processes.

`record(work, name, ckpt=None, split=True)` runs (or resumes) 2 epochs of the 32-sample data set
and returns, per optimizer step: the step, the samples consumed before it, the learning rate and
the sample indices of the whole global batch; and the final parameters and momentum. Without
`ckpt` it saves `work/<name>` once `SAVE_AT` samples are consumed (in the middle of epoch 1).

- `split=True` (`DataLoaderConfiguration(split_batches=True)`): the loader's batch is the global
  batch (8) on any number of processes, the scheduler steps once per optimizer step: a resume on
  another number of processes continues the uninterrupted run exactly.
- `split=False` (Accelerate's default): the batch (4) is per process, so the global batch is 4 x
  processes and Accelerate steps the scheduler once per process per optimizer step; a resume on
  another number of processes continues the data and the schedule at the same sample, but trains
  with another global batch (it cannot equal either uninterrupted run).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from accelerate.utils import DataLoaderConfiguration
from common import all_indices, dataset, fresh, full, full_params, lm_loss, max_rel_diff
from helpers.checks import Checks
from helpers.untrusted import plant
from torch.utils.data import DataLoader

import fsdp2_strategy as f2
from fsdp2_strategy.integrations.accelerate import FSDP2Accelerator, FSDP2Plugin

EPOCHS = 2
SAVE_AT = 48  # samples: step 6 of 8 with a global batch of 8, in the middle of epoch 1
DATA_SEED = 1234  # the sampler's order must not depend on the model's seed
TOL = 1e-5  # fp32 parity, relative
EARLIER: dict = {}
"""Rank 0's report of the fsdp2.yaml launch (flows.py's EARLIER argument), for `resume_from_one`."""


class Progress:
    """What the training loop keeps beside model and optimizer (`register_for_checkpointing`)."""

    def __init__(self) -> None:
        self.step = 0
        self.samples = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "samples": self.samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.samples = state["step"], state["samples"]


def record(work: Path, name: str, ckpt: Path | None = None, split: bool = True) -> dict:
    """One run (from `ckpt` if given): what each optimizer step saw, and the end state."""
    config = DataLoaderConfiguration(split_batches=split, use_seedable_sampler=True, data_seed=DATA_SEED)
    acc = FSDP2Accelerator(fsdp_plugin=FSDP2Plugin(), mixed_precision="no", dataloader_config=config)
    model, _ = fresh(0 if ckpt is None else 99)  # a resumed run gets everything from the checkpoint
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    loader = DataLoader(dataset(), batch_size=8 if split else 4, shuffle=True)
    model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    progress = Progress()
    acc.register_for_checkpointing(progress)
    if ckpt is not None:
        acc.load_state(ckpt)
    # Where to continue: the samples consumed, in this run's global batches (`total_batch_size`).
    start_epoch, skip = divmod(progress.samples // loader.total_batch_size, len(loader))
    out: dict = {"steps": [], "positions": [], "lrs": [], "samples": [], "processes": acc.num_processes}
    for epoch in range(start_epoch, EPOCHS):
        loader.set_epoch(epoch)  # the sampler's epoch (its order), which load_state does not restore
        batches = acc.skip_first_batches(loader, skip) if epoch == start_epoch and skip else loader
        for idx, x, y in batches:
            out["steps"].append(progress.step)
            out["positions"].append(progress.samples)
            out["lrs"].append(sched.get_last_lr()[0])
            out["samples"].append(sorted(all_indices(idx.tolist())))
            acc.backward(lm_loss(model, x, y))
            opt.step()
            sched.step()
            opt.zero_grad()
            progress.step += 1
            progress.samples += loader.total_batch_size
            if name and progress.samples == SAVE_AT:
                acc.save_state(work / name)
    out["params"] = {k: v.tolist() for k, v in full_params(model).items()}
    state = opt.optimizer.state
    out["momentum"] = {n: full(state[p]["momentum_buffer"]).tolist() for n, p in model.named_parameters()}
    return out


def state_rel(a: dict, b: dict) -> float:
    """Largest relative difference of parameters and momentum between two `record`s."""
    return max(
        max_rel_diff({k: torch.tensor(v) for k, v in a[part].items()}, {k: torch.tensor(v) for k, v in b[part].items()})
        for part in ("params", "momentum")
    )


def check_resumed(check: Checks, what: str, resumed: dict, uninterrupted: dict) -> None:
    """split_batches=True: the resumed steps (6 and 7) have the step numbers, learning rates and samples of
    the uninterrupted run, and end with its parameters and momentum."""
    check.equal(f"{what}: the resumed steps are 6 and 7", resumed["steps"], [6, 7])
    check.equal(
        f"{what}: the step numbers continue the uninterrupted run", resumed["steps"], uninterrupted["steps"][6:]
    )
    check.equal(f"{what}: the learning rates continue the uninterrupted run", resumed["lrs"], uninterrupted["lrs"][6:])
    check.equal(f"{what}: the samples continue the uninterrupted run", resumed["samples"], uninterrupted["samples"][6:])
    check.below(
        f"{what}: parameters and momentum equal the uninterrupted run's", state_rel(resumed, uninterrupted), TOL
    )


def resume_on_two(out: dict, work: Path) -> None:
    """flows.py (2 processes, before resume.py): the uninterrupted runs whose checkpoints resume.py
    continues on one process."""
    out["two"] = record(work, "acc_two")
    out["two_default"] = record(work, "acc_two_default", split=False)
    check = Checks(out)
    check.equal("split batches: 2 processes", out["two"]["processes"], 2)
    check.equal(
        "per-process batches: 8 samples a step on 2 processes", out["two_default"]["positions"], list(range(0, 64, 8))
    )


def one_process(work: Path, two: dict) -> dict:
    """resume.py (one process): 2 -> 1 for both batch modes, and the uninterrupted 1-process runs
    (one saves the checkpoint the 2-process variant world continues: 1 -> 2), checked against `two`,
    the 2-process runs (`resume_on_two`'s report entry)."""
    out = {
        "one": record(work, "acc_one"),
        "from_two": record(work, "", work / "acc_two"),
        "one_default": record(work, "", split=False),
        "from_two_default": record(work, "", work / "acc_two_default", split=False),
    }
    check = Checks(out)
    one, from_two = out["one"], out["from_two"]
    check.equal("split batches: 1 process, also resumed", [one["processes"], from_two["processes"]], [1, 1])
    # The same global batches on any number of processes.
    check.equal("split batches: the samples of 1 and 2 processes are alike", one["samples"], two["two"]["samples"])
    check.equal("split batches: the learning rates of 1 and 2 processes are alike", one["lrs"], two["two"]["lrs"])
    check.equal("8 different global batches", len({tuple(s) for s in one["samples"]}), 8)
    check.equal("8 optimizer steps", one["steps"], list(range(8)))
    check_resumed(check, "2 -> 1", from_two, one)
    # Accelerate's default (split_batches=False): a batch of 4 per process, so 8 per step on 2 and 4 on 1,
    # and the scheduler steps once per process per optimizer step. 2 -> 1 from sample 48 continues at
    # sample 48 with the learning rate and samples the uninterrupted 1-process run had at each sample
    # position (it trains with the smaller global batch, so its parameters follow neither run).
    one, resumed = out["one_default"], out["from_two_default"]
    check.equal("per-process batches: 4 samples a step on 1 process", one["positions"], list(range(0, 64, 4)))
    check.equal("per-process batches: 2 -> 1 continues at sample 48", resumed["positions"], [48, 52, 56, 60])
    at = {pos: [lr, samples] for pos, lr, samples in zip(one["positions"], one["lrs"], one["samples"])}
    check.equal(
        "per-process batches: the learning rates and samples of each sample position",
        [[lr, samples] for lr, samples in zip(resumed["lrs"], resumed["samples"])],
        [at.get(pos) for pos in resumed["positions"]],
    )
    check.equal(
        "per-process batches: the 2-process scheduler stepped twice per step",
        two["two_default"]["lrs"][6],
        one["lrs"][12],
    )
    return out


def resume_from_one(out: dict, work: Path) -> None:
    """flows.py in the variant world (2 processes, after resume.py; its WORKDIR is a folder inside the
    first world's): 1 -> 2, onto that world's other layout (size-based wrap, offload, no reshard),
    checked against the first world's uninterrupted 2-process run (`EARLIER`)."""
    out["from_one"] = record(work, "", work.parent / "acc_one")
    check = Checks(out)
    check.equal("1 -> 2: 2 processes", out["from_one"]["processes"], 2)
    check_resumed(check, "1 -> 2", out["from_one"], EARLIER["resume_on_two"]["two"])
    untrusted_state(out, work, check)


def untrusted_state(out: dict, work: Path, check: Checks) -> None:
    """The 1-process checkpoint with a `register_for_checkpointing` state that runs code when unpickled
    (checksums rewritten to match): load_state refuses it on every rank naming the file, runs nothing and
    changes nothing (Accelerate's own load_custom_state would run it); load_kwargs={"weights_only": False}
    (the user trusts it) loads it."""
    copy, marker = work / "acc_untrusted", work / "acc_untrusted_ran"
    if torch.distributed.get_rank() == 0:
        shutil.copytree(work.parent / "acc_one", copy)
        plant(copy / "custom_checkpoint_0.pkl", marker)
    torch.distributed.barrier()
    acc = FSDP2Accelerator(fsdp_plugin=FSDP2Plugin(), mixed_precision="no")
    model, _ = fresh(99)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    progress = Progress()
    acc.register_for_checkpointing(progress)
    before = full_params(model)
    out["untrusted_error"] = check.raises(
        "a registered state that runs code is refused, naming the file, the type and the switch",
        lambda: acc.load_state(copy),
        f2.UntrustedCheckpointError,
        "custom_checkpoint_0.pkl",
        "system",
        "weights_only",
    )
    out["untrusted_ran"], out["untrusted_changed"] = marker.exists(), max_rel_diff(full_params(model), before)
    check.that("the payload did not run", not out["untrusted_ran"])
    check.equal("the model and the registered state are unchanged", [out["untrusted_changed"], progress.step], [0, 0])
    torch.distributed.barrier()
    acc.load_state(copy, load_kwargs={"weights_only": False})
    out["trusted"] = [marker.exists(), progress.step]
    check.equal("weights_only=False loads it (and so runs it: the user trusted it)", out["trusted"], [True, 6])

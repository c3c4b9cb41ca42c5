"""One-process Lightning runs (devices=1, global batch 8 = 2 ranks x 4) for the resharding tests; each
flow checks what it claims (`helpers.checks.Checks`), against the launches before it where it says so.

single.py train  OUT.json WORKDIR                          reference run of 2 epochs + a 1-epoch checkpoint;
                                                           the 1-process runs of resume_flows (mid-epoch
                                                           checkpoints), the plain loader's resume checked
single.py resume OUT.json CKPT FLOWS.rank0.json SINGLE.rank0.json
                                                           load_from_checkpoint(CKPT) and Lightning's own
                                                           readers of it against flows.py's saved weights,
                                                           then resume fit from it (2 -> 1); the 2-rank
                                                           mid-epoch checkpoint continued (2 -> 1) against
                                                           single.py train's uninterrupted run

The report is written through `helpers.collect.run_flows` (OUT.rank0.json: one process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from common import LitMLP, full_params, loader, max_rel_diff, trainer
from helpers.checks import Checks
from helpers.collect import run_flows
from lightning.pytorch.callbacks import ModelCheckpoint
from resume_flows import TOL, check_resumed, checkpoint, other_world_sizes, plain_loader_resume, record

import fsdp2_strategy as f2

BATCH = 8


def reference(out: dict, work: Path) -> None:
    """The uninterrupted 2-epoch run flows.py compares its 2-rank losses with, and a 1-epoch checkpoint
    flows.py resumes on 2 ranks (raw values: flows.py checks them)."""
    torch.manual_seed(0)
    ref = LitMLP(optimizer="adam")
    trainer(devices=1, max_epochs=2).fit(ref, loader(BATCH))
    torch.manual_seed(0)
    first = LitMLP(optimizer="adam")
    callback = ModelCheckpoint(dirpath=work / "single_ckpts", save_top_k=-1)
    trainer(devices=1, max_epochs=1, enable_checkpointing=True, callbacks=[callback]).fit(first, loader(BATCH))
    out["ref_losses"] = ref.losses
    out["params"] = {k: v.tolist() for k, v in full_params(ref).items()}


def _run(*args: object) -> None:
    """Run a command-line tool in this process's environment; fail with the end of its output."""
    proc = subprocess.run(
        [sys.executable, *map(str, args)], capture_output=True, text=True, timeout=120, env=os.environ
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{args} exited with code {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


def load_from_checkpoint(out: dict, work: Path) -> None:
    """One process, no trainer: LitMLP.load_from_checkpoint(CKPT) reads the 2-rank sharded directory with
    its weights gathered (those flows.py saved), and so does Lightning's own reader of sharded checkpoints."""
    check = Checks(out)
    loaded = LitMLP.load_from_checkpoint(ARGS["ckpt"])
    saved = {k: torch.tensor(v) for k, v in ARGS["flows"]["checkpoints"]["epoch0_params"].items()}
    out["loaded_diff"] = max_rel_diff({k: v.detach() for k, v in loaded.named_parameters()}, saved)
    # Lightning's own reader of sharded checkpoints (behind its consolidation CLI) reads ours; the
    # model is under FSDPStrategy's key "model" (which that CLI renames to "state_dict").
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    lightning_view = _load_distributed_checkpoint(Path(ARGS["ckpt"]))["model"]
    out["lightning_reader_diff"] = max_rel_diff({k: lightning_view[k] for k in saved}, saved)
    out["loaded_hparams"] = dict(loaded.hparams)
    check.equal("load_from_checkpoint: the saved weights (exactly)", out["loaded_diff"], 0.0)
    check.equal("Lightning's own reader: the saved weights (exactly)", out["lightning_reader_diff"], 0.0)
    check.equal(
        "load_from_checkpoint: the saved hyperparameters", out["loaded_hparams"], {"optimizer": "adam", "lr": 0.1}
    )


def consolidation(out: dict, work: Path) -> None:
    """`python -m lightning.pytorch.utilities.consolidate_checkpoint` (FSDPStrategy's tool) turns the
    2-rank sharded directory into one file the Trainer loads; `fsdp2-strategy consolidate` agrees."""
    from safetensors.torch import load_file

    check = Checks(out)
    expected = {k: torch.tensor(v) for k, v in ARGS["flows"]["checkpoints"]["epoch0_params"].items()}
    merged = work / "consolidated.ckpt"
    _run("-m", "lightning.pytorch.utilities.consolidate_checkpoint", ARGS["ckpt"], "--output_file", merged)
    full = torch.load(merged, weights_only=False)
    state = full["state_dict"]
    check.equal("Lightning's tool: the saved weights' names", sorted(state), sorted(expected))
    differing = sorted(k for k, v in expected.items() if k not in state or not torch.equal(state[k], v))
    check.equal("Lightning's tool: the saved weights (exactly)", differing, [])
    check.equal("Lightning's tool: one optimizer", len(full["optimizer_states"]), 1)
    check.that("Lightning's tool: Adam's moments kept", bool(full["optimizer_states"][0]["state"]))
    check.equal("Lightning's tool: global step 4 (meta.pt merged in)", full["global_step"], 4)
    check.equal("Lightning's tool: epoch 0 (meta.pt merged in)", full["epoch"], 0)
    _run("-m", "fsdp2_strategy.cli", "consolidate", ARGS["ckpt"], work / "hf")
    weights = load_file(str(work / "hf" / "model.safetensors"))
    check.equal("fsdp2-strategy consolidate: the saved weights' names", sorted(weights), sorted(expected))
    differing = sorted(k for k, v in expected.items() if k not in weights or not torch.equal(weights[k], v))
    check.equal("fsdp2-strategy consolidate: the saved weights (exactly)", differing, [])


def resume_from_two_ranks(out: dict, work: Path) -> None:
    """2 -> 1: fit resumed from the 2-rank epoch-0 checkpoint continues as the 2-rank reference; the
    2-rank mid-epoch checkpoint (flows.py's) continues as single.py train's uninterrupted run."""
    check = Checks(out)
    torch.manual_seed(7)
    model = LitMLP(optimizer="adam")
    trainer(devices=1, max_epochs=2).fit(model, loader(BATCH), ckpt_path=ARGS["ckpt"])
    out["losses"] = model.losses
    ref = ARGS["flows"]["checkpoints"]["ref_losses"]
    check.close("2 -> 1: the 2-rank reference's second-epoch losses (relative)", out["losses"], ref[4:], TOL)
    # The mid-epoch checkpoint of flows.py's 2-rank run, continued on one process.
    flows_work = Path(ARGS["flows_path"]).parent
    out["from_two"] = record(flows_work, "", 1, checkpoint(flows_work, "lit_two"))
    check_resumed(check, "2 -> 1", out["from_two"], ARGS["single"]["other_world_sizes"]["one"])


ARGS: dict = {}
"""single.py resume's arguments: the checkpoint, flows.py's and single.py train's reports (rank 0's)."""


def main(command: str, out_path: str, *args: str) -> None:
    if command == "train":
        run_flows([reference, other_world_sizes, plain_loader_resume], out_path, Path(args[0]))
    else:
        ckpt, flows_path, single_path = args
        ARGS.update(
            ckpt=ckpt,
            flows_path=flows_path,
            flows=json.loads(Path(flows_path).read_text()),
            single=json.loads(Path(single_path).read_text()),
        )
        run_flows([load_from_checkpoint, consolidation, resume_from_two_ranks], out_path, Path(flows_path).parent)
    f2.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])

"""`fsdp2-strategy convert-fsdp1 SOURCE TARGET [--optimizer-file FILE] [--step N] [--model SPEC]
[--weights-only] [--no-progress] [--trust]`: an FSDP1 checkpoint (torch, Lightning `FSDPStrategy`, Accelerate;
sharded or full) into a committed step of ours under TARGET (`migrate.convert_fsdp1_checkpoint`)."""

from __future__ import annotations

import argparse
from typing import Any

from ..migrate import convert_fsdp1_checkpoint
from .plan import load_model


def add_parser(sub: Any) -> None:
    cmd = sub.add_parser(
        "convert-fsdp1",
        help="convert an FSDP1 checkpoint (torch, Lightning FSDPStrategy or Accelerate; sharded or full: weights, "
        "optimizer state, scheduler, counters) into a resumable checkpoint of ours, loadable on any number of ranks",
    )
    cmd.add_argument(
        "source",
        help="a DCP folder (torch SHARDED_STATE_DICT, Lightning's sharded checkpoint), an Accelerate save_state "
        "folder, a Lightning .ckpt file, or a full model state dict file (with --optimizer-file)",
    )
    cmd.add_argument("target", help="a Checkpointer root: the result is written as TARGET/step-N")
    cmd.add_argument(
        "--optimizer-file",
        default=None,
        help="with a full model state dict file: the torch.save'd full FSDP.optim_state_dict",
    )
    cmd.add_argument(
        "--step",
        type=int,
        default=None,
        help="step number of the result (default: the trainer's step counter, else the optimizer's step count)",
    )
    cmd.add_argument(
        "--model",
        default=None,
        help="package.module:factory (or a Hugging Face config folder) building the model on meta: its parameter "
        "order names the positions of a Lightning full checkpoint's optimizer state",
    )
    cmd.add_argument(
        "--weights-only", action="store_true", help="write the weights and buffers only, no optimizer state"
    )
    cmd.add_argument("--no-progress", action="store_true", help="no progress bar")
    cmd.add_argument(
        "--trust", action="store_true", help="unpickle any type in the source (a checkpoint you wrote yourself)"
    )


def run(args: argparse.Namespace) -> int:
    model = load_model(args.model, None, None)[0] if args.model else None
    result = convert_fsdp1_checkpoint(
        args.source,
        args.target,
        optimizer_file=args.optimizer_file,
        step=args.step,
        model=model,
        weights_only=args.weights_only,
        progress=not args.no_progress,
        trusted=args.trust,
    )
    print(f"wrote {result}")
    return 0

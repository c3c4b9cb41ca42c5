"""`fsdp2-strategy convert-deepspeed SOURCE TARGET [--tag TAG] [--step N] [--optimizer AdamW|Adam]
[--weights-only] [--no-progress] [--trust]`: a DeepSpeed ZeRO-1/2/3 checkpoint folder into a committed step of
ours under TARGET (`migrate.convert_deepspeed_checkpoint`)."""

from __future__ import annotations

import argparse
from typing import Any

from ..migrate import convert_deepspeed_checkpoint


def add_parser(sub: Any) -> None:
    cmd = sub.add_parser(
        "convert-deepspeed",
        help="convert a DeepSpeed ZeRO-1/2/3 checkpoint (weights, Adam state, LR scheduler, counters) into a "
        "resumable checkpoint of ours, loadable on any number of ranks",
    )
    cmd.add_argument(
        "source", help="the folder DeepSpeed's save_checkpoint wrote (holding 'latest'), or one tag folder"
    )
    cmd.add_argument("target", help="a Checkpointer root: the result is written as TARGET/step-N")
    cmd.add_argument("--tag", default=None, help="the tag folder to convert (default: the one 'latest' names)")
    cmd.add_argument(
        "--step", type=int, default=None, help="step number of the result (default: DeepSpeed's global_steps)"
    )
    cmd.add_argument(
        "--optimizer",
        choices=("Adam", "AdamW"),
        default="AdamW",
        help="the torch optimizer the run resumes with (names the hyperparameters of the saved groups)",
    )
    cmd.add_argument(
        "--weights-only", action="store_true", help="write the weights and buffers only, no optimizer state"
    )
    cmd.add_argument("--no-progress", action="store_true", help="no progress bar")
    cmd.add_argument(
        "--trust", action="store_true", help="unpickle any type in the source (a checkpoint you wrote yourself)"
    )


def run(args: argparse.Namespace) -> int:
    result = convert_deepspeed_checkpoint(
        args.source,
        args.target,
        tag=args.tag,
        step=args.step,
        optimizer=args.optimizer,
        weights_only=args.weights_only,
        progress=not args.no_progress,
        trusted=args.trust,
    )
    print(f"wrote {result}")
    return 0

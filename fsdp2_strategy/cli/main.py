"""`fsdp2-strategy` command line: consolidate, export (PEFT) and inspect sharded checkpoints; plan memory;
tune throughput; translate a DeepSpeed config and convert a DeepSpeed or FSDP1 checkpoint."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from ..checkpoint import export_full, export_peft, inspect_checkpoint
from ..versions import __version__
from . import convert_deepspeed as convert_deepspeed_command
from . import convert_fsdp1 as convert_fsdp1_command
from . import from_deepspeed as from_deepspeed_command
from . import plan as plan_command
from . import tune as tune_command

_COMMAND_MODULES = {
    "plan": plan_command,
    "tune": tune_command,
    "from-deepspeed": from_deepspeed_command,
    "convert-deepspeed": convert_deepspeed_command,
    "convert-fsdp1": convert_fsdp1_command,
}
"""Subcommands defined in a module of their own (`add_parser(sub)` and `run(args)`), by name."""


def _size(text: str) -> int:
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}
    upper = text.strip().upper()
    try:
        for unit, factor in units.items():
            if upper.endswith(unit):
                return int(float(upper[: -len(unit)]) * factor)
        return int(upper)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; use bytes or a number with KB, MB, GB or TB (e.g. 500MB)"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    """The `fsdp2-strategy` parser: every subcommand and option, each with its help text."""
    parser = argparse.ArgumentParser(
        prog="fsdp2-strategy",
        description="fsdp2-strategy's command line: sharded checkpoints (consolidate, export, inspect), "
        "the memory planner (plan), the throughput tuner (tune), a DeepSpeed config translated (from-deepspeed) and a DeepSpeed "
        "checkpoint converted (convert-deepspeed), an FSDP1 checkpoint converted (convert-fsdp1).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}", help="print the version")
    sub = parser.add_subparsers(dest="command", required=True)
    cons = sub.add_parser("consolidate", help="write full weights (Hugging Face safetensors or a torch file)")
    cons.add_argument("checkpoint", help="a DCP directory or a Checkpointer root (latest committed step)")
    cons.add_argument("out", help="output folder")
    cons.add_argument(
        "--format",
        choices=("safetensors", "torch"),
        default="safetensors",
        help="safetensors: Hugging Face files (an index when split); torch: one torch.save file",
    )
    cons.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None, help="convert on export")
    cons.add_argument("--step", type=int, default=None, help="step of a Checkpointer root (default: latest)")
    cons.add_argument("--max-shard-size", type=_size, default="5GB", help="split safetensors above this (e.g. 500MB)")
    exp = sub.add_parser(
        "export",
        help="a PEFT model's adapter (PEFT's format, for PeftModel.from_pretrained) or, with --merged, "
        "the base weights with the LoRA deltas added (for AutoModel...from_pretrained)",
    )
    exp.add_argument("checkpoint", help="a DCP directory or a Checkpointer root (latest committed step)")
    exp.add_argument("out", help="output folder")
    kind = exp.add_mutually_exclusive_group()
    kind.add_argument("--adapter", action="store_true", help="the adapter only (the default)")
    kind.add_argument("--merged", action="store_true", help="merged full weights")
    exp.add_argument("--base", default=None, help="pretrained model folder (merging a trainable-only checkpoint)")
    exp.add_argument("--adapter-name", default="default", help="the PEFT adapter to export (default: 'default')")
    exp.add_argument("--step", type=int, default=None, help="step of a Checkpointer root (default: latest)")
    exp.add_argument("--max-shard-size", type=_size, default="5GB", help="split merged safetensors above this")
    insp = sub.add_parser(
        "inspect",
        help="list steps, tensors, shapes, dtypes and the saving world size; "
        "verify checksums (exit status 1 if a file is damaged)",
    )
    insp.add_argument("checkpoint", help="a DCP directory or a Checkpointer root (every committed step)")
    insp.add_argument("--step", type=int, default=None, help="only this step of a Checkpointer root")
    for module in _COMMAND_MODULES.values():
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.command in _COMMAND_MODULES:
            return _COMMAND_MODULES[args.command].run(args)
        if args.command == "consolidate":
            out = export_full(
                args.checkpoint,
                args.out,
                format=args.format,
                dtype=args.dtype,
                step=args.step,
                max_shard_size=args.max_shard_size,
            )
            print(f"wrote {out}")
        elif args.command == "export":
            out = export_peft(
                args.checkpoint,
                args.out,
                merged=args.merged,
                base=args.base,
                adapter_name=args.adapter_name,
                step=args.step,
                max_shard_size=args.max_shard_size,
            )
            print(f"wrote {out}")
        else:
            info = inspect_checkpoint(args.checkpoint, args.step)
            print(info)
            return 1 if info.problems else 0
    except (OSError, ValueError) as exc:  # bad input or a damaged/unwritable path: a message, not a traceback
        print(f"fsdp2-strategy {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 0

"""`fsdp2-strategy from-deepspeed DS_CONFIG.json [--world-size N] [--out FILE]`: the equivalent
FSDP2Config YAML (what `FSDP2Config.from_yaml`, `FSDP2Plugin(config=...)` and `FSDP2Strategy(config=...)`
read), the trainer settings and the untranslated keys as comments (`migrate.translate_deepspeed`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..migrate import translate_deepspeed


def add_parser(sub: Any) -> None:
    cmd = sub.add_parser(
        "from-deepspeed", help="print the FSDP2Config YAML equivalent to a DeepSpeed config (and what it cannot map)"
    )
    cmd.add_argument(
        "config", help="the DeepSpeed config JSON file (as deepspeed.initialize or TrainingArguments take)"
    )
    cmd.add_argument(
        "--world-size", type=int, default=None, help="processes in all: turns zero_hpz_partition_size into a mesh_shape"
    )
    cmd.add_argument("--out", default=None, help="write the YAML to this file instead of printing it")


def run(args: argparse.Namespace) -> int:
    text = translate_deepspeed(args.config, world_size=args.world_size, warn=False).to_yaml()
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0

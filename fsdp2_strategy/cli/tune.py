"""`fsdp2-strategy tune MODEL`: measure candidate settings on the process group and print the table.

Run it under a launcher on every rank (`torchrun --nproc_per_node=N -m fsdp2_strategy.cli tune ...`;
without one it tunes a single process). MODEL is `package.module:factory`, a callable returning
`(model, example_batch)` or `(model, example_batch, loss_fn)` with real tensors (one rank's
micro-batch), or a Hugging Face config folder (built from the config on the meta device and
initialised per candidate; `--batch-size` and `--seq-len` make a batch of zeros).
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..distributed import init_distributed, rank
from ..tuning import tune
from ..tuning.tuner import TIMED_STEPS, WARMUP_STEPS
from .plan import load_model


def add_parser(sub: Any) -> None:
    cmd = sub.add_parser(
        "tune", help="measure each fitting setting's step time on this process group; pick the fastest"
    )
    cmd.add_argument("model", help="package.module:factory returning (model, batch[, loss_fn]), or a HF config folder")
    cmd.add_argument("--batch-size", type=int, default=None, help="micro-batch per rank (Hugging Face folder)")
    cmd.add_argument("--seq-len", type=int, default=None, help="sequence length (Hugging Face folder)")
    cmd.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation steps per optimizer step")
    cmd.add_argument("--steps", type=int, default=TIMED_STEPS, help="timed optimizer steps per candidate and pass")
    cmd.add_argument(
        "--warmup",
        type=int,
        default=WARMUP_STEPS,
        help="untimed optimizer steps per candidate before the timed ones (the last is the probe; with fewer than 2, "
        "one more step after the timed ones)",
    )
    cmd.add_argument(
        "--passes", type=int, choices=(1, 2), default=2, help="2: measure the contenders again, in reverse order"
    )
    cmd.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd, sgd_plain, adagrad or rmsprop")
    cmd.add_argument(
        "--precision", choices=("bf16", "fp16", "fp32"), default=None, help="mixed precision (default: fp32)"
    )
    cmd.add_argument("--memory-budget", default=None, help="bytes per rank, e.g. 80GiB (default: the device's)")
    cmd.add_argument(
        "--candidates",
        default=None,
        help='JSON list of FSDP2Config field dicts, e.g. \'[{"sharding_strategy": "NO_SHARD"}]\'',
    )
    cmd.add_argument("--json", default=None, help="also write the table as JSON to this file (rank 0)")
    cmd.add_argument("--cpu", action="store_true", help="tune on CPU (gloo) even where an accelerator exists")


def _load(args: argparse.Namespace) -> tuple[nn.Module, Any, Any]:
    if Path(args.model).is_dir():
        model, batch = load_model(args.model, args.batch_size, args.seq_len)
        if batch is None:
            raise ValueError("tune: a Hugging Face folder needs --batch-size (and --seq-len) to make a batch.")
        real = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in batch.items()}
        return model, real, None
    module_name, sep, attr = args.model.partition(":")
    if not sep:
        raise ValueError(f"MODEL={args.model!r} is neither a folder nor package.module:factory.")
    made = getattr(importlib.import_module(module_name), attr)()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise ValueError(f"tune: {args.model} must return (model, example_batch) or (model, example_batch, loss_fn).")
    return made[0], made[1], made[2] if len(made) == 3 else None


def run(args: argparse.Namespace) -> int:
    init_distributed(cpu=args.cpu)
    model, batch, loss_fn = _load(args)
    try:
        candidates = json.loads(args.candidates) if args.candidates else None
    except ValueError as exc:
        raise ValueError(f"tune: --candidates is not valid JSON ({exc}).") from None
    result = tune(
        model,
        batch,
        config={"mixed_precision": args.precision} if args.precision else None,
        candidates=candidates,
        optimizer=args.optimizer,
        loss_fn=loss_fn,
        micro_batches=args.micro_batches,
        warmup=args.warmup,
        steps=args.steps,
        passes=args.passes,
        memory_budget=args.memory_budget,
    )
    if rank() == 0:
        print(result)
        if args.json:
            Path(args.json).write_text(json.dumps(result.to_dict(), indent=1))
    return 0

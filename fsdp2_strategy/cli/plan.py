"""`fsdp2-strategy plan MODEL`: load a model on meta and print `compare_strategies` for it.

MODEL is a Hugging Face config folder (the model is built with `from_config` on the meta
device: no weights are read) or `package.module:factory`, a callable returning a model or a
`(model, example_batch)` pair.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..choose import compare_strategies
from ..estimate import largest_micro_batch


def add_parser(sub: Any) -> None:
    plan = sub.add_parser(
        "plan", help="per-rank memory and communication of every sharding strategy, and the one to use"
    )
    plan.add_argument("model", help="a Hugging Face config folder, or package.module:factory")
    plan.add_argument("--world-size", type=int, required=True, help="processes (ranks) the job runs, in all")
    plan.add_argument("--nodes", type=int, default=1, help="machines the ranks span (hybrid sharding's replicas)")
    plan.add_argument("--device-memory", default=None, help="budget per rank, e.g. 80GiB (default: no verdict)")
    plan.add_argument("--batch-size", type=int, default=None, help="micro-batch per rank (activations)")
    plan.add_argument("--seq-len", type=int, default=None, help="sequence length of a Hugging Face model's batch")
    plan.add_argument(
        "--precision", choices=("bf16", "fp16", "fp32"), default=None, help="mixed precision (default: fp32)"
    )
    plan.add_argument(
        "--context-parallel-size",
        type=int,
        default=1,
        help="ranks each sequence is split across (activations per rank of 1/N of every sequence)",
    )
    plan.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd, sgd_plain, adagrad, rmsprop or none")
    plan.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation steps")
    plan.add_argument(
        "--largest-batch",
        action="store_true",
        help="also the most rows per rank per micro-batch that fit --device-memory with the recommended strategy "
        "(needs --batch-size for the batch's shape)",
    )
    plan.add_argument(
        "--device-type",
        default=None,
        help="device the job trains on: cpu, cuda, ... (default: this machine's accelerator, else cpu); "
        "decides attention kernels and collective buffers",
    )


def load_model(spec: str, batch_size: int | None, seq_len: int | None) -> tuple[nn.Module, Any]:
    """The model on meta and an example batch (None when the size is not given)."""
    if Path(spec).is_dir():
        return _hugging_face(Path(spec), batch_size, seq_len)
    module_name, sep, attr = spec.partition(":")
    if not sep:
        raise ValueError(f"MODEL={spec!r} is neither a folder nor package.module:factory.")
    factory = getattr(importlib.import_module(module_name), attr)
    with torch.device("meta"):
        made = factory()
    return made if isinstance(made, tuple) else (made, None)


def _hugging_face(folder: Path, batch_size: int | None, seq_len: int | None) -> tuple[nn.Module, Any]:
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM  # optional ([hf]): only this path needs it

    config = AutoConfig.from_pretrained(folder)
    causal = any(a.endswith("ForCausalLM") for a in (config.architectures or []))
    with torch.device("meta"):
        model = (AutoModelForCausalLM if causal else AutoModel).from_config(config)
    if batch_size is None:
        return model, None
    seq = seq_len if seq_len is not None else int(getattr(config, "max_position_embeddings", 512))
    ids = torch.zeros(batch_size, seq, dtype=torch.long, device="meta")
    return model, ({"input_ids": ids, "labels": ids} if causal else {"input_ids": ids})


def run(args: argparse.Namespace) -> int:
    model, batch = load_model(args.model, args.batch_size, args.seq_len)
    config: dict[str, Any] = {"mixed_precision": args.precision} if args.precision else {}
    if args.context_parallel_size != 1:
        config["context_parallel_size"] = args.context_parallel_size
    comparison = compare_strategies(
        model,
        config,
        world_size=args.world_size,
        nodes=args.nodes,
        device_memory=args.device_memory,
        optimizer=args.optimizer,
        example_batch=batch,
        micro_batches=args.micro_batches,
        device_type=args.device_type,
    )
    params = sum(p.numel() for p in model.parameters())
    print(
        f"{type(model).__name__}: {params:,} parameters; {args.world_size} ranks on {args.nodes} node(s)"
        + ("" if batch is not None else "; no --batch-size: activations not counted")
    )
    print(comparison)
    if args.largest_batch:
        _print_largest_batch(args, model, batch, config, comparison)
    return 0 if comparison.budget is None or comparison.recommended is not None else 1


def _print_largest_batch(args: argparse.Namespace, model: nn.Module, batch: Any, config: dict, comparison: Any) -> None:
    """The largest micro-batch for the recommended strategy (the budget's, or this machine's memory)."""
    if batch is None:
        raise ValueError(
            "plan --largest-batch needs an example batch to grow: --batch-size (and --seq-len) for a Hugging Face "
            "folder, or a factory returning (model, batch)."
        )
    row = comparison.recommended
    setting: dict[str, Any] = {"sharding_strategy": "FULL_SHARD"}
    if row is not None:
        ac = "auto" if row.activation_checkpointing else None
        setting = {"sharding_strategy": row.strategy, "cpu_offload": row.cpu_offload, "activation_checkpointing": ac}
    fit = largest_micro_batch(
        model, {**config, **setting}, world_size=args.world_size, example_batch=batch, nodes=args.nodes,
        optimizer=args.optimizer, memory_budget=args.device_memory, device_type=args.device_type,
    )  # fmt: skip
    print(f"{row.label if row is not None else 'FULL_SHARD'}: {fit}")

"""Collectives per training step, 1-D FSDP vs 2-D FSDP x tensor parallel, at equal world size.

    torchrun --standalone --nproc_per_node=4 benchmarks/collectives_2d.py [--dim 256 --layers 4 --tp 2]

Counted, not timed (counts do not depend on machine load), with torch's `CommDebugMode`, which
sees every collective that runs through the dispatcher: FSDP's all-gathers and reduce-scatters
and the tensor-parallel all-reduces / all-gathers DTensor issues. One step (forward, backward,
SGD) after a warm-up step, rank 0, same small GPT, same global batch:
- `1-D`: `shard_model` over all ranks (tensor_parallel_size=1);
- `2-D`: `tensor_parallel_size=--tp` with the column/row-wise plan, FSDP over world/tp ranks.
Bytes are each collective's local payload as the dispatcher sees it (input tensor).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.debug import CommDebugMode

import fsdp2_strategy as f2

# The tests' tensor-parallel GPT and its plan (as memory_accuracy.py borrows the tests' models).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.models import TP_PLAN, TPGPT  # noqa: E402

VOCAB, SEQ = 256, 64


def kind(op: object) -> str:
    """'all-gather', 'reduce-scatter', 'all-reduce', ... from a c10d / functional op name."""
    name = str(op).lower()
    for key, label in (
        ("reduce_scatter", "reduce-scatter"),
        ("allgather", "all-gather"),
        ("all_gather", "all-gather"),
        ("allreduce", "all-reduce"),
        ("all_reduce", "all-reduce"),
        ("all_to_all", "all-to-all"),
        ("alltoall", "all-to-all"),
        ("broadcast", "broadcast"),
    ):
        if key in name:
            return label
    return name


def step_counts(args: argparse.Namespace, tp: int) -> Counter:
    """Collectives of one step (after a warm-up step) of the GPT sharded with `tp`."""
    torch.manual_seed(0)
    model = f2.shard_model(
        TPGPT(vocab=VOCAB, dim=args.dim, heads=8, layers=args.layers),
        wrap_policy=["TPBlock"],
        tensor_parallel_size=tp,
        tensor_parallel_plan=TP_PLAN,
        log_plan=False,
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    dp = dist.get_world_size() // tp
    g = torch.Generator().manual_seed(1 + dist.get_rank() // tp)  # one batch per data-parallel rank
    idx = torch.randint(0, VOCAB, (args.batch * 4 // dp, SEQ), generator=g)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(idx).reshape(-1, VOCAB), torch.roll(idx, -1, 1).reshape(-1)).backward()
        opt.step()

    step()  # warm-up: lazy init
    with CommDebugMode() as mode:
        step()
    counts: Counter = Counter()
    for op, n in mode.get_comm_counts().items():
        counts[kind(op)] += n
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="global batch, samples")
    args = parser.parse_args()
    logging.getLogger("fsdp2_strategy").setLevel(logging.WARNING)
    f2.init_distributed(cpu=True)
    rows = {"1-D FSDP": step_counts(args, 1), f"2-D FSDP x TP{args.tp}": step_counts(args, args.tp)}
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        kinds = sorted({k for c in rows.values() for k in c})
        print(
            f"GPT dim {args.dim}, {args.layers} blocks, world {world}, torch {torch.__version__}; "
            f"collectives in one training step, rank 0 (CommDebugMode)"
        )
        print(f"{'variant':<20}" + "".join(f"{k:>16}" for k in kinds) + f"{'total':>10}")
        for name, c in rows.items():
            print(f"{name:<20}" + "".join(f"{c[k]:>16}" for k in kinds) + f"{sum(c.values()):>10}")
    f2.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

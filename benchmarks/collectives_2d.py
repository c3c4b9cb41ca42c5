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
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

import fsdp2_strategy as f2

PLAN = {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
        "blocks.*.attn.proj": "rowwise", "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}
VOCAB, SEQ = 256, 64


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(dim), Attention(dim, heads), nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int = 8):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, VOCAB)

    def forward(self, idx):
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def kind(op: object) -> str:
    """'all-gather', 'reduce-scatter', 'all-reduce', ... from a c10d / functional op name."""
    name = str(op).lower()
    for key, label in (("reduce_scatter", "reduce-scatter"), ("allgather", "all-gather"), ("all_gather", "all-gather"),
                       ("allreduce", "all-reduce"), ("all_reduce", "all-reduce"), ("all_to_all", "all-to-all"),
                       ("alltoall", "all-to-all"), ("broadcast", "broadcast")):
        if key in name:
            return label
    return name


def step_counts(args: argparse.Namespace, tp: int) -> Counter:
    """Collectives of one step (after a warm-up step) of the GPT sharded with `tp`."""
    torch.manual_seed(0)
    model = f2.shard_model(GPT(args.dim, args.layers), wrap_policy=["Block"], tensor_parallel_size=tp,
                           tensor_parallel_plan=PLAN, log_plan=False)
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
        print(f"GPT dim {args.dim}, {args.layers} blocks, world {world}, torch {torch.__version__}; "
              f"collectives in one training step, rank 0 (CommDebugMode)")
        print(f"{'variant':<20}" + "".join(f"{k:>16}" for k in kinds) + f"{'total':>10}")
        for name, c in rows.items():
            print(f"{name:<20}" + "".join(f"{c[k]:>16}" for k in kinds) + f"{sum(c.values()):>10}")
    f2.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

"""FSDP's two collectives on gloo: gloo's own against the point-to-point rings (`FSDP2Config.collectives`).

    torchrun --standalone --nproc_per_node=2 benchmarks/ring_collectives.py [--mib 8 64 --repeats 5 --rounds 3]

For each size (the gathered / reduced buffer, fp32): `all_gather_into_tensor` vs `RingAllGather`,
`reduce_scatter_tensor` vs `RingReduceScatter`, and `all_reduce` of the same buffer (what DDP runs
once per step) as the yardstick; interleaved rounds, medians and ratios to gloo's all-reduce. Every
ring result is checked against gloo's before timing. Output buffers are allocated once per
variant, as in a training loop whose allocator reuses memory.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402

from fsdp2_strategy.shard.ring_comms import RingAllGather, RingReduceScatter  # noqa: E402

ALL_REDUCE = "gloo all_reduce (DDP's collective)"


def _check(full: torch.Tensor, shard: torch.Tensor) -> None:
    """The rings give gloo's results (2 ranks: the same additions, so bitwise equal)."""
    world = dist.get_world_size()
    want, got = torch.empty_like(full), torch.zeros_like(full)
    dist.all_gather_into_tensor(want, shard)
    RingAllGather()(got, shard, dist.group.WORLD)
    assert torch.equal(got, want), "ring all-gather differs from gloo's"
    want, got = torch.empty(full.numel() // world), torch.zeros(full.numel() // world)
    dist.reduce_scatter_tensor(want, full.clone())
    RingReduceScatter()(got, full.clone(), dist.group.WORLD)
    assert torch.allclose(got, want, rtol=1e-6, atol=0), "ring reduce-scatter differs from gloo's"


def variants_for(numel: int, repeats: int) -> dict:
    world, group = dist.get_world_size(), dist.group.WORLD
    gen = torch.Generator().manual_seed(dist.get_rank())
    full, shard = torch.randn(numel, generator=gen), torch.randn(numel // world, generator=gen)
    _check(full, shard)
    gathered, reduced, scratch = torch.empty(numel), torch.empty(numel // world), torch.empty(numel)
    ring_ag, ring_rs = RingAllGather(), RingReduceScatter()

    def timed(fn):
        return lambda: _bench.timed_steps(lambda i: fn(), repeats)

    def ring_reduce_scatter():
        scratch.copy_(full)  # the ring reduces its input in place, as FSDP lets it
        ring_rs(reduced, scratch, group)

    def gloo_reduce_scatter():
        scratch.copy_(full)  # the same copy, so both sides do equal work outside the collective
        dist.reduce_scatter_tensor(reduced, scratch)

    return {
        ALL_REDUCE: timed(lambda: dist.all_reduce(gathered)),
        "gloo all_gather_into_tensor": timed(lambda: dist.all_gather_into_tensor(gathered, shard)),
        "ring all-gather": timed(lambda: ring_ag(gathered, shard, group)),
        "gloo reduce_scatter_tensor (+copy)": timed(gloo_reduce_scatter),
        "ring reduce-scatter (+copy)": timed(ring_reduce_scatter),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, nargs="+", default=[8, 64], help="gathered / reduced buffer sizes")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per variant per round")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (plus one warm-up round)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    if dist.get_rank() == 0:
        print(f"world {world} (gloo, CPU), torch {torch.__version__}; seconds per call, ratio to gloo's all-reduce")
    for mib in args.mib:
        numel = int(mib * 2**20 / 4) // world * world
        results = _bench.interleave(variants_for(numel, args.repeats), args.rounds)
        _bench.print_ratio_table(results, ALL_REDUCE, f"[{numel * 4 / 2**20:.2f} MiB fp32]")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

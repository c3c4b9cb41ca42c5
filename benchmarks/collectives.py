"""Collectives and bytes per optimizer step with gradient accumulation: ours vs Lightning's.

    torchrun --standalone --nproc_per_node=2 benchmarks/collectives.py [--accumulate 4 --steps 4]
        [--part core lightning] [--plot out.png]

Communication is counted, not timed (counts do not depend on machine load): every call of
the torch.distributed collectives FSDP2 uses is intercepted and its payload added up
(all-gather: the gathered output; reduce-scatter: the unsharded input; all-reduce: the
tensor). Counted per optimizer step, after one warm-up step, on rank 0.

`core`: `f2.no_sync` on the first k-1 micro-batches vs a plain `fully_shard` loop that
  never skips sync (what a loop without `no_sync` does);
`lightning`: `Trainer(strategy="fsdp2", accumulate_grad_batches=k)` vs Lightning's
  `ModelParallelStrategy` with hand-applied `fully_shard` and the same accumulation.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import warnings
from collections import Counter
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402

import fsdp2_strategy as f2  # noqa: E402

# The tests' collective hook (torch's functions and the rings), as collectives_2d.py borrows the tests' models.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from helpers.comm import observe_collectives  # noqa: E402

# name -> (position, keyword) of the payload argument, whose bytes are counted
PAYLOAD = {
    "all_gather_single": (0, "output_tensor"),
    "all_gather_into_tensor": (0, "output_tensor"),  # gathered params
    "reduce_scatter_single": (1, "input"),
    "reduce_scatter_tensor": (1, "input"),  # unsharded gradients
    "all_reduce": (0, "tensor"),
}
KINDS = {
    "all_gather_single": "all-gather",
    "all_gather_into_tensor": "all-gather",
    "reduce_scatter_single": "reduce-scatter",
    "reduce_scatter_tensor": "reduce-scatter",
    "all_reduce": "all-reduce",
}


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter]:
    """Yield a Counter of calls ("all-gather") and payload bytes ("all-gather bytes") inside the block,
    whether torch's collectives or the rings (`FSDP2Config.collectives`) carried them (the tests'
    `observe_collectives` intercepts both)."""
    counts: Counter = Counter()

    def count(name: str, args: tuple, kwargs: dict) -> None:
        position, keyword = PAYLOAD[name]
        tensor = args[position] if len(args) > position else kwargs.get(keyword)
        counts[KINDS[name]] += 1
        if isinstance(tensor, torch.Tensor):
            counts[KINDS[name] + " bytes"] += tensor.numel() * tensor.element_size()

    with observe_collectives(count):
        yield counts


# --------------------------------------------------------------------------- core API
def core_counts(args: argparse.Namespace, skip_sync: bool) -> Counter:
    """Collectives of one optimizer step (after a warm-up step) with or without `f2.no_sync`."""
    if skip_sync:
        net = f2.shard_model(_bench.make_net(args.dim, args.layers), wrap_policy="auto", log_plan=False)
    else:
        net = _bench.hand_shard(_bench.make_net(args.dim, args.layers))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    data = _bench.batches(args.accumulate, args.batch)

    def step() -> None:
        for i, (x, y) in enumerate(data):
            last = i == len(data) - 1
            with f2.no_sync(net) if skip_sync and not last else contextlib.nullcontext():
                (F.mse_loss(net(x), y) / len(data)).backward()
        opt.step()
        opt.zero_grad()

    step()  # warm-up: one-time gathers are not part of a step
    with count_collectives() as counts:
        for _ in range(args.steps):
            step()
    return Counter({k: v / args.steps for k, v in counts.items()})


# --------------------------------------------------------------------------- Lightning
def lightning_counts(args: argparse.Namespace, strategy_name: str) -> Counter:
    """Collectives per optimizer step of a Trainer.fit with `accumulate_grad_batches=k`."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import ModelParallelStrategy

    import fsdp2_strategy.integrations.lightning  # noqa: F401  (registers "fsdp2")

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    world = dist.get_world_size()
    if strategy_name == "fsdp2":
        strategy, module = "fsdp2", _bench.lightning_module(args.dim, args.layers, shard_in_configure_model=False)
    else:
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
        module = _bench.lightning_module(args.dim, args.layers, shard_in_configure_model=True)

    class Snapshots(Callback):
        """The counter's value at the end of every optimizer step."""

        def __init__(self, counts: Counter):
            self.counts, self.marks, self._step = counts, [], 0

        def on_train_batch_end(self, trainer, *rest) -> None:
            if trainer.global_step != self._step:
                self._step = trainer.global_step
                self.marks.append(Counter(self.counts))

    with count_collectives() as counts:
        snaps = Snapshots(counts)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=strategy,
            max_steps=args.steps + 1,
            accumulate_grad_batches=args.accumulate,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[snaps],
        )
        trainer.fit(module, _bench.tensor_loader((args.steps + 1) * args.accumulate, args.batch))
    first, last = snaps.marks[0], snaps.marks[-1]  # from the end of the warm-up step to the end of the last
    n = len(snaps.marks) - 1
    return Counter({k: (last[k] - first[k]) / n for k in last})


# --------------------------------------------------------------------------- report
def print_table(title: str, rows: dict[str, Counter], baseline: str) -> None:
    print(title)
    print(
        f"{'variant':<44} {'reduce-scatters':>15} {'all-gathers':>11} {'all-reduces':>11} "
        f"{'RS MiB':>8} {'AG MiB':>8} {'total MiB':>9}"
    )
    for name, c in rows.items():
        total = _total(c) / 2**20
        print(
            f"{name:<44} {c['reduce-scatter']:>15.1f} {c['all-gather']:>11.1f} {c['all-reduce']:>11.1f} "
            f"{c['reduce-scatter bytes'] / 2**20:>8.2f} {c['all-gather bytes'] / 2**20:>8.2f} {total:>9.2f}"
        )
    names = list(rows)
    ours = names[1]
    ratio = rows[ours]["reduce-scatter bytes"] / max(rows[baseline]["reduce-scatter bytes"], 1)
    total = _total(rows[ours]) / max(_total(rows[baseline]), 1)
    print(f"ratio {ours} / {baseline}: reduce-scatter bytes {ratio:.3f}, all bytes {total:.3f}")


def _total(c: Counter) -> float:
    return sum(v for k, v in c.items() if k.endswith("bytes"))


def plot(tables: dict[str, dict[str, Counter]], out: str, accumulate: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, rs, ag = [], [], []
    for rows in tables.values():
        for name, c in rows.items():
            labels.append(name.replace(" + ", "\n+ ").replace(", ", ",\n"))
            rs.append(c["reduce-scatter bytes"] / 2**20)
            ag.append(c["all-gather bytes"] / 2**20)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    xs = range(len(labels))
    ax.bar(xs, ag, label="all-gather")
    ax.bar(xs, rs, bottom=ag, label="reduce-scatter")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("MiB per optimizer step (rank 0)")
    ax.set_title(f"Communication per optimizer step, accumulate_grad_batches={accumulate}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", nargs="+", choices=["core", "lightning"], default=["core", "lightning"])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="counted optimizer steps")
    parser.add_argument("--plot", default=None, help="write a bar chart PNG here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    k = args.accumulate
    tables: dict[str, dict[str, Counter]] = {}
    if "core" in args.part:
        tables["core"] = {
            "fully_shard loop, sync every micro-batch": core_counts(args, skip_sync=False),
            "core API, f2.no_sync on k-1 micro-batches": core_counts(args, skip_sync=True),
        }
    if "lightning" in args.part:
        tables["lightning"] = {
            "ModelParallelStrategy + fully_shard": lightning_counts(args, "model_parallel"),
            'Trainer(strategy="fsdp2")': lightning_counts(args, "fsdp2"),
        }
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in _bench.make_net(args.dim, args.layers).parameters())
        print(
            f"model: {params / 1e6:.2f} M params fp32 ({args.layers} blocks, dim {args.dim}), accumulate {k}, "
            f"world {dist.get_world_size()}, torch {torch.__version__}; per optimizer step, rank 0"
        )
        for part, rows in tables.items():
            print_table(f"[{part}]", rows, baseline=next(iter(rows)))
        if args.plot:
            plot(tables, args.plot, k)
            print(f"plot written to {args.plot}")
    f2.shutdown()


if __name__ == "__main__":
    main()

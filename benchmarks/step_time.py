"""Does the engine cost step time? Ours vs hand-written FSDP2, interleaved.

    torchrun --standalone --nproc_per_node=2 benchmarks/step_time.py [--part core lightning]
        [--dim 512 --layers 8 --batch 16 --accumulate 4 --steps 8 --rounds 4]

`core`: one optimizer step (`--accumulate` micro-batches, gradient clipping, AdamW) with
  - ours: `f2.shard_model(wrap_policy="auto")`, `f2.no_sync`, `f2.clip_grad_norm_`;
  - hand: `fully_shard` on each block and the root, `set_requires_gradient_sync`,
    `torch.nn.utils.clip_grad_norm_`.
  Same initial weights and data; the loss of both is printed as a correctness check.
`lightning`: `Trainer(strategy="fsdp2")` (sharding by policy, no user code) vs Lightning's
  `ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)` with the same
  `fully_shard` calls written in `configure_model`, `accumulate_grad_batches=1` by default so
  that both do the same communication; `--lightning-accumulate 4` shows what skipping the
  reduce-scatter on 3 of 4 micro-batches is worth (collectives.py counts it).
Variants alternate (A, B, A, B, ...; the first round is warm-up); reported: median seconds
per optimizer step and the ratio to the hand-written baseline.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402

import fsdp2_strategy as f2  # noqa: E402


# --------------------------------------------------------------------------- core API vs hand loop
def ours_step(args: argparse.Namespace):
    """An optimizer step through the core API; returns (step function, last-loss holder)."""
    net = f2.shard_model(_bench.make_net(args.dim, args.layers), wrap_policy="auto", log_plan=False)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    data = _bench.batches(args.accumulate, args.batch)
    losses: list[float] = []

    def step(_: int) -> None:
        for i, (x, y) in enumerate(data):
            ctx = f2.no_sync(net) if i < len(data) - 1 else contextlib.nullcontext()
            with ctx:
                loss = F.mse_loss(net(x), y) / len(data)
                loss.backward()
        f2.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))

    return step, losses


def hand_step(args: argparse.Namespace):
    """The same step written against torch's `fully_shard` directly."""
    net = _bench.hand_shard(_bench.make_net(args.dim, args.layers))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    data = _bench.batches(args.accumulate, args.batch)
    losses: list[float] = []

    def step(_: int) -> None:
        for i, (x, y) in enumerate(data):
            net.set_requires_gradient_sync(i == len(data) - 1)
            loss = F.mse_loss(net(x), y) / len(data)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))

    return step, losses


HAND, CORE = "hand-written fully_shard loop", "core API (shard_model, no_sync)"


def run_core(args: argparse.Namespace) -> None:
    ours, ours_losses = ours_step(args)
    hand, hand_losses = hand_step(args)
    results = _bench.interleave(
        {HAND: lambda: _bench.timed_steps(hand, args.steps), CORE: lambda: _bench.timed_steps(ours, args.steps)},
        args.rounds,
    )
    _bench.print_ratio_table(
        results, HAND, f"core API vs hand-written FSDP2, accumulate {args.accumulate}, clip 1.0, AdamW"
    )
    if dist.get_rank() == 0:
        diff = max(abs(a - b) for a, b in zip(ours_losses, hand_losses))
        print(f"core/hand step-time ratio: {_ratio(results, CORE, HAND):.3f}")
        print(
            f"loss after {len(ours_losses)} steps: ours {ours_losses[-1]:.6f}, hand {hand_losses[-1]:.6f} "
            f"(max difference over all steps {diff:.2e})"
        )


# --------------------------------------------------------------------------- Lightning strategies
def fit_once(args: argparse.Namespace, strategy_name: str) -> list[float]:
    """One Trainer.fit of `args.steps + 3` optimizer steps; seconds per step after warm-up."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    import fsdp2_strategy.integrations.lightning  # noqa: F401  (registers "fsdp2")

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # Lightning resets it on import

    world = dist.get_world_size()
    if strategy_name == "fsdp2":
        strategy, module = "fsdp2", _bench.lightning_module(args.dim, args.layers, shard_in_configure_model=False)
    else:
        # "auto" sizes would give data_parallel_size=num_nodes=1: nothing sharded on one node.
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
        module = _bench.lightning_module(args.dim, args.layers, shard_in_configure_model=True)
    timer = _bench.step_timer()
    k = args.lightning_accumulate
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=args.steps + 3,
        accumulate_grad_batches=k,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    trainer.fit(module, _bench.tensor_loader((args.steps + 3) * k, args.batch))
    return timer.intervals(skip=2)


MPS, OURS = "ModelParallelStrategy + fully_shard", 'Trainer(strategy="fsdp2")'


def run_lightning(args: argparse.Namespace) -> None:
    results = _bench.interleave(
        {MPS: lambda: fit_once(args, "model_parallel"), OURS: lambda: fit_once(args, "fsdp2")}, args.rounds
    )
    _bench.print_ratio_table(
        results,
        MPS,
        f"Lightning: strategy='fsdp2' vs ModelParallelStrategy, accumulate_grad_batches={args.lightning_accumulate}",
    )
    if dist.get_rank() == 0:
        print(f"fsdp2/ModelParallel step-time ratio: {_ratio(results, OURS, MPS):.3f}")


def _ratio(results: dict[str, list[float]], a: str, b: str) -> float:
    import statistics

    return statistics.median(results[a]) / statistics.median(results[b])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", nargs="+", choices=["core", "lightning"], default=["core", "lightning"])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--lightning-accumulate", type=int, default=1, help="accumulate_grad_batches (lightning part)")
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps per variant per round")
    parser.add_argument("--rounds", type=int, default=4, help="measured rounds (plus one warm-up round)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if dist.get_rank() == 0:
        print(
            f"model: {args.layers} blocks of dim {args.dim}, batch {args.batch}/rank, world {dist.get_world_size()}, "
            f"torch {torch.__version__}"
        )
    if "core" in args.part:
        run_core(args)
    if "lightning" in args.part:
        run_lightning(args)
    f2.shutdown()


if __name__ == "__main__":
    main()

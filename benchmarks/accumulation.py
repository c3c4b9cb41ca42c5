"""Accumulation modes (`FSDP2Config.accumulation`): communication, memory and step time against DDP.

    torchrun --standalone --nproc_per_node=2 benchmarks/accumulation.py [--part counts time lightning]
        [--dim 512 --layers 8 --batch 16 --ks 1 2 4 8 --steps 4 --rounds 3] [--host-allocator auto|system]
        [--plot out.png]

`counts` (counted, not timed): per mode and k micro-batches per optimizer step, the all-gathers
  and reduce-scatters per FSDP group per step with their bytes (rank 0, after a warm-up step), the
  gradient bytes held between micro-batches (sharded `.grad` plus FSDP's unsharded accumulation
  buffers, the largest after any backward of the step) and the peak tensor memory of the step
  (torch's `MemTracker`: every live tensor of this rank, parameters, gradients, activations and
  optimizer state included).
`one_group` rows: "keep_gathered" with `wrap_policy=None` (the root the only FSDP group).
`time`: seconds per optimizer step (AdamW, clipping at 1.0) of a hand-written DDP loop
  (`DistributedDataParallel`, `no_sync` on k-1 micro-batches) and of the core API in each mode
  (and with each `--collectives`: "auto" runs FSDP's collectives as rings on gloo, "torch" as
  gloo's own), same model, weights and global batch, interleaved; medians, spread and ratio to DDP.
`lightning`: `Trainer(strategy="ddp")` vs `FSDP2Strategy(accumulation=mode)`, accumulate_grad_batches=k
  (the largest of --ks), interleaved. Accelerate's comparison is benchmarks/accelerate_step_time.py
  --cpu-env --accumulation ... (each variant needs its own `accelerate launch`).
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
from torch.distributed.fsdp import FSDPModule

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402
from collectives import count_collectives  # noqa: E402

import fsdp2_strategy as f2  # noqa: E402
from fsdp2_strategy import _torch_compat as tc  # noqa: E402

MODES = ("sync_each", "sync_last", "keep_gathered")
ONE_GROUP = "one_group"
"""A variant: "keep_gathered" with `wrap_policy=None`, the root the only FSDP group (one all-gather
and one reduce-scatter of the whole model per step: fewer, larger collectives and FSDP hooks)."""
VARIANTS = MODES + (ONE_GROUP,)


def _config(mode: str) -> dict:
    """The FSDP2Config fields a variant sets."""
    if mode == ONE_GROUP:
        return {"accumulation": "keep_gathered", "wrap_policy": None}
    return {"accumulation": mode, "wrap_policy": "auto"}


DDP = "DDP (hand-written loop)"


def _micro_step(model, opt, data, no_sync, on_backward=None) -> None:
    """One optimizer step over `data` (k micro-batches), `no_sync` on all but the last."""
    for i, (x, y) in enumerate(data):
        with no_sync() if i < len(data) - 1 else contextlib.nullcontext():
            (F.mse_loss(model(x), y) / len(data)).backward()
        if on_backward is not None:
            on_backward()
    if isinstance(model, FSDPModule):
        f2.clip_grad_norm_(model.parameters(), 1.0)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


def _sharded(args, mode: str, collectives: str = "auto"):
    model = f2.shard_model(
        _bench.make_net(args.dim, args.layers),
        **_config(mode),
        collectives=collectives,
        host_allocator=args.host_allocator,
        log_plan=False,
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), lambda: f2.no_sync(model)


def _ddp(args):
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_bench.make_net(args.dim, args.layers))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), model.no_sync


# --------------------------------------------------------------------------- counts and memory
def _held_grad_bytes(model) -> int:
    """Gradient bytes this rank holds now: sharded `.grad` and FSDP's unsharded accumulation (each
    tensor once: from torch 2.15 `unsharded_accumulated_grad` is a view of the unsharded `.grad`)."""
    total = 0
    for module in model.modules():
        for group in tc.param_groups(module):
            for p in group.fsdp_params:
                sharded = p.sharded_param.grad
                if sharded is not None:
                    total += sharded.to_local().numel() * sharded.element_size()
                for g in tc.unreduced_grads(p):
                    if g.untyped_storage().size():
                        total += g.numel() * g.element_size()
    return total


def _peak_bytes(model, opt, data, no_sync) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        # Module statistics reset after each micro-batch: MemTracker refuses a module run twice.
        _micro_step(model, opt, data, no_sync, on_backward=tracker.reset_mod_stats)
    return sum(v for k, v in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items() if k == "Total")


def count_one(args, mode: str, k: int) -> dict:
    model, opt, no_sync = _sharded(args, mode)
    data = _bench.batches(k, args.batch)
    groups = sum(isinstance(m, FSDPModule) for m in model.modules())
    _micro_step(model, opt, data, no_sync)  # warm-up: one-time gathers are not part of a step
    held = []
    with count_collectives() as counts:
        _micro_step(model, opt, data, no_sync, on_backward=lambda: held.append(_held_grad_bytes(model)))
    peak = _peak_bytes(model, opt, data, no_sync)
    return {
        "groups": groups,
        "ag": counts["all-gather"] / groups,
        "rs": counts["reduce-scatter"] / groups,
        "ar": counts["all-reduce"],
        "ag_mib": counts["all-gather bytes"] / 2**20,
        "rs_mib": counts["reduce-scatter bytes"] / 2**20,
        "grad_mib": max(held) / 2**20,
        "peak_mib": peak / 2**20,
    }


def run_counts(args) -> dict:
    rows = {(mode, k): count_one(args, mode, k) for mode in VARIANTS for k in args.ks}
    model = _bench.make_net(args.dim, args.layers)
    ddp, opt, no_sync = _ddp(args)
    rows[("ddp", max(args.ks))] = {
        "peak_mib": _peak_bytes(ddp, opt, _bench.batches(max(args.ks), args.batch), no_sync) / 2**20
    }
    if dist.get_rank() == 0:
        full = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        world = dist.get_world_size()
        print(
            f"[counts] per optimizer step, rank 0; model {full:.2f} MiB fp32 params ({args.layers} blocks, dim "
            f"{args.dim}), grads of 1/{world} of it = {full / world:.2f} MiB"
        )
        print(
            f"{'mode':<14} {'k':>2} {'AG/group':>8} {'RS/group':>8} {'AG MiB':>8} {'RS MiB':>8} "
            f"{'held grads MiB':>14} {'peak MiB':>9}"
        )
        for (mode, k), r in rows.items():
            if mode == "ddp":
                print(f"{'DDP':<14} {k:>2} {'':>8} {'':>8} {'':>8} {'':>8} {'':>14} {r['peak_mib']:>9.3f}")
                continue
            print(
                f"{mode:<14} {k:>2} {r['ag']:>8.2f} {r['rs']:>8.2f} {r['ag_mib']:>8.3f} {r['rs_mib']:>8.3f} "
                f"{r['grad_mib']:>14.3f} {r['peak_mib']:>9.3f}"
            )
    return rows


# --------------------------------------------------------------------------- step time
def run_time(args) -> None:
    for k in args.ks:
        variants, models = {}, {}
        sharded = [
            (_variant_name(m, c), (lambda m=m, c=c: _sharded(args, m, c)))
            for c in args.collectives
            for m in (VARIANTS if c == "auto" else MODES)
        ]
        for name, build in [(DDP, lambda: _ddp(args))] + sharded:
            model, opt, no_sync = build()
            data = [_bench.batches(k, args.batch, seed=_bench.BATCH_SEED + s) for s in range(args.steps)]
            variants[name] = lambda model=model, opt=opt, no_sync=no_sync, data=data: _bench.timed_steps(
                lambda i: _micro_step(model, opt, data[i], no_sync), args.steps
            )
            models[name] = model
        results = _bench.interleave(variants, args.rounds)
        _bench.print_ratio_table(results, DDP, f"[time] core API vs hand-written DDP, k={k}, AdamW, clip 1.0")
        _check_same_weights(models)


def _variant_name(mode: str, collectives: str) -> str:
    return mode if collectives == "auto" else f"{mode} ({collectives} collectives)"


def _check_same_weights(models: dict) -> None:
    """Every variant ran the same steps on the same data: their weights must agree."""
    from torch.distributed.tensor import DTensor

    def flat(model):
        return torch.cat(
            [
                (p.full_tensor() if isinstance(p, DTensor) else p).detach().reshape(-1)
                for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0].removeprefix("module."))
            ]
        )

    ref = flat(models[DDP])
    diffs = {n: ((flat(m) - ref).norm() / ref.norm()).item() for n, m in models.items() if n != DDP}
    if dist.get_rank() == 0:
        print(
            "weights after all timed steps, relative difference to DDP: "
            + ", ".join(f"{n} {d:.1e}" for n, d in diffs.items())
        )


# --------------------------------------------------------------------------- Lightning
def fit_once(args, k: int, variant: str) -> list[float]:
    import lightning.pytorch as pl

    from fsdp2_strategy.integrations.lightning import FSDP2Strategy

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    strategy = (
        "ddp"
        if variant == "ddp"
        else FSDP2Strategy(**_config(variant), host_allocator=args.host_allocator, log_plan=False)
    )
    module = _bench.lightning_module(args.dim, args.layers, shard_in_configure_model=False)
    timer = _bench.step_timer()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=dist.get_world_size(),
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


def run_lightning(args) -> None:
    k = max(args.ks) if args.lightning_k is None else args.lightning_k
    names = {'Trainer(strategy="ddp")': "ddp", **{f"fsdp2 {m}": m for m in VARIANTS}}
    results = _bench.interleave({n: (lambda v=v: fit_once(args, k, v)) for n, v in names.items()}, args.rounds)
    _bench.print_ratio_table(results, 'Trainer(strategy="ddp")', f"[lightning] accumulate_grad_batches={k}")


# --------------------------------------------------------------------------- plot
def plot(rows: dict, out: str, ks) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, (comm, mem) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, mode in enumerate(MODES):
        color = f"C{i}"
        comm.plot(
            ks, [rows[(mode, k)]["ag_mib"] + rows[(mode, k)]["rs_mib"] for k in ks], marker="o", color=color, label=mode
        )
        mem.plot(
            ks,
            [rows[(mode, k)]["peak_mib"] for k in ks],
            marker="x",
            linestyle="--",
            color=color,
            label=f"{mode}: peak",
        )
        mem.plot(ks, [rows[(mode, k)]["grad_mib"] for k in ks], marker="o", color=color, label=f"{mode}: held grads")
    ddp = rows.get(("ddp", max(ks)))
    if ddp is not None:
        mem.axhline(ddp["peak_mib"], color="gray", linestyle=":", label="DDP: peak")
    for ax, title, ylabel in (
        (comm, "all-gather + reduce-scatter bytes", "MiB per optimizer step (rank 0)"),
        (mem, "memory per rank (counted)", "MiB (rank 0)"),
    ):
        ax.set(xlabel="micro-batches per optimizer step (k)", ylabel=ylabel, title=title, xscale="log")
        ax.set_xticks(list(ks), [str(k) for k in ks])
        ax.xaxis.set_minor_formatter(NullFormatter())
    comm.legend(fontsize=8)
    mem.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--part", nargs="+", choices=["counts", "time", "lightning"], default=["counts", "time", "lightning"]
    )
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="samples per rank and micro-batch")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--lightning-k", type=int, default=None, help="accumulate_grad_batches (default: max of --ks)")
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps per variant per round")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (plus one warm-up round)")
    parser.add_argument(
        "--collectives",
        nargs="+",
        choices=["auto", "ring", "torch"],
        default=["auto"],
        help="FSDP2Config.collectives of the timed core-API variants (auto: rings on gloo)",
    )
    parser.add_argument(
        "--host-allocator",
        choices=["auto", "system"],
        default="auto",
        help="FSDP2Config.host_allocator of every sharded variant; process-wide, so DDP "
        "in the same run gets it too (auto: glibc malloc keeps freed memory on CPU)",
    )
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if dist.get_rank() == 0:
        print(
            f"world {dist.get_world_size()} (gloo, CPU), torch {torch.__version__}, dim {args.dim}, {args.layers} blocks, "
            f"batch {args.batch}/rank/micro-batch, host_allocator {args.host_allocator}"
        )
    if "counts" in args.part:
        rows = run_counts(args)
        if args.plot and dist.get_rank() == 0:
            plot(rows, args.plot, args.ks)
            print(f"plot written to {args.plot}")
    if "time" in args.part:
        run_time(args)
    if "lightning" in args.part:
        run_lightning(args)
    f2.shutdown()


if __name__ == "__main__":
    main()

"""Step time and losses: `FSDP2Accelerator` vs the stock `Accelerator`, same accelerate FSDP config.

    python benchmarks/accelerate_step_time.py [--dim 512 --layers 8 --batch 16 --accumulate 4
                                               --steps 8 --rounds 3 --processes 2 --cpu --cpu-env]

Both read one ordinary accelerate config file (`distributed_type: FSDP`, `fsdp_version: 2`,
`TRANSFORMER_BASED_WRAP` on `Block`); the training loop is the same Accelerate loop
(`prepare`, `accumulate`, `backward`, `clip_grad_norm_`, AdamW). What differs is what each
accelerator does with the config: on CPU the stock one leaves the model as it is (its FSDP
path needs an accelerator; measured with Accelerate 1.15: no wrapper and no gradient
synchronisation), or with `--cpu-env` (ACCELERATE_USE_CPU=true, which its FSDP launcher
does not derive from `use_cpu: true`) wraps it in DDP; on GPUs it runs its own FSDP2 path.
Each run is a fresh `accelerate launch` world, interleaved (ours, stock, stock, ours, ...),
first round dropped (`--warmup-rounds`).
Reported: what the model became, median seconds per optimizer step with spread, the ratio,
and each one's largest loss difference from one process training on the same global batches
(correct data parallelism matches it; unsynchronised processes do not).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import _bench  # this folder: the script's own directory is on sys.path

RESULT = "ACCELERATE_STEP_TIME_RESULT "
OURS, STOCK = "FSDP2Accelerator", "stock Accelerator"


# --------------------------------------------------------------------------- worker (one rank)
def _accelerator(variant: str, accumulate: int):
    if variant.startswith(OURS):
        from fsdp2_strategy.integrations.accelerate import FSDP2Accelerator, FSDP2Plugin

        mode = variant.partition(" ")[2]  # "FSDP2Accelerator keep_gathered": FSDP2Config.accumulation
        # "one_group": keep_gathered with the root the only FSDP group (wrap_policy=None over the config's).
        fields = (
            {"accumulation": "keep_gathered", "wrap_policy": None} if mode == "one_group" else {"accumulation": mode}
        )
        plugin = FSDP2Plugin(**fields) if mode else None
        return FSDP2Accelerator(fsdp_plugin=plugin, gradient_accumulation_steps=accumulate)
    from accelerate import Accelerator

    return Accelerator(gradient_accumulation_steps=accumulate)  # its own plugin, from the same config


def worker(variant: str, args: argparse.Namespace) -> None:
    import time

    import torch
    import torch.nn.functional as F

    accelerator = _accelerator(variant, args.accumulate)
    model = _bench.make_net(args.dim, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    micro = _bench.batches(args.accumulate * (args.steps + 2), args.batch)
    losses, stamps = [], []
    for x, y in micro:
        x, y = x.to(accelerator.device), y.to(accelerator.device)
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            losses.append(accelerator.reduce(loss.detach(), "mean").item())
            accelerator.wait_for_everyone()
            stamps.append(time.perf_counter())
    if accelerator.is_main_process:
        times = [b - a for a, b in zip(stamps, stamps[1:])][1:]  # the first two steps are warm-up
        print(
            RESULT
            + json.dumps(
                {
                    "variant": variant,
                    "wrapped": type(model).__name__,
                    "losses": losses,
                    "times": times,
                    "distributed_type": str(accelerator.distributed_type),
                }
            ),
            flush=True,
        )
    accelerator.end_training()
    import fsdp2_strategy as f2

    f2.shutdown()


def reference_losses(args: argparse.Namespace) -> list[float]:
    """One process, no accelerator library: every rank's micro-batches concatenated (the global
    batch), loss / accumulate per micro-batch, clipping, AdamW: what correct data parallelism computes."""
    import torch
    import torch.nn.functional as F

    model = _bench.make_net(args.dim, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n = args.accumulate * (args.steps + 2)
    per_rank = [_bench.batches(n, args.batch, rank=r) for r in range(args.processes)]
    losses = []
    for i in range(n):
        x = torch.cat([b[i][0] for b in per_rank])
        y = torch.cat([b[i][1] for b in per_rank])
        loss = F.mse_loss(model(x), y)
        (loss / args.accumulate).backward()
        if (i + 1) % args.accumulate == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses


# --------------------------------------------------------------------------- parent
def launch(variant: str, config: Path, args: argparse.Namespace) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_"))}
    env.setdefault("OMP_NUM_THREADS", "1")
    if args.cpu_env:
        # Accelerate's FSDP launcher drops the file's `use_cpu: true`; this variable reaches both
        # variants (the stock one then becomes MULTI_CPU + DDP instead of DistributedType.NO).
        env["ACCELERATE_USE_CPU"] = "true"
    port = _bench.free_port()
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        "--main_process_port",
        str(port),
        __file__,
        "--worker",
        variant,
        "--dim",
        str(args.dim),
        "--layers",
        str(args.layers),
        "--batch",
        str(args.batch),
        "--accumulate",
        str(args.accumulate),
        "--steps",
        str(args.steps),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{variant} run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[0][len(RESULT) :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="per process and micro-batch")
    parser.add_argument("--accumulate", type=int, default=4, help="gradient_accumulation_steps")
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps per run")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds")
    parser.add_argument("--warmup-rounds", type=int, default=1, help="rounds run first and dropped (0: a smoke run)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--cpu", action="store_true", help="use_cpu: true (the default where no accelerator exists)")
    parser.add_argument(
        "--cpu-env",
        action="store_true",
        help="also set ACCELERATE_USE_CPU=true (needed for CPU runs on a machine with GPUs)",
    )
    parser.add_argument(
        "--accumulation",
        nargs="+",
        default=None,
        help="FSDP2Config.accumulation modes to run as separate FSDP2Accelerator variants "
        "('one_group': keep_gathered with wrap_policy=None)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args)

    import torch

    cpu = args.cpu or not torch.accelerator.is_available()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "fsdp2.yaml"
        config.write_text(
            _bench.accelerate_fsdp2_config(layer="Block", processes=args.processes, mixed_precision="no", cpu=cpu)
        )
        ours = [f"{OURS} {m}" for m in args.accumulation] if args.accumulation else [OURS]
        runs: dict[str, list[dict]] = {v: [] for v in [*ours, STOCK]}
        for r in range(args.warmup_rounds + args.rounds):
            for variant in list(runs) if r % 2 == 0 else list(runs)[::-1]:
                result = launch(variant, config, args)
                if r >= args.warmup_rounds:
                    runs[variant].append(result)
    device = "CPU (gloo)" if cpu else torch.accelerator.current_accelerator().type
    print(
        f"{args.processes} processes on {device}, dim {args.dim}, {args.layers} blocks, batch {args.batch}, "
        f"accumulate {args.accumulate}, {args.steps} steps x {args.rounds} rounds"
    )
    reference = reference_losses(args)
    print(
        f"{'variant':<30} {'distributed_type':<27} {'model became':<14} {'median s/step':>13} {'p25-p75':>15} "
        f"{'n':>3} {'loss vs 1 process':>18}"
    )
    medians = {}
    for variant, results in runs.items():
        times = [t for res in results for t in res["times"]]
        medians[variant] = statistics.median(times)
        q1, _, q3 = statistics.quantiles(times, n=4)
        # Largest relative difference from the one-process run of the same global batches.
        diff = max(abs(a - b) / max(abs(b), 1e-12) for res in results for a, b in zip(res["losses"], reference))
        print(
            f"{variant:<30} {results[0]['distributed_type']:<27} {results[0]['wrapped']:<14} {medians[variant]:>13.4f} "
            f"{q1:>7.3f}-{q3:<7.3f} {len(times):>3} {diff:>18.2e}"
        )
    if ours == [OURS]:
        print(f"ours/stock step-time ratio {medians[OURS] / medians[STOCK]:.3f}")
    for variant in ours[1:] if ours == [OURS] else ours:
        print(f"{variant} / stock step-time ratio {medians[variant] / medians[STOCK]:.3f}")


if __name__ == "__main__":
    main()

"""Peak memory per rank while building a sharded model with pretrained weights.

    python benchmarks/build_memory.py [--dim 1024 --layers 16 --world 2 --repeats 2 --plot out.png]

Two ways to end up with the same sharded, loaded model:
- `full`: every rank builds the whole model (random init), reads the full checkpoint
  (`safetensors.torch.load_file`), `load_state_dict`, then `shard_model` (what a script does
  that calls `from_pretrained` on every rank before sharding);
- `meta`: the model is built on the meta device, `shard_model` allocates only this rank's
  shards, and `load_full_weights` reads only this rank's rows from the file.
Each measurement is a fresh `torchrun` world (so no allocator state carries over), run
interleaved (full, meta, full, meta, ...). Reported: the peak resident-memory growth of the
worst rank from before the model existed until it is loaded (Linux VmHWM, reset first);
medians over repeats and the meta/full ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

MIB = 2**20
RESULT = "BUILD_MEMORY_RESULT "


# --------------------------------------------------------------------------- worker (one rank)
def _worker(variant: str, path: str, dim: int, layers: int) -> None:
    """Run one variant in this rank and print the per-rank growth (rank 0, one JSON line)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import fsdp2_strategy as f2

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from meta_init import build_model, reset_peak_rss, rss_mib  # the example's model and readings

    warnings.filterwarnings("ignore", message="DTensor random operators")
    dist.init_process_group("gloo")
    dist.barrier()
    reset_peak_rss()
    before = rss_mib("VmRSS")
    if variant == "meta":
        with torch.device("meta"):
            model: nn.Module = build_model(dim, layers)
        f2.shard_model(model, wrap_policy="auto", log_plan=False)
        f2.load_full_weights(model, path)
    else:
        from safetensors.torch import load_file

        model = build_model(dim, layers)
        model.load_state_dict(load_file(path))
        f2.shard_model(model, wrap_policy="auto", log_plan=False)
    growth = rss_mib("VmHWM") - before
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, growth)
    if dist.get_rank() == 0:
        print(RESULT + json.dumps({"variant": variant, "growth_mib": rows}), flush=True)
    f2.shutdown()


# --------------------------------------------------------------------------- launcher
def _write_weights(path: Path, dim: int, layers: int) -> float:
    """Write the seeded full weights; return their size in MiB."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from meta_init import write_weights

    write_weights(path, dim, layers)
    return path.stat().st_size / MIB


def _run_world(variant: str, path: Path, args: argparse.Namespace) -> list[float]:
    """One fresh torchrun world running `variant`; the growth of each rank in MiB."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.world}",
        __file__,
        "--worker",
        variant,
        "--path",
        str(path),
        "--dim",
        str(args.dim),
        "--layers",
        str(args.layers),
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=args.timeout, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])["growth_mib"]
    raise RuntimeError(
        f"{variant} world failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )


def _plot(results: dict[str, list[list[float]]], full_mib: float, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    world = len(next(iter(results.values()))[0])
    fig, ax = plt.subplots(figsize=(5, 3.2))
    width = 0.38
    for i, (variant, runs) in enumerate(results.items()):
        per_rank = [statistics.median(run[r] for run in runs) for r in range(world)]
        ax.bar([r + (i - 0.5) * width for r in range(world)], per_rank, width, label=variant)
    ax.axhline(full_mib, color="k", linestyle="--", linewidth=1, label="full model size")
    ax.set_xticks(range(world), [f"rank {r}" for r in range(world)])
    ax.set_ylabel("peak RSS growth (MiB)")
    ax.set_title("Building a sharded model with weights")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--plot", default=None, help="write a bar chart PNG here")
    parser.add_argument("--worker", choices=["full", "meta"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.path, args.dim, args.layers)
        return

    results: dict[str, list[list[float]]] = {"full": [], "meta": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "weights.safetensors"
        full_mib = _write_weights(path, args.dim, args.layers)
        for _ in range(args.repeats):
            for variant in results:  # interleaved: full, meta, full, meta, ...
                results[variant].append(_run_world(variant, path, args))
    import torch

    print(
        f"model: {full_mib:.0f} MiB fp32 ({args.layers} blocks of dim {args.dim}), world {args.world}, "
        f"torch {torch.__version__}, median of {args.repeats} fresh worlds per variant"
    )
    print(f"{'variant':<8} {'worst-rank peak growth (MiB)':>29} {'/ full model':>13}")
    median = {}
    for variant, runs in results.items():
        median[variant] = statistics.median(max(run) for run in runs)
        print(f"{variant:<8} {median[variant]:>29.0f} {median[variant] / full_mib:>13.2f}")
    print(f"meta/full peak-memory ratio: {median['meta'] / median['full']:.2f}")
    if args.plot:
        _plot(results, full_mib, args.plot)
        print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()

"""Loading a sharded checkpoint with resharding: saved on 2 ranks, loaded on 1 and on 2.

    python benchmarks/checkpoint_load.py [--dim 1024 --layers 8 --repeats 3 --save-world 2 --load-worlds 1 2]

One `torchrun` world saves the model and AdamW state with `f2.Checkpointer` (DCP, one shard
file per rank). Then fresh worlds of each load size alternate (1, 2, 2, 1, 1, 2, ...); each
builds the model, shards it for its own world size and times `Checkpointer.load()` (the
median of `--inner` loads in that world). DCP reshards on read, so a 1-rank world reads
every shard and a 2-rank world reads what matches its own. Every load is checked: the sum
of all weights must equal the one saved with the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

RESULT = "CHECKPOINT_LOAD_RESULT "


# --------------------------------------------------------------------------- worker (one rank)
def _build(dim: int, layers: int):
    import torch
    from torch import nn

    import fsdp2_strategy as f2

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])
    f2.shard_model(model, wrap_policy=[nn.Linear], log_plan=False)
    return model, torch.optim.AdamW(model.parameters())


def _weight_sum(model) -> float:
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        local = sum(float(p.to_local().double().sum()) for p in model.parameters())
    total = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total)


def _worker(mode: str, root: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import fsdp2_strategy as f2

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    model, opt = _build(args.dim, args.layers)
    ckpt = f2.Checkpointer(root)
    if mode == "save":
        model(torch.randn(4, args.dim)).sum().backward()
        opt.step()  # optimizer state exists, so it is saved (and loaded) too
        ckpt.save(1, model=model, optimizer=opt, extra={"weight_sum": _weight_sum(model)})
        result = {"saved": True}
    else:
        times = []
        for _ in range(args.inner):
            dist.barrier()
            start = time.perf_counter()
            extra = ckpt.load(model=model, optimizer=opt)
            times.append(time.perf_counter() - start)
        ok = abs(_weight_sum(model) - extra["weight_sum"]) <= 1e-6 * max(1.0, abs(extra["weight_sum"]))
        result = {"seconds": statistics.median(times), "ok": ok}
    if dist.get_rank() == 0:
        print(RESULT + json.dumps(result), flush=True)
    f2.shutdown()


# --------------------------------------------------------------------------- launcher
def _world(world: int, mode: str, root: Path, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        __file__,
        "--worker",
        mode,
        "--root",
        str(root),
        "--dim",
        str(args.dim),
        "--layers",
        str(args.layers),
        "--inner",
        str(args.inner),
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=args.timeout, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    raise RuntimeError(
        f"{mode} on {world} ranks failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="fresh worlds per load size")
    parser.add_argument("--inner", type=int, default=3, help="timed loads per world (median)")
    parser.add_argument("--save-world", type=int, default=2)
    parser.add_argument("--load-worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--worker", choices=["save", "load"], help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.root, args)
        return

    results: dict[int, list[float]] = {w: [] for w in args.load_worlds}
    all_ok = True
    with tempfile.TemporaryDirectory() as tmp:
        _world(args.save_world, "save", Path(tmp), args)
        size = sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file()) / 2**20
        for r in range(args.repeats):
            order = args.load_worlds if r % 2 == 0 else args.load_worlds[::-1]
            for world in order:
                res = _world(world, "load", Path(tmp), args)
                results[world].append(res["seconds"])
                all_ok &= res["ok"]
    import torch

    params = args.dim * (args.dim + 1) * args.layers
    print(
        f"checkpoint: {params / 1e6:.1f} M params fp32 + AdamW state ({size:.0f} MiB on disk), saved by "
        f"{args.save_world} ranks; torch {torch.__version__}; median of {args.repeats} worlds x {args.inner} loads"
    )
    print(f"{'load world':>10} {'resharded':>10} {'load() median s':>16}")
    base = statistics.median(results[args.save_world]) if args.save_world in results else None
    for world, times in results.items():
        print(f"{world:>10} {'yes' if world != args.save_world else 'no':>10} {statistics.median(times):>16.3f}")
    if base:
        for world, times in results.items():
            if world != args.save_world:
                print(
                    f"load on {world} / load on {args.save_world} ranks time ratio: {statistics.median(times) / base:.2f}"
                )
    print(f"weights after every load match the saved ones: {all_ok}")


if __name__ == "__main__":
    main()

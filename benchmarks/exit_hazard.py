"""How often does a gloo process that ran a DCP save die at interpreter exit?

torch 2.13 + gloo: a gloo worker thread can drop the last reference to tensors of DCP's
final `broadcast_object_list` while the main thread finalises the interpreter, and the
process aborts ("terminate called without an active exception", SIGABRT/SIGSEGV) although
the script finished (pytorch/pytorch#190489, #117762). This script launches 2-rank worlds as
ordinary processes (so each exits through normal interpreter finalisation), each saving a
small sharded model with DCP, and counts worlds in which any rank exited non-zero:

    python benchmarks/exit_hazard.py --runs 20 --modes plain barrier shutdown

Modes: `plain` (destroy_process_group, then return), `barrier` (barrier, destroy, return),
`shutdown` (`fsdp2_strategy.shutdown()`: barrier, destroy, flush, os._exit).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

WORKER = r"""
import os, sys, tempfile
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
import fsdp2_strategy as f2

mode, path = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
f2.shard_model(model, wrap_policy=[nn.Linear], log_plan=False)
dcp.save({"model": model.state_dict()}, checkpoint_id=path)
if mode == "shutdown":
    f2.shutdown()
if mode == "barrier":
    dist.barrier()
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(mode: str, world: int = 2, timeout: float = 120) -> list[int]:
    """Start one world, return each rank's exit code (negative: killed by that signal)."""
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in range(world):
            env = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", WORKER, mode, os.path.join(tmp, "ckpt")],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        return codes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--modes", nargs="+", default=["plain", "barrier", "shutdown"])
    args = parser.parse_args()
    failures = {m: [] for m in args.modes}
    start = time.time()
    for _ in range(args.runs):  # interleaved, so load and time affect every mode alike
        for mode in args.modes:
            codes = run_world(mode)
            if any(codes):
                failures[mode].append(codes)
    print(f"{'mode':<10} {'failed worlds':>14}  exit codes of failed worlds")
    for mode, bad in failures.items():
        print(f"{mode:<10} {len(bad):>6} / {args.runs:<6}  {bad[:5]}")
    print(f"({time.time() - start:.0f}s, torch {__import__('torch').__version__})")


if __name__ == "__main__":
    main()

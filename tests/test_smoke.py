"""Examples and benchmarks run end to end at tiny sizes, so none of them can rot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(script: str, *args: str, timeout: int = 300) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script, *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_plain_example_trains():
    out = _torchrun("examples/train_plain.py")
    losses = [float(line.split("loss ")[1].split()[0]) for line in out.splitlines() if " loss " in line]
    assert len(losses) >= 2 and losses[-1] < losses[0] / 5, losses  # it learns
    assert "FSDP2 sharding plan" in out and "last block" in out


def test_checkpoint_benchmark_runs():
    out = _torchrun("benchmarks/checkpoint_save.py", "--dim", "64", "--layers", "2", "--repeats", "1")
    assert "async/sync blocking ratio" in out


def test_exit_hazard_script_runs():
    proc = subprocess.run([sys.executable, "benchmarks/exit_hazard.py", "--runs", "1", "--modes", "shutdown"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "shutdown        0 / 1" in proc.stdout

"""`fsdp2_strategy.shutdown()`: exit code, process group destroyed, atexit hooks still run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from _harness import free_port

SCRIPT = r"""
import atexit, sys, tempfile
import torch.distributed as dist
import fsdp2_strategy as f2

report, port = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
abandoned = tempfile.TemporaryDirectory()  # never cleaned by hand: its finalizer runs at exit

def record():
    with open(report, "w") as f:
        f.write(f"{dist.is_initialized()} {abandoned.name}")

atexit.register(record)
f2.shutdown(3)
print("shutdown returned")
"""


def test_shutdown_destroys_the_group_runs_atexit_hooks_and_exits_with_the_code(tmp_path: Path):
    report = tmp_path / "report.txt"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(report), str(free_port())], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "shutdown returned" not in proc.stdout
    initialized, tmpdir = report.read_text().split()
    assert initialized == "False"  # the hook ran after the group was destroyed
    assert not Path(tmpdir).exists()  # TemporaryDirectory's weakref finalizer ran too

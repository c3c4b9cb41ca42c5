"""`fsdp2_strategy.init_distributed()` and `shutdown()`: group start with and without a launcher; exit code, group
destroyed, atexit hooks still run."""

from __future__ import annotations

from pathlib import Path

from helpers.harness import free_port, launch

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
    proc = launch("python", "-c", SCRIPT, report, free_port(), cwd=tmp_path, timeout=120, check=False)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "shutdown returned" not in proc.stdout
    initialized, tmpdir = report.read_text().split()
    assert initialized == "False"  # the hook ran after the group was destroyed
    assert not Path(tmpdir).exists()  # TemporaryDirectory's weakref finalizer ran too


INIT_SCRIPT = r"""
import sys
import torch.distributed as dist
import fsdp2_strategy as f2

device = f2.init_distributed(cpu=True)  # CPU on any machine: this test is about the group
again = f2.init_distributed(cpu=True)  # already started: same device, no second group
# One write per line: torchrun runs ranks with `python -u`, so print's pieces would interleave.
sys.stdout.write(f"INIT {dist.get_world_size()} {dist.get_rank()} {dist.get_backend()} {device} {again}\n")
f2.shutdown()
"""


def test_init_distributed_without_and_under_a_launcher(tmp_path: Path):
    """Plain `python`: a 1-rank gloo group of its own. torchrun with one process: env:// (a group on
    another port waited forever on torchrun's agent store, so the timeout fails it); with two: both ranks."""
    script = tmp_path / "init.py"
    script.write_text(INIT_SCRIPT)
    env = dict.fromkeys(("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))  # None: removed
    runs = {"plain": ("python", None)} | {f"torchrun{n}": ("torchrun", n) for n in (1, 2)}
    lines = {}
    for name, (kind, nproc) in runs.items():
        proc = launch(kind, script, cwd=tmp_path, nproc=nproc, env=env, timeout=90)
        lines[name] = sorted(line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("INIT"))
    assert lines["plain"] == [["1", "0", "gloo", "cpu", "cpu"]]
    assert lines["torchrun1"] == [["1", "0", "gloo", "cpu", "cpu"]]
    assert lines["torchrun2"] == [["2", "0", "gloo", "cpu", "cpu"], ["2", "1", "gloo", "cpu", "cpu"]]

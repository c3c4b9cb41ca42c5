"""The built wheel ships the adapters as fsdp2_strategy.integrations (a package-dir mapping)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_editable_install_maps_integrations():
    import fsdp2_strategy.integrations as integrations

    assert Path(integrations.__file__).resolve().parent == ROOT / "integrations"


def test_wheel_contains_core_and_integrations(tmp_path):
    pytest.importorskip("setuptools")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    wheel = next(tmp_path.glob("fsdp2_strategy-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = ("train", "estimate", "shard", "checkpoint", "fsdp1", "cli")
    assert {"fsdp2_strategy/__init__.py", "fsdp2_strategy/shard/sharding.py", "fsdp2_strategy/cli/__main__.py"} <= names
    assert all(f"fsdp2_strategy/{p}/__init__.py" in names for p in packages), sorted(names)
    assert "fsdp2_strategy/integrations/__init__.py" in names
    assert (
        "fsdp2_strategy/integrations/accelerate/accelerator.py" in names
        and "fsdp2_strategy/integrations/lightning/strategy.py" in names
    )
    assert (
        "fsdp2_strategy/integrations/fabric/strategy.py" in names
        and "fsdp2_strategy/integrations/_lightning_shared/config.py" in names
        and "fsdp2_strategy/integrations/transformers/trainer.py" in names
        and "fsdp2_strategy/checkpoint/peft.py" in names
    )
    assert not any(n.startswith("integrations/") for n in names)
    # The wheel imports on its own (unpacked beside nothing else of the repo).
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    code = "import fsdp2_strategy, fsdp2_strategy.integrations as i; print(i.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert str(target) in out.stdout

"""The release: the built wheel ships the adapters as fsdp2_strategy.integrations (a package-dir
mapping), its version is the package's one version, it carries the licence; the command line has a
version and help text on every option."""

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
    code = (
        "import fsdp2_strategy, fsdp2_strategy.integrations as i; print(i.__file__); "
        "import fsdp2_strategy.integrations.lightning, fsdp2_strategy.integrations.fabric, "
        "fsdp2_strategy.integrations.accelerate, fsdp2_strategy.integrations.transformers, "
        "fsdp2_strategy.integrations.ray"
    )
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
    import fsdp2_strategy

    assert wheel.name.startswith(f"fsdp2_strategy-{fsdp2_strategy.__version__}-")
    assert f"fsdp2_strategy-{fsdp2_strategy.__version__}.dist-info/licenses/LICENSE" in names
    assert "Apache License" in (ROOT / "LICENSE").read_text()


def _options(parser):
    """(command path, action) of every option and positional argument, subcommands included."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from ((f"{name} {path}", a) for path, a in _options(sub))
        elif not isinstance(action, argparse._HelpAction):
            yield ("/".join(action.option_strings) or action.dest), action


def test_every_command_line_option_has_help_and_the_version_prints(capsys):
    import fsdp2_strategy
    from fsdp2_strategy.cli import build_parser, main

    options = list(_options(build_parser()))
    assert len(options) >= 40  # the five subcommands' options
    assert [path for path, action in options if not action.help] == []
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"fsdp2-strategy {fsdp2_strategy.__version__}"
    assert "plan" in build_parser().description and "tune" in build_parser().description

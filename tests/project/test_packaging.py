"""The release: the sdist and the wheel build, install into a clean virtualenv; the wheel ships the adapters as fsdp2_strategy.integrations (a package-dir
mapping), its version is the package's one version, it carries the licence; the command line has a
version and help text on every option."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from helpers import ROOT


def test_editable_install_maps_integrations():
    import fsdp2_strategy.integrations as integrations

    assert Path(integrations.__file__).resolve().parent == ROOT / "integrations"


def test_sdist_and_wheel_build_and_install_into_a_clean_venv(tmp_path):
    """`python -m build` (the wheel built from the sdist, so the sdist is complete), installed with
    pip into a new virtualenv: every adapter imports from there and the console script runs."""
    pytest.importorskip("build")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path / "dist"), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import fsdp2_strategy

    version = fsdp2_strategy.__version__
    wheel = tmp_path / "dist" / f"fsdp2_strategy-{version}-py3-none-any.whl"
    sdist = tmp_path / "dist" / f"fsdp2_strategy-{version}.tar.gz"
    assert wheel.is_file() and sdist.is_file(), sorted(p.name for p in (tmp_path / "dist").iterdir())
    with tarfile.open(sdist) as tar:
        in_sdist = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert {"LICENSE", "README.md", "pyproject.toml", "integrations/lightning/strategy.py"} <= in_sdist
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = ("train", "estimate", "shard", "checkpoint", "fsdp1", "cli", "migrate", "tuning")
    assert all(f"fsdp2_strategy/{p}/__init__.py" in names for p in packages), sorted(names)
    assert {
        "fsdp2_strategy/integrations/accelerate/accelerator.py",
        "fsdp2_strategy/integrations/lightning/strategy.py",
        "fsdp2_strategy/integrations/fabric/strategy.py",
        "fsdp2_strategy/integrations/_lightning_shared/config.py",
        "fsdp2_strategy/integrations/transformers/trainer.py",
    } <= names
    assert not any(n.startswith("integrations/") for n in names)
    assert f"fsdp2_strategy-{version}.dist-info/licenses/LICENSE" in names
    assert "Apache License" in (ROOT / "LICENSE").read_text()

    # A new virtualenv; pip installs the wheel into it. Its dependencies (torch, the frameworks) come from
    # this environment's site-packages, appended after the new venv's own, so the package is the installed one.
    venv = tmp_path / "clean"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index"]
    proc = subprocess.run([*install, str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    site = next(venv.glob("lib/python*/site-packages"))
    # Read, not edited: the test environment's site-packages, for the clean venv's .pth below.
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (site / "zz_dependencies.pth").write_text("\n".join(deps) + "\n")
    code = (
        "import fsdp2_strategy, fsdp2_strategy.integrations as i; print(fsdp2_strategy.__file__, i.__file__); "
        "import fsdp2_strategy.integrations.lightning, fsdp2_strategy.integrations.fabric, "
        "fsdp2_strategy.integrations.accelerate, fsdp2_strategy.integrations.transformers, "
        "fsdp2_strategy.integrations.ray"
    )
    clean_env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run(
        [str(python), "-c", code], cwd=tmp_path, capture_output=True, text=True, env=clean_env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [
        str(site / "fsdp2_strategy" / "__init__.py"),
        str(site / "fsdp2_strategy" / "integrations" / "__init__.py"),
    ]
    cli = subprocess.run(
        [str(venv / "bin" / "fsdp2-strategy"), "--version"], capture_output=True, text=True, env=clean_env, timeout=120
    )
    assert cli.returncode == 0 and cli.stdout.strip() == f"fsdp2-strategy {version}", cli.stdout + cli.stderr


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

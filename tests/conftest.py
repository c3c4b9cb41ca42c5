"""What the test files share: the markers, and the fixtures several files use.

Being at the top of tests/, this file puts tests/ on the path of every test (pytest's default import
mode adds a root conftest's folder): tests import `helpers.<module>`, and the processes
`helpers.harness.launch` starts get tests/ on PYTHONPATH. The layout is in CONTRIBUTING.md.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

DEEPSPEED = "deepspeed==0.19.8"
DEEPSPEED_DEPENDENCIES = ["einops", "hjson", "py-cpuinfo", "ninja"]  # DeepSpeed's requirements the dev extra lacks
UNREACHABLE = ("Could not find a version", "No matching distribution", "NewConnectionError", "Temporary failure")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long multi-process tests")


@pytest.fixture
def flows(runs) -> dict:
    """The every-flow launch's report, from a file's module-scoped `runs` fixture (test_accelerate,
    test_fabric, test_lightning); a file whose `flows` is its own launch defines it itself."""
    return runs["flows"]


@pytest.fixture(scope="session")
def deepspeed_path() -> Path:
    """DeepSpeed installed once beside the project's environment (`<venv>/deepspeed-0.19.8`), with
    `--no-deps` (torch and the rest come from the environment) and outside its site-packages: a test
    puts it on its processes' PYTHONPATH. Installing it into the environment would change how
    Accelerate, transformers and Lightning behave in every other test."""
    from helpers.harness import launch

    target = Path(sys.prefix) / DEEPSPEED.replace("==", "-")
    if (target / "deepspeed").is_dir():
        return target
    staging = target.with_name(f"{target.name}.partial-{os.getpid()}")  # one per worker process
    args = ["install", "-q", "--no-deps", "--target", staging, DEEPSPEED, *DEEPSPEED_DEPENDENCIES]
    proc = launch("python", "-m", "pip", *args, cwd=target.parent, timeout=600, check=False)
    if proc.returncode != 0:
        if any(text in proc.stderr for text in UNREACHABLE):
            pytest.skip(f"{DEEPSPEED} could not be installed (package registry unreachable): {proc.stderr[-300:]}")
        raise AssertionError(f"{' '.join(proc.args)} failed:\n{proc.stderr[-3000:]}")
    try:
        staging.rename(target)  # whole or not at all
    except OSError:  # another worker's install got there first: use it
        shutil.rmtree(staging, ignore_errors=True)
    return target

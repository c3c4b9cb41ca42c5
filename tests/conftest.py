"""What the test files share: the markers, and the fixtures several files defined alike.

The subprocess launcher (`launch`) and the in-process worlds (`run_distributed`) live in
`_harness.py`, which tests and scripts import by name (pytest and `launch` put tests/ on the path).
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long multi-process tests")


@pytest.fixture
def flows(runs) -> dict:
    """The every-flow launch's report, from a file's module-scoped `runs` fixture (test_accelerate,
    test_fabric, test_lightning); a file whose `flows` is its own launch defines it itself."""
    return runs["flows"]

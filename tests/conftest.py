"""What the test files share: the markers, and the fixtures several files defined alike.

Being at the top of tests/, this file puts tests/ on the path of every test (pytest's default import
mode adds a root conftest's folder): tests import `helpers.<module>`, and the processes
`helpers.harness.launch` starts get tests/ on PYTHONPATH. The layout is in CONTRIBUTING.md.
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

"""What the tests share: the launcher and in-process worlds (`harness`), the flow scripts' reports and
named checks (`collect`, `checks`), models, collective counters, memory trackers and the scenario
builders several test files use. tests/ is on the path of every test (its conftest.py) and of every
process `harness.launch` starts, so everything imports `helpers.<module>`.
"""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
"""tests/."""

ROOT = TESTS.parent
"""The repository."""

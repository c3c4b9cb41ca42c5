"""Named sub-checks: the scenario asserts where it runs, the test file launches it and reports.

A flow script (`helpers.collect.run_flows`) builds `Checks(entry)` inside each flow and checks there, on every
rank, what it claims: `checks.below("grads equal one process (relative)", diff, 1e-5)`. Each check
records its name and, when it failed, what differed (got, expected); a failed check does not stop the
flow, so the ranks stay in step and the next checks still run. The test reads every rank's report
through `FlowReports` and calls `flows.assert_passed("flow", ...)`, which fails naming each failed
check, the ranks it failed on and what differed (as torch's `run_subtests` and Accelerate's test
scripts assert inside the scenario).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from helpers.harness import agreed_report


class Checks:
    """The named checks of one flow, recorded in its report entry under "checks" (name -> None when
    it held, else what differed). Every method returns whether the check held.

    Args:
        entry: the flow's report entry (the dict `run_flows` hands the flow).
    """

    def __init__(self, entry: dict) -> None:
        self._results: dict[str, str | None] = entry.setdefault("checks", {})

    def _record(self, name: str, failure: str | None) -> bool:
        if name in self._results:
            raise ValueError(f"check {name!r} recorded twice in one flow: give each check its own name")
        self._results[name] = failure
        return failure is None

    def that(self, name: str, ok: bool, detail: Any = None) -> bool:
        """`ok` is true; `detail` (the values it was judged on) is shown when it is not."""
        return self._record(name, None if ok else f"false{f' ({detail!r})' if detail is not None else ''}")

    def equal(self, name: str, got: Any, expected: Any) -> bool:
        """`got == expected`."""
        return self._record(name, None if got == expected else f"got {got!r}, expected {expected!r}")

    def below(self, name: str, value: float, bound: float) -> bool:
        """`value < bound` (a NaN fails)."""
        return self._record(name, None if value < bound else f"{value!r} is not below {bound!r}")

    def within(self, name: str, value: float, low: float, high: float) -> bool:
        """`low <= value <= high`."""
        return self._record(name, None if low <= value <= high else f"{value!r} is outside [{low!r}, {high!r}]")

    def close(self, name: str, got: float | Iterable[float], expected: float | Iterable[float], rel: float) -> bool:
        """Each of `got` within `rel` (relative) of the same place in `expected`, same length."""
        a = [got] if isinstance(got, (int, float)) else list(got)
        b = [expected] if isinstance(expected, (int, float)) else list(expected)
        bad = [i for i, (x, y) in enumerate(zip(a, b)) if not abs(x - y) <= rel * max(abs(y), 1e-8)]
        failure: str | None = None
        if len(a) != len(b):
            failure = f"{len(a)} values, expected {len(b)}: {a!r} vs {b!r}"
        elif bad:
            i = bad[0]
            worst = max(abs(a[j] - b[j]) / max(abs(b[j]), 1e-8) for j in bad)
            failure = f"{len(bad)} of {len(a)} differ by more than {rel:g} (relative; worst {worst:.3g}): "
            failure += f"first at [{i}], {a[i]!r} vs {b[i]!r}"
        return self._record(name, failure)

    def raises(self, name: str, fn: Callable[[], Any], error: type[BaseException], *fragments: str) -> str | None:
        """`fn()` raises `error` whose message holds every one of `fragments`; returns the message."""
        try:
            fn()
        except error as exc:
            message = str(exc)
            missing = [f for f in fragments if f not in message]
            self._record(name, f"message lacks {missing!r}: {message!r}" if missing else None)
            return message
        except Exception as exc:  # noqa: BLE001 - the wrong error is what this check reports
            self._record(name, f"raised {type(exc).__name__}: {exc}, expected {error.__name__}")
            return None
        self._record(name, f"did not raise, expected {error.__name__}")
        return None


class FlowReports(dict):
    """Rank 0's flow report (asserted equal on every rank outside `per_rank` and the checks), with every
    rank's report in `.ranks` for `assert_passed`.

    Args:
        reports: every rank's report, in rank order (`helpers.harness.rank_reports`).
        per_rank: dotted paths ("flow.key") each rank measures on its own, left out of the comparison.
    """

    def __init__(self, reports: list[dict], per_rank: Iterable[str] = ()) -> None:
        skip = {f"{flow}.checks" for report in reports for flow in report} | set(per_rank)
        super().__init__(agreed_report(reports, skip))
        self.ranks = reports

    def assert_passed(self, flow: str, *names: str) -> None:
        """Fail naming each check of `flow` that failed, with the ranks it failed on and what differed:
        the checks in `names`, or every check the flow ran. A named check no rank ran fails, and so
        does a flow that ran no check on some rank (it would pass without judging anything).
        """
        problems: dict[str, list[int]] = {}  # what went wrong -> the ranks it went wrong on
        for rank, report in enumerate(self.ranks):
            checks = report.get(flow, {}).get("checks", {})
            if not checks:
                problems.setdefault(f"ran no check of flow {flow!r}", []).append(rank)
            for name in names or checks:
                if name not in checks:
                    problems.setdefault(f"{name}: not run (the flow ran {sorted(checks)})", []).append(rank)
                elif checks[name] is not None:
                    problems.setdefault(f"{name}: {checks[name]}", []).append(rank)
        lines = [
            f"{what} (rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))})" for what, ranks in problems.items()
        ]
        assert not lines, f"flow {flow!r}, failed checks:\n  " + "\n  ".join(lines)

"""The multi-process harness itself: results, tracebacks, exit codes, hangs, timeouts (the suite relies on them)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from helpers.harness import DistributedTestError, agreed_report, launch, rank_reports, run_distributed, run_script


def _sum_ranks():
    import torch
    import torch.distributed as dist

    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_all_ranks_report(world):
    results = run_distributed(_sum_ranks, world)
    assert results == [(r, world, world * (world + 1) / 2) for r in range(world)]


@pytest.mark.parametrize("world", [1, 2])
def test_a_world_whose_port_was_taken_starts_again_on_another(world, monkeypatch):
    """Between `free_port()` and rank 0's store binding it, another process may take the port (a
    connection of another world): the world is started again instead of failing with EADDRINUSE."""
    import socket

    import helpers.harness as harness

    real = harness.free_port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        handed = []
        monkeypatch.setattr(
            harness, "free_port", lambda: handed.append(1) or (taken.getsockname()[1] if len(handed) == 1 else real())
        )
        assert run_distributed(_sum_ranks, world) == [(r, world, world * (world + 1) / 2) for r in range(world)]
    assert len(handed) == 2  # the taken port, then a free one


def _rank1_raises():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise KeyError("boom from rank one")
    dist.barrier()  # rank 0 would wait here forever without the harness


def test_exception_on_one_rank_fails_fast_with_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"(?s)rank 1.*KeyError: 'boom from rank one'"):
        run_distributed(_rank1_raises, 2, timeout=120)
    assert time.monotonic() - start < 60  # not the full timeout


def _hang():
    import time

    time.sleep(600)


def test_hanging_world_is_killed_on_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="timed out"):
        run_distributed(_hang, 2, timeout=3)
    assert time.monotonic() - start < 30


def _rank1_ends_its_process():
    import torch.distributed as dist

    if dist.get_rank() == 1:  # what `f2.shutdown()` does: barrier (rank 0's final one), destroy, exit 0
        dist.barrier()
        dist.destroy_process_group()
        os._exit(0)
    return "rank 0's result"


def test_a_rank_that_exits_0_without_a_result_fails():
    with pytest.raises(DistributedTestError, match="rank 1 exited with code 0 without a result") as info:
        run_distributed(_rank1_ends_its_process, 2, timeout=60)
    assert "rank 0" not in str(info.value)  # rank 0 returned, and its final barrier met rank 1's


def _exit_with(codes):
    import torch.distributed as dist

    # rank 0 hosts the store: leaving before rank 1 finished joining the group resets its connection
    dist.barrier()
    os._exit(codes[dist.get_rank()])


def test_expected_exit_codes_are_checked_rank_by_rank():
    assert run_distributed(_exit_with, 2, [3, 4], exit_codes=[3, 4], timeout=60) == [None, None]
    with pytest.raises(DistributedTestError, match="rank 1 exited without a result with code 4, expected 3") as info:
        run_distributed(_exit_with, 2, [3, 4], exit_codes=3, timeout=60)
    assert "rank 0" not in str(info.value)  # rank 0 did what was expected of it
    with pytest.raises(DistributedTestError, match="rank 0 exited without a result with code 0, expected 3"):
        run_distributed(_exit_with, 2, [0, 3], exit_codes=3, timeout=60)


def _rank1_raises_rank0_hangs():
    import time

    import torch.distributed as dist

    # Both ranks joined the group first: a rank 1 that fails while rank 0 is still connecting makes rank
    # 0's init_process_group raise ("Connection closed by peer"), not hang (seen once on CI).
    dist.barrier()
    if dist.get_rank() == 1:
        raise KeyError("boom from rank one")
    time.sleep(600)  # not in a collective: nothing ends it but the harness


def test_a_rank_hanging_after_another_failed_is_named_as_hung():
    start = time.monotonic()
    pattern = r"(?s)rank 0 hung: still running 1s after rank 1 went wrong.*rank 1 raised.*KeyError"
    with pytest.raises(DistributedTestError, match=pattern):
        run_distributed(_rank1_raises_rank0_hangs, 2, timeout=120, grace=1)
    assert time.monotonic() - start < 60  # not the full timeout


def _rank1_exits_rank0_hangs():
    import time

    import torch.distributed as dist

    dist.barrier()  # both ranks joined the group before one of them leaves
    if dist.get_rank() == 1:
        os._exit(143)
    time.sleep(600)


def test_a_rank_hanging_while_the_others_exit_as_expected_is_named_as_hung():
    with pytest.raises(DistributedTestError, match="rank 0 hung: still running when the world timed out") as info:
        run_distributed(_rank1_exits_rank0_hangs, 2, timeout=2, exit_codes=143)
    assert "rank 1" not in str(info.value)


def _rank1_crashes_in_a_kernel():
    import ctypes

    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 1:
        _read_address_zero(ctypes)
    dist.barrier()


def _read_address_zero(ctypes):
    ctypes.string_at(0)  # SIGSEGV, as a crash in a C++ kernel or in gloo


def test_a_rank_that_crashes_shows_where():
    """A fatal signal leaves no Python traceback of its own: the report carries faulthandler's stack."""
    pattern = r"(?s)rank 1 exited without a result with code -11 \(SIGSEGV\).*Segmentation fault.*_read_address_zero"
    with pytest.raises(DistributedTestError, match=pattern):
        run_distributed(_rank1_crashes_in_a_kernel, 2, timeout=60, grace=2)


def _sleep_in_a_named_function():
    import time

    time.sleep(600)


def _rank0_hangs_in_a_named_function():
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        _sleep_in_a_named_function()


def test_a_hung_rank_shows_where_it_hangs():
    pattern = r"(?s)rank 0 hung: still running when the world timed out.*in _sleep_in_a_named_function"
    with pytest.raises(DistributedTestError, match=pattern):
        run_distributed(_rank0_hangs_in_a_named_function, 2, timeout=2)


def _flows_world(out: str) -> None:
    import torch.distributed as dist
    from helpers.collect import run_flows

    def same(entry, work):
        entry["x"] = 1

    def fails_on_rank_1(entry, work):
        if dist.get_rank() == 1:
            raise ZeroDivisionError("only on rank one")
        entry["y"] = 2

    def after(entry, work):
        entry["z"] = 3

    run_flows([same, fails_on_rank_1, after], out, Path(out).parent)
    os._exit(0)  # as the scripts' f2.shutdown()


def test_a_flow_that_raised_on_rank_1_only_is_reported(tmp_path):
    """The flow scripts' reports: every rank writes its own, and the test reads them all; a rank whose
    flow raised stops there, with exit code 1."""
    out = tmp_path / "flows.json"
    run_distributed(_flows_world, 2, str(out), timeout=60, exit_codes=[0, 1])
    with pytest.raises(AssertionError, match=r"(?s)flow fails_on_rank_1 raised on rank 1:.*only on rank one"):
        rank_reports(out, 2)
    assert list(json.loads((tmp_path / "flows.rank1.json").read_text())) == ["same", "fails_on_rank_1"]
    assert json.loads((tmp_path / "flows.rank0.json").read_text())["after"] == {"z": 3}
    with pytest.raises(AssertionError, match=r"rank 2 wrote no report \(flows.rank2.json is missing\)"):
        rank_reports(out, 3)


def test_rank_reports_must_agree_but_where_each_rank_measures_its_own(tmp_path):
    out = tmp_path / "flows.json"
    for rank, seconds in enumerate([0.5, 0.7]):
        (tmp_path / f"flows.rank{rank}.json").write_text(json.dumps({"flow": {"x": [1, 2], "seconds": seconds}}))
    reports = rank_reports(out, 2)
    assert agreed_report(reports, ["flow.seconds"]) == {"flow": {"x": [1, 2], "seconds": 0.5}}
    with pytest.raises(
        AssertionError, match="rank 1's report differs from rank 0's:\nflow.seconds: rank 0 0.5, this rank 0.7"
    ):
        agreed_report(reports)


_LAUNCHER = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)  # as torchrun does
print("ranks started", flush=True)
time.sleep(60)
"""


def test_a_launcher_past_its_timeout_is_killed_with_the_ranks_it_started(tmp_path):
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)ran past its timeout \(2s\), killed.*ranks started"):
        run_script([sys.executable, "-c", _LAUNCHER], cwd=tmp_path, env=dict(os.environ), timeout=2)
    assert time.monotonic() - start < 30  # its rank, still holding the output open, was killed too


def test_a_failing_launch_names_the_script_its_exit_code_and_output_and_tests_is_on_the_path(tmp_path):
    """`launch` puts tests/ on PYTHONPATH (the script imports `helpers.harness` without editing sys.path) and a
    script that fails is named with its exit code and the end of its output."""
    script = tmp_path / "fails.py"
    script.write_text("import sys\nimport helpers.harness\nprint('imported', helpers.harness.__name__)\nsys.exit(3)\n")
    with pytest.raises(AssertionError, match=r"(?s)fails\.py'\] exited with code 3.*imported helpers.harness"):
        launch("python", script, cwd=tmp_path, timeout=60)
    proc = launch("python", script, cwd=tmp_path, timeout=60, check=False)
    assert proc.returncode == 3 and "imported helpers.harness" in proc.stdout


def test_checks_record_what_differed_and_the_report_names_the_failed_check_and_rank():
    from helpers.checks import Checks, FlowReports

    reports = []
    for rank in range(2):
        entry: dict = {"loss": 1.0}
        c = Checks(entry)
        assert c.below("grads equal one process", 1e-6 if rank == 0 else 3e-5, 1e-5) is (rank == 0)
        assert c.equal("groups", ["<root>", "a"], ["<root>", "a"])
        assert c.close("losses", [1.0, 2.0], [1.0, 2.0 + 1e-7], 1e-5)
        assert not c.close("short", [1.0], [1.0, 2.0], 1e-5)
        message = c.raises("typo named", lambda: {}["x"], KeyError, "'x'")
        assert message == "'x'"
        assert not c.raises("no raise", lambda: None, KeyError)
        with pytest.raises(ValueError, match="recorded twice"):
            c.that("groups", True)
        reports.append({"flow": entry})
    flows = FlowReports(reports)  # the checks differ by rank: left to assert_passed, not the agreement
    assert flows["flow"]["loss"] == 1.0
    flows.assert_passed("flow", "groups", "losses", "typo named")
    with pytest.raises(AssertionError) as failed:
        flows.assert_passed("flow")
    text = str(failed.value)
    assert "grads equal one process: 3e-05 is not below 1e-05 (rank 1)" in text
    assert "short: 1 values, expected 2" in text and "(ranks 0, 1)" in text
    assert "no raise: did not raise, expected KeyError (ranks 0, 1)" in text
    assert "groups" not in text
    with pytest.raises(AssertionError, match="missing: not run"):
        flows.assert_passed("flow", "missing")
    with pytest.raises(AssertionError, match="ran no check of flow 'other'"):
        flows.assert_passed("other")

"""The multi-process harness itself: results, tracebacks, exit codes, hangs, timeouts (the suite relies on them)."""

from __future__ import annotations

import os
import time

import pytest
from _harness import DistributedTestError, run_distributed


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

    if dist.get_rank() == 1:
        os._exit(143)
    time.sleep(600)


def test_a_rank_hanging_while_the_others_exit_as_expected_is_named_as_hung():
    with pytest.raises(DistributedTestError, match="rank 0 hung: still running when the world timed out") as info:
        run_distributed(_rank1_exits_rank0_hangs, 2, timeout=2, exit_codes=143)
    assert "rank 1" not in str(info.value)

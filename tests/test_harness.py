"""The multi-process harness itself: results, tracebacks, timeouts (the suite relies on them)."""

from __future__ import annotations

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

"""`FSDP2Config.host_allocator`: glibc's malloc keeps the buffers FSDP frees and re-allocates every step.

A subprocess measures the page faults of a freed and re-allocated buffer before and after
`keep_freed_memory` (the setting is process-wide, so it runs outside pytest's process); one
spawned 2-rank world checks that `shard_model` applies it on CPU under "auto", not under
"system", and that `sharding_plan` says which.
"""

from __future__ import annotations

import platform

import pytest
from helpers.harness import launch, run_distributed
from helpers.models import TinyGPT

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

_FAULTS = """
import resource, torch
from fsdp2_strategy.shard import host_memory

def faults_per_cycle():
    counts = []
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        buffer = torch.empty(12 * 2**20)  # 48 MiB: above glibc's largest automatic mmap threshold (32 MiB)
        buffer.fill_(1.0)
        del buffer
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return min(counts[1:])  # after the first cycle, which faults in either case

default = faults_per_cycle()
assert host_memory.keep_freed_memory() and host_memory.freed_memory_kept()
print(default, faults_per_cycle())
"""


@pytest.mark.skipif(not GLIBC, reason="tunes glibc's malloc")
def test_kept_memory_is_reused_without_page_faults(tmp_path):
    out = launch("python", "-c", _FAULTS, cwd=tmp_path, timeout=120)
    default, kept = map(int, out.stdout.split())
    # 48 MiB are 12 288 pages of 4 KiB: by default a fresh mmap faults every one in again; kept, none.
    assert default > 10_000 and kept < 100, (default, kept)


def _plan_line(model) -> str:
    import fsdp2_strategy as f2

    return next(line for line in str(f2.sharding_plan(model)).splitlines() if line.startswith("host memory"))


def _allocator_world() -> dict:
    import fsdp2_strategy as f2
    from fsdp2_strategy.shard import host_memory

    out = {"before": host_memory.freed_memory_kept()}
    model = f2.shard_model(TinyGPT(), host_allocator="system", log_plan=False)
    out["system"] = (host_memory.freed_memory_kept(), _plan_line(model))
    model = f2.shard_model(TinyGPT(), log_plan=False)  # "auto" on a CPU mesh
    out["auto"] = (host_memory.freed_memory_kept(), _plan_line(model))
    return out


@pytest.mark.skipif(not GLIBC, reason="tunes glibc's malloc")
def test_shard_model_keeps_freed_memory_on_cpu_unless_told_not_to():
    for r in run_distributed(_allocator_world, 2):
        assert r["before"] is False
        assert r["system"] == (False, "host memory: malloc's own settings")
        assert r["auto"] == (True, "host memory: glibc malloc keeps freed blocks for reuse")


def test_cache_without_glibc_names_the_field(monkeypatch):
    from fsdp2_strategy.shard import host_memory

    monkeypatch.setattr(host_memory, "_kept", False)
    monkeypatch.setattr(host_memory, "_glibc", lambda: None)
    assert host_memory.apply_host_allocator("auto", "cpu") is False  # nothing to tune: left alone
    with pytest.raises(ValueError, match="FSDP2Config.host_allocator='cache' needs glibc"):
        host_memory.apply_host_allocator("cache", "cpu")
    assert host_memory.apply_host_allocator("auto", "cuda") is False

"""Run a function on N CPU ranks (gloo) from a test, with tracebacks and a hard timeout.

`run_distributed(fn, world_size, *args)` spawns `world_size` processes, initialises a gloo
process group in each (with a collective timeout), calls `fn(*args)` and returns the list of
per-rank return values. If any rank raises, its traceback is re-raised in the test; if the
world does not finish within `timeout` seconds, every process is killed and the test fails.

Workers end with barrier, destroy, flush, `os._exit`: with torch 2.13 on gloo, a process
that ran a DCP save otherwise aborts at interpreter exit about 1 run in 5
(see fsdp2_strategy.distributed.shutdown).

Ranks are forked from a forkserver that imported torch and the core once (`PRELOAD`): a 2-rank
world starts in about 0.1 s instead of the 4 s two spawned interpreters take to import torch on
2 cores, which over the suite's worlds is minutes. Each rank still gets a fresh process, the
caller's environment and working directory (a forkserver's own would be those of its start).
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "fsdp2_strategy", "_harness"]
"""Imported once by the forkserver. torch's import starts one thread (OpenBLAS's, which handles
fork); lightning's starts another, so lightning is left to the ranks that use it."""

_context: Any = None


def _forkserver() -> Any:
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


class DistributedTestError(AssertionError):
    """A rank failed or the world timed out."""


def free_port() -> int:
    """A TCP port nobody listens on now (for a world's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    outdir: str,
    fn: Callable,
    args: tuple,
    parent_environ: dict,
    env: dict,
    pg_timeout: float,
) -> None:
    os.environ.clear()
    os.environ.update(parent_environ)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(env.pop("LOCAL_WORLD_SIZE", world_size)),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    os.environ.update({k: str(v) for k, v in env.items()})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # 2 cores shared by up to 4 ranks
    code = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout))
        result = fn(*args)
        payload = ("ok", result)
    except BaseException:  # DCP's CheckpointException is a BaseException
        payload = ("error", traceback.format_exc())
        code = 1
    try:
        data = pickle.dumps(payload)
    except Exception:
        data = pickle.dumps(("ok", repr(payload[1])))
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        f.write(data)
    if code == 0 and dist.is_initialized():
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception:
            code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_distributed(
    fn: Callable,
    world_size: int = 2,
    *args: Any,
    timeout: float = 180.0,
    env: dict | None = None,
) -> list[Any]:
    """Run `fn(*args)` on `world_size` gloo ranks; return each rank's result (rank order)."""
    ctx = _forkserver()
    parent_environ = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="f2dist-") as outdir:
        port = free_port()
        procs = []
        for rank in range(world_size):
            p = ctx.Process(
                target=_worker,
                args=(rank, world_size, port, outdir, fn, args, parent_environ, dict(env or {}), timeout),
            )
            p.start()
            procs.append(p)
        # Slack past the ranks' own collective timeout, so a rank can report its timeout first.
        limit = timeout + min(10.0, timeout)
        deadline = time.monotonic() + limit
        failure = None
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline:
                failure = f"timed out after {limit:.0f}s"
                break
            exited_bad = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if exited_bad:
                # Give the others a moment to report their own errors, then stop waiting.
                time.sleep(2)
                failure = f"rank(s) {exited_bad} exited with codes {[procs[r].exitcode for r in exited_bad]}"
                break
            time.sleep(0.05)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        results, errors = [], []
        for rank, p in enumerate(procs):
            path = os.path.join(outdir, f"rank{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    status, value = pickle.load(f)
                if status == "error":
                    errors.append(f"--- rank {rank} ---\n{value}")
                results.append(value)
            else:
                results.append(None)
                if failure is None and p.exitcode != 0:
                    failure = f"rank {rank} exited with code {p.exitcode} without a result"
        if errors:
            raise DistributedTestError("a rank raised:\n" + "\n".join(errors))
        if failure is not None:
            raise DistributedTestError(failure)
        bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise DistributedTestError(f"ranks exited non-zero after returning: {bad}")
        return results


def run_agreeing(fn: Callable, world_size: int = 2, *args: Any, **kwargs: Any) -> Any:
    """`run_distributed`, asserting that every rank returned the same result; returns that result.

    For worlds whose results are computed from collectively gathered values (full tensors,
    counts of symmetric collectives): a rank that diverged fails the test instead of being ignored.
    """
    results = run_distributed(fn, world_size, *args, **kwargs)
    for rank, result in enumerate(results[1:], start=1):
        difference = _first_difference(results[0], result)
        assert difference is None, f"rank {rank} disagrees with rank 0: {difference}"
    return results[0]


def _first_difference(a: Any, b: Any, path: str = "result") -> str | None:
    """Where `a` and `b` first differ (tensors compared by value), None when they are equal."""
    import torch

    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{path}: keys {sorted(map(repr, a.keys() ^ b.keys()))} on one side only"
        return next((d for k in a if (d := _first_difference(a[k], b[k], f"{path}[{k!r}]")) is not None), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b) and len(a) == len(b):
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := _first_difference(x, y, f"{path}[{i}]"))), None)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return None if a.dtype == b.dtype and torch.equal(a, b) else f"{path}: tensors differ"
    return None if a == b else f"{path}: {a!r} != {b!r}"


def assert_no_flow_failed(results: dict) -> None:
    """A flow script records a flow that raised as `{"error": traceback}`: fail with every traceback."""
    errors = {flow: entry["error"] for flow, entry in results.items() if isinstance(entry, dict) and "error" in entry}
    assert not errors, "\n".join(f"{flow}:\n{tb}" for flow, tb in errors.items())

"""Process-level helpers: rank-zero logging and a clean shutdown.

`shutdown()` exists because of a torch bug measured here (torch 2.13, gloo): a process that
ran a DCP save aborts at interpreter exit ("terminate called without an active exception",
SIGABRT, sometimes SIGSEGV) in about 1 run of 5. A gloo worker thread drops the last
reference to tensors from DCP's final `broadcast_object_list` and takes the GIL while the
main thread is finalising the interpreter (pytorch/pytorch#190489, #117762). Synchronising
every rank, destroying the process group, flushing, then leaving with `os._exit` skips the
finalisation that races with that thread.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

logger = logging.getLogger("fsdp2_strategy")


def is_distributed() -> bool:
    """True when a default process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Global rank (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """World size (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def log_rank_zero(message: str, *args, level: int = logging.INFO) -> None:
    """Log through the `fsdp2_strategy` logger on rank 0 only (other ranks stay quiet)."""
    if rank() == 0:
        logger.log(level, message, *args)


def shutdown(exit_code: int = 0, *, barrier_timeout: Optional[timedelta] = timedelta(seconds=60)) -> None:
    """End a distributed process without the exit-time abort described above; never returns.

    Call it as the last line of a training script on every rank. It waits for all ranks
    (a barrier, bounded by `barrier_timeout` when the backend supports it), destroys the
    process group, runs the `atexit` hooks, flushes stdout, stderr and logging, and exits
    with `exit_code`.
    """
    try:
        if dist.is_available() and dist.is_initialized():
            if dist.get_backend() == "gloo" and barrier_timeout is not None:
                dist.monitored_barrier(timeout=barrier_timeout)
            else:
                dist.barrier()
            dist.destroy_process_group()
    except Exception as exc:  # a peer already gone: still exit, but say so and fail the process
        print(f"fsdp2_strategy.shutdown: barrier/destroy failed: {exc}", file=sys.stderr)
        exit_code = exit_code or 1
    finally:
        # What a normal exit runs first (user atexit hooks, loggers, weakref finalizers such as
        # TemporaryDirectory cleanup); only the interpreter finalisation that races is skipped.
        atexit._run_exitfuncs()
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(exit_code)

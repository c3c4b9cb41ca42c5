"""Process-level helpers: starting the process group, rank-zero logging and a clean shutdown.

`shutdown()` exists because of a torch bug (seen on torch 2.13 with gloo): a process that
ran a DCP save sometimes aborts at interpreter exit ("terminate called without an active
exception", SIGABRT, sometimes SIGSEGV). A gloo worker thread drops the last
reference to tensors from DCP's final `broadcast_object_list` and takes the GIL while the
main thread is finalising the interpreter (pytorch/pytorch#190489, #117762). Synchronising
every rank, destroying the process group, flushing, then leaving with `os._exit` skips the
finalisation that races with that thread.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("fsdp2_strategy")


LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What a launcher (torchrun, `accelerate launch`, Lightning's subprocess launcher) sets for env://."""


def init_distributed(
    *, cpu: bool = False, timeout: timedelta | None = None, cpu_hint: str = "init_distributed(cpu=True)"
) -> torch.device:
    """Start the default process group (unless started) and return this process's device.

    - Under a launcher (`LAUNCHER_ENV` set): env://, one process included: torchrun's agent
      holds the store at MASTER_PORT and (TORCHELASTIC_USE_AGENT_STORE) makes every rank a
      client of it, so a group on another port would wait forever for a server.
    - Without one: a 1-rank group on a free local port (`fully_shard` needs a group).
    - On an accelerator (unless `cpu`): device index LOCAL_RANK and backend
      "cpu:gloo,<type>:<its backend>", so CPU tensors (DCP, offloaded state) have one too;
      otherwise gloo on CPU.

    Args:
        cpu: Use CPU and gloo even where an accelerator is available.
        timeout: The process group's timeout (None: torch's default).
        cpu_hint: The caller's CPU switch, named in the error raised when LOCAL_RANK has no device.

    Returns:
        This process's device: `cuda:<LOCAL_RANK>` (or another accelerator's), else `cpu`.

    Raises:
        RuntimeError: If LOCAL_RANK is not below the number of accelerator devices.
    """
    accel = torch.accelerator.current_accelerator() if not cpu and torch.accelerator.is_available() else None
    if accel is None:
        device, backend = torch.device("cpu"), "gloo"
    else:
        local_rank, count = int(os.environ.get("LOCAL_RANK", 0)), torch.accelerator.device_count()
        if local_rank >= count:
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but this machine has {count} {accel.type} device(s): start at most {count} "
                f"process(es) per node, or run on CPU with {cpu_hint}."
            )
        torch.accelerator.set_device_index(local_rank)
        device = torch.device(accel.type, local_rank)
        backend = f"cpu:gloo,{accel.type}:{dist.Backend.default_device_backend_map.get(accel.type, 'nccl')}"
    if dist.is_initialized():
        return device
    kwargs: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
    if all(k in os.environ for k in LAUNCHER_ENV):
        dist.init_process_group(backend, **kwargs)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, **kwargs)
    return device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_distributed() -> bool:
    """True when a default process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Global rank (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """World size (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def barrier() -> None:
    """Wait for every rank (a no-op without a process group)."""
    if is_distributed():
        dist.barrier()


def from_rank_zero(value: Any) -> Any:
    """Rank 0's `value` on every rank (a collective, so it synchronises like a barrier)."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def log_rank_zero(message: str, *args, level: int = logging.INFO) -> None:
    """Log through the `fsdp2_strategy` logger on rank 0 only (other ranks stay quiet)."""
    if rank() == 0:
        logger.log(level, message, *args)


_BEFORE_SHUTDOWN: list[weakref.WeakMethod] = []


def before_shutdown(method: Callable[[], None]) -> None:
    """Have `shutdown()` call the bound `method` first (while its owner lives): collective work that
    must end with the run, such as committing an asynchronous checkpoint still in flight."""
    _BEFORE_SHUTDOWN.append(weakref.WeakMethod(method))


def _run_before_shutdown() -> None:
    while _BEFORE_SHUTDOWN:
        method = _BEFORE_SHUTDOWN.pop(0)()
        if method is not None:
            method()


def shutdown(exit_code: int = 0, *, barrier_timeout: timedelta | None = timedelta(seconds=60)) -> None:
    """End a distributed process cleanly; never returns.

    Call it as the last line of a training script on every rank. It commits checkpoints still
    being written asynchronously (`before_shutdown`), waits for all ranks (a barrier, bounded by
    `barrier_timeout` when the backend supports it), destroys the process group, runs the `atexit`
    hooks, flushes stdout, stderr and logging, and exits with `exit_code`. Leaving with `os._exit`
    skips the interpreter finalisation in which a process that ran a DCP save on gloo can abort.

    Args:
        exit_code: The process's exit status; a failed barrier or destroy turns 0 into 1.
        barrier_timeout: How long the final barrier waits for the other ranks on gloo (None: a
            plain barrier, without a bound).
    """
    try:
        _run_before_shutdown()
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

"""Keep freed host memory inside the process: glibc's malloc tuned like a caching allocator.

FSDP frees and re-allocates the same large buffers every optimizer step: the gathered parameters,
the all-gather outputs, the unsharded gradients and the reduce-scatter buffers. glibc's malloc
serves blocks above its mmap threshold (128 KiB at start, raised by use to at most 32 MiB) with
fresh `mmap`s, and gives the top of its heap back to the OS once it exceeds the trim threshold
(twice the mmap threshold). So on CPU every step page-faults all those pages in again; DDP, which
keeps its buffers, does not. With the thresholds raised, the steps make no such page faults.

`keep_freed_memory` raises both thresholds with `mallopt`, so freed blocks stay in malloc's free
lists for the next step, as torch's CUDA caching allocator keeps freed device memory. Tensor memory
is unchanged; the process's resident memory stays at its high-water mark instead of shrinking after
a peak (`malloc_trim(0)` from libc gives it back on demand). The setting is process-wide, which is
why it is applied once per process and logged; `FSDP2Config.host_allocator` says whether
`shard_model` applies it.
"""

from __future__ import annotations

import ctypes
import logging
import platform

from ..config_checks import check_choice
from ..config_options import HOST_ALLOCATORS

MMAP_THRESHOLD = 1 << 30
"""Blocks below 1 GiB come from malloc's heap (reused) instead of a fresh mmap each time."""
TRIM_THRESHOLD = 2**31 - 1
"""Up to 2 GiB of free memory at the heap's top is kept (`mallopt` takes an int)."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
_log = logging.getLogger(__name__)
_kept = False


def _glibc() -> ctypes.CDLL | None:
    """The running glibc (None with another C library, e.g. musl or macOS's)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "mallopt") else None


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed blocks for reuse (see the module docstring). Process-wide and
    idempotent; returns False, changing nothing, where the C library is not glibc."""
    global _kept
    if _kept:
        return True
    libc = _glibc()
    if libc is None:
        return False
    # Both at once: setting either one also turns off glibc's own adjustment of the other, and the
    # trim threshold alone would leave the mmap threshold at 128 KiB (a fresh mmap per tensor).
    if not (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        raise RuntimeError(
            "glibc's mallopt refused M_MMAP_THRESHOLD/M_TRIM_THRESHOLD; "
            "set FSDP2Config.host_allocator='system' to leave malloc alone."
        )
    _kept = True
    _log.debug("glibc malloc keeps freed blocks: mmap threshold %d, trim threshold %d", MMAP_THRESHOLD, TRIM_THRESHOLD)
    return True


def freed_memory_kept() -> bool:
    """Whether this process's malloc was tuned by `keep_freed_memory`."""
    return _kept


def apply_host_allocator(host_allocator: str, device_type: str) -> bool:
    """What `shard_model` does with `FSDP2Config.host_allocator` for a mesh on `device_type`:
    "cache" tunes malloc (an error without glibc), "auto" does where the mesh is on CPU and the C
    library is glibc, "system" never. Returns whether malloc keeps freed memory now."""
    check_choice(host_allocator, HOST_ALLOCATORS, "FSDP2Config.host_allocator")
    if host_allocator == "cache":
        if not keep_freed_memory():
            raise ValueError(
                f"FSDP2Config.host_allocator='cache' needs glibc's malloc, and this process runs on "
                f"{platform.libc_ver()[0] or platform.system()}; use 'auto' or 'system'."
            )
        return True
    if host_allocator == "auto" and device_type == "cpu":
        return keep_freed_memory()
    return _kept

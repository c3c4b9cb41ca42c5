"""Accelerate's context parallelism (`ParallelismConfig(cp_size=N)`) on FSDP2Accelerator.

Stock Accelerate, with `cp_size > 1`, sets torch's ring rotation from `cp_handler`, attaches hooks
that drop each attention's mask (asking for a causal one) in `prepare`, and makes
`maybe_context_parallel(buffers=..., buffer_seq_dims=..., no_restore_buffers=...)` torch's
`context_parallel` on the mesh's "cp" dim. The same here, with the core's ring (which also runs on
CPUs), on the mesh the core shards over: FSDP over "dp_shard" x "cp", Accelerate's data loaders
giving every rank of a "cp" group the same batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp2_strategy.distributed import log_rank_zero
from fsdp2_strategy.mesh import CP_DIM
from fsdp2_strategy.sequence import ring_attention, set_ring_rotation

from . import _compat as compat


def set_rotation(parallelism: Any) -> None:
    """torch's way of passing keys and values around the ring, from `parallelism.cp_handler`
    ("allgather" or "alltoall"), as stock Accelerate sets it."""
    handler = getattr(parallelism, "cp_handler", None)
    strategy = getattr(handler, "cp_comm_strategy", None)
    if strategy:
        set_ring_rotation(strategy)


def cp_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The "cp" dim of the accelerator's mesh (None without context parallelism)."""
    names = mesh.mesh_dim_names if mesh is not None else None
    return mesh[CP_DIM] if names and CP_DIM in names else None


def prepare_for_context_parallel(model: nn.Module) -> None:
    """What stock `prepare` does to a model with `cp_size > 1`: hooks that drop each attention's
    mask and ask for a causal one (a mask cannot be split with the sequence)."""
    compat.attach_context_parallel_hooks(model)


_warned: list[bool] = []  # once per process, as stock Accelerate's `warning_once`


@contextlib.contextmanager
def maybe_context_parallel(
    mesh: DeviceMesh | None,
    buffers: list[torch.Tensor] | None,
    buffer_seq_dims: list[int] | None,
    no_restore_buffers: set[torch.Tensor] | None,
) -> Iterator[None]:
    """Accelerate's `maybe_context_parallel` on the accelerator's `mesh`: without a "cp" dim a
    warning (once) and nothing else, as stock Accelerate does."""
    ring = cp_mesh(mesh)
    if ring is None:
        if not _warned:
            _warned.append(True)
            log_rank_zero(
                "Context parallel training is not enabled, so maybe_context_parallel has no effect; pass "
                "ParallelismConfig(cp_size=N) (N > 1) to FSDP2Accelerator to enable it.",
                level=30,
            )
        yield
        return
    with ring_attention(ring, buffers or [], buffer_seq_dims or [], no_restore=no_restore_buffers or ()):
        yield

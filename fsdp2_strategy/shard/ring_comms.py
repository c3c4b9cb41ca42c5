"""FSDP's all-gather and reduce-scatter as point-to-point rings, for gloo process groups.

gloo has no reduce-scatter of its own: `reduce_scatter_tensor` all-reduces a copy of its whole
input and keeps one chunk, and its `all_gather_into_tensor` takes longer than an all-reduce of
the output's size; the rings below are faster than both on CPU (`benchmarks/ring_collectives.py`
measures them). A ring step
sends one chunk to the next rank and receives one from the previous, so each rank sends (N-1)/N
of the buffer once, the least any all-gather or reduce-scatter sends, through gloo's
`isend`/`irecv`.

FSDP2 takes replacements for its two collectives per parameter group (`FSDPModule.
set_custom_all_gather` / `set_custom_reduce_scatter`); `install_ring_comms` sets them where
`FSDP2Config.collectives` says. Memory: the reduce-scatter holds one output-sized receive buffer
while it runs, instead of gloo's copy of the whole input.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from .. import _torch_compat as tc
from ..config_checks import check_choice
from ..config_options import COLLECTIVES
from ..train import engine_state


class _Pending(dist.Work):
    """One ring step's send and receive as a single `Work` (FSDP waits on the `Work` it is given)."""

    def __init__(self, works: list) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout=None) -> bool:
        for work in self._works:
            work.wait()
        return True


def _start_ring_step(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup) -> _Pending:
    """Start sending `send` to the next rank of the ring and receiving `recv` from the previous one."""
    rank, world = group.rank(), group.size()
    ops = [
        dist.P2POp(dist.isend, send, group=group, group_peer=(rank + 1) % world),
        dist.P2POp(dist.irecv, recv, group=group, group_peer=(rank - 1) % world),
    ]
    return _Pending(dist.batch_isend_irecv(ops))


class _FreshBuffers:
    """`Comm.allocate` for both rings: a new buffer per call, as FSDP's default comms allocate."""

    def allocate(self, size: Sequence, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


def _check_sizes(name: str, full: torch.Tensor, chunk: torch.Tensor, world: int) -> None:
    if full.numel() != chunk.numel() * world:
        raise ValueError(
            f"{name}: the full buffer has {full.numel()} elements, not {world} x {chunk.numel()} "
            f"(the chunk's) for a group of {world} ranks."
        )


class RingAllGather(_FreshBuffers, tc.AllGather):
    """All-gather of equal chunks into a flat output, in N-1 ring steps."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        return self.ring_all_gather(output_tensor, input_tensor, group, async_op)

    @staticmethod
    def ring_all_gather(
        output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        rank, world = group.rank(), group.size()
        _check_sizes("RingAllGather", output, input, world)
        chunks = output.view(world, -1)
        if chunks[rank].data_ptr() != input.data_ptr():  # FSDP's copy-in usually wrote it in place
            chunks[rank].copy_(input.view(-1))
        if async_op and world == 2:
            # A single step: returned unfinished, so FSDP's forward prefetch overlaps it with compute.
            return _start_ring_step(chunks[rank], chunks[1 - rank], group)
        for step in range(world - 1):
            # Step s forwards the chunk received at step s-1 (at s=0 the rank's own).
            _start_ring_step(chunks[(rank - step) % world], chunks[(rank - step - 1) % world], group).wait()
        return None  # finished: FSDP waits only on a returned Work


class RingReduceScatter(_FreshBuffers, tc.ReduceScatter):
    """Sum or average of a flat input, each rank keeping its chunk, in N-1 ring steps.

    The input is reduced in place (FSDP does not read it afterwards); FSDP's premultiplied sums,
    which gloo does not offer anyway, go to torch's collective.
    """

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op=dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> dist.Work | None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            # `reduce_scatter_single` from torch 2.13, `reduce_scatter_tensor` before (looked up per call,
            # so collective counters that patch `torch.distributed` see it).
            reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            return reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        self.ring_reduce_scatter(output_tensor, input_tensor, group, average=op == dist.ReduceOp.AVG)
        return None

    @staticmethod
    def ring_reduce_scatter(
        output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, average: bool = False
    ) -> None:
        rank, world = group.rank(), group.size()
        _check_sizes("RingReduceScatter", input, output, world)
        chunks, out = input.view(world, -1), output.view(-1)
        recv = torch.empty_like(out)
        partial = chunks[(rank - 1) % world]
        for step in range(world - 1):
            # Rank r sends its running sum of chunk r-s-1 and receives the previous rank's sum of
            # chunk r-s-2, adding its own part; after N-1 steps it holds the whole sum of chunk r.
            _start_ring_step(partial, recv, group).wait()
            index = (rank - step - 2) % world
            partial = out if step == world - 2 else chunks[index]
            torch.add(chunks[index], recv, out=partial)
        if average:
            out.div_(world)


def _shard_group(module: FSDPModule) -> dist.ProcessGroup | None:
    """The process group `module`'s parameters are sharded over (None: not sharded, or several groups)."""
    groups = tc.param_groups(module)
    return tc.shard_process_group(groups[0]) if len(groups) == 1 else None


def install_ring_comms(model: nn.Module, collectives: str = "auto") -> int:
    """Give the FSDP groups of `model` the ring all-gather and reduce-scatter as `collectives` says:
    "auto" where the shard group's backend is gloo, "ring" on every sharded group, "torch" on none.
    Returns how many groups got them. Call after `fully_shard` (`shard_model` does)."""
    check_choice(collectives, COLLECTIVES, "FSDP2Config.collectives")
    if collectives == "torch":
        return 0
    # Stateless, so one of each serves every group.
    all_gather, reduce_scatter = RingAllGather(), RingReduceScatter()
    installed = 0
    for module in tc.fsdp_groups(model):
        group = _shard_group(module)
        if group is None or (collectives == "auto" and dist.get_backend(group) != "gloo"):
            continue
        module.set_custom_all_gather(all_gather)
        module.set_custom_reduce_scatter(reduce_scatter)
        engine_state(cast(nn.Module, module)).ring_comms = True  # for `sharding_plan`
        installed += 1
    return installed

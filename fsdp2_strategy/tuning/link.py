"""`measure_link`: latency and bandwidth of FSDP's collectives on the process group, from a sweep.

Each collective runs at a few buffer sizes, through the implementation FSDP uses there (the
point-to-point rings of `shard.ring_comms` where `FSDP2Config.collectives` puts them, torch's
collectives elsewhere). A call's time is the slowest rank's; the fit `time = latency + sent /
bandwidth` (least squares over the sizes, `sent` the bytes each rank sends, ring-counted as
`estimate_memory` counts them) gives `estimate.step_time.CollectiveFit`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..config_checks import check_choice
from ..config_options import COLLECTIVES
from ..estimate import CollectiveFit, Link
from ..mesh import collective_device
from ..shard import RingAllGather, RingReduceScatter

SWEEP_BYTES = (1 << 16, 1 << 20, 1 << 23)
"""Full-buffer sizes the sweep times (64 KiB, 1 MiB, 8 MiB of fp32)."""


def _uses_rings(collectives: str, group: dist.ProcessGroup | None) -> bool:
    return collectives == "ring" or (collectives == "auto" and dist.get_backend(group) == "gloo")


def _calls(collectives: str, group: dist.ProcessGroup | None) -> dict[str, Callable[[torch.Tensor], None]]:
    """One call of each collective on a full buffer `buf` (what FSDP gathers or reduces)."""
    world = dist.get_world_size(group)
    ring = _uses_rings(collectives, group)
    real_group = group if group is not None else dist.group.WORLD
    assert real_group is not None  # an initialised default group

    def all_gather(buf: torch.Tensor) -> None:
        chunk = buf.view(world, -1)[dist.get_rank(group)].clone()
        if ring:
            RingAllGather.ring_all_gather(buf, chunk, real_group)
        else:
            dist.all_gather_into_tensor(buf, chunk, group=group)

    def reduce_scatter(buf: torch.Tensor) -> None:
        out = torch.empty(buf.numel() // world, dtype=buf.dtype, device=buf.device)
        if ring:
            RingReduceScatter.ring_reduce_scatter(out, buf, real_group)
        else:
            dist.reduce_scatter_tensor(out, buf, group=group)

    def all_reduce(buf: torch.Tensor) -> None:
        dist.all_reduce(buf, group=group)

    return {"all_gather": all_gather, "reduce_scatter": reduce_scatter, "all_reduce": all_reduce}


def _sent(name: str, nbytes: int, world: int) -> float:
    ring = (world - 1) / world
    return nbytes * ring * (2 if name == "all_reduce" else 1)


def _time_calls(call: Callable[[torch.Tensor], None], buf: torch.Tensor, repeats: int, group) -> float:
    """Median seconds of one call, each call's time the slowest rank's."""
    times = []
    for _ in range(repeats + 1):  # the first is warm-up
        dist.barrier(group)
        start = time.perf_counter()
        call(buf)
        if buf.device.type != "cpu":
            torch.accelerator.synchronize()
        times.append(time.perf_counter() - start)
    slowest = torch.tensor(times[1:], dtype=torch.float64, device=collective_device())
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return statistics.median(slowest.tolist())


def fit_line(points: list[tuple[float, float]]) -> CollectiveFit:
    """Least-squares `seconds = latency + sent / bandwidth` through (sent bytes, seconds) points;
    a negative intercept becomes 0 and the slope is then refitted through the origin."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    latency = my - slope * mx
    if latency < 0 or slope <= 0:
        latency = max(latency, 0.0) if slope > 0 else my
        sxy = sum(x * (y - latency) for x, y in points)
        sx2 = sum(x * x for x, _ in points)
        slope = max(sxy / sx2 if sx2 else 0.0, 1e-15)
    return CollectiveFit(latency_s=latency, bytes_per_s=1.0 / slope)


def measure_link(
    group: dist.ProcessGroup | None = None,
    *,
    collectives: str = "auto",
    sizes: tuple[int, ...] = SWEEP_BYTES,
    repeats: int = 3,
) -> Link:
    """Time the collectives FSDP uses on a process group and fit latency and bandwidth to each.

    All-gather, reduce-scatter and all-reduce are swept over `sizes`; each fit is
    `seconds = latency + sent / bandwidth` through the median times. Every rank must call it;
    every rank returns the same `Link` (times are the slowest rank's).

    Args:
        group: The process group to measure (None: the world).
        collectives: How all-gather and reduce-scatter run, as `FSDP2Config.collectives`: "auto"
            (point-to-point rings on gloo, torch's collectives elsewhere), "ring" or "torch".
        sizes: Bytes of the full buffer (what FSDP gathers or reduces) at each point of the sweep.
        repeats: Timed calls per size and collective, after one warm-up call.

    Returns:
        The fitted latency and bandwidth of each collective and the group's size. On one rank
        nothing is sent: every fit is zero latency and infinite bandwidth.

    Raises:
        RuntimeError: If no process group is initialised.
        ValueError: If `collectives` is not "auto", "ring" or "torch".
    """
    if not dist.is_initialized():
        raise RuntimeError("measure_link needs an initialised process group (f2.init_distributed()).")
    check_choice(collectives, COLLECTIVES, "measure_link: collectives")
    world = dist.get_world_size(group)
    if world == 1:
        return Link({n: CollectiveFit(0.0, float("inf")) for n in ("all_gather", "reduce_scatter", "all_reduce")}, 1)
    device = collective_device()
    fits = {}
    for name, call in _calls(collectives, group).items():
        points = []
        for nbytes in sizes:
            numel = max(nbytes // 4 // world, 1) * world
            buf = torch.ones(numel, dtype=torch.float32, device=device)
            points.append((_sent(name, numel * 4, world), _time_calls(call, buf, repeats, group)))
        fits[name] = fit_line(points)
    return Link(fits, world)

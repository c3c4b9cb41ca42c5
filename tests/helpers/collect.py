"""What the flow scripts (tests/**/scripts/) and the tests reading their reports share: full copies of
sharded values, per-rank results gathered in rank order, relative differences, rank 0's JSON report,
and the flow scripts' reports, one per rank."""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor


def full(t: torch.Tensor) -> torch.Tensor:
    """Unsharded float copy (full_tensor() is a collective: every rank calls this)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().clone()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p) for n, p in model.named_parameters()}


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p.grad) for n, p in model.named_parameters()}


def gather(obj):
    """Every rank's `obj`, in rank order (a plain list in one process)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def max_rel_diff(a: dict, b: dict) -> float:
    """Largest relative difference ||a[k] - b[k]|| / ||b[k]|| over the keys of `b`."""
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)).item() for k in b)


def write_json(path: str, result: dict) -> None:
    """Rank 0 (or the only process) writes `result`."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(path).write_text(json.dumps(result, indent=1, default=str))


def rank_path(path: str | Path, rank: int) -> Path:
    """Where rank `rank` writes its report for `path` (OUT.json -> OUT.rank1.json)."""
    path = Path(path)
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def run_flows(flows: list[Callable[[dict, Path], None]], out_path: str, work: Path) -> None:
    """Run each flow on this rank and write this rank's report (`rank_path(out_path, rank)`) after
    every flow, so every rank's outcome reaches the test (the flows before one that hangs too).

    A flow that raises is recorded as `{"error": traceback}` and ends this process at once with exit
    code 1: this rank may be out of step with the others (waiting in a collective it never joins), and
    its exit ends their wait (gloo reports the closed connection) instead of the process group's
    timeout. The rank comes from the launcher's RANK: a failure before the group exists is reported.
    """
    rank = int(os.environ.get("RANK", "0"))
    result: dict = {}
    for flow in flows:
        result[flow.__name__] = entry = {}
        try:
            flow(entry, work)
        except (Exception, CheckpointException):  # DCP's CheckpointException is a BaseException
            entry["error"] = traceback.format_exc()
            print(f"[flow {flow.__name__} on rank {rank}]", entry["error"], file=sys.stderr, flush=True)
        rank_path(out_path, rank).write_text(json.dumps(result, indent=1, default=str))
        if "error" in entry:
            sys.stdout.flush()
            os._exit(1)

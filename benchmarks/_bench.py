"""Pieces the benchmarks share: the model, synthetic data, Lightning modules, step timing.

Not a public API: the benchmark scripts put this folder on `sys.path` and import it.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

BATCH_SEED = 1234


class Block(nn.Module):
    """A pre-norm MLP block (8 * dim**2 parameters): the unit every variant shards."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    """Input projection, `layers` blocks in a ModuleList (what `wrap_policy="auto"` picks), head."""

    def __init__(self, dim: int, layers: int, inputs: int = 32):
        super().__init__()
        self.inp = nn.Linear(inputs, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, 2)  # 2 rows: every rank of a 2-rank world owns a non-empty shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_net(dim: int, layers: int, seed: int = 0) -> Net:
    """The same initial weights on every rank and in every variant."""
    torch.manual_seed(seed)
    return Net(dim, layers)


def hand_shard(net: Net, mesh=None) -> Net:
    """What people write by hand: `fully_shard` on each block, then on the root."""
    from torch.distributed.fsdp import fully_shard

    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def batches(
    n: int, batch: int, inputs: int = 32, seed: int = BATCH_SEED, rank: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` (x, y) micro-batches of a fixed random regression task; different on each rank
    (this process's rank, or `rank` to make another rank's batches in one process)."""
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    gen = torch.Generator().manual_seed(seed + rank)
    w = torch.randn(inputs, 2, generator=torch.Generator().manual_seed(seed))
    out = []
    for _ in range(n):
        x = torch.randn(batch, inputs, generator=gen)
        out.append((x, x @ w))
    return out


def pin_to_core(rank: int) -> int | None:
    """Pin every thread of this process (gloo's included) to one of the cores it may use, chosen
    by `rank`, so the scheduler does not move ranks between cores mid-step; new threads inherit
    it. The core, or None where the OS has no affinity call."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    core = cores[rank % len(cores)]
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:  # a thread that ended meanwhile
            pass
    return core


def timed_steps(step: Callable[[int], None], steps: int) -> list[float]:
    """Seconds per call of `step(i)`, each call started on all ranks together (on an accelerator,
    until the device finished the step's work)."""
    times = []
    sync = torch.accelerator.synchronize if torch.accelerator.is_available() else lambda: None
    for i in range(steps):
        dist.barrier()
        sync()
        start = time.perf_counter()
        step(i)
        sync()
        times.append(time.perf_counter() - start)
    return times


def interleave(
    variants: dict[str, Callable[[], list[float]]], rounds: int, warmup: bool = True
) -> dict[str, list[float]]:
    """Run each variant once per round, interleaved A B, B A, A B, ... (the order alternates so
    that neither always runs first after the other); with `warmup`, a first round more, untimed."""
    results: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds + warmup):
        for name in names if r % 2 == 0 else names[::-1]:
            times = variants[name]()
            if r >= warmup:
                results[name].extend(times)
    return results


def print_ratio_table(results: dict[str, list[float]], baseline: str, title: str) -> None:
    """Median per step of each variant, its spread (25th-75th percentile) and its ratio to
    `baseline` (rank 0 prints). The spread says how much of a ratio is noise."""
    if dist.get_rank() != 0:
        return
    base = statistics.median(results[baseline])
    print(title)
    print(f"{'variant':<36} {'median s/step':>14} {'p25-p75':>15} {'ratio':>7} {'n':>4}")
    for name, times in results.items():
        med = statistics.median(times)
        q1, _, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else (med, med, med)
        print(f"{name:<36} {med:>14.4f} {q1:>7.3f}-{q3:<7.3f} {med / base:>7.3f} {len(times):>4}")


# --------------------------------------------------------------------------- Lightning
def lightning_module(dim: int, layers: int, *, shard_in_configure_model: bool, lr: float = 1e-3):
    """A LightningModule training `Net`; optionally applying `fully_shard` itself in configure_model."""
    import lightning.pytorch as pl
    import torch.nn.functional as F

    class BenchModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_net(dim, layers)

        def configure_model(self) -> None:
            # Lightning's ModelParallelStrategy requires the user to shard here, by hand.
            if shard_in_configure_model:
                hand_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=lr)

    return BenchModule()


def step_timer():
    """A Lightning callback recording the wall time of every optimizer step (rank-local)."""
    from lightning.pytorch.callbacks import Callback

    class StepTimer(Callback):
        def __init__(self):
            self.stamps: list[float] = []
            self._step = -1

        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step != self._step:  # an optimizer step happened in this batch
                self._step = trainer.global_step
                self.stamps.append(time.perf_counter())

        def intervals(self, skip: int = 2) -> list[float]:
            """Seconds between consecutive optimizer steps, the first `skip` dropped as warm-up."""
            return [b - a for a, b in zip(self.stamps, self.stamps[1:])][skip:]

    return StepTimer()


def tensor_loader(n_batches: int, batch: int):
    """A DataLoader over a fixed dataset (Lightning adds the DistributedSampler)."""
    from torch.utils.data import DataLoader, TensorDataset

    gen = torch.Generator().manual_seed(BATCH_SEED)
    w = torch.randn(32, 2, generator=gen)
    world = dist.get_world_size() if dist.is_initialized() else 1
    x = torch.randn(n_batches * batch * world, 32, generator=gen)
    return DataLoader(TensorDataset(x, x @ w), batch_size=batch)


def free_port() -> int:
    """A TCP port nobody listens on now, for a world's rendezvous (the default 29500 may still be held
    by the previous world's exiting processes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_fsdp2_config(*, layer: str, processes: int, mixed_precision: str, cpu: bool) -> str:
    """The text of an ordinary accelerate FSDP config file (the shape `accelerate config` writes) with
    fsdp_version 2: one group per `layer` class, full resharding, sharded `save_state`."""
    return f"""compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_machines: 1
num_processes: {processes}
machine_rank: 0
mixed_precision: '{mixed_precision}'
use_cpu: {str(cpu).lower()}
rdzv_backend: static
same_network: true
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: {layer}
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
"""


def repo_env() -> dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH (for a worker process)."""
    root = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def world_of_one_env() -> dict[str, str]:
    """`repo_env()` with torchrun's variables for a world of one rank (on a free port): what a
    benchmark's single-process worker is started with."""
    env = repo_env()
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    env.update(MASTER_PORT=str(free_port()))
    return env


def run_for_result(cmd: list[str], env: dict[str, str], timeout: float, marker: str, name: str) -> dict:
    """Run a worker process and return the JSON object its last `marker` line carries; a timeout, a
    non-zero exit or no such line gives `{"path": name, "error": ...}` instead."""
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"path": name, "error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith(marker)]
    if proc.returncode != 0 or not lines:
        return {"path": name, "error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-3000:]}"}
    return json.loads(lines[-1][len(marker) :])

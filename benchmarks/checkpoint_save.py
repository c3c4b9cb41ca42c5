"""What a checkpoint costs the training loop: synchronous, async (copy before `save()` returns) and
"overlap" (the copy runs behind the next forward and backward; the next optimizer step waits for it).

    torchrun --standalone --nproc_per_node=2 benchmarks/checkpoint_save.py [--dim 1024 --layers 8 --repeats 5]

Each round runs, interleaved so machine load affects all alike: one training step without a save
(the baseline), then for each mode `save()` followed at once by one training step. Per mode, medians:
how long `save()` blocks, how much longer the following step took than the baseline, their sum (the
stall: what the save cost training), and the time until the step is committed. The stall is
reported as a fraction of a synchronous save, and as the overhead per step when saving every
`--every` steps (stall / (every x baseline step)).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

import fsdp2_strategy as f2
from fsdp2_strategy import Checkpointer

MODES = {"sync": False, "async": True, "overlap": "overlap"}


def build(dim: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])
    f2.shard_model(model, wrap_policy=[nn.Linear], log_plan=False)
    opt = torch.optim.AdamW(model.parameters())
    train_step(model, opt, dim)  # materialise optimizer state so it is saved too
    return model, opt


def train_step(model: nn.Module, opt: torch.optim.Optimizer, dim: int) -> float:
    start = time.perf_counter()
    model(torch.randn(16, dim)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start


def save_then_step(ckpt: Checkpointer, step: int, model, opt, dim: int) -> tuple[float, float, float]:
    """(save() blocked, the next training step, save() to committed)."""
    dist.barrier()
    start = time.perf_counter()
    ckpt.save(step, model=model, optimizer=opt)
    blocked = time.perf_counter() - start
    next_step = train_step(model, opt, dim)
    ckpt.wait()
    return blocked, next_step, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--every", type=int, default=10, help="save interval (steps) for the overhead column")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    model, opt = build(args.dim, args.layers)
    root = [tempfile.mkdtemp(prefix="ckpt-bench-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root)  # one shared folder for all ranks
    savers = {mode: Checkpointer(f"{root[0]}/{mode}", keep_last=1, async_save=value) for mode, value in MODES.items()}
    rows: dict[str, list] = {mode: [] for mode in MODES}
    baseline = []
    for i in range(args.repeats + 1):
        dist.barrier()
        base = train_step(model, opt, args.dim)
        timings = {mode: save_then_step(saver, i, model, opt, args.dim) for mode, saver in savers.items()}
        if i > 0:  # the first round warms up every path
            baseline.append(base)
            for mode, timing in timings.items():
                rows[mode].append(timing)
    for saver in savers.values():
        saver.close()
    if dist.get_rank() == 0:
        report(model, rows, statistics.median(baseline), args.every)
    f2.shutdown()


def report(model: nn.Module, rows: dict[str, list], step: float, every: int) -> None:
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {params / 1e6:.1f} M params fp32 + AdamW state, world {dist.get_world_size()}, torch {torch.__version__}"
    )
    print(f"training step without a save (median): {step:.3f} s")
    header = ("mode", "save() blocks", "next step +", "stall", "committed", "stall / sync save", f"overhead @{every}")
    print("{:<8} {:>14} {:>12} {:>8} {:>10} {:>18} {:>13}".format(*header))
    med = {mode: [statistics.median(r[k] for r in rs) for k in range(3)] for mode, rs in rows.items()}
    sync_save = med["sync"][0]
    for mode, (blocked, next_step, committed) in med.items():
        stall = blocked + max(next_step - step, 0.0)
        print(
            f"{mode:<8} {blocked:>14.3f} {next_step - step:>12.3f} {stall:>8.3f} {committed:>10.3f} "
            f"{stall / sync_save:>18.3f} {stall / (every * step):>12.1%}"
        )


if __name__ == "__main__":
    main()

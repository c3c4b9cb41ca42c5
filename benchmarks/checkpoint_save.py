"""How long does `Checkpointer.save()` block the training loop, async vs. synchronous?

    torchrun --standalone --nproc_per_node=2 benchmarks/checkpoint_save.py [--dim 1024 --layers 8 --repeats 5]

Both modes save the same sharded model and AdamW state, interleaved (sync, async, sync, ...)
so machine load affects them alike. Reported per mode: median time `save()` blocks the
caller, and median time until the step is committed (`save()` + `wait()`), with the ratio.
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


def build(dim: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])
    f2.shard_model(model, wrap_policy=[nn.Linear], log_plan=False)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, dim)).sum().backward()
    opt.step()  # materialise optimizer state so it is saved too
    return model, opt


def time_save(ckpt: Checkpointer, step: int, model, opt) -> tuple[float, float]:
    dist.barrier()
    start = time.perf_counter()
    ckpt.save(step, model=model, optimizer=opt)
    blocked = time.perf_counter() - start
    ckpt.wait()
    committed = time.perf_counter() - start
    return blocked, committed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    model, opt = build(args.dim, args.layers)
    root = [tempfile.mkdtemp(prefix="ckpt-bench-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root)  # one shared folder for all ranks
    results = {"sync": [], "async": []}
    savers = {
        "sync": Checkpointer(f"{root[0]}/sync", keep_last=1),
        "async": Checkpointer(f"{root[0]}/async", keep_last=1, async_save=True),
    }
    for i in range(args.repeats + 1):
        for mode, saver in savers.items():
            timing = time_save(saver, i, model, opt)
            if i > 0:  # the first round warms up both paths
                results[mode].append(timing)
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in model.parameters())
        print(
            f"model: {params / 1e6:.1f} M params fp32 + AdamW state, world {dist.get_world_size()}, torch {torch.__version__}"
        )
        print(f"{'mode':<6} {'save() blocks (median s)':>26} {'until committed (median s)':>28}")
        med = {}
        for mode, rows in results.items():
            med[mode] = (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows))
            print(f"{mode:<6} {med[mode][0]:>26.3f} {med[mode][1]:>28.3f}")
        print(
            f"async/sync blocking ratio: {med['async'][0] / med['sync'][0]:.2f}  "
            f"commit-time ratio: {med['async'][1] / med['sync'][1]:.2f}"
        )
    f2.shutdown()


if __name__ == "__main__":
    main()

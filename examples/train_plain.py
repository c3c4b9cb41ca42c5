"""Plain PyTorch + the fsdp2_strategy core: shard, accumulate, clip, step, checkpoint.

    torchrun --standalone --nproc_per_node=2 examples/train_plain.py [--steps 20 --ckpt-dir runs/train_plain]
Runs on CPU (gloo) or accelerators (nccl, ...) alike. Run it twice: the second run resumes from the
latest checkpoint (on any number of ranks) and trains `--steps` more.
"""

import argparse
import contextlib
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fsdp2_strategy as f2


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def main(steps: int, accumulate: int, ckpt_dir: str, save_every: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = f2.init_distributed()  # gloo on CPU; on GPUs the device LOCAL_RANK, nccl (+ gloo for CPU tensors)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), *[Block(64) for _ in range(4)], nn.Linear(64, 1))
    # bf16 compute where the device has it natively (an AVX2-only CPU emulates it, many times slower)
    precision = "bf16" if f2.native_low_precision(torch.bfloat16, device.type) else None
    f2.shard_model(model, f2.FSDP2Config(wrap_policy="auto", mixed_precision=precision))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)  # after sharding
    ckpt = f2.Checkpointer(ckpt_dir, keep_last=2, async_save=True)
    start = 0
    if ckpt.latest_step() is not None:  # resume: weights, optimizer state and the step counter
        start = ckpt.load(model=model, optimizer=optimizer)["step"] + 1

    gen = torch.Generator().manual_seed(dist.get_rank())
    w_true = torch.randn(16, 1, generator=torch.Generator().manual_seed(42))
    for step in range(start, start + steps):
        for micro in range(accumulate):
            x = torch.randn(32, 16, generator=gen)
            y = x @ w_true
            # No reduce-scatter on all but the last micro-batch: gradients accumulate locally.
            with f2.no_sync(model) if micro < accumulate - 1 else contextlib.nullcontext():
                loss = F.mse_loss(model(x.to(device)).float(), y.to(device)) / accumulate
                loss.backward()
        norm = f2.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % save_every == 0:
            ckpt.save(step, model=model, optimizer=optimizer, extra={"step": step})  # returns before the write ends
        if step % 5 == 0 or step == start + steps - 1:
            f2.distributed.log_rank_zero(
                "step %d loss %.4f grad-norm %.3f", step, loss.item() * accumulate, norm.item()
            )
    ckpt.wait()  # commit the last asynchronous save
    f2.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--ckpt-dir", default="runs/train_plain")
    parser.add_argument("--save-every", type=int, default=10)
    args = parser.parse_args()
    main(args.steps, args.accumulate, args.ckpt_dir, args.save_every)

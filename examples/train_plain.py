"""Plain PyTorch + the fsdp2_strategy core: shard, accumulate, clip, step.

    torchrun --standalone --nproc_per_node=2 examples/train_plain.py
Runs on CPU (gloo) or GPUs (nccl) alike.
"""

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


def main(steps: int = 20, accumulate: int = 2) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), *[Block(64) for _ in range(4)], nn.Linear(64, 1))
    f2.shard_model(model, f2.FSDP2Config(wrap_policy="auto", mixed_precision="bf16"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)  # after sharding

    device = next(p.to_local().device for p in model.parameters() if hasattr(p, "to_local"))
    gen = torch.Generator().manual_seed(dist.get_rank())
    w_true = torch.randn(16, 1, generator=torch.Generator().manual_seed(42))
    for step in range(steps):
        for micro in range(accumulate):
            x = torch.randn(32, 16, generator=gen)
            y = x @ w_true
            sync = f2.no_sync(model) if micro < accumulate - 1 else torch.enable_grad()
            with sync:
                loss = F.mse_loss(model(x.to(device)).float(), y.to(device)) / accumulate
                loss.backward()
        norm = f2.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step % 5 == 0 or step == steps - 1:
            f2.distributed.log_rank_zero("step %d loss %.4f grad-norm %.3f", step, loss.item() * accumulate, norm.item())
    f2.shutdown()


if __name__ == "__main__":
    main()

"""The core API under Ray Train: sharded training, checkpoints reported to Ray, recovery from a killed worker.

    python examples/ray_train.py                                    # local Ray, 2 CPU workers (gloo)
    python examples/ray_train.py --kill-at 7                        # rank 1 SIGKILLs itself once at step 7
    python examples/ray_train.py --address auto --workers 8 --gpu --storage /shared/ray   # a running cluster

Ray starts the workers and their process group; `f2.init_distributed()` finds that group. Every
`--ckpt-every` steps a Checkpointer step is committed and reported (`ray.train.report`); after a
worker dies Ray restarts the group (`FailureConfig(max_failures=...)`), and the train function resumes
from the newest committed step (Ray's `ray.train.get_checkpoint()`, or a newer step in the Checkpointer
root whose report Ray lost, which is reported again). The Checkpointer root and Ray's storage must be on storage all
nodes share.
"""

import argparse
import os
import signal
import tempfile
from pathlib import Path

import ray
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from torch import nn

import fsdp2_strategy as f2
from fsdp2_strategy.integrations.ray import resume, save_and_report


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))


def batch(step: int, device: torch.device):
    """The global batch of `step` (the same on every attempt) and this rank's contiguous share of it."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 16, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    n = x.shape[0] // dist.get_world_size()
    part = slice(dist.get_rank() * n, (dist.get_rank() + 1) * n)
    return x[part].to(device), y[part].to(device)


def train_fn(config: dict) -> None:
    device = f2.init_distributed()  # the group Ray made
    model = f2.shard_model(make_model().to(device), f2.FSDP2Config(wrap_policy=[nn.Linear]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    checkpointer = f2.Checkpointer(config["ckpt_dir"], keep_last=2)
    extra = resume(checkpointer, model=model, optimizer=optimizer)  # None on the first attempt
    start = extra["step"] if extra else 0
    if dist.get_rank() == 0:
        print(f"attempt starting at step {start}", flush=True)
    for step in range(start + 1, config["steps"] + 1):
        x, y = batch(step, device)
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == config["kill_at"] and dist.get_rank() == 1 and not Path(config["ckpt_dir"], "killed").exists():
            Path(config["ckpt_dir"], "killed").touch()
            os.kill(os.getpid(), signal.SIGKILL)  # what a lost node looks like to Ray
        if step % config["ckpt_every"] == 0:
            save_and_report(
                checkpointer,
                step,
                {"loss": loss.item(), "step": step},
                model=model,
                optimizer=optimizer,
                extra={"step": step},
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--address", default=None, help="Ray cluster address ('auto' for a running cluster); default local"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--gpu", action="store_true", help="one GPU per worker (nccl, plus gloo for CPU tensors)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=0, help="SIGKILL rank 1 once after this step (0: never)")
    parser.add_argument("--max-failures", type=int, default=2)
    parser.add_argument("--storage", default=None, help="shared directory for Ray's storage and the checkpoints")
    args = parser.parse_args()
    storage = Path(args.storage or tempfile.mkdtemp(prefix="ray_train_"))
    ray.init(address=args.address, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    trainer = TorchTrainer(
        train_fn,
        train_loop_config={
            "steps": args.steps,
            "ckpt_every": args.ckpt_every,
            "kill_at": args.kill_at,
            "ckpt_dir": str(storage / "fsdp2_steps"),
        },
        # With GPUs, also a gloo backend for the CPU collectives of DCP and offloaded state.
        torch_config=TorchConfig(backend="cpu:gloo,cuda:nccl" if args.gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.gpu),
        run_config=RunConfig(
            name="fsdp2_ray_train",
            storage_path=str(storage / "ray"),
            failure_config=FailureConfig(max_failures=args.max_failures),
        ),
    )
    result = trainer.fit()
    print(f"final metrics {result.metrics}; latest checkpoint {result.checkpoint.path}")


if __name__ == "__main__":
    main()

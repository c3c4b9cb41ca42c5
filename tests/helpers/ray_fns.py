"""Ray train functions for tests/integrations/ray/test_ray.py, shipped to the workers by value (cloudpickle).

Each function trains the same small MLP on the same global batches as `reference_weights`
(one process, plain torch), each rank taking a contiguous half, and rank 0 writes the final
full weights to `config["out"]` for the test to compare.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import torch
from torch import nn

DIM, GLOBAL_BATCH, LR = 8, 8, 1e-2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, DIM, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def reference_weights(steps: int, optimizer: str) -> dict[str, torch.Tensor]:
    """One process, no sharding: the numbers every distributed run must reproduce."""
    model = make_model()
    opt = _optimizer(model, optimizer)
    for step in range(1, steps + 1):
        x, y = global_batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=LR) if name == "adam" else torch.optim.SGD(model.parameters(), lr=LR)


def _local(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = x.shape[0] // world
    return x[rank * n : (rank + 1) * n]


def _write_full_weights(model: nn.Module, out: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import fsdp2_strategy as f2

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if f2.distributed.rank() == 0:
        torch.save({k: v.clone() for k, v in state.items()}, out)


def _kill_once(marker: Path) -> None:
    """SIGKILL this process the first time only (the marker survives Ray's restart)."""
    if not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)


def core_train(config: dict) -> None:
    """Checkpointer + report/resume; rank 1 is SIGKILLed once mid-training and once inside a save."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    import fsdp2_strategy as f2
    from fsdp2_strategy.integrations.ray import resume, save_and_report

    device = f2.init_distributed()
    world_group = dist.group.WORLD
    assert f2.init_distributed() == device and dist.group.WORLD is world_group, "a second process group was made"
    rank, world = dist.get_rank(), dist.get_world_size()
    marks = Path(config["marks"])

    class KillInSave(f2.Checkpointer):
        """Rank 1 dies while writing its shards of step `kill_in_save` (once)."""

        def _storage_writer(self, path):
            writer = FileSystemWriter(str(path))
            if rank == 1 and path.name.endswith(f"{config['kill_in_save']:06d}"):
                original = writer.write_data

                def write_data(plan, planner):
                    _kill_once(marks / "killed-in-save")
                    return original(plan, planner)

                writer.write_data = write_data
            return writer

    model = f2.shard_model(make_model(), f2.FSDP2Config(wrap_policy=[nn.Linear]))
    opt = _optimizer(model, "adam")
    checkpointer = KillInSave(config["root"], keep_last=3)
    extra = resume(checkpointer, model=model, optimizer=opt)
    start = extra["step"] if extra else 0
    if rank == 0:
        with open(marks / "starts.jsonl", "a") as f:
            f.write(json.dumps({"start": start, "world": world, "backend": dist.get_backend()}) + "\n")
    for step in range(start + 1, config["steps"] + 1):
        x, y = global_batch(step)
        loss = nn.functional.mse_loss(model(_local(x, rank, world)), _local(y, rank, world))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == config["kill_in_train"] and rank == 1:
            _kill_once(marks / "killed-in-train")
        if step % config["every"] == 0:
            save_and_report(
                checkpointer,
                step,
                {"loss": loss.item(), "step": step},
                model=model,
                optimizer=opt,
                extra={"step": step},
            )
    _write_full_weights(model, config["out"])


def lightning_train(config: dict) -> None:
    """Trainer(strategy=RayFSDP2Strategy()) through Ray's prepare_trainer; ModelCheckpoint saves reported;
    rank 1 is SIGKILLed once after step `kill_at` and the restarted run resumes with `checkpoint_path`."""
    import lightning.pytorch as pl
    import ray.train
    import ray.train.lightning
    from lightning.pytorch.callbacks import ModelCheckpoint

    from fsdp2_strategy.integrations.ray.lightning import RayFSDP2Strategy, checkpoint_path

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model()

        def configure_model(self):
            pass  # the strategy shards by its wrap policy

        def training_step(self, batch, _):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return _optimizer(self, "sgd")

    class KillOnce(pl.Callback):
        def on_train_batch_end(self, trainer, *_):
            if trainer.global_step == config.get("kill_at") and trainer.global_rank == 1:
                _kill_once(Path(config["root"]).parent / "killed")

    # This rank's contiguous half of each global batch, in order; an epoch is `every` steps, so
    # each checkpoint ends one and a resumed run starts the next epoch (Lightning cannot resume a
    # plain DataLoader mid-epoch). The sampler picks the epoch's steps (Lightning calls set_epoch).
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    halves = [tuple(_local(t, rank, world) for t in global_batch(s)) for s in range(1, config["steps"] + 1)]
    data = torch.utils.data.TensorDataset(torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves]))
    per_epoch = config["every"] * (GLOBAL_BATCH // world)

    class EpochSampler(torch.utils.data.Sampler):
        epoch = 0

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __iter__(self):
            return iter(range(self.epoch * per_epoch, (self.epoch + 1) * per_epoch))

        def __len__(self) -> int:
            return per_epoch

    loader = torch.utils.data.DataLoader(data, batch_size=GLOBAL_BATCH // world, sampler=EpochSampler())
    module = Module()
    trainer = pl.Trainer(
        max_steps=config["steps"],
        accelerator="cpu",
        devices="auto",
        strategy=RayFSDP2Strategy(wrap_policy=[nn.Linear]),
        callbacks=[
            ModelCheckpoint(dirpath=config["root"], every_n_train_steps=config["every"], save_top_k=-1),
            KillOnce(),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer = ray.train.lightning.prepare_trainer(trainer)
    ckpt_path = checkpoint_path(config["root"])
    if rank == 0:
        with open(Path(config["root"]).parent / "starts.txt", "a") as f:
            f.write(f"{Path(ckpt_path).name if ckpt_path else None}\n")
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    _write_full_weights(module, config["out"])


def accelerate_train(config: dict) -> None:
    """FSDP2Accelerator configured from an accelerate config file (no `accelerate launch`)."""
    from torch.distributed.fsdp import FSDPModule

    from fsdp2_strategy.integrations.ray.accelerate import accelerator_from_config

    accelerator = accelerator_from_config(config["config_file"], plugin={"checkpoint_async_save": "overlap"})
    model = make_model()
    opt = _optimizer(model, "sgd")
    model, opt = accelerator.prepare(model, opt)
    # fsdp_transformer_layer_cls_to_wrap: Linear in the file -> every Linear is its own group
    assert all(isinstance(m, FSDPModule) for m in model if isinstance(m, nn.Linear)), "config file not applied"
    rank, world = accelerator.process_index, accelerator.num_processes
    for step in range(1, config["steps"] + 1):
        x, y = global_batch(step)
        loss = nn.functional.mse_loss(model(_local(x, rank, world)), _local(y, rank, world))
        opt.zero_grad()
        accelerator.backward(loss)
        opt.step()
        if step % 2 == 0:  # reported once committed: by the next save, and the last by wait_for_checkpoint
            accelerator.save_state(f"{config['root']}/state-{step}", metrics={"step": step, "loss": loss.item()})
    accelerator.wait_for_checkpoint()
    _write_full_weights(model, config["out"])

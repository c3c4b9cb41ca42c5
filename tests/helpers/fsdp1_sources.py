"""FSDP1 checkpoints in every format `f2.convert_fsdp1_checkpoint` reads, written by torch FSDP1 (and by
Lightning's and Accelerate's own FSDP1 save code) in one 2-rank world, plus what FSDP1 holds when it
continues: the reference the converted runs are compared with.

`save_sources(out)` runs on every rank of a 2-process gloo world: the DeepSpeed tests' model, data and
AdamW (`helpers.deepspeed_models`), wrapped with `FullyShardedDataParallel` (one unit per block, the root
holding the tied embedding, `use_orig_params=True`, fp32, CPU), trains K steps, writes

- `torch_sharded/`: `dcp.save({"model": ..., "optim": FSDP.optim_state_dict(...)})` under
  `SHARDED_STATE_DICT`, with `"step"` and `"scheduler"` entries of the caller's own;
- `torch_full/model.pt` and `torch_full/optim.pt`: `FULL_STATE_DICT` (rank 0's `torch.save`);
- `lightning_sharded/` and `lightning_full.ckpt`: Lightning's `FSDPStrategy` (its
  `lightning_module_state_dict`, `optimizer_state` and `save_checkpoint`, on this FSDP1 model: its
  Trainer refuses CPU, so the checkpoint dict around them is built here as the Trainer's would be);
- `accelerate_sharded/` and `accelerate_full/`: Accelerate's `save_fsdp_model` / `save_fsdp_optimizer`
  (both state dict types) and `save_accelerator_state` (scheduler, step, RNG states), the calls
  `Accelerator.save_state` makes for FSDP1 (its Accelerator turns FSDP into DDP on CPU),

then continues M steps; rank 0 writes `reference.pt` (parameters and Adam moments at the save and after
the M steps, and the learning rate).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, OptimStateKeyType, StateDictType
from torch.distributed.fsdp.api import FullOptimStateDictConfig
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from helpers.deepspeed_models import K_STEPS, M_STEPS, batch_for, lm_loss, make_model, make_optimizer, make_scheduler
from helpers.models import Block

FSDP = FullyShardedDataParallel


def _train(model, optimizer, scheduler, steps: range) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        idx, tgt = batch_for(step, rank, world)
        lm_loss(model, idx, tgt).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def _snapshot(model, optimizer, scheduler) -> dict:
    """Full trainable parameters and Adam moments by name (collective), the learning rate."""
    with FSDP.state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(rank0_only=False),
        FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False),
    ):
        params = model.state_dict()
        optim = FSDP.optim_state_dict(model, optimizer)
    trainable = {_clean(n) for n, p in model.named_parameters() if p.requires_grad}
    out: dict = {"param": {n: params[n].clone() for n in trainable}}
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = {n: optim["state"][n][key].clone() for n in trainable}
    out["lr"] = scheduler.get_last_lr()[0]
    return out


def _torch_saves(model, optimizer, scheduler, out: Path) -> None:
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {
            "model": model.state_dict(),
            "optim": FSDP.optim_state_dict(model, optimizer),
            "step": K_STEPS,
            "scheduler": scheduler.state_dict(),
        }
        dcp.save(state, checkpoint_id=out / "torch_sharded")
    full_model, full_optim = _full_model_state(model), _full_optim_state(model, optimizer)
    if dist.get_rank() == 0:
        (out / "torch_full").mkdir(exist_ok=True)
        torch.save(full_model, out / "torch_full" / "model.pt")
        torch.save(full_optim, out / "torch_full" / "optim.pt")


def _full_model_state(model) -> dict:
    """The full state dict on rank 0 (empty elsewhere), without `offload_to_cpu`: Lightning's and
    Accelerate's full saves turn it on, and FSDP1's unshard then crashes on CPU (SIGSEGV on torch 2.13)."""
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
        return model.state_dict()


def _full_optim_state(model, optimizer) -> dict:
    """`FSDP.optim_state_dict` under `FULL_STATE_DICT` on rank 0, without `offload_to_cpu` (on by
    default, and in Lightning's and Accelerate's full saves): on CPU, FSDP1 (torch 2.13) then returns
    every state of a parameter as views of one reused gather buffer, so `exp_avg` comes back equal to
    `exp_avg_sq`."""
    with FSDP.state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(rank0_only=True),
        FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
    ):
        return FSDP.optim_state_dict(model, optimizer)


def _lightning_saves(model, optimizer, scheduler, out: Path) -> None:
    from lightning.fabric.plugins.environments import TorchElasticEnvironment
    from lightning.pytorch.strategies import FSDPStrategy

    for kind, path in (("sharded", out / "lightning_sharded"), ("full", out / "lightning_full.ckpt")):
        strategy = FSDPStrategy(state_dict_type=kind, cluster_environment=TorchElasticEnvironment())
        strategy.model = model
        if kind == "sharded":
            model_state, optim_state = strategy.lightning_module_state_dict(), strategy.optimizer_state(optimizer)
        else:  # Lightning's full path, without offload_to_cpu (see _full_optim_state): rekeyed by position
            model_state, optim_state = _full_model_state(model), _full_optim_state(model, optimizer)
            if dist.get_rank() == 0:
                optim_state = FSDP.rekey_optim_state_dict(optim_state, OptimStateKeyType.PARAM_ID, model)
        checkpoint = {
            "epoch": 1,
            "global_step": K_STEPS,
            "pytorch-lightning_version": "2.6.6",
            "state_dict": model_state,
            "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 1}}}},
            "callbacks": {},
            "optimizer_states": [optim_state],
            "lr_schedulers": [scheduler.state_dict()],
        }
        strategy.save_checkpoint(checkpoint, path)


def _accelerate_saves(model, optimizer, scheduler, out: Path) -> None:
    from accelerate import PartialState
    from accelerate.checkpointing import save_accelerator_state
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer

    PartialState(cpu=True)  # the process group exists; Accelerate's logging asks for its state
    rank = dist.get_rank()
    accelerator = SimpleNamespace(num_processes=dist.get_world_size(), process_index=rank)
    for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        folder = out / f"accelerate_{kind.split('_')[0].lower()}"
        plugin = FullyShardedDataParallelPlugin(fsdp_version=1, state_dict_type=kind)
        if kind == "FULL_STATE_DICT":  # see _full_optim_state
            plugin.optim_state_dict_config = FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True)
        if kind == "SHARDED_STATE_DICT":
            save_fsdp_model(plugin, accelerator, model, folder)
        else:  # save_fsdp_model's own full path sets offload_to_cpu (see _full_model_state)
            state = _full_model_state(model)
            if rank == 0:
                folder.mkdir(parents=True, exist_ok=True)
                torch.save(state, folder / "pytorch_model_fsdp.bin")
        save_fsdp_optimizer(plugin, accelerator, optimizer, model, folder)
        save_accelerator_state(str(folder), [], [], [scheduler], [], rank, K_STEPS)


def save_sources(out: str) -> None:
    """On each rank of a 2-process world: train, save every format, continue (module docstring)."""
    out_dir = Path(out)
    model = FSDP(
        make_model(), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, device_id=torch.device("cpu")
    )
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer)
    _train(model, optimizer, scheduler, range(K_STEPS))
    at_save = {**_snapshot(model, optimizer, scheduler), "scheduler": scheduler.state_dict()}
    _torch_saves(model, optimizer, scheduler, out_dir)
    _lightning_saves(model, optimizer, scheduler, out_dir)
    _accelerate_saves(model, optimizer, scheduler, out_dir)
    _train(model, optimizer, scheduler, range(K_STEPS, K_STEPS + M_STEPS))
    continued = _snapshot(model, optimizer, scheduler)
    if dist.get_rank() == 0:
        torch.save({"at_save": at_save, "continued": continued}, out_dir / "reference.pt")
    dist.barrier()

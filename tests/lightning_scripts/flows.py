"""Lightning flows on 2 ranks under torchrun, in one world; writes what it measured to JSON.

Usage: torchrun --nproc_per_node=2 flows.py OUT.json WORKDIR [SINGLE_PROCESS_CKPT]

Each flow records its numbers under its own key. Every rank writes its own report (OUT.rank0.json,
OUT.rank1.json) after each flow; an exception is recorded as "error" for that flow and ends that rank
(`_collect.run_flows`): the test fails naming the flow and the rank.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed.checkpoint as dcp
from _checks import Checks
from _collect import full, run_flows
from _comm import collective_dtypes, count_collectives
from _models import ResidualBlock
from _precision import policy_grads, true_precision_update
from _slow_staging import copied_by, differing, full_state, slow_staging
from common import (
    LR,
    LitMLP,
    dataset,
    full_params,
    gather,
    loader,
    max_rel_diff,
    reference_step,
    trainer,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from resume_flows import resume_other_world_sizes
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

import fsdp2_strategy as f2
from fsdp2_strategy import _torch_compat as tc
from fsdp2_strategy.integrations.lightning import FSDP2MixedPrecision, FSDP2Strategy, FSDP2ThroughputMonitor

BATCH = 4  # per rank
TOL = 1e-5  # fp32 parity, relative


def _all_indices(model: LitMLP, steps: slice = slice(None)) -> list[int]:
    return [i for rank in gather(model.indices[steps]) for batch in rank for i in batch]


def _global_losses(model: LitMLP) -> list[float]:
    per_rank = gather(model.losses)
    return [sum(v) / len(v) for v in zip(*per_rank)]


def _fresh(seed: int = 0, **kwargs) -> tuple[LitMLP, LitMLP]:
    torch.manual_seed(seed)
    model = LitMLP(**kwargs)
    return model, copy.deepcopy(model)


def _rs(counts) -> int:
    return sum(v for k, v in counts.items() if k.startswith("reduce_scatter"))


def one_step_parity(out: dict, work: Path) -> None:
    """One step of `Trainer(strategy="fsdp2")` on 2 ranks against one process on the same global batch."""
    check = Checks(out)
    model, initial = _fresh()
    fit = trainer(max_steps=1)
    fit.fit(model, loader(BATCH))
    full = full_params(model)
    ref, _ = reference_step(initial, _all_indices(model))
    seen = model.seen
    check.equal("strategy is FSDP2Strategy", seen["strategy"], "FSDP2Strategy")
    check.that("the root module is sharded", isinstance(model, FSDPModule))
    check.equal("mesh dims", seen["mesh_dims"], ["data_parallel", "tensor_parallel"])
    check.equal("mesh shape", seen["mesh_shape"], [2, 1])
    check.equal(
        "groups by policy",
        [g.name for g in f2.sharding_plan(model).groups],
        ["<root>", "blocks.0", "blocks.1", "blocks.2"],
    )
    check.that("optimizer built on the shards", all(seen["optimizer_params_dtensor"]), seen["optimizer_params_dtensor"])
    first = gather(model.indices[0])
    check.that("each rank saw different samples", not set(first[0]) & set(first[1]), first)
    check.below("parameters equal one process's (relative)", max_rel_diff(full, ref), TOL)
    check.raises(
        "unknown wrap class named with its close match",
        lambda: trainer(FSDP2Strategy(wrap_policy=["ResidualBlok"]), max_steps=1).fit(LitMLP(), loader(BATCH)),
        ValueError,
        "'ResidualBlok'",
        "Did you mean 'ResidualBlock'",
    )


def registry_variants(out: dict, work: Path) -> None:
    """ "fsdp2_hybrid" and "fsdp2_cpu_offload": one step each, against one process."""
    for name in ("fsdp2_hybrid", "fsdp2_cpu_offload"):
        model, initial = _fresh()
        trainer(name, max_steps=1).fit(model, loader(BATCH))
        ref, _ = reference_step(initial, _all_indices(model))
        plan = f2.sharding_plan(model)
        out[name] = dict(
            mesh_shapes=sorted({str(g.mesh_shape) for g in plan.groups}),
            strategies=sorted({g.strategy for g in plan.groups}),
            offload=sorted({g.cpu_offload for g in plan.groups}),
            max_rel_diff=max_rel_diff(full_params(model), ref),
        )


def accumulation(out: dict, work: Path) -> None:
    model, initial = _fresh()
    with count_collectives() as counts:
        trainer(max_steps=1, accumulate_grad_batches=2).fit(model, loader(BATCH))
    ref, _ = reference_step(initial, _all_indices(model))
    plain, _ = _fresh()
    with count_collectives() as plain_counts:
        trainer(max_steps=2).fit(plain, loader(BATCH))
    out.update(
        groups=len(f2.sharding_plan(model).groups),
        micro_batches=len(model.losses),
        reduce_scatters=_rs(counts),
        reduce_scatters_two_plain_steps=_rs(plain_counts),
        max_rel_diff=max_rel_diff(full_params(model), ref),
    )


def accumulation_modes(out: dict, work: Path) -> None:
    """accumulate_grad_batches=2 under each FSDP2Config.accumulation mode: collectives and parity."""
    for mode in ("sync_each", "sync_last", "keep_gathered"):
        model, initial = _fresh()
        with count_collectives() as counts:
            trainer(FSDP2Strategy(accumulation=mode), max_steps=1, accumulate_grad_batches=2).fit(model, loader(BATCH))
        ref, _ = reference_step(initial, _all_indices(model))
        plan = f2.sharding_plan(model)
        out[mode] = dict(
            plan_mode=plan.accumulation,
            groups=len(plan.groups),
            reduce_scatters=_rs(counts),
            all_gathers=sum(v for k, v in counts.items() if k.startswith("all_gather")),
            max_rel_diff=max_rel_diff(full_params(model), ref),
        )


def clipping(out: dict, work: Path) -> None:
    for algorithm, value in (("norm", 0.05), ("value", 0.002)):
        model, initial = _fresh()
        fit = trainer(max_steps=1, gradient_clip_val=value, gradient_clip_algorithm=algorithm)
        fit.fit(model, loader(BATCH))
        ref, ref_norm = reference_step(initial, _all_indices(model), clip=(algorithm, value))
        unclipped, _ = reference_step(initial, _all_indices(model))
        norm = fit.strategy.precision_plugin.last_grad_norm
        out[algorithm] = dict(
            max_rel_diff=max_rel_diff(full_params(model), ref),
            unclipped_diff=max_rel_diff(full_params(model), unclipped),
            norm=None if norm is None else float(norm),
            ref_norm=ref_norm,
        )


def _policy_update(initial: LitMLP, model: LitMLP, dtype: torch.dtype, scale: float = 1.0) -> dict:
    """The weights one SGD step should give under a mixed policy, written out without the engine
    (tests/_precision.py): each rank's batch on a `dtype` copy under autocast, fp32 gradients averaged
    over the ranks (the loss multiplied by `scale`, the gradients divided by it), fp32 SGD."""
    _, xs, ys = dataset().tensors

    def loss(low, x, y):
        with torch.autocast("cpu", dtype=dtype):
            return nn.functional.mse_loss(low(x.to(dtype)).float(), y)

    batches = [[(xs[rank[0]], ys[rank[0]])] for rank in gather(model.indices)]
    grads = policy_grads(initial, batches, loss, dtype, scale)
    return {n: p.detach() - LR * grads[n] / scale for n, p in initial.named_parameters()}, grads


def _state_dtypes(fit) -> list[str]:
    return sorted({str(v.dtype) for s in fit.optimizers[0].state.values() for v in s.values() if torch.is_tensor(v)})


def precision(out: dict, work: Path) -> None:
    # bf16-mixed: the update against the policy written out; dtypes of weights, state and reductions.
    model, initial = _fresh(optimizer="momentum")
    fit = trainer(max_steps=1, precision="bf16-mixed")
    with collective_dtypes() as reductions:
        fit.fit(model, loader(BATCH))
    plan = f2.sharding_plan(model)
    expected, grads = _policy_update(initial, model, torch.bfloat16)
    momentum = {n: full(fit.optimizers[0].state[p]["momentum_buffer"]) for n, p in model.named_parameters()}
    out["bf16_mixed"] = dict(
        model.seen,
        plugin=type(fit.precision_plugin).__name__,
        stored_dtypes=sorted({str(p.dtype) for p in model.parameters()}),
        state_dtypes=_state_dtypes(fit),
        reductions=sorted(reductions),
        precision=sorted({g.precision for g in plan.groups}),
        update_diff=max_rel_diff(full_params(model), expected),
        momentum_diff=max_rel_diff(momentum, grads),
        fp32_update_diff=max_rel_diff(full_params(model), reference_step(initial, _all_indices(model))[0]),
    )

    # 16-mixed: an initial scale that does not overflow, so no step is skipped; then the update.
    model, initial = _fresh()
    scaler = ShardedGradScaler(device="cpu", init_scale=2.0**10, growth_interval=1000)
    fit = trainer(FSDP2Strategy(), max_steps=1, plugins=[FSDP2MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    with collective_dtypes() as reductions:
        fit.fit(model, loader(BATCH))
    expected, _ = _policy_update(initial, model, torch.float16, scale=2.0**10)
    out["fp16_mixed"] = dict(
        model.seen,
        scaler=type(fit.precision_plugin.scaler).__name__,
        sharded_scaler=isinstance(fit.precision_plugin.scaler, ShardedGradScaler),
        scale_after=float(scaler.get_scale()),
        reductions=sorted(reductions),
        stored_dtypes=sorted({str(p.dtype) for p in model.parameters()}),
        update_diff=max_rel_diff(full_params(model), expected),
    )

    # bf16-true: weights, compute and reduction in bf16; the update against one bf16 process.
    model, initial = _fresh()
    fit = trainer(max_steps=1, precision="bf16-true")
    with collective_dtypes() as reductions:
        fit.fit(model, loader(BATCH))
    _, xs, ys = dataset().tensors
    batches = [(xs[rank[0]].to(torch.bfloat16), ys[rank[0]].to(torch.bfloat16)) for rank in gather(model.indices)]
    expected = true_precision_update(
        initial, batches, lambda m, x, y: nn.functional.mse_loss(m(x).float(), y.float()), torch.bfloat16, LR
    )  # Lightning casts the whole batch, targets too
    out["bf16_true"] = dict(
        model.seen, reductions=sorted(reductions), update_diff=max_rel_diff(full_params(model), expected)
    )
    try:
        trainer(precision="64-true")
        out["double_error"] = None
    except ValueError as exc:
        out["double_error"] = str(exc)


def _plain_params(model: nn.Module) -> list[str]:
    """Managed parameters that are not DTensor shards (gathered, left so by a forward-only pass)."""
    return [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]


def evaluation(out: dict, work: Path) -> None:
    """validate/test/predict on a model that never trained, against one process; after each entry
    point (and a fit whose validation runs last) every parameter is its shard again."""
    model, initial = _fresh()
    fit = trainer()
    val = fit.validate(model, loader(BATCH, shuffle=False), verbose=False)[0]["val_sum"]
    plain = {"validate": _plain_params(model)}
    test = fit.test(model, loader(BATCH, shuffle=False), verbose=False)[0]["val_sum"]
    plain["test"] = _plain_params(model)
    preds = fit.predict(model, loader(BATCH, shuffle=False))
    plain["predict"] = _plain_params(model)
    trainer(max_steps=2, val_check_interval=2, limit_val_batches=1).fit(
        model, loader(BATCH), val_dataloaders=loader(BATCH, shuffle=False)
    )
    plain["fit"] = _plain_params(model)
    with torch.no_grad():
        model(dataset().tensors[1][:2])  # a forward outside the Trainer: the root stays gathered
    plain["own_forward"] = _plain_params(model)
    _, xs, ys = dataset().tensors
    with torch.no_grad():
        ref_out = initial(xs)
        ref_sum = torch.nn.functional.mse_loss(ref_out, ys, reduction="sum").item()
        pred_diff = max((p - ref_out[i]).abs().max().item() for i, p in preds)
    out.update(
        val=float(val),
        test=float(test),
        ref=ref_sum,
        pred_diff=pred_diff,
        root_is_fsdp=isinstance(model, FSDPModule),
        predicted=sum(len(i) for i, _ in preds),
        plain_after=plain,
    )


class ManualBlocks(LitMLP):
    """Written for ModelParallelStrategy: shards its blocks itself in configure_model."""

    def configure_model(self):
        for block in self.blocks:
            if not isinstance(block, FSDPModule):
                fully_shard(block, mesh=self.device_mesh["data_parallel"], reshard_after_forward=False)


class OwnTensorParallel(LitMLP):
    """Written for ModelParallelStrategy's default (TP over a node): parallelises a block itself."""

    def configure_model(self):
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        if not isinstance(self.blocks[0].fc.weight, DTensor):
            parallelize_module(self.blocks[0].fc, self.device_mesh["tensor_parallel"], ColwiseParallel())


def own_tp_with_default_strategy(out: dict, work: Path) -> None:
    """FSDP2Strategy() keeps tensor_parallel_size=1 and says so, once, when the module does TP itself."""
    import logging

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("fsdp2_strategy").addHandler(handler)
    try:
        for _ in range(2):  # a second fit in the same process does not repeat it
            torch.manual_seed(0)
            trainer(FSDP2Strategy(), max_steps=1).fit(OwnTensorParallel(), loader(BATCH))
    finally:
        logging.getLogger("fsdp2_strategy").removeHandler(handler)
    out["tp_notes"] = gather([m for m in records if "tensor_parallel_size=1" in m])


def manual_configure_model(out: dict, work: Path) -> None:
    torch.manual_seed(0)
    model = ManualBlocks()
    initial = LitMLP()
    initial.load_state_dict(model.state_dict())
    trainer(max_steps=1).fit(model, loader(BATCH))
    ref, _ = reference_step(initial, _all_indices(model))
    # The user's reshard_after_forward=False survives: no post-forward mesh (a private attribute).
    kept = [tc.post_forward_mesh_info(tc.param_groups(blk)[0]) is None for blk in model.blocks]
    out.update(
        groups=[g.name for g in f2.sharding_plan(model).groups],
        user_settings_kept=kept,
        max_rel_diff=max_rel_diff(full_params(model), ref),
    )


class _WeightsAtStart(pl.Callback):
    """The full weights when training starts: sharded and materialised, not yet updated."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.weights = full_params(pl_module)


def meta_init(out: dict, work: Path) -> None:
    start = _WeightsAtStart()
    fit = trainer(max_steps=1, callbacks=[start])
    torch.manual_seed(3)
    with fit.init_module(empty_init=True):
        model = LitMLP()
    out["meta_before"] = all(p.is_meta for p in model.parameters())
    fit.fit(model, loader(BATCH))
    # The module's own initialisation, reproduced in one process from the same generator state
    # (building on meta draws nothing); then one step from those weights against one process.
    own = LitMLP()
    torch.manual_seed(3)
    for module in own.modules():
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
    ref, _ = reference_step(own, _all_indices(model))
    out.update(
        meta_after=any(p.is_meta for p in model.parameters()),
        init_diff=max_rel_diff(start.weights, full_params(own)),
        max_rel_diff=max_rel_diff(full_params(model), ref),
    )


def _ckpt_trainer(dirpath: Path, epochs: int, **kwargs) -> pl.Trainer:
    callback = ModelCheckpoint(dirpath=dirpath, save_last=True, save_top_k=-1)
    return trainer(max_epochs=epochs, enable_checkpointing=True, callbacks=[callback], **kwargs)


class _SaveAtStart(pl.Callback):
    def __init__(self, path: Path):
        self.path = path

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)
        self.state_entries = len(trainer.optimizers[0].state)
        assert self.state_entries == 0, f"the save gave the optimizer state ({self.state_entries} entries)"


def checkpoints(out: dict, work: Path) -> None:
    ckpt_dir = work / "ckpts"
    # Uninterrupted reference: two epochs.
    ref, _ = _fresh(optimizer="adam")
    trainer(max_epochs=2).fit(ref, loader(BATCH))
    out["ref_losses"] = _global_losses(ref)
    ref_params = full_params(ref)

    first, _ = _fresh(optimizer="adam")
    _ckpt_trainer(ckpt_dir, 1).fit(first, loader(BATCH))
    out["first_losses"] = _global_losses(first)
    out["epoch0_params"] = {k: v.tolist() for k, v in full_params(first).items()}
    out["listing"] = sorted(p.name for p in ckpt_dir.iterdir())
    out["step_files"] = sorted(p.name for p in (ckpt_dir / "epoch=0-step=4.ckpt").iterdir())

    # ModelParallelStrategy's layout (the model under "state_dict", plain DCP, no checksums), as its
    # save_checkpoint writes it: FSDP2Strategy resumes from it too.
    mps = work / "mps_style.ckpt"
    optimizer = first.trainer.optimizers[0]
    dcp.save(
        {"state_dict": get_model_state_dict(first), "optimizer_0": get_optimizer_state_dict(first, optimizer)},
        checkpoint_id=mps,
    )
    if torch.distributed.get_rank() == 0:
        torch.save(torch.load(ckpt_dir / "last.ckpt" / "meta.pt", weights_only=False), mps / "meta.pt")
    torch.distributed.barrier()
    from_mps, _ = _fresh(seed=7, optimizer="adam")
    trainer(max_epochs=2).fit(from_mps, loader(BATCH), ckpt_path=mps)
    out["mps_resumed_diff"] = max_rel_diff(full_params(from_mps), ref_params)

    resumed, _ = _fresh(seed=7, optimizer="adam")  # other init: everything must come from the checkpoint
    _ckpt_trainer(ckpt_dir, 2).fit(resumed, loader(BATCH), ckpt_path="last")
    out["resumed_losses"] = _global_losses(resumed)
    out["resumed_diff"] = max_rel_diff(full_params(resumed), ref_params)

    top1 = work / "top1"  # save_top_k=1: the strategy removes the older sharded directory
    model, _ = _fresh(optimizer="adam")
    trainer(max_epochs=2, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=top1, save_top_k=1)]).fit(
        model, loader(BATCH)
    )
    torch.distributed.barrier()  # rank 0 removes the older directory: every rank lists after it did
    out["top1_listing"] = sorted(p.name for p in top1.iterdir())

    explicit = work / "explicit.ckpt"
    fit = trainer(max_epochs=1)
    model, _ = _fresh(optimizer="adam")
    fit.fit(model, loader(BATCH))
    fit.save_checkpoint(explicit)
    out["explicit_is_dir"] = explicit.is_dir() and (explicit / ".metadata").is_file()

    full_file = work / "full.ckpt"
    fit = trainer(FSDP2Strategy(state_dict_type="full"), max_epochs=1)
    model, _ = _fresh(optimizer="adam")
    fit.fit(model, loader(BATCH))
    fit.save_checkpoint(full_file)
    out["full_is_file"] = full_file.is_file()
    resumed, _ = _fresh(seed=7, optimizer="adam")
    trainer(FSDP2Strategy(state_dict_type="full"), max_epochs=2).fit(resumed, loader(BATCH), ckpt_path=full_file)
    out["full_resumed_losses"] = _global_losses(resumed)

    if len(sys.argv) > 3:  # 1 -> 2 ranks: a checkpoint one process wrote
        resumed, _ = _fresh(seed=7, optimizer="adam")
        trainer(max_epochs=2).fit(resumed, loader(BATCH), ckpt_path=sys.argv[3])
        out["from_single_losses"] = _global_losses(resumed)
        out["from_single_diff"] = max_rel_diff(full_params(resumed), ref_params)

    # A save before the first optimizer step (on_train_start) changes nothing, sharded or full
    # (torch's state-dict call would step Adam once), and a resume from it runs like `ref`.
    for kind in ("sharded", "full"):
        early = work / f"early_{kind}.ckpt"
        model, _ = _fresh(optimizer="adam")
        trainer(FSDP2Strategy(state_dict_type=kind), max_epochs=2, callbacks=[_SaveAtStart(early)]).fit(
            model, loader(BATCH)
        )
        out[f"early_{kind}_diff"] = max_rel_diff(full_params(model), ref_params)
    resumed, _ = _fresh(seed=7, optimizer="adam")
    trainer(max_epochs=2).fit(resumed, loader(BATCH), ckpt_path=work / "early_sharded.ckpt")
    out["early_resumed_diff"] = max_rel_diff(full_params(resumed), ref_params)

    damaged = work / "damaged.ckpt"
    if torch.distributed.get_rank() == 0:
        shutil.copytree(ckpt_dir / "last.ckpt", damaged)
        shard = damaged / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    torch.distributed.barrier()
    try:
        model, _ = _fresh(seed=7, optimizer="adam")
        trainer(max_epochs=2).fit(model, loader(BATCH), ckpt_path=damaged)
        out["damaged_error"] = None
    except ValueError as exc:
        out["damaged_error"] = str(exc)
    out["damaged_errors_all_ranks"] = gather(out["damaged_error"] is not None)


class LitLoRA(LitMLP):
    """LitMLP with PEFT LoRA injected into each block's `fc`; only the adapters train. The base comes
    from `base_seed`, the adapters' initial values from `lora_seed`."""

    def __init__(self, base_seed: int = 0, lora_seed: int = 1, **kwargs):
        import peft

        torch.manual_seed(base_seed)
        super().__init__(**kwargs)
        torch.manual_seed(lora_seed)
        config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["fc"], init_lora_weights="gaussian")
        peft.inject_adapter_in_model(config, self)
        for name, p in self.named_parameters():
            p.requires_grad = "lora_" in name


def peft_checkpoints(out: dict, work: Path) -> None:
    """Trainable-only sharded checkpoints through the Trainer ("auto" for PEFT layers): resume exactly
    on the same base, refuse another base, and store only the adapters."""
    ckpt_dir = work / "lora_ckpts"
    ref = LitLoRA(optimizer="adam")
    trainer(max_epochs=2).fit(ref, loader(BATCH))
    first = LitLoRA(optimizer="adam")
    _ckpt_trainer(ckpt_dir, 1).fit(first, loader(BATCH))
    names = dcp.FileSystemReader(str(ckpt_dir / "last.ckpt")).read_metadata().state_dict_metadata
    out["saved_model_keys"] = sorted(k for k in names if k.startswith("model."))
    out["frozen_base_entry"] = "frozen_base.model" in names
    resumed = LitLoRA(lora_seed=9, optimizer="adam")  # same base, other adapter values: all from the checkpoint
    _ckpt_trainer(ckpt_dir, 2).fit(resumed, loader(BATCH), ckpt_path="last")
    out["resumed_diff"] = max_rel_diff(full_params(resumed), full_params(ref))
    try:
        trainer(max_epochs=2).fit(
            LitLoRA(base_seed=5, optimizer="adam"), loader(BATCH), ckpt_path=ckpt_dir / "last.ckpt"
        )
        out["other_base_error"] = None
    except ValueError as exc:
        out["other_base_error"] = str(exc)


def _auto_budgets(config: f2.FSDP2Config, model) -> dict:
    """Budgets from the core planner's estimates (2 ranks, AdamW, no batch: what "auto" uses):
    one that FULL_SHARD fits and SHARD_GRAD_OP (less communication) does not, one that
    SHARD_GRAD_OP fits (NO_SHARD communicates as much with a larger peak), one below all."""
    est = {
        s: f2.estimate_memory(model, dataclasses.replace(config, sharding_strategy=s), world_size=2).peak_bytes
        for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
    }
    return {
        "estimates": est,
        "FULL_SHARD": (est["FULL_SHARD"] + est["SHARD_GRAD_OP"]) // 2,
        "SHARD_GRAD_OP": est["NO_SHARD"] * 2,
        "too_small": est["FULL_SHARD"] // 2,
    }


def _chosen(model) -> dict:
    """What the sharded model shows of the strategy: plan strategies, mesh shapes, reshard choices."""
    plan = f2.sharding_plan(model)
    return {
        "strategies": sorted({g.strategy for g in plan.groups}),
        "mesh_shapes": sorted({str(g.mesh_shape) for g in plan.groups}),
        "reshard": {g.name: g.reshard_after_forward for g in plan.groups},
    }


class AutoMLP(LitMLP):
    """LitMLP with 8 blocks of width 64: enough blocks that FULL_SHARD's peak is below SHARD_GRAD_OP's."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(8, 64), nn.Linear(64, 1)
        self.blocks = nn.ModuleList(ResidualBlock(64) for _ in range(8))


def auto_strategy(out: dict, work: Path) -> None:
    """FSDP2Strategy(sharding_strategy="auto", memory_budget=...): the planner's pick per budget."""
    budgets = _auto_budgets(FSDP2Strategy(sharding_strategy="FULL_SHARD").fsdp2_config, AutoMLP())
    out["estimates"] = budgets["estimates"]
    for expected in ("FULL_SHARD", "SHARD_GRAD_OP"):
        torch.manual_seed(0)
        model = AutoMLP()
        initial = copy.deepcopy(model)
        trainer(FSDP2Strategy(sharding_strategy="auto", memory_budget=budgets[expected]), max_steps=1).fit(
            model, loader(BATCH)
        )
        ref, _ = reference_step(initial, _all_indices(model))
        out[expected] = dict(_chosen(model), max_rel_diff=max_rel_diff(full_params(model), ref))
        out[expected]["rng_after"] = torch.get_rng_state().sum().item()
    try:
        trainer(FSDP2Strategy(sharding_strategy="auto", memory_budget=budgets["too_small"]), max_steps=1).fit(
            AutoMLP(), loader(BATCH)
        )
        out["too_small_error"] = None
    except ValueError as exc:
        out["too_small_error"] = str(exc)
    _throughput(out, work)


class TuneMLP(AutoMLP):
    """AutoMLP whose training_step reads nothing of the Trainer (the tuner's copies have none) and no
    values of meta tensors (the memory planner runs it on them)."""

    def training_step(self, batch, batch_idx):
        idx, x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if not idx.is_meta:
            self.indices.append(idx.tolist())
        self.log("loss", loss)
        return loss


def _throughput(out: dict, work: Path) -> None:
    """objective="throughput": the core tunes on the train loader's first batch and training_step's
    loss, caches the pick, shards with it on both ranks; a second fit reuses the cached pick."""
    import fsdp2_strategy.tuning.resolve as resolve

    cache = work / "lightning_tune.json"
    cache.unlink(missing_ok=True)  # both ranks, before the fit's first collective
    os.environ["FSDP2_TUNE_CACHE"] = str(cache)
    strategy = dict(sharding_strategy="auto", objective="throughput")
    torch.manual_seed(0)
    model = TuneMLP()
    initial = copy.deepcopy(model)
    trainer(FSDP2Strategy(**strategy), max_steps=1).fit(model, loader(BATCH))
    ref, _ = reference_step(initial, _all_indices(model))
    (entry,) = json.loads(cache.read_text()).values()
    out["throughput"] = dict(
        _chosen(model),
        groups=len(f2.sharding_plan(model).groups),
        every_rank=gather(str(f2.sharding_plan(model))),
        entry={k: entry[k] for k in ("label", "changes")},
        rows=[r["label"] for r in entry["table"]["rows"]],
        max_rel_diff=max_rel_diff(full_params(model), ref),
        rng_after=torch.get_rng_state().sum().item(),
    )

    def no_tuning(*args, **kwargs):
        raise AssertionError("tuned again although the decision was cached")

    resolve.tune, original = no_tuning, resolve.tune
    try:
        again = TuneMLP()
        trainer(FSDP2Strategy(**strategy), max_steps=1).fit(again, loader(BATCH))
        out["throughput"]["reused_same_plan"] = str(f2.sharding_plan(again)) == str(f2.sharding_plan(model))
    finally:
        resolve.tune = original
        del os.environ["FSDP2_TUNE_CACHE"]


class _AtEpochEnd(pl.Callback):
    """Records the whole training state when epoch 0 ends (before ModelCheckpoint saves it: Lightning
    runs checkpoint callbacks last) and when training ends, when each `strategy.save_checkpoint`
    returned, whether that save was still uncommitted when the next step began, and the mode of the
    strategy's background writer."""

    def __init__(self, path: Path):
        self.path, self.state, self.final, self.pending_next_step, self.mode = path, None, None, None, None
        self.save_returned: list[float] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        save = trainer.strategy.save_checkpoint

        def timed(*args, **kwargs):  # what ModelCheckpoint's trainer.save_checkpoint calls
            save(*args, **kwargs)
            self.save_returned.append(time.perf_counter())

        trainer.strategy.save_checkpoint = timed

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == 0:
            self.state = full_state(pl_module, trainer.optimizers[0])

    def on_train_batch_start(self, trainer: pl.Trainer, *_) -> None:
        if trainer.current_epoch == 1 and self.pending_next_step is None:
            self.pending_next_step = not self.path.exists()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.final = full_state(pl_module, trainer.optimizers[0])
        self.mode = getattr(trainer.strategy._saver, "mode", None)


def _saved_state(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the sharded checkpoint at `path`, whole, named as `full_state` names them: the
    model's entries by their names, the optimizer's as "optim.<parameter>.<state key>" (every rank
    reads all of it)."""
    reader = dcp.FileSystemReader(str(path))
    saved = reader.read_metadata().state_dict_metadata
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in saved.items()
        if isinstance(m, TensorStorageMetadata)
    }
    dcp.load(state, storage_reader=reader)
    names = {"model.": "", "optimizer_0.state.": "optim."}
    return {
        next((new + k[len(old) :] for old, new in names.items() if k.startswith(old)), k): v for k, v in state.items()
    }


def async_checkpoints(out: dict, work: Path) -> None:
    """checkpoint_async_save="overlap" through ModelCheckpoint: the epoch-0 save (its copy held back)
    is committed later (at teardown), holds the state of the save bit for bit although epoch 1 ran
    meanwhile, training is unchanged and a resume continues exactly. AsyncCheckpointIO (Lightning's
    own switch) means async_save=True."""
    ck = work / "async_ckpts"
    ref, _ = _fresh(optimizer="momentum")
    trainer(max_epochs=2).fit(ref, loader(BATCH, shuffle=False))
    probe = _AtEpochEnd(ck / "epoch=0-step=4.ckpt")
    model, _ = _fresh(optimizer="momentum")
    with slow_staging(0.5):
        trainer(
            FSDP2Strategy(checkpoint_async_save="overlap"),
            max_epochs=2,
            enable_checkpointing=True,
            callbacks=[probe, ModelCheckpoint(dirpath=ck, save_top_k=-1)],
        ).fit(model, loader(BATCH, shuffle=False))
    out["listing"] = sorted(p.name for p in ck.iterdir())
    out["pending_at_next_step"], out["mode"] = probe.pending_next_step, probe.mode
    # The epoch-0 save returned before its (held back) copy ended: it did not wait for it.
    out["copied_before_return"] = copied_by(probe.save_returned[0])
    # Parameters and optimizer state (momentum), bit for bit those of the save, although epoch 1
    # changed every one of them.
    out["saved_differs"] = differing(_saved_state(ck / "epoch=0-step=4.ckpt"), probe.state)
    out["keys"], out["changed_by_epoch_1"] = sorted(probe.state), differing(probe.final, probe.state)
    out["trained_diff"] = max_rel_diff(full_params(model), full_params(ref))
    resumed, _ = _fresh(seed=7, optimizer="momentum")
    probe = _AtEpochEnd(work / "none")
    trainer(
        max_epochs=2,
        plugins=[AsyncCheckpointIO()],
        enable_checkpointing=True,
        callbacks=[probe, ModelCheckpoint(dirpath=work / "asyncio_ckpts")],
    ).fit(resumed, loader(BATCH, shuffle=False), ckpt_path=ck / "epoch=0-step=4.ckpt")
    out["resumed_diff"] = max_rel_diff(full_params(resumed), full_params(ref))
    out["checkpoint_io_mode"] = probe.mode


class _MemoryLogger(Logger):
    """Keeps what it is given, on whichever rank calls it (Lightning's own loggers write on rank 0
    only by decoration; this one shows which ranks the callback logs from)."""

    name, version = "memory", 0

    def __init__(self):
        super().__init__()
        self.rows: list = []

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self.rows.append([step, dict(metrics)])


def throughput_monitor(out: dict, work: Path) -> None:
    """FSDP2ThroughputMonitor(every=2) over 4 optimizer steps of 2 micro-batches: what each rank logged."""
    logger = _MemoryLogger()
    model, _ = _fresh()
    trainer(max_steps=4, accumulate_grad_batches=2, logger=logger, callbacks=[FSDP2ThroughputMonitor(every=2)]).fit(
        model, loader(BATCH)
    )
    out["rows"] = gather(logger.rows)
    out["cpu_peak"] = f2.peak_flops("cpu").flops


FLOWS = [
    one_step_parity,
    registry_variants,
    accumulation,
    accumulation_modes,
    clipping,
    precision,
    evaluation,
    manual_configure_model,
    own_tp_with_default_strategy,
    meta_init,
    checkpoints,
    peft_checkpoints,
    async_checkpoints,
    auto_strategy,
    throughput_monitor,
    resume_other_world_sizes,
]


def main(out_path: str, work: str) -> None:
    run_flows(FLOWS, out_path, Path(work))
    f2.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

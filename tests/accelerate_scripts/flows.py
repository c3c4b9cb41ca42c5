"""FSDP2Accelerator flows on 2 ranks in one world; writes what it measured to JSON.

Usage (tests/ on the path, as `_harness.launch` puts it), in tests/accelerate_scripts/:

    PYTHONPATH=.. accelerate launch --config_file fsdp2.yaml flows.py OUT.json WORKDIR [FLOW,FLOW...]

Launched by `accelerate launch` with an ordinary accelerate FSDP config, so the plugin's
defaults come from the `FSDP_*` variables that config produces. Each flow records its numbers
under its own key; an exception is recorded as "error" for that flow (the test fails on it)
and the next flow runs.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from _collect import run_flows
from _comm import collective_dtypes, count_collectives
from _precision import policy_grads, tied_names
from _slow_staging import copied_by, differing, full_state, slow_staging
from accelerate import Accelerator
from accelerate.tracking import GeneralTracker
from accelerate.utils import GradScalerKwargs, InitProcessGroupKwargs
from common import (
    PER_RANK,
    VOCAB,
    all_indices,
    dataset,
    fresh,
    full_grads,
    full_params,
    gather,
    lm_loss,
    loader,
    max_rel_diff,
    rank_batch,
    reduce_scatters,
    reference,
    setup_resumable,
    train,
    update_rel_diff,
)
from resume_flows import resume_from_one, resume_on_two
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Subset

import fsdp2_strategy as f2
from fsdp2_strategy.integrations.accelerate import FSDP2Accelerator, FSDP2Plugin


def _plan(model) -> dict:
    plan = f2.sharding_plan(model)
    return {
        "groups": [g.name for g in plan.groups],
        "precision": sorted({g.precision for g in plan.groups}),
        "offload": sorted({g.cpu_offload for g in plan.groups}),
    }


def config_from_launch(out: dict, work: Path) -> None:
    """What `accelerate launch --config_file` handed to FSDP2Plugin() and FSDP2Accelerator()."""
    cfg = FSDP2Plugin().fsdp2_config
    out.update(
        wrap_policy=cfg.wrap_policy,
        reshard_after_forward=cfg.reshard_after_forward,
        cpu_offload=cfg.cpu_offload,
        activation_checkpointing=cfg.activation_checkpointing,
        mixed_precision=cfg.mixed_precision,
        sharding_strategy=cfg.sharding_strategy,
        env={k: v for k, v in os.environ.items() if k.startswith("FSDP_") or k == "ACCELERATE_MIXED_PRECISION"},
    )
    acc = FSDP2Accelerator()
    out.update(
        distributed_type=str(acc.distributed_type),
        num_processes=acc.num_processes,
        accelerator_precision=acc.mixed_precision,
        is_fsdp2=acc.is_fsdp2,
        backend=dist.get_backend(),
    )
    try:
        Accelerator(fsdp_plugin=FSDP2Plugin())
        out["stock_error"] = None
    except TypeError as exc:
        out["stock_error"] = str(exc)


def parity(out: dict, work: Path) -> None:
    """One SGD step, optimizer built before prepare (rebound), batches from a prepared DataLoader."""
    model, initial = fresh(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = FSDP2Accelerator(mixed_precision="no")
    model, opt, dl = acc.prepare(model, opt, loader(PER_RANK))
    idx, x, y = next(iter(dl))
    acc.backward(lm_loss(model, x, y))
    grads = full_grads(model)
    opt.step()
    params = full_params(model)
    ref_params, ref_grads, _ = reference(initial, [all_indices(idx.tolist())])
    out.update(
        _plan(model),
        grad_rel=max_rel_diff(grads, ref_grads),
        param_rel=max_rel_diff(params, ref_params),
        root_is_fsdp=isinstance(model, FSDPModule),
        indices=gather(idx.tolist()),
        optimizer_params_dtensor=all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"]),
    )
    # The other order: optimizer built after prepare(model), prepared on its own.
    model2, initial2 = fresh(1)
    model2 = acc.prepare(model2)
    opt2 = acc.prepare(torch.optim.SGD(model2.parameters(), lr=0.1))
    idx, x, y = rank_batch()
    acc.backward(lm_loss(model2, x, y))
    opt2.step()
    ref2, _, _ = reference(initial2, [all_indices(idx)])
    out["after_prepare_param_rel"] = max_rel_diff(full_params(model2), ref2)


def variants(out: dict, work: Path) -> None:
    """Plugin keyword arguments over the config file: CPU offload + activation checkpointing."""
    model, initial = fresh(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = FSDP2Accelerator(
        fsdp_plugin=FSDP2Plugin(cpu_offload=True, activation_checkpointing="auto"), mixed_precision="no"
    )
    model, opt = acc.prepare(model, opt)
    idx, x, y = rank_batch()
    acc.backward(lm_loss(model, x, y))
    opt.step()
    ref, _, _ = reference(initial, [all_indices(idx)])
    out.update(_plan(model), param_rel=max_rel_diff(full_params(model), ref))


def accumulation(out: dict, work: Path) -> None:
    """gradient_accumulation_steps=2: no reduce-scatter on the first micro-batch."""
    model, initial = fresh(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = FSDP2Accelerator(mixed_precision="no", gradient_accumulation_steps=2)
    dl = DataLoader(Subset(dataset(), range(16)), batch_size=PER_RANK)  # 2 micro-batches per rank
    model, opt, dl = acc.prepare(model, opt, dl)
    after_backward, sync_flags, micro = [], [], []
    with count_collectives() as counts:
        for idx, x, y in dl:
            with acc.accumulate(model):
                acc.backward(lm_loss(model, x, y))
                after_backward.append(reduce_scatters(counts))
                sync_flags.append(acc.sync_gradients)
                opt.step()
                opt.zero_grad()
            micro.append(idx.tolist())
    groups = len(f2.sharding_plan(model).groups)
    params = full_params(model)
    per_rank = gather(micro)
    micro_batches = [[i for rank in per_rank for i in rank[m]] for m in range(len(micro))]
    ref, _, _ = reference(initial, micro_batches)
    with count_collectives() as plain:  # the same two backward passes without accumulate()
        for _ in range(2):
            _, x, y = rank_batch()
            acc.backward(lm_loss(model, x, y))
    opt.zero_grad()
    out.update(
        reduce_scatters_after_each_backward=after_backward,
        sync_gradients=sync_flags,
        groups=groups,
        reduce_scatters_two_plain_backwards=reduce_scatters(plain),
        param_rel=max_rel_diff(params, ref),
        micro_batches=len(micro),
    )


def accumulation_modes(out: dict, work: Path) -> None:
    """2 micro-batches per step under FSDP2Plugin(accumulation="keep_gathered"), and under
    GradientAccumulationPlugin(sync_each_batch=True) ("sync_each"); last in FLOWS, because
    accelerate keeps the gradient plugin's settings in shared state."""
    from accelerate.utils import GradientAccumulationPlugin

    cases = {
        "keep_gathered": dict(fsdp_plugin=FSDP2Plugin(accumulation="keep_gathered"), gradient_accumulation_steps=2),
        "sync_each_batch": dict(
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2, sync_each_batch=True)
        ),
    }
    for name, kwargs in cases.items():
        model, initial = fresh(3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        acc = FSDP2Accelerator(mixed_precision="no", **kwargs)
        dl = DataLoader(Subset(dataset(), range(16)), batch_size=PER_RANK)  # 2 micro-batches per rank
        model, opt, dl = acc.prepare(model, opt, dl)
        micro = []
        with count_collectives() as counts:
            for idx, x, y in dl:
                with acc.accumulate(model):
                    acc.backward(lm_loss(model, x, y))
                    opt.step()
                    opt.zero_grad()
                micro.append(idx.tolist())
        per_rank = gather(micro)
        ref, _, _ = reference(initial, [[i for rank in per_rank for i in rank[m]] for m in range(len(micro))])
        plan = f2.sharding_plan(model)
        out[name] = dict(
            mode=plan.accumulation,
            groups=len(plan.groups),
            reduce_scatters=reduce_scatters(counts),
            all_gathers=sum(v for k, v in counts.items() if k.startswith("all_gather")),
            param_rel=max_rel_diff(full_params(model), ref),
        )
    out["scalar_sync_each"] = _scalars_under_sync_each_batch()
    try:
        _ = FSDP2Accelerator(
            fsdp_plugin=FSDP2Plugin(accumulation="keep_gathered"),
            mixed_precision="no",
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2, sync_each_batch=True),
        ).fsdp2_config
        out["conflict_error"] = None
    except ValueError as exc:
        out["conflict_error"] = str(exc)
    FSDP2Accelerator(mixed_precision="no", gradient_accumulation_steps=1)  # sync_each_batch back off for later flows


class _Regression(torch.nn.Module):
    """Accelerate's test RegressionModel (0-dim `a` and `b`, which the core replicates) plus a Linear
    for FSDP to shard."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Parameter(torch.tensor(2.0)), torch.nn.Parameter(torch.tensor(3.0))
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.a * self.lin(x) + self.b


def _scalars_under_sync_each_batch() -> dict:
    """First of 2 micro-batches with sync_each_batch=True: the scalars' gradients are averaged already."""
    from accelerate.utils import GradientAccumulationPlugin

    torch.manual_seed(0)
    model = _Regression()
    ref = copy.deepcopy(model)
    acc = FSDP2Accelerator(
        mixed_precision="no",
        fsdp_plugin=FSDP2Plugin(wrap_policy=["Linear"]),
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2, sync_each_batch=True),
    )
    model = acc.prepare(model)
    xs = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    rank, world = dist.get_rank(), dist.get_world_size()
    with acc.accumulate(model):
        acc.backward(model(xs[rank * 2 : rank * 2 + 2]).pow(2).mean())
    first = {"grads": gather([float(model.a.grad), float(model.b.grad)]), "sync_step": acc.sync_gradients}
    with acc.accumulate(model):  # the second micro-batch ends the cycle (Accelerate's step counter is shared)
        acc.backward(model(xs[4 + rank * 2 : 4 + rank * 2 + 2]).pow(2).mean())
    for r in range(world):  # one process: each rank's loss / ranks / micro-batches
        (ref(xs[r * 2 : r * 2 + 2]).pow(2).mean() / world / 2).backward()
    return {**first, "ref": [float(ref.a.grad), float(ref.b.grad)]}


def clipping(out: dict, work: Path) -> None:
    model, initial = fresh(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = FSDP2Accelerator(mixed_precision="no")
    model, opt = acc.prepare(model, opt)
    idx, x, y = rank_batch()
    acc.backward(lm_loss(model, x, y))
    norm = acc.clip_grad_norm_(model.parameters(), 0.05)
    opt.step()
    ref, _, ref_norm = reference(initial, [all_indices(idx)], clip=0.05)
    unclipped, _, _ = reference(initial, [all_indices(idx)])
    out.update(
        norm=norm.item(),
        ref_norm=ref_norm,
        norm_is_plain=not isinstance(norm, DTensor),
        param_rel=max_rel_diff(full_params(model), ref),
        unclipped_rel=max_rel_diff(unclipped, ref),
    )


def _policy_step(initial, idx: list[int], dtype: torch.dtype, scale: float = 1.0, clip: float | None = None) -> tuple:
    """The weights one SGD step (lr 0.1) should give under a mixed policy, written out without the engine
    (tests/_precision.py): each rank's samples on a `dtype` copy under autocast, fp32 gradients averaged
    (the loss multiplied by `scale`, the gradients divided by it), clipped to `clip` by the global norm,
    fp32 SGD. Returns (weights, norm before clipping)."""
    _, xs, ys = dataset().tensors

    def loss(model, samples):
        with torch.autocast("cpu", dtype=dtype):
            return lm_loss(model, xs[samples], ys[samples])

    grads = policy_grads(initial, [[(samples,)] for samples in gather(idx)], loss, dtype, scale)
    grads = {n: g / scale for n, g in grads.items()}
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])).item()
    coef = min(1.0, clip / (norm + 1e-6)) if clip else 1.0
    return {n: p.detach() - 0.1 * coef * grads[n] for n, p in initial.named_parameters()}, norm


def _untied_and_tied(got: dict, want: dict, model) -> tuple[float, float]:
    tied = tied_names(model)
    return (
        max_rel_diff({k: v for k, v in got.items() if k not in tied}, {k: v for k, v in want.items() if k not in tied}),
        max_rel_diff({k: got[k] for k in tied}, {k: want[k] for k in tied}) if tied else 0.0,
    )


def bf16(out: dict, work: Path) -> None:
    model, initial = fresh(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = FSDP2Accelerator(mixed_precision="bf16")
    model, opt = acc.prepare(model, opt)
    idx, x, y = rank_batch()
    logits = model(x)
    loss = lm_loss(model, x, y)
    with collective_dtypes() as reductions:
        acc.backward(loss)
    grad_dtypes = sorted({str(p.grad.dtype) for p in model.parameters()})
    opt.step()
    expected, _ = _policy_step(initial, idx, torch.bfloat16)
    update_diff, tied_diff = _untied_and_tied(full_params(model), expected, initial)
    out.update(
        _plan(model),
        accelerator_precision=acc.mixed_precision,
        out_dtype=str(logits.dtype),
        stored_dtypes=sorted({str(p.dtype) for p in model.parameters()}),
        grad_dtypes=grad_dtypes,
        reductions=sorted(reductions),
        update_diff=update_diff,
        tied_update_diff=tied_diff,
    )


def fp16(out: dict, work: Path) -> None:
    """fp16 compute with the sharded grad scaler, on CPU too (stock Accelerate refuses fp16 there).

    Default scale (65536): the scaled gradients overflow fp16, every rank skips the step and the
    scale halves. GradScalerKwargs(init_scale=1024): unscaled before clipping, the step matches the
    policy written out."""
    for name, handlers in (("default", []), ("init_1024", [GradScalerKwargs(init_scale=1024)])):
        model, initial = fresh(13)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        acc = FSDP2Accelerator(mixed_precision="fp16", kwargs_handlers=handlers)
        model, opt = acc.prepare(model, opt)
        idx, x, y = rank_batch()
        logits = model(x)
        with collective_dtypes() as reductions:
            acc.backward(lm_loss(model, x, y))
        norm = acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        start, got = full_params(initial), full_params(model)
        entry = dict(
            _plan(model),
            out_dtype=str(logits.dtype),
            scaler=type(acc.scaler).__name__,
            scale=acc.scaler.get_scale(),
            norm=norm.item(),
            reductions=sorted(reductions),
            unchanged=all(torch.equal(got[k], start[k]) for k in start),
            skipped=gather(opt.step_was_skipped),
        )
        if name == "init_1024":
            expected, entry["ref_norm"] = _policy_step(initial, idx, torch.float16, scale=1024.0, clip=1.0)
            entry["update_diff"], entry["tied_update_diff"] = _untied_and_tied(got, expected, initial)
        out[name] = entry


def multi_model(out: dict, work: Path) -> None:
    a, a0 = fresh(6)
    b, b0 = fresh(7, layers=2, tied=False)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    acc = FSDP2Accelerator(mixed_precision="no")
    a, b, oa, ob = acc.prepare(a, b, oa, ob)
    idx, x, y = rank_batch()
    for model, opt in ((a, oa), (b, ob)):
        acc.backward(lm_loss(model, x, y))
        opt.step()
    ref_a, _, _ = reference(a0, [all_indices(idx)])
    ref_b, _, _ = reference(b0, [all_indices(idx)])
    out.update(
        models=len(acc._models),
        both_fsdp=isinstance(a, FSDPModule) and isinstance(b, FSDPModule),
        a_rel=max_rel_diff(full_params(a), ref_a),
        b_rel=max_rel_diff(full_params(b), ref_b),
    )


def evaluation(out: dict, work: Path) -> None:
    model, initial = fresh(8)
    # Groups stay gathered after forward (the config file reshards them: not here), so the save
    # below has something to reshard.
    acc = FSDP2Accelerator(fsdp_plugin=FSDP2Plugin(reshard_after_forward=False), mixed_precision="no")
    model = acc.prepare(model)
    model.eval()
    _, x, _ = rank_batch()
    with torch.no_grad():
        got, want = model(x), initial.eval()(x)
    gathered = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]  # the root, after forward
    acc.save_state(work / "after_eval")  # a save outside a step reshards first
    out.update(
        root_is_fsdp=isinstance(model, FSDPModule),
        rel=((got - want).norm() / want.norm()).item(),
        gathered_after_forward=gathered,
        plain_after_save=[n for n, p in model.named_parameters() if not isinstance(p, DTensor)],
    )


def checkpoints(out: dict, work: Path) -> None:
    acc, model, opt, sched = setup_resumable(9, state_dict_type="full")
    first = train(acc, model, opt, sched, range(0, 2))
    path = Path(acc.save_state(work / "state"))
    lr_saved = sched.get_last_lr()
    if dist.get_rank() == 0:  # kept for resume.py (one process); `state` itself is saved over below
        shutil.copytree(path, work / "state_step2")
    saved_params = full_params(model)
    cont = train(acc, model, opt, sched, range(2, 4))
    out.update(
        first=first,
        continued=cont,
        lr_saved=lr_saved,
        lr_continued=sched.get_last_lr(),
        listing=sorted(p.name for p in path.iterdir()),
        parent=sorted(p.name for p in path.parent.iterdir()),
    )
    if dist.get_rank() == 0:
        from safetensors.torch import load_file

        exported = load_file(str(path / "model.safetensors"))
        out["export_diff"] = max((exported[k].float() - v).abs().max().item() for k, v in saved_params.items())
    # A fresh model, optimizer and scheduler (different init) resumed from the directory.
    acc2, model2, opt2, sched2 = setup_resumable(99)
    acc2.load_state(path)
    out.update(resumed=train(acc2, model2, opt2, sched2, range(2, 4)), lr_resumed=sched2.get_last_lr())
    # Saving again into the same directory replaces it whole (no .tmp-* left behind).
    acc2.save_state(path)
    out["parent_after_resave"] = sorted(p.name for p in path.parent.iterdir())
    dist.barrier()  # every rank has listed before rank 0 adds the damaged copies below
    # A directory that never committed, and a damaged one, are refused before anything loads.
    partial = work / "partial"
    if dist.get_rank() == 0:
        shutil.copytree(path, partial)
        (partial / ".metadata").unlink()
        damaged = work / "damaged"
        shutil.copytree(path, damaged)
        with open(damaged / "__1_0.distcp", "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    for name in ("partial", "damaged"):
        try:
            acc2.load_state(work / name)
            out[f"{name}_error"] = None
        except (FileNotFoundError, ValueError) as exc:
            out[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
    # Automatic naming with keep_last: only the newest committed checkpoints stay.
    from accelerate.utils import ProjectConfiguration

    acc3, model3, opt3, sched3 = setup_resumable(9, keep_last=2)
    acc3.project_configuration = ProjectConfiguration(project_dir=str(work / "auto"), automatic_checkpoint_naming=True)
    for _ in range(3):
        acc3.save_state()
    out["auto_listing"] = sorted(p.name for p in (work / "auto" / "checkpoints").iterdir())
    # A new run resumes from the newest and numbers its next save after it (no clash with checkpoint_0).
    acc4, *_ = setup_resumable(9, keep_last=2)
    acc4.project_configuration = ProjectConfiguration(project_dir=str(work / "auto"), automatic_checkpoint_naming=True)
    acc4.load_state()
    out["auto_after_resume"] = Path(acc4.save_state()).name
    # A save before the first optimizer step changes nothing (torch's state-dict call would step
    # Adam once), and resuming from it starts like a fresh run.
    acc5, model5, opt5, sched5 = setup_resumable(9)
    acc5.save_state(work / "early")
    out["early_state_entries"] = len(opt5.optimizer.state)
    out["early_trained"] = train(acc5, model5, opt5, sched5, range(0, 4))
    acc6, model6, opt6, sched6 = setup_resumable(99)
    acc6.load_state(work / "early")
    out["early_state_after_load"] = len(opt6.optimizer.state)
    out["early_resumed"] = train(acc6, model6, opt6, sched6, range(0, 4))
    # Accelerate's own `merge_fsdp_weights` (`accelerate merge-weights`) reads the model view
    # `pytorch_model_fsdp_0/` of a save_state directory; the top level is not one model.
    from accelerate.utils import merge_fsdp_weights

    merge_fsdp_weights(str(work / "state_step2" / "pytorch_model_fsdp_0"), str(work / "merged"))
    if dist.get_rank() == 0:
        from safetensors.torch import load_file

        merged, exported = (
            load_file(str(work / "merged" / "model.safetensors")),
            load_file(str(work / "state_step2" / "model.safetensors")),
        )
        out["merged_keys_match"] = sorted(merged) == sorted(exported)
        out["merged_equal"] = all(torch.equal(merged[k], exported[k]) for k in exported)


def overlap_save(out: dict, work: Path) -> None:
    """checkpoint_async_save="overlap": save_state returns before its (held back) copy, the next step
    waits for it, wait_for_checkpoint() commits the directory (end_training() calls it, then destroys
    the process group), which holds the state of the save bit for bit, and training from it continues
    exactly."""
    acc, model, opt, sched = setup_resumable(9, checkpoint_async_save="overlap")
    train(acc, model, opt, sched, range(0, 2))
    at_save = full_state(model, opt)
    with slow_staging(0.5):
        start = time.perf_counter()
        path = Path(acc.save_state(work / "overlap_state"))
        returned_at = time.perf_counter()
        out["returned"], out["copied_before_return"] = returned_at - start, copied_by(returned_at)
        continued = train(acc, model, opt, sched, range(2, 4))
        out["waited"] = time.perf_counter() - start
    out["changed_by_next_step"] = len(differing(full_state(model, opt), at_save)) == len(at_save)
    out["committed_before_end"] = path.exists()
    acc.wait_for_checkpoint()
    out["committed_after_wait"] = path.exists()
    acc2, model2, opt2, sched2 = setup_resumable(99)
    train(acc2, model2, opt2, sched2, range(0, 1))  # optimizer state to overwrite
    acc2.load_state(path)
    out["differs"] = differing(full_state(model2, opt2), at_save)
    out["resumed"], out["continued"] = train(acc2, model2, opt2, sched2, range(2, 4)), continued


def preemption(out: dict, work: Path) -> None:
    """checkpoint_on_preemption: SIGTERM to rank 1 during step 3 sets Accelerate's trigger on every rank
    at the step's check_trigger(); the loop saves and stops there."""
    acc, model, opt, sched = setup_resumable(9, checkpoint_on_preemption=True)
    triggers = []
    for step in range(4):
        if step == 2 and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the default action would kill this rank
        train(acc, model, opt, sched, range(step, step + 1))
        triggers.append(acc.check_trigger())
        if triggers[-1]:
            acc.save_state(work / "preempted")
            break
    acc._preemption.close()  # the flows after this one run in the same processes
    out.update(triggers=gather(triggers), committed=(work / "preempted" / ".metadata").is_file())


def hf_export(out: dict, work: Path) -> None:
    """A transformers GPT-2: save_model -> from_pretrained; get_state_dict full on rank 0 only."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(10)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # The launch config wraps "Block" (TinyGPT); a keyword overrides it: "auto" finds GPT2Block.
    acc = FSDP2Accelerator(fsdp_plugin=FSDP2Plugin(wrap_policy="auto"), mixed_precision="no")
    model, opt = acc.prepare(model, opt)
    _, x, _ = rank_batch()
    acc.backward(model(input_ids=x, labels=x).loss)
    opt.step()
    state = acc.get_state_dict(model)
    acc.save_model(model, work / "hf")
    params = full_params(model)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=x).logits
    out.update(
        _plan(model),
        state_sizes=gather(len(state)),
        state_keys=len(model.state_dict()),
        files=sorted(p.name for p in (work / "hf").iterdir()),
    )
    if dist.get_rank() == 0:
        loaded = GPT2LMHeadModel.from_pretrained(work / "hf").eval()
        got = dict(loaded.named_parameters())
        out["weight_diff"] = max((got[k] - v).abs().max().item() for k, v in params.items())
        with torch.no_grad():
            ref = loaded(input_ids=x).logits
        out["logits_rel"] = ((ref - logits).norm() / ref.norm()).item()
        out["state_diff"] = max((state[k] - got[k]).abs().max().item() for k in got)


def peft_lora(out: dict, work: Path) -> None:
    """LoRA (PEFT) on a GPT-2 (Conv1D: fan-in-fan-out; the head tied to the frozen embedding):
    save_state holds the adapter only, and
    Accelerate's documented adapter recipe, save_model and f2.save_merged write files that PEFT and
    transformers load with the live model's logits."""
    import peft
    from transformers import GPT2Config, GPT2LMHeadModel

    def base() -> GPT2LMHeadModel:
        torch.manual_seed(10)
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4))

    torch.manual_seed(11)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights="gaussian"
    )
    model = peft.get_peft_model(base(), config)
    acc = FSDP2Accelerator(fsdp_plugin=FSDP2Plugin(wrap_policy="auto"), mixed_precision="no")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model, opt = acc.prepare(model, opt)
    _, x, _ = rank_batch()
    for _ in range(2):
        acc.backward(model(input_ids=x, labels=x).loss)
        opt.step()
        opt.zero_grad()
    state_dir = Path(acc.save_state(work / "peft_state"))
    names = f2.inspect_checkpoint(state_dir)
    out["saved_model_keys"] = sorted(k for k in names.tensors if k.startswith("model."))
    out["fingerprint"] = "frozen_base.model" in names.other_keys
    # Accelerate's documented recipe for PEFT models under FSDP.
    acc.unwrap_model(model).save_pretrained(
        work / "peft_recipe",
        is_main_process=acc.is_main_process,
        save_function=acc.save,
        state_dict=acc.get_state_dict(model),
    )
    acc.save_model(model, work / "peft_save_model")
    f2.save_merged(model, work / "peft_merged")
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=x).logits
        for p in model.parameters():
            if p.requires_grad:
                p.zero_()
        acc.load_state(state_dir)  # the adapter back; the frozen base checked by its fingerprint
        out["reloaded_rel"] = max_rel_diff({"l": model(input_ids=x).logits}, {"l": logits})
    if dist.get_rank() == 0:
        with torch.no_grad():
            for name in ("peft_recipe", "peft_save_model"):
                loaded = peft.PeftModel.from_pretrained(base(), work / name).eval()
                out[f"{name}_rel"] = max_rel_diff({"l": loaded(input_ids=x).logits}, {"l": logits})
            merged = GPT2LMHeadModel.from_pretrained(work / "peft_merged").eval()
            out["merged_rel"] = max_rel_diff({"l": merged(input_ids=x).logits}, {"l": logits})


def rank0_loading(out: dict, work: Path) -> None:
    """cpu_ram_efficient_loading: real weights on rank 0, the meta device elsewhere (runs last: the
    plugin exports FSDP_CPU_RAM_EFFICIENT_LOADING=true for transformers, as Accelerate's does)."""
    from _models import TinyGPT

    acc = FSDP2Accelerator(fsdp_plugin=FSDP2Plugin(cpu_ram_efficient_loading=True), mixed_precision="no")
    if dist.get_rank() == 0:
        model, initial = fresh(11)
    else:
        with torch.device("meta"):
            model, initial = TinyGPT(vocab=VOCAB, seq=16), None
    model = acc.prepare(model)
    params = full_params(model)
    if dist.get_rank() == 0:
        ref = dict(initial.named_parameters())
        out["diff"] = max((params[k] - ref[k]).abs().max().item() for k in ref)
    out["meta_after"] = gather(any(p.is_meta for p in model.parameters()))


def launch_variant(out: dict, work: Path) -> None:
    """Under fsdp2_variant.yaml: size-based wrap, no reshard, offload, activation checkpointing,
    full state dict, rank-0 loading and bf16, all from the config file alone."""
    acc = FSDP2Accelerator()
    if dist.get_rank() == 0:
        model, initial = fresh(12)
    else:
        with torch.device("meta"):  # as transformers loads it on ranks > 0 with rank-0 loading
            model, initial = fresh(12)
    model = acc.prepare(model)
    opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []
    # A pre-hook: checkpoint's recomputation may stop inside mlp once it has what backward needs.
    model.blocks[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    idx, x, y = rank_batch()
    loss = lm_loss(model, x, y)
    acc.backward(loss)
    opt.step()
    plan = f2.sharding_plan(model)
    params = full_params(model)
    path = Path(acc.save_state(work / "variant_state"))
    out.update(
        _plan(model),
        reshard=sorted({str(g.reshard_after_forward) for g in plan.groups}),
        mlp_forward_calls=len(calls),
        accelerator_precision=acc.mixed_precision,
        listing=sorted(p.name for p in path.iterdir()),
        loss=sum(gather(loss.item())) / dist.get_world_size(),
    )
    global_idx = all_indices(idx)
    if dist.get_rank() == 0:  # only rank 0 has the real initial weights
        ref, _, _ = reference(initial, [global_idx])
        out["update_rel"] = update_rel_diff(dict(initial.named_parameters()), params, ref)
        _, xs, ys = dataset().tensors
        out["fp32_loss"] = lm_loss(initial, xs[global_idx], ys[global_idx]).item()


def auto_strategy(out: dict, work: Path) -> None:
    """FSDP2Plugin(sharding_strategy="auto", memory_budget=...): the planner's pick per budget reaches
    the prepared model; one SGD step against one process; a budget below every estimate fails.

    Budgets come from the core planner's estimates (2 ranks, AdamW, no batch: what "auto" uses) of
    this config: one that FULL_SHARD fits and SHARD_GRAD_OP (less communication) does not, one
    that SHARD_GRAD_OP fits (NO_SHARD communicates as much with a larger peak), one below all.
    The config file's `fsdp_reshard_after_forward: true` would override either strategy's
    reshard choice, so the plugins unset it.
    """
    layers = dict(layers=8)  # enough blocks that FULL_SHARD's peak is below SHARD_GRAD_OP's
    probe = FSDP2Plugin(reshard_after_forward=None).fsdp2_config
    est = {
        s: f2.estimate_memory(
            fresh(0, **layers)[0], dataclasses.replace(probe, sharding_strategy=s), world_size=2
        ).peak_bytes
        for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
    }
    budgets = {"FULL_SHARD": (est["FULL_SHARD"] + est["SHARD_GRAD_OP"]) // 2, "SHARD_GRAD_OP": 2 * est["NO_SHARD"]}
    out["estimates"] = est
    for expected, budget in budgets.items():
        plugin = FSDP2Plugin(sharding_strategy="auto", memory_budget=budget, reshard_after_forward=None)
        out[f"{expected}_plugin_reshard"] = plugin.reshard_after_forward
        acc = FSDP2Accelerator(fsdp_plugin=plugin, mixed_precision="no")
        model, initial = fresh(20, **layers)
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        idx, x, y = rank_batch()
        acc.backward(lm_loss(model, x, y))
        opt.step()
        ref, _, _ = reference(initial, [all_indices(idx)])
        plan = f2.sharding_plan(model)
        out[expected] = {
            "strategies": sorted({g.strategy for g in plan.groups}),
            "mesh_shapes": sorted({str(g.mesh_shape) for g in plan.groups}),
            "reshard": {g.name: g.reshard_after_forward for g in plan.groups},
            "param_rel": max_rel_diff(full_params(model), ref),
        }
    acc = FSDP2Accelerator(
        fsdp_plugin=FSDP2Plugin(sharding_strategy="auto", memory_budget=est["FULL_SHARD"] // 2), mixed_precision="no"
    )
    try:
        acc.prepare(fresh(21, **layers)[0])
        out["too_small_error"] = None
    except ValueError as exc:
        out["too_small_error"] = str(exc)
    _throughput(out, work)


def _throughput(out: dict, work: Path) -> None:
    """objective="throughput": prepare(model, optimizer, loader) tunes on the loader's first batch,
    caches the pick and shards with it on both ranks (one SGD step against one process);
    prepare(model) alone names the loader it needs."""
    import json

    cache = work / "accelerate_tune.json"
    cache.unlink(missing_ok=True)  # both ranks, before prepare's first collective
    os.environ["FSDP2_TUNE_CACHE"] = str(cache)
    # cpu_ram_efficient_loading=False: rank0_loading, an earlier flow, exported it as true to the environment.
    plugin = dict(
        sharding_strategy="auto", objective="throughput", reshard_after_forward=None, cpu_ram_efficient_loading=False
    )
    try:
        acc = FSDP2Accelerator(fsdp_plugin=FSDP2Plugin(**plugin), mixed_precision="no")
        model, initial = fresh(20, layers=4)
        inputs = DataLoader(torch.utils.data.TensorDataset(dataset().tensors[1]), batch_size=PER_RANK, shuffle=True)
        model, opt, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), inputs)
        idx, x, y = rank_batch()
        acc.backward(lm_loss(model, x, y))
        opt.step()
        ref, _, _ = reference(initial, [all_indices(idx)])
        (entry,) = json.loads(cache.read_text()).values()
        out["throughput"] = dict(
            _plan(model),
            every_rank=gather(str(f2.sharding_plan(model))),
            strategies=sorted({g.strategy for g in f2.sharding_plan(model).groups}),
            entry={k: entry[k] for k in ("label", "changes")},
            rows=[r["label"] for r in entry["table"]["rows"]],
            param_rel=max_rel_diff(full_params(model), ref),
        )
        try:
            acc.prepare(fresh(21, layers=4)[0])
            out["throughput"]["no_loader_error"] = None
        except ValueError as exc:
            out["throughput"]["no_loader_error"] = str(exc)
    finally:
        del os.environ["FSDP2_TUNE_CACHE"]


class _MemoryTracker(GeneralTracker):
    """Keeps what `Accelerator.log` hands it (on every rank it is called on: it logs on the main one)."""

    name, requires_logging_directory, main_process_only = "memory", False, False

    def __init__(self):
        super().__init__()
        self.rows: list = []

    @property
    def tracker(self):
        return self.rows

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        self.rows.append([step, dict(values)])


def throughput_logging(out: dict, work: Path) -> None:
    """log_throughput_every=2 over 5 SGD steps of 4 sequences of 16 tokens per rank: the first step
    starts the clock, then one report per 2 steps, through the trackers, on the main process."""
    model, _ = fresh(4)
    tracker = _MemoryTracker()
    acc = FSDP2Accelerator(mixed_precision="no", log_throughput_every=2, log_with=[tracker])
    acc.init_trackers("flows")
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(5):
        _, x, y = rank_batch(step)
        acc.backward(lm_loss(model, x, y))
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        model(x)  # an evaluation forward: no training tokens
    out["rows"] = gather(tracker.rows)
    out["pending_after_eval"] = acc.throughput.meter._pending
    out["last_step"] = acc.throughput.meter.last.step
    acc.throughput.remove()


def deepspeed_launch(out: dict, work: Path) -> None:
    """The variables `accelerate launch` sets for `distributed_type: DEEPSPEED` (ZeRO-2, inline keys)
    instead of this launch's FSDP ones: FSDP2Accelerator() trains with the translation, SHARD_GRAD_OP,
    where the stock path would import DeepSpeed."""
    saved = dict(os.environ)
    for key in [k for k in os.environ if k.startswith("FSDP_") or k == "ACCELERATE_USE_FSDP"]:
        del os.environ[key]
    os.environ.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE="2")
    try:
        model, initial = fresh(5)
        acc = FSDP2Accelerator(mixed_precision="no")
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        idx, x, y = rank_batch()
        acc.backward(lm_loss(model, x, y))
        opt.step()
        ref, _, _ = reference(initial, [all_indices(idx)])
        out.update(_plan(model), param_rel=max_rel_diff(full_params(model), ref))
        out["strategies"] = sorted({g.strategy for g in f2.sharding_plan(model).groups})
        out["use_deepspeed_after"] = os.environ.get("ACCELERATE_USE_DEEPSPEED")
    finally:
        os.environ.clear()
        os.environ.update(saved)


FLOWS = [
    config_from_launch,
    parity,
    variants,
    accumulation,
    clipping,
    bf16,
    fp16,
    multi_model,
    evaluation,
    checkpoints,
    overlap_save,
    preemption,
    hf_export,
    peft_lora,
    rank0_loading,
    accumulation_modes,
    auto_strategy,
    resume_on_two,
    throughput_logging,
    deepspeed_launch,
]
"""Run under fsdp2.yaml (the default when no flow names are given)."""
VARIANT_FLOWS = [config_from_launch, launch_variant, resume_from_one]
"""Run under fsdp2_variant.yaml."""


def main() -> None:
    out_path, work = sys.argv[1], Path(sys.argv[2])
    by_name = {f.__name__: f for f in FLOWS + VARIANT_FLOWS}
    flows = [by_name[n] for n in sys.argv[3].split(",")] if len(sys.argv) > 3 else FLOWS
    # The first accelerator starts the process group: a timeout, so a stuck rank fails the run.
    FSDP2Accelerator(mixed_precision="no", kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=90))])
    run_flows(flows, out_path, work)  # every rank writes its report (OUT.rankN.json)
    f2.shutdown()


if __name__ == "__main__":
    main()

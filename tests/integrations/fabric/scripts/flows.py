"""Fabric flows on 2 ranks in one world (launched by `fabric run`); each flow checks what it claims.

Usage (tests/ on the path, as `helpers.harness.launch` puts it; default: every flow):

    PYTHONPATH=tests fabric run --accelerator cpu --devices 2 tests/integrations/fabric/scripts/flows.py OUT.json WORKDIR [FLOW ...]

Each flow records its named checks (`helpers.checks.Checks`, on every rank) and the raw numbers under its own
key. Every rank writes its own report (OUT.rank0.json, OUT.rank1.json) after each flow; an exception
is recorded as "error" for that flow and ends that rank (`helpers.collect.run_flows`): the test fails naming
the flow and the rank. The test file only launches and calls `assert_passed` per flow.
"""

from __future__ import annotations

import copy
import shutil
import sys
import time
from pathlib import Path

import torch
from common import (
    LR,
    MLP,
    data,
    fresh,
    full_params,
    loss_on,
    max_rel_diff,
    params,
    rank_slice,
    reference_steps,
)
from helpers.checks import Checks
from helpers.collect import run_flows
from helpers.comm import collective_dtypes, count_collectives
from helpers.models import tiny_llama
from helpers.precision import policy_grads, true_precision_update
from helpers.slow_staging import copied_by, differing, full_state, slow_staging
from helpers.untrusted import plant
from lightning.fabric import Fabric
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fsdp2_strategy as f2
from fsdp2_strategy.integrations.fabric import FSDP2FabricMixedPrecision, FSDP2FabricStrategy

BATCHES = [slice(0, 8), slice(8, 16)]  # two global batches of 8 (4 per rank)
DELAY = 0.5  # seconds an "overlap" save's copy is held back
TOL = 1e-5  # fp32 parity, relative


def _train(fabric: Fabric, model, optimizer, batches=BATCHES, clip: tuple | None = None) -> list[float]:
    """One step per global batch on this rank's part; returns the losses and (norm clipping) norms."""
    losses, norms = [], []
    for batch in batches:
        loss = loss_on(model, rank_slice(fabric.global_rank, fabric.world_size, batch))
        fabric.backward(loss)
        if clip and clip[0] == "norm":
            norms.append(fabric.clip_gradients(model, optimizer, max_norm=clip[1]).item())
        elif clip:
            fabric.clip_gradients(model, optimizer, clip_val=clip[1])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())  # the global batch's loss
    return losses if not norms else norms


def parity(out: dict, work: Path) -> None:
    """`Fabric(strategy="fsdp2")`, `setup(model, optimizer)` with the optimizer built first."""
    fabric = Fabric(strategy="fsdp2")
    raw, ref = fresh(0)
    model, optimizer = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=LR))
    _train(fabric, model, optimizer)
    reference_steps(ref, torch.optim.SGD(ref.parameters(), lr=LR), BATCHES)
    out.update(
        strategy=type(fabric.strategy).__name__,
        root_is_fsdp=isinstance(raw, FSDPModule),
        plan_groups=[g.name for g in f2.sharding_plan(raw).groups],
        optimizer_params_dtensor=[isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"]],
        mesh_dims=list(fabric.strategy.device_mesh.mesh_dim_names),
        mesh_shape=list(fabric.strategy.device_mesh.shape),
        max_rel_diff=max_rel_diff(full_params(raw), params(ref)),
    )
    check = Checks(out)
    check.equal("the strategy is FSDP2FabricStrategy", out["strategy"], "FSDP2FabricStrategy")
    check.that("the root module is sharded", out["root_is_fsdp"])
    check.equal("groups by policy", out["plan_groups"], ["<root>", "blocks.0", "blocks.1", "blocks.2"])
    check.equal("mesh dims", out["mesh_dims"], ["data_parallel", "tensor_parallel"])
    check.equal("mesh shape", out["mesh_shape"], [2, 1])
    # Built before setup, pointed at the shards.
    dtensors = out["optimizer_params_dtensor"]
    check.that("the optimizer rebound to the shards", all(dtensors), dtensors)
    check.below("two steps equal one process's (relative)", out["max_rel_diff"], TOL)


def validate_first(out: dict, work: Path) -> None:
    """`setup_module`, a validation pass under no_grad, then the optimizer and `setup_optimizers`, then
    training: the validation leaves the root and the last block gathered, so the optimizer is built
    on FSDP's gathered copies; the engine points it at the shards at its first step."""
    fabric = Fabric(strategy="fsdp2")
    raw, ref = fresh(7)
    model = fabric.setup_module(raw)
    with torch.no_grad():
        val_loss = loss_on(model, rank_slice(fabric.global_rank, fabric.world_size, BATCHES[0])).item()
    built_on = [isinstance(p, DTensor) for p in model.parameters()]
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    _train(fabric, model, optimizer)
    reference_steps(ref, torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9), BATCHES)
    out.update(
        val_loss=fabric.all_reduce(torch.tensor(val_loss), reduce_op="mean").item(),
        gathered_when_built=built_on.count(False),
        optimizer_params_dtensor=[isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"]],
        max_rel_diff=max_rel_diff(full_params(raw), params(ref)),
    )
    check = Checks(out)
    check.that("the validation loss is a loss", out["val_loss"] > 0, out["val_loss"])
    check.that("the validation left parameters gathered", out["gathered_when_built"] > 0, out["gathered_when_built"])
    dtensors = out["optimizer_params_dtensor"]
    check.that("after the first step the optimizer holds the shards", all(dtensors), dtensors)
    check.below("two SGD-momentum steps equal one process's (relative)", out["max_rel_diff"], TOL)


def accumulation(out: dict, work: Path) -> None:
    """`no_backward_sync` on the first of two micro-batches: one reduce-scatter per group per step."""
    fabric = Fabric(strategy="fsdp2")
    raw, ref = fresh(1)
    model, optimizer = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=LR))
    part = rank_slice(fabric.global_rank, fabric.world_size, BATCHES[0])
    micros = [slice(part.start, part.start + 2), slice(part.start + 2, part.stop)]
    with count_collectives() as counts:
        for i, micro in enumerate(micros):
            with fabric.no_backward_sync(model, enabled=i < len(micros) - 1):
                fabric.backward(loss_on(model, micro) / len(micros))
        optimizer.step()
        optimizer.zero_grad()
    with count_collectives() as plain:  # the same two micro-batches without no_backward_sync
        for micro in micros:
            fabric.backward(loss_on(model, micro) / len(micros))
        optimizer.zero_grad()
    reference_steps(ref, torch.optim.SGD(ref.parameters(), lr=LR), BATCHES[:1])
    rs = lambda c: sum(v for k, v in c.items() if k.startswith("reduce_scatter"))  # noqa: E731
    out.update(
        groups=len(f2.sharding_plan(raw).groups),
        reduce_scatters=rs(counts),
        reduce_scatters_plain=rs(plain),
        max_rel_diff=max_rel_diff(full_params(raw), params(ref)),
    )
    check = Checks(out)
    groups = out["groups"]
    check.equal("four FSDP groups", groups, 4)
    # Without no_backward_sync: one per group per micro-batch.
    check.equal("one reduce-scatter per group per optimizer step", out["reduce_scatters"], groups)
    check.equal("without no_backward_sync: one per group per micro-batch", out["reduce_scatters_plain"], 2 * groups)
    check.below("two accumulated micro-batches equal one step on the whole batch (relative)", out["max_rel_diff"], TOL)


def clipping(out: dict, work: Path) -> None:
    """`fabric.clip_gradients` by norm (the global norm is returned) and by value, vs one process."""
    check = Checks(out)
    for algorithm, value in (("norm", 0.05), ("value", 0.01)):
        fabric = Fabric(strategy="fsdp2")
        raw, ref = fresh(2)
        unclipped = MLP()
        unclipped.load_state_dict(ref.state_dict())
        model, optimizer = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=LR))
        norms = _train(fabric, model, optimizer, clip=(algorithm, value))
        ref_norms = reference_steps(ref, torch.optim.SGD(ref.parameters(), lr=LR), BATCHES, clip=(algorithm, value))
        reference_steps(unclipped, torch.optim.SGD(unclipped.parameters(), lr=LR), BATCHES)
        out[algorithm] = dict(
            max_rel_diff=max_rel_diff(full_params(raw), params(ref)),
            unclipped_diff=max_rel_diff(params(unclipped), params(ref)),
            norms=norms if algorithm == "norm" else None,
            ref_norms=ref_norms if algorithm == "norm" else None,
        )
        r = out[algorithm]
        check.below(f"{algorithm}: parameters equal one clipping process's (relative)", r["max_rel_diff"], TOL)
        unclipped = r["unclipped_diff"]
        check.that(f"{algorithm}: the clip was active (> 0.1 from unclipped)", unclipped > 0.1, unclipped)
        if algorithm == "norm":  # fabric.clip_gradients returns the global norm
            check.close("norm: clip_gradients returns one process's norm, each step (relative)", norms, ref_norms, TOL)
            check.equal("norm: one norm per step", len(norms), 2)


def _expected_update(initial: MLP, name: str, scale: float) -> dict:
    """The weights one SGD step on BATCHES[0] should give under precision `name`, written out without
    the engine (tests/helpers/precision.py): "-mixed": each rank's part on a low-precision copy under autocast,
    fp32 gradients averaged (the loss multiplied by `scale`, the gradients divided by it), fp32 SGD;
    "-true": everything in that dtype; "32-true": one fp32 process."""
    xs, ys = data()
    parts = [rank_slice(r, 2, BATCHES[0]) for r in range(2)]
    if name == "32-true":
        ref = copy.deepcopy(initial)
        reference_steps(ref, torch.optim.SGD(ref.parameters(), lr=LR), BATCHES[:1])
        return params(ref)
    dtype = torch.float16 if name.startswith("16") else torch.bfloat16
    if name.endswith("-true"):
        return true_precision_update(
            initial,
            [(part,) for part in parts],
            lambda m, part: nn.functional.mse_loss(m(xs[part].to(dtype)).float(), ys[part]),
            dtype,
            LR,
        )

    def loss(model, part):
        with torch.autocast("cpu", dtype=dtype):
            return nn.functional.mse_loss(model(xs[part].to(dtype)).float(), ys[part])

    grads = policy_grads(initial, [[(part,)] for part in parts], loss, dtype, scale)
    return {n: p.detach() - LR * grads[n] / scale for n, p in initial.named_parameters()}


def precision(out: dict, work: Path) -> None:
    """Precision strings -> FSDP2 policies: compute dtype inside a block, stored dtype, the reductions'
    dtype, and one step against the policy written out. "16-mixed" starts at a loss scale of 2**10,
    which does not overflow, so the step is not skipped."""
    check = Checks(out)
    for name in ("bf16-mixed", "16-mixed", "bf16-true", "32-true"):
        scale = 2.0**10 if name == "16-mixed" else 1.0
        if name == "16-mixed":
            scaler = ShardedGradScaler(device="cpu", init_scale=scale, growth_interval=1000)
            fabric = Fabric(strategy="fsdp2", plugins=[FSDP2FabricMixedPrecision(name, "cpu", scaler=scaler)])
        else:
            fabric = Fabric(strategy="fsdp2", precision=name)
        raw, initial = fresh(4)
        seen = {}
        raw.blocks[0].fc.register_forward_pre_hook(
            lambda mod, args, seen=seen: seen.setdefault("compute", str(mod.weight.dtype)) and None
        )  # None: args unchanged
        model, optimizer = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=LR))
        with collective_dtypes() as reductions:
            _train(fabric, model, optimizer, batches=BATCHES[:1])
        scaler = getattr(fabric.strategy.precision, "scaler", None)
        out[name] = dict(
            plugin=type(fabric.strategy.precision).__name__,
            plan_precision=sorted({g.precision for g in f2.sharding_plan(raw).groups}),
            compute_dtype=seen["compute"],
            stored_dtypes=sorted({str(p.dtype) for p in raw.parameters()}),
            sharded_scaler=isinstance(scaler, ShardedGradScaler),
            scale=scaler.get_scale() if scaler is not None else None,
            reductions=sorted(reductions),
            update_diff=max_rel_diff(full_params(raw), _expected_update(initial, name, scale)),
        )
    p = out
    check.equal("bf16-mixed: every group bf16/fp32", p["bf16-mixed"]["plan_precision"], ["bf16/fp32"])
    check.equal("bf16-mixed: compute in bf16", p["bf16-mixed"]["compute_dtype"], "torch.bfloat16")
    check.equal("bf16-mixed: parameters stored fp32", p["bf16-mixed"]["stored_dtypes"], ["torch.float32"])
    check.that("16-mixed: the scaler is a ShardedGradScaler", p["16-mixed"]["sharded_scaler"])
    check.equal("16-mixed: compute in fp16", p["16-mixed"]["compute_dtype"], "torch.float16")
    check.equal("16-mixed: parameters stored fp32", p["16-mixed"]["stored_dtypes"], ["torch.float32"])
    # A skipped step would have halved the scale.
    check.equal("16-mixed: the scale is unchanged (the step ran)", p["16-mixed"]["scale"], 2.0**10)
    check.equal("bf16-true: parameters stored bf16", p["bf16-true"]["stored_dtypes"], ["torch.bfloat16"])
    check.equal("bf16-true: compute in bf16", p["bf16-true"]["compute_dtype"], "torch.bfloat16")
    check.equal("32-true: compute in fp32", p["32-true"]["compute_dtype"], "torch.float32")
    check.equal("32-true: the plan keeps the parameters' dtype", p["32-true"]["plan_precision"], ["param"])
    check.equal("bf16-mixed: the plugin", p["bf16-mixed"]["plugin"], "FSDP2FabricMixedPrecision")
    check.equal("32-true: the plugin", p["32-true"]["plugin"], "FSDP2FabricPrecision")
    # One step against the policy written out without the engine (tests/helpers/precision.py; "-true": one
    # bf16 process; "32-true": one fp32 process): the same arithmetic up to fp32 summation order
    # (measured <= 2.2e-08; bf16-true 0). Gradients reduce-scattered in the policy's reduce dtype.
    for name, reduce_dtype in (
        ("bf16-mixed", "float32"),
        ("16-mixed", "float32"),
        ("bf16-true", "bfloat16"),
        ("32-true", "float32"),
    ):
        check.below(f"{name}: the update is the policy's (relative)", p[name]["update_diff"], TOL)
        scatters = sorted({d for n, d in p[name]["reductions"] if n.startswith("reduce_scatter")})
        check.equal(f"{name}: gradients reduce-scattered in {reduce_dtype}", scatters, [reduce_dtype])


def meta_init(out: dict, work: Path) -> None:
    """`fabric.init_module(empty_init=True)` builds on meta; `setup` shards and materialises: the
    weights are the modules' own reset_parameters() draws as in one process, then one step matches."""
    fabric = Fabric(strategy="fsdp2")
    torch.manual_seed(5)
    with fabric.init_module(empty_init=True):
        raw = MLP()
    meta_before = all(p.is_meta for p in raw.parameters())
    model, optimizer = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=LR))
    start = full_params(raw)
    own = MLP()  # the same draws in one process, from the same generator state (building on meta draws nothing)
    torch.manual_seed(5)
    for module in own.modules():
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
    _train(fabric, model, optimizer, batches=BATCHES[:1])
    reference_steps(own_start := copy.deepcopy(own), torch.optim.SGD(own_start.parameters(), lr=LR), BATCHES[:1])
    out.update(
        meta_before=meta_before,
        meta_after=any(p.is_meta for p in raw.parameters()),
        init_diff=max_rel_diff(start, params(own)),
        max_rel_diff=max_rel_diff(full_params(raw), params(own_start)),
    )
    check = Checks(out)
    check.that("init_module(empty_init=True) builds on meta", out["meta_before"])
    check.that("no meta parameter left after setup", not out["meta_after"])
    # The modules' own reset_parameters() draws, as in one process (shards of one draw, not each
    # rank's own), and one step from them matches one process.
    check.equal("materialised weights are one process's draws (exactly)", out["init_diff"], 0.0)
    check.below("one step from them equals one process's (relative)", out["max_rel_diff"], TOL)


class Counter:
    """A stateful object in `state` (has state_dict/load_state_dict), as Fabric allows."""

    def __init__(self, n: int = 0):
        self.n = n

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def _expect_error(fn) -> str | None:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def checkpoints(out: dict, work: Path) -> None:
    """save -> continue vs load -> continue (exact); damaged, partial, filtered, missing key; load_raw."""
    check = Checks(out)
    fabric = Fabric(strategy="fsdp2")
    ck = work / "fabric_ckpt"
    raw, _ = fresh(5)
    model, optimizer = fabric.setup(raw, torch.optim.Adam(raw.parameters(), lr=0.01))
    _train(fabric, model, optimizer, batches=BATCHES[:1])
    with torch.no_grad():
        model(torch.ones(2, 8))  # an evaluation forward leaves the root group gathered ...
    gathered = [n for n, p in raw.named_parameters() if not isinstance(p, DTensor)]
    fabric.save(ck, {"model": model, "optimizer": optimizer, "step": 1, "counter": Counter(7), "note": "hello"})
    plain_after_save = [n for n, p in raw.named_parameters() if not isinstance(p, DTensor)]  # ... the save reshards
    files = sorted(p.name for p in ck.iterdir())
    continued_losses = _train(fabric, model, optimizer, batches=BATCHES[1:])
    continuing = full_params(raw)
    if fabric.global_rank == 0:
        torch.save({"params": continuing, "losses": continued_losses}, work / "continuing.pt")

    # Resume in a new model and optimizer, same world.
    raw2, _ = fresh(6)
    model2, optimizer2 = fabric.setup(raw2, torch.optim.Adam(raw2.parameters(), lr=0.01))
    counter = Counter()
    state = {"model": model2, "optimizer": optimizer2, "step": 0, "counter": counter}
    remainder = fabric.load(ck, state)
    resumed_losses = _train(fabric, model2, optimizer2, batches=BATCHES[1:])
    out.update(
        files=files,
        step=state["step"],
        counter=counter.n,
        remainder=remainder,
        resumed_losses=resumed_losses,
        continued_losses=continued_losses,
        resume_diff=max_rel_diff(full_params(raw2), continuing),
        gathered_before_save=gathered,
        plain_after_save=plain_after_save,
    )
    check.equal(
        "a checkpoint directory's files",
        files,
        [".metadata", "__0_0.distcp", "__1_0.distcp", "checksums.json", "meta.pt"],
    )
    check.equal("load restores the step", state["step"], 1)
    check.equal("load restores a stateful object", counter.n, 7)
    check.equal("load returns what state did not ask for", remainder, {"note": "hello"})
    check.equal("the resumed model is the continuing one (exactly)", out["resume_diff"], 0.0)
    check.equal("the resumed losses are the continuing run's", resumed_losses, continued_losses)
    # fabric.save after an evaluation forward: the root was gathered, the save left only shards.
    check.that("an evaluation forward left the root gathered", "inp.weight" in gathered, gathered)
    check.equal("the save left only shards", plain_after_save, [])

    # Damaged (one byte of rank 0's shard file flipped) and partial (.metadata gone) copies.
    bad, partial = work / "damaged_ckpt", work / "partial_ckpt"
    if fabric.global_rank == 0:
        shutil.copytree(ck, bad)
        shard = bad / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        shutil.copytree(ck, partial)
        (partial / ".metadata").unlink()
    fabric.barrier()
    raw3, _ = fresh(7)
    model3, optimizer3 = fabric.setup(raw3, torch.optim.Adam(raw3.parameters(), lr=0.01))
    before = full_params(raw3)
    out["damaged_error"] = damaged = check.raises(
        "a damaged checkpoint refused, naming the damaged file",
        lambda: fabric.load(bad, {"model": model3, "optimizer": optimizer3}),
        Exception,
        "damaged and was not loaded",
        "__0_0.distcp",
    )
    # What to load instead: the committed checkpoint beside it (not the partial copy), and how.
    hint = (damaged or "").partition("Committed checkpoints beside it")[2]
    check.that(
        "the refusal names the committed checkpoint beside it (not the partial copy) and how to load it",
        "fabric_ckpt" in hint and "partial_ckpt" not in hint and "the same load call with its path" in hint,
        damaged,
    )
    out["partial_error"] = check.raises(
        "a partial checkpoint refused",
        lambda: fabric.load(partial, {"model": model3}),
        Exception,
        "not a committed fsdp2 checkpoint",
    )
    out["unchanged_after_refusals"] = max_rel_diff(full_params(raw3), before)
    check.equal("the refusals left the model unchanged (exactly)", out["unchanged_after_refusals"], 0.0)
    out["missing_key_error"] = missing = _expect_error(lambda: fabric.load(ck, {"model": model3, "absent": 0}))
    check.that(
        "a key the checkpoint lacks raises KeyError naming it",
        missing is not None and missing.startswith("KeyError") and "'absent'" in missing,
        missing,
    )
    out["filter_error"] = check.raises(
        "save(filter=) refused for sharded checkpoints",
        lambda: fabric.save(work / "filtered", {"model": model3}, filter={"model": lambda k, v: "bias" not in k}),
        Exception,
        "filter=",
        "not supported with strategy='fsdp2'",
    )
    out["no_model_error"] = check.raises(
        "a save without a model refused",
        lambda: fabric.save(work / "nomodel", {"step": 1}),
        Exception,
        "needs the model in `state`",
    )

    # load_raw: a plain torch file of full weights into a sharded model.
    source, _ = fresh(8)
    if fabric.global_rank == 0:
        torch.save(source.state_dict(), work / "full.pt")
    fabric.barrier()
    raw4, _ = fresh(9)
    model4 = fabric.setup_module(raw4)
    fabric.load_raw(work / "full.pt", model4)
    out["load_raw_diff"] = max_rel_diff(full_params(raw4), params(source))
    check.equal("load_raw loads full weights into the shards (exactly)", out["load_raw_diff"], 0.0)


def _half_frozen(base_seed: int, head_seed: int) -> MLP:
    """MLP whose input layer and blocks are frozen (from `base_seed`); only `out` trains (from `head_seed`)."""
    model, _ = fresh(base_seed)
    torch.manual_seed(head_seed)
    model.out.reset_parameters()
    for name, p in model.named_parameters():
        p.requires_grad = name.startswith("out.")
    return model


def trainable_only(out: dict, work: Path) -> None:
    """FSDP2FabricStrategy(checkpoint_trainable_only=True) on a model with frozen layers (no PEFT):
    fabric.save stores the trainable part and the base's fingerprint; load continues exactly on the
    same base and refuses another."""
    check = Checks(out)
    fabric = Fabric(strategy=FSDP2FabricStrategy(checkpoint_trainable_only=True))
    ck = work / "fabric_trainable"

    def setup(raw):
        return fabric.setup(raw, torch.optim.SGD([p for p in raw.parameters() if p.requires_grad], lr=LR, momentum=0.9))

    raw = _half_frozen(11, 12)
    model, optimizer = setup(raw)
    _train(fabric, model, optimizer, batches=BATCHES[:1])
    fabric.save(ck, {"model": model, "optimizer": optimizer})
    _train(fabric, model, optimizer, batches=BATCHES[1:])
    raw2 = _half_frozen(11, 13)  # the same base, another head: the head comes from the checkpoint
    model2, optimizer2 = setup(raw2)
    fabric.load(ck, {"model": model2, "optimizer": optimizer2})
    _train(fabric, model2, optimizer2, batches=BATCHES[1:])
    out["resume_diff"] = max_rel_diff(full_params(raw2), full_params(raw))
    names = f2.inspect_checkpoint(ck)
    out["saved_model_keys"] = sorted(k for k in names.tensors if k.startswith("model."))
    check.equal(
        "the checkpoint's model entries are the trainable head's",
        out["saved_model_keys"],
        ["model.out.bias", "model.out.weight"],
    )
    check.below("resumed on the same base: the uninterrupted run (relative)", out["resume_diff"], 1e-6)
    other = _half_frozen(14, 12)
    out["other_base_error"] = check.raises(
        "another base refused, naming a differing parameter",
        lambda: fabric.load(ck, {"model": setup(other)[0]}),
        Exception,
        "another frozen base",
        "inp.weight",
    )


def overlap_save(out: dict, work: Path) -> None:
    """checkpoint_async_save="overlap": fabric.save returns before the (held back) copy, the next step
    waits for it, the checkpoint holds the state of the save bit for bit, and fabric.load commits it."""
    check = Checks(out)
    fabric = Fabric(strategy=FSDP2FabricStrategy(checkpoint_async_save="overlap"))
    ck = work / "fabric_overlap"

    def setup(seed: int):
        raw, _ = fresh(seed)
        return fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=LR, momentum=0.9))

    model, optimizer = setup(21)
    _train(fabric, model, optimizer, batches=BATCHES[:1])
    at_save = full_state(model, optimizer)
    with slow_staging(DELAY):
        start = time.perf_counter()
        fabric.save(ck, {"model": model, "optimizer": optimizer, "step": 1})
        returned_at = time.perf_counter()
        out["returned"], out["copied_before_return"] = returned_at - start, copied_by(returned_at)
        _train(fabric, model, optimizer, batches=BATCHES[1:])
        out["waited"] = time.perf_counter() - start
    out["changed_by_next_step"] = len(differing(full_state(model, optimizer), at_save))
    out["committed_before_load"] = ck.exists()
    model2, optimizer2 = setup(22)
    _train(fabric, model2, optimizer2, batches=BATCHES[1:])  # momentum state to overwrite
    state = {"model": model2, "optimizer": optimizer2, "step": 0}
    fabric.load(ck, state)
    out.update(differs=differing(full_state(model2, optimizer2), at_save), keys=len(at_save), step=state["step"])
    check.that("save returned before its held-back copy", not out["copied_before_return"], out["returned"])
    # "waited" is this rank's own time (PER_RANK in the test): judged on each rank.
    check.that("the next step waited for the copy (>= 0.45 s from the save)", out["waited"] >= 0.45, out["waited"])
    check.equal("the next step changed every entry of the state", out["changed_by_next_step"], out["keys"])
    check.that("not committed before load", not out["committed_before_load"])
    check.equal("load committed and read the state of the save, bit for bit", out["differs"], [])
    check.equal("load restores the step", out["step"], 1)


class _FeedForward(nn.Module):
    """w1 column-wise and w2 row-wise under `_tensor_parallel_ff`; `head` is left to the engine."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2, self.head = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.w2(torch.relu(self.w1(x))))


def _tensor_parallel_ff(model: nn.Module, mesh) -> nn.Module:
    """A `ModelParallelStrategy` parallelize_fn: TP on the "tensor_parallel" mesh dim, nothing else."""
    parallelize_module(model, mesh["tensor_parallel"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    return model


def _dtensor_layout(param) -> dict:
    return dict(
        placements=[f"Shard({p.dim})" if p.is_shard() else type(p).__name__ for p in param.placements],
        dims=list(param.device_mesh.mesh_dim_names),
        local_shape=list(param.to_local().shape),
    )


def model_parallel(out: dict, work: Path) -> None:
    """ModelParallelStrategy's constructor: a parallelize_fn's TP under tensor_parallel_size="auto",
    the engine sharding the rest; save_distributed_checkpoint=False (one file, filter=) loaded into a
    sharded model, and a one-process checkpoint likewise (fabric.load of full single files)."""
    check = Checks(out)
    fabric = Fabric(strategy=FSDP2FabricStrategy(_tensor_parallel_ff, tensor_parallel_size="auto"))
    torch.manual_seed(3)
    raw = _FeedForward()
    ref = copy.deepcopy(raw)
    model, optimizer = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=LR))
    for batch in BATCHES:  # every rank of the TP group sees the whole batch
        fabric.backward(loss_on(model, batch))
        optimizer.step()
        optimizer.zero_grad()
    reference_steps(ref, torch.optim.SGD(ref.parameters(), lr=LR), BATCHES)
    out["tp"] = dict(
        mesh_shape=list(fabric.strategy.device_mesh.shape),
        w1=_dtensor_layout(raw.w1.weight),
        w2=_dtensor_layout(raw.w2.weight),
        head=_dtensor_layout(raw.head.weight),
        root_is_fsdp=isinstance(raw, FSDPModule),
        max_rel_diff=max_rel_diff(full_params(raw), params(ref)),
    )
    tp = out["tp"]
    check.equal('tensor_parallel_size="auto": the node\'s 2 devices in TP', tp["mesh_shape"], [1, 2])
    # The function's column-/row-wise TP, kept as it left it (16 x 8 weight: 8 rows and 8 columns per rank).
    tp_dim = {"dims": ["tensor_parallel"], "local_shape": [8, 8]}
    check.equal("w1 column-wise as the function left it", tp["w1"], {"placements": ["Shard(0)"], **tp_dim})
    check.equal("w2 row-wise as the function left it", tp["w2"], {"placements": ["Shard(1)"], **tp_dim})
    # What it left, sharded by the engine on the data-parallel dim (one rank here).
    check.that("the engine sharded the root", tp["root_is_fsdp"])
    check.equal("the head sharded on the data-parallel dim", tp["head"]["dims"], ["data_parallel"])
    check.below("two SGD steps equal one process's (relative)", tp["max_rel_diff"], TOL)

    # save_distributed_checkpoint=False: one file of full state on rank 0 ...
    fabric = Fabric(strategy=FSDP2FabricStrategy(save_distributed_checkpoint=False))
    raw, _ = fresh(31)
    model, optimizer = fabric.setup(raw, torch.optim.Adam(raw.parameters(), lr=0.01))
    _train(fabric, model, optimizer, batches=BATCHES[:1])
    full_file, filtered = work / "full_state.pt", work / "filtered.pt"
    fabric.save(full_file, {"model": model, "optimizer": optimizer, "step": 1})
    fabric.save(filtered, {"model": model}, filter={"model": lambda k, v: "bias" in k})
    saved = full_params(raw)
    continued_losses = _train(fabric, model, optimizer, batches=BATCHES[1:])
    continuing = full_params(raw)
    # ... loaded by the default (sharded) strategy: weights and Adam state into the shards.
    fabric = Fabric(strategy="fsdp2")
    raw2, _ = fresh(32)
    model2, optimizer2 = fabric.setup(raw2, torch.optim.Adam(raw2.parameters(), lr=0.01))
    _train(fabric, model2, optimizer2, batches=BATCHES[:1])  # optimizer state to overwrite
    state = {"model": model2, "optimizer": optimizer2, "step": 0}
    remainder = fabric.load(full_file, state)
    loaded_diff = max_rel_diff(full_params(raw2), saved)
    resumed_losses = _train(fabric, model2, optimizer2, batches=BATCHES[1:])
    out["full_file"] = dict(
        is_file=full_file.is_file(),
        keys=sorted(torch.load(full_file, weights_only=True)),
        filtered_keys=sorted(torch.load(filtered, weights_only=True)["model"]),
        step=state["step"],
        remainder=remainder,
        loaded_diff=loaded_diff,
        resume_diff=max_rel_diff(full_params(raw2), continuing),
        resumed_losses=resumed_losses,
        continued_losses=continued_losses,
    )
    f = out["full_file"]
    # save_distributed_checkpoint=False: Lightning's single file, filter= applied.
    check.that("save_distributed_checkpoint=False writes one file", f["is_file"])
    check.equal("the file's keys", f["keys"], ["model", "optimizer", "step"])
    check.equal(
        "filter= kept the biases only",
        f["filtered_keys"],
        [f"{n}.bias" for n in ("blocks.0.fc", "blocks.1.fc", "blocks.2.fc", "inp", "out")],
    )
    # fabric.load of it into a sharded model: the saved weights exactly, then Adam continues exactly.
    check.equal("full file: load restores the step", f["step"], 1)
    check.equal("full file: nothing left over", f["remainder"], {})
    check.equal("full file: the saved weights in the shards (exactly)", f["loaded_diff"], 0.0)
    check.below("full file: Adam continues as the saving run (relative)", f["resume_diff"], TOL)
    check.close("full file: the saving run's losses (relative)", f["resumed_losses"], f["continued_losses"], TOL)

    # A one-process checkpoint (what a one-device Fabric writes: plain state dicts) into the shards.
    single, _ = fresh(33)
    single_opt = torch.optim.Adam(single.parameters(), lr=0.01)
    reference_steps(single, single_opt, BATCHES[:1])
    if fabric.global_rank == 0:
        torch.save({"model": single.state_dict(), "optimizer": single_opt.state_dict(), "step": 5}, work / "one.pt")
    fabric.barrier()
    reference_steps(single, single_opt, BATCHES[1:])
    raw3, _ = fresh(34)
    model3, optimizer3 = fabric.setup(raw3, torch.optim.Adam(raw3.parameters(), lr=0.01))
    state3 = {"model": model3, "optimizer": optimizer3, "step": 0}
    fabric.load(work / "one.pt", state3)
    _train(fabric, model3, optimizer3, batches=BATCHES[1:])
    out["one_process"] = dict(step=state3["step"], resume_diff=max_rel_diff(full_params(raw3), params(single)))
    # A one-process checkpoint (plain state dicts, optimizer keyed by index) continues like that process.
    check.equal("one-process checkpoint: load restores the step", out["one_process"]["step"], 5)
    check.below(
        "one-process checkpoint: continues like that process (relative)", out["one_process"]["resume_diff"], TOL
    )


def untrusted(out: dict, work: Path) -> None:
    """A checkpoint whose meta.pt runs code when unpickled (checksums rewritten to match): fabric.load
    refuses it on every rank naming the file, runs nothing and changes nothing; weights_only=False
    (the user's switch: they trust it) loads it."""
    check = Checks(out)
    fabric = Fabric(strategy="fsdp2")
    ck, marker = work / "fabric_untrusted", work / "fabric_untrusted_ran"
    raw, _ = fresh(31)
    model, optimizer = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=LR, momentum=0.9))
    _train(fabric, model, optimizer, batches=BATCHES[:1])
    fabric.save(ck, {"model": model, "optimizer": optimizer, "step": 1})
    if fabric.global_rank == 0:
        plant(ck / "meta.pt", marker)
    fabric.barrier()
    raw2, _ = fresh(32)
    model2, optimizer2 = fabric.setup(raw2, torch.optim.SGD(raw2.parameters(), lr=LR, momentum=0.9))
    _train(fabric, model2, optimizer2, batches=BATCHES[1:2])  # momentum state the load would overwrite
    before = full_state(model2, optimizer2)
    state = {"model": model2, "optimizer": optimizer2, "step": 0}
    out["refusal"] = check.raises(
        "refused naming meta.pt, the type and the switch",
        lambda: fabric.load(ck, state),
        f2.UntrustedCheckpointError,
        "meta.pt",
        "system",
        "weights_only=False",
    )
    out["ran"] = marker.exists()
    out["changed"] = differing(full_state(model2, optimizer2), before)
    check.that("the payload did not run", not out["ran"])
    check.equal("the model and optimizer are unchanged", out["changed"], [])
    fabric.barrier()
    fabric.load(ck, state, weights_only=False)
    out.update(trusted_ran=marker.exists(), step=state["step"])
    check.that("weights_only=False loads it (and so runs it: the user trusted it)", out["trusted_ran"])
    check.equal("... restoring the step", out["step"], 1)


CP_SEQ = 128


def context_parallel(out: dict, work: Path) -> None:
    """`FSDP2FabricStrategy(context_parallel_size=2)`: the loop's `f2.context_parallel(model, batch)`
    on Fabric's module holds half of every sequence per rank; the sampler gives both ranks one
    batch; 2 steps equal one process on whole sequences (a Hugging Face Llama, SDPA, GQA)."""
    check = Checks(out)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 64, (4, CP_SEQ), generator=g)
    labels = ids.clone()
    labels[0, :20] = -100  # the ranks' token counts differ
    rows = [{"input_ids": ids[i], "labels": labels[i]} for i in range(4)]

    def llama():
        return tiny_llama(
            64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CP_SEQ, attn_implementation="sdpa"
        )

    reference = llama()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(2):
        reference(**torch.utils.data.default_collate(rows[2 * step : 2 * step + 2])).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    fabric = Fabric(strategy=FSDP2FabricStrategy(context_parallel_size=2))
    model = fabric.setup_module(llama())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5))
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(rows, batch_size=2))
    shapes = []
    for batch in loader:
        with f2.context_parallel(model, batch) as part:
            shapes.append(list(part["input_ids"].shape))
            logits = model(input_ids=part["input_ids"], position_ids=part["position_ids"]).logits
            fabric.backward(part.loss(logits))
        optimizer.step()
        optimizer.zero_grad()
    check.equal("each rank holds half of every sequence, both ranks one batch", shapes, [[2, CP_SEQ // 2]] * 2)
    check.below(
        "parameters after 2 steps equal one process on whole sequences (relative)",
        max_rel_diff(full_params(model.module), {n: p.detach() for n, p in reference.named_parameters()}),
        TOL,
    )


FLOWS = [
    parity,
    validate_first,
    accumulation,
    clipping,
    precision,
    meta_init,
    checkpoints,
    trainable_only,
    overlap_save,
    untrusted,
    model_parallel,
    context_parallel,
]


def main(out_path: str, work: str, *names: str) -> None:
    run_flows([f for f in FLOWS if not names or f.__name__ in names], out_path, Path(work))
    f2.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])

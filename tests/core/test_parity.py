"""Sharded training equals single-process training on the same global batch (2 ranks, gloo)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.harness import run_agreeing
from helpers.models import TinyGPT, loss_fn, make_batch, rel_diff
from helpers.precision import TIED_TOL, UPDATE_TOL, policy_grads, tied_names

TOL_FP32 = 1e-5

CASES = {
    "full_shard": dict(sharding_strategy="FULL_SHARD"),
    "shard_grad_op": dict(sharding_strategy="SHARD_GRAD_OP"),
    "no_shard": dict(sharding_strategy="NO_SHARD"),
    "hsdp_1x2": dict(sharding_strategy="HYBRID_SHARD", mesh_shape=(1, 2)),
    "hsdp_2x1": dict(sharding_strategy="HYBRID_SHARD", mesh_shape=(2, 1)),
    "hsdp_zero2": dict(sharding_strategy="HYBRID_SHARD_ZERO2", mesh_shape=(1, 2)),
    "min_params": dict(wrap_policy=1000),
    "class_names": dict(wrap_policy=["Block", "Attention"]),
    "offload": dict(cpu_offload=True),
    "ac_auto": dict(activation_checkpointing="auto"),
    "ac_classes": dict(activation_checkpointing=["Attention"], wrap_policy=["Block"]),
    "prefetch": dict(forward_prefetch=2, backward_prefetch=2),
    "two_blocks_per_group": dict(blocks_per_group=2, backward_prefetch=1),
    "reshard_int": dict(reshard_after_forward=1),
    "overrides": dict(
        module_overrides={
            "blocks.1": {"sharding_strategy": "HYBRID_SHARD"},
            "blocks.2": {"reshard_after_forward": False},
        }
    ),
    "scalar_param": dict(),
    "bf16": dict(mixed_precision="bf16"),
    "fp16": dict(mixed_precision="fp16"),
    "compile": dict(compile=True),
}
FAST = [n for n in CASES if n != "compile"]
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}  # core policies: compute dtype, fp32 weights and reduction


def _parity_world(names):
    import torch.distributed as dist
    from helpers.comm import collective_dtypes

    import fsdp2_strategy as f2

    rank, world = dist.get_rank(), dist.get_world_size()
    idx, target = make_batch(n=8)
    local = slice(rank * 8 // world, (rank + 1) * 8 // world)
    report = {}
    for name in names:
        cfg = dict(CASES[name])
        torch.manual_seed(0)
        ref = TinyGPT(temperature=(name == "scalar_param"))
        model = copy.deepcopy(ref)
        # Inductor reorders float ops (grads differ by ~1e-6); Adam's first step is ~lr*sign(g), which
        # turns that into lr-sized flips on near-zero grads, so the compiled case steps with SGD.
        opt_cls = torch.optim.SGD if name == "compile" else torch.optim.AdamW
        f2.shard_model(model, cfg, log_plan=False)
        opt = opt_cls(model.parameters(), lr=1e-2)
        with collective_dtypes() as reductions:
            loss_fn(model, idx[local], target[local]).backward()
        grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        if name in LOW:
            # The policy written out without the engine: each rank's half on a bf16 (fp16) copy, fp32
            # gradients averaged; the update is AdamW on the fp32 weights from the engine's own gradients.
            ref_grads = policy_grads(
                ref,
                [[(idx[r * 4 : (r + 1) * 4], target[r * 4 : (r + 1) * 4])] for r in range(world)],
                loss_fn,
                LOW[name],
            )
            for n, p in ref.named_parameters():
                p.grad = grads[n].clone()
        else:
            loss_fn(ref, idx, target).backward()
            ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        opt_cls(ref.parameters(), lr=1e-2).step()
        opt.step()
        tied = tied_names(ref)
        ref_params = dict(ref.named_parameters())
        report[name] = {
            "grad_err": max(rel_diff(grads[n], ref_grads[n]) for n in ref_grads if n not in tied),
            "tied_grad_err": max((rel_diff(grads[n], ref_grads[n]) for n in tied), default=0.0),
            "param_err": max(rel_diff(_full(p), ref_params[n]) for n, p in model.named_parameters()),
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "state_dtypes": sorted({str(v.dtype) for st in opt.state.values() for k, v in st.items() if k != "step"}),
            "reductions": sorted(reductions),
        }
    return report


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _check(report):
    for name, r in report.items():
        # fp32: against one process on the global batch. bf16 and fp16: gradients against the policy
        # written out (untied parameters: only fp32 summation order differs; the tied embedding: one
        # rounding of the compute dtype, torch adds its two contributions in it), the update against
        # AdamW on the engine's own fp32 gradients (the same arithmetic: measured 0).
        tied_tol = TIED_TOL if name in LOW else TOL_FP32
        param_tol = UPDATE_TOL if name in LOW else TOL_FP32
        assert r["grad_err"] < TOL_FP32, f"{name}: gradient relative difference {r['grad_err']:.2e} >= {TOL_FP32}"
        assert r["tied_grad_err"] < tied_tol, f"{name}: tied gradient difference {r['tied_grad_err']:.2e} >= {tied_tol}"
        assert r["param_err"] < param_tol, (
            f"{name}: parameter difference after one step {r['param_err']:.2e} >= {param_tol}"
        )
        # fp32 master weights and optimizer state; gradients reduced in fp32 (bf16 too: its reduce dtype).
        assert r["param_dtypes"] == ["torch.float32"], (name, r)
        assert r["state_dtypes"] in ([], ["torch.float32"]), (name, r)
        assert r["reductions"] and all(dtype == "float32" for _, dtype in r["reductions"]), (name, r)


def test_parity_every_strategy_two_ranks():
    report = run_agreeing(_parity_world, 2, FAST, timeout=400)
    assert set(report) == set(FAST)
    _check(report)


@pytest.mark.slow
def test_parity_compile_two_ranks():
    _check(run_agreeing(_parity_world, 2, ["compile"], timeout=500))

"""shard_model behaviour on 2 gloo ranks: memory, ties, HF models, meta init, FSDP1 vocabulary, errors.

Each test spawns one world and runs several checks in it (starting a world costs seconds).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from helpers.harness import run_agreeing, run_distributed
from helpers.models import Block, TinyGPT, loss_fn, make_batch, rel_diff
from torch import nn


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _expect(exc_type, pattern, fn, *args, **kwargs):
    import re

    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        assert re.search(pattern, str(exc)), f"message {str(exc)!r} does not match {pattern!r}"
        return str(exc)
    raise AssertionError(f"{fn} did not raise {exc_type.__name__}")


def _memory_ties_plan_world():
    import torch.distributed as dist

    import fsdp2_strategy as f2
    from fsdp2_strategy.shard.report import rank_param_bytes

    out = {}
    torch.manual_seed(0)
    model = TinyGPT(dim=64, layers=4, vocab=128, tied=True)
    full_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    f2.shard_model(model, log_plan=False)
    out["ratio"] = rank_param_bytes(model) / full_bytes
    plan = f2.sharding_plan(model)
    out["plan_names"] = [g.name for g in plan.groups]
    out["plan_text"] = str(plan)
    out["plan_total"] = plan.total_params
    out["full_params"] = sum(
        p.numel() for p in {id(p): p for p in TinyGPT(dim=64, layers=4, vocab=128).parameters()}.values()
    )
    # The tie survives sharding: one parameter object, in the root group.
    out["tied"] = model.head.weight is model.tok.weight

    # Wrapping the embedding and the head separately would split the tie: they are merged.
    tied = TinyGPT(tied=True)
    f2.shard_model(tied, wrap_policy=["Embedding", "Linear", "Block"], log_plan=False)
    out["tied_groups"] = [g.name for g in f2.sharding_plan(tied).groups]
    idx, target = make_batch(n=4)
    loss_fn(tied, idx, target).backward()
    out["tied_grad_ok"] = tied.tok.weight.grad is not None

    # Seeds' example: per-module strategy and precision by glob.
    seeds = TinyGPT(layers=2, tied=False)
    f2.shard_model(
        seeds,
        module_overrides={
            "blocks.0": {"sharding_strategy": "FULL_SHARD"},
            "blocks.1": {"sharding_strategy": "HYBRID_SHARD"},
            "*.attn": {"mixed_precision": "fp16"},
        },
        log_plan=False,
    )
    rows = {g.name: g for g in f2.sharding_plan(seeds).groups}
    out["override_rows"] = {n: (g.strategy, g.precision, g.mesh_shape) for n, g in rows.items()}
    loss_fn(seeds, idx, target).backward()
    out["override_norm_finite"] = bool(torch.isfinite(f2.clip_grad_norm_(seeds.parameters(), 1.0)))

    # blocks_per_group: consecutive blocks in one group, one plan row each; the last group keeps
    # its parameters for backward as a last block does.
    grouped = TinyGPT(dim=64, layers=4, vocab=128, tied=True)
    block_params = sum(p.numel() for p in grouped.blocks[0].parameters())
    f2.shard_model(grouped, blocks_per_group=3, log_plan=False)
    plan = f2.sharding_plan(grouped)
    out["grouped_rows"] = [(g.name, g.num_params, g.reshard_after_forward, g.note) for g in plan.groups]
    out["grouped_total"], out["block_params"] = plan.total_params, block_params
    loss_fn(grouped, idx, target).backward()
    out["grouped_grads"] = all(p.grad is not None for p in grouped.parameters())

    # The resolved plan: decided (and checked) before anything changes, then applied as it says.
    from torch.distributed.tensor import DTensor

    from fsdp2_strategy.shard.plan import plan_sharding

    planned = TinyGPT(dim=64, layers=4, vocab=128, tied=True)
    plan = plan_sharding(planned, f2.FSDP2Config(blocks_per_group=3, accumulation="keep_gathered", log_plan=False))
    out["plan_untouched"] = not any(isinstance(p, DTensor) for p in planned.parameters())
    out["resolved"] = [
        (g.spec.name, g.spec.modules, g.spec.settings.reshard_after_forward, g.spec.settings.reshard_reason)
        for g in plan.groups
    ]
    out["resolved_blocks"], out["resolved_mode"] = plan.blocks, plan.accumulation.name
    out["world"] = dist.get_world_size()
    return out


def test_memory_ties_plan_and_overrides():
    res = run_agreeing(_memory_ties_plan_world, 2)
    # FULL_SHARD: each rank holds half of the parameter bytes (dim-0 padding makes it inexact).
    assert 0.48 < res["ratio"] < 0.53, res["ratio"]
    assert res["plan_names"] == ["<root>", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert res["plan_total"] == res["full_params"]
    assert "last block" in res["plan_text"] and "FULL_SHARD" in res["plan_text"]
    assert res["tied"]
    assert "tok" not in res["tied_groups"] and "head" not in res["tied_groups"]
    assert "blocks.0" in res["tied_groups"] and res["tied_grad_ok"]
    rows = res["override_rows"]
    assert rows["blocks.0"][0] == "FULL_SHARD" and rows["blocks.1"][0] == "HYBRID_SHARD"
    assert rows["blocks.1"][2] == (1, 2) and rows["blocks.0"][2] == (2,)
    assert rows["blocks.0.attn"][1] == "fp16/fp32" and rows["blocks.1.attn"][1] == "fp16/fp32"
    assert res["override_norm_finite"]
    rows = res["grouped_rows"]
    assert [r[0] for r in rows] == ["<root>", "blocks.0 + blocks.1 + blocks.2", "blocks.3"]
    assert rows[1][1] == 3 * res["block_params"] and rows[2][1] == res["block_params"]
    assert rows[1][2] is True and rows[2][2] is False and rows[2][3] == "last block"
    assert res["grouped_total"] == res["full_params"] and res["grouped_grads"]
    # The plan the rows above came from: FULL_SHARD leaves the choice to torch (None: the root kept
    # gathered, the rest resharded; the rows show what happened), one call for three blocks, the last
    # block kept for backward; the model untouched until it is applied.
    assert res["plan_untouched"]
    assert res["resolved"] == [
        ("", ("",), None, ""),
        ("blocks.0", ("blocks.0", "blocks.1", "blocks.2"), None, ""),
        ("blocks.3", ("blocks.3",), False, "last block"),
    ]
    assert res["resolved_blocks"] == ("blocks.0", "blocks.3") and res["resolved_mode"] == "keep_gathered"


def _hf_world():
    from transformers import GPT2Config, GPT2LMHeadModel

    import fsdp2_strategy as f2

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4, tie_word_embeddings=True)
    ref = GPT2LMHeadModel(config).eval()
    model = copy.deepcopy(ref)
    f2.shard_model(model, wrap_policy="auto", log_plan=False)
    plan = f2.sharding_plan(model)
    assert "wrap policy: 'auto' made one group per GPT2Block (the model's _no_split_modules)" in str(plan), str(plan)
    groups = [g.name for g in plan.groups]
    idx, _ = make_batch(n=4, vocab=96)
    import torch.distributed as dist

    rank = dist.get_rank()
    ref(idx, labels=idx).loss.backward()
    model(idx[rank * 2 : rank * 2 + 2], labels=idx[rank * 2 : rank * 2 + 2]).loss.backward()
    ref_grads = dict(ref.named_parameters())
    err = max(rel_diff(_full(p.grad), ref_grads[n].grad) for n, p in model.named_parameters())
    return groups, model.lm_head.weight is model.transformer.wte.weight, err


def test_hf_model_auto_policy_and_tied_embeddings():
    groups, tied, err = run_agreeing(_hf_world, 2)
    assert groups == ["<root>", "transformer.h.0", "transformer.h.1"]  # GPT2Block from _no_split_modules
    assert tied
    assert err < 1e-5


class _NoInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 4))

    def forward(self, x):
        return x @ self.w


def _meta_world():
    import torch.distributed as dist

    import fsdp2_strategy as f2

    out = {}
    torch.manual_seed(7)
    with torch.device("meta"):
        model = TinyGPT(temperature=True)
    f2.shard_model(model, log_plan=False)
    out["on_meta"] = any(p.is_meta for p in model.parameters())
    full = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    # The model's own initialisation (init_weights), reproduced in one process from the same generator
    # state (building on meta draws nothing); on a CPU mesh torch would otherwise give every rank the
    # same draws for its shard.
    own = TinyGPT(temperature=True)
    torch.manual_seed(7)
    own.init_weights()
    out["init_diffs"] = {n: float((full[n] - p.detach()).abs().max()) for n, p in own.named_parameters()}
    out["pos_halves_differ"] = not torch.equal(full["pos"][:8], full["pos"][8:])
    out["ln_ones"] = bool(torch.equal(full["ln_f.weight"], torch.ones_like(full["ln_f.weight"])))
    out["finite"] = all(bool(torch.isfinite(t).all()) for t in full.values())
    out["temperature"] = float(full["temperature"])
    out["plan_has_scalar"] = "REPLICATED" in str(f2.sharding_plan(model))
    # Training from the materialised weights matches one process started from the same weights.
    ref = TinyGPT(temperature=True)
    ref.load_state_dict({**full, "head.weight": full["tok.weight"]})
    idx, target = make_batch(n=4)
    rank = dist.get_rank()
    loss_fn(ref, idx, target).backward()
    loss_fn(model, idx[rank * 2 : rank * 2 + 2], target[rank * 2 : rank * 2 + 2]).backward()
    ref_p = dict(ref.named_parameters())
    out["err"] = max(rel_diff(_full(p.grad), ref_p[n].grad) for n, p in model.named_parameters())
    out["temp_grad"] = float(model.temperature.grad)
    with torch.device("meta"):
        bad = nn.Sequential(_NoInit())
    out["no_init_msg"] = _expect(ValueError, "reset_parameters.*init_weights", f2.shard_model, bad, log_plan=False)
    return out


def test_meta_device_model_is_materialised_and_trains():
    res = run_agreeing(_meta_world, 2)
    assert not res["on_meta"] and res["ln_ones"] and res["finite"]
    assert set(res["init_diffs"].values()) == {0.0}, res["init_diffs"]  # bit for bit the one-process init
    assert res["pos_halves_differ"]
    assert res["temperature"] == 1.5 and res["plan_has_scalar"]
    assert res["err"] < 1e-5


def _fsdp1_and_errors_world():
    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy
    from torch.distributed.tensor import DTensor

    import fsdp2_strategy as f2

    out = {}
    model = TinyGPT(tied=False)
    f2.fully_shard(
        model,
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        cpu_offload=CPUOffload(offload_params=True),
        ignored_modules=[model.ln_f],
        auto_wrap_policy=ModuleWrapPolicy({Block}),
    )
    plan = f2.sharding_plan(model)
    out["fsdp1_rows"] = [(g.name, g.strategy, g.precision, g.cpu_offload, g.reshard_after_forward) for g in plan.groups]
    out["ignored_plain"] = not isinstance(model.ln_f.weight, DTensor)
    model2 = TinyGPT()
    f2.fully_shard(
        model2, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    )
    out["callable_policy"] = [g.name for g in f2.sharding_plan(model2).groups]
    _expect(ValueError, "process_group", f2.fully_shard, TinyGPT(), process_group=object())
    flags = TinyGPT()
    f2.fully_shard(flags, use_orig_params=True, forward_prefetch=True)  # FSDP1 switches: routed through shard_model
    out["flags_rows"] = [(g.name, g.strategy) for g in f2.sharding_plan(flags).groups]

    # Errors, each before the model is touched.
    _expect(ValueError, r"mesh_shape=\(3,\).*world size is 2", f2.shard_model, TinyGPT(), mesh_shape=(3,))
    _expect(
        ValueError,
        r"reshard_after_forward=3 does not divide.*\[1, 2\]",
        f2.shard_model,
        TinyGPT(),
        reshard_after_forward=3,
    )
    _expect(ValueError, "wrap_policy.*'Blok'.*Did you mean 'Block'", f2.shard_model, TinyGPT(), wrap_policy=["Blok"])
    _expect(
        ValueError,
        "module_overrides\\['decoder\\.\\*'\\] matches no module",
        f2.shard_model,
        TinyGPT(),
        module_overrides={"decoder.*": {"mixed_precision": "bf16"}},
    )
    _expect(ValueError, "ignored_modules.*'Dropout'", f2.shard_model, TinyGPT(), ignored_modules=["Dropout"])
    untouched = TinyGPT()
    try:
        f2.shard_model(untouched, mesh_shape=(3,))
    except ValueError:
        pass
    out["untouched"] = not any(isinstance(p, DTensor) for p in untouched.parameters())

    # An optimizer built before sharding is refused at its first step.
    early = TinyGPT()
    opt = torch.optim.SGD(early.parameters(), lr=0.1)
    f2.shard_model(early, log_plan=False)
    idx, target = make_batch(n=2)
    loss_fn(early, idx, target).backward()
    _expect(ValueError, "created before shard_model", opt.step)
    good = torch.optim.SGD(early.parameters(), lr=0.1)
    good.step()

    # Evaluate, then build the optimizer, then train: built after a forward with no backward, the
    # optimizer holds the gathered copies of the root's and the last block's parameters; at its first
    # step it is pointed at their shards, and trains as one built before the evaluation (SGD with
    # momentum: state from the first step on).
    torch.manual_seed(1)
    evaluated = TinyGPT(tied=False)
    reference = copy.deepcopy(evaluated)
    f2.shard_model(evaluated, log_plan=False)
    f2.shard_model(reference, log_plan=False)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    with torch.no_grad():
        evaluated(idx)
    evaluated_opt = torch.optim.SGD(evaluated.parameters(), lr=0.1, momentum=0.9)
    out["built_on_gathered"] = sum(not isinstance(p, DTensor) for g in evaluated_opt.param_groups for p in g["params"])
    for _ in range(3):
        for model_, opt_ in ((evaluated, evaluated_opt), (reference, reference_opt)):
            loss_fn(model_, idx, target).backward()
            opt_.step()
            opt_.zero_grad()
    out["eval_then_train_on_shards"] = all(
        isinstance(p, DTensor) for g in evaluated_opt.param_groups for p in g["params"]
    )
    out["eval_then_train_diff"] = max(
        rel_diff(_full(p), _full(q)) for p, q in zip(evaluated.parameters(), reference.parameters())
    )
    # A method besides forward, registered as an entry point, computes on the gathered parameters.
    from torch.distributed.fsdp import register_fsdp_forward_method

    scored = TinyGPT(tied=False)
    unsharded = copy.deepcopy(scored)
    f2.shard_model(scored, log_plan=False)
    register_fsdp_forward_method(scored, "score")
    hidden = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(3))
    out["score_diff"] = rel_diff(scored.score(hidden), unsharded.score(hidden))
    # f2.reshard gives the memory back at once; an optimizer built after it holds the shards.
    with torch.no_grad():
        early(idx)
    f2.reshard(early)
    resharded = torch.optim.SGD(early.parameters(), lr=0.1)
    loss_fn(early, idx, target).backward()
    resharded.step()
    resharded.zero_grad()

    # forward() instead of model(...) names the fix.
    _expect(ValueError, r"forward\(\) was called directly.*model\(inputs\)", early.forward, idx)
    out["call_ok"] = early(idx).shape == (2, 16, 64)

    # A submodule the user already sharded is left as it is.
    from torch.distributed.fsdp import fully_shard

    pre = TinyGPT(tied=False)
    fully_shard(pre.blocks[0], reshard_after_forward=False)
    f2.shard_model(pre, log_plan=False)
    rows = {g.name: g for g in f2.sharding_plan(pre).groups}
    out["user_group"] = rows["blocks.0"].note
    return out


def test_fsdp1_vocabulary_and_clear_errors():
    res = run_agreeing(_fsdp1_and_errors_world, 2)
    rows = res["fsdp1_rows"]
    assert [r[0] for r in rows] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
    assert all(r[1] == "SHARD_GRAD_OP" and r[2] == "bf16/fp32" and r[3] and r[4] is False for r in rows)
    assert res["ignored_plain"]
    assert res["flags_rows"] == [("<root>", "FULL_SHARD")]
    assert res["callable_policy"] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
    assert res["untouched"] and res["call_ok"]
    assert res["user_group"] == "sharded by the user"
    # Evaluate, then train: the optimizer built on gathered copies (root and last block) trains the shards.
    assert res["built_on_gathered"] > 0 and res["eval_then_train_on_shards"]
    assert res["eval_then_train_diff"] < 1e-6
    assert res["score_diff"] < 1e-6


def _world_size_world(strategy_cases):
    import torch.distributed as dist

    import fsdp2_strategy as f2

    rank, world = dist.get_rank(), dist.get_world_size()
    errs = {}
    idx, target = make_batch(n=8)
    per = 8 // world
    for name, cfg in strategy_cases.items():
        torch.manual_seed(0)
        ref = TinyGPT()
        model = copy.deepcopy(ref)
        f2.shard_model(model, cfg, log_plan=False)
        loss_fn(ref, idx, target).backward()
        loss_fn(model, idx[rank * per : (rank + 1) * per], target[rank * per : (rank + 1) * per]).backward()
        ref_p = dict(ref.named_parameters())
        errs[name] = max(rel_diff(_full(p.grad), ref_p[n].grad) for n, p in model.named_parameters())
    return errs


@pytest.mark.parametrize(
    "world, cases",
    [
        (1, {"full": {}}),
        (
            4,
            {
                "full": {},
                "hsdp_2x2": {"sharding_strategy": "HYBRID_SHARD", "mesh_shape": (2, 2)},
                "reshard_to_2": {"reshard_after_forward": 2},
            },
        ),
    ],
)
def test_world_sizes_one_and_four(world, cases):
    for errs in run_distributed(_world_size_world, world, cases, timeout=300):
        assert set(errs) == set(cases)
        assert all(e < 1e-5 for e in errs.values()), errs


def _hybrid_default_mesh_world():
    import fsdp2_strategy as f2

    model = f2.shard_model(TinyGPT(), sharding_strategy="HYBRID_SHARD", log_plan=False)
    return [g.mesh_shape for g in f2.sharding_plan(model).groups]


def test_hybrid_mesh_follows_node_count():
    # torchrun's LOCAL_WORLD_SIZE=1 on a world of 2 means two nodes: replicate across, shard within.
    shapes = run_agreeing(_hybrid_default_mesh_world, 2, env={"LOCAL_WORLD_SIZE": 1})
    assert set(shapes) == {(2, 1)}
    shapes = run_agreeing(_hybrid_default_mesh_world, 2)
    assert set(shapes) == {(1, 2)}

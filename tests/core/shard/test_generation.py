"""`f2.gathered`: generation on a sharded model without an all-gather per token.

One 2-rank world decodes greedily with a hand-written loop (TinyGPT) and with Hugging Face
`generate` (a tiny Llama built from a config), each on the sharded model outside the context, inside
it, and on one unsharded copy; it counts the collectives per generated token and checks that the
model trains as before afterwards.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.comm import count_collectives
from helpers.harness import run_agreeing
from helpers.models import TinyGPT, loss_fn, make_batch, rel_diff, tiny_llama

NEW = 8  # generated tokens per run


def _greedy(model, prompt: torch.Tensor, new: int) -> torch.Tensor:
    idx = prompt
    with torch.no_grad():
        for _ in range(new):
            idx = torch.cat([idx, model(idx)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


def _gathers(counts) -> int:
    return counts["all_gather_single"] + counts["all_gather_into_tensor"]


def _generation_world():
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import fsdp2_strategy as f2

    out = {}
    torch.manual_seed(0)
    ref = TinyGPT(layers=3, seq=16)
    prompt = torch.randint(0, 64, (2, 4))
    out["reference"] = _greedy(ref, prompt, NEW).tolist()
    model = f2.shard_model(copy.deepcopy(ref), log_plan=False)
    with count_collectives() as outside:
        out["outside"] = _greedy(model, prompt, NEW).tolist()
    with count_collectives() as entering, f2.gathered(model):
        with count_collectives() as inside:
            out["inside"] = _greedy(model, prompt, NEW).tolist()
    out["gathers_outside"], out["gathers_inside"] = _gathers(outside), _gathers(inside)
    out["gathers_entering"] = _gathers(entering) - _gathers(inside)
    out["sharded_after"] = all(isinstance(p, DTensor) for p in model.parameters())
    # Training after the context is as before: the same loss and gradients as a fresh sharded copy.
    fresh = f2.shard_model(copy.deepcopy(ref), log_plan=False)
    idx, target = make_batch(n=4)
    mine = slice(dist.get_rank() * 2, dist.get_rank() * 2 + 2)
    losses = []
    for m in (model, fresh):
        with count_collectives() as step:
            loss = loss_fn(m, idx[mine], target[mine])
            loss.backward()
        losses.append((loss.item(), dict(step)))
    # Each rank its own micro-batch: compared rank by rank, the collectives alike on every rank.
    out["train_after_same_loss"] = losses[0][0] == losses[1][0]
    out["train_after_collectives"] = (losses[0][1], losses[1][1])

    # Inside, FSDP's forward hooks are swapped (forwards without gradients skip them) and put back after;
    # a forward with gradients still runs them: its gradients are reduced as outside the context.
    def hooks(m):
        return [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]

    before = hooks(model)
    for m in (model, fresh):
        m.zero_grad(set_to_none=True)
    with f2.gathered(model):
        inside = hooks(model)
        loss_fn(model, idx[mine], target[mine]).backward()
    loss_fn(fresh, idx[mine], target[mine]).backward()
    out["hooks_swapped_inside"] = len(inside) == len(before) and any(a is not b for a, b in zip(inside, before))
    out["hooks_restored"] = all(a is b for a, b in zip(hooks(model), before)) and len(hooks(model)) == len(before)
    out["grad_inside_diff"] = max(
        rel_diff(p.grad.full_tensor(), q.grad.full_tensor()) for p, q in zip(model.parameters(), fresh.parameters())
    )
    model.zero_grad(set_to_none=True)

    # An exception inside the context: every group resharded, the next forward as usual.
    try:
        with f2.gathered(model):
            model(prompt)
            raise RuntimeError("user error while generating")
    except RuntimeError:
        pass
    out["sharded_after_error"] = all(isinstance(p, DTensor) for p in model.parameters())
    # Over the memory budget: nothing held (a warning says so), the tokens the same.
    with f2.gathered(model, memory_budget=1024), count_collectives() as over:
        out["over_budget"] = _greedy(model, prompt, NEW).tolist()
    out["gathers_over_budget"] = _gathers(over)
    # A budget for part of the model: the groups that fit are held, the others gathered per forward.
    with f2.gathered(model, memory_budget=sum(p.numel() * p.element_size() for p in ref.parameters()) // 2):
        with count_collectives() as partly:
            out["partly_held"] = _greedy(model, prompt, NEW).tolist()
    out["gathers_partly_held"] = _gathers(partly)

    # A reference model (forward only): frozen, every group resharded after forward (the root too),
    # the same logits as the unsharded model; a model sharded for training keeps its root gathered.
    reference = f2.shard_reference(copy.deepcopy(ref), log_plan=False)
    with torch.no_grad():
        out["reference_logits_err"] = rel_diff(reference(prompt), ref(prompt))
        model(prompt)
    out["reference_sharded_after_forward"] = all(isinstance(p, DTensor) for p in reference.parameters() if p.ndim)
    out["trained_root_gathered_after_forward"] = not isinstance(model.tok.weight, DTensor)
    out["reference_frozen"] = not any(p.requires_grad for p in reference.parameters()) and not reference.training
    bf16 = f2.shard_reference(copy.deepcopy(ref), mixed_precision="bf16", log_plan=False)
    out["reference_bf16_dtypes"] = sorted({str(p.dtype) for p in bf16.parameters() if p.ndim})

    # Hugging Face generate on a tiny Llama, greedy.
    # No end token: generate always runs its NEW steps.
    llama = tiny_llama(64, num_hidden_layers=3, num_attention_heads=4, pad_token_id=None, eos_token_id=None).eval()
    ids = torch.randint(0, 64, (1, 5))
    out["hf_reference"] = llama.generate(ids, max_new_tokens=NEW, do_sample=False).tolist()
    sharded = f2.shard_model(copy.deepcopy(llama), log_plan=False)
    with count_collectives() as hf_outside:
        out["hf_outside"] = sharded.generate(ids, max_new_tokens=NEW, do_sample=False).tolist()
    with f2.gathered(sharded), count_collectives() as hf_inside:  # generate's own defaults
        out["hf_inside"] = sharded.generate(ids, max_new_tokens=NEW, do_sample=False).tolist()
    with f2.gathered(sharded), count_collectives() as hf_synced:
        out["hf_synced"] = sharded.generate(ids, max_new_tokens=NEW, do_sample=False, synced_gpus=True).tolist()
    out["hf_generate_restored"] = "generate" not in vars(sharded)
    out["hf_gathers_outside"], out["hf_inside_collectives"] = _gathers(hf_outside), sum(hf_inside.values())
    out["hf_synced_all_reduces"] = hf_synced["all_reduce"]
    # A PEFT model's generate takes **kwargs and hands them to the base model's: defaulted too.
    from peft import LoraConfig, get_peft_model

    peft_model = f2.shard_model(
        get_peft_model(copy.deepcopy(llama), LoraConfig(r=2, target_modules=["q_proj"])), log_plan=False
    )
    with f2.gathered(peft_model), count_collectives() as peft_inside:
        out["peft_tokens"] = peft_model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False).tolist()
    out["peft_inside_collectives"] = sum(peft_inside.values())
    out["hf_groups"] = len(f2.sharding_plan(sharded).groups)
    return out


@pytest.fixture(scope="module")
def generation():
    return run_agreeing(_generation_world, 2, timeout=300)


def test_tokens_equal_one_process_inside_and_outside(generation):
    r = generation
    assert r["inside"] == r["outside"] == r["reference"]
    assert r["hf_inside"] == r["hf_outside"] == r["hf_synced"] == r["hf_reference"]


def test_no_collective_per_token_inside_the_context(generation):
    r = generation
    # Outside: every forward gathers the groups FSDP reshards after forward (TinyGPT: 3 blocks, the
    # last kept, the root kept: 2 per token, 2 x 8 + the first forward's 2 others); inside: none. On
    # entering, one all-gather for each group not gathered yet: the forward-only passes before left
    # the root and the last block gathered, so 2.
    assert r["gathers_outside"] == 2 * NEW + 2 and r["gathers_inside"] == 0, r
    assert r["gathers_entering"] == 2, r
    assert r["hf_gathers_outside"] >= NEW, r
    # Inside, generate defaults to synced_gpus=False: no collective at all (ranks need not stay in
    # step); a caller's explicit synced_gpus=True is kept (one all-reduce per step to stop together).
    assert r["hf_inside_collectives"] == 0 and r["hf_synced_all_reduces"] >= NEW, r
    assert r["hf_generate_restored"]
    assert r["peft_tokens"] == r["hf_reference"] and r["peft_inside_collectives"] == 0, r


def test_a_generate_without_synced_gpus_is_left_alone():
    from torch import nn

    from fsdp2_strategy.shard.gathered import _takes_synced_gpus

    class Decoder(nn.Module):
        def generate(self, ids, steps=8, **options):
            return ids

    class HF(nn.Module):
        def generate(self, ids, synced_gpus=None):
            return ids

    assert not _takes_synced_gpus(Decoder(), Decoder().generate)  # **options, but no HF generate inside
    assert _takes_synced_gpus(HF(), HF().generate)


def test_forwards_without_gradients_skip_fsdps_hooks_inside_and_with_gradients_run_them(generation):
    r = generation
    assert r["hooks_swapped_inside"] and r["hooks_restored"], r
    assert r["grad_inside_diff"] < 1e-6, r["grad_inside_diff"]


def test_model_is_sharded_and_trains_as_before_after_the_context(generation):
    r = generation
    assert r["sharded_after"] and r["sharded_after_error"]
    step, fresh_step = r["train_after_collectives"]
    assert r["train_after_same_loss"] and step == fresh_step, r["train_after_collectives"]


def test_over_the_budget_only_the_groups_that_fit_are_held(generation):
    r = generation
    assert r["over_budget"] == r["reference"] and r["gathers_over_budget"] == r["gathers_outside"]
    # Half the model's bytes: some groups held, so fewer all-gathers per token than outside, not none.
    assert r["partly_held"] == r["reference"]
    assert 0 < r["gathers_partly_held"] < r["gathers_outside"], (r["gathers_partly_held"], r["gathers_outside"])


def test_reference_model_is_frozen_in_the_compute_dtype_and_resharded_after_forward(generation):
    r = generation
    assert r["reference_logits_err"] < 1e-5, r["reference_logits_err"]
    assert r["reference_sharded_after_forward"] and r["trained_root_gathered_after_forward"], r
    assert r["reference_frozen"] and r["reference_bf16_dtypes"] == ["torch.bfloat16"], r

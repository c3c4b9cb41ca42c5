"""The chunked causal-LM loss: `f2.chunked_causal_lm_loss` against the plain cross-entropy of the full
logits, and `FSDP2Config.chunked_loss` installed by `shard_model` on a Hugging Face causal LM (one
2-rank world: the same loss and gradients as one unsharded process, and where it does not apply)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers.harness import run_agreeing
from helpers.models import TinyGPT, rel_diff, tiny_llama
from torch.distributed._tools.mem_tracker import MemTracker

import fsdp2_strategy as f2
from fsdp2_strategy.train.chunked_loss import chunk_tokens


def _plain(hidden, weight, labels, bias=None, num_items=None):
    """transformers' ForCausalLMLoss on the full logits."""
    logits = F.linear(hidden, weight, bias).float()
    targets = F.pad(labels[..., 1:], (0, 1), value=-100)
    reduction = "mean" if num_items is None else "sum"
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction)
    return loss if num_items is None else loss / num_items


def _inputs(dtype=torch.float32, vocab=300, bias=False):
    torch.manual_seed(0)
    hidden = torch.randn(2, 37, 16, dtype=dtype, requires_grad=True)
    weight = (torch.randn(vocab, 16) * 0.3).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (2, 37))
    labels[0, :9] = -100  # a masked prompt
    labels[1, 20:] = -100  # padding
    b = torch.randn(vocab, dtype=dtype, requires_grad=True) if bias else None
    return hidden, weight, labels, b


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize(
    "chunk_size, bias, num_items",
    [(None, False, None), (1, False, None), (7, True, None), (1000, False, None), (5, False, 50)],
)
def test_loss_and_gradients_equal_the_plain_loss_in_fp32(chunk_size, bias, num_items):
    hidden, weight, labels, b = _inputs(bias=bias)
    plain = _plain(hidden, weight, labels, b, num_items)
    chunked = f2.chunked_causal_lm_loss(
        hidden, weight, labels, bias=b, chunk_size=chunk_size, num_items_in_batch=num_items
    )
    assert chunked.dtype == torch.float32
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-6)
    for mine, ref in zip(_grads(chunked * 3.0, hidden, weight, b), _grads(plain * 3.0, hidden, weight, b)):
        assert rel_diff(mine, ref) < 1e-6  # the incoming gradient (3.0) scales every gradient


def test_pre_shifted_labels_score_each_position_as_given():
    hidden, weight, labels, _ = _inputs()
    shifted = F.pad(labels[..., 1:], (0, 1), value=-100)
    by_shift = f2.chunked_causal_lm_loss(hidden, weight, torch.zeros_like(labels), shift_labels=shifted)
    assert by_shift.item() == pytest.approx(_plain(hidden, weight, labels).item(), rel=1e-6)


def test_bf16_within_bf16_rounding_of_the_plain_loss():
    hidden, weight, labels, _ = _inputs(torch.bfloat16, vocab=512)
    plain, chunked = _plain(hidden, weight, labels), f2.chunked_causal_lm_loss(hidden, weight, labels, chunk_size=8)
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-3)
    for mine, ref in zip(_grads(chunked, hidden, weight), _grads(plain, hidden, weight)):
        assert mine.dtype == torch.bfloat16 and rel_diff(mine, ref) < 2e-2


def test_no_labelled_position_gives_a_differentiable_zero():
    hidden, weight, labels, _ = _inputs()
    loss = f2.chunked_causal_lm_loss(hidden, weight, torch.full_like(labels, -100))
    assert loss.item() == 0.0
    grad_hidden, grad_weight = _grads(loss, hidden, weight)
    assert not grad_hidden.any() and not grad_weight.any()


def test_frozen_weight_gets_no_gradient_and_costs_none():
    hidden, weight, labels, _ = _inputs()
    frozen = weight.detach()
    (grad,) = _grads(f2.chunked_causal_lm_loss(hidden, frozen, labels), hidden)
    (ref,) = _grads(_plain(hidden, frozen, labels), hidden)
    assert rel_diff(grad, ref) < 1e-6


def test_shapes_that_do_not_fit_are_refused():
    hidden, weight, labels, _ = _inputs()
    with pytest.raises(ValueError, match=r"do not fit: expected hidden_states \(\.\.\., sequence, hidden\)"):
        f2.chunked_causal_lm_loss(hidden, weight[:, :8], labels)


def test_chunks_hold_about_the_hidden_states():
    assert chunk_tokens(8192, 2048, 32000) == 512  # 16 chunks of 512 x 32,000 logits: 16 M elements each
    assert chunk_tokens(8192, 4096, 128256) == 256  # 32 chunks
    assert chunk_tokens(1_000_000, 4096, 128256) == 32768  # 31,250 rounded up to a power of two
    assert chunk_tokens(3, 64, 1000) == 256 and chunk_tokens(0, 64, 1000) == 256  # the floor


def _loss_step_peak(vocab: int, chunked: bool, tokens: int = 1024, hidden_size: int = 64) -> int:
    """Peak live bytes (torch's MemTracker) of the loss's forward and backward, fp32."""
    torch.manual_seed(0)
    hidden = torch.randn(1, tokens, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    tracker = MemTracker()
    tracker.track_external(hidden, weight)
    with tracker:
        loss = f2.chunked_causal_lm_loss(hidden, weight, labels) if chunked else _plain(hidden, weight, labels)
        loss.backward()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


@pytest.mark.parametrize("vocab", [32000, 128256])
def test_the_loss_step_peak_is_a_fraction_of_the_plain_one(vocab):
    plain, chunked = _loss_step_peak(vocab, False), _loss_step_peak(vocab, True)
    logits = 1024 * vocab * 4
    # The plain step holds the fp32 logits, their log-softmax and its gradient at once (>= 2x the
    # logits); the chunked one the weight's gradient and one chunk (benchmarks/chunked_loss.py).
    assert plain > 2 * logits, (plain, logits)
    assert chunked < 0.25 * plain, (chunked, plain)


def test_the_memory_planner_counts_the_loss_the_step_will_run():
    model = tiny_llama(32000)
    ids = torch.randint(0, 32000, (2, 256), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    chunked = f2.estimate_memory(model, world_size=2, example_batch=batch).peak_bytes
    plain = f2.estimate_memory(model, {"chunked_loss": False}, world_size=2, example_batch=batch).peak_bytes
    logits = 512 * 32000 * 4  # fp32: the plain step holds them and their log-softmax at once, at least
    assert plain - chunked > 1.5 * logits, (plain, chunked, logits)


# --------------------------------------------------------------------------- installed by shard_model
VOCAB = 256


def _batch(rank: int | None):
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (4, 24))
    labels = ids.clone()
    labels[:, :6] = -100
    labels[3, 15:] = -100  # uneven: the mean runs over each rank's own tokens, as one process's would not
    rows = slice(None) if rank is None else slice(2 * rank, 2 * rank + 2)
    return ids[rows], labels[rows]


def _step_grads(model, ids, labels, **kwargs):
    out = model(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    return out, {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def _compare(sharded, reference, rank: int, world: int) -> float:
    """Relative gradient difference of one step on the global batch: each rank sums its labelled
    tokens' losses over the global count (`num_items_in_batch`, as the HF Trainer does), FSDP averages."""
    ids, labels = _batch(rank)
    all_ids, all_labels = _batch(None)
    total = int((all_labels[:, 1:] != -100).sum())
    _, mine = _step_grads(sharded, ids, labels, num_items_in_batch=total / world)
    _, ref = _step_grads(reference, all_ids, all_labels, num_items_in_batch=total)
    return max(rel_diff(mine[n], ref[n]) for n in ref)


class Holder(torch.nn.Module):
    """A module holding a causal LM, as a LightningModule does."""

    def __init__(self):
        super().__init__()
        self.lm = tiny_llama(VOCAB)

    def forward(self, **kwargs):
        return self.lm(**kwargs)


def _installed_world():
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, kwargs, shard in [
        ("untied", {}, {}),
        ("tied", {"tie_word_embeddings": True}, {}),
        ("lm_head own group", {}, {"module_overrides": {"lm_head": {"reshard_after_forward": True}}}),
    ]:
        reference = tiny_llama(VOCAB, **kwargs)
        model = f2.shard_model(copy.deepcopy(reference), log_plan=False, **shard)
        out[f"{name}: plan"] = f2.sharding_plan(model).loss
        out[f"{name}: grad diff"] = _compare(model, reference, rank, world)

    reference = Holder()
    model = f2.shard_model(copy.deepcopy(reference), log_plan=False)
    out["held by another module: plan"] = f2.sharding_plan(model).loss
    out["held by another module: grad diff"] = _compare(model, reference, rank, world)

    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    reference = get_peft_model(tiny_llama(VOCAB), lora)
    model = f2.shard_model(copy.deepcopy(reference), log_plan=False)
    out["lora: plan"] = f2.sharding_plan(model).loss
    out["lora: grad diff"] = _compare(model, reference, rank, world)

    model = f2.shard_model(tiny_llama(VOCAB), log_plan=False)
    ids, labels = _batch(rank)
    trained, _ = _step_grads(model, ids, labels)
    out["training logits"] = repr(trained.logits)
    try:
        trained.logits.argmax(-1)
    except AttributeError as exc:
        out["logits use"] = str(exc)
    out["loss first"] = list(trained.keys())[0]
    with torch.no_grad():
        out["no labels logits"] = list(model(input_ids=ids).logits.shape)
        model.eval()
        evaluated = model(input_ids=ids, labels=labels)
        out["eval logits"] = list(evaluated.logits.shape)
    plain = f2.shard_model(tiny_llama(VOCAB), chunked_loss=False, log_plan=False)
    plain_out, _ = _step_grads(plain, ids, labels)
    out["chunked_loss=False: logits"] = list(plain_out.logits.shape)
    out["chunked_loss=False: plan"] = f2.sharding_plan(plain).loss
    out["eval loss equals plain"] = abs(evaluated.loss.item() - plain_out.loss.item()) < 1e-6

    capped = tiny_llama(VOCAB)
    capped.config.final_logit_softcapping = 30.0
    out["softcapped: plan"] = f2.sharding_plan(f2.shard_model(capped, log_plan=False)).loss
    for name, model_fn in [("TinyGPT", lambda: TinyGPT(seq=16)), ("softcapped", lambda: capped)]:
        try:
            f2.shard_model(model_fn(), chunked_loss=True, log_plan=False)
        except ValueError as exc:
            out[f"{name}: chunked_loss=True"] = str(exc)
    return out


@pytest.fixture(scope="module")
def installed():
    return run_agreeing(_installed_world, 2, timeout=300)


def test_sharded_llama_step_equals_one_process(installed):
    for name in ("untied", "tied", "lm_head own group", "held by another module", "lora"):
        assert installed[f"{name}: plan"].startswith("chunked cross-entropy"), installed[f"{name}: plan"]
        assert installed[f"{name}: grad diff"] < 1e-5, (name, installed[f"{name}: grad diff"])


def test_training_output_has_the_loss_and_no_logits(installed):
    assert installed["loss first"] == "loss"
    assert installed["training logits"] == "LogitsNotBuilt(see FSDP2Config.chunked_loss)"
    assert "pass chunked_loss=False" in installed["logits use"]


def test_evaluation_and_forwards_without_labels_are_the_models_own(installed):
    assert installed["no labels logits"] == installed["eval logits"] == [2, 24, VOCAB]
    assert installed["chunked_loss=False: logits"] == [2, 24, VOCAB]
    assert installed["chunked_loss=False: plan"] == "the model's own (chunked_loss=False)"
    assert installed["eval loss equals plain"]


def test_models_it_does_not_fit_keep_their_loss_or_are_refused_by_name(installed):
    assert installed["softcapped: plan"] == (
        "the model's own: LlamaForCausalLM changes its logits after the output layer (final_logit_softcapping)"
    )
    assert installed["TinyGPT: chunked_loss=True"].startswith(
        "FSDP2Config.chunked_loss=True: TinyGPT holds no Hugging Face causal LM (a *ForCausalLM class)"
    )
    assert "final_logit_softcapping" in installed["softcapped: chunked_loss=True"]


def test_installing_twice_installs_once_and_an_unsharded_model_trains_the_same():
    from fsdp2_strategy.train import install_chunked_loss

    model, plain = tiny_llama(VOCAB), tiny_llama(VOCAB)
    for _ in range(2):
        assert install_chunked_loss(model, "auto", tensor_parallel=False).startswith("chunked cross-entropy")
    assert len(model.lm_head._forward_pre_hooks) == 1 and len(model.lm_head._forward_hooks) == 1
    ids, labels = _batch(None)
    mine, ref = _step_grads(model, ids, labels), _step_grads(plain, ids, labels)
    assert mine[0].loss.item() == pytest.approx(ref[0].loss.item(), rel=1e-6)
    assert max(rel_diff(mine[1][n], ref[1][n]) for n in ref[1]) < 1e-5


def test_config_refuses_other_values():
    with pytest.raises(ValueError, match=r"FSDP2Config.chunked_loss=1 is invalid; use 'auto', True or False"):
        f2.FSDP2Config(chunked_loss=1)

"""Measured per-rank peaks of real FSDP2 training steps, to check `f2.estimate_memory` against.

`measure_peak` runs inside a spawned rank: it shards a fresh model, takes one warm-up step (so the
optimizer state exists, as in every later step), then measures one more optimizer step with
torch's `MemTracker` (live tensor bytes, counting FSDP2's storage resizes). The models cover
tied weights (TinyGPT), buffers and BatchNorm (ConvNet), a Hugging Face encoder (MiniLM) and the
same with LoRA (frozen base), and a Llama-shaped QLoRA model (4-bit base).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

import fsdp2_strategy as f2
from fsdp2_strategy.estimate.sim_optimizer import optimizer_factory
from helpers.models import TinyGPT, make_batch


class ConvBlock(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)
        self.bn = nn.BatchNorm2d(ch)

    def forward(self, x):
        return x + F.relu(self.bn(self.conv(x)))


class ConvNet(nn.Module):
    """Blocks with BatchNorm buffers (running stats are not sharded)."""

    def __init__(self, ch: int = 16, blocks: int = 3, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, ch, 3, padding=1)
        self.blocks = nn.Sequential(*[ConvBlock(ch) for _ in range(blocks)])
        self.head = nn.Linear(ch, classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def gpt_model():
    torch.manual_seed(0)
    return TinyGPT(vocab=512, dim=128, heads=4, layers=4, seq=64)


def gpt_batch(n=8):
    idx, tgt = make_batch(n, seq=64, vocab=512)
    return {"idx": idx, "target": tgt}


def gpt_loss(model, batch):
    logits = model(batch["idx"])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch["target"].reshape(-1))


def conv_model():
    torch.manual_seed(0)
    return ConvNet(ch=32, blocks=4)


def conv_batch(n=8):
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(n, 3, 32, 32, generator=g), "y": torch.randint(0, 10, (n,), generator=g)}


def conv_loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])


def minilm_model():
    import importlib.util
    from pathlib import Path

    from transformers import AutoConfig, AutoModel

    # examples/reviews.py, loaded from its file (the examples are scripts, not an importable package).
    spec = importlib.util.spec_from_file_location(
        "reviews", Path(__file__).resolve().parents[2] / "examples" / "reviews.py"
    )
    reviews = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reviews)
    pretrained_dir = reviews.pretrained_dir

    torch.manual_seed(0)
    return AutoModel.from_config(AutoConfig.from_pretrained(pretrained_dir()))


def minilm_lora_model():
    """all-MiniLM-L6-v2 with PEFT LoRA (r=8) on the attention's query and value: 0.15 M trainable parameters."""
    import peft

    model = minilm_model()
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"]))


def minilm_batch(n=8, seq=64):
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, 30000, (n, seq), generator=g)}


def minilm_loss(model, batch):
    return model(input_ids=batch["input_ids"]).last_hidden_state.float().pow(2).mean()


def qlora_model():
    """A Llama-shaped Hugging Face model (4 layers of width 256) whose attention and MLP projections are
    bitsandbytes NF4 layers (bf16 storage, fp32 compute), with PEFT LoRA (r=8) on q_proj and v_proj."""
    import bitsandbytes as bnb
    import peft

    from helpers.models import tiny_llama

    model = tiny_llama(512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=4, max_position_embeddings=64)  # fmt: skip
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, linear in list(parent.named_children()):
                if isinstance(linear, nn.Linear):
                    quantised = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=False,
                                                  compute_dtype=torch.float32, quant_type="nf4",
                                                  quant_storage=torch.bfloat16)  # fmt: skip
                    quantised.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4",
                                                         quant_storage=torch.bfloat16, module=quantised)  # fmt: skip
                    setattr(parent, name, quantised)
    model.to("cpu")  # bitsandbytes quantises here
    model.requires_grad_(False)
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))


def qlora_batch(n=8, seq=64):
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(3, 512, (n, seq), generator=g)}


def qlora_loss(model, batch):
    return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss


MODELS = {
    "gpt": (gpt_model, gpt_batch, gpt_loss),
    "convnet": (conv_model, conv_batch, conv_loss),
    "minilm": (minilm_model, minilm_batch, minilm_loss),
    "minilm_lora": (minilm_lora_model, minilm_batch, minilm_loss),
    "qlora": (qlora_model, qlora_batch, qlora_loss),
}


def train_step(model, opt, batch, loss_fn, micro_batches: int, tracker=None) -> None:
    """One optimizer step; `f2.no_sync` on all but the last micro-batch follows the model's mode."""
    for i in range(micro_batches):
        if tracker is not None and i:
            tracker.reset_mod_stats()  # MemTracker refuses a second forward otherwise; totals are kept
        with f2.no_sync(model) if i < micro_batches - 1 else contextlib.nullcontext():
            loss_fn(model, batch).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


class FrozenAwareTracker(MemTracker):
    """torch's MemTracker registers a gradient hook on every parameter, which a frozen one refuses (a
    LoRA base): no hooks for modules holding frozen parameters. The hooks only label gradient storages,
    which the dispatch mode counts anyway, so the totals measured here are unchanged."""

    def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
        frozen = any(not p.requires_grad for p in module.parameters())
        return super()._track_module_params_and_buffers(module, install_grad_hooks and not frozen)


def measure_peak(
    model_name: str,
    config: dict,
    optimizer="adamw",
    micro_batches: int = 1,
    batch_size: int = 8,
    with_reference: bool = False,
) -> int:
    """Peak live tensor bytes of this rank during one steady-state optimizer step (the accumulation
    mode is the config's); `with_reference`: a copy of the model sharded by `f2.shard_reference`
    beside it (its shards counted; its no-grad forward, between steps, is not measured here)."""

    make_model, make_batch_, loss_fn = MODELS[model_name]
    model = f2.shard_model(make_model(), {**config, "log_plan": False})
    reference = f2.shard_reference(make_model(), {**config, "log_plan": False}) if with_reference else None
    opt = optimizer_factory(optimizer)(list(model.parameters()))
    batch = make_batch_(batch_size)

    if reference is not None:
        with torch.no_grad():
            loss_fn(reference, batch)  # (outside the tracker: it counts one forward per module)
    train_step(model, opt, batch, loss_fn, micro_batches)  # warm-up: optimizer state exists
    tracker = FrozenAwareTracker()
    tracker.track_external(model, opt, *([reference] if reference is not None else []))
    with tracker:
        train_step(model, opt, batch, loss_fn, micro_batches, tracker)
    snapshot = tracker.get_tracker_snapshot("peak")
    return max(s["Total"] for s in snapshot.values())


def estimate_peak(
    model_name: str,
    config: dict,
    world_size: int,
    optimizer="adamw",
    micro_batches: int = 1,
    batch_size: int = 8,
    nodes: int = 1,
    with_reference: bool = False,
):
    make_model, make_batch_, loss_fn = MODELS[model_name]
    return f2.estimate_memory(
        make_model(),
        config,
        reference=make_model() if with_reference else None,
        world_size=world_size,
        nodes=nodes,
        optimizer=optimizer,
        example_batch=make_batch_(batch_size),
        loss_fn=loss_fn,
        micro_batches=micro_batches,
    )

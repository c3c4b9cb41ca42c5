"""The QLoRA headline on paper: which Llama-shaped QLoRA runs fit which GPUs, by the memory planner.

Each model is built on the meta device from its config (no download) and given transformers'
bitsandbytes NF4 layers (`replace_with_bnb_linear`, double quantisation, bf16 storage, lm_head
kept in bf16) and PEFT LoRA r=16 on every linear layer; `f2.estimate_memory` plays one step of
FULL_SHARD, bf16 mixed precision, activation checkpointing, AdamW, sequence 2048, batch 1 per rank,
with the 4-bit base sharded (the default), the same with `cpu_offload=True`, and the base kept whole
on every rank (`quantised_weights="replicate"`, the behaviour before sharding).
These are estimates of peak tensor memory, not measurements; the CUDA caching allocator and
the NCCL/cuBLAS workspaces come on top (a few hundred MiB to a few GiB).

    python benchmarks/qlora_plan.py [--models 8B 70B] [--out benchmarks/results/qlora_plan.txt]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import fsdp2_strategy as f2

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
}
CLUSTERS = [(2, 24), (4, 24), (8, 80)]  # (GPUs, GB each)
SEQ = 2048


def qlora_on_meta(shape: str):
    """A Llama-3-shaped model on meta, NF4 linear layers (double quantisation, bf16 storage), LoRA r=16
    on all of them."""
    import peft
    import transformers
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    config = transformers.LlamaConfig(
        **SHAPES[shape], num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192
    )
    quantisation = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=torch.bfloat16,
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model = replace_with_bnb_linear(model, modules_to_not_convert=["lm_head"], quantization_config=quantisation)
    model.requires_grad_(False)
    return peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "qlora_plan.txt"))
    args = parser.parse_args()
    batch = {"input_ids": torch.zeros(1, SEQ, dtype=torch.long), "labels": torch.zeros(1, SEQ, dtype=torch.long)}
    config = {"sharding_strategy": "FULL_SHARD", "mixed_precision": "bf16", "activation_checkpointing": "auto"}
    lines = [
        f"# {time.strftime('%Y-%m-%d')}, fsdp2-strategy {f2.__version__}, torch {torch.__version__}; estimates "
        f"(f2.estimate_memory, device_type='cuda'), FULL_SHARD + bf16 + activation checkpointing, AdamW, "
        f"seq {SEQ}, batch 1 per rank, NF4 with double quantisation (bf16 storage), LoRA r=16 on all linear layers",
        "| model | trainable | GPUs | base sharded | fits | + CPU offload (device) | fits | base whole on every rank | fits |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for shape in args.models:
        model = qlora_on_meta(shape)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        for gpus, gb in CLUSTERS:
            variants = ({}, {"cpu_offload": True}, {"quantised_weights": "replicate"})
            peaks = [
                f2.estimate_memory(
                    model, {**config, **variant}, world_size=gpus, example_batch=batch, device_type="cuda"
                ).peak_bytes
                for variant in variants
            ]
            cells = [f"{p / 1e9:.1f} GB | {'yes' if p <= gb * 1e9 else 'no'}" for p in peaks]
            lines.append(
                f"| Llama-3-{shape} QLoRA | {trainable / 1e6:.0f} M | {gpus} x {gb} GB | " + " | ".join(cells) + " |"
            )
            print(lines[-1], flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

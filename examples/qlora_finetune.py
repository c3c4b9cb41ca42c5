"""QLoRA on 2 CPU processes: a small Llama-shaped model in NF4 (bitsandbytes), LoRA on every
projection, the 4-bit base sharded across the ranks, through Lightning's Trainer or Hugging Face's.

    python examples/qlora_finetune.py                       # Lightning: Trainer(strategy=FSDP2Strategy())
    accelerate launch --config_file examples/accelerate_fsdp2.yaml \\
        --fsdp_transformer_layer_cls_to_wrap LlamaDecoderLayer examples/qlora_finetune.py --trainer hf

The "pretrained" model is built from a config and saved in bf16 (nothing is downloaded), then
loaded as QLoRA recipes do: `from_pretrained(..., quantization_config=BitsAndBytesConfig(4-bit))`
and `peft.get_peft_model`. It computes in bf16 where the CPU does so natively, in fp32 elsewhere
(`--precision` chooses; through the HF Trainer the accelerate config file's `mixed_precision`). The task: sequences counting up modulo the vocabulary, so the loss has
something to learn. At the end rank 0 prints one JSON line: the 4-bit bytes each rank holds against
the whole base, the first and last training losses, and the adapter reloaded with
`PeftModel.from_pretrained` on a fresh 4-bit base: its logits against the trained model's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import warnings
from pathlib import Path

import torch
from reviews import choose_precision  # examples/reviews.py: shared by the examples

import fsdp2_strategy as f2

VOCAB, SEQ = 256, 32


def save_pretrained_base(folder: Path) -> None:
    """A Llama-shaped model (4 layers of width 256) saved in bf16, as a downloaded checkpoint would be."""
    import transformers

    if (folder / "config.json").is_file():
        return
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=SEQ, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)


def load_qlora(folder: Path, dtype: torch.dtype, lora: bool = True):
    """The base in NF4 (double quantisation, computing in `dtype`), and PEFT LoRA r=8 on every projection."""
    import peft
    import transformers

    quantisation = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantisation, dtype=dtype)
    model.train()  # from_pretrained returns eval mode; bitsandbytes' CPU eval kernel is for inference
    if not lora:
        return model
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))


def counting_data(rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    starts = torch.randint(0, VOCAB, (rows, 1), generator=g)
    return (starts + torch.arange(SEQ)) % VOCAB


def base_bytes(model) -> tuple[int, int]:
    """(4-bit bytes this rank holds, the whole base's): the packed weights, sharded or not."""
    names = f2.shard.quantised_param_names(model)
    params = {n: p for n, p in model.named_parameters() if n in names}
    local = sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in params.values())
    return local, sum(p.numel() * p.element_size() for p in params.values())


def run_lightning(args, folder: Path) -> dict:
    import lightning.pytorch as pl

    from fsdp2_strategy.integrations.lightning import FSDP2Strategy

    class QLoRA(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, self.losses = load_qlora(folder, args.dtype), []

        def forward(self, ids, labels=None):  # through the root: FSDP gathers what this module holds
            return self.model(input_ids=ids, labels=labels)

        def training_step(self, batch, batch_idx):
            loss = self(batch[0], labels=batch[0]).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=args.lr)

    module = QLoRA()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(counting_data(64)), batch_size=args.batch_size)
    trainer = pl.Trainer(
        strategy=FSDP2Strategy(),
        accelerator="cpu",
        devices=args.devices,
        precision=args.precision,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    return finish(module.model, module, folder, args, module.losses, trainer.global_rank)


def run_hf(args, folder: Path) -> dict:
    from transformers import TrainerCallback, TrainingArguments

    from fsdp2_strategy.integrations.transformers import FSDP2Trainer as Trainer

    losses: list[float] = []

    class Losses(TrainerCallback):
        def on_log(self, _args, _state, _control, logs=None, **_):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    rows = [{"input_ids": row, "labels": row} for row in counting_data(64)]
    training_args = TrainingArguments(
        output_dir=str(args.out_dir / "hf"),
        per_device_train_batch_size=args.batch_size,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        bf16=args.dtype == torch.bfloat16,
        report_to=[],
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=load_qlora(folder, args.dtype), args=training_args, train_dataset=rows, callbacks=[Losses()]
    )
    trainer.train()
    return finish(
        trainer.model, lambda ids: trainer.model(input_ids=ids), folder, args, losses, trainer.accelerator.process_index
    )


def finish(model, forward, folder: Path, args, losses: list[float], rank: int) -> dict:
    """Collective: the adapter saved, the trained model's logits on a probe batch (`forward(ids)`
    calls the sharded root); rank 0 reloads the adapter onto a fresh 4-bit base."""
    import peft

    local, whole = base_bytes(model)
    adapter = f2.save_peft_adapter(model, args.out_dir / f"adapter-{args.trainer}")
    probe = counting_data(2)
    with torch.no_grad():
        trained = forward(probe).logits.float()
    result = {
        "trainer": args.trainer,
        "precision": args.precision,
        "base_MiB_this_rank": round(local / 2**20, 3),
        "base_MiB_whole": None,
    }
    if rank != 0:
        return result
    reloaded = peft.PeftModel.from_pretrained(load_qlora(folder, args.dtype, lora=False), adapter)
    _, result["base_MiB_whole"] = base_bytes(reloaded)
    with torch.no_grad():
        again = reloaded(input_ids=probe).logits.float()
    result.update(
        base_MiB_whole=round(result["base_MiB_whole"] / 2**20, 3),
        first_loss=round(losses[0], 4),
        last_loss=round(losses[-1], 4),
        reloaded_logits_rel_diff=float((again - trained).norm() / trained.norm()),
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", choices=("lightning", "hf"), default="lightning")
    parser.add_argument("--devices", type=int, default=2, help="processes (Lightning; accelerate's config for hf)")
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out-dir", type=Path, default=Path("runs/qlora_finetune"))
    parser.add_argument(
        "--precision",
        choices=("bf16-mixed", "32-true"),
        default=None,
        help="the compute dtype (bf16 or fp32) of the 4-bit layers and the trainer's precision; default: "
        "bf16-mixed where this CPU computes in bf16 natively, else 32-true (through the HF Trainer: the "
        "accelerate config file's mixed_precision)",
    )
    args = parser.parse_args()
    if args.precision is None and args.trainer == "hf":  # the accelerate config's policy: compute alike
        args.precision = "bf16-mixed" if os.environ.get("ACCELERATE_MIXED_PRECISION") == "bf16" else "32-true"
    args.precision = args.precision or choose_precision("cpu")
    args.dtype = torch.bfloat16 if args.precision == "bf16-mixed" else torch.float32
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for message in (".*does not have many workers.*", ".*DistributedSampler.*", "DTensor random"):
        warnings.filterwarnings("ignore", message=message)
    folder = args.out_dir / "pretrained"
    if args.trainer == "hf":  # accelerate starts every rank at once: rank 0 writes, the others wait
        f2.init_distributed()
    if os.environ.get("LOCAL_RANK", "0") == "0":  # (Lightning runs rank 0 alone first, then starts the others)
        save_pretrained_base(folder)
    if args.trainer == "hf":
        torch.distributed.barrier()
    result = (run_hf if args.trainer == "hf" else run_lightning)(args, folder)
    print(json.dumps(result), flush=True)
    f2.shutdown()


if __name__ == "__main__":
    main()

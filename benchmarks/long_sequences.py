"""The longest sequence a small Llama trains with, with and without context parallelism, at one
per-rank memory budget, and its step time.

    torchrun --standalone --nproc_per_node=2 benchmarks/long_sequences.py [--layers 4 --hidden 256 --seqs 1024 2048 ...]

A Llama built from a config (`transformers.LlamaConfig`, SDPA attention, grouped-query heads), one
sequence per step, FSDP over both ranks: with cp=1 each rank trains on its own whole sequence; with
cp=2 both ranks train on one sequence, each holding half of it (`f2.context_parallel`). For each
sequence length and cp: the peak live bytes of one step per rank (torch's MemTracker: parameters,
gradients, activations, the ring's buffers) and the median step time over `--rounds` (cp=1 and cp=2
interleaved, one thread per rank on CPU). Each budget is cp=1's peak at one of `--budget-seqs`; the
report names the longest of `--seqs` each setting trains within it. `--json PATH` writes the rows
(rank 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def _model(args: argparse.Namespace, seq: int):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 2,
        max_position_embeddings=seq,
    )
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config)


def _step(model, optimizer, batch: dict) -> None:
    import fsdp2_strategy as f2

    with f2.context_parallel(model, batch) as part:
        logits = model(input_ids=part["input_ids"], position_ids=part["position_ids"]).logits
        part.loss(logits).backward()
    optimizer.step()
    optimizer.zero_grad()


def _measure(args: argparse.Namespace, seq: int, cp: int) -> tuple[int, list[float]]:
    """Peak bytes of one step on this rank (after a warm-up step) and the times of `--rounds` steps."""
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker

    import fsdp2_strategy as f2

    model = f2.shard_model(_model(args, seq), context_parallel_size=cp, log_plan=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # cp=1: each rank its own sequence; cp=2: both ranks one sequence.
    row = dist.get_rank() if cp == 1 else 0
    g = torch.Generator().manual_seed(100 + row)
    ids = torch.randint(3, args.vocab, (1, seq), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    _step(model, optimizer, batch)  # warm-up: the optimizer state exists
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        _step(model, optimizer, batch)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    times = []
    for _ in range(args.rounds):
        dist.barrier()
        start = time.perf_counter()
        _step(model, optimizer, batch)
        times.append(time.perf_counter() - start)
    return peak, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024 * k for k in range(1, 9)])
    parser.add_argument(
        "--budget-seqs", type=int, nargs="+", default=[2048, 4096], help="budgets: cp=1's peak at these lengths"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the rows here (rank 0)")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    import fsdp2_strategy as f2

    f2.init_distributed(cpu=True)
    torch.set_num_threads(1)
    rows = []
    for seq in args.seqs:
        for cp in (1, 2):
            peak, times = _measure(args, seq, cp)
            worst = torch.tensor([peak], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            rows.append({"seq": seq, "cp": cp, "peak_bytes": int(worst.item()), "step_s": statistics.median(times)})
    if dist.get_rank() == 0:
        print(f"{'tokens':>7} {'cp':>3} {'peak MiB/rank':>14} {'step s':>8} {'s/1k tokens':>12}")
        for r in rows:
            tokens_per_step = r["seq"] * (2 if r["cp"] == 1 else 1)  # sequences trained per step, all ranks
            print(
                f"{r['seq']:>7} {r['cp']:>3} {r['peak_bytes'] / 2**20:>14.1f} {r['step_s']:>8.3f} "
                f"{1000 * r['step_s'] / tokens_per_step:>12.4f}"
            )
        for budget_seq in args.budget_seqs:
            budget = next(r["peak_bytes"] for r in rows if r["cp"] == 1 and r["seq"] == budget_seq)
            longest = {
                cp: max((r["seq"] for r in rows if r["cp"] == cp and r["peak_bytes"] <= budget), default=0)
                for cp in (1, 2)
            }
            print(
                f"budget {budget / 2**20:.1f} MiB per rank (cp=1 at {budget_seq} tokens): longest sequence "
                f"cp=1 {longest[1]}, cp=2 {longest[2]}"
            )
        for seq in args.seqs:
            one, two = ({r["cp"]: r for r in rows if r["seq"] == seq}[cp] for cp in (1, 2))
            print(f"cp=2/cp=1 peak per rank at {seq} tokens: {two['peak_bytes'] / one['peak_bytes']:.3f}")
        if args.json:
            args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1))
    f2.shutdown()


if __name__ == "__main__":
    main()

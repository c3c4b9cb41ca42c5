"""Greedy generation on a sharded model: `f2.gathered` against the sharded model without it and
against one unsharded process.

    torchrun --standalone --nproc_per_node=2 benchmarks/generation.py [--layers 8 --hidden 512 --new 64]
    torchrun --standalone --nproc_per_node=1 benchmarks/generation.py --layers 16 --hidden 2048 --dtype bf16  # one GPU

A Llama-shaped model built from a config (`transformers.LlamaConfig`, default 8 layers, hidden 512:
~40 M parameters), prompt of 16 tokens, `generate(max_new_tokens=--new, do_sample=False)`, on the
accelerator where one exists (nccl), else on CPU (gloo, one thread per rank). Per
round, interleaved: the sharded model (`shard_model` defaults), the sharded model inside
`f2.gathered`, and rank 0's unsharded copy (one process; the other rank waits). Reports the median
tokens/s of each over `--rounds`, the all-gathers per generated token, and whether every run
produced the same tokens as the unsharded copy; `--json PATH` also writes them (rank 0).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/helpers/comm.py counts collectives


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the model's weights")
    parser.add_argument("--json", type=Path, help="also write the results here (rank 0)")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    import transformers
    from helpers.comm import count_collectives

    import fsdp2_strategy as f2

    device = f2.init_distributed()
    if device.type == "cpu":
        torch.set_num_threads(1)
    sync = torch.accelerator.synchronize if device.type != "cpu" else (lambda: None)
    rank = dist.get_rank()
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=args.prompt + args.new,
    )  # fmt: skip
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    plain = copy.deepcopy(model)
    sharded = f2.shard_model(model, log_plan=False)
    ids = torch.randint(0, config.vocab_size, (1, args.prompt)).to(device)

    def generate(m, **kwargs) -> tuple[list[int], float, int]:
        with torch.no_grad(), count_collectives() as counts:
            sync()
            start = time.perf_counter()
            out = m.generate(ids, max_new_tokens=args.new, do_sample=False, min_new_tokens=args.new, **kwargs)
            sync()
            seconds = time.perf_counter() - start
        return out[0].tolist(), seconds, counts["all_gather_single"] + counts["all_gather_into_tensor"]

    def gathered_generate(m):
        with f2.gathered(m):  # ranks need not stay in step inside: no all-reduce per token
            return generate(m, synced_gpus=False)

    runs = {"sharded": lambda: generate(sharded), "sharded, f2.gathered": lambda: gathered_generate(sharded)}
    times: dict[str, list[float]] = {name: [] for name in [*runs, "one process (unsharded)"]}
    gathers, tokens = {}, {}
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            tokens[name], seconds, gathers[name] = runs[name]()
            times[name].append(seconds)
        if rank == 0:
            tokens["one process (unsharded)"], seconds, _ = generate(plain)
            times["one process (unsharded)"].append(seconds)
        dist.barrier()
    if rank == 0:
        report(args, plain, device, times, gathers, tokens)
    f2.shutdown()


def report(args, plain, device, times: dict, gathers: dict, tokens: dict) -> None:
    """Print the table (and write `--json`): tokens/s, against one process, all-gathers per token."""
    import torch
    import torch.distributed as dist

    ref = tokens["one process (unsharded)"]
    params = sum(p.numel() for p in plain.parameters())
    where = f"{dist.get_world_size()} {device.type} rank(s) ({dist.get_backend()})"
    print(f"Llama {args.layers} layers x hidden {args.hidden} ({params / 1e6:.1f} M parameters, {args.dtype}), "
          f"prompt {args.prompt}, {args.new} new tokens, greedy; {where}, torch {torch.__version__}; "
          f"medians of {args.rounds} interleaved rounds")  # fmt: skip
    print(f"{'run':28s} {'tokens/s':>9s} {'vs one process':>15s} {'all-gathers/token':>18s} {'same tokens':>12s}")
    base = statistics.median(times["one process (unsharded)"])
    rows = []
    for name, values in times.items():
        median = statistics.median(values)
        per_token = gathers[name] / args.new if name in gathers else None
        rows.append({"run": name, "tokens_per_s": args.new / median, "vs_one_process": base / median,
                     "all_gathers_per_token": per_token, "same_tokens": tokens[name] == ref})  # fmt: skip
        shown = "-" if per_token is None else f"{per_token:.2f}"
        print(
            f"{name:28s} {args.new / median:9.1f} {base / median:14.2f}x {shown:>18s} {str(tokens[name] == ref):>12s}"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"params": params, "where": where, "dtype": args.dtype, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()

"""Greedy generation on a sharded model: `f2.gathered` against the sharded model without it and
against the unsharded model, side by side.

    torchrun --standalone --nproc_per_node=2 benchmarks/generation.py [--layers 8 --hidden 512 --new 64]
    torchrun --standalone --nproc_per_node=1 benchmarks/generation.py --layers 16 --hidden 2048 --dtype bf16  # one GPU

A Llama-shaped model built from a config (`transformers.LlamaConfig`, default 8 layers, hidden 512:
~66 M parameters), prompt of 16 tokens, `generate(max_new_tokens=--new, do_sample=False)`, on the
accelerator where one exists (nccl), else on CPU (gloo, one thread per rank). Every rank decodes,
in interleaved rounds and all ranks at the same time (a barrier before each run): the sharded model
(`shard_model` defaults), the sharded model inside `f2.gathered` (`generate`'s defaults: the context
makes `synced_gpus` False), and its own unsharded copy, so that the ranks share the machine's
memory bandwidth alike in every run. Reports rank 0's median tokens/s of each over `--rounds`, each
rank's ratio of the gathered model's median time to its unsharded copy's, the all-gathers and other
collectives per generated token, and whether every run produced the unsharded copy's tokens;
`--json PATH` also writes them (rank 0).
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
    plain = copy.deepcopy(model)  # every rank's own unsharded copy
    sharded = f2.shard_model(model, log_plan=False)
    ids = torch.randint(0, config.vocab_size, (1, args.prompt)).to(device)

    def generate(m, **kwargs) -> tuple[list[int], float, dict]:
        dist.barrier()  # every rank decodes at the same time: they share the memory bandwidth alike
        with torch.no_grad(), count_collectives() as counts:
            sync()
            start = time.perf_counter()
            out = m.generate(ids, max_new_tokens=args.new, do_sample=False, min_new_tokens=args.new, **kwargs)
            sync()
            seconds = time.perf_counter() - start
        return out[0].tolist(), seconds, dict(counts)

    def gathered_generate(m):
        with f2.gathered(m):  # generate's synced_gpus defaults to False inside: no all-reduce per token
            return generate(m)

    runs = {
        "sharded": lambda: generate(sharded),
        "sharded, f2.gathered": lambda: gathered_generate(sharded),
        UNSHARDED: lambda: generate(plain),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    counts, tokens = {}, {}
    for r in range(args.rounds):
        for name in list(runs) if r % 2 == 0 else list(reversed(runs)):
            tokens[name], seconds, counts[name] = runs[name]()
            times[name].append(seconds)
    ratios = [None] * dist.get_world_size()
    mine = statistics.median(times[UNSHARDED]) / statistics.median(times["sharded, f2.gathered"])
    dist.all_gather_object(ratios, mine)
    if rank == 0:
        report(args, plain, device, times, counts, tokens, ratios)
    f2.shutdown()


UNSHARDED = "unsharded copy"


def report(args, plain, device, times: dict, counts: dict, tokens: dict, ratios: list[float]) -> None:
    """Print the table (and write `--json`): tokens/s, against the unsharded copy, collectives per token."""
    import torch
    import torch.distributed as dist

    ref = tokens[UNSHARDED]
    params = sum(p.numel() for p in plain.parameters())
    where = f"{dist.get_world_size()} {device.type} rank(s) ({dist.get_backend()})"
    print(f"Llama {args.layers} layers x hidden {args.hidden} ({params / 1e6:.1f} M parameters, {args.dtype}), "
          f"prompt {args.prompt}, {args.new} new tokens, greedy; {where}, torch {torch.__version__}; "
          f"medians of {args.rounds} interleaved rounds, every rank decoding at once")  # fmt: skip
    head = f"{'run (rank 0)':28s} {'tokens/s':>9s} {'vs unsharded':>13s} {'all-gathers/token':>18s}"
    print(f"{head} {'other collectives/token':>24s} {'same tokens':>12s}")
    base = statistics.median(times[UNSHARDED])
    rows = []
    for name, values in times.items():
        median = statistics.median(values)
        gathers = counts[name].get("all_gather_single", 0) + counts[name].get("all_gather_into_tensor", 0)
        others = sum(counts[name].values()) - gathers
        rows.append({"run": name, "tokens_per_s": args.new / median, "vs_unsharded": base / median,
                     "all_gathers_per_token": gathers / args.new, "other_collectives_per_token": others / args.new,
                     "same_tokens": tokens[name] == ref})  # fmt: skip
        print(
            f"{name:28s} {args.new / median:9.1f} {base / median:12.2f}x {gathers / args.new:18.2f} "
            f"{others / args.new:24.2f} {str(tokens[name] == ref):>12s}"
        )
    print("f2.gathered against the unsharded copy, per rank: " + ", ".join(f"{r:.2f}x" for r in ratios))
    if args.json:
        result = {"params": params, "where": where, "dtype": args.dtype, "rows": rows, "gathered_vs_unsharded": ratios}
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

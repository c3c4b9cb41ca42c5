"""This engine against DeepSpeed ZeRO on the same model, batch and ranks: ZeRO-2 vs SHARD_GRAD_OP and
ZeRO-3 vs FULL_SHARD, torch AdamW in both, fp32 or bf16 (`--precision`).

    DS_ACCELERATOR=cpu PYTHONPATH=<deepspeed install> torchrun --standalone --nproc_per_node=2 \\
        benchmarks/deepspeed_compare.py [--part time memory] [--dim 512 --layers 8 --batch 16]
    python benchmarks/deepspeed_compare.py --memory-runs 3     # memory: launches the worlds itself
    PYTHONPATH=<deepspeed install> torchrun --standalone --nproc_per_node=1 \\
        benchmarks/deepspeed_compare.py --dim 4096 --layers 8 --batch 64 --precision bf16   # one GPU

On an accelerator the ranks use it (nccl), the steps are timed to the device's completion and the
memory part reports the device's peak allocation; on CPU gloo, each rank pinned to a core, and the
process's peak resident memory. bf16: our `mixed_precision="bf16"` (fp32 parameters, bf16 compute)
against DeepSpeed's `"bf16": {"enabled": true}` (bf16 parameters, fp32 master weights in the
optimizer): the usual setting of each, not the same arithmetic.

`--model blocks` (default): the benchmark model (`_bench.Net`: input layer, `--layers` pre-norm MLP
blocks of `--dim`, head; a regression loss); `--model minilm`: all-MiniLM-L6-v2 (the embedded
pretrained folder, 22.7 M parameters; sequences of 64 tokens, the mean square of the last hidden state).
`time`: one 2-rank world holds the four engines, each on its own copy of the model (the
same initial weights) and steps them
interleaved, round by round in alternating order (the first round untimed); reported: median seconds
per optimizer step, its spread, and the ratio of each engine to its DeepSpeed counterpart.
`memory`: each engine alone in a fresh 2-process world (a process's resident high-water mark is all
it ever held), `--memory-runs` launches each, alternated; reported per engine: the median over
launches of the largest rank's peak resident memory and its rise over the process after imports.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402

import fsdp2_strategy as f2  # noqa: E402

PAIRS = {"SHARD_GRAD_OP": 2, "FULL_SHARD": 3}  # our strategy -> the ZeRO stage it stands for
LR = 1e-3


def _device() -> torch.device:
    if not torch.accelerator.is_available():
        return torch.device("cpu")
    return torch.device(torch.accelerator.current_accelerator().type, int(os.environ.get("LOCAL_RANK", 0)))


def _peak_mib(device: torch.device) -> float:
    """The device's peak allocation on an accelerator, the process's peak resident memory on CPU."""
    if device.type != "cpu":
        return torch.accelerator.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_model(args: argparse.Namespace) -> torch.nn.Module:
    if args.model == "minilm":
        from transformers import AutoModel

        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
        from reviews import pretrained_dir  # examples/reviews.py: the embedded all-MiniLM-L6-v2

        torch.manual_seed(0)
        return AutoModel.from_pretrained(pretrained_dir()).to(args.device)
    return _bench.make_net(args.dim, args.layers).to(args.device)


def make_data(args: argparse.Namespace) -> list:
    if args.model == "minilm":
        g = torch.Generator().manual_seed(_bench.BATCH_SEED + dist.get_rank())
        return [(torch.randint(0, 30000, (args.batch, 64), generator=g).to(args.device), None) for _ in range(8)]
    return [(x.to(args.device), y.to(args.device)) for x, y in _bench.batches(8, args.batch)]


def loss_of(model, x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
    if y is None:  # MiniLM
        return model(input_ids=x).last_hidden_state.pow(2).mean()
    return F.mse_loss(model(x).float(), y)


def deepspeed_engine(args: argparse.Namespace, stage: int):
    import deepspeed

    model = make_model(args)
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "bf16": {"enabled": args.precision == "bf16"},
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def step(i: int) -> None:
        x, y = args.data[i % len(args.data)]
        if args.precision == "bf16" and x.is_floating_point():  # DeepSpeed's bf16 model takes bf16 inputs
            x = x.to(torch.bfloat16)
        engine.backward(loss_of(engine, x, y))
        engine.step()

    return step


def our_engine(args: argparse.Namespace, strategy: str):
    precision = "bf16" if args.precision == "bf16" else None
    model = f2.shard_model(make_model(args), sharding_strategy=strategy, mixed_precision=precision, log_plan=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(i: int) -> None:
        x, y = args.data[i % len(args.data)]
        loss_of(model, x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def engine_for(args: argparse.Namespace, name: str):
    return deepspeed_engine(args, int(name[-1])) if name.startswith("ZeRO-") else our_engine(args, name)


def names() -> list[str]:
    return [n for ours, stage in PAIRS.items() for n in (f"ZeRO-{stage}", ours)]


def time_part(args: argparse.Namespace) -> None:
    steps = {name: engine_for(args, name) for name in names()}
    results = _bench.interleave(
        {name: (lambda s=step: _bench.timed_steps(s, args.steps)) for name, step in steps.items()}, args.rounds
    )
    if dist.get_rank() == 0:
        what = "all-MiniLM-L6-v2, 64 tokens" if args.model == "minilm" else f"{args.layers} blocks of {args.dim}"
        where = f"{dist.get_world_size()} {args.device.type} rank(s)"
        print(f"model: {what}, batch {args.batch} per rank, {args.precision}, AdamW, {where}")
        print(f"{'engine':<16} {'median s/step':>14} {'p25-p75':>15} {'vs ZeRO':>8} {'n':>4}")
        for ours, stage in PAIRS.items():
            base = statistics.median(results[f"ZeRO-{stage}"])
            for name in (f"ZeRO-{stage}", ours):
                med = statistics.median(results[name])
                q1, _, q3 = statistics.quantiles(results[name], n=4) if len(results[name]) > 1 else [med] * 3
                print(f"{name:<16} {med:>14.4f} {q1:>7.3f}-{q3:<7.3f} {med / base:>8.3f} {len(results[name]):>4}")


def memory_world(args: argparse.Namespace) -> None:
    """One engine (`--engine`) alone: this rank's peak resident memory after its steps, as JSON."""
    start = _peak_mib(args.device)
    step = engine_for(args, args.engine)
    for i in range(args.steps):
        step(i)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, {"start": start, "peak": _peak_mib(args.device)})
    if dist.get_rank() == 0:
        print("MEMORY " + json.dumps(peaks), flush=True)


def memory_part(args: argparse.Namespace) -> None:
    """Launch each engine's world `--memory-runs` times, alternating, and print the medians."""
    rows: dict[str, list[dict]] = {name: [] for name in names()}
    for run in range(args.memory_runs):
        for name in names() if run % 2 == 0 else names()[::-1]:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
            cmd += [__file__, "--part", "memory-world", "--engine", name, "--dim", str(args.dim)]
            cmd += ["--layers", str(args.layers), "--batch", str(args.batch), "--steps", str(args.steps)]
            cmd += ["--model", args.model, "--precision", args.precision]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            peaks = json.loads(next(line for line in out.splitlines() if line.startswith("MEMORY "))[7:])
            top = max(peaks, key=lambda p: p["peak"])
            rows[name].append({"peak": top["peak"], "rise": top["peak"] - top["start"]})
    what = "peak RSS MiB" if _device().type == "cpu" else "peak dev MiB"
    print(f"{'engine':<16} {what:>13} {'rise MiB':>9} {'rise vs ZeRO':>13} {'launches':>9}")
    for ours, stage in PAIRS.items():
        base = statistics.median(r["rise"] for r in rows[f"ZeRO-{stage}"])
        for name in (f"ZeRO-{stage}", ours):
            peak = statistics.median(r["peak"] for r in rows[name])
            rise = statistics.median(r["rise"] for r in rows[name])
            print(f"{name:<16} {peak:>13.0f} {rise:>9.0f} {rise / base:>13.3f} {len(rows[name]):>9}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="time", choices=("time", "memory", "memory-world"))
    parser.add_argument("--engine", choices=names(), help="memory-world: the engine to run")
    parser.add_argument("--model", default="blocks", choices=("blocks", "minilm"))
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="per rank")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per engine and round")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds (plus one untimed)")
    parser.add_argument("--memory-runs", type=int, default=3, help="memory: launches per engine")
    parser.add_argument("--nproc", type=int, default=2, help="memory: ranks per launched world")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    args = parser.parse_args()
    if args.part == "memory":
        memory_part(args)
        return
    import deepspeed

    args.device = _device()
    if args.device.type == "cpu":
        deepspeed.init_distributed(dist_backend="gloo")
        _bench.pin_to_core(dist.get_rank())
    else:
        torch.accelerator.set_device_index(args.device.index)
        deepspeed.init_distributed(dist_backend="nccl")
    args.data = make_data(args)
    time_part(args) if args.part == "time" else memory_world(args)
    f2.shutdown()


if __name__ == "__main__":
    main()

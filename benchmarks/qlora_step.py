"""QLoRA training on one device: step time and peak memory of a Llama-shaped NF4 base with LoRA,
unsharded (bitsandbytes + PEFT alone) against `f2.shard_model` (a world of one, the 4-bit base
held as packed bytes), and the memory planner's estimate against the allocator's peak.

The model is built in bf16 from a config (seeded), its linear layers made bitsandbytes NF4 layers
(`f2.to_4bit`: double quantisation, bf16 compute, lm_head kept) and quantised by moving it to the
device, then PEFT LoRA r=16 on every linear layer; AdamW on the LoRA weights, no activation
checkpointing, the same token batches for both paths. Each path runs in its own process, so each
peak is its own. The planner estimates from the same model built on the meta device
(`f2.estimate_memory`, FULL_SHARD, bf16, world 1).

    python benchmarks/qlora_step.py --json qlora.json                 # a GPU: the 3 B shape
    python benchmarks/qlora_step.py --size tiny --json /tmp/q.json    # CPU, bitsandbytes' CPU kernels
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import _bench  # this folder: on sys.path as the script's directory, or put there by device_suite
import gpu_throughput

RESULT = "QLORA_STEP_RESULT "
SIZES = {
    # bitsandbytes' CPU matmul needs widths divisible by its block size (64): what the dry run uses.
    "tiny": {"hidden": 128, "ffn": 256, "layers": 2, "heads": 4, "kv_heads": 4, "vocab": 256, "seq": 64, "batch": 2},
    # Llama-3.2-3B's shape with a 32000-token vocabulary: 3.0 B parameters, 4096 tokens a step.
    "3b": {
        "hidden": 3072,
        "ffn": 8192,
        "layers": 28,
        "heads": 24,
        "kv_heads": 8,
        "vocab": 32000,
        "seq": 2048,
        "batch": 2,
    },
}
PATHS = ("unsharded", "sharded")
CONFIG = {"sharding_strategy": "FULL_SHARD", "mixed_precision": "bf16"}


def build(size: dict, device):
    """The seeded QLoRA model of `size`: quantised on `device`, or pending (not quantised) on meta."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    import fsdp2_strategy as f2

    config = gpu_throughput.llama_config(size)
    torch.manual_seed(0)
    # Initialised on the device (fast), quantised from the host: bitsandbytes quantises a
    # Params4bit when it moves to a device, not when it is already there.
    with torch.device("meta" if device.type == "meta" else device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if device.type != "meta":
        model.cpu()
    f2.to_4bit(model)
    if device.type != "meta":
        model.to(device)
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    return peft.get_peft_model(model, lora)


def batches(size: dict, n: int):
    import torch

    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, size["vocab"], (n, size["batch"], size["seq"]), generator=gen)


def worker(path: str, size_name: str, steps: int, warmup: int) -> None:
    """Train `steps + warmup` steps of `path` in this process; print the result line."""
    import torch
    import torch.distributed as dist

    import fsdp2_strategy as f2

    size, device = SIZES[size_name], gpu_throughput._device()
    model = build(size, device)
    if path == "sharded":
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None
        )
        model = f2.shard_model(model, CONFIG, log_plan=False)
    base_bytes = _quantised_bytes(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    sync = torch.accelerator.synchronize if device.type != "cpu" else (lambda: None)
    if device.type != "cpu":
        torch.accelerator.reset_peak_memory_stats(device)
    stamps, losses = [], []
    sync()
    stamps.append(time.perf_counter())
    for ids in batches(size, steps + warmup).to(device):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        sync()
        stamps.append(time.perf_counter())
        losses.append(float(loss))
    times = [b - a for a, b in zip(stamps, stamps[1:])][warmup:]
    result = {
        "path": path,
        "median_s": statistics.median(times),
        "times": times,
        "losses": losses,
        "tokens_per_s": size["batch"] * size["seq"] / statistics.median(times),
        "quantised_bytes": base_bytes,
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "peak_bytes": int(torch.accelerator.max_memory_allocated(device)) if device.type != "cpu" else None,
    }
    print(RESULT + json.dumps(result), flush=True)
    if path == "sharded":
        f2.shutdown()


def _quantised_bytes(model) -> int:
    """Bytes of the 4-bit weights this process holds (a sharded one: its local shard)."""
    import fsdp2_strategy as f2

    params = dict(model.named_parameters())
    names = f2.shard.quantised_param_names(model)
    if not names:  # unsharded: the Params4bit themselves
        return sum(p.nbytes for p in params.values() if type(p).__name__ == "Params4bit")
    return sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for n, p in params.items() if n in names)


def estimate(size: dict, device_type: str) -> dict:
    """The planner's estimate for the sharded path, from the model built on the meta device."""
    import torch

    import fsdp2_strategy as f2

    ids = batches(size, 1)[0]
    est = f2.estimate_memory(
        build(size, torch.device("meta")),
        CONFIG,
        world_size=1,
        example_batch={"input_ids": ids, "labels": ids},
        device_type=device_type,
    )
    return {"peak_bytes": est.peak_bytes, "peak_phase": est.peak_phase}


def launch(path: str, size: str, steps: int, warmup: int, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--worker", path, "--size", size, "--steps", str(steps), "--warmup", str(warmup)]
    return _bench.run_for_result(cmd, _bench.world_of_one_env(), timeout, RESULT, path)


def run(size: str, steps: int, warmup: int, timeout: float) -> dict:
    """Both paths (one process each), the planner's estimate, and the ratios."""
    device = gpu_throughput._device()
    runs = {path: launch(path, size, steps, warmup, timeout) for path in PATHS}
    result = {"size": size, "shape": SIZES[size], "device_type": device.type, "runs": runs}
    result["estimate"] = estimate(SIZES[size], device.type)
    unsharded, sharded = runs["unsharded"], runs["sharded"]
    if "error" not in unsharded and "error" not in sharded:
        result["step_ratio"] = sharded["median_s"] / unsharded["median_s"]
        if sharded["peak_bytes"]:
            result["peak_ratio"] = sharded["peak_bytes"] / unsharded["peak_bytes"]
            result["estimate_error"] = result["estimate"]["peak_bytes"] / sharded["peak_bytes"] - 1
    return result


def table(result: dict) -> str:
    rows = [f"{'path':<10} {'s/step':>8} {'tokens/s':>9} {'peak GiB':>9} {'4-bit GiB':>9}   loss first -> last"]
    for path, r in result["runs"].items():
        if "error" in r:
            rows.append(f"{path:<10} ERROR {r['error'][-300:]}")
            continue
        peak = f"{r['peak_bytes'] / 2**30:9.2f}" if r["peak_bytes"] else f"{'-':>9}"
        rows.append(
            f"{path:<10} {r['median_s']:8.4f} {r['tokens_per_s']:9.0f} {peak} {r['quantised_bytes'] / 2**30:9.3f}"
            f"   {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"
        )
    est = result["estimate"]
    rows.append(f"planner estimate (sharded): {est['peak_bytes'] / 2**30:.2f} GiB at {est['peak_phase']}")
    for key in ("step_ratio", "peak_ratio", "estimate_error"):
        if key in result:
            rows.append(f"{key}: {result[key]:+.3f}" if key == "estimate_error" else f"{key}: {result[key]:.3f}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="3b")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", choices=PATHS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.size, args.steps, args.warmup)
        return
    result = run(args.size, args.steps, args.warmup, args.timeout)
    result["table"] = table(result)
    print(result["table"], flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

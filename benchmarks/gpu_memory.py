"""The memory planner against the device allocator, and the largest model one device trains.

    python benchmarks/gpu_memory.py planner --size 1b --out planner.json
    python benchmarks/gpu_memory.py largest --out largest.json [--confirm-timeout 150]

`planner`: for six settings of the Llama-shaped model of `gpu_throughput.SIZES` (bf16 compute,
AdamW; FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, FULL_SHARD + activation checkpointing, + CPU offload,
keep_gathered over 2 micro-batches), `f2.estimate_memory(...).peak_bytes` (computed on meta)
against the allocator's peak (`torch.accelerator.max_memory_allocated`) during one optimizer step
after a warm-up step; on the CPU the live-tensor peak of torch's MemTracker stands in.

`largest`: for FULL_SHARD, + activation checkpointing and + CPU offload on one device, the
largest of a Llama family (1 B to 34 B, sequence 2048, micro-batch 1) whose estimate fits the
device's memory; then one process per setting trains that size for two steps to confirm it, and
the next size up to confirm it does not fit (each in a fresh process: an out-of-memory error
stays there). Offload runs are sized by the host as well: a size whose fp32 parameters,
gradients and AdamW state (16 bytes a parameter) exceed half the host's memory is not run; the
largest size the device would fit is still reported.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT.parent)]

from gpu_throughput import SIZES, batches, build_model  # noqa: E402

import fsdp2_strategy as f2  # noqa: E402

RESULT = "GPU_MEMORY_RESULT "
BF16 = {"mixed_precision": "bf16"}
SETTINGS = {
    "FULL_SHARD": ({**BF16, "sharding_strategy": "FULL_SHARD"}, 1),
    "SHARD_GRAD_OP": ({**BF16, "sharding_strategy": "SHARD_GRAD_OP"}, 1),
    "NO_SHARD": ({**BF16, "sharding_strategy": "NO_SHARD"}, 1),
    "FULL_SHARD+AC": ({**BF16, "activation_checkpointing": "auto"}, 1),
    "FULL_SHARD+offload": ({**BF16, "cpu_offload": True}, 1),
    "keep_gathered k=2": ({**BF16, "accumulation": "keep_gathered"}, 2),
}
"""name -> (config, micro-batches per optimizer step)."""

FAMILY = {
    "1b": {"hidden": 2048, "ffn": 5632, "layers": 18, "heads": 16},
    "3b": {"hidden": 3072, "ffn": 8192, "layers": 26, "heads": 24},
    "7b": {"hidden": 4096, "ffn": 11008, "layers": 32, "heads": 32},
    "13b": {"hidden": 5120, "ffn": 13824, "layers": 40, "heads": 40},
    "20b": {"hidden": 6144, "ffn": 16384, "layers": 44, "heads": 48},
    "34b": {"hidden": 8192, "ffn": 22016, "layers": 48, "heads": 64},
}
LARGEST_SETTINGS = ("FULL_SHARD", "FULL_SHARD+AC", "FULL_SHARD+offload")


def family_size(name: str, dry_run: bool) -> dict:
    """A family member at sequence 2048, micro-batch 1 (the tiny shape, scaled by its index, in a dry run)."""
    if dry_run:
        k = list(FAMILY).index(name) + 1
        return {**SIZES["tiny"], "hidden": 32 * k, "ffn": 64 * k, "batch": 1}
    return {**FAMILY[name], "vocab": 32000, "seq": 2048, "batch": 1}


def _device() -> torch.device:
    return f2.init_distributed()  # this process's device: cuda:LOCAL_RANK, or cpu


def _train_step(model, opt, ids, micro_batches: int, tracker=None) -> None:
    for i in range(micro_batches):
        if tracker is not None and i:
            tracker.reset_mod_stats()  # MemTracker refuses a second forward otherwise; totals are kept
        with f2.no_sync(model) if i < micro_batches - 1 else contextlib.nullcontext():
            model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(size: dict, config: dict, micro_batches: int, device: torch.device) -> int:
    """The peak bytes of one optimizer step after a warm-up step (the model built on meta, sharded)."""
    model = f2.shard_model(build_model(size, "meta"), {**config, "log_plan": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = batches(size, 1)[0].to(device)
    _train_step(model, opt, ids, micro_batches)
    if device.type == "cpu":
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            _train_step(model, opt, ids, micro_batches, tracker)
        return max(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())
    torch.accelerator.synchronize()
    torch.accelerator.reset_peak_memory_stats(device)
    _train_step(model, opt, ids, micro_batches)
    torch.accelerator.synchronize()
    return int(torch.accelerator.max_memory_allocated(device))


def estimate(size: dict, config: dict, micro_batches: int, device_type: str) -> f2.MemoryEstimate:
    ids = batches(size, 1)[0]
    return f2.estimate_memory(
        build_model(size, "meta"),
        config,
        world_size=1,
        optimizer="adamw",
        example_batch={"input_ids": ids, "labels": ids},
        accumulation=config.get("accumulation", "sync_last"),
        micro_batches=micro_batches,
        device_type=device_type,
    )


def planner(size_name: str) -> list[dict]:
    """Every setting of `SETTINGS`, estimated and measured, in this process (one after another:
    each model and optimizer freed and the allocator's cache emptied before the next)."""
    device, size = _device(), SIZES[size_name]
    rows = []
    for name, (config, k) in SETTINGS.items():
        est = estimate(size, config, k, device.type)
        measured = measure(size, config, k, device)
        gc.collect()
        if device.type != "cpu":
            torch.accelerator.empty_cache()
        rows.append(
            {
                "setting": name,
                "estimate": est.peak_bytes,
                "measured": measured,
                "error": est.peak_bytes / measured - 1,
                "peak_phase": est.peak_phase,
            }
        )
        print(f"  {name}: estimate {est.peak_bytes / 2**30:.2f} GiB, measured {measured / 2**30:.2f} GiB", flush=True)
    return rows


def device_memory() -> int:
    if torch.accelerator.is_available() and torch.accelerator.current_accelerator().type == "cuda":
        return torch.cuda.get_device_properties(0).total_memory
    return 2 * 2**20  # the dry run's pretend device: a few tiny sizes fit, the larger do not


def host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def confirm(size_name: str, setting: str, dry_run: bool) -> None:
    """Child process: two optimizer steps of `size_name` with `setting`; prints the peak or the error."""
    device = _device()
    config, k = SETTINGS[setting]
    try:
        peak = measure(family_size(size_name, dry_run), config, k, device)
        out = {"fits": True, "measured": peak}
    except torch.OutOfMemoryError as exc:
        out = {"fits": False, "error": str(exc).splitlines()[0][:300]}
    print(RESULT + json.dumps(out), flush=True)
    f2.shutdown()


def _confirm_in_child(size_name: str, setting: str, dry_run: bool, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "confirm", "--size", size_name, "--setting", setting]
    cmd += ["--dry-run"] if dry_run else []
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"size": size_name, "error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if not lines:
        return {"size": size_name, "error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}
    return {"size": size_name, **json.loads(lines[-1][len(RESULT) :]), "seconds": time.perf_counter() - start}


def _host_fits(params: int) -> bool:
    """Whether an offloaded run's host state (fp32 weights, gradients, AdamW: 16 bytes a parameter)
    fits in half the host's memory."""
    return 16 * params <= host_memory() / 2


def largest(dry_run: bool, timeout: float, deadline: float) -> dict:
    """Per setting: the planner's largest fitting size, then runs confirming it and the next size up.
    With offload the host bounds the sizes run: the largest the device fits is reported, the
    largest the host also holds is run."""
    device = torch.device(torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else "cpu")
    budget, names, out = device_memory(), list(FAMILY), {}
    params = {n: sum(p.numel() for p in build_model(family_size(n, dry_run), "meta").parameters()) for n in names}
    for setting in LARGEST_SETTINGS:
        config, k = SETTINGS[setting]
        estimates = {n: estimate(family_size(n, dry_run), config, k, device.type).peak_bytes for n in names}
        fitting = [n for n in names if estimates[n] <= budget]
        runnable = [n for n in names if "offload" not in setting or _host_fits(params[n])]
        predicted = fitting[-1] if fitting else None
        to_run = [n for n in fitting if n in runnable][-1:]  # the largest that fits and can be run here
        larger = names[names.index(to_run[0]) + 1 :] if to_run else names
        to_run += [n for n in larger if n in runnable][:1]  # and the next size up, expected not to fit
        row: dict = {
            "budget": budget,
            "predicted_largest": predicted,
            "params": params,
            "estimates": estimates,
            "host_limited": predicted not in runnable,
            "runs": [],
        }
        for name in to_run:
            if time.monotonic() + timeout > deadline:
                row["runs"].append({"size": name, "skipped": "out of time"})
            else:
                row["runs"].append(_confirm_in_child(name, setting, dry_run, timeout))
            print(f"  {setting} {name}: {row['runs'][-1]}", flush=True)
        out[setting] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("planner", "largest", "confirm"))
    parser.add_argument("--size", default="1b")
    parser.add_argument("--setting", choices=list(SETTINGS))
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes (CPU)")
    parser.add_argument("--confirm-timeout", type=float, default=150, help="seconds per confirming run")
    parser.add_argument("--budget", type=float, default=float("inf"), help="no confirming run starts after this")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.mode == "confirm":
        confirm(args.size, args.setting, args.dry_run)
        return
    if args.mode == "planner":
        result: object = planner("tiny" if args.dry_run else args.size)
    else:
        result = largest(args.dry_run, args.confirm_timeout, time.monotonic() + args.budget)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    f2.shutdown()


if __name__ == "__main__":
    main()

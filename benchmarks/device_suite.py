"""Everything a GPU run should prove, in one command and one results file.

    python benchmarks/device_suite.py --out "$OUT"                 # one H100/H200: about 8 minutes
    python benchmarks/device_suite.py --out /tmp/suite --dry-run   # CPU, tiny sizes: the suite's own test

Parts (`--parts`, in the order given; the default is the order below):

- `tests`: `pytest tests/project/test_device.py` (core, Lightning, Accelerate, meta + offload, the tuner
  and its offload terms): each test's outcome, the summary, the log (`tests.log`, with the tuner's
  tables);
- `throughput`: `gpu_throughput.py`'s eight paths on the 1 B Llama-shaped model, interleaved rounds:
  tokens/s, MFU, peak memory, ratio to the hand-written `fully_shard` loop;
- `levers`: the speed levers each alone, two interleaved rounds: the hand-written loop, the core
  (chunked loss by default), the core with the model's own loss (`chunked_loss=False`), the core
  with AdamW's fused kernel, and the core with the largest micro-batch the memory planner fits;
- `compile`: the hand-written loop and the core with per-block `torch.compile`, two interleaved
  rounds (one round per machine could not tell the pair apart);
- `float8`: the same with torchao's float8 linears too, one round, where torchao is installed and the
  GPU has float8 tensor cores;
- `float8_sweep`: the hand-written loop compiled, bf16 against torchao's float8, on 2 Llama layers
  of hidden 1024 to 8192 (`gpu_throughput.FLOAT8_SWEEP`), one round each: where float8 starts to pay;
- `checkpoint`: `checkpoint_save.py` on a 169 M Llama (2 GB of weights and AdamW state): the stall
  of sync, async and overlap saves and the overhead of a save every 10 steps;
- `generation`: `generation.py` on a 1.2 B Llama in bf16, 128 greedy tokens: the sharded model, the
  sharded model inside `f2.gathered` and the unsharded model, tokens/s and the same tokens;
- `planner`: `gpu_memory.py planner`: the estimate against the allocator's peak, six settings;
- `largest`: `gpu_memory.py largest`: the largest model per setting, predicted, then run;
- `qlora`: `qlora_step.py` on a 3 B Llama shape in NF4 + LoRA (bitsandbytes' kernels): step time
  and peak memory unsharded against `f2.shard_model`, the planner against the allocator's peak;
- `deepspeed`: `deepspeed_compare.py` in bf16 (8 MLP blocks of 2048, 268 M parameters, 8192 rows a
  step): ZeRO-2 against SHARD_GRAD_OP and ZeRO-3 against FULL_SHARD, interleaved, then each engine's
  peak device memory in a world of its own; where DeepSpeed is importable (carry it and put it on
  PYTHONPATH).

Each part runs in its own processes with a time limit; a part that fails or times out is recorded
with its error and the suite goes on. `--budget` seconds bound the whole run: a part that would
start past it is recorded as not run. After each part `device_suite.json` (all numbers, the
device, versions, date and command) and `device_suite.txt` (the tables) are rewritten under
`--out`, so a run stopped from outside still leaves what it finished.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(BENCH), str(ROOT)]

import gpu_throughput  # noqa: E402
import qlora_step  # noqa: E402

PARTS = (
    "tests",
    "throughput",
    "levers",
    "compile",
    "float8",
    "float8_sweep",
    "checkpoint",
    "generation",
    "planner",
    "largest",
    "qlora",
    "deepspeed",
)
VERSIONED = ("torch", "transformers", "accelerate", "lightning", "peft", "torchao")


def environment(argv: list[str]) -> dict:
    """The device, the versions, the date and the command: what every table must carry."""
    import torch

    import fsdp2_strategy as f2

    versions = {}
    for name in VERSIONED:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    device = "cpu"
    if torch.accelerator.is_available():
        device = (
            torch.cuda.get_device_name(0) if torch.cuda.is_available() else str(torch.accelerator.current_accelerator())
        )
    return {
        "device": device,
        "device_memory_bytes": torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "versions": versions,
        "fsdp2_strategy": f2.__version__,
        "peak_flops": {"table": _peak(f2, False), "measured": _peak(f2, True)},
        "git": _git_head(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/device_suite.py", *argv]),
    }


def _peak(f2, measure: bool) -> dict | None:
    peak = f2.peak_flops(measure=measure)
    return peak.to_dict() if measure or peak.source == "table" else None


def _git_head() -> str | None:
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _python(*args: str, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    run_env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=run_env)


# --------------------------------------------------------------------------- the parts
def part_tests(ctx: dict) -> dict:
    args = ["-m", "pytest", "-v", "-rA", "-p", "no:cacheprovider", str(ROOT / "tests" / "project" / "test_device.py")]
    args += ["-k", ctx["tests_k"]] if ctx["tests_k"] else []
    try:
        proc = _python(*args, timeout=ctx["limit"])
        stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:  # keep what finished: -v prints each test's outcome
        stdout, stderr, code = _text(exc.stdout), _text(exc.stderr), f"timed out after {ctx['limit']:.0f} s"
    ctx["files"]["tests.log"] = stdout[-200_000:] + stderr[-50_000:]
    outcomes = [" ".join(line.split()[:2]) for line in stdout.splitlines() if "::" in line and _OUTCOME.search(line)]
    summary = next((line for line in reversed(stdout.splitlines()) if " in " in line and "=" in line), "")
    return {"returncode": code, "summary": summary.strip("= "), "outcomes": outcomes}


_OUTCOME = re.compile(r" (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def _throughput(ctx: dict, paths: tuple[str, ...], rounds: int = 2) -> dict:
    size = "tiny" if ctx["dry_run"] else "1b"
    steps, warmup = (2, 1) if ctx["dry_run"] else (8, 3)
    deadline = time.monotonic() + ctx["limit"]
    rounds = 1 if ctx["dry_run"] else rounds
    return gpu_throughput.run(paths, size, rounds, steps, warmup, deadline, timeout=min(180, ctx["limit"]))


def part_throughput(ctx: dict) -> dict:
    return _throughput(ctx, gpu_throughput.PATHS)


def part_levers(ctx: dict) -> dict:
    return _throughput(ctx, gpu_throughput.LEVERS)


def part_compile(ctx: dict) -> dict:
    return _throughput(ctx, gpu_throughput.COMPILED)


def part_float8(ctx: dict) -> dict:
    import torch

    if not _has("torchao"):
        return {"not_run": "torchao is not installed (carry its wheel)"}
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        return {"not_run": "float8 matrix products need an NVIDIA GPU of compute capability 8.9 or newer"}
    return _throughput(ctx, gpu_throughput.FLOAT8, rounds=1)


def part_float8_sweep(ctx: dict) -> dict:
    import torch

    if not _has("torchao"):
        return {"not_run": "torchao is not installed (carry its wheel)"}
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        return {"not_run": "float8 matrix products need an NVIDIA GPU of compute capability 8.9 or newer"}
    deadline = time.monotonic() + ctx["limit"]
    rows = []
    for hidden in gpu_throughput.FLOAT8_SWEEP:
        result = gpu_throughput.run(
            ("hand+compile", "hand+compile+float8"), f"h{hidden}", 1, 6, 3, deadline, timeout=min(120, ctx["limit"])
        )
        by_path = {row["path"]: row for row in result["rows"]}
        bf16, float8 = by_path["hand+compile"], by_path["hand+compile+float8"]
        ratio = float8["tokens_per_s"] / bf16["tokens_per_s"] if "error" not in bf16 and "error" not in float8 else None
        rows.append({"hidden": hidden, "bf16": bf16, "float8": float8, "float8_over_bf16": ratio})
    return {"rows": rows}


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def part_checkpoint(ctx: dict) -> dict:
    size = ["--size", "tiny", "--rounds", "1", "--every", "3"] if ctx["dry_run"] else ["--rounds", "2", "--every", "10"]
    args = ["--model", "llama", *size, "--profile-save"]
    return _one_rank(ctx, "checkpoint_save.py", args, env={"BENCH_DIR": str(ctx["work"])})


def part_generation(ctx: dict) -> dict:
    tiny, gpu = (
        ["--layers", "2", "--hidden", "64", "--new", "8"],
        ["--layers", "16", "--hidden", "2048", "--new", "128"],
    )
    size = [*tiny, "--rounds", "1"] if ctx["dry_run"] else [*gpu, "--rounds", "3", "--dtype", "bf16"]
    return _one_rank(ctx, "generation.py", size)


def _one_rank(ctx: dict, script: str, args: list[str], env: dict | None = None) -> dict:
    """`script` under torchrun on one rank, writing `--json`: its numbers, and its printed table."""
    out = ctx["work"] / (Path(script).stem + ".json")
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    proc = _python(*launcher, str(BENCH / script), *args, "--json", str(out), timeout=ctx["limit"], env=env)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{script} exit {proc.returncode}: {proc.stderr[-3000:]}")
    return {**json.loads(out.read_text()), "table": proc.stdout.strip()}


def _memory(ctx: dict, mode: str) -> object:
    out = ctx["work"] / f"{mode}.json"
    args = [str(BENCH / "gpu_memory.py"), mode, "--out", str(out), "--budget", str(ctx["limit"] - 15)]
    args += ["--confirm-timeout", str(min(120, ctx["limit"] / 3))]
    proc = _python(*args, *(["--dry-run"] if ctx["dry_run"] else []), timeout=ctx["limit"])
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"gpu_memory.py {mode} exit {proc.returncode}: {proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def part_planner(ctx: dict) -> object:
    return _memory(ctx, "planner")


def part_largest(ctx: dict) -> object:
    return _memory(ctx, "largest")


def part_qlora(ctx: dict) -> dict:
    if not _has("bitsandbytes"):
        return {"not_run": "bitsandbytes is not installed (carry its wheel)"}
    size, steps, warmup = ("tiny", 2, 1) if ctx["dry_run"] else ("3b", 6, 2)
    return qlora_step.run(size, steps, warmup, timeout=ctx["limit"] / 2.2)


def part_deepspeed(ctx: dict) -> dict:
    if not _has("deepspeed"):
        return {"not_run": "DeepSpeed is not importable (carry it and put it on PYTHONPATH)"}
    tiny, gpu = ["--dim", "32", "--layers", "2", "--batch", "4"], ["--dim", "2048", "--layers", "8", "--batch", "8192"]
    size = tiny if ctx["dry_run"] else gpu
    bench = [str(BENCH / "deepspeed_compare.py"), *size, "--precision", "bf16"]
    env = {"DS_ACCELERATOR": "cpu"} if ctx["dry_run"] else None
    time_args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", *bench]
    time_args += ["--steps", "1", "--rounds", "1"] if ctx["dry_run"] else ["--steps", "5", "--rounds", "3"]
    timed = _python(*time_args, timeout=ctx["limit"] / 2, env=env)
    memory = _python(
        *bench,
        "--part",
        "memory",
        "--nproc",
        "1",
        "--memory-runs",
        "1",
        "--steps",
        "2",
        timeout=ctx["limit"] / 2,
        env=env,
    )
    for what, proc in (("time", timed), ("memory", memory)):
        if proc.returncode != 0:
            raise RuntimeError(f"deepspeed_compare.py {what} exit {proc.returncode}: {proc.stderr[-3000:]}")
    return {
        "time": _table_rows(timed.stdout),
        "memory": _table_rows(memory.stdout),
        "table": timed.stdout + memory.stdout,
    }


def _table_rows(text: str) -> dict[str, list[str]]:
    """deepspeed_compare.py's rows, engine -> its columns."""
    engines = ("ZeRO-2", "SHARD_GRAD_OP", "ZeRO-3", "FULL_SHARD")
    return {
        line.split()[0]: line.split()[1:]
        for line in text.splitlines()
        if line.split()[:1] and line.split()[0] in engines
    }


RUNNERS = {
    "tests": part_tests,
    "throughput": part_throughput,
    "levers": part_levers,
    "compile": part_compile,
    "float8": part_float8,
    "float8_sweep": part_float8_sweep,
    "checkpoint": part_checkpoint,
    "generation": part_generation,
    "planner": part_planner,
    "largest": part_largest,
    "qlora": part_qlora,
    "deepspeed": part_deepspeed,
}
LIMITS = {
    "tests": 240,
    "throughput": 240,
    "levers": 150,
    "compile": 300,
    "float8": 200,
    "float8_sweep": 300,
    "checkpoint": 200,
    "generation": 150,
    "planner": 150,
    "largest": 240,
    "qlora": 200,
    "deepspeed": 240,
}
"""Seconds each part may take on the device (a dry run takes a fraction)."""
MIN_START = {
    "tests": 60,
    "throughput": 60,
    "levers": 60,
    "compile": 60,
    "float8": 60,
    "float8_sweep": 60,
    "checkpoint": 30,
    "generation": 30,
    "planner": 30,
    "largest": 60,
    "qlora": 60,
    "deepspeed": 60,
}
"""A part starts only with this many seconds of the budget left."""


# --------------------------------------------------------------------------- report
def report(results: dict) -> str:
    """The results as text: environment, then one block per part."""
    env = results["environment"]
    lines = [
        f"device: {env['device']}; {env['cpus']} CPUs; python {env['python']}",
        "versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()),
        f"date: {env['date']}; git {env['git']}; command: {env['command']}",
    ]
    for name, part in results["parts"].items():
        lines += ["", f"## {name} ({part.get('seconds', 0):.0f} s)"]
        if "error" in part or "not_run" in part:
            lines.append(part.get("not_run") or "ERROR " + part["error"][-2000:])
            continue
        lines.append(_part_text(name, part["result"]))
    return "\n".join(lines) + "\n"


def _part_text(name: str, result) -> str:
    if name in ("throughput", "levers", "compile", "float8"):
        if "not_run" in result:
            return "not run: " + result["not_run"]
        peak = result["peak"]
        head = f"model {result['size']} {result['shape']}; peak {peak['flops'] / 1e12:.0f} TFLOP/s ({peak['source']})"
        return head + "\n" + gpu_throughput.table(result)
    if name == "float8_sweep":
        if "not_run" in result:
            return "not run: " + result["not_run"]
        return "\n".join(
            f"hidden {r['hidden']}: float8/bf16 tokens/s "
            + (f"{r['float8_over_bf16']:.3f}" if r["float8_over_bf16"] else "-")
            for r in result["rows"]
        )
    if name in ("checkpoint", "generation", "deepspeed"):
        return result.get("not_run") or result["table"]
    if name == "planner":
        rows = [f"{'setting':<20} {'estimate GiB':>12} {'measured GiB':>12} {'error':>7}"]
        for r in result:
            rows.append(
                f"{r['setting']:<20} {r['estimate'] / 2**30:>12.3f} {r['measured'] / 2**30:>12.3f} {r['error']:>7.1%}"
            )
        return "\n".join(rows)
    if name == "largest":
        rows = []
        for setting, r in result.items():
            runs = "; ".join(
                f"{run['size']}: " + ("fits" if run.get("fits") else run.get("skipped") or run.get("error", "?")[:120])
                for run in r["runs"]
            )
            rows.append(f"{setting:<20} predicted largest {r['predicted_largest']}; runs: {runs}")
        return "\n".join(rows)
    if name == "qlora":
        return result.get("not_run") or f"model {result['size']} {result['shape']}\n" + qlora_step.table(result)
    return json.dumps(result, indent=1)[:4000]


def write(out: Path, results: dict, files: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "device_suite.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "device_suite.txt").write_text(report(results))
    for name, text in files.items():
        (out / name).write_text(text)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "device_suite_out")))
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--budget", type=float, default=480, help="seconds for the whole run")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes (a CPU check: the device tests skip)")
    parser.add_argument("--tests-k", help="pytest -k expression selecting device tests (default: all)")
    args = parser.parse_args(argv)
    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="device-suite-"))  # checkpoints and scratch: not under --out
    results: dict = {"environment": environment(argv), "parts": {}}
    files: dict[str, str] = {}
    for name in args.parts:
        left = args.budget - (time.monotonic() - start)
        if left < (5 if args.dry_run else MIN_START[name]):
            results["parts"][name] = {"not_run": f"not run: {left:.0f} s of the budget left"}
            continue
        ctx = {"dry_run": args.dry_run, "limit": min(LIMITS[name], left), "work": work, "files": files}
        ctx["tests_k"] = args.tests_k
        print(f"[{time.monotonic() - start:6.0f} s] {name} (up to {ctx['limit']:.0f} s)", flush=True)
        t0 = time.monotonic()
        try:
            results["parts"][name] = {"result": RUNNERS[name](ctx)}
        except Exception as exc:  # recorded; the next part still runs
            results["parts"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        results["parts"][name]["seconds"] = time.monotonic() - t0
        write(args.out, results, files)
    results["seconds"] = time.monotonic() - start
    write(args.out, results, files)
    shutil.rmtree(work, ignore_errors=True)
    print(report(results), flush=True)
    return results


if __name__ == "__main__":
    main()

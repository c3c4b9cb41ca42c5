"""Training throughput of one Llama-shaped model through every path, on one accelerator.

    python benchmarks/gpu_throughput.py --size 1b --rounds 2 --out throughput.json
    python benchmarks/gpu_throughput.py --size tiny --rounds 1 --out t.json   # CPU: the paths run, tiny

The same model (a `transformers` `LlamaForCausalLM` built from a config, seeded), the same token
batches, AdamW, bf16 compute with fp32 master weights and fp32 gradient reduction, no clipping, one
optimizer step per batch, through:

- `hand`: the hand-written loop (`fully_shard` per decoder layer, then the root): the limit;
- `core`: `f2.shard_model(model, mixed_precision="bf16")`, the same loop;
- `lightning_fsdp2`: `Trainer(strategy="fsdp2", precision="bf16-mixed")`;
- `lightning_model_parallel`: Lightning's `ModelParallelStrategy`, `fully_shard` per layer in
  `configure_model` (the recipe Lightning documents), `precision="bf16-mixed"`;
- `fsdp2_accelerator` / `stock_accelerator`: an Accelerate loop under `accelerate launch` with one
  ordinary FSDP config file (`fsdp_version: 2`, transformer-based wrap, bf16), our accelerator and
  the stock one;
- `hf_trainer_fsdp2` / `hf_trainer_stock`: `transformers.Trainer` under the same launch, through
  `FSDP2Trainer` and the stock class;
- `hand+compile`, `core+compile`: per-block `torch.compile` (`compile=True` for the core);
  `...+float8`: torchao's float8 linears first (`FLOAT8`);
- `core+own_loss`: the core with `chunked_loss=False` (the model's own loss on the full logits), to
  measure the chunked loss alone against `core`; `core+fused_adamw`: the core with AdamW's fused
  kernel; `core+max_batch`: the core with the largest micro-batch `f2.largest_micro_batch` fits in
  80 % of the device's memory (at most 4x the size's batch) (`LEVERS`, each compared with `hand`).

Each (path, round) is one fresh process (each framework starts its own world); rounds alternate
the order (A..Z, Z..A). Per path: median seconds per step after `--warmup` steps, tokens/s, MFU
(`f2.flops_per_token` over the device's bf16 peak, `f2.peak_flops`), the peak of
`max_memory_allocated`, and the losses (the same data and seed give the same first loss).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _bench  # this folder: on sys.path as the script's directory, or put there by device_suite

RESULT = "GPU_THROUGHPUT_RESULT "

SIZES = {
    # A few seconds per path on 2 CPU cores: what `device_suite.py --dry-run` and the tests use.
    "tiny": {"hidden": 64, "ffn": 128, "layers": 2, "heads": 4, "vocab": 256, "seq": 64, "batch": 2},
    # 1.06 B parameters (18 layers of 51 M, untied 32000-token embeddings), 8192 tokens a step.
    "1b": {"hidden": 2048, "ffn": 5632, "layers": 18, "heads": 16, "vocab": 32000, "seq": 2048, "batch": 4},
}
FLOAT8_SWEEP = (1024, 2048, 4096, 8192)
"""Hidden sizes of the float8 sweep (`device_suite.py`'s `float8_sweep` part): where float8 starts to pay."""
for _hidden in FLOAT8_SWEEP:  # 2 Llama layers of each width (FFN 8/3 x hidden), 8192 tokens a step
    SIZES[f"h{_hidden}"] = {"hidden": _hidden, "ffn": 256 * round(8 * _hidden / 3 / 256), "layers": 2,
                            "heads": _hidden // 128, "vocab": 32000, "seq": 2048, "batch": 4}  # fmt: skip
PATHS = (
    "hand",
    "core",
    "lightning_fsdp2",
    "lightning_model_parallel",
    "fsdp2_accelerator",
    "stock_accelerator",
    "hf_trainer_fsdp2",
    "hf_trainer_stock",
)
COMPILED = ("hand+compile", "core+compile")
FLOAT8 = ("hand+compile+float8", "core+compile+float8")
"""torchao's float8 training (`convert_to_float8_training`, float8 all-gather with the scales
precomputed after each optimizer step; the output layer kept in bf16, as torchtitan does), compiled:
needs torchao and float8 tensor cores."""
LEVERS = ("hand", "core", "core+own_loss", "core+fused_adamw", "core+max_batch")
"""The speed levers, each alone against the hand-written loop: `core` (defaults: the chunked loss),
the same with the model's own loss, with torch's fused AdamW kernel (`fused=True`), and with the
largest micro-batch the memory planner fits (`max_batch_rows`)."""
LEVER_EXTRAS = ("own_loss", "fused_adamw", "max_batch")
ACCELERATE_PATHS = ("fsdp2_accelerator", "stock_accelerator", "hf_trainer_fsdp2", "hf_trainer_stock")


# --------------------------------------------------------------------------- one path (one process)
def llama_config(size: dict):
    """The `LlamaConfig` of `size` (untied embeddings, SDPA; `kv_heads` defaults to `heads`)."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=size["hidden"],
        intermediate_size=size["ffn"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size.get("kv_heads", size["heads"]),
        vocab_size=size["vocab"],
        max_position_embeddings=size["seq"],
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    return config


def build_model(size: dict, device):
    """The seeded Llama-shaped model of `size`, fp32, built on `device`."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(llama_config(size))


def max_batch_rows(size: dict, device) -> int:
    """The most rows per step the memory planner fits for the core's defaults: in 80 % of the
    accelerator's memory (a margin for the allocator's fragmentation), at most 4x `size`'s batch."""
    import torch

    import fsdp2_strategy as f2

    budget = None
    if device.type == "cuda":
        budget = int(0.8 * torch.cuda.get_device_properties(device).total_memory)
    ids = torch.zeros(size["batch"], size["seq"], dtype=torch.long)
    fit = f2.largest_micro_batch(
        build_model(size, "meta"), {"mixed_precision": "bf16"}, world_size=1, example_batch={"input_ids": ids, "labels": ids},
        memory_budget=budget, max_batch=4 * size["batch"], device_type=device.type,
    )  # fmt: skip
    return fit.batch_size


def batches(size: dict, steps: int):
    """`steps` batches of token ids (the labels are the ids: the model shifts them)."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, size["vocab"], (steps, size["batch"], size["seq"]), generator=gen)


class Clock:
    """Step boundaries (after a device synchronisation) and losses, for one path."""

    def __init__(self, device):
        import torch

        self.device, self.stamps, self.losses = device, [], []
        self._sync = torch.accelerator.synchronize if device.type != "cpu" else (lambda: None)

    def tick(self, loss) -> None:
        self._sync()
        self.stamps.append(time.perf_counter())
        self.losses.append(float(loss))

    def result(self, warmup: int) -> dict:
        times = [b - a for a, b in zip(self.stamps, self.stamps[1:])][max(warmup - 1, 0) :]
        return {"times": times, "losses": self.losses}


def _device():
    import torch

    if not torch.accelerator.is_available():
        return torch.device("cpu")
    return torch.device(torch.accelerator.current_accelerator().type, int(os.environ.get("LOCAL_RANK", 0)))


def _plain_loop(model, data, clock: Clock, extras: frozenset = frozenset()) -> None:
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True if "fused_adamw" in extras else None)
    after_step = _float8_scales if "float8" in extras else None
    for ids in data:
        ids = ids.to(clock.device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(model)
        clock.tick(loss)


def _float8_scales(model) -> None:
    """The float8 weights' scales for the next all-gather in one pass over every weight (one
    all-reduce of their amaxes), after each optimizer step, as torchtitan and torchao advise with
    float8 all-gather; without it each weight computes its own in its group's all-gather."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def to_float8(model) -> None:
    """torchao's float8 training linears with float8 all-gather, the output layer left in bf16."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn != "lm_head")


def run_hand(size: dict, data, clock: Clock, extras: frozenset = frozenset()):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if clock.device.type != "cpu":
        torch.accelerator.set_device_index(clock.device.index)
    dist.init_process_group(device_id=clock.device if clock.device.type != "cpu" else None)
    model = build_model(size, clock.device)
    if "float8" in extras:
        to_float8(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        if "compile" in extras:
            layer.compile()
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    _plain_loop(model, data, clock, extras)
    return model


def run_core(size: dict, data, clock: Clock, extras: frozenset = frozenset()):
    import fsdp2_strategy as f2

    f2.init_distributed()
    model = build_model(size, clock.device)
    if "float8" in extras:
        to_float8(model)
    chunked = False if "own_loss" in extras else "auto"
    f2.shard_model(model, mixed_precision="bf16", compile="compile" in extras, chunked_loss=chunked, log_plan=False)
    _plain_loop(model, data, clock, extras)
    return model


def run_lightning(size: dict, data, clock: Clock, strategy_name: str):
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    import fsdp2_strategy.integrations.lightning  # noqa: F401  registers "fsdp2"

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build_model(size, clock.device)

        def configure_model(self) -> None:
            if strategy_name == "model_parallel":  # the user shards by hand there
                from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

                mesh = self.device_mesh["data_parallel"]
                mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                for layer in self.model.model.layers:
                    fully_shard(layer, mesh=mesh, mp_policy=mp)
                fully_shard(self.model, mesh=mesh, mp_policy=mp)

        def training_step(self, ids, _):
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Tick(Callback):
        def on_train_batch_end(self, trainer, module, outputs, *_):
            clock.tick(outputs["loss"])

    if strategy_name == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    else:
        strategy = "fsdp2"
    trainer = pl.Trainer(
        accelerator="gpu" if clock.device.type == "cuda" else clock.device.type,
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=len(data),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Tick()],
    )
    lit = Lit()
    trainer.fit(lit, DataLoader(list(data), batch_size=None))
    return lit.model


def run_accelerate(size: dict, data, clock: Clock, ours: bool):
    import torch

    if ours:
        from fsdp2_strategy.integrations.accelerate import FSDP2Accelerator as Accelerator
    else:
        from accelerate import Accelerator

    acc = Accelerator()
    model = build_model(size, clock.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    for ids in data:
        ids = ids.to(acc.device)
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        clock.tick(loss)
    return model


def run_hf_trainer(size: dict, data, clock: Clock, ours: bool, work: Path):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    if ours:
        from fsdp2_strategy.integrations.transformers import FSDP2Trainer as Trainer  # noqa: F811

    class Tick(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.tick(float("nan"))

    args = TrainingArguments(
        output_dir=str(work / "hf"),
        per_device_train_batch_size=size["batch"],
        max_steps=len(data),
        learning_rate=1e-4,
        optim="adamw_torch",
        lr_scheduler_type="constant",
        weight_decay=0.01,
        max_grad_norm=0.0,
        bf16=True,
        use_cpu=clock.device.type == "cpu",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    rows = [{"input_ids": ids, "labels": ids} for ids in data.reshape(-1, size["seq"])]
    model = build_model(size, clock.device)
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[Tick()])
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    clock.losses = losses[: len(clock.stamps)]
    return trainer.model


def worker(path: str, size_name: str, steps: int, warmup: int, work: Path) -> None:
    """Run one path in this process and print its result line (rank 0)."""
    import torch

    import fsdp2_strategy as f2

    size = SIZES[size_name]
    base, *extra = path.split("+")
    extras = frozenset(extra)
    clock = Clock(_device())
    if "max_batch" in extras:
        size = {**size, "batch": max_batch_rows(size, clock.device)}
    data = batches(size, steps + warmup)
    runners = {
        "hand": lambda: run_hand(size, data, clock, extras),
        "core": lambda: run_core(size, data, clock, extras),
        "lightning_fsdp2": lambda: run_lightning(size, data, clock, "fsdp2"),
        "lightning_model_parallel": lambda: run_lightning(size, data, clock, "model_parallel"),
        "fsdp2_accelerator": lambda: run_accelerate(size, data, clock, ours=True),
        "stock_accelerator": lambda: run_accelerate(size, data, clock, ours=False),
        "hf_trainer_fsdp2": lambda: run_hf_trainer(size, data, clock, ours=True, work=work),
        "hf_trainer_stock": lambda: run_hf_trainer(size, data, clock, ours=False, work=work),
    }
    model = runners[base]()
    result = clock.result(warmup)
    sharded = sum(type(p).__name__ == "DTensor" for p in model.parameters())
    result.update(
        path=path,
        batch=size["batch"],
        sharded_params=sharded,
        params=sum(p.numel() for p in model.parameters()),
        peak_memory_bytes=torch.cuda.max_memory_allocated() if clock.device.type == "cuda" else None,
    )
    print(RESULT + json.dumps(result), flush=True)
    f2.shutdown()


# --------------------------------------------------------------------------- the interleaved runs
def launch(path: str, size: str, steps: int, warmup: int, work: Path, timeout: float) -> dict:
    """One fresh process for `path`: `accelerate launch` with the FSDP config file for the
    Accelerate and HF Trainer paths, a world of one under `torchrun`'s variables for the others."""
    import torch

    script = [__file__, "--worker", path, "--size", size, "--steps", str(steps), "--warmup", str(warmup)]
    script += ["--work", str(work)]
    if path in ACCELERATE_PATHS:
        config = work / "accelerate_fsdp2.yaml"
        cpu = not torch.accelerator.is_available()
        config.write_text(
            _bench.accelerate_fsdp2_config(layer="LlamaDecoderLayer", processes=1, mixed_precision="bf16", cpu=cpu)
        )
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
        cmd += ["--main_process_port", str(_bench.free_port()), *script]
        env = _bench.repo_env()
    else:
        cmd, env = [sys.executable, *script], _bench.world_of_one_env()
    start = time.perf_counter()
    result = _bench.run_for_result(cmd, env, timeout, RESULT, path)
    return result if "error" in result else {**result, "process_s": time.perf_counter() - start}


def summarise(path: str, runs: list[dict], size: dict, peak_flops: float, flops_per_token: float) -> dict:
    """Median step, tokens/s and MFU of one path over its rounds."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"path": path, "error": runs[-1]["error"] if runs else "not run"}
    times = [t for r in ok for t in r["times"]]
    step = statistics.median(times)
    tokens_per_s = ok[0].get("batch", size["batch"]) * size["seq"] / step
    peaks = [r["peak_memory_bytes"] for r in ok if r["peak_memory_bytes"] is not None]
    return {
        "path": path,
        "batch": ok[0].get("batch", size["batch"]),
        "step_s": step,
        "step_p25_p75": statistics.quantiles(times, n=4)[::2] if len(times) > 1 else [step, step],
        "tokens_per_s": tokens_per_s,
        "mfu": flops_per_token * tokens_per_s / peak_flops,
        "peak_memory_bytes": max(peaks) if peaks else None,
        "first_loss": ok[0]["losses"][0] if ok[0]["losses"] else None,
        "sharded_params": ok[0]["sharded_params"],
        "params": ok[0]["params"],
        "rounds": len(ok),
        "errors": [r["error"] for r in runs if "error" in r],
    }


def run(paths, size_name: str, rounds: int, steps: int, warmup: int, deadline: float, timeout: float) -> dict:
    """Every path once per round, alternating the order; summaries with ratios to `hand`."""
    import fsdp2_strategy as f2

    size = SIZES[size_name]
    runs: dict[str, list[dict]] = {p: [] for p in paths}
    with tempfile.TemporaryDirectory(prefix="gpu-throughput-") as tmp:
        slowest = 0.0  # seconds of the slowest process so far: what the next one may take
        for r in range(rounds):
            for path in paths if r % 2 == 0 else paths[::-1]:
                if time.monotonic() + 1.2 * slowest > deadline:
                    if not runs[path]:
                        runs[path].append({"path": path, "error": "not run: out of time"})
                    continue
                start = time.monotonic()
                runs[path].append(launch(path, size_name, steps, warmup, Path(tmp), timeout))
                slowest = max(slowest, time.monotonic() - start)
                print(f"  {path}: {_short(runs[path][-1])}", flush=True)
    flops = f2.flops_per_token(build_model(size, "meta"), seq_len=size["seq"])
    peak = f2.peak_flops()
    rows = [summarise(p, runs[p], size, peak.flops, flops) for p in paths]
    # Each path against the hand-written loop with the same extras ("core+compile" against "hand+compile").
    hands = {_extras(row["path"]): row for row in rows if row["path"].split("+")[0] == "hand" and "error" not in row}
    for row in rows:
        base = hands.get(_extras(row["path"]))
        if base and "error" not in row:
            row["vs_hand"] = row["tokens_per_s"] / base["tokens_per_s"]
    return {"size": size_name, "shape": size, "flops_per_token": flops, "peak": peak.to_dict(), "rows": rows}


def _extras(path: str) -> str:
    """The extras that change the model (compile, float8): a path is compared with the hand-written
    loop that has them too; the levers (`LEVER_EXTRAS`) are what is measured against it."""
    return "+".join(e for e in path.split("+")[1:] if e not in LEVER_EXTRAS)


def _short(r: dict) -> str:
    if "error" in r:
        return "ERROR " + r["error"].strip().splitlines()[-1][:200]
    return f"{statistics.median(r['times']):.4f} s/step, first loss {r['losses'][0] if r['losses'] else None}"


def table(result: dict) -> str:
    """The rows as a fixed-width table."""
    lines = [
        f"{'path':<26} {'rows':>4} {'s/step':>8} {'tokens/s':>10} {'MFU':>6} {'vs hand':>8} {'peak GiB':>9} {'loss0':>7}"
    ]
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"{row['path']:<26} ERROR {row['error'].strip().splitlines()[-1][:150]}")
            continue
        peak = f"{row['peak_memory_bytes'] / 2**30:.2f}" if row["peak_memory_bytes"] else "-"
        loss = f"{row['first_loss']:.4f}" if row["first_loss"] == row["first_loss"] and row["first_loss"] else "-"
        lines.append(
            f"{row['path']:<26} {row['batch']:>4} {row['step_s']:>8.4f} {row['tokens_per_s']:>10.0f} {row['mfu']:>6.1%} "
            f"{row.get('vs_hand', float('nan')):>8.3f} {peak:>9} {loss:>7}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument(
        "--paths", nargs="+", default=list(PATHS), choices=sorted({*PATHS, *LEVERS, *COMPILED, *FLOAT8})
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per process")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.size, args.steps, args.warmup, args.work)
        return
    result = run(args.paths, args.size, args.rounds, args.steps, args.warmup, float("inf"), args.timeout)
    print(table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

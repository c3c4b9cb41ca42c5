"""One process on one accelerator (nccl and gloo side by side): the paths a CPU run never takes.

Usage, from the repository's root (tests/ on the path, as `helpers.harness.launch` puts it):

    PYTHONPATH=tests python tests/project/scripts/one_device.py {core,lightning,accelerate,tune,tune_offload,tune_bench} OUT.json WORKDIR

Each mode runs in its own process (each framework starts its own process group) and records
numbers in JSON; tests/project/test_device.py asserts them. CPU-only machines skip it.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import socket
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from helpers.collect import full
from helpers.models import TinyGPT, loss_fn, make_batch, rel_diff

import fsdp2_strategy as f2

# Exact fp32 on the accelerator, so one process and the sharded model compute the same thing.
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def _device() -> torch.device:
    return torch.device(torch.accelerator.current_accelerator().type, 0)


def _max_rel(model, ref, attr: str | None = None) -> float:
    ref_p = dict(ref.named_parameters())
    get = (lambda p: getattr(p, attr)) if attr else (lambda p: p)
    return max(rel_diff(full(get(p)).to(get(ref_p[n]).device), get(ref_p[n])) for n, p in model.named_parameters())


def _init_world1() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    accel = _device()
    torch.accelerator.set_device_index(0)
    dist.init_process_group(
        f"cpu:gloo,{accel.type}:nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=120),
        device_id=accel,
    )


def _step(model, ref, batch, **plan) -> dict:
    """One SGD step of the sharded model and of the plain reference on the same batch."""
    idx, tgt = (t.to(_device()) for t in batch)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    loss_fn(model, idx, tgt).backward()
    loss_fn(ref, idx, tgt).backward()
    grads = _max_rel(model, ref, "grad")
    opt.step()
    ref_opt.step()
    return {"grad_rel": grads, "param_rel": _max_rel(model, ref), "update_rel": _update_rel(model, ref, start)}


def _update_rel(model, ref, start: dict) -> float:
    """Relative difference of the whole update (all parameters as one vector)."""
    got = {n: full(p).to(start[n].device) - start[n] for n, p in model.named_parameters()}
    want = {n: p.detach() - start[n] for n, p in ref.named_parameters()}
    diff = torch.cat([(got[n] - want[n]).flatten() for n in want])
    return (diff.norm() / torch.cat([w.flatten() for w in want.values()]).norm()).item()


def _where(model) -> dict:
    """The device of the position embedding's local shard, and whether it is pinned."""
    local = model.pos.to_local()
    return {"device": str(local.device), "pinned": local.is_pinned()}


def core(out: dict, work: Path) -> None:
    _init_world1()
    dev, batch = _device(), make_batch(8)
    torch.manual_seed(0)
    ref = TinyGPT().to(dev)
    model = f2.shard_model(copy.deepcopy(ref), log_plan=False)
    out["fp32"] = _step(model, ref, batch)
    out["mesh_device"] = str(model.pos.device_mesh.device_type)
    out["param_device"] = str(model.pos.device.type)

    torch.manual_seed(0)
    ref = TinyGPT().to(dev)
    offloaded = f2.shard_model(copy.deepcopy(ref).cpu(), cpu_offload=True, log_plan=False)
    out["offload"] = {**_where(offloaded), **_step(offloaded, ref, batch)}

    torch.manual_seed(0)
    ref = TinyGPT().to(dev)
    bf16 = f2.shard_model(copy.deepcopy(ref), mixed_precision="bf16", log_plan=False)
    r = _step(bf16, ref, batch)
    out["bf16"] = {
        "update_rel": r["update_rel"],
        "grad_dtype": str(bf16.pos.grad.dtype) if bf16.pos.grad is not None else None,
        "logits_dtype": str(bf16(batch[0].to(dev)).dtype),
    }

    # Accumulation without sync + global-norm clipping, against one plain step on the whole batch.
    torch.manual_seed(0)
    ref = TinyGPT().to(dev)
    model = f2.shard_model(copy.deepcopy(ref), log_plan=False)
    idx, tgt = (t.to(dev) for t in batch)
    with f2.no_sync(model):
        (loss_fn(model, idx[:4], tgt[:4]) / 2).backward()
    (loss_fn(model, idx[4:], tgt[4:]) / 2).backward()
    norm = f2.clip_grad_norm_(model.parameters(), 0.5)
    loss_fn(ref, idx, tgt).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    out["accumulate_clip"] = {
        "grad_rel": _max_rel(model, ref, "grad"),
        "norm": norm.item(),
        "ref_norm": ref_norm.item(),
        "norm_device": str(norm.device.type),
    }

    # Checkpoints: sync, async (pinned staging on an accelerator) and overlap (the copies queued on a
    # side stream, the next step ordered after them on the device), resumed into a fresh model.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    saved = {n: full(p) for n, p in model.named_parameters()}
    results = {}
    for name, async_save in (("sync", False), ("async", True), ("overlap", "overlap")):
        ckpt = f2.Checkpointer(work / f"ckpt_{name}", async_save=async_save)
        ckpt.save(1, model=model, optimizer=opt, extra={"step": 1})
        if name == "overlap":  # a step right away (the last use of `model`): it must not reach the checkpoint
            idx, tgt = (t.to(dev) for t in batch)
            loss_fn(model, idx, tgt).backward()
            opt.step()
            results["changed_by_the_step_after_overlap"] = not all(
                torch.equal(full(p), saved[n]) for n, p in model.named_parameters()
            )
        ckpt.wait()
        torch.manual_seed(9)
        fresh = f2.shard_model(TinyGPT().to(dev), log_plan=False)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        extra = ckpt.load(model=fresh, optimizer=fresh_opt)
        results[name] = {
            "extra": extra,
            "latest": ckpt.latest_step(),
            "equal": all(torch.equal(full(p), saved[n]) for n, p in fresh.named_parameters()),
            "opt_state_device": str(next(iter(fresh_opt.state.values()))["exp_avg"].device.type),
        }
    out["checkpoint"] = results
    f2.export_full(work / "ckpt_sync", work / "export")

    # Meta-device build + full weights from the exported safetensors, straight onto the accelerator.
    with torch.device("meta"):
        meta = TinyGPT()
    f2.shard_model(meta, log_plan=False)
    f2.load_full_weights(meta, work / "export")
    out["load_full_weights_equal"] = all(torch.equal(full(p), saved[n]) for n, p in meta.named_parameters())

    # The same meta build with CPU offload: initialised on the device, its shards then moved to
    # host memory (FSDP refuses others at its first forward), pinned there, trained as one process.
    with torch.device("meta"):
        meta_offloaded = TinyGPT()
    f2.shard_model(meta_offloaded, cpu_offload=True, log_plan=False)
    f2.load_full_weights(meta_offloaded, work / "export")
    ref = TinyGPT().to(dev)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(saved[n])
    out["meta_offload"] = {**_where(meta_offloaded), **_step(meta_offloaded, ref, batch)}


GPT_1B = {"vocab": 32000, "dim": 2048, "heads": 16, "layers": 20, "seq": 512}
"""A TinyGPT of 1.07 B parameters (20 blocks of 50 M, a tied 32000-token embedding)."""


def tune(out: dict, work: Path) -> None:
    """`f2.tune` on the 1 B GPT built on the meta device, bf16 mixed precision: every fitting
    candidate materialised and measured on the accelerator, predicted against measured."""
    _init_world1()
    out.update(tune_meta_gpt(GPT_1B, batch_size=4, micro_batches=2))
    (work / "tune.txt").write_text(out["table"])


OFFLOAD_CANDIDATES = [
    {"wrap_policy": None},
    {},
    {"wrap_policy": None, "cpu_offload": True},
    {"cpu_offload": True},
]
"""One group and per-block groups, each with and without CPU offload (the default candidates
offload only when nothing else fits, which a 1 B model on one large GPU never reaches)."""


def tune_offload(out: dict, work: Path) -> None:
    """`tune` with `OFFLOAD_CANDIDATES`: the offloaded settings step the optimizer on the host and
    copy shards both ways; one of them fits the offload terms of the step-time model
    (`fit_offload`), and every row is predicted against its measured step."""
    _init_world1()
    out.update(tune_meta_gpt(GPT_1B, batch_size=4, micro_batches=2, candidates=OFFLOAD_CANDIDATES))
    (work / "tune_offload.txt").write_text(out["table"])


def tune_meta_gpt(
    dims: dict, batch_size: int, micro_batches: int, bench_rounds: int = 0, candidates: list | None = None
) -> dict:
    """Tune a TinyGPT of `dims` built on the meta device (`candidates`: default the tuner's); the
    table, each row as data, and what became of the meta model. With `bench_rounds`, every
    measured candidate is then timed again in that many interleaved rounds
    (`benchmarks/tune.py`'s separate run and verdict, "bench")."""
    with torch.device("meta"):
        model = TinyGPT(**dims)
    idx, target = make_batch(batch_size, seq=dims["seq"], vocab=dims["vocab"])
    batch = {"idx": idx, "target": target}

    def gpt_loss(m, b):
        return loss_fn(m, b["idx"], b["target"])

    result = f2.tune(
        model,
        batch,
        config={"mixed_precision": "bf16"},
        candidates=candidates,
        loss_fn=gpt_loss,
        micro_batches=micro_batches,
    )
    out = {
        "params": sum(p.numel() for p in model.parameters()),
        "still_meta": all(p.is_meta for p in model.parameters()),
        "table": str(result),
        **result.to_dict(),
    }
    if bench_rounds:
        # benchmarks/tune.py loaded from its file (it puts tests/ and benchmarks/ on its own path).
        spec = importlib.util.spec_from_file_location(
            "tune", Path(__file__).resolve().parents[3] / "benchmarks" / "tune.py"
        )
        tune_bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tune_bench)

        from fsdp2_strategy.mesh import collective_device

        on_device = {k: t.to(collective_device()) for k, t in batch.items()}
        times = tune_bench._interleaved(model, on_device, gpt_loss, result, micro_batches, bench_rounds, steps=5)
        verdict = tune_bench.judge("gpt", dist.get_world_size(), micro_batches, {"result": out, "bench": times})
        out["bench"] = {**verdict, "report": tune_bench.report(verdict)}
    return out


def tune_bench(out: dict, work: Path) -> None:
    """`tune`, then each measured candidate timed again in 3 interleaved rounds of 5 steps: is the
    pick within 5 % of the fastest on the accelerator too? (Not a test: about 2 minutes on an H200;
    `python one_device.py tune_bench OUT.json WORKDIR`.)"""
    _init_world1()
    out.update(tune_meta_gpt(GPT_1B, batch_size=4, micro_batches=2, bench_rounds=3))
    (work / "tune_bench.txt").write_text(out["table"] + "\n\n" + out["bench"]["report"])


def lightning(out: dict, work: Path) -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    import fsdp2_strategy.integrations.lightning  # noqa: F401  registers "fsdp2"

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = TinyGPT()
            self.losses, self.seen = [], {}

        def training_step(self, batch, _):
            idx, tgt = batch
            loss = loss_fn(self.net, idx, tgt)
            self.losses.append(loss.item())
            self.seen = {
                "device": str(idx.device.type),
                "backend": str(dist.get_backend()),
                "scaler": type(getattr(self.trainer.precision_plugin, "scaler", None)).__name__,
            }
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    idx, tgt = make_batch(32)
    data = DataLoader(TensorDataset(idx, tgt), batch_size=8)
    results = {}
    for precision in ("bf16-mixed", "16-mixed"):
        torch.manual_seed(0)
        model = Lit()
        trainer = pl.Trainer(
            accelerator="gpu",
            devices=1,
            strategy="fsdp2",
            precision=precision,
            max_steps=4,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            gradient_clip_val=1.0,
            accumulate_grad_batches=2,
        )
        trainer.fit(model, data)
        path = work / f"lit_{precision}.ckpt"
        trainer.save_checkpoint(path)
        # Looked at after fit: inside a step FSDP2 swaps in the gathered (plain) parameters.
        results[precision] = {
            "losses": model.losses,
            "seen": model.seen,
            "saved_dir": path.is_dir(),
            "param": type(model.net.pos).__name__,
            "finite": all(torch.isfinite(torch.tensor(model.losses)).tolist()),
        }
    out.update(results)


def accelerate(out: dict, work: Path) -> None:
    from fsdp2_strategy.integrations.accelerate import FSDP2Accelerator, FSDP2Plugin

    dev = _device()
    torch.manual_seed(0)
    ref = TinyGPT().to(dev)
    model = copy.deepcopy(ref).cpu()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = FSDP2Accelerator(fsdp_plugin=FSDP2Plugin(read_env=False), mixed_precision="no")
    model, opt = acc.prepare(model, opt)
    r = _step_prepared(acc, model, opt, ref)
    out["fp32"] = {**r, "device": str(acc.device), "backend": str(dist.get_backend())}
    path = acc.save_state(work / "acc_state")
    acc.load_state(path)
    out["state_listing"] = sorted(p.name for p in Path(path).iterdir())
    acc.save_model(model, work / "acc_model")
    out["model_files"] = sorted(p.name for p in (work / "acc_model").iterdir())
    # fp16 on the accelerator: the sharded grad scaler, with a start scale that does not overflow.
    from accelerate.utils import GradScalerKwargs

    torch.manual_seed(0)
    ref = TinyGPT().to(dev)
    model = copy.deepcopy(ref).cpu()
    acc16 = FSDP2Accelerator(
        fsdp_plugin=FSDP2Plugin(read_env=False),
        mixed_precision="fp16",
        kwargs_handlers=[GradScalerKwargs(init_scale=1024)],
    )
    model, opt = acc16.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    r = _step_prepared(acc16, model, opt, ref)
    out["fp16"] = {**r, "scaler": type(acc16.scaler).__name__, "skipped": opt.step_was_skipped}


def _step_prepared(acc, model, opt, ref) -> dict:
    idx, tgt = (t.to(acc.device) for t in make_batch(8))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    acc.backward(loss_fn(model, idx, tgt))
    loss_fn(ref, idx, tgt).backward()
    opt.step()
    ref_opt.step()
    return {"param_rel": _max_rel(model, ref), "update_rel": _update_rel(model, ref, start)}


def main() -> None:
    mode, out_path, work = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    work.mkdir(parents=True, exist_ok=True)
    out: dict = {}
    try:
        modes = {
            "core": core,
            "lightning": lightning,
            "accelerate": accelerate,
            "tune": tune,
            "tune_offload": tune_offload,
            "tune_bench": tune_bench,
        }
        modes[mode](out, work)
    except BaseException:  # DCP's CheckpointException is a BaseException
        out["error"] = traceback.format_exc()
    out_path.write_text(json.dumps(out, indent=1, default=str))
    if dist.is_initialized():
        f2.shutdown(1 if "error" in out else 0)
    os._exit(1 if "error" in out else 0)


if __name__ == "__main__":
    main()

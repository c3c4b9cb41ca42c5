"""Build a model too big for one rank on the meta device, shard it, load real weights.

    torchrun --standalone --nproc_per_node=2 examples/meta_init.py [--dim 1024 --layers 16]

No rank ever holds the whole model: it is built on the meta device (shapes only, no
storage), `shard_model` allocates each rank's shard, and `load_full_weights` reads only
that rank's rows of each tensor from a safetensors file. The script first writes such a
file (rank 0, seeded; skipped when `--weights` already exists), then reports every rank's
peak memory while building and loading, next to the model's full size. On GPUs (nccl) the
peak device memory is reported as well.
"""

from __future__ import annotations

import argparse
import logging
import resource
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import fsdp2_strategy as f2

MIB = 2**20
warnings.filterwarnings("ignore", message="DTensor random operators")  # CPU meshes: harmless here


class Block(nn.Module):
    """A pre-norm MLP block: 8 * dim**2 parameters, the unit `wrap_policy="auto"` shards."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def build_model(dim: int, layers: int) -> nn.Module:
    """The model; on whatever device is current (`with torch.device("meta")` for no storage)."""
    return nn.Sequential(*[Block(dim) for _ in range(layers)], nn.LayerNorm(dim))


# --------------------------------------------------------------------------- memory readings
def reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS (Linux; else a no-op)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux: ru_maxrss below is then the peak since process start


def rss_mib(field: str = "VmHWM") -> float:
    """Resident memory in MiB: `VmRSS` (now) or `VmHWM` (peak since the last reset)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# --------------------------------------------------------------------------- the weights file
def write_weights(path: Path, dim: int, layers: int, seed: int = 0) -> None:
    """Write the full model's weights (seeded) to a safetensors file; rank 0 only."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    state = {k: v.contiguous() for k, v in build_model(dim, layers).state_dict().items()}
    save_file(state, str(path))


def _checksums(rows: torch.Tensor, first_row: int) -> list[float]:
    """(sum, row-weighted sum) of `rows`, rows numbered from `first_row`: a tensor swapped with another,
    or rows loaded into the wrong place, changes them; one sum over the model would not see either."""
    rows = rows.double().reshape(rows.shape[0], -1) if rows.ndim else rows.double().reshape(1, 1)
    weights = torch.arange(first_row + 1, first_row + 1 + rows.shape[0], dtype=torch.float64)
    return [float(rows.sum()), float((rows.sum(dim=1) * weights).sum())]


@torch.no_grad()
def weight_checksums(model: nn.Module) -> dict[str, list[float]]:
    """Per parameter, `_checksums` added up over ranks shard by shard (no full tensor is gathered).
    The wrap policy shards dim 0 over a 1-D mesh; rank r holds rows from r * ceil(rows / world)."""
    world = dist.get_world_size()
    local = []
    for p in model.parameters():
        if hasattr(p, "to_local"):
            first = p.device_mesh.get_local_rank() * -(-p.shape[0] // world)
            local += _checksums(p.to_local(), first) if p.to_local().numel() else [0.0, 0.0]
        else:  # replicated: every rank holds it whole
            local += [v / world for v in _checksums(p, 0)]
    total = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(total)
    names = [n for n, _ in model.named_parameters()]
    return {n: total[2 * i : 2 * i + 2].tolist() for i, n in enumerate(names)}


def file_checksums(path: Path) -> dict[str, list[float]]:
    """The same per-tensor checksums read from the file (rank 0, one tensor at a time)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: _checksums(f.get_tensor(k), 0) for k in f.keys()}


# --------------------------------------------------------------------------- main
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=1024, help="hidden size (block = 8*dim^2 params)")
    parser.add_argument("--layers", type=int, default=16, help="number of blocks")
    parser.add_argument("--weights", type=Path, default=None, help="safetensors file (written if missing)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = f2.init_distributed()  # gloo on CPU; on an accelerator its device LOCAL_RANK
    accel = torch.get_device_module(device) if device.type != "cpu" else None
    rank, world = dist.get_rank(), dist.get_world_size()

    # 1. A full checkpoint to load (what from_pretrained would read), written once by rank 0.
    shared = [str(args.weights or Path(tempfile.gettempdir()) / f"meta_init_{args.dim}x{args.layers}.safetensors")]
    dist.broadcast_object_list(shared)
    path = Path(shared[0])
    if rank == 0 and not path.exists():
        write_weights(path, args.dim, args.layers)
    expected = [file_checksums(path) if rank == 0 else None]
    dist.broadcast_object_list(expected)  # also a barrier: the file exists from here on

    # 2. Measured: build on meta, shard, load this rank's slices.
    reset_peak_rss()
    if accel is not None:
        accel.reset_peak_memory_stats()
    before = rss_mib("VmRSS")
    with torch.device("meta"):
        model = build_model(args.dim, args.layers)
    full_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / MIB
    f2.shard_model(model, f2.FSDP2Config(wrap_policy="auto"))
    f2.load_full_weights(model, path)
    growth = rss_mib("VmHWM") - before
    gpu_peak = accel.max_memory_allocated() / MIB if accel is not None else None
    shard_mib = f2.sharding_plan(model).local_bytes / MIB

    # 3. Proof that the right weights arrived, and that the model runs.
    checksum = weight_checksums(model)
    with torch.no_grad():
        out = model(torch.randn(2, args.dim, generator=torch.Generator().manual_seed(0)).to(device))
    rows = [None] * world
    dist.all_gather_object(rows, (rank, before, growth, shard_mib, gpu_peak))
    if rank == 0:
        report(rows, full_mib, checksum, expected[0], bool(torch.isfinite(out).all()))
    f2.shutdown()


def report(rows: list, full_mib: float, checksum: dict, expected: dict, finite: bool) -> None:
    """Print the per-rank memory table (rank 0)."""
    print(f"model: {full_mib:.0f} MiB of fp32 parameters in full, sharded over {len(rows)} ranks")
    gpu = rows[0][4] is not None
    print(
        f"{'rank':>4} {'RSS before (MiB)':>17} {'peak growth (MiB)':>18} {'own shard (MiB)':>16}"
        + (f" {'GPU peak (MiB)':>15}" if gpu else "")
    )
    for rank, before, growth, shard, gpu_peak in rows:
        print(f"{rank:>4} {before:>17.0f} {growth:>18.0f} {shard:>16.0f}" + (f" {gpu_peak:>15.0f}" if gpu else ""))
    worst = max(r[2] for r in rows)
    print(f"largest per-rank peak growth / full model size: {worst / full_mib:.2f}")
    wrong = [
        n
        for n in expected
        if n not in checksum or any(abs(a - b) > 1e-6 * max(1.0, abs(b)) for a, b in zip(checksum[n], expected[n]))
    ]
    match = not wrong and set(checksum) == set(expected)
    print(
        f"weights match the file: {match} ({len(expected)} tensors, each by its sum and row-weighted sum"
        f"{'; differing: ' + ', '.join(wrong[:5]) if wrong else ''}); forward output finite: {finite}"
    )


if __name__ == "__main__":
    main()

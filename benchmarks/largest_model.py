"""The largest model of one family that fits per strategy (estimated, in the spirit of the seeds'
figure): a GPT family from 125 M to 65 B parameters, bf16 compute, AdamW, micro-batch 1 x 2048
tokens, on a given device memory and rank count. Estimates only (`f2.estimate_memory` on meta);
the accuracy of the estimator is measured by `memory_accuracy.py`.

    python benchmarks/largest_model.py --world-size 16 --nodes 2 --device-memory 80GiB
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from helpers.models import TinyGPT  # noqa: E402

import fsdp2_strategy as f2  # noqa: E402
from fsdp2_strategy.config_checks import parse_bytes  # noqa: E402

FAMILY = [(768, 12), (1024, 24), (1536, 24), (2048, 24), (2560, 32), (4096, 32), (5120, 40), (6656, 60), (8192, 80)]
"""(width, layers) of GPT-3's sizes 125M ... 65B (vocabulary 50257, tied embedding)."""


def build(width: int, layers: int, seq: int) -> torch.nn.Module:
    with torch.device("meta"):
        return TinyGPT(vocab=50257, dim=width, heads=width // 128, layers=layers, seq=seq)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=16)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--device-memory", default="80GiB")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument(
        "--sizes",
        nargs="+",
        type=int,
        default=list(range(len(FAMILY))),
        help="indices into FAMILY to estimate (default: all)",
    )
    parser.add_argument(
        "--device-type",
        default="cuda",
        help="device the ranks train on (attention kernels, collective buffers): an 80 GiB GPU by default",
    )
    parser.add_argument("--offload", nargs="+", type=int, default=[0, 1], help="offload settings to try (0/1)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "largest_model"))
    args = parser.parse_args()
    budget = parse_bytes(args.device_memory)
    results: dict[str, list] = {}
    for width, layers in [FAMILY[i] for i in args.sizes]:
        model = build(width, layers, args.seq)
        params = sum(p.numel() for p in model.parameters())
        batch = torch.zeros(1, args.seq, dtype=torch.long, device="meta")
        table = f2.compare_strategies(
            model,
            {"mixed_precision": "bf16"},
            world_size=args.world_size,
            nodes=args.nodes,
            device_memory=budget,
            example_batch=batch,
            offload=tuple(bool(o) for o in args.offload),
            device_type=args.device_type,
        )
        for row in table.rows:
            results.setdefault(row.label, []).append((params, row.estimate.peak_bytes, bool(row.fits)))
        print(
            f"{params / 1e9:6.2f} B params: fits {sum(r.fits for r in table.rows)}/{len(table.rows)}; "
            f"recommended {table.recommended.label if table.recommended else 'none'}",
            flush=True,
        )
    largest = {label: max((p for p, _, fits in pts if fits), default=0) for label, pts in results.items()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(
        json.dumps({"args": vars(args), "points": results, "largest": largest}, indent=1)
    )
    for label, p in largest.items():
        print(f"{label:30s} largest fitting: {p / 1e9:6.2f} B")
    plot(largest, args, out.with_suffix(".png"))


def plot(largest: dict, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(largest)
    fig, ax = plt.subplots(figsize=(9, 5))
    ax.barh(labels, [largest[k] / 1e9 for k in labels], color="tab:blue")
    ax.set_xscale("log")
    ax.set_xlabel("largest GPT that fits (billion parameters, estimated)")
    ax.set_title(
        f"{args.world_size} ranks on {args.nodes} nodes, {args.device_memory} per rank, bf16, AdamW, "
        f"1 x {args.seq} tokens"
    )
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

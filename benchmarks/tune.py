"""Does `f2.tune` pick the fastest setting, and does its step-time model predict each one?

For each model x world size x micro-batch count, one spawned gloo world:
1. runs `f2.tune` (default candidates, AdamW) and keeps its table: predicted and measured s/step;
2. times every candidate the tuner measured again, interleaved (A B C, C B A, ...; the first round
   is warm-up), a run separate from the tuner's: each round builds each candidate afresh, takes 2
   untimed and `--steps` timed steps and frees it, so one model is alive at a time, as in training
   and in the tuner. Each rank is pinned to one core in (1) and (2) (`--no-pin`: left to the scheduler);
3. judges: the pick's median step in (2) within 5 % of the fastest candidate's; each prediction
   against (2)'s median; the tuner's cost against 1,000 steps of the pick.

    OMP_NUM_THREADS=1 python benchmarks/tune.py --models mlp8 gpt minilm --worlds 2 --ks 1 4

Models: `mlp8` the 8-block benchmark model (dim 512, batch 16, `_bench.Net`), `gpt` TinyGPT and
`minilm` all-MiniLM-L6-v2 (batch 8, as `tests/_memtrack.py` builds them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks"), str(ROOT)]

from _harness import run_distributed  # noqa: E402


def _model(name: str):
    """(model, one rank's batch, loss_fn)."""
    import torch
    import torch.nn.functional as F

    if name == "mlp8":
        import _bench

        x, y = _bench.batches(1, 16)[0]
        return _bench.make_net(512, 8), (x, y), lambda m, b: F.mse_loss(m(b[0]), b[1])
    from _memtrack import MODELS

    make_model, make_batch, loss_fn = MODELS[name]
    torch.manual_seed(0)
    return make_model(), make_batch(8), loss_fn


def _interleaved(model, batch, loss_fn, result, k: int, rounds: int, steps: int) -> dict[str, list[float]]:
    import copy
    import gc

    import _bench
    import torch

    import fsdp2_strategy as f2
    from fsdp2_strategy.tuning.measure import train_step

    def timed(cfg) -> list[float]:
        sharded = f2.shard_model(copy.deepcopy(model), cfg, log_plan=False)
        opt = torch.optim.AdamW(sharded.parameters())

        def step(_: int) -> None:
            train_step(sharded, opt, batch, loss_fn, k, cfg.accumulation)

        for i in range(2):
            step(i)
        return _bench.timed_steps(step, steps)

    def run(cfg) -> list[float]:
        times = timed(cfg)
        # FSDP's hooks hold the model in reference cycles: collect it now, as the tuner does, or
        # the next candidates step beside dead copies (on an H200, 1 B GPT: 1.16-1.40x the tuner's steps).
        gc.collect()
        return times

    configs = {r.label: result.config_of(r.label) for r in result.rows if r.measured is not None}
    variants = {label: lambda cfg=cfg: run(cfg) for label, cfg in configs.items()}
    times = _bench.interleave(variants, rounds)
    slowest = torch.tensor([times[name] for name in variants], dtype=torch.float64)
    torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
    return {name: slowest[i].tolist() for i, name in enumerate(variants)}


def _case(name: str, k: int, rounds: int, steps: int, pin: bool) -> dict:
    import _bench
    import torch.distributed as dist

    import fsdp2_strategy as f2

    if pin:  # for the tuner and the interleaved run alike
        _bench.pin_to_core(dist.get_rank())
    model, batch, loss_fn = _model(name)
    result = f2.tune(model, batch, loss_fn=loss_fn, micro_batches=k)
    if dist.get_rank() == 0:  # now, so a cell that runs out of time still shows the tuner's table
        print(result, flush=True)
    bench = _interleaved(model, batch, loss_fn, result, k, rounds, steps)
    return {"result": result.to_dict(), "bench": bench}


def judge(name: str, world: int, k: int, out: dict) -> dict:
    medians = {label: statistics.median(t) for label, t in out["bench"].items()}
    quartiles = {label: statistics.quantiles(t, n=4) for label, t in out["bench"].items() if len(t) > 1}
    fastest = min(medians, key=medians.__getitem__)
    pick = out["result"]["best"]
    rows = []
    for r in out["result"]["rows"]:
        bench = medians.get(r["label"])
        pred = r["predicted_s"]
        rows.append(
            {
                "setting": r["label"],
                "predicted_s": pred,
                "tuner_s": r["measured_s"],
                "interleaved_s": bench,
                "interleaved_p25_p75": [quartiles[r["label"]][0], quartiles[r["label"]][2]]
                if r["label"] in quartiles
                else None,
                "error": (pred - bench) / bench if pred and bench else None,
                "skipped": r["skipped"],
            }
        )
    cost = out["result"]["cost_s"]
    return {
        "model": name,
        "world": world,
        "k": k,
        "pick": pick,
        "fastest": fastest,
        "pick_vs_fastest": medians[pick] / medians[fastest],
        "tuner_cost_s": cost,
        "cost_vs_1000_steps": cost / (1000 * medians[pick]),
        "rows": rows,
    }


def report(v: dict) -> str:
    lines = [
        f"## {v['model']}, {v['world']} ranks, k={v['k']}: picked {v['pick']}, fastest interleaved {v['fastest']} "
        f"(pick/fastest {v['pick_vs_fastest']:.3f}); tuning {v['tuner_cost_s']:.1f} s = "
        f"{v['cost_vs_1000_steps']:.1%} of 1,000 steps",
        f"{'setting':<34} {'predicted':>10} {'tuner':>8} {'interleaved':>12} {'p25-p75':>15} {'pred err':>9}",
    ]
    for r in v["rows"]:
        fmt = lambda x, w: f"{x:>{w}.4f}" if x is not None else f"{'-':>{w}}"  # noqa: E731
        err = f"{r['error']:>+9.0%}" if r["error"] is not None else f"{'-':>9}"
        mark = " <-" if r["setting"] == v["pick"] else ""
        spread = r["interleaved_p25_p75"]
        spread_s = f"{spread[0]:>7.4f}-{spread[1]:<7.4f}" if spread else f"{'-':>15}"
        lines.append(
            f"{r['setting'] + mark:<34} {fmt(r['predicted_s'], 10)} {fmt(r['tuner_s'], 8)} "
            f"{fmt(r['interleaved_s'], 12)} {spread_s} {err}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["mlp8"], choices=["mlp8", "gpt", "minilm"])
    parser.add_argument("--worlds", nargs="+", type=int, default=[2])
    parser.add_argument("--ks", nargs="+", type=int, default=[1])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds after one warm-up round")
    parser.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    parser.add_argument(
        "--no-pin", dest="pin", action="store_false", help="leave ranks unpinned (default: each rank on one core)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="seconds per cell (all-MiniLM-L6-v2 on 4 ranks at k=4 ran past 1,800 with --rounds 3 --steps 3)",
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tune.json"))
    args = parser.parse_args()
    verdicts = []
    for name in args.models:
        for world in args.worlds:
            for k in args.ks:
                out = run_distributed(_case, world, name, k, args.rounds, args.steps, args.pin, timeout=args.timeout)[0]
                verdicts.append(judge(name, world, k, out))
                print(report(verdicts[-1]), flush=True)
                Path(args.out).write_text(json.dumps(verdicts, indent=1))  # after each cell: a later one may fail


if __name__ == "__main__":
    main()

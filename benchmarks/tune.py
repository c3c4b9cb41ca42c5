"""Does `f2.tune` pick the fastest setting, and does its step-time model predict each one?

For each model x world size x micro-batch count, one spawned gloo world:
1. runs `f2.tune` (default candidates, AdamW) and keeps its table: predicted and measured s/step;
2. times every candidate the tuner measured again, interleaved (A B C, C B A, ...; the first round
   is warm-up), a run separate from the tuner's: each round builds each candidate afresh, takes 2
   untimed and `--steps` timed steps and frees it, so one model is alive at a time, as in training
   and in the tuner; then those within `--close` of the fastest, and the pick, as many rounds more
   among themselves. Each rank is pinned to one core in (1) and (2) (`--no-pin`: left to the scheduler);
3. judges: the pick's median step in (2) within 5 % of the fastest candidate's, pooled over the
   rounds and paired by round (each candidate's median over the pick's in each round, the
   median of those ratios: the machine's speed between rounds divides out); each prediction
   against (2)'s median; the tuner's cost against 1,000 steps of the pick.

    OMP_NUM_THREADS=1 python benchmarks/tune.py --models mlp8 gpt minilm --worlds 2 --ks 1 4
    python benchmarks/tune.py --plot benchmarks/results/tune.png   # the stored cells (--out), no runs

Models: `mlp8` the 8-block benchmark model (dim 512, batch 16, `_bench.Net`), `gpt` TinyGPT and
`minilm` all-MiniLM-L6-v2 (batch 8, as `tests/helpers/memtrack.py` builds them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks"), str(ROOT)]

from helpers.harness import run_distributed  # noqa: E402


def _model(name: str):
    """(model, one rank's batch, loss_fn)."""
    import torch
    import torch.nn.functional as F

    if name == "mlp8":
        import _bench

        x, y = _bench.batches(1, 16)[0]
        return _bench.make_net(512, 8), (x, y), lambda m, b: F.mse_loss(m(b[0]), b[1])
    from helpers.memtrack import MODELS

    make_model, make_batch, loss_fn = MODELS[name]
    torch.manual_seed(0)
    return make_model(), make_batch(8), loss_fn


def _interleaved(model, batch, loss_fn, result, k: int, rounds: int, steps: int, close: float) -> list[dict]:
    """Every measured candidate timed again, in `rounds` interleaved rounds after a warm-up round;
    then those within `close` of the fastest median, and the pick, `rounds` rounds more among
    themselves (a close call is where the verdict needs the samples). One dict per round:
    label -> the slowest rank's step seconds."""
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
            train_step(sharded, opt, batch, loss_fn, k)

        for i in range(2):
            step(i)
        return _bench.timed_steps(step, steps)

    def run(cfg) -> list[float]:
        times = timed(cfg)
        # FSDP's hooks hold the model in reference cycles: collect it now, as the tuner does, or
        # the next candidates step beside dead copies (on an H200, 1 B GPT: 1.16-1.40x the tuner's steps).
        gc.collect()
        return times

    def timed_rounds(labels: list[str], warmup: bool) -> list[dict]:
        """`_bench.interleave` of `labels`, the slowest rank's steps, cut into its rounds."""
        variants = {label: lambda cfg=configs[label]: run(cfg) for label in labels}
        times = _bench.interleave(variants, rounds, warmup)
        slowest = torch.tensor([times[label] for label in labels], dtype=torch.float64)
        torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
        return [
            {label: row[r * steps : (r + 1) * steps].tolist() for label, row in zip(labels, slowest)}
            for r in range(rounds)
        ]

    configs = {r.label: result.config_of(r.label) for r in result.rows if r.measured is not None}
    done = timed_rounds(list(configs), warmup=True)
    medians = pooled(done)
    near = [label for label in configs if medians[label] <= close * min(medians.values()) or label == result.best.label]
    if len(near) > 1:
        done += timed_rounds(near, warmup=False)
    return done


def steps_of(rounds: list[dict]) -> dict[str, list[float]]:
    """Each label's step seconds over every round it ran in."""
    steps: dict[str, list[float]] = {}
    for round_ in rounds:
        for label, times in round_.items():
            steps.setdefault(label, []).extend(times)
    return steps


def pooled(rounds: list[dict]) -> dict[str, float]:
    """Each label's median step over every round it ran in."""
    return {label: statistics.median(t) for label, t in steps_of(rounds).items()}


def paired(rounds: list[dict], pick: str) -> dict[str, list[float]]:
    """Per label other than `pick`, its median step over the pick's in each round both ran in:
    the machine's speed, which moved one setting's median by up to 1.5x minutes apart on our
    2 cores, divides out of each round's ratio, as in a blocked experiment."""
    ratios: dict[str, list[float]] = {}
    for round_ in rounds:
        if pick not in round_:
            continue
        base = statistics.median(round_[pick])
        for label, times in round_.items():
            if label != pick:
                ratios.setdefault(label, []).append(statistics.median(times) / base)
    return ratios


def paired_verdict(rounds: list[dict], pick: str) -> dict:
    """The candidate that beats the pick by most, round by round (the median of its per-round
    ratios, `paired`), and pick/it with the ratios' quartiles (1.0 and the pick itself when none
    beats it)."""
    ratios = paired(rounds, pick)
    medians = {label: statistics.median(r) for label, r in ratios.items()}
    best = min(medians, key=medians.__getitem__, default=None)
    if best is None or medians[best] >= 1.0:
        return {"fastest": pick, "pick_vs_fastest": 1.0, "p25_p75": None, "rounds": 0}
    q1, _, q3 = statistics.quantiles(ratios[best], n=4) if len(ratios[best]) > 1 else (ratios[best][0],) * 3
    return {
        "fastest": best,
        "pick_vs_fastest": 1 / medians[best],
        "p25_p75": [1 / q3, 1 / q1],
        "rounds": len(ratios[best]),
    }


def _case(name: str, k: int, rounds: int, steps: int, close: float, pin: bool) -> dict:
    import _bench
    import torch.distributed as dist

    import fsdp2_strategy as f2

    if pin:  # for the tuner and the interleaved run alike
        _bench.pin_to_core(dist.get_rank())
    model, batch, loss_fn = _model(name)
    result = f2.tune(model, batch, loss_fn=loss_fn, micro_batches=k)
    if dist.get_rank() == 0:  # now, so a cell that runs out of time still shows the tuner's table
        print(result, flush=True)
    bench = _interleaved(model, batch, loss_fn, result, k, rounds, steps, close)
    return {"result": result.to_dict(), "rounds": bench}


def judge(name: str, world: int, k: int, out: dict) -> dict:
    medians = pooled(out["rounds"])
    steps = steps_of(out["rounds"])
    quartiles = {label: statistics.quantiles(t, n=4) for label, t in steps.items() if len(t) > 1}
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
        "paired": paired_verdict(out["rounds"], pick),
        "steps": {label: len(t) for label, t in steps.items()},
        "tuner_cost_s": cost,
        "cost_vs_1000_steps": cost / (1000 * medians[pick]),
        "rows": rows,
    }


def report(v: dict) -> str:
    lines = [
        f"## {v['model']}, {v['world']} ranks, k={v['k']}: picked {v['pick']}, fastest interleaved {v['fastest']} "
        f"(pick/fastest {v['pick_vs_fastest']:.3f}); tuning {v['tuner_cost_s']:.1f} s = "
        f"{v['cost_vs_1000_steps']:.1%} of 1,000 steps",
        _paired_line(v["paired"]),
        f"{'setting':<34} {'predicted':>10} {'tuner':>8} {'interleaved':>12} {'p25-p75':>15} {'pred err':>9} {'steps':>6}",
    ]
    for r in v["rows"]:
        fmt = lambda x, w: f"{x:>{w}.4f}" if x is not None else f"{'-':>{w}}"  # noqa: E731
        err = f"{r['error']:>+9.0%}" if r["error"] is not None else f"{'-':>9}"
        mark = " <-" if r["setting"] == v["pick"] else ""
        spread = r["interleaved_p25_p75"]
        spread_s = f"{spread[0]:>7.4f}-{spread[1]:<7.4f}" if spread else f"{'-':>15}"
        lines.append(
            f"{r['setting'] + mark:<34} {fmt(r['predicted_s'], 10)} {fmt(r['tuner_s'], 8)} "
            f"{fmt(r['interleaved_s'], 12)} {spread_s} {err} {v['steps'].get(r['setting'], 0):>6}"
        )
    return "\n".join(lines)


def _paired_line(p: dict) -> str:
    if p["p25_p75"] is None:
        return "paired by round: no candidate beats the pick (pick/fastest 1.000)"
    lo, hi = p["p25_p75"]
    return (
        f"paired by round: fastest {p['fastest']}, pick/fastest {p['pick_vs_fastest']:.3f} "
        f"(p25-p75 {lo:.3f}-{hi:.3f}, {p['rounds']} rounds)"
    )


def plot(verdicts: list[dict], out: str) -> None:
    """One panel per cell: each candidate's interleaved median s/step (bar, p25-p75 whiskers), the
    tuner's prediction (dot) and its pick (dark bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    heights = [1 + 0.4 * len(v["rows"]) for v in verdicts]
    fig, axes = plt.subplots(len(verdicts), 1, figsize=(7.5, sum(heights) + 0.6), height_ratios=heights)
    for ax, v in zip([axes] if len(verdicts) == 1 else axes, verdicts):
        rows = [r for r in v["rows"] if r["interleaved_s"] is not None]
        y = range(len(rows))
        medians = [r["interleaved_s"] for r in rows]
        quartiles = [r["interleaved_p25_p75"] or [m, m] for m, r in zip(medians, rows)]
        spread = [[m - q[0] for m, q in zip(medians, quartiles)], [q[1] - m for m, q in zip(medians, quartiles)]]
        colors = ["0.25" if r["setting"] == v["pick"] else "0.75" for r in rows]
        ax.barh(y, medians, xerr=spread, color=colors, capsize=2)
        ax.scatter([r["predicted_s"] for r in rows], y, color="tab:red", s=14, zorder=3)
        ax.set_yticks(list(y), [r["setting"] for r in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("s/step", fontsize=8)
        ax.set_title(f"{v['model']}, {v['world']} ranks, {v['k']} micro-batch(es) per step", fontsize=9)
    legend = [
        Patch(color="0.75", label="measured, interleaved (median, p25-p75)"),
        Patch(color="0.25", label="the tuner's pick"),
        plt.Line2D([], [], marker="o", color="tab:red", linestyle="", label="the tuner's prediction"),
    ]
    fig.legend(handles=legend, loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["mlp8"], choices=["mlp8", "gpt", "minilm"])
    parser.add_argument("--worlds", nargs="+", type=int, default=[2])
    parser.add_argument("--ks", nargs="+", type=int, default=[1])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds after one warm-up round")
    parser.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    parser.add_argument(
        "--close",
        type=float,
        default=1.10,
        help="candidates within this factor of the fastest median, and the pick, take --rounds more rounds",
    )
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
    parser.add_argument("--plot", default=None, help="write the stored cells (--out) as a PNG here, running nothing")
    args = parser.parse_args()
    if args.plot:
        plot(json.loads(Path(args.out).read_text()), args.plot)
        return
    verdicts = []
    for name in args.models:
        for world in args.worlds:
            for k in args.ks:
                out = run_distributed(
                    _case, world, name, k, args.rounds, args.steps, args.close, args.pin, timeout=args.timeout
                )[0]
                verdicts.append(judge(name, world, k, out))
                print(report(verdicts[-1]), flush=True)
                Path(args.out).write_text(json.dumps(verdicts, indent=1))  # after each cell: a later one may fail


if __name__ == "__main__":
    main()

"""`TuneResult`: the tuner's table, its pick, and the step-time model it measured."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import FSDP2Config
from ..estimate import MemoryEstimate, StepTimeModel, StepTimePrediction, collective_count, fsdp_calls, human_bytes
from .candidates import Candidate
from .measure import Measurement


@dataclass
class TuneRow:
    """One candidate: its memory estimate, prediction and measurement, or why it was not run."""

    candidate: Candidate
    """The setting."""
    estimate: MemoryEstimate | None = None
    """`estimate_memory` of the setting (None when it could not be estimated: see `skipped`)."""
    fits: bool = False
    """Whether the estimated peak fits the budget."""
    predicted: StepTimePrediction | None = None
    """Predicted step time (None before a reference step was measured)."""
    measured: Measurement | None = None
    """What the timed steps measured (None: not run)."""
    skipped: str = ""
    """Why the setting was not run or did not finish ("" when measured)."""

    @property
    def label(self) -> str:
        return self.candidate.label

    @property
    def estimated_calls(self) -> int:
        """FSDP's calls per optimizer step the estimate counts (`fsdp_calls`: collective calls
        and local unshards and syncs; 0 when not estimated)."""
        return fsdp_calls(self.estimate) if self.estimate is not None else 0

    @property
    def estimated_collective_calls(self) -> int:
        """The collective calls among `estimated_calls`."""
        return collective_count(self.estimate) if self.estimate is not None else 0

    @property
    def shard_size(self) -> int:
        """Ranks each parameter is sharded over, as estimated (0 when not estimated)."""
        return self.estimate.shard_size if self.estimate is not None else 0

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured step time (`Measurement.expected_s`)."""
        if self.predicted is None or self.measured is None or not self.measured.expected_s:
            return None
        return (self.predicted.total_s - self.measured.expected_s) / self.measured.expected_s


@dataclass
class TuneResult:
    """Every candidate of one `f2.tune` run, the fastest measured one and its config."""

    rows: list[TuneRow]
    """Every candidate, in the order given (measured fewest estimated collective calls first)."""
    best: TuneRow
    """The measured row with the least median step time, among the rows measured in turn where
    there are (decided on rank 0)."""
    base_config: FSDP2Config
    """The config every candidate's settings were applied to (`config_of`, `best_config`)."""
    time_model: StepTimeModel | None
    """Link and compute measured on this group; `compare_strategies(time=...)` takes it."""
    reference: str
    """Labels of the rows whose measured steps gave the compute profile ("A + B": A's phases,
    B's step time for the cost per collective call); their predictions match by construction."""
    world_size: int
    """Ranks tuned on."""
    device_type: str
    """Device tuned on."""
    budget: int
    """Bytes per rank the candidates had to fit."""
    samples_per_step: int
    """Samples one optimizer step trains on, all ranks together."""
    tokens_per_step: int = 0
    """Tokens per step when the batch's first tensor holds token ids (integers, 2 dims); else 0."""
    sweep_s: float = 0.0
    """Seconds of the collective sweep."""
    cost_s: float = 0.0
    """Seconds the whole tuning took (estimates, sweep and every candidate)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form facts for reports (e.g. "cache": the cache file a decision was written to)."""

    @property
    def best_config(self) -> FSDP2Config:
        """The base config with the best row's settings: hand it to `shard_model`."""
        return self.best.candidate.config(self.base_config)

    def config_of(self, label: str) -> FSDP2Config:
        """The config the row `label` was measured with. (A row's settings applied to `best_config`
        instead would keep the pick's other fields: a "blocks" row would inherit one group.)"""
        row = next((r for r in self.rows if r.label == label), None)
        if row is None:
            raise KeyError(f"tune: no row {label!r}; the rows are {[r.label for r in self.rows]}.")
        return row.candidate.config(self.base_config)

    def __str__(self) -> str:
        header = (
            "setting",
            "fits",
            "est peak",
            "meas peak",
            "meas/est",
            "pred s/step",
            "meas s/step",
            "passes",
            "pred err",
            "samples/s" if not self.tokens_per_step else "tokens/s",
            "collectives/step",
            "cost s",
        )
        lines = [header] + [self._cells(r) for r in self.rows]
        widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
        text = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in lines]
        notes = [f"  {r.label}: {r.skipped}" for r in self.rows if r.skipped]
        text += (["not run:"] + notes) if notes else []
        text.append(
            f"picked {self.best.label} ({self.best.measured.step_s:.4f} s/step {_compared(self.best.measured)}) "
            f"on {self.world_size} {self.device_type} rank(s), budget {human_bytes(self.budget)}/rank; compute profile from "
            f"{self.reference}; collective sweep {self.sweep_s:.2f} s; tuning took {self.cost_s:.1f} s in all."
            if self.best.measured
            else "nothing measured"
        )
        return "\n".join(text)

    def _cells(self, r: TuneRow) -> tuple[str, ...]:
        e, m, p = r.estimate, r.measured, r.predicted
        per_step = self.tokens_per_step or self.samples_per_step
        mark = " <-" if r is self.best else ""
        ref = " (ref)" if r.label in self.reference.split(" + ") else ""
        return (
            r.label + mark,
            "-" if e is None else ("yes" if r.fits else "no"),
            human_bytes(e.peak_bytes) if e else "-",
            human_bytes(m.peak_bytes) if m and m.peak_bytes else "-",
            f"{m.peak_bytes / e.peak_bytes:.2f}" if m and e and m.peak_bytes and e.peak_bytes else "-",
            f"{p.total_s:.4f}" if p else "-",
            f"{m.expected_s:.4f}" if m else "-",
            _passes(m),
            f"{r.error:+.0%}{ref}" if r.error is not None else "-",
            f"{per_step / m.expected_s:,.0f}" if m and m.expected_s else "-",
            " ".join(f"{k} {v}" for k, v in sorted(m.collectives.items())) if m else "-",
            f"{m.cost_s:.2f}" if m else "-",
        )

    def to_dict(self) -> dict[str, Any]:
        """The table as plain data (JSON-ready): one dict per row, plus the pick and the costs."""
        rows = []
        for r in self.rows:
            rows.append(
                {
                    "label": r.label,
                    "changes": {k: repr(v) if not _plain(v) else v for k, v in r.candidate.changes.items()},
                    "fits": r.fits,
                    "estimated_peak_bytes": r.estimate.peak_bytes if r.estimate else None,
                    "measured_peak_bytes": r.measured.peak_bytes if r.measured else None,
                    "predicted_s": r.predicted.total_s if r.predicted else None,
                    "measured_s": r.measured.expected_s if r.measured else None,
                    "compared_s": r.measured.step_s if r.measured else None,
                    "passes_s": r.measured.passes if r.measured else None,
                    "stopped": r.measured.stopped if r.measured else None,
                    "interleaved": r.measured.interleaved if r.measured else None,
                    "collectives": r.measured.collectives if r.measured else None,
                    "cost_s": r.measured.cost_s if r.measured else None,
                    "skipped": r.skipped,
                }
            )
        return {
            "best": self.best.label,
            "reference": self.reference,
            "world_size": self.world_size,
            "device_type": self.device_type,
            "samples_per_step": self.samples_per_step,
            "tokens_per_step": self.tokens_per_step,
            "sweep_s": self.sweep_s,
            "cost_s": self.cost_s,
            "rows": rows,
        }


def _passes(m: Measurement | None) -> str:
    """Each pass's median when there were two or more, the last marked "in turn" when it was
    interleaved with the other contenders; "stopped" when the pass stopped after two slow steps
    (timed by the second)."""
    if m is None:
        return "-"
    if m.stopped:
        return "stopped"
    medians = " / ".join(f"{t:.4f}" for t in m.passes) if len(m.passes) > 1 else "-"
    return medians + (" in turn" if m.interleaved else "")


def _compared(m: Measurement) -> str:
    """What the pick compared: the pass in turn's median, or the row's measured step."""
    return "in turn, the fastest" if m.interleaved else "measured"


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))

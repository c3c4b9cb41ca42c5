"""Per-step training metrics: tokens per second, model FLOPs utilisation (MFU), peak memory.

`ThroughputMeter` is the one implementation the adapters log through (Lightning callback,
Accelerate's `log`, the HF Trainer's logs); a plain loop calls `meter.step(tokens)` after each
optimizer step. MFU is model FLOPs (not hardware FLOPs: activation recomputation is not counted,
as in torchtitan and the PaLM paper) per second over the device's peak:

- `flops_per_token`: 6 x the non-embedding parameters (forward 2, backward 4) plus attention's
  12 x layers x hidden x sequence;
- `peak_flops`: a table of dense bf16 peaks for known accelerators, otherwise a timed large
  matrix product on the device (the only honest number on a CPU).
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

_logger = logging.getLogger("fsdp2_strategy")

PEAK_BF16_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,  # SXM; matched after the more specific names above
    "H20": 148e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A10G": 70e12,
    "L40S": 362e12,
    "L4": 121e12,
}
"""Dense (no sparsity) bf16 tensor-core peaks from the vendors' data sheets, by a substring of
`torch.cuda.get_device_name()`; the first match in this order wins."""


@dataclass(frozen=True)
class PeakFlops:
    """A device's peak FLOP/s and where the number comes from ("table" or "measured")."""

    flops: float
    source: str
    device: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def flops_per_token(
    model: nn.Module | None = None,
    *,
    seq_len: int,
    layers: int | None = None,
    hidden: int | None = None,
    non_embedding_params: int | None = None,
) -> float:
    """Training FLOPs per token of a decoder (forward + backward, no recomputation).

    Args:
        model: counts its parameters (global sizes: a sharded model counts whole), less those of
            `nn.Embedding` modules; its `config.num_hidden_layers` / `config.hidden_size` (Hugging
            Face models) give `layers` / `hidden` when they are not passed.
        seq_len: tokens per sequence (attention's cost grows with it).
        layers, hidden: attention blocks and model width; without both (and no config), the
            attention term is left out.
        non_embedding_params: used instead of counting `model`'s.

    Returns:
        6 * non_embedding_params + 12 * layers * hidden * seq_len.

    Raises:
        ValueError: neither `model` nor `non_embedding_params` given.
    """
    if non_embedding_params is None:
        if model is None:
            raise ValueError("flops_per_token needs model= or non_embedding_params=")
        embedding = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
        non_embedding_params = sum(p.numel() for p in model.parameters() if id(p) not in embedding)
    config = getattr(model, "config", None)
    layers = layers if layers is not None else getattr(config, "num_hidden_layers", None)
    hidden = hidden if hidden is not None else getattr(config, "hidden_size", None)
    attention = 12 * layers * hidden * seq_len if layers and hidden else 0
    return float(6 * non_embedding_params + attention)


def peak_flops(device: torch.device | str | None = None, *, measure: bool | None = None) -> PeakFlops:
    """The peak bf16 FLOP/s of `device` (default: the current accelerator, else the CPU).

    Args:
        device: the device to ask about.
        measure: True times a matrix product even for a device in `PEAK_BF16_FLOPS`; None (default)
            measures only devices the table does not know (always the CPU, in float32 there: its
            bf16 products are emulated on most CPUs).

    Returns:
        A `PeakFlops`.
    """
    device = torch.device(device) if device is not None else _default_device()
    name = _device_name(device)
    if not measure:
        for key, flops in PEAK_BF16_FLOPS.items():
            if device.type == "cuda" and key in name:
                return PeakFlops(flops, "table", name)
    return PeakFlops(_measured_matmul_flops(device), "measured", name)


def _default_device() -> torch.device:
    if torch.accelerator.is_available():
        accel = torch.accelerator.current_accelerator()
        return torch.device(accel.type, torch.accelerator.current_device_index())
    return torch.device("cpu")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":  # the table's names are NVIDIA's
        return torch.cuda.get_device_name(device)
    return device.type


def _measured_matmul_flops(device: torch.device, seconds: float = 0.3) -> float:
    """The best of repeated square matrix products (bf16 on accelerators, fp32 on the CPU)."""
    n, dtype = (8192, torch.bfloat16) if device.type != "cpu" else (512, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.accelerator.synchronize if device.type != "cpu" else (lambda: None)
    best, deadline = float("inf"), time.perf_counter() + seconds
    torch.mm(a, b)  # warm-up: kernels chosen, clocks up
    while time.perf_counter() < deadline or best == float("inf"):
        sync()
        start = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        sync()
        best = min(best, (time.perf_counter() - start) / 4)
    return 2 * n**3 / best


@dataclass(frozen=True)
class StepMetrics:
    """One optimizer step as the meter saw it.

    `tokens_per_s` and `mfu` are per rank; `peak_memory_bytes` is the device allocator's peak
    since the last report on an accelerator (`torch.accelerator`), the process's peak resident memory on the CPU.
    """

    step: int
    step_time_s: float
    tokens_per_s: float
    mfu: float | None
    peak_memory_bytes: int

    def as_log(self, prefix: str = "") -> dict[str, float]:
        """The numbers as a flat dict for a framework's logger (None fields left out)."""
        out = {"tokens_per_s": self.tokens_per_s, "step_time_s": self.step_time_s}
        if self.mfu is not None:
            out["mfu"] = self.mfu
        out["peak_memory_gib"] = self.peak_memory_bytes / 2**30
        return {prefix + k: v for k, v in out.items()}


class ThroughputMeter:
    """Times optimizer steps and turns tokens into tokens/s, MFU and peak memory.

    Args:
        flops_per_token: the model's training FLOPs per token (`flops_per_token(...)`); None
            reports no MFU.
        peak: the device's peak (`peak_flops()`); asked for on first use when `flops_per_token`
            is set and this is None.
        every: report every this many steps (`step` returns None in between); the times and
            tokens of the steps in between are summed, so a report is their average.
        log: called with each report (a framework's logger); default: nothing.
        device: synchronised before each reading so the time covers the queued kernels (default:
            the current accelerator; nothing on the CPU).

    Raises:
        ValueError: `every` below 1.
    """

    def __init__(
        self,
        *,
        flops_per_token: float | None = None,
        peak: PeakFlops | None = None,
        every: int = 1,
        log: Callable[[StepMetrics], None] | None = None,
        device: torch.device | str | None = None,
    ):
        if every < 1:
            raise ValueError(f"ThroughputMeter(every={every}) is invalid; use a step count of 1 or more.")
        self.flops_per_token, self.peak, self.every, self.log = flops_per_token, peak, every, log
        self.device = torch.device(device) if device is not None else _default_device()
        self._last: float | None = None
        self._steps = self._tokens = 0
        self._elapsed = 0.0
        self.steps_seen = 0

    def start(self) -> None:
        """Mark the start of the first timed step (otherwise the first `step()` only starts the clock)."""
        self._synchronize()
        self._last = time.perf_counter()
        self._reset_peak()

    def step(self, tokens: int) -> StepMetrics | None:
        """Record one optimizer step that processed `tokens` tokens on this rank.

        Returns:
            The metrics every `every` steps, else None (also for the call that starts the clock).
        """
        self._synchronize()
        now = time.perf_counter()
        self.steps_seen += 1
        if self._last is None:
            self._last = now
            self._reset_peak()
            return None
        self._elapsed += now - self._last
        self._last = now
        self._steps += 1
        self._tokens += tokens
        if self._steps < self.every:
            return None
        metrics = self._report()
        if self.log is not None:
            self.log(metrics)
        return metrics

    def _report(self) -> StepMetrics:
        tokens_per_s = self._tokens / self._elapsed
        mfu = None
        if self.flops_per_token is not None:
            self.peak = self.peak or peak_flops(self.device)
            mfu = self.flops_per_token * tokens_per_s / self.peak.flops
        metrics = StepMetrics(self.steps_seen, self._elapsed / self._steps, tokens_per_s, mfu, self._peak_memory())
        self._steps = self._tokens = 0
        self._elapsed = 0.0
        self._reset_peak()
        return metrics

    def _synchronize(self) -> None:
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)

    def _reset_peak(self) -> None:
        if self.device.type != "cpu":
            torch.accelerator.reset_peak_memory_stats(self.device)

    def _peak_memory(self) -> int:
        if self.device.type != "cpu":
            return int(torch.accelerator.max_memory_allocated(self.device))
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def log_step_metrics(metrics: StepMetrics) -> None:
    """A `ThroughputMeter(log=...)` target: one INFO line through the `fsdp2_strategy` logger."""
    mfu = f", MFU {metrics.mfu:.1%}" if metrics.mfu is not None else ""
    peak = f", peak {metrics.peak_memory_bytes / 2**30:.2f} GiB" if metrics.peak_memory_bytes else ""
    _logger.info("step %d: %.0f tokens/s%s%s", metrics.step, metrics.tokens_per_s, mfu, peak)

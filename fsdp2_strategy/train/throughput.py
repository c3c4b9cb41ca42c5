"""Per-step training metrics: tokens per second, model FLOPs utilisation (MFU), peak memory.

`ThroughputMeter` is the one implementation the adapters log through (Lightning callback,
Accelerate's `log`, the HF Trainer's logs). A plain loop calls `meter.step(tokens)` after each
optimizer step, or `track_throughput(model, optimizer, ...)` has hooks do it: the model's forward
counts the tokens of its inputs, the optimizer's step reports. MFU is model FLOPs (not hardware FLOPs: activation recomputation is not counted,
as in torchtitan and the PaLM paper) per second over the device's peak:

- `flops_per_token`: 6 x the non-embedding parameters (forward 2, backward 4) plus attention's
  12 x layers x hidden x sequence;
- `peak_flops`: a table of dense bf16 peaks for known accelerators, otherwise a timed large
  matrix product on the device (the only honest number on a CPU).
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..distributed import log_rank_zero

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
            `nn.Embedding` modules; the `config.num_hidden_layers` / `config.hidden_size` of it or
            of a submodule (Hugging Face models) give `layers` / `hidden` when they are not passed.
        seq_len: tokens per sequence (attention's cost grows with it).
        layers: attention blocks; without it and `hidden` (and no config), the attention term
            is left out.
        hidden: model width (the attention term's other factor).
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
    config = _hf_config(model)
    layers = layers if layers is not None else getattr(config, "num_hidden_layers", None)
    hidden = hidden if hidden is not None else getattr(config, "hidden_size", None)
    attention = 12 * layers * hidden * seq_len if layers and hidden else 0
    return float(6 * non_embedding_params + attention)


def _hf_config(model: nn.Module | None) -> Any:
    """The Hugging Face config of `model` or of the first submodule holding one (a LightningModule
    wrapping a transformers model), else None."""
    if model is None:
        return None
    for module in model.modules():
        config = getattr(module, "config", None)
        if hasattr(config, "num_hidden_layers") and hasattr(config, "hidden_size"):
            return config
    return None


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
    accel = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accel is None:
        return torch.device("cpu")
    return torch.device(accel.type, torch.accelerator.current_device_index())


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

    TRACKER_PREFIX: ClassVar[str] = "throughput/"
    """What the adapters prepend to the metric names in a framework's trackers and loggers."""

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
        model: with `flops_per_token` None, MFU comes from `flops_per_token(model, seq_len=...)`, the
            sequence length read from the first batch `add_tokens` sees.
        flops_per_token: the model's training FLOPs per token; None (and no `model`): no MFU.
        peak: the device's peak (`peak_flops()`); asked for at the first report when None.
        every: report every this many optimizer steps (`step` returns None in between); the time
            and tokens of those steps are summed, so a report is their average.
        log: called with each report (a framework's logger); default: nothing.
        device: synchronised before each reading so the time covers the queued kernels (default:
            the current accelerator; nothing on the CPU).

    Raises:
        ValueError: `every` below 1.
    """

    def __init__(
        self,
        *,
        model: nn.Module | None = None,
        flops_per_token: float | None = None,
        peak: PeakFlops | None = None,
        every: int = 1,
        log: Callable[[StepMetrics], None] | None = None,
        device: torch.device | str | None = None,
    ):
        if every < 1:
            raise ValueError(f"ThroughputMeter(every={every}) is invalid; use a step count of 1 or more.")
        self.model, self.flops_per_token, self.peak, self.every, self.log = model, flops_per_token, peak, every, log
        self.device = torch.device(device) if device is not None else _default_device()
        self.seq_len: int | None = None
        self.steps_seen = 0
        self.last: StepMetrics | None = None
        self._last_time: float | None = None
        self._steps = self._tokens = self._pending = 0
        self._elapsed = 0.0

    def add_tokens(self, batch: Any) -> int:
        """Count a micro-batch's tokens towards the next `step()`.

        Args:
            batch: a count, a tensor of token ids, or a batch holding one (a dict's "input_ids", else
                its first integer tensor; the same in a tuple or list).

        Returns:
            The tokens counted (0 when the batch holds no integer tensor).
        """
        tokens, seq_len = count_tokens(batch)
        self._pending += tokens
        if self.seq_len is None and seq_len:
            self.seq_len = seq_len
        return tokens

    def start(self) -> None:
        """Start the clock (otherwise the first `step()` only starts it, and its tokens are dropped)."""
        self._synchronize()
        self._last_time = time.perf_counter()
        self._pending = 0
        self._reset_peak()

    def step(self, tokens: int | None = None) -> StepMetrics | None:
        """Record one optimizer step.

        Args:
            tokens: the step's tokens on this rank; None uses what `add_tokens` counted since the
                last step.

        Returns:
            The metrics every `every` steps, else None (also for the call that starts the clock).
        """
        self._synchronize()
        now = time.perf_counter()
        tokens = self._pending if tokens is None else tokens
        self._pending = 0
        self.steps_seen += 1
        if self._last_time is None:
            self._last_time = now
            self._reset_peak()
            return None
        self._elapsed += now - self._last_time
        self._last_time = now
        self._steps += 1
        self._tokens += tokens
        if self._steps < self.every:
            return None
        self.last = self._report()
        if self.log is not None:
            self.log(self.last)
        return self.last

    def _report(self) -> StepMetrics:
        tokens_per_s = self._tokens / self._elapsed
        flops = self.flops_per_token
        if flops is None and self.model is not None and self.seq_len:
            flops = self.flops_per_token = flops_per_token(self.model, seq_len=self.seq_len)
        mfu = None
        if flops is not None:
            self.peak = self.peak or peak_flops(self.device)
            mfu = flops * tokens_per_s / self.peak.flops
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


def count_tokens(batch: Any) -> tuple[int, int | None]:
    """(tokens, sequence length) of a batch: a count, a tensor of token ids, or a dict / tuple /
    list holding one ("input_ids" first, else the first integer tensor). (0, None) if none."""
    if isinstance(batch, int):
        return batch, None
    ids = _token_ids(batch)
    if ids is None:
        return 0, None
    return ids.numel(), (ids.shape[-1] if ids.dim() else None)


def _token_ids(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch if not batch.is_floating_point() and not batch.is_complex() and batch.dtype != torch.bool else None
    if isinstance(batch, dict):
        if isinstance(batch.get("input_ids"), torch.Tensor):
            return batch["input_ids"]
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            found = _token_ids(item)
            if found is not None:
                return found
    return None


class ThroughputTracker:
    """A `ThroughputMeter` driven by hooks on a model and its optimizer.

    `model`'s forward counts the tokens of its inputs, `optimizer`'s step reports. `remove()`
    takes the hooks off. Built by `track_throughput`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, meter: ThroughputMeter):
        self.meter = meter
        self._handles = [
            model.register_forward_pre_hook(self._count, with_kwargs=True),
            optimizer.register_step_post_hook(self._stepped),
        ]

    def _stepped(self, *_: Any) -> None:
        self.meter.step()

    def _count(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.is_grad_enabled():  # evaluation and generation forwards are not training tokens
            self.meter.add_tokens((kwargs, args) if kwargs else args)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def track_throughput(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    every: int = 10,
    log: Callable[[StepMetrics], None] | None = None,
) -> ThroughputTracker:
    """Report tokens/s, MFU and peak memory every `every` optimizer steps, with no change to the loop.

    Args:
        model: the model whose forward gets the token ids (`input_ids=` or the first integer tensor).
        optimizer: the optimizer stepped once per training step.
        every: optimizer steps per report.
        log: called with each `StepMetrics`; default `log_step_metrics` (an INFO line on rank 0).

    Returns:
        The tracker (`.meter.last` is the latest report; `.remove()` unhooks).
    """
    meter = ThroughputMeter(model=model, every=every, log=log or log_step_metrics)
    return ThroughputTracker(model, optimizer, meter)


def log_step_metrics(metrics: StepMetrics) -> None:
    """A `ThroughputMeter(log=...)` target: one INFO line through the `fsdp2_strategy` logger."""
    mfu = f", MFU {metrics.mfu:.1%}" if metrics.mfu is not None else ""
    peak = f", peak {metrics.peak_memory_bytes / 2**30:.2f} GiB" if metrics.peak_memory_bytes else ""
    log_rank_zero("step %d: %.0f tokens/s%s%s", metrics.step, metrics.tokens_per_s, mfu, peak)

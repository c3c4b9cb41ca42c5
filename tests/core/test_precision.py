"""bf16/fp16 where the device computes in them natively, and one warning where it does not: torch's CPU
feature detection first, a timed matrix product where it says no; `shard_model` warns once per process
(rank 0) with the measured slowdown and the fix. The CPU's answers are faked here: this machine's own
(AVX2 only, or AVX512-BF16) must not decide what the test sees."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.harness import run_distributed
from helpers.models import TinyGPT

import fsdp2_strategy as f2
from fsdp2_strategy import _torch_compat as tc
from fsdp2_strategy import precision


def _fake_cpu(monkeypatch, *, avx512_bf16=False, amx=False, amx_fp16=False, slowdown=None):
    """A CPU as torch's feature detection reports it, and what the timed probe would measure (None:
    the probe must not run)."""
    monkeypatch.setattr(tc, "cpu_has_avx512_bf16", lambda: avx512_bf16)
    monkeypatch.setattr(tc, "cpu_has_amx_tile", lambda: amx)
    monkeypatch.setattr(tc, "cpu_has_amx_fp16", lambda: amx_fp16)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512" if avx512_bf16 else "AVX2")

    def probe(dtype):
        if slowdown is None:
            raise AssertionError("the timed probe ran although torch reported the CPU's features")
        return slowdown

    monkeypatch.setattr(precision, "cpu_slowdown", probe)
    monkeypatch.setattr(precision, "_warned_emulated", set())


@pytest.mark.parametrize(
    "cpu, dtype, native",
    [
        ({"avx512_bf16": True}, torch.bfloat16, True),  # Cooper Lake, Zen 4: no probe needed
        ({"amx": True}, torch.bfloat16, True),  # Sapphire Rapids
        ({"slowdown": 48.0}, torch.bfloat16, False),  # AVX2 only: emulated
        ({"slowdown": 0.9}, torch.bfloat16, True),  # an Arm CPU with BF16: the probe says native
        ({"avx512_bf16": True, "slowdown": 40.0}, torch.float16, False),  # bf16 native says nothing of fp16
        ({"amx_fp16": True}, torch.float16, True),
        ({}, torch.float32, True),
    ],
)
def test_native_low_precision_asks_the_cpu_then_times_it(monkeypatch, cpu, dtype, native):
    _fake_cpu(monkeypatch, **cpu)
    assert f2.native_low_precision(dtype, "cpu") is native


def test_the_emulation_warning_says_the_slowdown_and_the_fix_once(monkeypatch):
    _fake_cpu(monkeypatch, slowdown=52.4)
    message = precision.first_emulation_warning(torch.bfloat16, "cpu")
    assert "no native bf16" in message and "capability AVX2" in message and "52x as long as in fp32" in message
    assert "mixed_precision=None" in message and 'precision="32-true"' in message and 'mixed_precision="no"' in message
    assert precision.first_emulation_warning(torch.bfloat16, "cpu") is None  # once per process
    assert "no native fp16" in precision.first_emulation_warning(torch.float16, "cpu")
    assert precision.first_emulation_warning(torch.float32, "cpu") is None
    assert precision.first_emulation_warning(None, "cpu") is None
    _fake_cpu(monkeypatch, avx512_bf16=True)
    assert precision.first_emulation_warning(torch.bfloat16, "cpu") is None


def test_the_real_probe_measures_a_ratio():
    ratio = precision.cpu_slowdown(torch.float32)  # fp32 against itself: about 1 whatever the CPU
    assert 0.2 < ratio < 5


def _shard_twice(native: bool) -> list[str]:
    """Rank 0 of a 1-rank world: two bf16 models sharded; the warnings logged."""
    from _pytest.monkeypatch import MonkeyPatch

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("fsdp2_strategy").addHandler(Keep(level=logging.WARNING))
    with MonkeyPatch.context() as monkeypatch:
        _fake_cpu(monkeypatch, avx512_bf16=native, slowdown=None if native else 55.0)
        for _ in range(2):
            f2.shard_model(TinyGPT(), f2.FSDP2Config(wrap_policy="auto", mixed_precision="bf16"))
        f2.shard_model(TinyGPT(), f2.FSDP2Config(wrap_policy="auto"))
    return [r for r in records if "mixed_precision" in r]


@pytest.mark.parametrize("native, warnings", [(False, 1), (True, 0)])
def test_shard_model_warns_once_where_bf16_is_emulated(native, warnings):
    (records,) = run_distributed(_shard_twice, 1, native)
    assert len(records) == warnings, records
    if warnings:
        assert "mixed_precision='bf16' on this CPU is slow" in records[0] and "55x" in records[0]


def test_an_accelerator_without_native_bf16_is_named_without_cpu_words(monkeypatch):
    monkeypatch.setattr(precision, "_warned_emulated", set())
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    message = precision.first_emulation_warning(torch.bfloat16, "cuda")  # a V100: bf16 only emulated
    assert message.startswith("mixed_precision='bf16' on this cuda device is slow") and "capability" not in message

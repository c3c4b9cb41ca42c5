"""Per-step throughput metrics of the core (one process, CPU): FLOPs per token, the device's peak,
token counting, the meter's averaging and the hooks of `track_throughput`. The adapters' logging on
2 ranks is tested with their flows (test_lightning, test_accelerate, test_transformers)."""

from __future__ import annotations

import time

import pytest
import torch
from helpers.models import TinyGPT
from torch import nn

import fsdp2_strategy as f2


def test_flops_per_token_counts_non_embedding_parameters_and_attention():
    model = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 16), nn.Linear(16, 8, bias=False))
    params = 8 * 16 + 16 + 16 * 8  # the linears: the embedding's 800 do not count
    assert f2.flops_per_token(model, seq_len=32) == 6 * params  # no config: no attention term
    assert f2.flops_per_token(model, seq_len=32, layers=2, hidden=8) == 6 * params + 12 * 2 * 8 * 32
    assert f2.flops_per_token(seq_len=4, non_embedding_params=10, layers=1, hidden=2) == 60 + 96
    with pytest.raises(ValueError, match="model= or non_embedding_params="):
        f2.flops_per_token(seq_len=4)


def test_flops_per_token_reads_a_hugging_face_config_inside_a_wrapper():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=50
    )
    llama = transformers.LlamaForCausalLM(config)
    wrapper = nn.Module()
    wrapper.model = llama  # as a LightningModule holds it
    embedding = llama.model.embed_tokens.weight.numel()
    expected = 6 * (sum(p.numel() for p in llama.parameters()) - embedding) + 12 * 2 * 32 * 16
    assert f2.flops_per_token(wrapper, seq_len=16) == f2.flops_per_token(llama, seq_len=16) == expected


def test_peak_flops_measures_the_cpu_and_reads_the_table_for_known_gpus(monkeypatch):
    cpu = f2.peak_flops("cpu")
    assert cpu.source == "measured" and cpu.device == "cpu" and 1e8 < cpu.flops < 1e14
    from fsdp2_strategy.train import throughput

    monkeypatch.setattr(throughput, "_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    h100 = f2.peak_flops("cuda")
    assert h100 == f2.PeakFlops(989e12, "table", "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(throughput, "_device_name", lambda device: "NVIDIA H100 PCIe")
    assert f2.peak_flops("cuda").flops == 756e12  # the more specific name wins over "H100"


def test_count_tokens_finds_the_token_ids_in_a_batch():
    from fsdp2_strategy.train.throughput import count_tokens

    ids = torch.zeros(4, 16, dtype=torch.long)
    assert count_tokens(ids) == (64, 16)
    assert count_tokens({"attention_mask": torch.ones(4, 3, dtype=torch.long), "input_ids": ids}) == (64, 16)
    assert count_tokens((torch.randn(4, 8), ids)) == (64, 16)  # the first integer tensor
    assert count_tokens(((), {"input_ids": ids})) == (64, 16)  # (args, kwargs) as the hook sees them
    assert count_tokens(torch.randn(4, 8)) == (0, None)
    assert count_tokens(7) == (7, None)


def test_meter_averages_every_n_steps_and_reports_mfu_against_the_peak():
    reports = []
    peak = f2.PeakFlops(1e9, "table", "test")
    meter = f2.ThroughputMeter(flops_per_token=100.0, peak=peak, every=2, log=reports.append)
    assert meter.step(10) is None  # starts the clock
    times = []
    for tokens in (10, 30, 50):
        start = time.perf_counter()
        time.sleep(0.02)
        result = meter.step(tokens)
        times.append(time.perf_counter() - start)
    assert len(reports) == 1 and result is None  # steps 2 and 3 make one report; step 4 waits for step 5
    first = reports[0]
    assert first.step == 3
    assert first.tokens_per_s * first.step_time_s * 2 == pytest.approx(40)  # 10 + 30 tokens over 2 steps
    assert first.step_time_s == pytest.approx(sum(times[:2]) / 2, rel=0.2)
    assert first.mfu == pytest.approx(100.0 * first.tokens_per_s / 1e9)
    assert first.peak_memory_bytes > 2**20  # the process's resident peak on the CPU
    assert set(first.as_log("x/")) == {"x/tokens_per_s", "x/step_time_s", "x/mfu", "x/peak_memory_gib"}
    with pytest.raises(ValueError, match="every=0"):
        f2.ThroughputMeter(every=0)


def test_track_throughput_counts_training_forwards_and_reports_at_optimizer_steps():
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, seq=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    reports = []
    tracker = f2.track_throughput(model, opt, every=1, log=reports.append)
    ids = torch.randint(0, 64, (2, 16))
    for _ in range(3):
        for _ in range(2):  # two micro-batches of 32 tokens per optimizer step
            model(ids).float().mean().backward()
        with torch.no_grad():
            model(ids)  # evaluation: not counted
        opt.step()
        opt.zero_grad()
    assert [r.step for r in reports] == [2, 3]
    for r in reports:
        assert r.tokens_per_s * r.step_time_s == pytest.approx(64)
        assert 0 < r.mfu < 1  # TinyGPT's FLOPs per token over the CPU's measured peak
    assert tracker.meter.seq_len == 16 and tracker.meter.last is reports[-1]
    tracker.remove()
    opt.step()
    assert len(reports) == 2  # unhooked

"""`f2.largest_micro_batch`: the most rows per rank that fit the budget, by the planner's estimate;
what the chunked loss frees becomes a larger batch."""

from __future__ import annotations

import pytest
import torch
from helpers.models import tiny_llama

import fsdp2_strategy as f2
from fsdp2_strategy.cli.main import main
from fsdp2_strategy.estimate.micro_batch import _search

VOCAB, SEQ = 32000, 128


def _batch(rows: int = 1):
    ids = torch.zeros(rows, SEQ, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


def _peak(config: dict, rows: int) -> int:
    return f2.estimate_memory(tiny_llama(VOCAB), config, world_size=2, example_batch=_batch(rows)).peak_bytes


def test_the_batch_found_fits_and_one_row_more_does_not():
    config = {"chunked_loss": False}
    budget = _peak(config, 6) + 1  # 6 rows fit exactly: the search must find 6 from a 1-row example
    fit = f2.largest_micro_batch(tiny_llama(VOCAB), config, world_size=2, example_batch=_batch(), memory_budget=budget)
    assert fit.batch_size == 6 and fit.peak_bytes <= budget < fit.next_peak_bytes, fit
    assert fit.peak_bytes == _peak(config, 6) and fit.next_peak_bytes == _peak(config, 7)
    assert str(fit).startswith("largest micro-batch within ") and " 6 rows (peak " in str(fit)


def test_the_memory_the_chunked_loss_frees_becomes_rows():
    budget = _peak({"chunked_loss": False}, 6) + 1
    plain = f2.largest_micro_batch(
        tiny_llama(VOCAB), {"chunked_loss": False}, world_size=2, example_batch=_batch(), memory_budget=budget
    )
    chunked = f2.largest_micro_batch(tiny_llama(VOCAB), world_size=2, example_batch=_batch(), memory_budget=budget)
    # A 32-wide toy: its fp32 logits are nearly all of its activations (6 rows against 346 when written).
    assert plain.batch_size == 6 and chunked.batch_size > 10 * plain.batch_size, (plain, chunked)


def test_search_doubles_then_bisects_and_stops_at_max_batch():
    calls = []

    def peak(rows):
        calls.append(rows)
        return 100 * rows

    fit = _search(peak, budget=1234, max_batch=4096)
    assert (fit.batch_size, fit.peak_bytes, fit.next_peak_bytes) == (12, 1200, 1300)
    assert calls == [1, 2, 4, 8, 16, 12, 14, 13]
    capped = _search(lambda rows: rows, budget=10**9, max_batch=100)
    assert capped.batch_size == 100 and capped.next_peak_bytes is None and "(the largest tried)" in str(capped)


def test_nothing_fits_names_the_peak_the_budget_and_the_levers():
    with pytest.raises(ValueError, match=r"one row needs .* per rank, over the budget of 1.00 KiB\. Lower the peak"):
        f2.largest_micro_batch(tiny_llama(VOCAB), world_size=2, example_batch=_batch(), memory_budget=1024)
    with pytest.raises(ValueError, match=r"max_batch=0\): use an int >= 1"):
        f2.largest_micro_batch(tiny_llama(VOCAB), world_size=2, example_batch=_batch(), max_batch=0)


def test_plan_command_prints_the_largest_batch_of_the_recommended_setting(capsys):
    from test_planner import gpt_with_batch

    args = ["plan", "test_planner:gpt_with_batch", "--world-size", "2", "--device-memory", "1GiB"]
    assert main([*args, "--largest-batch"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    model, batch = gpt_with_batch()
    best = f2.compare_strategies(model, world_size=2, example_batch=batch, device_memory="1GiB").recommended
    setting = {"sharding_strategy": best.strategy, "cpu_offload": best.cpu_offload}
    setting["activation_checkpointing"] = "auto" if best.activation_checkpointing else None
    fit = f2.largest_micro_batch(model, setting, world_size=2, example_batch=batch, memory_budget="1GiB")
    assert line == f"{best.label}: {fit}", line
    assert fit.batch_size > 8  # the 8-row example fits 1 GiB with room to spare

"""`f2.compare_strategies`, `fsdp2-strategy plan` and `FSDP2Config(sharding_strategy="auto")`."""

from __future__ import annotations

import pytest
import torch
from helpers.harness import run_distributed
from helpers.models import TinyGPT

import fsdp2_strategy as f2
from fsdp2_strategy.cli.main import main
from fsdp2_strategy.estimate.memory import human_bytes


def gpt(layers: int = 4):
    torch.manual_seed(0)
    return TinyGPT(vocab=512, dim=128, heads=4, layers=layers, seq=64)


def gpt_with_batch():
    """A `plan` factory: the model and one rank's micro-batch."""
    return gpt(), torch.zeros(8, 64, dtype=torch.long)


def test_comparison_has_every_setting_and_recommends_the_cheapest_that_fits():
    batch = torch.randint(0, 512, (8, 64))
    free = f2.compare_strategies(gpt(), world_size=4, example_batch=batch)
    assert len(free.rows) == 20 and free.recommended is None  # 5 strategies x offload x AC, no budget
    peaks = sorted(r.estimate.peak_bytes for r in free.rows)
    budget = peaks[len(peaks) // 2]
    judged = f2.compare_strategies(gpt(), world_size=4, example_batch=batch, device_memory=budget)
    fitting = [r for r in judged.rows if r.estimate.peak_bytes <= budget]
    assert [r.fits for r in judged.rows] == [r.estimate.peak_bytes <= budget for r in judged.rows]
    best = judged.recommended
    assert best in fitting
    assert best.estimate.communication_bytes == min(r.estimate.communication_bytes for r in fitting)
    assert best.label in str(judged) and "<-" in str(judged)


def test_nothing_fits_names_the_smallest_peak_and_the_levers():
    result = f2.compare_strategies(gpt(), world_size=2, device_memory=1000)
    assert result.recommended is None
    smallest = min(r.estimate.peak_bytes for r in result.rows)
    assert f"smallest peak is {human_bytes(smallest)}" in result.reason and "offload" in result.reason


def test_plan_command_prints_one_row_per_setting(capsys):
    code = main(["plan", "test_planner:gpt_with_batch", "--world-size", "2", "--device-memory", "1GiB"])
    out = capsys.readouterr().out
    assert code == 0 and "<-" in out
    for name in ("FULL_SHARD+offload+AC", "HYBRID_SHARD_ZERO2", "NO_SHARD+AC"):
        assert name in out
    assert main(["plan", "test_planner:gpt_with_batch", "--world-size", "2", "--device-memory", "1KiB"]) == 1


def test_context_parallel_plans_count_one_ranks_part_of_each_sequence(capsys):
    """With context_parallel_size=2 every row's activations are those of half of each sequence, and
    NO_SHARD (the cp ranks share parameters' shards) is not offered; `plan` takes the size too."""
    batch = torch.randint(0, 512, (8, 64))
    whole = f2.compare_strategies(gpt(), world_size=4, example_batch=batch)
    split = f2.compare_strategies(gpt(), {"context_parallel_size": 2}, world_size=4, example_batch=batch)
    by_label = {r.label: r.estimate.activation_peak_bytes for r in whole.rows}
    assert split.rows and not any(r.strategy == "NO_SHARD" for r in split.rows)
    for row in split.rows:
        assert 0.4 <= row.estimate.activation_peak_bytes / by_label[row.label] <= 0.65, row.label
    assert main(["plan", "test_planner:gpt_with_batch", "--world-size", "2", "--context-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "FULL_SHARD" in out and "NO_SHARD" not in out


def test_memory_budget_is_validated():
    assert f2.FSDP2Config(sharding_strategy="auto", memory_budget="2GiB").memory_budget == 2 * 2**30
    with pytest.raises(ValueError, match="FSDP2Config.memory_budget"):
        f2.FSDP2Config(memory_budget="lots")
    with pytest.raises(ValueError, match="auto"):
        f2.FSDP2Config(sharding_strategy="fastest")


def _auto_world(budget_fits_full_only, budget_nothing, batch_budgets=()):
    from torch.distributed.fsdp import FSDPModule

    model = f2.shard_model(gpt(8), sharding_strategy="auto", memory_budget=budget_fits_full_only, log_plan=False)
    chosen = f2.engine_state(model.blocks[0]).group.strategy
    assert isinstance(model, FSDPModule)
    error = None
    try:
        f2.shard_model(gpt(8), sharding_strategy="auto", memory_budget=budget_nothing)
    except ValueError as exc:
        error = str(exc)
    # The same budgets planned without and with an example batch (activations counted).
    by_batch = []
    for budget in batch_budgets:
        row = []
        for batch in (None, _batch()):
            try:
                sharded = f2.shard_model(
                    gpt(8), sharding_strategy="auto", memory_budget=budget, log_plan=False, example_batch=batch
                )
                row.append(f2.engine_state(sharded.blocks[0]).group.strategy)
            except ValueError as exc:
                row.append(str(exc))
        by_batch.append(row)
    return chosen, error, by_batch


def _batch():
    return torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(0))


def test_auto_picks_the_least_communication_that_fits_and_explains_when_nothing_does():
    est = {
        s: f2.estimate_memory(gpt(8), {"sharding_strategy": s}, world_size=2, device_type="cpu").peak_bytes
        for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
    }
    assert est["FULL_SHARD"] < est["SHARD_GRAD_OP"] < est["NO_SHARD"]
    budget = (est["FULL_SHARD"] + est["SHARD_GRAD_OP"]) // 2  # SHARD_GRAD_OP communicates less but does not fit
    # Budgets that SHARD_GRAD_OP fits without activations: with the example batch's activations
    # one fits FULL_SHARD only (more sharded), the other nothing at all.
    with_batch = {
        s: f2.estimate_memory(
            gpt(8), {"sharding_strategy": s}, world_size=2, example_batch=_batch(), device_type="cpu"
        ).peak_bytes
        for s in ("FULL_SHARD", "SHARD_GRAD_OP")
    }
    no_batch_sgo = f2.estimate_memory(
        gpt(8), {"sharding_strategy": "SHARD_GRAD_OP"}, world_size=2, device_type="cpu"
    ).peak_bytes
    full_only = (with_batch["FULL_SHARD"] + with_batch["SHARD_GRAD_OP"]) // 2
    too_small = (no_batch_sgo + with_batch["FULL_SHARD"]) // 2
    assert no_batch_sgo <= too_small < with_batch["FULL_SHARD"] < full_only < with_batch["SHARD_GRAD_OP"]
    chosen, error, by_batch = run_distributed(
        _auto_world, 2, budget, int(est["FULL_SHARD"] * 0.9), (full_only, too_small)
    )[0]
    assert chosen == "FULL_SHARD"
    assert error is not None and "smallest peak" in error and "ranks" in error and "memory_budget" in error
    assert by_batch[0] == ["SHARD_GRAD_OP", "FULL_SHARD"]
    assert by_batch[1][0] == "SHARD_GRAD_OP" and "smallest peak" in by_batch[1][1] and "memory_budget" in by_batch[1][1]


def test_when_whole_sequences_fit_no_setting_the_planner_proposes_context_parallelism():
    """`sharding_strategy="auto"` under a budget below every whole-sequence setting (offload and
    checkpointing included) but above FULL_SHARD with each sequence split in two: the error proposes
    context_parallel_size=2 with its peak (proposed, not chosen: the loader must know the cp groups)."""
    from helpers.models import tiny_llama

    from fsdp2_strategy.estimate import resolve_auto

    model = tiny_llama(64, max_position_embeddings=2048, attn_implementation="sdpa")
    ids = torch.zeros(4, 2048, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}
    whole = f2.compare_strategies(
        model, {"activation_checkpointing": "auto"}, world_size=4, example_batch=batch, offload=(False, True)
    )
    split = f2.estimate_memory(
        model, {"activation_checkpointing": "auto", "context_parallel_size": 2}, world_size=4, example_batch=batch
    )
    smallest = min(r.estimate.peak_bytes for r in whole.rows)
    assert split.peak_bytes < smallest, (split.peak_bytes, smallest)
    config = f2.FSDP2Config(
        sharding_strategy="auto", memory_budget=(split.peak_bytes + smallest) // 2, activation_checkpointing="auto"
    )
    with pytest.raises(
        ValueError, match=f"context_parallel_size=2 FULL_SHARD peaks at {human_bytes(split.peak_bytes)}"
    ):
        resolve_auto(model, config, 4, 1, example_batch=batch)

"""`FSDP2Config(sharding_strategy="auto", objective="throughput")`: tune, or reuse a cached
decision, and return the concrete config; and the measured `StepTimeModel` behind
`compare_strategies(time=True)`. `fsdp2_strategy.choose` calls both (it sits above the sharding
these need)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist
from torch import nn

from ..config import FSDP2Config
from ..distributed import from_rank_zero, log_rank_zero
from ..estimate import StepTimeModel
from ..mesh import mesh_device_type
from .cache import cache_key, cache_path, read_decision, write_decision
from .tuner import TIMED_STEPS, WARMUP_STEPS, tune

STEPS = {"warmup": WARMUP_STEPS, "steps": TIMED_STEPS}
"""Warm-up and timed steps per candidate when tuning for `objective="throughput"`."""


def resolve_throughput(
    model: nn.Module,
    config: FSDP2Config,
    world_size: int,
    nodes: int,
    *,
    example_batch: Any = None,
    loss_fn: Any = None,
    device_type: str | None = None,
) -> FSDP2Config:
    """`config` with the setting `tune` measured fastest (or the one cached for this model, world
    and device); the table, or the reuse, is logged on rank 0. Every rank gets rank 0's decision."""
    if example_batch is None:
        raise ValueError(
            "FSDP2Config(objective='throughput') measures training steps and needs one rank's micro-batch: pass "
            "shard_model(..., example_batch=batch). Lightning's Trainer takes it from the train dataloader, "
            "FSDP2Accelerator.prepare from a DataLoader passed in the same prepare() call; Fabric's setup sees no "
            "batch: run f2.tune(model, batch) and pass the fields of its best_config, or use objective='memory'."
        )
    if not dist.is_initialized() or dist.get_world_size() != world_size:
        raise RuntimeError(
            f"FSDP2Config(objective='throughput') tunes on the running process group, which must hold the "
            f"{world_size} ranks it plans for; initialise it first (f2.init_distributed())."
        )
    base = dataclasses.replace(config, sharding_strategy="FULL_SHARD", objective="memory", log_plan=False)
    path = cache_path()
    # The device the tuner measures on names the decision (a GPU's is not a CPU's).
    key = cache_key(model, example_batch, base, world_size, nodes, device_type or mesh_device_type(), steps=STEPS)
    entry = from_rank_zero(read_decision(path, key) if dist.get_rank() == 0 else None)
    if entry is not None:
        log_rank_zero(
            "objective='throughput': reusing %s (%.4f s/step when tuned) from %s (key %s); delete the entry to tune again.",
            entry["label"],
            entry["step_s"],
            path,
            key,
        )
        return _chosen(config, entry["changes"])
    result = tune(model, example_batch, config=base, loss_fn=loss_fn, warmup=STEPS["warmup"], steps=STEPS["steps"])
    changes = result.best.candidate.changes
    if dist.get_rank() == 0:
        entry = {"label": result.best.label, "changes": changes, "step_s": result.best.measured.expected_s}  # type: ignore[union-attr]
        write_decision(path, key, {**entry, "table": result.to_dict()})
        log_rank_zero("objective='throughput' chose %s; decision cached in %s (key %s).", result.best.label, path, key)
    dist.barrier()
    return _chosen(config, changes)


def _chosen(config: FSDP2Config, changes: dict) -> FSDP2Config:
    # The resolved config names a concrete strategy, which objective="throughput" may not accompany.
    return FSDP2Config.coerce(config, **{"sharding_strategy": "FULL_SHARD", **changes, "objective": "memory"})


def measure_time_model(
    model: nn.Module,
    config: Any,
    *,
    example_batch: Any = None,
    loss_fn: Any = None,
    optimizer: Any = "adamw",
    device_type: str | None = None,
) -> StepTimeModel:
    """The step-time model of `compare_strategies(time=True)`: the collective sweep and one
    measured candidate (the config's own setting, "FULL_SHARD" when it says "auto")."""
    base = FSDP2Config.coerce(config, log_plan=False)
    strategy = "FULL_SHARD" if base.sharding_strategy == "auto" else base.sharding_strategy
    result = tune(
        model,
        example_batch,
        config=dataclasses.replace(base, sharding_strategy=strategy, objective="memory"),
        candidates=[{"sharding_strategy": strategy}],
        optimizer=optimizer,
        loss_fn=loss_fn,
        steps=3,
        warmup=1,
    )
    assert result.time_model is not None  # the one candidate was measured, else tune raised
    return result.time_model

"""The settings the tuner measures: `Candidate` (FSDP2Config fields over a base config, and a
label) and `default_candidates`, the ones worth trying on a given world."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import FSDP2Config
from ..train import MODES, accumulation_mode

TUNABLE_FIELDS = (
    "sharding_strategy",
    "reshard_after_forward",
    "wrap_policy",
    "blocks_per_group",
    "accumulation",
    "activation_checkpointing",
    "cpu_offload",
    "forward_prefetch",
    "backward_prefetch",
    "mixed_precision",
    "mesh_shape",
    "collectives",
)
"""FSDP2Config fields a candidate may set (the rest comes from the base config)."""


@dataclass
class Candidate:
    """One setting to measure: `changes` (FSDP2Config fields) applied to the base config."""

    label: str
    """Name in the table, e.g. "FULL_SHARD/blocks"."""
    changes: dict[str, Any] = field(default_factory=dict)
    """FSDP2Config fields this setting sets (`TUNABLE_FIELDS`)."""

    def config(self, base: FSDP2Config) -> FSDP2Config:
        """The base config with this setting's fields (validated by `FSDP2Config`)."""
        return FSDP2Config.coerce(base, **self.changes, log_plan=False)


def _label(changes: Mapping[str, Any]) -> str:
    parts = [str(changes.get("sharding_strategy", "base"))]
    if "wrap_policy" in changes:
        parts.append("one group" if changes["wrap_policy"] is None else f"wrap={changes['wrap_policy']!r}")
    elif changes.get("blocks_per_group", 1) > 1:
        parts.append(f"groups of {changes['blocks_per_group']}")
    else:
        parts.append("blocks")
    for key in ("accumulation", "reshard_after_forward"):
        if key in changes:
            parts.append(f"{changes[key]}" if key == "accumulation" else f"reshard={changes[key]}")
    if changes.get("activation_checkpointing"):
        parts.append("AC")
    if changes.get("cpu_offload"):
        parts.append("offload")
    return "/".join(parts)


def coerce_candidates(values: Iterable[Any]) -> list[Candidate]:
    """Candidates from `Candidate`s or dicts of FSDP2Config fields (an optional "label" key)."""
    out = []
    for i, value in enumerate(values):
        if isinstance(value, Candidate):
            out.append(value)
            continue
        if not isinstance(value, Mapping):
            raise ValueError(
                f"tune: candidates[{i}]={value!r} is invalid; use a dict of FSDP2Config fields "
                f"({', '.join(TUNABLE_FIELDS)}; optional 'label') or a Candidate."
            )
        changes = {k: v for k, v in value.items() if k != "label"}
        unknown = sorted(set(changes) - set(TUNABLE_FIELDS))
        if unknown:
            raise ValueError(
                f"tune: candidates[{i}] sets {unknown}, which the tuner does not vary; use {', '.join(TUNABLE_FIELDS)}."
            )
        out.append(Candidate(str(value.get("label") or _label(changes)), changes))
    labels = [c.label for c in out]
    if not out or len(set(labels)) != len(labels):
        raise ValueError(f"tune: candidates must be a non-empty list with distinct labels; got {labels}.")
    return out


def middle_group_size(blocks: int) -> int | None:
    """Blocks per group between per block and one group: about the square root of `blocks` (8 -> 3,
    6 -> 2, 3 -> 2), so the calls per step and the blocks gathered at once both grow as it does;
    None below 3 blocks (nothing lies between)."""
    return min(max(2, round(math.sqrt(blocks))), blocks - 1) if blocks >= 3 else None


def default_candidates(base: FSDP2Config, nodes: int, micro_batches: int, blocks: int = 0) -> list[Candidate]:
    """Strategies (hybrid ones only on several nodes) x wrapping (the base's policy, "blocks", or
    one group for the whole model; with `blocks` >= 3 of the base's policy, FULL_SHARD also with
    `middle_group_size` blocks per group), and with several micro-batches the accumulation modes
    that communicate less than the base's. The base's offload, checkpointing, precision and
    `blocks_per_group` are kept. One group is the same under FULL_SHARD and SHARD_GRAD_OP (torch
    keeps the root gathered), so it is tried once; NO_SHARD gathers nothing, so "keep_gathered"
    is "sync_last" there."""
    strategies = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
    if nodes > 1:
        strategies[2:2] = ["HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
    changes: list[dict[str, Any]] = []
    for strategy in strategies:
        changes.append({"sharding_strategy": strategy})
        if strategy in ("FULL_SHARD", "NO_SHARD", "HYBRID_SHARD"):
            changes.append({"sharding_strategy": strategy, "wrap_policy": None})
        middle = middle_group_size(blocks)
        if strategy == "FULL_SHARD" and middle and base.blocks_per_group == 1:
            changes.append({"sharding_strategy": strategy, "blocks_per_group": middle})
    if micro_batches > 1:
        mode = accumulation_mode(base.accumulation)
        # Only the modes that can save time are tried over the base's own (`saves_time`). A mode that
        # keeps parameters gathered from the step's first forward to its last backward makes
        # SHARD_GRAD_OP repeat FULL_SHARD (same peak, same collectives), so it is tried under
        # FULL_SHARD only, also with one group.
        for other in MODES.values():
            if other is not mode and other.saves_time:
                changes.append({"sharding_strategy": "FULL_SHARD", "accumulation": other.name})
                if other.keeps_gathered:
                    changes.append({"sharding_strategy": "FULL_SHARD", "wrap_policy": None, "accumulation": other.name})
    if base.blocks_per_group > 1:  # said in the settings, so the label says "groups of N", not "blocks"
        changes = [c if "wrap_policy" in c else {**c, "blocks_per_group": base.blocks_per_group} for c in changes]
    return [Candidate(_label(c), c) for c in changes]


def with_memory_savers(candidates: list[Candidate]) -> list[Candidate]:
    """The same settings with activation checkpointing, then with CPU offload as well: tried only
    when none of `candidates` fits the budget."""
    out = []
    for extra in ({"activation_checkpointing": "auto"}, {"activation_checkpointing": "auto", "cpu_offload": True}):
        for c in candidates:
            changes = {**c.changes, **extra}
            out.append(Candidate(_label(changes), changes))
    return out

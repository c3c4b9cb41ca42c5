"""A forward-only model beside the one in training (RL's reference, distillation's teacher), as the
memory planner counts it: what `f2.shard_reference` makes of it with the same config.

Its shards stay on the device for the whole run, stored in the compute dtype (frozen: no gradient,
no optimizer state); its forward, which runs between the policy's steps, gathers one group at a time
and frees it after (every group reshards after forward). So the pair's peak is the larger of the
policy's peak plus the reference's shards, and the policy's resident state plus the reference's
shards and its largest gathered group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ..config import FSDP2Config
from ..groups import ignored_names, resolve_groups
from .sim_model import meta_copy
from .sim_sizes import group_sizes


@dataclass(frozen=True)
class ReferenceSizes:
    """Bytes per rank of a forward-only model sharded as `f2.shard_reference` does."""

    resident: int
    """Its shards (compute dtype) and buffers, on the device for the whole run."""
    gathered: int
    """Its largest group gathered, for the moment that group's forward runs."""


def reference_sizes(
    reference: nn.Module, config: FSDP2Config, mesh_of: Callable[[str], tuple[int, int]]
) -> ReferenceSizes:
    """Sizes of `reference` sharded for forward only by `config` (`mesh_of` as for `group_sizes`)."""
    config = FSDP2Config.coerce(config, reshard_after_forward=True, log_plan=False)
    sim, _ = meta_copy(reference, None, None, False)
    sim.requires_grad_(False)
    ignored = ignored_names(sim, config)
    specs = resolve_groups(sim, config, ignored)
    sizes = group_sizes(sim, specs, ignored, config.frozen_dtype, mesh_of, config.quantised_weights)
    resident = sum(g.sharded + g.replicated + g.quantised_whole + g.buffers for g in sizes.values())
    return ReferenceSizes(resident=resident, gathered=max((g.gathered for g in sizes.values()), default=0))

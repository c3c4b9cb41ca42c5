"""The sharding strategies (FSDP1's names) and what each means for FSDP2: the one table of them.

| strategy            | mesh                     | reshard_after_forward | layout     |
|---------------------|--------------------------|-----------------------|------------|
| FULL_SHARD          | (world,)                 | True (root: False)    | shard      |
| SHARD_GRAD_OP       | (world,)                 | False                 | shard      |
| HYBRID_SHARD        | (replicate, shard)       | True (root: False)    | hybrid     |
| HYBRID_SHARD_ZERO2  | (replicate, shard)       | False                 | hybrid     |
| NO_SHARD            | (world, 1)               | False                 | replicate  |

NO_SHARD is HSDP with shards of size one: every rank keeps full parameters and gradients are
all-reduced, which is what DDP does, with the same hooks and checkpoint format as the rest.
Config validation, mesh building and both adapters read these facts from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Layout = Literal["shard", "hybrid", "replicate"]


@dataclass(frozen=True)
class Strategy:
    """What one strategy name means."""

    name: str
    """FSDP1's name (also torch's `ShardingStrategy` member name)."""
    layout: Layout
    """"shard": a 1-D mesh over every rank; "hybrid": (replicate across nodes, shard within one);
    "replicate": (world, 1), nothing sharded."""
    reshard_after_forward: bool | None
    """The default `reshard_after_forward`; None lets torch free after forward except for the root."""

    @property
    def two_dim(self) -> bool:
        """Whether its mesh has a replicate dim (hybrid and replicate layouts)."""
        return self.layout != "shard"


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("FULL_SHARD", "shard", None),
        Strategy("SHARD_GRAD_OP", "shard", False),
        Strategy("HYBRID_SHARD", "hybrid", None),
        Strategy("HYBRID_SHARD_ZERO2", "hybrid", False),
        Strategy("NO_SHARD", "replicate", False),
    )
}
NAMES = tuple(STRATEGIES)
"""Accepted names for `FSDP2Config.sharding_strategy`."""


def strategy(name: str) -> Strategy:
    """The facts of a validated strategy name (KeyError for an unknown one)."""
    return STRATEGIES[name]


def reshards_after_forward(name: str) -> bool:
    """Whether non-root groups free their gathered parameters after forward by default."""
    return STRATEGIES[name].reshard_after_forward is not False

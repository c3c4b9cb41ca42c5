"""`ModelParallelStrategy`'s constructor arguments, read once for both Lightning adapters.

The Trainer's `FSDP2Strategy` and Fabric's `FSDP2FabricStrategy` subclass Lightning's
`ModelParallelStrategy` and take its `data_parallel_size`, `tensor_parallel_size` and
`save_distributed_checkpoint` with their meaning. What differs on purpose: `tensor_parallel_size`
defaults to 1 (FSDP over every device, what "fsdp2" promises) where `ModelParallelStrategy`'s
default "auto" puts the devices of a node in one TP group; "auto" keeps that meaning when asked for,
and `data_parallel_size="auto"` means every rank outside tensor parallelism (its "auto", the node
count, shards nothing on one node).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import fsdp2_strategy as f2

from .config import parallel_sizes

__all__ = ["ModelParallelArgs", "model_parallel_args"]


@dataclass(frozen=True)
class ModelParallelArgs:
    """`ModelParallelStrategy`'s sizes as given, checked.

    Attributes:
        data_parallel_size: "auto" or the ranks of the "data_parallel" mesh dim.
        auto_tensor_parallel: `tensor_parallel_size="auto"` was given: the devices of one node,
            known once launched (`FSDP2Config.tensor_parallel_size` is an int).
    """

    data_parallel_size: Any
    auto_tensor_parallel: bool

    def resolve(
        self, owner: str, config: f2.FSDP2Config, num_nodes: int, num_processes: int
    ) -> tuple[f2.FSDP2Config, int, int]:
        """Once launched: the config with "auto" TP made the devices of a node, and the
        ("data_parallel", "tensor_parallel") mesh sizes (see `parallel_sizes`; ValueError naming the
        sizes that do not fit the world)."""
        if self.auto_tensor_parallel:
            config = dataclasses.replace(config, tensor_parallel_size=num_processes)
        dp, tp = parallel_sizes(owner, config, self.data_parallel_size, num_nodes, num_processes)
        return config, dp, tp


def model_parallel_args(owner: str, fields: dict[str, Any], data_parallel_size: Any) -> ModelParallelArgs:
    """Check `data_parallel_size` and take `tensor_parallel_size="auto"` out of the config `fields`
    (in place: the rest are `FSDP2Config` fields).

    Raises:
        ValueError: `data_parallel_size` is neither "auto" nor an int >= 1.
    """
    auto_tp = isinstance(fields.get("tensor_parallel_size"), str) and fields["tensor_parallel_size"] == "auto"
    if auto_tp:
        del fields["tensor_parallel_size"]
    if data_parallel_size != "auto" and (
        isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) or data_parallel_size < 1
    ):
        raise ValueError(f"{owner}.data_parallel_size={data_parallel_size!r} is invalid; use 'auto' or an int >= 1.")
    return ModelParallelArgs(data_parallel_size, auto_tp)

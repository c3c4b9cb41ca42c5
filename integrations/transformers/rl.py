"""TRL's reinforcement-learning trainers on the engine: generation without a gather per token, and a
reference model sharded for forward only.

TRL asks two things of the distributed backend that FSDP2 does badly by default:

- Generation (`GRPOTrainer`, `RLOOTrainer`, distillation) runs `generate` inside
  `DistributedBackend.summon_full_params(model)`, a no-op for FSDP2: every decoding step then
  all-gathers every group again. `GatheringBackend` makes that context `f2.gathered(model)`: the groups
  are gathered once and kept for the whole `generate`, then resharded.
- A reference or teacher model (`ref_model`) is sharded by TRL's `prepare_fsdp` with one `fully_shard`
  on the root: the whole model is one group, gathered whole at every forward. `shard_reference`
  shards it as `f2.shard_reference` does (the policy's groups, frozen, in the compute dtype, every
  group resharded after forward); TRL's `prepare_fsdp` then leaves the already sharded model alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

import fsdp2_strategy as f2


class GatheringBackend:
    """TRL's `DistributedBackend` with `summon_full_params` as `f2.gathered` (the rest delegated)."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    @contextlib.contextmanager
    def summon_full_params(self, module: nn.Module, **kwargs: Any) -> Iterator[None]:
        """Every FSDP group of `module` gathered once for the whole block (TRL wraps `generate` in it)."""
        with f2.gathered(module):
            yield


def shard_reference(model: Any, config: f2.FSDP2Config, mesh: Any = None) -> Any:
    """`model` sharded for forward only by `config`'s policy (on `mesh`, the policy's), unless it is
    not a module or is sharded already (then as it is, for TRL to handle)."""
    if not isinstance(model, nn.Module) or any(isinstance(m, FSDPModule) for m in model.modules()):
        return model
    return f2.shard_reference(model, config, mesh=mesh)

"""Free every gathered group, so that each managed parameter is its DTensor shard again.

FSDP2 reshards a group after its backward, and after its forward unless `reshard_after_forward`
is False, which it is for the root (its parameters are needed again at once by the backward).
After forward-only passes (validation, testing, prediction) no backward comes, so the root, and
every group with `reshard_after_forward=False`, stays gathered: `model.parameters()` then mixes
plain full tensors with DTensor shards, holds the gathered memory, and code that inspects or
compares parameters sees the mix. The adapters call `reshard` at the end of fit / validate / test /
predict and before a checkpoint is taken from outside a step; the core's `Checkpointer.save` too.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule


def reshard(*models: nn.Module) -> None:
    """Reshard every FSDP group of `models`, freeing their gathered parameters.

    A no-op for groups already sharded and for modules without FSDP. Call it between optimizer
    steps, not inside an accumulation window.

    Args:
        *models: The sharded models (or any modules holding FSDP groups).
    """
    for model in models:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

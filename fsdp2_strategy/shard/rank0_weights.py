"""Shard a model whose real weights exist on rank 0 only (CPU-RAM-efficient loading).

Loading a pretrained model on every rank costs N full copies of host memory. Hugging Face
`from_pretrained` can load it on rank 0 only and build it on the meta device elsewhere
(Accelerate's `fsdp_cpu_ram_efficient_loading`). `shard_with_rank0_weights` shards such a
model and then broadcasts rank 0's values into every rank's shards, one tensor at a time.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from ..distributed import is_distributed, log_rank_zero, rank
from ..mesh import collective_device
from .materialize import has_meta_tensors, move_to_meta
from .sharding import shard_model


def shard_with_rank0_weights(model: nn.Module, config: Any = None, **overrides: Any) -> nn.Module:
    """`shard_model`, then every parameter and buffer set to rank 0's value. Collective.

    Other ranks may hold the model on the meta device or with any initial values. If any
    rank's model is on the meta device, every rank shards from the meta device (so the
    materialisation runs alike everywhere; rank 0 keeps its values aside on CPU first).
    """
    if not is_distributed():
        return shard_model(model, config, **overrides)
    is_zero = rank() == 0
    meta = has_meta_tensors(model)
    # [ranks with a meta model, whether rank 0 is one of them]: every rank decides alike.
    flags = torch.tensor([int(meta), int(meta and is_zero)], device=collective_device())
    dist.all_reduce(flags)
    if flags[1].item():
        raise ValueError(
            "Rank 0 holds the model on the meta device, but its real weights are what gets broadcast: load the "
            "pretrained weights on rank 0 (other ranks may use the meta device), or shard it with shard_model "
            "(each rank then initialises its own weights)."
        )
    # Rank 0's values, kept aside before sharding replaces its parameters.
    params = {n: t.detach().cpu() for n, t in model.state_dict().items()} if is_zero else {}
    buffers = {n: b.detach().cpu() for n, b in model.named_buffers()} if is_zero else {}
    if flags[0].item() and not meta:
        move_to_meta(model)
    shard_model(model, config, **overrides)
    set_model_state_dict(model, params, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # Buffers are not sharded, and non-persistent ones are not in the state dict: sent as they are.
    for name, buf in model.named_buffers():
        if is_zero:
            buf.copy_(buffers[name].to(buf.device))
        dist.broadcast(buf, src=0)
    log_rank_zero("Broadcast rank 0's weights into the shards (%d tensors)", len(params) if is_zero else 0)
    return model

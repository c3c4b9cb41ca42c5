"""Quantised parameters (bitsandbytes `Params4bit`, `Int8Params`): kept whole and frozen, never sharded.

A 4-bit or 8-bit weight is packed integer data plus a quantisation state (absmax, code map,
original shape) that lives on the parameter object. `fully_shard` would flatten and split the
packed bytes into DTensor shards and lose that state: the layer would compute with garbage. So
`shard_model` leaves quantised parameters out of FSDP: each rank keeps them whole, as loaded, and
they must be frozen (QLoRA trains adapters beside a frozen quantised base; the adapters and every
other parameter are sharded as usual). They are found by their bitsandbytes class name, so the
core does not import bitsandbytes. What cannot work is refused, naming the parameter and the fix:
a bitsandbytes parameter not quantised yet (bitsandbytes quantises when the model is moved to
its device; until then it is a float tensor FSDP would shard), or one on another device than the
mesh's. (Packed integer data cannot require grad, so a quantised weight is frozen by construction.)
"""

from __future__ import annotations

import torch
from torch import nn

QUANTISED_TYPES = ("Params4bit", "Int8Params")
"""bitsandbytes parameter classes (`bitsandbytes.nn.Params4bit`, `Int8Params`), by name."""

QUANTISED_REASON = "quantised (bitsandbytes): kept whole and frozen on every rank"
"""The sharding plan's note for these parameters."""


def _is_bitsandbytes(param: nn.Parameter) -> bool:
    return type(param).__name__ in QUANTISED_TYPES


def quantised_param_names(model: nn.Module) -> set[str]:
    """Qualified names of the model's bitsandbytes parameters (the quantised ones `shard_model` kept)."""
    return {n for n, p in model.named_parameters() if _is_bitsandbytes(p)}


def find_quantised_params(model: nn.Module, exclude: set[int], device: torch.device) -> dict[str, nn.Parameter]:
    """The quantised parameters of `model` by qualified name (ids in `exclude` skipped: ignored
    modules), checked; raises ValueError listing every bitsandbytes parameter that cannot be kept."""
    found = {n: p for n, p in model.named_parameters() if _is_bitsandbytes(p) and id(p) not in exclude}
    problems = []
    for name, p in found.items():
        kind = f"{name} ({type(p).__name__}, {p.dtype}, {p.device})"
        if p.is_floating_point():
            problems.append(
                f"{kind} is not quantised yet: bitsandbytes quantises when the model is moved to its device; "
                "call model.to(device) before sharding"
            )
        elif p.device.type != device.type:
            problems.append(f"{kind} is not on the mesh's device {device}: move the quantised model there first")
    if problems:
        raise ValueError(
            "shard_model keeps bitsandbytes-quantised parameters whole (they cannot be split into shards), "
            "but cannot keep these:\n  " + "\n  ".join(problems)
        )
    return found

"""A QLoRA model that never exists whole: built on the meta device, sharded, then quantised on load.

`from_pretrained(..., quantization_config=...)` on every rank holds the whole quantised model in
every process before `shard_model` splits it (about 35 GB per process for a 70B base). Instead:

1. build the model on the meta device and give it bitsandbytes 4-bit layers (`to_4bit`): their
   `Params4bit` are meta tensors, not quantised yet;
2. `shard_model` shards each as the packed bytes it will hold (a meta uint8 column, half a byte per
   weight), and marks the layer with its 4-bit format (`engine_state(layer).pending_4bit`);
3. `load_full_weights(model, pretrained)` reads each such weight in full precision, one tensor at a
   time, quantises it with bitsandbytes (`quantise_pending`) and keeps this rank's bytes and the
   whole quantisation state: each rank's peak is its shards plus one weight in full precision.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..train import engine_state, recorded_state


@dataclass(frozen=True)
class FourBitFormat:
    """How a pending 4-bit weight is quantised when its values arrive (bitsandbytes' settings)."""

    quant_type: str
    blocksize: int
    double_quant: bool
    """bitsandbytes' `compress_statistics` (`bnb_4bit_use_double_quant`)."""
    shape: tuple[int, ...]
    """The full-precision weight's shape (what the pretrained checkpoint holds)."""


def to_4bit(
    model: nn.Module,
    *,
    skip: Sequence[str] = ("lm_head",),
    compute_dtype: torch.dtype | None = torch.bfloat16,
    quant_type: str = "nf4",
    double_quant: bool = True,
    blocksize: int = 64,
) -> nn.Module:
    """Replace every `nn.Linear` of `model` by a bitsandbytes `Linear4bit` holding the same weight,
    not quantised yet (QLoRA's base), as transformers' `BitsAndBytesConfig(load_in_4bit=True)` does.

    On the meta device this is the first step of loading a QLoRA model without the whole base in
    any process (module docstring); on a real device bitsandbytes quantises when the model is moved
    (`model.to(device)`). The replaced layers' weights are frozen; biases are kept (frozen).

    Args:
        model: The model, usually on the meta device (`with torch.device("meta"): ...`).
        skip: Globs on qualified module names (or their last part) left in full precision; the
            output head by default, as transformers does.
        compute_dtype: The dtype the 4-bit layers compute in (`bnb_4bit_compute_dtype`).
        quant_type: "nf4" (QLoRA's) or "fp4".
        double_quant: Quantise the absmax too (`bnb_4bit_use_double_quant`): ~1 byte of state per
            64 weights instead of 4.
        blocksize: Weights per absmax block.

    Returns:
        `model`, changed in place.

    Raises:
        ImportError: bitsandbytes is not installed.
    """
    import bitsandbytes as bnb  # only 4-bit models come here

    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            qualified = f"{parent_name}.{name}" if parent_name else name
            if type(child) is not nn.Linear or any(fnmatch.fnmatch(qualified, g) or name == g for g in skip):
                continue
            layer = bnb.nn.Linear4bit(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                compute_dtype=compute_dtype,
                compress_statistics=double_quant,
                quant_type=quant_type,
                device=child.weight.device,
            )
            layer.weight = bnb.nn.Params4bit(
                child.weight.data,
                requires_grad=False,
                blocksize=blocksize,
                compress_statistics=double_quant,
                quant_type=quant_type,
                module=layer,
            )
            if child.bias is not None:
                layer.bias = nn.Parameter(child.bias.data, requires_grad=False)
            setattr(parent, name, layer)
    return model


def is_pending(param: Any) -> bool:
    """A `Params4bit` on the meta device, not quantised yet: `load_full_weights` will quantise it."""
    return type(param).__name__ == "Params4bit" and param.is_meta and not getattr(param, "bnb_quantized", False)


def pending_format(param: Any) -> FourBitFormat:
    """The 4-bit format of a pending `Params4bit` (its bitsandbytes settings and full shape)."""
    return FourBitFormat(
        quant_type=param.quant_type,
        blocksize=param.blocksize,
        double_quant=param.compress_statistics,
        shape=tuple(param.shape),
    )


def pending_4bit(layer: nn.Module) -> FourBitFormat | None:
    """The format a sharded 4-bit layer's weight waits to be quantised in, if it has no values yet."""
    state = recorded_state(layer)
    return state.pending_4bit if state is not None else None


@torch.no_grad()
def quantise_pending(layer: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """Quantise the full-precision `weight` of a pending 4-bit `layer` as bitsandbytes does; the layer
    keeps the quantisation state (whole). Returns the packed bytes as the column FSDP shards (in
    the dtype `shard_model` stores them in: the layer's `quant_storage`).

    Raises:
        ValueError: `layer` holds no pending 4-bit weight, or `weight` has another shape.
    """
    from bitsandbytes.functional import quantize_4bit

    spec = pending_4bit(layer)
    if spec is None:
        raise ValueError(f"{type(layer).__name__} holds no 4-bit weight waiting for its values")
    if tuple(weight.shape) != spec.shape:
        raise ValueError(f"the 4-bit weight's values have shape {tuple(weight.shape)}, the layer wants {spec.shape}")
    packed_param: Any = layer.weight
    device = packed_param.device
    packed, state = quantize_4bit(
        weight.to(device).contiguous(),
        blocksize=spec.blocksize,
        compress_statistics=spec.double_quant,
        quant_type=spec.quant_type,
        quant_storage=torch.uint8,
    )
    setattr(layer, "quant_state", state)  # noqa: B010  # what bitsandbytes' forward rebuilds from
    engine_state(layer).pending_4bit = None
    return packed.reshape(-1).view(getattr(layer, "quant_storage", torch.uint8)).reshape(-1, 1)

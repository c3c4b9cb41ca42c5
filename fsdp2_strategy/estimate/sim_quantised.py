"""What a bitsandbytes-quantised layer costs the estimator, and the dense layer it computes like.

A 4-bit weight (`Params4bit`) is packed data (half a byte per weight, stored in
`bnb_4bit_quant_storage`) plus its quantisation state (one absmax per block of 64 weights: fp32, or
uint8 with a nested fp32 absmax per 256 blocks under double quantisation; a 16-entry code map).
`shard_model` shards the packed data as bytes (`FSDP2Config.quantised_weights="shard"`) and keeps
the state whole on every rank; it has no gradient and no optimizer state. A `Params4bit` not
quantised yet (a meta-device model built with transformers' `replace_with_bnb_linear`, for planning
a model never downloaded) is counted as it will be once quantised. An 8-bit weight (`Int8Params`:
one byte per weight and an fp32 scale per row) is kept whole.

On the meta device the layers compute as the dense `nn.Linear`/`nn.Embedding` they stand for: the
same outputs and saved activations (bitsandbytes saves the packed weight, not a new activation).
Found by class name: the core does not import bitsandbytes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

_NF4_CODES = 16
"""Entries of a 4-bit code map (fp32)."""
_NESTED_BLOCK = 256
"""Blocks of absmax per nested absmax under double quantisation (bitsandbytes' default)."""


def quantised_kind(param: torch.Tensor) -> str | None:
    """ "4bit" for a `Params4bit`, "8bit" for an `Int8Params`, else None."""
    return {"Params4bit": "4bit", "Int8Params": "8bit"}.get(type(param).__name__)


def dense_shape(param: Any) -> tuple[int, ...]:
    """The shape of the float weight a bitsandbytes parameter stands for."""
    state = getattr(param, "quant_state", None)
    if quantised_kind(param) == "4bit" and getattr(param, "bnb_quantized", False) and state is not None:
        return tuple(state.shape)
    return tuple(param.shape)


def quantised_bytes(param: Any) -> tuple[int, int]:
    """(packed data bytes, quantisation state bytes) of a bitsandbytes parameter."""
    if quantised_kind(param) == "8bit":
        return param.numel(), (param.shape[0] * 4 if param.ndim else 0)
    state = getattr(param, "quant_state", None)
    if getattr(param, "bnb_quantized", False) and state is not None:
        return param.numel() * param.element_size(), _state_bytes(state)
    numel = param.numel()
    item = torch.empty((), dtype=getattr(param, "quant_storage", torch.uint8), device="meta").element_size()
    packed = math.ceil(math.ceil(numel / 2) / item) * item
    blocks = math.ceil(numel / getattr(param, "blocksize", 64))
    if getattr(param, "compress_statistics", False):
        absmax = blocks + math.ceil(blocks / _NESTED_BLOCK) * 4 + _NESTED_BLOCK * 4 + 4  # + nested codes, offset
    else:
        absmax = blocks * 4
    return packed, absmax + _NF4_CODES * 4


def _state_bytes(state: Any) -> int:
    tensors = [state.absmax, state.code]
    nested = getattr(state, "state2", None) if getattr(state, "nested", False) else None
    if nested is not None:
        tensors += [nested.absmax, nested.code]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def compute_as_dense(sim: nn.Module) -> None:
    """Make every bitsandbytes layer of the meta copy `sim` run the dense layer's forward."""
    for module in sim.modules():
        weight = module._parameters.get("weight")
        if weight is None or not getattr(weight, "_f2_dense_stand_in", False):
            continue
        # An instance attribute: the copy's class stays bitsandbytes', whose forward needs its kernels.
        dense = nn.Embedding.forward if isinstance(module, nn.Embedding) else nn.Linear.forward
        module.forward = dense.__get__(module)


def dense_stand_in(param: Any, dtype: torch.dtype | None) -> nn.Parameter:
    """A frozen meta parameter of the dense weight's shape in `dtype` (None: the layer's float dtype)."""
    state = getattr(param, "quant_state", None)
    dtype = dtype or getattr(state, "dtype", None) or torch.float32
    stand_in = nn.Parameter(torch.empty(dense_shape(param), dtype=dtype, device="meta"), requires_grad=False)
    stand_in._f2_dense_stand_in = True  # type: ignore[attr-defined]
    return stand_in

"""Quantised parameters (bitsandbytes `Params4bit`, `Int8Params`): 4-bit weights sharded as packed
bytes, or kept whole on every rank (`FSDP2Config.quantised_weights`).

A 4-bit weight is packed data (two 4-bit codes per byte, stored in `bnb_4bit_quant_storage`:
uint8, or bf16/fp32 words holding the same bytes) plus a quantisation state (absmax per block,
nested absmax, code map, original shape). Under "shard" (the default) `shard_model` sees the
packed data as what it is, bytes: each weight becomes a frozen uint8 column `(nbytes, 1)` that
FSDP shards like any frozen parameter (1/N of the bytes per rank, never cast by mixed precision
or `frozen_dtype`, all-gathered as bytes). On torch 2.11-2.12, whose `fully_shard` cannot shard
an integer parameter, the same bytes are stored as words of the owning group's compute dtype
(`packed_storage`): mixed precision leaves a parameter already in its dtype as it is. The
quantisation state stays on the layer, whole on every rank: it is small (4 bytes of absmax per 64 weights, or ~1 byte with nested
quantisation, against 32 bytes of packed data), and bitsandbytes' `Linear4bit`/`Embedding4bit`
already rebuild their `Params4bit` from the layer's `quant_state` when they find a plain
parameter (`fix_4bit_weight_quant_state_from_module`, the recovery bitsandbytes keeps for FSDP),
so the forward dequantises the gathered bytes exactly as the unsharded layer does.

Under "replicate" (and for 8-bit weights, which cannot be sharded: see `find_quantised_params`)
quantised parameters are left out of FSDP and kept whole on every rank, frozen. They are found by
their bitsandbytes class name, so the core does not import bitsandbytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import _torch_compat as tc
from ..train import engine_state, recorded_state
from .quantise_on_load import is_pending, pending_format

QUANTISED_TYPES = ("Params4bit", "Int8Params")
"""bitsandbytes parameter classes (`bitsandbytes.nn.Params4bit`, `Int8Params`), by name."""

QUANTISED_REASON = "quantised (bitsandbytes): kept whole and frozen on every rank"
"""The sharding plan's note for quantised parameters kept whole."""

_PACKED_OWNERS = ("Linear4bit", "Embedding4bit")
"""bitsandbytes layers that rebuild their `Params4bit` from the layer's `quant_state` when FSDP
hands them a plain parameter (their forward calls `fix_4bit_weight_quant_state_from_module`)."""

_SHARD_FIX = "set FSDP2Config(quantised_weights='replicate') to keep quantised weights whole on every rank"


@dataclass(frozen=True)
class QuantisedParams:
    """The quantised parameters of a model, by qualified name, as `shard_model` will treat them."""

    sharded: tuple[str, ...]
    """4-bit weights sharded as packed bytes (`quantised_weights="shard"`)."""
    kept: tuple[str, ...]
    """Weights left out of FSDP and kept whole on every rank (`quantised_weights="replicate"`)."""


def _is_bitsandbytes(param: nn.Parameter) -> bool:
    return type(param).__name__ in QUANTISED_TYPES


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_name, _, attr = name.rpartition(".")
    return model.get_submodule(module_name), attr


def _is_quantised_yet(param: nn.Parameter) -> bool:
    if type(param).__name__ == "Params4bit":
        # The packed data may be stored in a floating dtype (bnb_4bit_quant_storage): ask the flag.
        return bool(getattr(param, "bnb_quantized", False))
    return not param.is_floating_point()  # Int8Params: int8 once quantised


def quantised_param_names(model: nn.Module) -> set[str]:
    """Qualified names of the model's quantised weights: bitsandbytes parameters kept whole, and
    4-bit weights `shard_model` sharded as packed bytes (DTensors now, known by their layer)."""
    names = {n for n, p in model.named_parameters() if _is_bitsandbytes(p)}
    for module_name, module in model.named_modules():
        state = recorded_state(module)
        if state is not None and state.packed_4bit:
            names.add(f"{module_name}.weight" if module_name else "weight")
    return names


def find_quantised_params(
    model: nn.Module, exclude: set[int], device: torch.device, mode: str = "shard"
) -> QuantisedParams:
    """The quantised parameters of `model` (ids in `exclude` skipped: ignored modules), checked.

    Args:
        model: The model about to be sharded.
        exclude: `id`s of parameters FSDP leaves alone anyway.
        device: The mesh's device.
        mode: `FSDP2Config.quantised_weights`.

    Returns:
        Which are sharded as packed bytes and which are kept whole.

    Raises:
        ValueError: Listing every quantised parameter that cannot be treated so, with the fix.
    """
    found = {n: p for n, p in model.named_parameters() if _is_bitsandbytes(p) and id(p) not in exclude}
    problems, sharded = [], []
    for name, p in found.items():
        kind = f"{name} ({type(p).__name__}, {p.dtype}, {p.device})"
        pending = mode == "shard" and is_pending(p)  # a meta model: load_full_weights quantises it
        if not pending and not _is_quantised_yet(p):
            problems.append(
                f"{kind} is not quantised yet: bitsandbytes quantises when the model is moved to its device; "
                "call model.to(device) before sharding (or build it on the meta device and fill it with "
                "f2.load_full_weights, which quantises each rank's shards)"
            )
        elif not pending and p.device.type != device.type:
            problems.append(f"{kind} is not on the mesh's device {device}: move the quantised model there first")
        elif mode == "shard":
            problem = _why_not_shardable(model, name, p)
            if problem:
                problems.append(f"{kind} {problem}; {_SHARD_FIX}")
            else:
                sharded.append(name)
    if problems:
        raise ValueError(
            "shard_model cannot handle these bitsandbytes-quantised parameters:\n  " + "\n  ".join(problems)
        )
    return QuantisedParams(sharded=tuple(sharded), kept=tuple(n for n in found if n not in sharded))


def _why_not_shardable(model: nn.Module, name: str, param: nn.Parameter) -> str | None:
    if type(param).__name__ == "Int8Params":
        return (
            "is 8-bit: LLM.int8's row scales (SCB) and outlier state are built from the whole weight by the "
            "layer's first forward and live in the layer, so its rows cannot be split; load the model in 4-bit "
            "(BitsAndBytesConfig(load_in_4bit=True)) to shard it, or"
        )
    owner, attr = _owner(model, name)
    classes = {c.__name__ for c in type(owner).__mro__}
    if attr != "weight" or not classes & set(_PACKED_OWNERS):
        return (
            f"belongs to {type(owner).__name__}.{attr}, not the weight of a bitsandbytes "
            f"{' or '.join(_PACKED_OWNERS)}, which alone can rebuild a sharded 4-bit weight in forward"
        )
    if getattr(param, "quant_state", None) is None and not is_pending(param):
        return "has no quant_state"
    return None


def packed_storage(compute: torch.dtype | None) -> torch.dtype:
    """The dtype `shard_model` stores a 4-bit weight's packed bytes in, for a group computing in `compute`.

    uint8 where `fully_shard` shards integer parameters (torch >= 2.13). Before, the bytes are
    stored as words of the group's compute dtype (bf16 without mixed precision), the storage of
    the FSDP-QLoRA recipe (`bnb_4bit_quant_storage`): FSDP's mixed precision casts a parameter
    only when its dtype differs from the compute dtype, so the words travel unchanged.
    """
    if tc.FSDP_SHARDS_INTEGER_PARAMS:
        return torch.uint8
    return compute if compute is not None and compute.is_floating_point else torch.bfloat16


def pack_for_sharding(model: nn.Module, storage: dict[str, torch.dtype]) -> None:
    """Turn each named `Params4bit` into a frozen column of its packed bytes, ready for FSDP.

    The layer keeps the quantisation state (`quant_state`) and learns the dtype its weight is now
    stored in, so bitsandbytes rebuilds the `Params4bit` in forward from the gathered bytes; the
    engine marks the layer (`engine_state(layer).packed_4bit`).

    Args:
        model: The model about to be sharded.
        storage: The 4-bit weights to shard, by qualified name, with the dtype to store their
            bytes in (`packed_storage`).

    Raises:
        ValueError: A weight's packed bytes do not fill whole words of its storage dtype.
    """
    for name, dtype in storage.items():
        layer, attr = _owner(model, name)
        param: Any = layer.get_parameter(attr)  # a Params4bit
        nbytes = (param.numel() + 1) // 2 if is_pending(param) else param.nbytes
        words, rest = divmod(nbytes, dtype.itemsize)
        if rest:
            raise ValueError(
                f"{name}: its {nbytes} packed bytes do not fill whole {dtype} words, the storage torch "
                f"{torch.__version__}'s fully_shard needs (it cannot shard uint8 before 2.13); "
                f"use torch >= 2.13, or {_SHARD_FIX}"
            )
        # bitsandbytes' forward rebuilds its Params4bit from these two (fix_4bit_weight_quant_state_from_module).
        setattr(layer, "quant_state", param.quant_state)  # noqa: B010  # None while pending
        setattr(layer, "quant_storage", dtype)  # noqa: B010  # what the gathered bytes are
        if hasattr(layer, "support_avx512bf16_for_cpu"):
            # bitsandbytes' CPU inference kernel repacks the weight and rewrites `quant_state` in place
            # on the first eval forward; the next gather brings the original bytes back, which the
            # rewritten state would misread. The portable dequantising path computes the same product.
            setattr(layer, "support_avx512bf16_for_cpu", False)  # noqa: B010
        state = engine_state(layer)
        state.packed_4bit = True
        if is_pending(param):  # no values yet: the bytes it will hold, half a byte per weight
            state.pending_4bit = pending_format(param)
            packed = torch.empty(words, 1, dtype=dtype, device="meta")
        else:
            packed = as_packed_bytes(param).reshape(-1).view(dtype).reshape(-1, 1)
        setattr(layer, attr, nn.Parameter(packed, requires_grad=False))


def as_packed_bytes(param: torch.Tensor) -> torch.Tensor:
    """A bitsandbytes 4-bit parameter kept whole seen as the uint8 column `shard_model` shards it as
    (any storage dtype: the same bytes), so both modes describe a base alike; others unchanged."""
    if type(param).__name__ == "Params4bit":
        return param.data.contiguous().view(torch.uint8).reshape(-1, 1)
    return param


def is_packed_4bit(layer: nn.Module) -> bool:
    """Whether `layer` is a 4-bit layer whose weight `pack_for_sharding` turned into sharded bytes."""
    state = recorded_state(layer)
    return state is not None and state.packed_4bit


def packed_weight_count(layer: nn.Module, param: nn.Parameter) -> int | None:
    """How many weights a 4-bit parameter of `layer` holds (its elements are packed codes), else None."""
    if type(param).__name__ == "Params4bit":
        state = getattr(param, "quant_state", None)
    elif param is getattr(layer, "weight", None) and is_packed_4bit(layer):
        state = getattr(layer, "quant_state", None)
    else:
        return None
    return math.prod(state.shape) if state is not None else None


def four_bit_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's 4-bit layers by qualified name: weights sharded as bytes, or `Params4bit` kept whole."""
    return {
        name: module
        for name, module in model.named_modules()
        if is_packed_4bit(module) or type(getattr(module, "weight", None)).__name__ == "Params4bit"
    }


def dequantised(layer: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """The floating-point weight of a 4-bit `layer`, in the dtype it was quantised from, from its
    whole packed weight `weight` (the gathered bytes of a sharded one, or a kept `Params4bit`'s data).

    Raises:
        ImportError: bitsandbytes is not installed (it holds the dequantising kernels).
    """
    from bitsandbytes.functional import dequantize_4bit  # only 4-bit models come here

    owner: Any = layer if is_packed_4bit(layer) else layer.weight
    state = owner.quant_state
    packed = weight.detach().contiguous().view(torch.uint8).reshape(-1, 1)  # the same bytes in any storage
    return dequantize_4bit(packed.to(state.absmax.device), state).to(weight.device)

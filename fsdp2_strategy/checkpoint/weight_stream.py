"""Full weights out of a live sharded model, one tensor at a time: `full_weights` (the stream an
inference engine loads) and `save_merged` (the same stream written as Hugging Face safetensors).

A PEFT model's weights come merged, each LoRA delta added to its base weight as the layer is
reached; a bitsandbytes 4-bit weight comes dequantised. Every rank iterates in step (each item is a
collective); with `rank0_only` the whole tensors land on rank 0 only, gathered there (the other
ranks send their shards and receive nothing), as an engine living beside rank 0 wants.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ..distributed import barrier, logger, rank
from ..shard import dequantised, four_bit_layers
from .hf_files import DEFAULT_MAX_SHARD_BYTES, ShardWriter
from .peft import check_mergeable, find_peft_model, lora_delta, lora_layers, merged_name, peft_models


def whole(t: torch.Tensor, device: torch.device | str | None = None, dst: int | None = None) -> torch.Tensor | None:
    """Collective for a DTensor: the whole tensor on every rank (`dst` None) or on global rank `dst`
    only (None elsewhere), on `device` (None: where it is)."""
    t = t.detach()
    if dst is not None and isinstance(t, DTensor) and t.device_mesh.ndim == 1 and t.placements == (Shard(0),):
        full = _gather_rows(t, dst)
    else:
        full = t.full_tensor() if isinstance(t, DTensor) else t
        full = full if dst is None or rank() == dst else None
    return full if full is None or device is None else full.to(device)


def _gather_rows(t: DTensor, dst: int) -> torch.Tensor | None:
    """A dim-0-sharded DTensor gathered on `dst` alone: each rank's rows padded to FSDP's chunk size
    (ceil(rows / N); the last ranks may hold fewer or none), one `gather`, the padding cut."""
    mesh = t.device_mesh
    chunk = -(-t.shape[0] // mesh.size())
    local = t.to_local()
    padded = local.new_zeros((chunk, *t.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(mesh.size())] if rank() == dst else None
    dist.gather(padded, parts, dst=dst, group=mesh.get_group())
    return torch.cat(parts)[: t.shape[0]] if parts is not None else None


def _weights(model: nn.Module, device: Any, dst: int | None) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Collective: `model.state_dict()`'s entries whole, one at a time; a bitsandbytes 4-bit weight
    dequantised (in the dtype it was quantised from), its quantisation-state entries dropped."""
    quantised = four_bit_layers(model)
    for key, value in model.state_dict().items():
        owner, _, leaf = key.rpartition(".")
        if any(key.startswith(f"{name}.weight.") for name in quantised):
            continue  # absmax, quant_map, ...: part of the 4-bit weight, not a weight of the float model
        tensor = whole(value, device, dst)
        if tensor is not None and leaf == "weight" and owner in quantised:
            tensor = dequantised(quantised[owner], tensor)
        yield key, tensor


def full_weights(
    model: nn.Module,
    *,
    adapter_name: str = "default",
    device: torch.device | str | None = None,
    rank0_only: bool = False,
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Collective: `(name, full tensor)` for every weight of a sharded model, one tensor gathered at a
    time, under the Hugging Face names, for an inference engine's weight loading (vLLM's
    `load_weights`, TRL's weight sync) or a writer.

    A PEFT model's weights come merged, each LoRA delta added to its base weight as the layer is
    reached (`merge_and_unload` semantics: `W + scaling * B @ A`, summed in fp32, the weight's dtype
    kept), under the base model's names: the merged model never exists in memory, only one tensor.
    A bitsandbytes 4-bit base weight comes dequantised. Every rank must consume the whole iterator,
    in step (each item is a collective).

    Args:
        model: The sharded model, a `PeftModel`, or a module holding one.
        adapter_name: The adapter whose deltas are merged (PEFT models).
        device: Where the tensors are delivered (None: the parameters' device).
        rank0_only: Deliver the tensors on rank 0 only (the others get `(name, None)`): each
            dim-0-sharded tensor is gathered to rank 0 alone, so the other ranks neither receive
            nor hold it (other layouts are all-gathered and dropped there).

    Yields:
        `(name, tensor)` in the model's state-dict order (`tensor` None off rank 0 with `rank0_only`).

    Raises:
        ValueError: A LoRA layer of the adapter cannot be merged (DoRA, embeddings, convolutions, an
            8-bit base): raised by the call, before any tensor is gathered.

    Example:
        ```python
        for name, tensor in f2.full_weights(model, rank0_only=True):  # every rank iterates
            if tensor is not None:
                llm.load_weights([(name, tensor)])  # the engine beside rank 0
        ```
    """
    dst = 0 if rank0_only else None
    found_peft = peft_models(model)
    if not found_peft:
        return _weights(model, device, dst)
    peft_model = found_peft[0][1]
    return _merged_weights(peft_model, _mergeable_layers(peft_model, adapter_name), adapter_name, device, dst)


def _mergeable_layers(peft_model: Any, adapter_name: str) -> dict[str, Any]:
    """The adapter's LoRA layers by name; ValueError naming those that cannot be merged."""
    found = lora_layers(peft_model, adapter_name)
    check_mergeable({name: why for name, (_, why) in found.items()})
    return {name: layer for name, (layer, _) in found.items()}


def _merged_weights(
    peft_model: Any, layers: dict[str, Any], adapter_name: str, device: Any, dst: int | None
) -> Iterator[tuple[str, torch.Tensor | None]]:
    for key, tensor in _weights(peft_model.get_base_model(), device, dst):
        name = merged_name(key, adapter_name)
        if name is None:
            continue
        layer = layers.get(key.removesuffix(".base_layer.weight")) if key.endswith(".base_layer.weight") else None
        if layer is not None:
            # Gathered where the base weight is (collectives: every rank, even without the weight).
            a = whole(layer.lora_A[adapter_name].weight, "cpu", dst)
            b = whole(layer.lora_B[adapter_name].weight, "cpu", dst)
            if tensor is not None and a is not None and b is not None:
                fan_in_fan_out = getattr(layer, "fan_in_fan_out", False)
                delta = lora_delta(a, b, float(layer.scaling[adapter_name]), fan_in_fan_out).to(tensor.device)
                tensor = (tensor.float() + delta).to(tensor.dtype)
        yield name, tensor


def save_merged(
    model: nn.Module,
    out_dir: str | os.PathLike,
    *,
    adapter_name: str = "default",
    max_shard_size: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Collective: write a sharded PEFT model's weights with the LoRA deltas merged in (rank 0 writes).

    The output is Hugging Face safetensors (with an index past `max_shard_size`) plus the base
    model's `config.json`, under the base model's names, which `AutoModel.from_pretrained` loads.
    Each weight keeps its dtype (the sum is taken in fp32); a bitsandbytes 4-bit base weight is
    written dequantised, in the dtype it was quantised from, and the config without its
    `quantization_config`. The tensors are gathered on rank 0 only. Every rank must call it.

    Args:
        model: The sharded `PeftModel`, or a module holding one.
        out_dir: The folder to write (created if missing).
        adapter_name: The adapter whose deltas are merged.
        max_shard_size: The most bytes per safetensors file (default 5 GiB, Hugging Face's).

    Returns:
        `out_dir`, as a Path.

    Raises:
        ValueError: If `model` holds no PEFT model, or a LoRA layer of the adapter cannot be merged
            (DoRA, embeddings, convolutions, an 8-bit base).
    """
    _, peft_model = find_peft_model(model)
    layers = _mergeable_layers(peft_model, adapter_name)
    base = peft_model.get_base_model()
    writer = ShardWriter(Path(out_dir), _merged_sizes(base, adapter_name), max_shard_size) if rank() == 0 else None
    for name, tensor in _merged_weights(peft_model, layers, adapter_name, "cpu", dst=0):
        if writer is not None and tensor is not None:
            writer.add(name, tensor)
    if writer is not None:
        writer.close()
        _save_float_config(base, Path(out_dir))
        logger.info("Saved merged weights (%d LoRA layers) to %s", len(layers), out_dir)
    barrier()
    return Path(out_dir)


def _merged_sizes(base: nn.Module, adapter_name: str) -> dict[str, int]:
    """Bytes of each tensor `save_merged` writes, by its name: a 4-bit weight dequantised (its
    quantisation-state entries are not written)."""
    quantised = four_bit_layers(base)
    sizes = {}
    for key, value in base.state_dict().items():
        name = merged_name(key, adapter_name)
        owner = key.removesuffix(".weight")
        if name is None or any(key.startswith(f"{q}.weight.") for q in quantised):
            continue
        state = getattr(quantised.get(owner), "quant_state", None) or getattr(value, "quant_state", None)
        if owner in quantised and state is not None:
            sizes[name] = int(torch.Size(state.shape).numel()) * torch.empty((), dtype=state.dtype).element_size()
        else:
            sizes[name] = value.numel() * value.element_size()
    return sizes


def _save_float_config(base: nn.Module, out: Path) -> None:
    """The base model's `config.json`, if it has one, without `quantization_config`: the merged
    weights are written dequantised, so `from_pretrained` must load them as a float model."""
    config: Any = getattr(base, "config", None)
    if not callable(getattr(config, "save_pretrained", None)):
        return
    if getattr(config, "quantization_config", None) is not None:
        config = copy.deepcopy(config)
        for name in ("quantization_config", "_pre_quantization_dtype"):
            if hasattr(config, name):
                delattr(config, name)
    config.save_pretrained(str(out))

"""PEFT (LoRA) weights out of a sharded model: the adapter in PEFT's format, or merged full weights.

From a live sharded model (collective: call on every rank; rank 0 writes):
- `save_peft_adapter(model, out)`: `adapter_model.safetensors` + `adapter_config.json`, what
  `PeftModel.from_pretrained(base, out)` loads (PEFT's own `get_peft_model_state_dict` names the keys);
- `save_merged(model, out)`: the base model's weights with each LoRA delta added
  (`merge_and_unload` semantics: `W + scaling * B @ A`), Hugging Face safetensors plus `config.json`,
  what `AutoModel...from_pretrained(out)` loads.

Both gather one tensor at a time; rank 0 holds at most one output file's worth (`max_shard_size`).
A LoRA layer's A and B are small: every rank gathers them to add the delta to its base weight.

Checkpoints of PEFT models hold `peft.<model key>` (JSON: the adapters' configs, and each LoRA
layer's scaling and fan-in-fan-out), so `export_peft` can write either form from a checkpoint
directory in one process, without PEFT installed; a trainable-only checkpoint takes the base
weights from `base=` (the pretrained model's folder).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..distributed import barrier, logger, rank

PEFT_ENTRY = "peft"
"""Top-level checkpoint key prefix of a PEFT model's adapter description: `peft.<model key>`."""
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
# PEFT's LoRA Linear layers (plain, and on bitsandbytes 4-/8-bit bases): the delta is B @ A.
_SUPPORTED_LAYERS = ("Linear", "Linear4bit", "Linear8bitLt")
# Why an 8-bit base is not merged live: its int8 data and row scales live in bitsandbytes' layer state.
_INT8_BASE = "quantised base (8-bit)"


def peft_key(model_key: str) -> str:
    """Where the PEFT description of the model saved under `model_key` is stored."""
    return f"{PEFT_ENTRY}.{model_key}"


def peft_models(model: nn.Module) -> list[tuple[str, Any]]:
    """(qualified name, module) of each `PeftModel` in `model` (`model` itself, or a submodule such as
    a LightningModule's attribute)."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "peft_config") and hasattr(m, "get_base_model")]


def find_peft_model(model: nn.Module) -> tuple[str, Any]:
    """The first of `peft_models(model)`; ValueError if there is none."""
    found = peft_models(model)
    if found:
        return found[0]
    raise ValueError(
        f"{type(model).__name__} holds no PEFT model (peft.get_peft_model(...)); for a plain model use "
        "accelerator.save_model, fsdp2_strategy.export_full on a checkpoint, or save_merged on a PEFT model."
    )


def lora_layers(peft_model: Any, adapter: str) -> dict[str, tuple[Any, str]]:
    """Every LoRA layer of `adapter`, by qualified name relative to the base model, with why it cannot
    be merged ("" when it can: a Linear layer whose delta is `B @ A`; not DoRA, embeddings,
    convolutions; and, in a live model, not an 8-bit base; a 4-bit base merges dequantised)."""
    layers: dict[str, tuple[Any, str]] = {}
    for name, module in peft_model.get_base_model().named_modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, nn.ModuleDict) or adapter not in lora_a:
            continue
        why = ""
        kind = _peft_class_name(module)
        if kind not in _SUPPORTED_LAYERS:
            why = kind
        elif getattr(module, "use_dora", {}).get(adapter, False):
            why = "DoRA"
        elif type(getattr(getattr(module, "base_layer", None), "weight", None)).__name__ == "Int8Params":
            why = _INT8_BASE
        layers[name] = (module, why)
    return layers


def _peft_class_name(module: nn.Module) -> str:
    """The PEFT layer class of `module` (fully_shard swaps a group's class for an `FSDP<name>` subclass)."""
    return next((c.__name__ for c in type(module).__mro__ if c.__module__.startswith("peft.")), type(module).__name__)


def check_mergeable(reasons: dict[str, str]) -> None:
    """Raise ValueError naming the layers (name -> reason) that cannot be merged."""
    unsupported = [f"{name} ({why})" for name, why in reasons.items() if why]
    if unsupported:
        raise ValueError(
            f"Merging is implemented for LoRA Linear layers on full-precision weights; {unsupported[:10]} are not. "
            "Save the adapter (save_peft_adapter, or a checkpoint) and merge it into the full-precision pretrained "
            "weights with export_peft(checkpoint, out, merged=True, base=...) or PEFT's merge_and_unload."
        )


def peft_description(model: nn.Module) -> str:
    """JSON text stored beside a PEFT model's checkpoint state (see module doc); `model` holds a `PeftModel`."""
    prefix, peft_model = find_peft_model(model)
    adapters = {name: _jsonable(config.to_dict()) for name, config in peft_model.peft_config.items()}
    layers: dict[str, dict] = {}
    for adapter in adapters:
        for name, (layer, why) in lora_layers(peft_model, adapter).items():
            layers.setdefault(adapter, {})[name] = {
                "scaling": float(layer.scaling[adapter]),
                "fan_in_fan_out": bool(getattr(layer, "fan_in_fan_out", False)),
                # An 8-bit base merges offline into the pretrained weights (`export_peft(base=...)`).
                "unmergeable": "" if why == _INT8_BASE else why,
            }
    return json.dumps({"prefix": prefix, "adapters": adapters, "layers": layers}, sort_keys=True)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_jsonable(v) for v in value]
        return sorted(items, key=str) if isinstance(value, (set, frozenset)) else items
    if hasattr(value, "value") and not isinstance(value, (str, int, float, bool)):  # enums such as TaskType
        return value.value
    return value


def adapter_name_in(key: str, adapter: str) -> bool:
    """Whether a parameter name belongs to `adapter` (`...lora_A.default.weight`, `...modules_to_save.default.bias`)."""
    return f".{adapter}." in f".{key}"


def peft_format_name(key: str, adapter: str) -> str:
    """PEFT's saved name for an adapter parameter: without `modules_to_save.` and the adapter name."""
    return key.replace("modules_to_save.", "").replace(f".{adapter}", "")


def merged_name(key: str, adapter: str) -> str | None:
    """The base model's name for a PEFT model's state entry, or None for entries merging drops
    (LoRA matrices, dropout, the original copy of a module that `modules_to_save` trains)."""
    parts = key.split(".")
    if any(p.startswith("lora_") for p in parts) or "original_module" in parts:
        return None
    if "modules_to_save" in parts:
        i = parts.index("modules_to_save")
        if parts[i + 1] != adapter:
            return None
        parts = parts[:i] + parts[i + 2 :]
    return ".".join(p for p in parts if p != "base_layer")


def lora_delta(a: torch.Tensor, b: torch.Tensor, scaling: float, fan_in_fan_out: bool) -> torch.Tensor:
    """`scaling * B @ A` in fp32, transposed for fan-in-fan-out layers (GPT-2's Conv1D)."""
    delta = (b.float() @ a.float()) * scaling
    return delta.T if fan_in_fan_out else delta


def _full(t: torch.Tensor) -> torch.Tensor:
    """Collective for a DTensor: the whole tensor on every rank, on the CPU."""
    t = t.detach()
    return (t.full_tensor() if isinstance(t, DTensor) else t).to("cpu")


def save_peft_adapter(model: nn.Module, out_dir: str | os.PathLike, *, adapter_name: str = "default") -> Path:
    """Collective: write the adapter of a sharded PEFT model in PEFT's format (rank 0 writes).

    Only the adapter's parameters are gathered (LoRA matrices and `modules_to_save`); the output
    is `adapter_model.safetensors` and `adapter_config.json`, which `PeftModel.from_pretrained`
    loads. Every rank must call it.

    Args:
        model: The sharded `PeftModel`, or a module holding one.
        out_dir: The folder to write (created if missing).
        adapter_name: The adapter to save.

    Returns:
        `out_dir`, as a Path.

    Raises:
        ValueError: If `model` holds no PEFT model, or `adapter_name` is not one of its adapters.
    """
    from peft.utils import get_peft_model_state_dict  # optional: only PEFT models come here
    from safetensors.torch import save_file  # optional ([hf])

    _, peft_model = find_peft_model(model)
    if adapter_name not in peft_model.peft_config:
        raise ValueError(
            f"adapter_name={adapter_name!r} is not an adapter of this model: {list(peft_model.peft_config)}."
        )
    gathered = {n: _full(p) for n, p in peft_model.named_parameters() if adapter_name_in(n, adapter_name)}
    out = Path(out_dir)
    if rank() == 0:
        state = get_peft_model_state_dict(peft_model, state_dict=gathered, adapter_name=adapter_name)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        peft_model.peft_config[adapter_name].save_pretrained(str(out))
        logger.info("Saved PEFT adapter %r (%d tensors) to %s", adapter_name, len(state), out)
    barrier()
    return out

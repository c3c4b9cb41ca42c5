"""`export_peft`: a PEFT model's adapter, or its merged weights, from a checkpoint directory.

One process, no process group, PEFT not needed: the checkpoint's `peft.<model key>` entry (see
`peft`) says where the PEFT model's state sits, each adapter's config and each LoRA layer's scaling.
A trainable-only checkpoint holds no base weights: `base=` names the pretrained model's folder
(safetensors, with or without an index), read one tensor at a time.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from ..distributed import logger
from . import directory as cdir
from .export import read_objects, read_tensors, verified_checkpoint_dir
from .hf_files import DEFAULT_MAX_SHARD_BYTES, ShardWriter
from .peft import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_ENTRY,
    adapter_name_in,
    check_mergeable,
    lora_delta,
    merged_name,
    peft_format_name,
)
from .trainable import FROZEN_BASE

_BASE_PREFIX = "base_model.model."  # where a LoRA PeftModel keeps the base model's state


def export_peft(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    *,
    merged: bool = False,
    base: str | Path | None = None,
    adapter_name: str = "default",
    step: int | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write a checkpointed PEFT model's adapter, or its weights with the adapter merged in.

    Runs in one process, without a process group; the files are checked against
    `checksums.json` first.

    Args:
        checkpoint_dir: A DCP directory, or a `Checkpointer` root (its latest committed step, or
            `step`), saved from a PEFT model.
        out_dir: The folder to write (created if missing).
        merged: False writes the adapter in PEFT's format (`adapter_model.safetensors` +
            `adapter_config.json`); True writes the base weights with the LoRA deltas added
            (Hugging Face safetensors).
        base: The pretrained model's folder (safetensors): with `merged=True`, base weights the
            checkpoint does not hold are read from it, and its `config.json` is copied. Required to
            merge a trainable-only checkpoint.
        adapter_name: The adapter to export.
        step: The step of a `Checkpointer` root to export (None: the latest committed one).
        max_shard_size: The most bytes per safetensors file of the merged weights (default 5 GiB).

    Returns:
        `out_dir`, as a Path.

    Raises:
        ValueError: If the checkpoint is damaged, holds no PEFT model or no adapter
            `adapter_name`, or is trainable-only and `merged=True` without `base`.
        FileNotFoundError: If `checkpoint_dir` holds no committed checkpoint (or not `step`).
    """
    ckpt = verified_checkpoint_dir(checkpoint_dir, step)
    metadata = cdir.read_metadata(ckpt)
    model_key, info = _peft_entry(ckpt, metadata.state_dict_metadata)
    if adapter_name not in info["adapters"]:
        raise ValueError(f"{ckpt} holds adapters {sorted(info['adapters'])}, not {adapter_name!r}; pass adapter_name=.")
    prefix = f"{model_key}." + (f"{info['prefix']}." if info["prefix"] else "")
    saved = {k[len(prefix) :]: k for k in metadata.state_dict_metadata if k.startswith(prefix)}
    out = Path(out_dir)
    if merged:
        trainable_only = f"{FROZEN_BASE}.{model_key}" in metadata.state_dict_metadata
        if trainable_only and base is None:
            raise ValueError(
                f"{ckpt} is a trainable-only checkpoint (no base weights): pass base= (--base) the pretrained "
                "model's folder to merge into, or export the adapter instead."
            )
        _export_merged(ckpt, metadata, saved, info, adapter_name, Path(base) if base else None, out, max_shard_size)
    else:
        _export_adapter(ckpt, metadata, saved, info, adapter_name, out)
    return out


def _peft_entry(ckpt: Path, entries: dict[str, Any]) -> tuple[str, dict]:
    keys = [k for k in entries if k.startswith(PEFT_ENTRY + ".")]
    if not keys:
        raise ValueError(
            f"{ckpt} holds no PEFT model (no {PEFT_ENTRY}.<model> entry: saved from a model without PEFT layers, or "
            "before fsdp2-strategy recorded them). Export full weights with `fsdp2-strategy consolidate`."
        )
    key = sorted(keys)[0]
    return key[len(PEFT_ENTRY) + 1 :], json.loads(read_objects(ckpt, [key])[key])


def _export_adapter(ckpt: Path, metadata, saved: dict[str, str], info: dict, adapter: str, out: Path) -> None:
    from safetensors.torch import save_file  # optional ([hf])

    names = [n for n in saved if adapter_name_in(n, adapter)]
    tensors = read_tensors(ckpt, metadata, [saved[n] for n in names])
    state = {peft_format_name(n, adapter): tensors[saved[n]].contiguous() for n in names}
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(info["adapters"][adapter], indent=2, sort_keys=True))
    logger.info("Exported adapter %r (%d tensors) from %s to %s", adapter, len(state), ckpt, out)


def _export_merged(ckpt, metadata, saved, info, adapter, base: Path | None, out: Path, max_shard_size: int) -> None:
    base_reader = _SafetensorsFolder(base) if base is not None else None
    # Output name -> where its values come from: the base folder first, the checkpoint overriding.
    sources: dict[str, tuple[str, str]] = {}
    if base_reader is not None:
        sources.update({n: ("base", n) for n in base_reader.names})
    for name, key in saved.items():
        target = merged_name(name.removeprefix(_BASE_PREFIX), adapter) if name.startswith(_BASE_PREFIX) else None
        if target is not None:
            sources[target] = ("ckpt", key)
    layers = info["layers"].get(adapter, {})
    check_mergeable({name: layer.get("unmergeable", "") for name, layer in layers.items()})
    missing = [f"{layer}.weight" for layer in layers if f"{layer}.weight" not in sources]
    if missing:
        raise ValueError(f"Base weights of LoRA layers not found in the checkpoint or base folder: {missing[:10]}.")
    sizes = {n: _source_nbytes(src, metadata, base_reader) for n, src in sources.items()}
    writer = ShardWriter(out, sizes, max_shard_size)
    for name, (kind, key) in sources.items():
        tensor = read_tensors(ckpt, metadata, [key])[key] if kind == "ckpt" else base_reader.get(key)  # type: ignore[union-attr]
        layer = layers.get(name.removesuffix(".weight"))
        if layer is not None:
            lora = f"{_BASE_PREFIX}{name.removesuffix('.weight')}"
            keys = [saved[f"{lora}.lora_A.{adapter}.weight"], saved[f"{lora}.lora_B.{adapter}.weight"]]
            a, b = (read_tensors(ckpt, metadata, [k])[k] for k in keys)
            tensor = (tensor.float() + lora_delta(a, b, layer["scaling"], layer["fan_in_fan_out"])).to(tensor.dtype)
        writer.add(name, tensor)
    writer.close()
    if base is not None and (base / "config.json").is_file():
        shutil.copy(base / "config.json", out / "config.json")
    logger.info("Exported merged weights (%d LoRA layers) from %s to %s", len(layers), ckpt, out)


def _source_nbytes(source: tuple[str, str], metadata, base_reader) -> int:
    kind, key = source
    if kind == "base":
        return base_reader.nbytes(key)
    meta = metadata.state_dict_metadata[key]
    return torch.Size(meta.size).numel() * torch.empty((), dtype=meta.properties.dtype).element_size()


class _SafetensorsFolder:
    """Tensors of a Hugging Face model folder (`model.safetensors` or shards with an index), one at a time."""

    def __init__(self, folder: Path):
        from safetensors import safe_open  # optional ([hf])

        index = folder / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (folder / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise ValueError(
                f"base={folder} holds no model.safetensors (or index): pass the pretrained model's folder."
            )
        self.handles = {f: safe_open(str(folder / f), framework="pt") for f in files}
        self.file_of = {n: f for f, h in self.handles.items() for n in h.keys()}
        self.names = list(self.file_of)

    def get(self, name: str) -> torch.Tensor:
        return self.handles[self.file_of[name]].get_tensor(name)

    def nbytes(self, name: str) -> int:
        sl = self.handles[self.file_of[name]].get_slice(name)
        return torch.Size(sl.get_shape()).numel() * _DTYPE_BYTES[sl.get_dtype()]


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}

"""`load_full_weights`: fill a sharded model from an unsharded checkpoint, shard by shard.

Every rank reads only the slice of each tensor that it owns. For safetensors files the slice
of a dim-0 shard is one contiguous byte range, read straight into the rank's local shard
(no full tensor, no mmap pages); other layouts go through `safe_open(...).get_slice`, and
torch files through a memory-mapped `torch.load`, one tensor at a time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .distributed import log_rank_zero
from .materialize import has_meta_tensors
from .mesh import mesh_device

SAFETENSORS_INDEX = "model.safetensors.index.json"
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


class _SafetensorsFile:
    """Header of one safetensors file: name -> (dtype, shape, absolute byte offset)."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        self.entries = {
            k: (_ST_DTYPES[v["dtype"]], tuple(v["shape"]), 8 + size + v["data_offsets"][0]) for k, v in header.items()
        }

    def read_rows(self, name: str, start: int, out: torch.Tensor) -> None:
        """Read rows [start, start + len(out)) of tensor `name` into `out` (same dtype)."""
        if out.numel() == 0:  # this rank owns no rows (a tensor with fewer rows than ranks)
            return
        _, shape, offset = self.entries[name]
        row_bytes = torch.Size(shape[1:]).numel() * out.element_size()
        with open(self.path, "rb", buffering=0) as f:
            f.seek(offset + start * row_bytes)
            view = memoryview(out.reshape(-1).view(torch.uint8).numpy()).cast("B")
            if f.readinto(view) != len(view):
                raise ValueError(f"{self.path}: tensor {name!r} is truncated; the file is incomplete or corrupt.")

    def read_slice(self, name: str, index: tuple) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as f:
            return f.get_slice(name)[index]


def _safetensors_files(path: Path) -> dict[str, _SafetensorsFile]:
    """Tensor name -> file, for one file or a folder with a Hugging Face index."""
    if path.is_file():
        single = _SafetensorsFile(path)
        return dict.fromkeys(single.entries, single)
    index = path / SAFETENSORS_INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {f: _SafetensorsFile(path / f) for f in sorted(set(weight_map.values()))}
        return {name: files[f] for name, f in weight_map.items()}
    singles = sorted(path.glob("*.safetensors"))
    if len(singles) == 1:
        return _safetensors_files(singles[0])
    raise FileNotFoundError(
        f"{path}: expected a .safetensors file, a folder with {SAFETENSORS_INDEX}, or a torch checkpoint file."
    )


def _local_region(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's part of a DTensor (whole tensor if plain)."""
    if not isinstance(tensor, DTensor):
        return tuple(tensor.shape), (0,) * tensor.ndim
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(shape), tuple(offset)


def _model_tensors(model: nn.Module) -> Iterator[tuple[list[str], torch.Tensor]]:
    """Each parameter and persistent buffer once, with all the names it has (tied weights)."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = tensor
    for key, tensor in tensors.items():
        yield names[key], tensor


def _check_keys(model_names: list[list[str]], available: set[str], path: Path) -> None:
    missing = [names[0] for names in model_names if not any(n in available for n in names)]
    claimed = {n for names in model_names for n in names}
    unexpected = sorted(available - claimed)
    if missing or unexpected:
        raise ValueError(
            f"{path} does not match the model: missing keys {missing[:10]}{' ...' if len(missing) > 10 else ''}; "
            f"unexpected keys {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}. Load the weights of the "
            "same architecture (rename keys first if they carry a different prefix)."
        )


@torch.no_grad()
def load_full_weights(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> nn.Module:
    """Load a full (unsharded) checkpoint into a sharded or meta-device model; returns `model`.

    `path` is a safetensors file, a folder of safetensors files with a Hugging Face index, or
    a `torch.save` file of a state dict. Each rank reads only its own slices, so no rank holds
    more than its shards plus one tensor. A model still on the meta device is allocated on
    its mesh's device first (no random initialisation is run). With `strict`, missing or
    unexpected keys raise `ValueError` listing them; shape mismatches always raise.
    """
    path = Path(path)
    if has_meta_tensors(model):
        mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
        model.to_empty(device=mesh_device(mesh) if mesh is not None else torch.device("cpu"))
    entries = list(_model_tensors(model))
    is_torch_file = path.is_file() and path.suffix not in (".safetensors",)
    if is_torch_file:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        available = set(state)
    else:
        files = _safetensors_files(path)
        available = set(files)
    if strict:
        _check_keys([names for names, _ in entries], available, path)
    for names, tensor in entries:
        key = next((n for n in names if n in available), None)
        if key is None:
            continue
        if is_torch_file:
            _copy_from_full(tensor, state[key], key)
        else:
            _copy_from_safetensors(tensor, files[key], key)
    log_rank_zero("Loaded full weights from %s into %d tensors.", path, len(entries))
    return model


def _check_shape(tensor: torch.Tensor, shape: tuple, key: str) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"Shape mismatch for {key!r}: checkpoint has {tuple(shape)}, the model has {tuple(tensor.shape)}.")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _copy_from_full(tensor: torch.Tensor, full: torch.Tensor, key: str) -> None:
    _check_shape(tensor, full.shape, key)
    shape, offset = _local_region(tensor)
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
    _local(tensor).copy_(full[index])


def _copy_from_safetensors(tensor: torch.Tensor, source: _SafetensorsFile, key: str) -> None:
    dtype, shape, _ = source.entries[key]
    _check_shape(tensor, shape, key)
    local_shape, offset = _local_region(tensor)
    local = _local(tensor)
    rows_only = tensor.ndim == 0 or tuple(local_shape[1:]) == tuple(shape[1:])
    if rows_only and local.is_contiguous() and local.device.type == "cpu":
        target = local if local.dtype == dtype else torch.empty(local.shape, dtype=dtype)
        source.read_rows(key, offset[0] if tensor.ndim else 0, target)
        if target is not local:
            local.copy_(target)
        return
    index = tuple(slice(o, o + s) for o, s in zip(offset, local_shape))
    local.copy_(source.read_slice(key, index))

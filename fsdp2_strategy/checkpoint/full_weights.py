"""`load_full_weights`: fill a sharded model from an unsharded checkpoint, shard by shard.

Every rank reads only the slice of each tensor that it owns. For safetensors files the slice
of a dim-0 shard is one contiguous byte range, read straight into the rank's local shard
(no full tensor, no mmap pages); other layouts go through `safe_open(...).get_slice`, and
torch files through a memory-mapped `torch.load`, one tensor at a time.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..distributed import log_rank_zero
from ..mesh import mesh_device
from ..shard import copy_from_full, has_meta_tensors, local_region, local_tensor, pending_4bit, quantise_pending
from .peft import merged_name, peft_models

SAFETENSORS_INDEX = "model.safetensors.index.json"
_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class DamagedWeightsError(ValueError):
    """A weights file that cannot be what it claims to be (truncated, overwritten, not safetensors)."""

    def __init__(self, path: Path, problem: str):
        super().__init__(
            f"{path} is damaged or not a safetensors file: {problem}. Nothing was loaded (the model is unchanged); "
            "download or export the file again."
        )


def _read_header(path: Path) -> tuple[int, dict]:
    """(size of the 8-byte length + JSON header, the header) of a safetensors file, checked
    against the file's size before anything is allocated: the length field is untrusted input."""
    size = path.stat().st_size
    if size < 8:
        raise DamagedWeightsError(path, f"it is {size} bytes long, shorter than the 8-byte header length")
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if length > size - 8:
            raise DamagedWeightsError(path, f"its header length field says {length} bytes, but only {size - 8} follow")
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DamagedWeightsError(path, f"its {length}-byte header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise DamagedWeightsError(path, f"its header is a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    return 8 + length, header


def _check_entries(path: Path, header: dict, data_bytes: int) -> None:
    """Every entry has a known dtype, a shape, and offsets that fit its size, the file and each other."""
    spans = []
    for name, entry in header.items():
        try:
            dtype_name, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            numel = torch.Size(shape).numel()
        except (TypeError, KeyError, ValueError):
            raise DamagedWeightsError(path, f"header entry {name!r} is malformed: {entry!r}") from None
        if not isinstance(dtype_name, str) or dtype_name not in _ST_DTYPES:
            raise ValueError(
                f"{path}: tensor {name!r} has dtype {dtype_name!r}, which load_full_weights does not read; "
                f"supported: {', '.join(_ST_DTYPES)}. Convert the file (e.g. to F32 or BF16) first."
            )
        nbytes = numel * _ST_DTYPES[dtype_name].itemsize
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data_bytes):
            raise DamagedWeightsError(
                path,
                f"tensor {name!r} has data_offsets [{begin}, {end}] outside the "
                f"{data_bytes} data bytes of the file (truncated?)",
            )
        if end - begin != nbytes:
            raise DamagedWeightsError(
                path,
                f"tensor {name!r} ({dtype_name}, shape {list(shape)}) needs {nbytes} "
                f"bytes but its data_offsets span {end - begin}",
            )
        spans.append((begin, end, name))
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise DamagedWeightsError(path, f"the bytes of tensors {first!r} and {second!r} overlap")


class _SafetensorsFile:
    """Header of one safetensors file: name -> (dtype, shape, absolute byte offset)."""

    def __init__(self, path: Path):
        self.path = path
        data_start, header = _read_header(path)
        # A file cut short keeps a valid header: the offsets are checked against the bytes
        # that exist (a truncated download is reported here, before any tensor is touched).
        _check_entries(path, header, path.stat().st_size - data_start)
        self.entries = {
            k: (_ST_DTYPES[v["dtype"]], tuple(v["shape"]), data_start + v["data_offsets"][0]) for k, v in header.items()
        }

    def read_rows(self, name: str, start: int, out: torch.Tensor) -> None:
        """Read rows [start, start + len(out)) of tensor `name` into `out` (same dtype)."""
        if out.numel() == 0:  # this rank owns no rows (a tensor with fewer rows than ranks)
            return
        _, shape, offset = self.entries[name]
        row_bytes = torch.Size(shape[1:]).numel() * out.element_size()
        with open(self.path, "rb", buffering=0) as f:
            f.seek(offset + start * row_bytes)
            # An ndarray exports the buffer protocol (numpy's stubs declare it only for Python >= 3.12).
            array: Any = out.reshape(-1).view(torch.uint8).numpy()
            view = memoryview(array).cast("B")
            if f.readinto(view) != len(view):
                raise ValueError(f"{self.path}: tensor {name!r} is truncated; the file is incomplete or corrupt.")

    def read_slice(self, name: str, index: tuple) -> torch.Tensor:
        from safetensors import safe_open  # optional ([hf]): only safetensors inputs need it

        with safe_open(str(self.path), framework="pt") as f:
            return f.get_slice(name)[index]


def _safetensors_files(path: Path) -> dict[str, _SafetensorsFile]:
    """Tensor name -> file, for one file or a folder with a Hugging Face index."""
    if path.is_file():
        single = _SafetensorsFile(path)
        return dict.fromkeys(single.entries, single)
    index = path / SAFETENSORS_INDEX
    if index.exists():
        weight_map = _read_weight_map(index)
        files = {f: _SafetensorsFile(path / f) for f in sorted(set(weight_map.values()))}
        return {name: files[f] for name, f in weight_map.items()}
    singles = sorted(path.glob("*.safetensors"))
    if len(singles) == 1:
        return _safetensors_files(singles[0])
    found = f"{len(singles)} .safetensors files but no {SAFETENSORS_INDEX}" if singles else "no .safetensors file"
    raise FileNotFoundError(
        f"load_full_weights: {path} holds {found}; pass a .safetensors file, a folder with "
        f"{SAFETENSORS_INDEX}, or a torch checkpoint file."
    )


def _read_weight_map(index: Path) -> dict[str, str]:
    """The index's tensor name -> file name map, every listed file present."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not a mapping of tensor names to file names")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise ValueError(
            f'{index} is damaged: expected JSON with a "weight_map" of tensor names to file names '
            f"({type(exc).__name__}: {exc}). Download or write the index again."
        ) from None
    missing = sorted({f for f in weight_map.values() if not (index.parent / f).is_file()})
    if missing:
        raise FileNotFoundError(
            f"{index} lists files that are not in {index.parent}: {missing}. "
            "Copy the whole folder (every shard the index names)."
        )
    return weight_map


def _open_torch_file(path: Path) -> dict:
    """A `torch.save`d state dict, memory-mapped; a file torch cannot read raises ValueError naming it."""
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as exc:
        raise ValueError(
            f"{path} is not a readable torch checkpoint ({type(exc).__name__}: {str(exc).splitlines()[0]}). "
            "It is damaged, or not written by torch.save (>= 1.6; re-save older files with torch.save). "
            "Safetensors files need the .safetensors suffix."
        ) from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict; save model.state_dict() instead.")
    return state


def _model_tensors(model: nn.Module) -> Iterator[tuple[list[str], torch.Tensor]]:
    """Each parameter and persistent buffer once, with all the names it has (tied weights; in a PEFT
    model also its base model's name, as in the pretrained checkpoint). LoRA's own tensors, which no
    pretrained checkpoint holds, are left out: they keep their initialisation."""
    aliases = _base_model_names(model)
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        alias = aliases.get(name, name)
        if alias is None:
            continue
        names.setdefault(id(tensor), []).extend(dict.fromkeys([name, alias]))
        tensors[id(tensor)] = tensor
    for key, tensor in tensors.items():
        yield names[key], tensor


def _base_model_names(model: nn.Module) -> dict[str, str | None]:
    """For each state-dict key of a PEFT model inside `model`: the base model's own name for it
    (`...q_proj.base_layer.weight` -> `...q_proj.weight`), or None for an adapter's tensor."""
    aliases: dict[str, str | None] = {}
    for prefix, peft_model in peft_models(model):
        adapter = peft_model.active_adapter if isinstance(peft_model.active_adapter, str) else "default"
        base = f"{prefix}.base_model.model." if prefix else "base_model.model."
        for key in peft_model.state_dict(keep_vars=True):
            full = f"{prefix}.{key}" if prefix else key
            aliases[full] = merged_name(full.removeprefix(base), adapter)
    return aliases


def _expected_shape(tensor: torch.Tensor, pending: dict[int, nn.Module]) -> tuple[int, ...]:
    """A tensor's shape in a full checkpoint: a 4-bit weight waiting for its values has its full
    precision shape there (the model holds the packed bytes it will become)."""
    layer = pending.get(id(tensor))
    spec = pending_4bit(layer) if layer is not None else None
    return spec.shape if spec is not None else tuple(tensor.shape)


def _pending_layers(model: nn.Module) -> dict[int, nn.Module]:
    """`id(weight)` -> layer, for the 4-bit layers `shard_model` built from the meta device."""
    return {id(m._parameters["weight"]): m for m in model.modules() if pending_4bit(m) is not None}


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


def _check_shapes(model: nn.Module, shapes: dict[str, tuple], path: Path) -> None:
    """All shape mismatches at once, before any tensor is copied (so a mismatch leaves the model as it was)."""
    pending = _pending_layers(model)
    wrong = [
        f"{key}: checkpoint {shapes[key]}, model {_expected_shape(tensor, pending)}"
        for names, tensor in _model_tensors(model)
        for key in [next((n for n in names if n in shapes), None)]
        if key is not None and tuple(shapes[key]) != _expected_shape(tensor, pending)
    ]
    if wrong:
        raise ValueError(
            f"{path} does not match the model: shape mismatch ({len(wrong)}): "
            + "; ".join(wrong[:10])
            + (" ..." if len(wrong) > 10 else "")
            + ". Load the weights of the same architecture and size. Nothing was loaded."
        )


@torch.no_grad()
def load_full_weights(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> nn.Module:
    """Load a full (unsharded) checkpoint into a sharded or meta-device model.

    Each rank reads only its own slices, so no rank holds more than its shards plus one tensor.
    A model still on the meta device is allocated on its mesh's device first (no random
    initialisation is run). Every file is checked before the model is touched, so an error
    leaves the model unchanged.

    A PEFT model takes its base model's weights under the base model's names (the pretrained
    checkpoint's); the adapters keep their initialisation. A bitsandbytes 4-bit layer that
    `shard_model` sharded from the meta device (`f2.to_4bit`) gets its weight read in full
    precision, quantised as bitsandbytes does, and keeps this rank's bytes and the quantisation
    state: the quantised base never exists whole in any process.

    Args:
        model: The sharded (or meta-device) model to fill.
        path: A safetensors file, a folder of safetensors files with a Hugging Face index, or a
            `torch.save` file of a state dict.
        strict: Raise on missing or unexpected keys (shape mismatches always raise).

    Returns:
        `model`, its parameters and buffers holding the checkpoint's values.

    Raises:
        FileNotFoundError: If `path` does not exist.
        ValueError: If a file is damaged, a shape differs from the model's, or (with `strict`)
            keys are missing or unexpected; the message lists them.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"load_full_weights: {path} does not exist; pass a .safetensors file, a folder "
            f"with {SAFETENSORS_INDEX}, or a torch checkpoint file."
        )
    # Every source file is opened and checked before the model is touched.
    is_torch_file = path.is_file() and path.suffix not in (".safetensors",)
    if is_torch_file:
        state = _open_torch_file(path)
        available = set(state)
    else:
        files = _safetensors_files(path)
        available = set(files)
    if strict:
        _check_keys([names for names, _ in _model_tensors(model)], available, path)
    shapes = (
        {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
        if is_torch_file
        else {k: f.entries[k][1] for k, f in files.items()}
    )
    _check_shapes(model, shapes, path)
    if has_meta_tensors(model):
        mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
        model.to_empty(device=mesh_device(mesh) if mesh is not None else torch.device("cpu"))
    entries = list(_model_tensors(model))
    pending = _pending_layers(model)
    for names, tensor in entries:
        key = next((n for n in names if n in available), None)
        if key is None:
            continue
        if id(tensor) in pending:  # a 4-bit weight: quantised whole, this rank keeps its bytes
            full = state[key] if is_torch_file else _read_whole(files[key], key)
            copy_from_full(tensor, quantise_pending(pending[id(tensor)], full))
        elif is_torch_file:
            copy_from_full(tensor, state[key])
        else:
            _copy_from_safetensors(tensor, files[key], key)
    log_rank_zero("Loaded full weights from %s into %d tensors.", path, len(entries))
    return model


def _read_whole(source: _SafetensorsFile, key: str) -> torch.Tensor:
    """The whole tensor `key`, read straight into one tensor (one byte range, as a shard's rows)."""
    dtype, shape, _ = source.entries[key]
    whole = torch.empty(shape, dtype=dtype)
    source.read_rows(key, 0, whole)
    return whole


def _copy_from_safetensors(tensor: torch.Tensor, source: _SafetensorsFile, key: str) -> None:
    dtype, shape, _ = source.entries[key]
    local_shape, offset = local_region(tensor)
    local = local_tensor(tensor)
    rows_only = tensor.ndim == 0 or tuple(local_shape[1:]) == tuple(shape[1:])
    if rows_only and local.is_contiguous() and local.device.type == "cpu":
        target = local if local.dtype == dtype else torch.empty(local.shape, dtype=dtype)
        source.read_rows(key, offset[0] if tensor.ndim else 0, target)
        if target is not local:
            local.copy_(target)
        return
    index = tuple(slice(o, o + s) for o, s in zip(offset, local_shape))
    local.copy_(source.read_slice(key, index))

"""An FSDP1 checkpoint read tensor by tensor, whatever wrote it: which files, under which keys.

Every FSDP1 save this reads holds a model state dict and an optimizer state dict from
`FSDP.optim_state_dict` (torch's layout, keyed by parameter name), in one of two containers:
- a DCP folder (`SHARDED_STATE_DICT`): the model under a top-level key ("model"), the optimizer under
  another ("optim", Lightning's "optimizer_0", Accelerate's "optimizer"); each tensor is read on its
  own with `dcp.load` of its flattened key, so nothing holds the whole model;
- a `torch.save` file (`FULL_STATE_DICT`): read memory-mapped, so a tensor's bytes are read when it
  is written out.

`TensorSource` is one such container seen through a key prefix: names, shapes, dtypes, a loader per
tensor, and the small values (step counters, hyperparameters) read at once.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ..checkpoint import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UntrustedCheckpointError,
    load_small_file,
    read_metadata_file,
)

WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
"""Module names FSDP1's and activation checkpointing's wrappers add to parameter names."""
RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def clean_name(name: str) -> str:
    """`name` without FSDP1's wrapper prefixes (`_fsdp_wrapped_module.`, `_checkpoint_wrapped_module.`)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a source: its shape and dtype, and how to read it."""

    shape: torch.Size
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]


class TensorSource:
    """What a state dict (flattened: "state.<name>.exp_avg", "param_groups.0.lr") holds, by key:
    `tensors` (read lazily) and `values` (everything else, read now)."""

    def __init__(self, where: Path, tensors: dict[str, TensorEntry], values: dict[str, Any]):
        self.where, self.tensors, self.values = where, tensors, values

    def keys(self) -> set[str]:
        return set(self.tensors) | set(self.values)


# ---------------------------------------------------------------------- DCP folders
def is_dcp_folder(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


def dcp_top_keys(folder: Path) -> set[str]:
    """The top-level keys of a DCP folder ("model", "optim", ...)."""
    return {key.split(".", 1)[0] for key in _metadata(folder).state_dict_metadata}


def dcp_world_size(folder: Path) -> int | None:
    """How many ranks wrote a DCP folder (its `__<rank>_<n>.distcp` files), None when it cannot tell."""
    ranks = {int(m.group(1)) for p in folder.iterdir() if (m := RANK_FILE.match(p.name))}
    return len(ranks) or None


def dcp_source(folder: Path, prefix: str) -> TensorSource:
    """The entries of DCP folder `folder` under top-level key `prefix`; tensors read one at a time."""
    tensors: dict[str, TensorEntry] = {}
    small: list[str] = []
    for key, meta in _metadata(folder).state_dict_metadata.items():
        if not key.startswith(prefix + "."):
            continue
        name = key[len(prefix) + 1 :]
        if isinstance(meta, TensorStorageMetadata) and len(meta.size) > 0:
            load = functools.partial(_read_dcp_tensor, folder, key, meta.size, meta.properties.dtype)
            tensors[name] = TensorEntry(meta.size, meta.properties.dtype, load)
        elif isinstance(meta, (TensorStorageMetadata, BytesStorageMetadata)):
            small.append(key)
    return TensorSource(folder, tensors, {k[len(prefix) + 1 :]: v for k, v in read_dcp_values(folder, small).items()})


def read_dcp_values(folder: Path, keys: list[str]) -> dict[str, Any]:
    """Small entries (scalars, 0-dim tensors, pickled values) of a DCP folder by flattened key."""
    meta = _metadata(folder).state_dict_metadata
    state: dict[str, Any] = {}
    for key in keys:
        entry = meta[key]
        state[key] = torch.empty((), dtype=entry.properties.dtype) if isinstance(entry, TensorStorageMetadata) else None
    if state:
        dcp.load(state, storage_reader=SafeFileSystemReader(folder), planner=SafeLoadPlanner(folder), no_dist=True)
    return state


def dcp_small_entries(folder: Path, tops: list[str]) -> dict[str, Any]:
    """The small entries (no tensor of one dimension or more) under top-level keys `tops`, by flattened key."""
    keys = [
        key
        for key, meta in _metadata(folder).state_dict_metadata.items()
        if key.split(".", 1)[0] in tops and not (isinstance(meta, TensorStorageMetadata) and len(meta.size) > 0)
    ]
    return read_dcp_values(folder, keys)


def _read_dcp_tensor(folder: Path, key: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    out = {key: torch.empty(shape, dtype=dtype)}
    dcp.load(out, storage_reader=SafeFileSystemReader(folder), planner=SafeLoadPlanner(folder), no_dist=True)
    return out[key]


@functools.lru_cache(maxsize=16)
def _metadata(folder: Path) -> Any:
    try:
        return read_metadata_file(folder / ".metadata")
    except UntrustedCheckpointError:
        raise
    except Exception as exc:
        raise ValueError(
            f"{folder / '.metadata'} is not a readable DCP metadata file ({type(exc).__name__}: {exc}); "
            "the save did not finish or the folder was not copied whole"
        ) from exc


# ---------------------------------------------------------------------- torch files
def load_torch_file(path: Path, *, trusted: bool = False) -> Any:
    """A `torch.save` file, memory-mapped (its tensors are read when used), read as data
    (`load_small_file`: tensors, containers, primitives, NumPy arrays) unless `trusted`.

    Raises:
        UntrustedCheckpointError: it holds another type (not `trusted`).
        ValueError: naming the file when torch cannot read it.
    """
    try:
        return load_small_file(path, name=path, trusted=trusted, mmap=True)
    except UntrustedCheckpointError:
        raise
    except Exception as exc:
        raise ValueError(f"{path} is not a readable torch checkpoint file ({type(exc).__name__}: {exc})") from exc


def dict_source(where: Path, state: Mapping[str, Any]) -> TensorSource:
    """A nested state dict (a full model or optimizer state dict) flattened into a `TensorSource`."""
    tensors: dict[str, TensorEntry] = {}
    values: dict[str, Any] = {}
    for key, value in _flatten(state):
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            tensors[key] = TensorEntry(value.shape, value.dtype, functools.partial(_copy, value))
        else:
            values[key] = value
    return TensorSource(where, tensors, values)


def _flatten(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """DCP's flattening: nested dicts and lists joined with dots ("param_groups.0.lr")."""
    if isinstance(value, Mapping):
        items: list[tuple[str, Any]] = []
        for key, inner in value.items():
            items += _flatten(inner, f"{prefix}{key}.")
        return items
    if isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
        items = []
        for i, inner in enumerate(value):
            items += _flatten(inner, f"{prefix}{i}.")
        return items
    return [(prefix[:-1], value)]


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone()

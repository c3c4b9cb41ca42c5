"""The tuner's decisions in a small JSON file, keyed by model, world and device, so a restarted
run takes the same setting without tuning again.

One file holds any number of decisions: `{key: {"label", "changes", "step_s", "table", ...}}`.
The key hashes what the measurement depends on: the model's class and parameter shapes, dtypes
and trainability, the example batch's shapes and dtypes, the world size and nodes, the device
(type and name), torch's version, the base settings that stay fixed and the tuning inputs.
Rank 0 reads and writes (atomically: a temporary file renamed over the old one).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import _torch_compat as tc
from ..config import FSDP2Config

CACHE_ENV = "FSDP2_TUNE_CACHE"
"""Environment variable naming the cache file (default `DEFAULT_CACHE` in the working directory)."""

DEFAULT_CACHE = "fsdp2_tune.json"
"""The cache file's name when `CACHE_ENV` is not set."""

FIXED_FIELDS = (
    "mixed_precision",
    "frozen_dtype",
    "cpu_offload",
    "activation_checkpointing",
    "accumulation",
    "collectives",
    "compile",
    "memory_budget",
    "wrap_policy",
    "blocks_per_group",
)
"""Base settings that are part of the key (a run with other ones tunes again)."""


def cache_path() -> Path:
    """Where decisions are kept: `$FSDP2_TUNE_CACHE`, else `fsdp2_tune.json` in the working directory."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def _stable(value: Any) -> str:
    """A repr without memory addresses (classes and functions by qualified name)."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return "[" + ",".join(sorted(_stable(v) for v in value)) + "]"
    if isinstance(value, type) or callable(value):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__name__)}"
    return repr(value)


def device_name(device_type: str) -> str:
    """The accelerator's product name, or the CPU's (platform and core count)."""
    if device_type != "cpu" and torch.accelerator.is_available():
        module = getattr(torch, device_type, None)
        if module is not None and hasattr(module, "get_device_name"):
            return str(module.get_device_name())
    return f"{platform.machine()} {platform.processor()} x{os.cpu_count()}"


def cache_key(
    model: nn.Module, batch: Any, config: FSDP2Config, world: int, nodes: int, device_type: str, **inputs: Any
) -> str:
    """The hash naming one decision (see the module docstring for what it covers)."""
    params = [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()]
    leaves = [(tuple(t.shape), str(t.dtype)) for t in tc.tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    parts = {
        "model": type(model).__qualname__,
        "params": params,
        "batch": leaves,
        "world": world,
        "nodes": nodes,
        "device": [device_type, device_name(device_type)],
        "torch": torch.__version__,
        "config": {f: _stable(getattr(config, f)) for f in FIXED_FIELDS},
        "inputs": {k: _stable(v) for k, v in sorted(inputs.items())},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def read_decision(path: Path, key: str) -> dict | None:
    """The decision stored under `key`, or None (no file, no entry, or an unreadable file)."""
    try:
        entry = json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return entry if isinstance(entry, dict) and isinstance(entry.get("changes"), dict) else None


def write_decision(path: Path, key: str, entry: dict) -> None:
    """Add or replace `key` in the file, keeping the other decisions."""
    try:
        data = json.loads(path.read_text())
        data = data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        data = {}
    data[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str))
    os.replace(tmp, path)

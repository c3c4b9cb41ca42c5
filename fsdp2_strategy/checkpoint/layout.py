"""What a checkpoint was saved as and what loads it: layouts named in load errors, and the optimizer's
parameter groups checked against the saved ones.

DCP reshards any checkpoint onto any mesh (`tests/core/checkpoint/test_resume_matrix.py`: six saved layouts, each
loaded on five and trained on exactly), so a load that fails has another cause: a different model,
optimizer or damaged files. Someone who moved a checkpoint between meshes suspects the move, so
every load error names both layouts (`layouts_note`): how many ranks saved it and how its tensors
were cut into chunks, and the loading world, its meshes and how it cuts the same tensors.

Parameter groups: torch's `set_optimizer_state_dict` maps saved groups onto the optimizer's by
parameter name, and where the optimizer has fewer groups it silently gives every parameter of a
group the hyperparameters of the one saved group it was asked for (an optimizer of one group
loading a checkpoint of two takes group 0's learning rate and weight decay for all). `load_dir`
calls `check_param_groups` before reading anything into a model and refuses such a load by name.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard

_SHOWN = 4  # chunk grids listed per layout
_MAX_LISTED = 8  # parameters listed in a group mismatch


def saved_world_size(metadata: Metadata) -> int:
    """Number of ranks that wrote the checkpoint (from the `__<rank>_<n>.distcp` file names)."""
    ranks = set()
    for info in (metadata.storage_data or {}).values():
        match = re.match(r"__(\d+)_", getattr(info, "relative_path", ""))
        if match:
            ranks.add(int(match.group(1)))
    return len(ranks) or 1


def _grid_name(grid: Sequence[int]) -> str:
    return "whole" if all(n == 1 for n in grid) else "x".join(map(str, grid))


def _grids(counter: Counter) -> str:
    shown = ", ".join(f"{grid} ({n})" for grid, n in counter.most_common(_SHOWN))
    rest = sum(counter.values()) - sum(n for _, n in counter.most_common(_SHOWN))
    return shown + (f", other ({rest})" if rest else "")


def saved_layout(metadata: Metadata, prefix: str) -> str:
    """How the tensors under `prefix` were saved: by how many ranks, cut into which chunk grids
    (chunks per dimension, "whole" for one chunk), with the number of tensors of each grid."""
    grids: Counter = Counter()
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata) and len(meta.size) > 0:
            per_dim = [len({chunk.offsets[d] for chunk in meta.chunks}) for d in range(len(meta.size))]
            grids[_grid_name(per_dim)] += 1
    return f"saved by {saved_world_size(metadata)} rank(s), tensors in chunk grids {_grids(grids) or 'none'}"


def _mesh_name(tensor: DTensor) -> str:
    mesh = tensor.device_mesh
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return " x ".join(f"{name}={size}" for name, size in zip(names, mesh.shape))


def model_layout(state: Mapping[str, Any]) -> str:
    """How this process's model state `state` (a sharded state dict) is laid out: the world, the
    meshes its tensors live on and the chunk grids they are cut into."""
    world = f"{dist.get_world_size()} rank(s)" if dist.is_initialized() else "one process without a process group"
    grids: Counter = Counter()
    meshes: Counter = Counter()
    for value in state.values():
        if not isinstance(value, torch.Tensor) or value.ndim == 0:
            continue
        per_dim = [1] * value.ndim
        if isinstance(value, DTensor):
            meshes[_mesh_name(value)] += 1
            for size, placement in zip(value.device_mesh.shape, value.placements):
                if isinstance(placement, Shard):  # also torch's strided shards (FSDP over TP)
                    per_dim[placement.dim] *= size
        grids[_grid_name(per_dim)] += 1
    mesh_text = ", ".join(f"mesh {name}" for name, _ in meshes.most_common()) or "no mesh (plain tensors)"
    return f"{world}, {mesh_text}, tensors in chunk grids {_grids(grids) or 'none'}"


def layouts_note(metadata: Metadata, model_states: Mapping[str, Mapping[str, Any]]) -> str:
    """One paragraph naming the checkpoint's layout and the loading model's, per model key."""
    lines = [
        f"Layouts of {key!r}: checkpoint {saved_layout(metadata, key + '.')}; this model {model_layout(state)}."
        for key, state in model_states.items()
    ]
    if not lines:
        lines = [f"Checkpoint layout: {saved_layout(metadata, '')}."]
    return "\n".join(lines) + "\nA change of layout alone loads (DCP reshards on read); the problem is the one above."


@contextlib.contextmanager
def layouts_named(metadata: Metadata, model_states: Mapping[str, Mapping[str, Any]]) -> Iterator[None]:
    """Around a load: a ValueError or RuntimeError raised inside comes out of the same kind with
    `layouts_note` appended (the original chained as its cause)."""
    try:
        yield
    except (ValueError, RuntimeError) as exc:
        kind = ValueError if isinstance(exc, ValueError) else RuntimeError
        raise kind(f"{exc}\n{layouts_note(metadata, model_states)}") from exc


# ---------------------------------------------------------------------- parameter groups
def saved_group_keys(keys: Iterable[str], key: str) -> list[str]:
    """Among checkpoint keys `keys`, the `<key>.param_groups.<i>.params` entries (one per saved
    optimizer group), in group order."""
    pattern = re.compile(re.escape(key) + r"\.param_groups\.(\d+)\.params$")
    found = {int(m.group(1)): k for k in keys if (m := pattern.match(k))}
    return [found[i] for i in sorted(found)]


def group_mismatch(key: str, saved: Sequence[Sequence[str]], current: Sequence[Sequence[str]]) -> str | None:
    """Why the optimizer under `key`, whose groups hold the parameter names `current`, cannot take
    the groups `saved` (names per saved group); None when every parameter it updates was saved in a
    group together with exactly the same others. Group order may differ (torch maps by name), and an
    optimizer over fewer parameters than the saved one is fine."""
    mine = {name for group in current for name in group}
    saved_part = {name: frozenset(n for n in group if n in mine) for group in saved for name in group}
    current_part = {name: frozenset(group) for group in current for name in group}
    moved = sorted(name for name in mine if saved_part.get(name) != current_part[name])
    if not moved:
        return None
    listed = ", ".join(moved[:_MAX_LISTED]) + (
        f", ... and {len(moved) - _MAX_LISTED} more" if len(moved) > _MAX_LISTED else ""
    )
    detail = f"grouped differently or not saved: {listed}"
    return (
        f"optimizer {key!r}: the checkpoint holds {len(saved)} parameter group(s) of sizes "
        f"{[len(g) for g in saved]}, this optimizer {len(current)} of sizes {[len(g) for g in current]} ({detail}). "
        "torch would give each parameter the hyperparameters of another group; build the optimizer with the "
        "same parameter groups as the run that saved it, or load without optimizer= and keep this optimizer's state."
    )


def check_param_groups(path: Path, saved: Mapping[str, Any], requested: Mapping[str, Any]) -> None:
    """Raise ValueError if an optimizer's parameter groups differ from the saved ones (`group_mismatch`).

    `saved`: the checkpoint's `<key>.param_groups.<i>.params` entries, read (`saved_group_keys`);
    `requested`: each optimizer's state by key, as torch names it (`param_groups` with parameter names).
    """
    problems = []
    for key, state in requested.items():
        groups = [saved[k] for k in saved_group_keys(saved, key)]
        current = [list(group["params"]) for group in state.get("param_groups", [])]
        problem = group_mismatch(key, groups, current)
        if problem:
            problems.append(problem)
    if problems:
        raise ValueError(f"Checkpoint {path} does not match the optimizer:\n  " + "\n  ".join(problems))

"""Tensor parallelism applied before FSDP: the plan, its checks, and splitting the device mesh.

With `FSDP2Config.tensor_parallel_size = k > 1` the world is a (data parallel..., "tp") mesh:
`parallelize_module` splits the planned modules over the `k` ranks of the "tp" dim first, then
`fully_shard` shards every group over the data-parallel dims (FSDP2 handles parameters that
are DTensors already: "2-D" FSDP + TP). Both meshes come from one parent mesh, which FSDP2
requires.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

TP_DIM = "tp"
"""Name of the tensor-parallel dim in meshes the core builds."""

STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "sequence_parallel": SequenceParallel,
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    # What transformers >= 5.25 puts in a model's `_tp_plan` for the embeddings and the LM head.
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
}
"""Plan strings (Hugging Face's names) and the torch style each means."""
_KIND = {"colwise_gather_output": "colwise", "embedding_rowwise": "rowwise", "embedding_colwise": "colwise"}
"""The split (colwise, rowwise) of a plan string that does not name it plainly."""

# Which weight dim a style splits, per module type: the size that must divide by the TP size.
_SPLIT_DIM = {
    ("colwise", nn.Linear): 0,
    ("rowwise", nn.Linear): 1,
    ("colwise", nn.Embedding): 1,
    ("rowwise", nn.Embedding): 0,
}
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "n_heads", "heads")


def check_plan(plan: Any, field: str) -> None:
    """Raise ValueError unless `plan` has one of the accepted forms (checked again on a model)."""
    if plan == "auto" or (callable(plan) and not isinstance(plan, type)):
        return
    if isinstance(plan, Mapping) and all(isinstance(k, str) for k in plan):
        bad = {k: v for k, v in plan.items() if not (isinstance(v, ParallelStyle) or v in STYLES)}
        if not bad:
            return
        raise ValueError(f"{field} has invalid styles {bad}; use one of {sorted(STYLES)} or a torch ParallelStyle.")
    raise ValueError(
        f"{field}={plan!r} is invalid; use 'auto' (a Hugging Face model's declared plan), a dict of module-name "
        f"globs to {sorted(STYLES)} or ParallelStyle objects, or a callable (model, tp_mesh)."
    )


def declared_plan(model: nn.Module) -> dict[str, Any]:
    """The plan a Hugging Face model declares (`_tp_plan`, else its config's `base_model_tp_plan`
    under `base_model_prefix`); {} when it declares none."""
    plan = getattr(model, "_tp_plan", None)
    if plan:
        return dict(plan)
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        return {f"{prefix}.{k}": v for k, v in base.items()}
    return dict(base)


def resolve_plan(model: nn.Module, plan: Any) -> dict[str, tuple[str, ParallelStyle]]:
    """Module name -> (label, torch style) for a dict or "auto" plan; modules the user already
    parallelised (DTensor parameters) are skipped. Raises ValueError for a glob matching nothing."""
    spec = declared_plan(model) if plan == "auto" else dict(plan)
    if not spec:
        raise ValueError(
            f"FSDP2Config.tensor_parallel_plan='auto' found no plan on {type(model).__name__} (a Hugging Face model "
            "declares one as base_model_tp_plan); give a dict such as {'layers.*.mlp.fc1': 'colwise', "
            "'layers.*.mlp.fc2': 'rowwise'} or a callable (model, tp_mesh)."
        )
    check_plan(spec, "FSDP2Config.tensor_parallel_plan")
    names = [n for n, _ in model.named_modules() if n]
    resolved: dict[str, tuple[str, ParallelStyle]] = {}
    for pattern, style in spec.items():
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            raise ValueError(
                f"FSDP2Config.tensor_parallel_plan: {pattern!r} matches no module of {type(model).__name__}."
            )
        for name in matched:
            if name not in resolved and not _user_parallelised(model.get_submodule(name)):
                resolved[name] = (style, STYLES[style]()) if isinstance(style, str) else (type(style).__name__, style)
    return resolved


def check_sizes(model: nn.Module, plan: Mapping[str, tuple[str, ParallelStyle]], tp_size: int) -> None:
    """Raise ValueError naming `tensor_parallel_size` where a split dim or a head count does not divide."""
    problems = []
    for name, (label, _) in plan.items():
        module = model.get_submodule(name)
        kind = _KIND.get(label, label.removesuffix("_rep"))
        dim = next((d for (k, cls), d in _SPLIT_DIM.items() if k == kind and isinstance(module, cls)), None)
        weight = cast(torch.Tensor, module.weight) if dim is not None else None
        if dim is not None and weight is not None and weight.shape[dim] % tp_size:
            problems.append(f"{name}: {kind} splits a dim of size {weight.shape[dim]}")
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        for attr in _HEAD_ATTRS:
            heads = getattr(parent, attr, None)
            if isinstance(heads, int) and not isinstance(heads, bool) and heads % tp_size:
                problems.append(f"{name.rpartition('.')[0] or '<root>'}.{attr}={heads} heads")
    if problems:
        raise ValueError(
            f"FSDP2Config.tensor_parallel_size={tp_size} does not divide: "
            + "; ".join(sorted(set(problems)))
            + ". Pick a tensor_parallel_size that divides these sizes."
        )


def apply_tensor_parallel(model: nn.Module, plan: Any, tp_mesh: DeviceMesh) -> dict[str, str]:
    """Parallelise `model` on `tp_mesh` by `plan`; returns {module name: style} (`shard_model`
    records each in the module's engine state, for the sharding plan)."""
    if callable(plan) and not isinstance(plan, Mapping):
        before = {n for n, m in model.named_modules() if _user_parallelised(m)}
        result = plan(model, tp_mesh)
        if result is not None and result is not model:
            raise ValueError(
                "FSDP2Config.tensor_parallel_plan callable must parallelise the model in place and "
                "return None or the same model."
            )
        styles = {n: "callable" for n, m in model.named_modules() if _user_parallelised(m) and n not in before}
    elif plan == "auto" and not declared_plan(model) and any(_user_parallelised(m) for m in model.modules()):
        styles = {}  # no declared plan, and the user parallelised the model (e.g. in configure_model)
    else:
        resolved = resolve_plan(model, plan)
        check_sizes(model, resolved, tp_mesh.size())
        parallelize_module(model, tp_mesh, {n: style for n, (_, style) in resolved.items()})
        styles = {n: label for n, (label, _) in resolved.items()}
    return styles


def _user_parallelised(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters(recurse=False))


def user_parallelised_modules(model: nn.Module) -> list[nn.Module]:
    """Modules whose own parameters are DTensors already (parallelised by the user before FSDP)."""
    return [m for m in model.modules() if _user_parallelised(m)]

"""The meta-device copy of the model and batch that `estimate_memory` runs, and its default loss."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .. import _torch_compat as tc
from .sim_quantised import compute_as_dense, dense_stand_in, quantised_kind


def meta_copy(model: nn.Module, batch: Any, compute_dtype: torch.dtype | None, cast_inputs: bool, seq_split: int = 1):
    """A meta-device copy of `model` (floating parameters in `compute_dtype`; bitsandbytes layers as
    the dense layers they compute like) and of `batch`, whose tensors with a sequence dim (dim 1)
    hold 1/`seq_split` of it: one context-parallel rank's part (`FSDP2Config.context_parallel_size`)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if quantised_kind(p):
            memo[id(p)] = dense_stand_in(p, compute_dtype)
            continue
        dtype = compute_dtype if compute_dtype is not None and p.is_floating_point() else p.dtype
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta", dtype=dtype), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    sim = copy.deepcopy(model, memo)
    compute_as_dense(sim)
    sim.train()

    def to_meta(t: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype if cast_inputs and compute_dtype is not None and t.is_floating_point() else t.dtype
        shape = list(t.shape)
        if seq_split > 1 and len(shape) > 1:
            shape[1] //= seq_split
        return torch.empty(shape, device="meta", dtype=dtype)

    return sim, (None if batch is None else tc.tree_map_only(torch.Tensor, to_meta, batch))


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The output's `.loss` (Hugging Face models given labels), else the first output tensor's mean."""
    out = call_model(model, batch)
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, Mapping):  # Hugging Face ModelOutput is an OrderedDict
        out = list(out.values())
    first = next(t for t in tc.tree_flatten(out)[0] if isinstance(t, torch.Tensor))
    return first.float().mean()


def call_model(model: nn.Module, batch: Any) -> Any:
    """`model(*batch)` for a tuple/list, `model(**batch)` for a dict, else `model(batch)`."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)

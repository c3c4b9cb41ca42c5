"""Each FSDP group's bytes per rank, by form, from the model's parameter shapes and the resolved groups.

What `shard_model` would create: padded dim-0 shards in the storage dtype (frozen parameters in
`FSDP2Config.frozen_dtype`), the gathered parameters in the compute dtype, and gradients, their
reduce-scatter input and optimizer state for the trainable parameters only. bitsandbytes weights
as `sim_quantised` says: packed bytes sharded (4-bit, `quantised_weights="shard"`) or kept whole,
their quantisation state whole on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..groups import GroupSpec
from ..precision import frozen_storage_dtype
from .sim_quantised import quantised_bytes, quantised_kind


@dataclass
class GroupSizes:
    """Bytes one FSDP group holds per rank, by form."""

    params: list = field(default_factory=list)
    """Qualified names of the sharded parameters this group gathers."""
    members: list = field(default_factory=list)
    """The modules sharded together in this group (`FSDP2Config.blocks_per_group`; one otherwise)."""
    sharded: int = 0
    """Padded shard of those parameters on one rank (their own dtype; frozen ones in `frozen_dtype`)."""
    trainable_sharded: int = 0
    """Part of `sharded` whose parameters require gradients: what gradients and optimizer state cover."""
    gathered: int = 0
    """The unsharded parameters in the compute dtype."""
    mp_copy: int = 0
    """Part of `gathered` that is a low-precision copy (0 without mixed precision)."""
    reduce_bytes: int = 0
    """Unsharded gradients (of the trainable parameters) in the reduce dtype."""
    reduce_input: int = 0
    """The flat reduce-scatter input: `reduce_bytes` with every dim 0 padded to the shard size."""
    replicated: int = 0
    """Parameters FSDP does not shard here (scalars, ignored modules): every rank holds them."""
    quantised_whole: int = 0
    """bitsandbytes bytes every rank holds whole (quantisation states; weights kept whole): frozen,
    so without gradient or optimizer state."""
    buffers: int = 0
    """Module buffers owned by this group."""
    shard_size: int = 1
    """Ranks this group's parameters are sharded over."""
    replicate_size: int = 1
    """Replicas of each shard (HSDP / NO_SHARD)."""
    keep_after_forward: bool = False
    """The group stays gathered between forward and backward (reshard_after_forward False)."""
    reshard_to: int = 0
    """An int `reshard_after_forward`: after forward it holds 1/reshard_to of `gathered`."""
    mp_dtype: torch.dtype | None = None
    """The compute dtype of the mixed-precision policy (None: each parameter's own)."""
    reduce_dtype: torch.dtype | None = None
    """The gradient-reduction dtype (None: the compute dtype)."""


def _nearest(name: str, group_of: dict[str, str]) -> str:
    """The group owning module `name`: its nearest enclosing group member's group."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in group_of:
            return group_of[prefix]
    return ""


def _padded_shard_numel(p: torch.Tensor, shard: int) -> int:
    """FSDP2 shards dim 0 and pads it to a multiple of the shard size."""
    return math.ceil(p.shape[0] / shard) * (p.numel() // max(p.shape[0], 1))


def _padded_shard_bytes(p: torch.Tensor, shard: int) -> int:
    return _padded_shard_numel(p, shard) * p.element_size()


def group_sizes(
    model: nn.Module,
    specs: list[GroupSpec],
    ignored: list[str],
    frozen_dtype: object,
    mesh_of: Callable[[str], tuple[int, int]],
    quantised_weights: str = "shard",
) -> dict[str, GroupSizes]:
    """Sizes of every group ("" is the root) of `specs` (`groups.resolve_groups`, root first), from
    parameter shapes; frozen parameters stored as `frozen_dtype` says (`FSDP2Config.frozen_dtype`),
    bitsandbytes ones as `quantised_weights` does (`FSDP2Config.quantised_weights`)."""
    sizes = {s.name: GroupSizes(members=list(s.modules)) for s in specs}
    group_of = {m: s.name for s in specs[1:] for m in s.modules}
    for spec in specs:
        settings = spec.settings
        g = sizes[spec.name]
        g.shard_size, g.replicate_size = mesh_of(settings.strategy)
        reshard = settings.effective_reshard(is_root=spec.name == "")
        # A shard group of one rank still frees its all-gather output after forward when resharding
        # (HYBRID_SHARD on a (2, 1) mesh peaks below NO_SHARD).
        g.keep_after_forward = reshard is False
        g.reshard_to = reshard if isinstance(reshard, int) and not isinstance(reshard, bool) else 0
        g.mp_dtype, g.reduce_dtype = settings.mp_policy.param_dtype, settings.mp_policy.reduce_dtype
    ignored_params = {id(p) for n in ignored for p in model.get_submodule(n).parameters()}
    for pname, p in model.named_parameters():
        owner = sizes[_nearest(pname.rsplit(".", 1)[0] if "." in pname else "", group_of)]
        if id(p) in ignored_params or p.ndim == 0:
            owner.replicated += p.numel() * p.element_size()
            continue
        kind = quantised_kind(p)
        if kind is not None:
            _add_quantised(owner, pname, p, sharded=kind == "4bit" and quantised_weights == "shard")
            continue
        compute = owner.mp_dtype if owner.mp_dtype is not None and p.is_floating_point() else p.dtype
        stored = p.dtype if p.requires_grad else frozen_storage_dtype(frozen_dtype, owner.mp_dtype, p)
        owner.params.append(pname)
        shard_numel = _padded_shard_numel(p, owner.shard_size)
        owner.sharded += shard_numel * _itemsize(stored)
        gathered = p.numel() * _itemsize(compute)
        owner.gathered += gathered
        owner.mp_copy += gathered if compute != stored else 0
        if p.requires_grad:  # FSDP2 allocates and reduces gradients only for these
            reduce = owner.reduce_dtype or compute
            owner.trainable_sharded += shard_numel * _itemsize(stored)
            owner.reduce_bytes += p.numel() * _itemsize(reduce)
            owner.reduce_input += shard_numel * owner.shard_size * _itemsize(reduce)
    for bname, b in model.named_buffers():
        sizes[_nearest(bname.rsplit(".", 1)[0] if "." in bname else "", group_of)].buffers += (
            b.numel() * b.element_size()
        )
    return sizes


def _add_quantised(owner: GroupSizes, name: str, p: torch.Tensor, sharded: bool) -> None:
    """A bitsandbytes weight: its packed bytes sharded as a uint8 column, or kept whole; its
    quantisation state whole on every rank; no gradient, no optimizer state, no compute-dtype copy."""
    packed, state = quantised_bytes(p)
    owner.quantised_whole += state
    if not sharded:
        owner.quantised_whole += packed
        return
    owner.params.append(name)
    owner.sharded += math.ceil(packed / owner.shard_size)
    owner.gathered += packed


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()

"""`sharding_plan`: what was sharded, how, and what it costs each rank."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ..groups import own_named_params
from ..precision import describe_precision
from ..train import (
    DEFAULT_MODE,
    SCALAR_REASON,
    accumulation_mode,
    mode_of,
    recorded_state,
    replicated_params_of,
)
from .host_memory import freed_memory_kept
from .quantised import QUANTISED_REASON, packed_weight_count


@dataclass
class GroupPlan:
    """One FSDP group (one `fully_shard` call) or the replicated / ignored remainder."""

    name: str
    """Qualified module name ("<root>" for the model itself)."""
    module_type: str
    """Class name of the module."""
    num_params: int
    """Parameter elements managed by this group (unsharded count; a 4-bit weight counts its weights,
    not its packed bytes)."""
    local_bytes: int
    """Bytes of those parameters held by this rank."""
    mesh_shape: tuple
    """Shape of the device mesh, e.g. (2,) or (1, 2)."""
    strategy: str
    """Sharding strategy name, "REPLICATED" for scalars, "IGNORED" for ignored modules."""
    reshard_after_forward: object
    """The reshard choice given to `fully_shard`."""
    precision: str
    """Compute/reduce dtypes, "param" when the parameter dtype is kept."""
    cpu_offload: bool = False
    """Whether this group's parameters live on CPU."""
    tensor_parallel: str = "-"
    """Tensor-parallel styles of the modules in this group, e.g. "colwise 3, rowwise 2"."""
    note: str = ""
    """Why a choice differs from the global config (override glob, last block)."""


@dataclass
class ShardingPlan:
    """The plan of a sharded model; `str()` renders a table."""

    groups: list[GroupPlan] = field(default_factory=list)
    accumulation: str = DEFAULT_MODE.name
    """The `FSDP2Config.accumulation` mode `f2.no_sync` follows for this model."""
    ring_groups: int = 0
    """FSDP groups whose all-gather and reduce-scatter run as point-to-point rings
    (`FSDP2Config.collectives`); the others use torch's collectives."""
    freed_memory_kept: bool = False
    """Whether this process's malloc keeps freed host memory (`FSDP2Config.host_allocator`)."""
    wrap_choice: str = ""
    """What `wrap_policy="auto"` chose and why ("" for another policy)."""
    loss: str = ""
    """What computes a causal LM's training loss (`FSDP2Config.chunked_loss`; "" if not sharded by
    `shard_model`)."""

    @property
    def total_params(self) -> int:
        return sum(g.num_params for g in self.groups)

    @property
    def local_bytes(self) -> int:
        return sum(g.local_bytes for g in self.groups)

    def __str__(self) -> str:
        header: tuple[str, ...] = (
            "group",
            "type",
            "params",
            "MiB/rank",
            "mesh",
            "strategy",
            "reshard",
            "precision",
            "offload",
            "tp",
            "note",
        )
        rows: list[tuple[str, ...]] = [header] + [
            (
                g.name,
                g.module_type,
                f"{g.num_params:,}",
                f"{g.local_bytes / 2**20:.2f}",
                "x".join(map(str, g.mesh_shape)),
                g.strategy,
                str(g.reshard_after_forward),
                g.precision,
                "yes" if g.cpu_offload else "no",
                g.tensor_parallel,
                g.note,
            )
            for g in self.groups
        ]
        rows.append(("total", "", f"{self.total_params:,}", f"{self.local_bytes / 2**20:.2f}", *[""] * 7))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if self.wrap_choice:
            lines.append(f"wrap policy: {self.wrap_choice}")
        if self.loss:
            lines.append(f"loss: {self.loss}")
        lines.append(f"gradient accumulation: {self.accumulation} ({accumulation_mode(self.accumulation).summary})")
        sharded = sum(g.strategy not in ("REPLICATED", "IGNORED") for g in self.groups)
        lines.append(
            f"collectives: point-to-point rings on {self.ring_groups} of {sharded} FSDP groups, torch's on the rest"
            if self.ring_groups
            else "collectives: torch's"
        )
        lines.append(
            "host memory: glibc malloc keeps freed blocks for reuse"
            if self.freed_memory_kept
            else "host memory: malloc's own settings"
        )
        return "\n".join(lines)


def _managed_params(module: nn.Module) -> list[DTensor]:
    return [p for _, p in own_named_params(module) if isinstance(p, DTensor)]


def _local_bytes(p) -> int:
    local = p.to_local() if isinstance(p, DTensor) else p
    return local.numel() * local.element_size()


def sharding_plan(model: nn.Module) -> ShardingPlan:
    """Describe every FSDP group of `model` plus replicated scalars, one row each.

    Args:
        model: A model `shard_model` (or `fully_shard`) sharded.

    Returns:
        One row per group (its modules, parameter count, mesh, resharding and precision notes) and
        per replicated parameter set, with the accumulation mode; `str()` of it is a table.
    """
    root = recorded_state(model)
    plan = ShardingPlan(
        accumulation=mode_of(model).name,
        freed_memory_kept=freed_memory_kept(),
        wrap_choice=root.wrap_choice if root is not None else "",
        loss=root.loss_choice if root is not None else "",
    )
    counts = _weight_counts(model)
    for name, module in model.named_modules():
        is_group = isinstance(module, FSDPModule)  # (a flag: `module` stays typed as nn.Module)
        state = recorded_state(module)
        settings = state.group if state is not None else None
        members = settings.members if settings is not None else ()
        if not is_group or (members and name != members[0]):  # a group sharded together: one row
            continue
        params = [p for m in members or [name] for p in _managed_params(model.get_submodule(m))]
        name = " + ".join(members) if members else name
        plan.ring_groups += bool(state is not None and state.ring_comms)
        # With tensor parallel, TP'd parameters live on the (data, tp) mesh, the others on data only.
        mesh_shape = max((tuple(p.device_mesh.shape) for p in params), key=len, default=())
        note = ""
        if settings is not None and settings.override:
            note = f"override {settings.override!r}"
        elif settings is not None and settings.reshard_reason:
            note = settings.reshard_reason
        if settings is not None and settings.precision_note:
            note = "; ".join(filter(None, (note, settings.precision_note)))
        packed = [p for p in params if id(p) in counts]
        if packed:
            note = "; ".join(filter(None, (note, f"{len(packed)} 4-bit weights sharded as packed bytes")))
        plan.groups.append(
            GroupPlan(
                name=name or "<root>",
                module_type=type(module).__name__.removeprefix("FSDP"),
                num_params=sum(counts.get(id(p), p.numel()) for p in params),
                local_bytes=sum(_local_bytes(p) for p in params),
                mesh_shape=mesh_shape,
                strategy=settings.strategy if settings else "fully_shard",
                reshard_after_forward=settings.reshard_after_forward if settings else "?",
                precision=describe_precision(settings.mp_policy) if settings else "?",
                cpu_offload=settings.cpu_offload if settings else False,
                tensor_parallel=_tp_summary(module),
                note=note if settings else "sharded by the user",
            )
        )
    replicated = replicated_params_of(model)
    for reason, by_name in (replicated.by_reason() if replicated is not None else {}).items():
        assert replicated is not None
        scalar = reason == SCALAR_REASON
        plan.groups.append(
            GroupPlan(
                name=", ".join(by_name) if scalar else _owner_names(by_name),
                module_type="scalar" if scalar else "quantised" if reason == QUANTISED_REASON else "replicate",
                num_params=sum(counts.get(id(p), p.numel()) for p in by_name.values()),
                local_bytes=sum(_local_bytes(p) for p in by_name.values()),
                mesh_shape=tuple(replicated.mesh.shape),
                strategy="REPLICATED",
                reshard_after_forward="-",
                precision="param",
                note=reason,
            )
        )
    return plan


def _weight_counts(model: nn.Module) -> dict[int, int]:
    """`id(parameter)` -> weights it holds, for the 4-bit ones (whose elements are packed bytes)."""
    counts = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            count = packed_weight_count(module, p)
            if count is not None:
                counts[id(p)] = count
    return counts


def _tp_summary(group: nn.Module) -> str:
    """The TP styles inside one FSDP group (nested groups excluded), e.g. "colwise 3, rowwise 2"."""
    counts: dict[str, int] = {}
    stack = [group]
    while stack:
        module = stack.pop()
        state = recorded_state(module)
        if state is not None and state.tp_style:
            counts[state.tp_style] = counts.get(state.tp_style, 0) + 1
        stack.extend(c for c in module.children() if not isinstance(c, FSDPModule))
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "-"


def _owner_names(params: dict) -> str:
    """The modules owning `params` ("a.weight", "a.bias", "b" -> "a, b"), at most six named."""
    owners = list(dict.fromkeys(n.rpartition(".")[0] or n for n in params))
    return ", ".join(owners[:6]) + (f", ... (+{len(owners) - 6})" if len(owners) > 6 else "")


def rank_param_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds (local shards plus plain tensors)."""
    return sum(_local_bytes(p) for p in {id(p): p for p in model.parameters()}.values())

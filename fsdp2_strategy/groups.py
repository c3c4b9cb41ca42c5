"""FSDP groups: which modules get their own group, and with which settings.

A group is one `fully_shard` call. This module decides the list of groups (policy, module
overrides, tied weights, already-sharded subtrees, `blocks_per_group`) and each group's resolved
settings: `resolve_groups` returns them as `GroupSpec`s, once, for `shard_model` to apply and the
memory estimator to play. It does not shard anything itself.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, replace

from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy

from .config import FSDP2Config
from .distributed import log_rank_zero
from .mesh import default_reshard_after_forward
from .precision import resolve_mixed_precision, resolve_offload
from .wrap_policy import match_override, modules_matching, select_wrapped, wrappable


@dataclass(frozen=True)
class GroupSettings:
    """What one `fully_shard` call receives, plus the text the plan shows."""

    strategy: str
    reshard_after_forward: bool | int | None
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy
    cpu_offload: bool
    override: str | None = None
    """The module_overrides glob that produced these settings, if any."""
    reshard_reason: str = ""
    """Why the reshard choice differs from the strategy's (shown in the plan)."""
    precision_note: str = ""
    """Precision work beyond `mp_policy` (FSDP1's root input cast, buffer_dtype), for the plan."""
    members: tuple[str, ...] = ()
    """The modules sharded together in this group (`FSDP2Config.blocks_per_group`), when several."""

    def effective_reshard(self, is_root: bool) -> bool | int:
        """The reshard choice that happens: torch's None keeps the root gathered, reshards the rest."""
        return self.reshard_after_forward if self.reshard_after_forward is not None else not is_root


@dataclass(frozen=True)
class GroupSpec:
    """One `fully_shard` call, every setting resolved (`resolve_groups`)."""

    name: str
    """The group's (first) module's qualified name; "" for the root."""
    modules: tuple[str, ...]
    """The modules sharded together in this call (one, unless `blocks_per_group` > 1)."""
    settings: GroupSettings
    """Strategy, reshard choice (and why), precision and offload policies, override."""


def resolve_groups(model: nn.Module, config: FSDP2Config, ignored: list[str]) -> list[GroupSpec]:
    """Every group of `model` under `config`, the root first, each with its settings resolved: the
    strategy's reshard choice, or False for the last block (backward starts with it: resharding it
    after forward would only all-gather it again at once) unless the config or an override says.

    Args:
        model: The model (real or a meta copy).
        config: The config; its `sharding_strategy` must be concrete.
        ignored: The modules `config.ignored_modules` selects (`ignored_names`).

    Returns:
        The root's spec, then one per `fully_shard` call below it, in module order.
    """
    members = group_members(select_groups(model, config, ignored), config)
    last = list(members)[-1] if members else None
    specs = []
    for name in ["", *members]:
        settings = settings_for(name, config)
        modules = tuple(members.get(name, [name]))
        if len(modules) > 1:
            settings = replace(settings, members=modules)
        if name and name == last and settings.reshard_after_forward is None and settings.override is None:
            settings = replace(settings, reshard_after_forward=False, reshard_reason="last block")
        if settings.reshard_after_forward is None:
            settings = replace(settings, reshard_after_forward=default_reshard_after_forward(settings.strategy))
        specs.append(GroupSpec(name, modules, settings))
    return specs


def settings_for(name: str, config: FSDP2Config) -> GroupSettings:
    """Global settings with the first matching `module_overrides` entry applied."""
    pattern = match_override(name, config.module_overrides) if name else None
    override = config.module_overrides.get(pattern) if pattern else None
    strategy = config.sharding_strategy
    reshard = config.reshard_after_forward
    precision = config.mixed_precision
    offload = config.cpu_offload
    if override is not None:
        if override.sharding_strategy is not None:
            strategy = override.sharding_strategy
            # A strategy override also brings its own reshard default unless given explicitly.
            reshard = override.reshard_after_forward
        elif override.reshard_after_forward is not None:
            reshard = override.reshard_after_forward
        if override.mixed_precision is not None:
            precision = override.mixed_precision
        if override.cpu_offload is not None:
            offload = override.cpu_offload
    field = f"FSDP2Config.module_overrides[{pattern!r}]" if pattern else "FSDP2Config.mixed_precision"
    return GroupSettings(
        strategy=strategy,
        reshard_after_forward=reshard,
        mp_policy=resolve_mixed_precision(precision, field),
        offload_policy=resolve_offload(offload),
        cpu_offload=offload,
        override=pattern,
    )


def _prefixes(name: str) -> list[str]:
    """ "a.b.c" -> ["a", "a.b", "a.b.c"]."""
    parts = name.split(".") if name else []
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _nearest_group(name: str, wrapped: set[str]) -> str:
    for prefix in reversed(_prefixes(name)):
        if prefix in wrapped:
            return prefix
    return ""


def _common_prefix(names: list[str]) -> str:
    split = [n.split(".") if n else [] for n in names]
    common: list[str] = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


def merge_tied_groups(model: nn.Module, wrapped: list[str]) -> list[str]:
    """Drop wrapped modules that would split a tied parameter across two groups.

    torch raises when a parameter is "shared with a parameter already managed by another FSDP
    group"; keeping all owners of a tied weight (embedding and output head) in the group of
    their closest common ancestor avoids that and gathers the weight once.
    """
    owners: dict[int, list[str]] = defaultdict(list)
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for _, param in module.named_parameters(recurse=False):
            owners[id(param)].append(mod_name)
    keep = set(wrapped)
    for names in owners.values():
        if len(names) < 2 or len({_nearest_group(n, keep) for n in names}) == 1:
            continue
        ancestor = _common_prefix(names)
        dropped = sorted({p for n in names for p in _prefixes(n) if p in keep and len(p) > len(ancestor)})
        keep.difference_update(dropped)
        log_rank_zero(
            "Tied parameter shared by %s: not sharding %s separately; the weight stays in group %r.",
            ", ".join(repr(n) for n in names),
            ", ".join(repr(d) for d in dropped),
            ancestor or "<root>",
        )
    return [n for n in wrapped if n in keep]


def already_sharded(model: nn.Module) -> list[str]:
    """Submodules the user sharded with `fully_shard` before us: left exactly as they are."""
    return [n for n, m in model.named_modules() if n and isinstance(m, FSDPModule)]


def select_groups(model: nn.Module, config: FSDP2Config, ignored_names: list[str]) -> list[str]:
    """Qualified names of the non-root groups, parents before children."""
    skip = tuple(ignored_names) + tuple(already_sharded(model))
    wrapped = set(select_wrapped(model, config.wrap_policy, skip=skip))
    if config.module_overrides:
        patterns = list(config.module_overrides)
        matched = [n for n, _ in model.named_modules() if wrappable(n, skip) and match_override(n, patterns)]
        for pattern in patterns:
            if not any(match_override(n, [pattern]) for n, _ in model.named_modules() if n):
                raise ValueError(
                    f"FSDP2Config.module_overrides[{pattern!r}] matches no module of {type(model).__name__}; "
                    f"qualified names look like {[n for n, _ in model.named_modules() if n][:6]}."
                )
        wrapped.update(matched)
    ordered = [n for n, _ in model.named_modules() if n in wrapped]
    return merge_tied_groups(model, ordered)


def ignored_names(model: nn.Module, config: FSDP2Config) -> list[str]:
    """Qualified names of the modules `config.ignored_modules` selects in `model`."""
    if not config.ignored_modules:
        return []
    return modules_matching(model, config.ignored_modules, "FSDP2Config.ignored_modules")


def block_count(model: nn.Module, config: FSDP2Config) -> int:
    """How many top-level groups (blocks) `config`'s policy makes of `model`, before any
    `blocks_per_group` merging."""
    return len(top_level(select_groups(model, config, ignored_names(model, config))))


def group_members(groups: list[str], config: FSDP2Config) -> dict[str, list[str]]:
    """Every group as one `fully_shard` call: {its first module's name: the modules sharded
    together}, in module order. With `config.blocks_per_group` n > 1, consecutive top-level groups
    with the same parent module and the same `module_overrides` entry are taken n at a time;
    nested groups stay their own."""
    n = config.blocks_per_group
    outer = set(top_level(groups))
    members: dict[str, list[str]] = {}
    run: list[str] = []  # the current chunk of consecutive siblings
    patterns = list(config.module_overrides)

    def same_run(name: str) -> bool:
        first = run[0]
        return (
            len(run) < n
            and name.rpartition(".")[0] == first.rpartition(".")[0]
            and match_override(name, patterns) == match_override(first, patterns)
        )

    for name in groups:
        if name not in outer:
            members[name] = [name]
        elif run and same_run(name):
            run.append(name)
        else:
            run = [name]
            members[name] = run
    return members


def top_level(names: list[str]) -> list[str]:
    """Names not nested inside another name of the list (the block sequence for prefetch)."""
    chosen: list[str] = []
    for n in names:
        if not any(n.startswith(c + ".") for c in chosen):
            chosen.append(n)
    return chosen


def own_named_params(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Parameters of `module` outside nested FSDP groups (those its own hooks gather), each once."""
    seen: set[int] = set()

    def walk(m: nn.Module, prefix: str, top: bool):
        if not top and isinstance(m, FSDPModule):
            return
        for name, p in m.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                yield prefix + name, p
        for child_name, child in m.named_children():
            yield from walk(child, f"{prefix}{child_name}.", False)

    yield from walk(module, "", True)

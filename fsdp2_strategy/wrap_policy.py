"""Wrap policies: which submodules become their own FSDP group.

A policy is resolved against a concrete model into a list of qualified module names, in
module order (parents before children). `shard_model` then shards them children-first.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn


def _class_names(model: nn.Module) -> set[str]:
    return {type(m).__name__ for m in model.modules()}


def resolve_classes(model: nn.Module, spec: Any, field: str) -> tuple[type, ...]:
    """Map classes / class-name strings onto classes present in `model`.

    An unknown name raises `ValueError` listing the closest class names in the model, so a typo
    ("GPT2Block" for "GPT2Blok") is caught before any sharding happens.
    """
    items = [spec] if isinstance(spec, (str, type)) else list(spec)
    by_name: dict[str, type] = {}
    for m in model.modules():
        by_name.setdefault(type(m).__name__, type(m))
    classes: list[type] = []
    for item in items:
        if isinstance(item, type):
            classes.append(item)
            continue
        if item in by_name:
            classes.append(by_name[item])
            continue
        close = difflib.get_close_matches(item, sorted(by_name), n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(
            f"{field}: no module in {type(model).__name__} has class name {item!r}.{hint} "
            f"Classes in the model: {', '.join(sorted(by_name))}."
        )
    return tuple(classes)


def auto_block_classes(model: nn.Module) -> tuple[type, ...]:
    """The repeated blocks of a model.

    Hugging Face models declare them in `_no_split_modules`; otherwise, among the classes that repeat
    (at least twice) as children of one `nn.ModuleList`/`nn.Sequential` and hold parameters: a
    composite block (a module with submodules) before a single layer, then the most instances, then
    the most parameters. So `Sequential(Linear, Block, Block, Linear)` wraps the two `Block`s, not
    the `Linear`s, and a plain stack of `Linear`s wraps each of them.
    """
    return _auto_choice(model)[0]


def describe_auto_choice(model: nn.Module) -> str:
    """What `wrap_policy="auto"` chose for `model` and why, as the sharding plan says it."""
    classes, source = _auto_choice(model)
    if not classes:
        return "'auto' found no repeated block: the root is the only group"
    names = ", ".join(c.__name__ for c in classes)
    return f"'auto' made one group per {names} ({source})"


def _auto_choice(model: nn.Module) -> tuple[tuple[type, ...], str]:
    """`auto_block_classes` and where they came from."""
    no_split: set[str] = set()
    for m in model.modules():
        names = getattr(m, "_no_split_modules", None)
        if names:
            no_split.update(names)
    if no_split:
        present = [n for n in no_split if n in _class_names(model)]
        if present:
            classes = resolve_classes(model, present, "wrap_policy='auto' (_no_split_modules)")
            return classes, "the model's _no_split_modules"
    best: tuple[tuple[bool, int, int], type] | None = None
    for m in model.modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        for cls, count in Counter(type(c) for c in m.children()).items():
            example = next(c for c in m.children() if type(c) is cls)
            params = sum(p.numel() for p in example.parameters())
            if count < 2 or params == 0:
                continue
            rank = (next(example.children(), None) is not None, count, params)
            if best is None or rank > best[0]:
                best = (rank, cls)
    if best is None:
        return (), ""
    (composite, count, _), cls = best
    kind = "block" if composite else "layer, no composite block repeats"
    return (cls,), f"the repeated {kind}: {count} in one ModuleList/Sequential"


def wrappable(name: str, skip: tuple[str, ...]) -> bool:
    """A submodule may get its own group: not the root, and not inside a skipped subtree."""
    return name != "" and not any(name == s or name.startswith(s + ".") for s in skip)


def select_wrapped(model: nn.Module, policy: Any, skip: Iterable[str] = ()) -> list[str]:
    """Qualified names of the submodules `policy` wraps (the root, "", is never included).

    `skip` holds module-name prefixes that must not be wrapped (ignored modules).
    """
    skip = tuple(skip)

    def allowed(name: str) -> bool:
        return wrappable(name, skip)

    if policy is None:
        return []
    predicate: Callable[[nn.Module, str], bool]
    if policy == "auto":
        classes = auto_block_classes(model)
        predicate = lambda m, n: bool(classes) and isinstance(m, classes)  # noqa: E731
    elif isinstance(policy, int) and not isinstance(policy, bool):
        return _select_by_min_params(model, policy, allowed)
    elif callable(policy) and not isinstance(policy, type):
        predicate = policy
    else:
        classes = resolve_classes(model, policy, "FSDP2Config.wrap_policy")
        predicate = lambda m, n: isinstance(m, classes)  # noqa: E731
    return [n for n, m in model.named_modules() if allowed(n) and predicate(m, n)]


def _select_by_min_params(model: nn.Module, threshold: int, allowed: Callable[[str], bool]) -> list[str]:
    """FSDP1's size policy: wrap the smallest subtrees that reach `threshold` parameters not
    already claimed by a wrapped descendant (children decide first, as in bottom-up wrapping)."""
    chosen: list[str] = []

    def visit(module: nn.Module, name: str) -> int:
        unclaimed = sum(p.numel() for p in module.parameters(recurse=False))
        for child_name, child in module.named_children():
            unclaimed += visit(child, f"{name}.{child_name}" if name else child_name)
        if allowed(name) and unclaimed >= threshold:
            chosen.append(name)
            return 0
        return unclaimed

    visit(model, "")
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(chosen, key=order.__getitem__)


def match_override(name: str, patterns: Iterable[str]) -> str | None:
    """The first glob in `patterns` that matches the qualified module name `name`."""
    for pattern in patterns:
        if fnmatch.fnmatchcase(name, pattern):
            return pattern
    return None


def modules_matching(model: nn.Module, spec: Any, field: str) -> list[str]:
    """Qualified names of modules selected by classes, class names, or instances."""
    items = [spec] if isinstance(spec, (str, type, nn.Module)) else list(spec)
    instances = {id(i) for i in items if isinstance(i, nn.Module)}
    kinds = [i for i in items if not isinstance(i, nn.Module)]
    classes = resolve_classes(model, kinds, field) if kinds else ()
    return [n for n, m in model.named_modules() if id(m) in instances or (classes and isinstance(m, classes))]

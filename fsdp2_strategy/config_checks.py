"""Per-field checks behind `FSDP2Config.__post_init__` (and `ModuleOverride`'s): each raises
`ValueError` naming the field and the values it accepts (and the closest, for a misspelt name);
`FieldErrors` collects them so that one error lists every bad field."""

from __future__ import annotations

import difflib
import enum
import re
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from . import sharding_strategies as strategies
from .precision import dtype_from_name, resolve_mixed_precision
from .tensor_parallel import check_plan

PRECISION_NAMES = ("bf16", "fp16", "fp32")
"""Accepted strings for `FSDP2Config.mixed_precision`."""


def did_you_mean(value: Any, choices: Iterable[str]) -> str:
    """ " Did you mean 'X'?" (or 'X' or 'Y') for a string close to some of `choices`, else "".

    A close candidate of the value's family (its leading letters: "bf" of "bf32") is preferred to a
    closer one of another: "bf32" is two letters from "bf16" and from "fp32", and means "bf16"."""
    if not isinstance(value, str):
        return ""
    by_key = {c.lower(): c for c in choices}
    typed = value.lower()
    scored = sorted(((difflib.SequenceMatcher(None, typed, c).ratio(), c) for c in by_key), reverse=True)
    scored = [(ratio, c) for ratio, c in scored if ratio >= 0.5]
    family = _FAMILY.match(typed)
    same_family = [(ratio, c) for ratio, c in scored if family and c.startswith(family.group())]
    scored = same_family or scored
    # The best match, and the runner-up only when nearly as close.
    close = [c for ratio, c in scored[:2] if ratio >= scored[0][0] - 0.15]
    return f" Did you mean {' or '.join(repr(by_key[c]) for c in close)}?" if close else ""


_FAMILY = re.compile(r"[a-z]+")


class FieldErrors:
    """Runs a config's checks and keeps every `ValueError`, so that one error lists every bad field
    (not only the first). `check(fn, *args, keep=...)` returns `fn`'s result, or `keep` if it raised."""

    def __init__(self, owner: str):
        self.owner = owner
        self.messages: list[str] = []

    def check(self, fn: Callable[..., Any], *args: Any, keep: Any = None) -> Any:
        try:
            return fn(*args)
        except ValueError as exc:
            self.messages.append(str(exc))
            return keep

    def raise_if_any(self) -> None:
        """Raise one ValueError: the message itself for one bad field, a list for several."""
        if len(self.messages) == 1:
            raise ValueError(self.messages[0])
        if self.messages:
            listed = "\n".join(f"- {m}" for m in self.messages)
            raise ValueError(f"{self.owner} has {len(self.messages)} invalid fields:\n{listed}")


def _strategy_name(value: Any, allow_auto: bool = False) -> str:
    """Normalise a strategy given as a string or torch's FSDP1 `ShardingStrategy` enum."""
    if isinstance(value, enum.Enum):
        value = value.name
    if allow_auto and isinstance(value, str) and value.lower() == "auto":
        return "auto"
    if isinstance(value, str) and value.upper() in strategies.NAMES:
        return value.upper()
    auto = "'auto' (chosen by the memory planner), " if allow_auto else ""
    raise ValueError(
        f"FSDP2Config.sharding_strategy={value!r} is not supported; use {auto}one of "
        f"{', '.join(strategies.NAMES)} (or torch.distributed.fsdp.ShardingStrategy)."
        + did_you_mean(value, [*strategies.NAMES, *(["auto"] if allow_auto else [])])
    )


def parse_bytes(value: Any, name: str = "memory_budget") -> int | None:
    """None, an int of bytes, or text such as "80GiB", "80GB", "512MiB"."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    units = {
        "": 1,
        "B": 1,
        "K": 2**10,
        "KB": 10**3,
        "KIB": 2**10,
        "M": 2**20,
        "MB": 10**6,
        "MIB": 2**20,
        "G": 2**30,
        "GB": 10**9,
        "GIB": 2**30,
        "T": 2**40,
        "TB": 10**12,
        "TIB": 2**40,
    }
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(value)) if isinstance(value, str) else None
    if match and match.group(2).upper() in units and float(match.group(1)) > 0:
        return int(float(match.group(1)) * units[match.group(2).upper()])
    raise ValueError(
        f"{name}={value!r} is invalid; use None, a positive int of bytes, or text like '80GiB' or '512MB'."
    )


def _check_reshard(value: Any, name: str) -> None:
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int) and value >= 1:
        return
    raise ValueError(
        f"{name}={value!r} is invalid; use None (follow the sharding strategy), True, False, "
        "or a positive int that divides the shard group size (reshard to that many ranks)."
    )


def _check_mixed_precision(value: Any, name: str) -> None:
    if isinstance(value, dict):
        resolve_mixed_precision(value, name)  # unknown keys and dtype names fail now, not at shard_model
        return
    if value is None or isinstance(value, MixedPrecisionPolicy):
        return
    if isinstance(value, str) and value.lower() in PRECISION_NAMES:
        return
    raise ValueError(
        f"{name}={value!r} is invalid; use None, one of {PRECISION_NAMES}, a dict of "
        "MixedPrecisionPolicy fields (param_dtype, reduce_dtype, output_dtype, cast_forward_inputs), "
        "or a torch.distributed.fsdp.MixedPrecisionPolicy." + did_you_mean(value, PRECISION_NAMES)
    )


def _check_wrap_policy(value: Any, name: str) -> None:
    if value is None or value == "auto" or callable(value) and not isinstance(value, type):
        return
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is invalid; use 'auto', classes, class names, an int or a callable.")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"{name}={value} is invalid; a min-params threshold must be a positive int.")
        return
    items = [value] if isinstance(value, (str, type)) else value
    if isinstance(items, (list, tuple, set, frozenset)) and all(
        isinstance(v, str) or (isinstance(v, type) and issubclass(v, nn.Module)) for v in items
    ):
        return
    raise ValueError(
        f"{name}={value!r} is invalid; use 'auto', None (only the root), nn.Module classes, "
        "class-name strings, an int min-params threshold, or a callable (module, name) -> bool."
    )


def _check_module_list(value: Any, name: str, allow_auto: bool) -> None:
    if value is None or (allow_auto and value == "auto"):
        return
    items = [value] if isinstance(value, (str, type)) else value
    if isinstance(items, (list, tuple, set, frozenset)) and all(
        isinstance(v, str) or (isinstance(v, type) and issubclass(v, nn.Module)) for v in items
    ):
        return
    auto = "'auto', " if allow_auto else ""
    raise ValueError(f"{name}={value!r} is invalid; use None, {auto}nn.Module classes or class-name strings.")


def check_choice(value: Any, choices: tuple, name: str) -> None:
    """`value` must be one of `choices` (the error names `name` and lists them)."""
    if value not in choices:
        raise ValueError(
            f"{name}={value!r} is invalid; use one of {', '.join(choices)}." + did_you_mean(value, choices)
        )


def _check_nonneg_int(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} is invalid; use an int >= 0 (how many blocks ahead; 0 disables).")


def _check_positive_int(value: Any, name: str, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid; use an int >= 1 ({what}).")


def check_trainable_only(value: Any, field: str) -> None:
    """Raise ValueError naming `field` unless `value` is "auto", True or False (trainable-only checkpoints)."""
    if not (value == "auto" or isinstance(value, bool)):
        raise ValueError(f"{field}={value!r} is invalid; use 'auto' (trainable-only for PEFT models), True or False.")


ASYNC_MODES = (False, True, "overlap")
"""Accepted values of `Checkpointer(async_save=...)` and `FSDP2Config.checkpoint_async_save`."""


def check_async_save(value: Any, field: str) -> None:
    """Raise ValueError naming `field` unless `value` is False, True or "overlap"."""
    if not isinstance(value, (bool, str)) or value not in ASYNC_MODES:
        raise ValueError(
            f"{field}={value!r} is invalid; use False (write before returning), True (copy, then write in "
            "the background) or 'overlap' (copy and write behind the next steps)."
        )


def check_frozen_dtype(value: Any, field: str) -> None:
    """Raise ValueError naming `field` unless `value` is "auto", None or a dtype (`FSDP2Config.frozen_dtype`)."""
    if value == "auto":
        return
    try:
        dtype_from_name(value, field)
    except ValueError:
        raise ValueError(
            f"{field}={value!r} is invalid; use 'auto' (the compute dtype), None (keep), 'bf16', 'fp16', 'fp32' "
            "or a torch.dtype."
        ) from None


def check_objective(value: Any, strategy: str, choices: tuple) -> None:
    """`FSDP2Config.objective` is one of `choices`, and anything but "memory" only with "auto"."""
    check_choice(value, choices, "FSDP2Config.objective")
    if value != "memory" and strategy != "auto":
        raise ValueError(
            f"FSDP2Config.objective={value!r} chooses the setting of sharding_strategy='auto', but "
            f"sharding_strategy={strategy!r}; set sharding_strategy='auto' or leave objective='memory'."
        )


def check_compile(value: Any, field: str) -> None:
    if not isinstance(value, (bool, dict)):
        raise ValueError(f"{field}={value!r} is invalid; use True, False or a dict of torch.compile kwargs.")


def check_bool(value: Any, field: str) -> None:
    """Raise ValueError naming `field` unless `value` is True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"{field}={value!r} is invalid; use True or False.")


def mesh_shape_of(value: Any) -> tuple[int, ...] | None:
    """`FSDP2Config.mesh_shape` as a tuple (an int is one dimension); ValueError naming the field."""
    if value is None:
        return None
    shape = (value,) if isinstance(value, int) else value
    if (
        not isinstance(shape, (list, tuple))
        or not 1 <= len(shape) <= 2
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape)
    ):
        raise ValueError(
            f"FSDP2Config.mesh_shape={value!r} is invalid; use (shard,) or "
            "(replicate, shard) with positive ints whose product is the world size."
        )
    return tuple(shape)


def check_tensor_parallel(config: Any) -> None:
    """`FSDP2Config.tensor_parallel_size` and `tensor_parallel_plan`, and what they exclude ("auto"
    strategy, per-module strategy overrides)."""
    size = config.tensor_parallel_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(
            f"FSDP2Config.tensor_parallel_size={size!r} is invalid; use an int >= 1 (1: no tensor parallelism)."
        )
    check_plan(config.tensor_parallel_plan, "FSDP2Config.tensor_parallel_plan")
    if size > 1 and config.sharding_strategy == "auto":
        raise ValueError(
            f"FSDP2Config(sharding_strategy='auto', tensor_parallel_size={size}): the memory planner does not model "
            "tensor parallelism yet; name a sharding_strategy (FULL_SHARD, HYBRID_SHARD, ...)."
        )
    if size > 1:
        _check_one_mesh(config, "tensor_parallel_size", size, "data parallel x tensor parallel")


def check_context_parallel(config: Any) -> None:
    """`FSDP2Config.context_parallel_size`, and what it excludes ("auto" and replicate-only strategies,
    per-module strategy overrides)."""
    size = config.context_parallel_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(
            f"FSDP2Config.context_parallel_size={size!r} is invalid; use an int >= 1 (1: no context parallelism)."
        )
    if size == 1:
        return
    if config.sharding_strategy == "auto":
        raise ValueError(
            f"FSDP2Config(sharding_strategy='auto', context_parallel_size={size}): 'auto' picks a strategy for "
            "whole sequences; name a sharding_strategy (FULL_SHARD, HYBRID_SHARD, ...)."
        )
    if strategies.strategy(config.sharding_strategy).layout == "replicate":
        raise ValueError(
            f"FSDP2Config(sharding_strategy='NO_SHARD', context_parallel_size={size}): the context-parallel ranks "
            "shard parameters between them; use FULL_SHARD, SHARD_GRAD_OP or a HYBRID_SHARD strategy."
        )
    _check_one_mesh(config, "context_parallel_size", size, "data parallel x context parallel")


def _check_one_mesh(config: Any, field: str, size: int, mesh: str) -> None:
    """Refuse per-module sharding strategies where every group must share one multi-dim mesh."""
    changed = [
        p for p, o in config.module_overrides.items() if o.sharding_strategy not in (None, config.sharding_strategy)
    ]
    if changed:
        raise ValueError(
            f"FSDP2Config.module_overrides {changed} change the sharding strategy, which needs another mesh; "
            f"with {field}={size} every group shares one ({mesh}) mesh. "
            "Drop those sharding_strategy overrides (reshard, precision and offload overrides are fine)."
        )

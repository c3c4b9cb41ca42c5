"""Mixed precision and offload: turn config values into torch's FSDP2 policies."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy


def dtype_from_name(value: Any, name: str) -> torch.dtype | None:
    """Turn "bf16"/"bfloat16"/"torch.float32"/a dtype into a `torch.dtype`, naming `name` on error."""
    if value is None or isinstance(value, torch.dtype):
        return value
    aliases = {
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
        "half": torch.float16,
        "fp32": torch.float32,
        "float32": torch.float32,
        "float": torch.float32,
    }
    key = str(value).lower().removeprefix("torch.")
    if key in aliases:
        return aliases[key]
    raise ValueError(f"{name}={value!r} is not a dtype; use one of {sorted(aliases)} or a torch.dtype.")


def frozen_storage_dtype(setting: Any, compute: torch.dtype | None, param: torch.Tensor) -> torch.dtype:
    """The dtype a frozen parameter is stored in under `FSDP2Config.frozen_dtype=setting` ("auto": the
    owning group's compute dtype `compute`, if any; None: its own); non-float parameters keep theirs."""
    if setting is None or not param.is_floating_point():
        return param.dtype
    if setting == "auto":
        return compute or param.dtype
    return dtype_from_name(setting, "FSDP2Config.frozen_dtype") or param.dtype


_POLICY_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")


def resolve_mixed_precision(value: Any, field: str = "FSDP2Config.mixed_precision") -> MixedPrecisionPolicy:
    """ "bf16"/"fp16" mean low-precision compute with fp32 master weights and fp32 gradient
    reduction (reducing in bf16 loses digits across many ranks); a dict may name dtypes as strings."""
    if value is None:
        return MixedPrecisionPolicy()
    if isinstance(value, MixedPrecisionPolicy):
        return value
    if isinstance(value, str):
        dtype = dtype_from_name(value, field)
        if dtype == torch.float32:
            return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    unknown = set(value) - set(_POLICY_FIELDS)
    if unknown:
        raise ValueError(f"{field} has unknown keys {sorted(unknown)}; accepted keys: {list(_POLICY_FIELDS)}.")
    kwargs: dict[str, Any] = {
        k: dtype_from_name(v, f"{field}[{k!r}]") for k, v in value.items() if k != "cast_forward_inputs"
    }
    if "cast_forward_inputs" in value:
        kwargs["cast_forward_inputs"] = bool(value["cast_forward_inputs"])
    return MixedPrecisionPolicy(**kwargs)


def describe_precision(policy: MixedPrecisionPolicy) -> str:
    """Short text for the plan table, e.g. "bf16/fp32" (compute/reduce)."""
    short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", None: "-"}
    param = short.get(policy.param_dtype, str(policy.param_dtype))
    reduce = short.get(policy.reduce_dtype, str(policy.reduce_dtype))
    return "param" if param == reduce == "-" else f"{param}/{reduce}"


def resolve_offload(enabled: bool) -> OffloadPolicy:
    """CPU offload; pinned memory only where an accelerator exists (pinning needs one)."""
    if not enabled:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())

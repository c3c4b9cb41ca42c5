"""Mixed precision and offload: turn config values into torch's FSDP2 policies, and tell whether a
device computes in a low-precision dtype natively (where it does not, mixed precision is slow, not fast)."""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from . import _torch_compat as tc


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


_SHORT_NAMES: dict[torch.dtype | None, str] = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def describe_precision(policy: MixedPrecisionPolicy) -> str:
    """Short text for the plan table, e.g. "bf16/fp32" (compute/reduce)."""
    short = {**_SHORT_NAMES, None: "-"}
    param = short.get(policy.param_dtype, str(policy.param_dtype))
    reduce = short.get(policy.reduce_dtype, str(policy.reduce_dtype))
    return "param" if param == reduce == "-" else f"{param}/{reduce}"


def resolve_offload(enabled: bool) -> OffloadPolicy:
    """CPU offload; pinned memory only where an accelerator exists (pinning needs one)."""
    if not enabled:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())


EMULATED_SLOWDOWN = 4.0
"""A low-precision matrix product this many times slower than fp32 on the CPU is emulated, not native.
On an AVX2-only x86 CPU bf16 and fp16 products run ~50x slower than fp32; natively (AVX512-BF16,
AMX, Arm's BF16 extension) they run at least as fast."""

_warned_emulated: set[torch.dtype] = set()


def _cpu_reports_native(dtype: torch.dtype) -> bool:
    """What torch's CPU feature detection says: AVX512-BF16 or AMX tiles for bf16, AMX-FP16 for fp16."""
    if dtype == torch.bfloat16:
        return bool(tc.cpu_has_avx512_bf16() or tc.cpu_has_amx_tile())
    return bool(tc.cpu_has_amx_fp16())


@functools.cache
def cpu_slowdown(dtype: torch.dtype) -> float:
    """How many times longer a (128 x 256) @ (256 x 256) product takes in `dtype` than in fp32 on
    this CPU (about 40 ms where `dtype` is emulated, once per process).

    Timed on one thread in that thread's CPU time, the best of 5 each: on a busy machine wall-clock
    time counts the waits for the cores, which can make fp32 look slow and an emulated dtype native.

    Args:
        dtype: `torch.bfloat16` or `torch.float16`.

    Returns:
        The ratio of the two best times (about 1 or below where `dtype` is native).
    """

    def best(kind: torch.dtype) -> int:
        a, b = torch.ones(128, 256, dtype=kind), torch.ones(256, 256, dtype=kind)
        a @ b  # first call: kernel selection, allocation
        times = []
        for _ in range(5):
            start = time.thread_time_ns()
            a @ b
            times.append(time.thread_time_ns() - start)
        return min(times)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the product runs in this thread, so its CPU time is all of it
    try:
        return best(dtype) / max(best(torch.float32), 1)
    finally:
        torch.set_num_threads(threads)


def native_low_precision(dtype: torch.dtype = torch.bfloat16, device_type: str = "cpu") -> bool:
    """Whether `device_type` computes in `dtype` natively, so mixed precision speeds training up.

    On a CPU: torch's feature detection (AVX512-BF16, AMX) says yes at once; otherwise a short
    probe times a matrix product (`cpu_slowdown`) and calls `dtype` native when it is less than
    `EMULATED_SLOWDOWN` times slower than fp32. A CUDA device answers with
    `torch.cuda.is_bf16_supported` for bf16; other accelerators count as native.

    Args:
        dtype: The compute dtype (`torch.bfloat16`, `torch.float16`; fp32 is always native).
        device_type: "cpu", "cuda", ... (the mesh's device type).

    Returns:
        True where `dtype` runs natively.
    """
    if dtype not in _LOW_PRECISION:
        return True
    if device_type == "cuda" and dtype == torch.bfloat16:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device_type != "cpu":
        return True
    return _cpu_reports_native(dtype) or cpu_slowdown(dtype) < EMULATED_SLOWDOWN


def first_emulation_warning(dtype: torch.dtype | None, device_type: str) -> str | None:
    """The warning for computing in an emulated `dtype` on `device_type`, the first time it is asked
    in this process for that dtype; None when `dtype` is native (or fp32) or was warned about already."""
    if dtype not in _LOW_PRECISION or dtype in _warned_emulated or native_low_precision(dtype, device_type):
        return None
    _warned_emulated.add(dtype)
    name = _SHORT_NAMES[dtype]
    fix = 'Train in fp32 here (mixed_precision=None; Lightning precision="32-true"; Accelerate mixed_precision="no")'
    if device_type != "cpu":
        return f"mixed_precision={name!r} on this {device_type} device is slow: it has no native {name}. {fix}."
    return (
        f"mixed_precision={name!r} on this CPU is slow: it has no native {name} (torch reports capability "
        f"{torch.backends.cpu.get_cpu_capability()}, without AVX512-BF16 or AMX), and a {name} matrix product "
        f"took {cpu_slowdown(dtype):.0f}x as long as in fp32. {fix}, or use {name} on a GPU or a CPU with "
        "AVX512-BF16 or AMX."
    )

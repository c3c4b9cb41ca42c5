"""`fully_shard` that also speaks FSDP1's vocabulary.

Code and tutorials written for FSDP1 pass `sharding_strategy=ShardingStrategy.X`,
`mixed_precision=MixedPrecision(...)`, `cpu_offload=CPUOffload(...)`, `ignored_modules=`
and `auto_wrap_policy=`. Those are translated into an `FSDP2Config` and applied with
`shard_model`; FSDP2's own keywords go straight to torch's `fully_shard`.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffload, MixedPrecision, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp import fully_shard as _torch_fully_shard

FSDP1_KEYWORDS = ("sharding_strategy", "mixed_precision", "cpu_offload", "ignored_modules", "auto_wrap_policy", "device_mesh")
FSDP2_KEYWORDS = ("mesh", "reshard_after_forward", "shard_placement_fn", "mp_policy", "offload_policy", "ignored_params")


def _mixed_precision(value: Any) -> Any:
    if isinstance(value, MixedPrecision):
        if value.buffer_dtype not in (None, value.param_dtype):
            raise ValueError(
                "mixed_precision=MixedPrecision(buffer_dtype=...) has no FSDP2 equivalent: FSDP2 leaves buffers "
                "in their own dtype; cast buffers yourself (model.to(dtype) before sharding) and drop buffer_dtype."
            )
        return MixedPrecisionPolicy(param_dtype=value.param_dtype, reduce_dtype=value.reduce_dtype,
                                    cast_forward_inputs=value.cast_forward_inputs)
    return value


def _cpu_offload(value: Any) -> bool:
    if isinstance(value, CPUOffload):
        return bool(value.offload_params)
    if isinstance(value, bool) or value is None:
        return bool(value)
    raise ValueError(f"cpu_offload={value!r} is invalid; use CPUOffload(offload_params=True) or a bool.")


def _wrap_policy(policy: Any) -> Any:
    """FSDP1 auto-wrap policies: `ModuleWrapPolicy`, or a `(module, recurse, nonwrapped_numel)`
    callable such as `functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=...)`."""
    if policy is None:
        return None
    module_classes = getattr(policy, "_module_classes", None)
    if module_classes is not None:
        return list(module_classes)
    if callable(policy):
        def fsdp1_callable(module: nn.Module, name: str) -> bool:
            numel = sum(p.numel() for p in module.parameters())
            return bool(policy(module=module, recurse=False, nonwrapped_numel=numel))

        return fsdp1_callable
    return policy


def _check_fsdp2_keywords(kwargs: dict[str, Any]) -> None:
    """Types torch would otherwise fail on deep inside (`'str' object has no attribute 'ndim'`)."""
    accepted = {
        "mesh": ((DeviceMesh,), "a torch.distributed.device_mesh.DeviceMesh"),
        "mp_policy": ((MixedPrecisionPolicy,), "a torch.distributed.fsdp.MixedPrecisionPolicy"),
        "offload_policy": ((OffloadPolicy,), "torch.distributed.fsdp.CPUOffloadPolicy() or OffloadPolicy()"),
    }
    for key, (types, fix) in accepted.items():
        if kwargs.get(key) is not None and not isinstance(kwargs[key], types):
            raise ValueError(f"fully_shard({key}={kwargs[key]!r}) is invalid; pass {fix}.")
    reshard = kwargs.get("reshard_after_forward")
    if not (reshard is None or isinstance(reshard, bool) or (isinstance(reshard, int) and reshard >= 1)):
        raise ValueError(f"fully_shard(reshard_after_forward={reshard!r}) is invalid; use True, False, or a positive "
                         "int that divides the shard group size.")


def fully_shard(module: nn.Module, **kwargs: Any) -> nn.Module:
    """Shard `module` with FSDP2, accepting FSDP1 keywords too; returns the module.

    With only FSDP2 keywords this is torch's `fully_shard`. With FSDP1 keywords the module is
    sharded by `shard_model` (with `auto_wrap_policy` when given, otherwise as one group);
    mixing the two vocabularies for one setting raises `ValueError`.
    """
    fsdp1 = {k: kwargs.pop(k) for k in FSDP1_KEYWORDS if k in kwargs}
    # What these FSDP1 switches asked for is what FSDP2 always does (the mesh picks the device,
    # parameters keep their names, meta init replaces broadcasting, no rate limiter needed).
    no_ops = [k for k in ("device_id", "use_orig_params", "sync_module_states", "limit_all_gathers")
              if kwargs.pop(k, None) is not None]
    for refused, fix in (("process_group", "pass mesh=DeviceMesh(...) instead"),
                         ("param_init_fn", "define init_weights() or reset_parameters() and build on the meta device")):
        if kwargs.pop(refused, None) is not None:
            raise ValueError(f"fully_shard({refused}=...) is FSDP1-only and has no FSDP2 equivalent; {fix}.")
    prefetch = {k: kwargs.pop(k) for k in ("forward_prefetch", "backward_prefetch") if k in kwargs}
    unknown = set(kwargs) - set(FSDP2_KEYWORDS)
    if unknown:
        raise ValueError(f"fully_shard got unknown keywords {sorted(unknown)}; FSDP1: {list(FSDP1_KEYWORDS)}, FSDP2: {list(FSDP2_KEYWORDS)}.")
    _check_fsdp2_keywords(kwargs)
    if not (fsdp1 or no_ops or prefetch):
        if kwargs.get("mesh") is None and not dist.is_initialized():  # torch would try env:// and ask for RANK
            raise RuntimeError("fully_shard needs an initialised process group (or mesh=): call f2.init_distributed() "
                               "or torch.distributed.init_process_group() first.")
        return _torch_fully_shard(module, **kwargs)

    from .sharding import shard_model

    clashes = [(a, b) for a, b in (("mixed_precision", "mp_policy"), ("cpu_offload", "offload_policy"),
                                   ("ignored_modules", "ignored_params"), ("device_mesh", "mesh")) if a in fsdp1 and b in kwargs]
    if clashes:
        raise ValueError(f"fully_shard got both FSDP1 and FSDP2 keywords for the same setting: {clashes}; keep one of each pair.")
    if "shard_placement_fn" in kwargs or "ignored_params" in kwargs:
        raise ValueError("shard_placement_fn/ignored_params cannot be combined with FSDP1 keywords; use FSDP2 keywords only.")
    config: dict[str, Any] = {"wrap_policy": _wrap_policy(fsdp1.get("auto_wrap_policy")), "log_plan": False}
    if "sharding_strategy" in fsdp1:
        config["sharding_strategy"] = fsdp1["sharding_strategy"]
    if "reshard_after_forward" in kwargs:
        config["reshard_after_forward"] = kwargs["reshard_after_forward"]
    mp = fsdp1.get("mixed_precision", kwargs.get("mp_policy"))
    if mp is not None:
        config["mixed_precision"] = _mixed_precision(mp)
    if "cpu_offload" in fsdp1:
        config["cpu_offload"] = _cpu_offload(fsdp1["cpu_offload"])
    elif "offload_policy" in kwargs:
        config["cpu_offload"] = type(kwargs["offload_policy"]).__name__ == "CPUOffloadPolicy"
    if fsdp1.get("ignored_modules"):
        config["ignored_modules"] = list(fsdp1["ignored_modules"])
    for key, value in prefetch.items():
        # FSDP1 flags (True / a BackwardPrefetch member) mean "one block ahead".
        config[key] = value if isinstance(value, int) and not isinstance(value, bool) else int(value is not None and value is not False)
    mesh = fsdp1.get("device_mesh", kwargs.get("mesh"))
    return shard_model(module, config, mesh=mesh)


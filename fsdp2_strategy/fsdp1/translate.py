"""`fully_shard` that also speaks FSDP1's vocabulary, with FSDP1's behaviour.

Code and tutorials written for FSDP1 pass `sharding_strategy=ShardingStrategy.X`,
`mixed_precision=MixedPrecision(...)`, `cpu_offload=CPUOffload(...)`, `ignored_modules=`,
`auto_wrap_policy=` (or the older `fsdp_auto_wrap_policy=`) and `process_group=`. Those are
translated into an `FSDP2Config` and applied with `shard_model`; FSDP2's own keywords go
straight to torch's `fully_shard`.

`MixedPrecision` keeps FSDP1's meaning field by field:
- `param_dtype`, `reduce_dtype`: FSDP2's fields of the same name.
- `cast_root_forward_inputs` (default True): the module handed to `fully_shard` casts its
  floating-point inputs to `param_dtype` whenever it runs as the FSDP root (no FSDP module
  above it), as FSDP1's root does; `cast_forward_inputs` (default False) makes it and every
  group the policy creates cast always.
- `buffer_dtype`: a no-op when the floating buffers already have that dtype; otherwise those
  buffers are cast once, in place, before sharding (the plan says so).
- `keep_low_precision_grads=True` has no FSDP2 equivalent and is refused.
- `_module_classes_to_ignore` (default BatchNorm): with an `auto_wrap_policy`, modules of those
  classes become their own group computing in fp32, inputs cast up and outputs back down.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffload, MixedPrecision, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp import fully_shard as _torch_fully_shard

from .. import _torch_compat as tc
from ..mesh import mesh_device_type
from ..shard import shard_model
from ..train import recorded_state
from ..wrap_policy import modules_matching
from .wrap import policy_groups

FSDP1_KEYWORDS = (
    "sharding_strategy",
    "mixed_precision",
    "cpu_offload",
    "ignored_modules",
    "auto_wrap_policy",
    "fsdp_auto_wrap_policy",
    "device_mesh",
    "process_group",
)
FSDP2_KEYWORDS = (
    "mesh",
    "reshard_after_forward",
    "shard_placement_fn",
    "mp_policy",
    "offload_policy",
    "ignored_params",
)
# What these FSDP1 switches asked for is what FSDP2 always does (the mesh picks the device,
# parameters keep their names, meta init replaces broadcasting, no rate limiter needed).
NO_OP_KEYWORDS = ("device_id", "use_orig_params", "sync_module_states", "limit_all_gathers")
# Keywords seen in tutorials that no FSDP version has (or that FSDP2 dropped), with the fix.
REFUSED_KEYWORDS = {
    "param_init_fn": "define init_weights() or reset_parameters() and build on the meta device",
    "overlap_comm": "FSDP2 overlaps communication with compute by itself; drop it (forward_prefetch=/"
    "backward_prefetch= set how many blocks ahead to all-gather)",
}


# --------------------------------------------------------------------------- mixed precision
def _check_mixed_precision(mp: MixedPrecision) -> None:
    if mp.keep_low_precision_grads:
        raise ValueError(
            "mixed_precision=MixedPrecision(keep_low_precision_grads=True) has no FSDP2 equivalent: FSDP2 "
            "gradients always have the sharded parameters' dtype. Drop keep_low_precision_grads, or keep the "
            "parameters themselves in low precision (model.to(torch.bfloat16) before sharding)."
        )


def _fsdp2_policy(mp: MixedPrecision, cast_inputs: bool) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(
        param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype, cast_forward_inputs=cast_inputs
    )


def _float_buffers(module: nn.Module, ignored: list[str]) -> list[tuple[nn.Module, str, torch.Tensor]]:
    skip = {id(module.get_submodule(n)) for n in ignored}
    found = []

    def walk(m: nn.Module) -> None:
        if id(m) in skip:
            return
        for name, buf in m.named_buffers(recurse=False):
            if buf is not None and torch.is_floating_point(buf):
                found.append((m, name, buf))
        for child in m.children():
            walk(child)

    walk(module)
    return found


def _cast_buffers(module: nn.Module, dtype: torch.dtype | None, ignored: list[str]) -> str:
    """FSDP1's buffer_dtype: cast the floating buffers that differ; returns the plan note
    ("" when nothing had to change)."""
    if dtype is None:
        return ""
    changed = [(m, n, b) for m, n, b in _float_buffers(module, ignored) if b.dtype != dtype]
    for owner, name, buf in changed:
        # Assigning a tensor to a registered buffer's name keeps it a (non-)persistent buffer.
        setattr(owner, name, buf.to(dtype))
    return f"{len(changed)} buffers cast to {str(dtype).removeprefix('torch.')}" if changed else ""


def _root_input_cast(dtype: torch.dtype):
    """Forward pre-hook: cast floating inputs to `dtype` while the module is the FSDP root.

    Registered after FSDP's own pre-hook, which decides at the first forward which module is
    the root (the first FSDP module to run with none above it), so the question is answered
    the way FSDP1 answers it for `cast_root_forward_inputs`.
    """

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if torch.is_floating_point(t) and t.dtype != dtype else t

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        if tc.is_root(module) is False:
            return None
        return tc.apply_to_tensors(cast, args), tc.apply_to_tensors(cast, kwargs)

    return hook


def _ignored_class_overrides(module: nn.Module, mp: MixedPrecision, ignored: list[str]) -> dict[str, Any]:
    """FSDP1's `_module_classes_to_ignore`: those modules compute in fp32, own group each."""
    classes = tc.classes_to_ignore(mp)
    if not classes or mp.param_dtype is None:
        return {}
    fp32 = MixedPrecisionPolicy(
        param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=mp.param_dtype, cast_forward_inputs=True
    )
    return {
        name: {"mixed_precision": fp32}
        for name, m in module.named_modules()
        if name and isinstance(m, classes) and not any(name == i or name.startswith(i + ".") for i in ignored)
    }


# --------------------------------------------------------------------------- other settings
def _cpu_offload(value: Any) -> bool:
    if isinstance(value, CPUOffload):
        return bool(value.offload_params)
    if isinstance(value, bool) or value is None:
        return bool(value)
    raise ValueError(f"cpu_offload={value!r} is invalid; use CPUOffload(offload_params=True) or a bool.")


def _mesh_from_process_group(group: Any) -> DeviceMesh:
    """FSDP1's `process_group` is the group parameters are sharded over: a 1-D mesh on it."""
    if isinstance(group, (tuple, list)):
        raise ValueError(
            "fully_shard(process_group=(intra_node, inter_node)) for HYBRID_SHARD is not mapped; pass "
            "device_mesh=init_device_mesh(device_type, (replicate, shard)) instead."
        )
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"fully_shard(process_group={group!r}) is not a torch.distributed ProcessGroup; pass the group "
            "torch.distributed.new_group(...) returned, or mesh=DeviceMesh(...)."
        )
    return DeviceMesh.from_group(group, mesh_device_type())


def _prefetch(value: Any) -> int:
    # FSDP1 flags (True / a BackwardPrefetch member) mean "one block ahead".
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return int(value is not None and value is not False)


def _pop_fsdp1(kwargs: dict[str, Any]) -> dict[str, Any]:
    fsdp1 = {k: kwargs.pop(k) for k in FSDP1_KEYWORDS if k in kwargs}
    if "fsdp_auto_wrap_policy" in fsdp1:  # torch 1.11's name for auto_wrap_policy
        if "auto_wrap_policy" in fsdp1:
            raise ValueError(
                "fully_shard got both auto_wrap_policy and fsdp_auto_wrap_policy (its old name); keep auto_wrap_policy."
            )
        fsdp1["auto_wrap_policy"] = fsdp1.pop("fsdp_auto_wrap_policy")
    if fsdp1.get("process_group") is None:
        fsdp1.pop("process_group", None)
    return fsdp1


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
        raise ValueError(
            f"fully_shard(reshard_after_forward={reshard!r}) is invalid; use True, False, or a positive "
            "int that divides the shard group size."
        )


def fully_shard(module: nn.Module, **kwargs: Any) -> nn.Module:
    """Shard `module` with FSDP2, accepting FSDP1 keywords with FSDP1's meaning.

    With only FSDP2 keywords this is torch's `fully_shard`. With FSDP1 keywords the module is
    sharded by `shard_model` (with `auto_wrap_policy` when given, otherwise as one group).

    Args:
        module: The module to shard.
        **kwargs: torch's `fully_shard` keywords (`mesh`, `reshard_after_forward`, `mp_policy`,
            `offload_policy`, ...), or FSDP1's (`sharding_strategy`, `mixed_precision`,
            `cpu_offload`, `ignored_modules`, `auto_wrap_policy`, `device_mesh`, `process_group`,
            ...). FSDP1 switches FSDP2 does anyway (`device_id`, `use_orig_params`,
            `sync_module_states`, `limit_all_gathers`) are accepted and ignored.

    Returns:
        The sharded module.

    Raises:
        ValueError: If a keyword is unknown or has no FSDP2 meaning, two keywords set the same
            setting (one of each vocabulary), or a value is invalid.
        RuntimeError: If, with FSDP2 keywords only, no process group is initialised and no `mesh`
            is given.
    """
    for refused, fix in REFUSED_KEYWORDS.items():
        if refused in kwargs:
            raise ValueError(f"fully_shard({refused}=...) is not an FSDP2 keyword: {fix}.")
    fsdp1 = _pop_fsdp1(kwargs)
    no_ops = [k for k in NO_OP_KEYWORDS if kwargs.pop(k, None) is not None]
    prefetch = {k: kwargs.pop(k) for k in ("forward_prefetch", "backward_prefetch") if k in kwargs}
    unknown = set(kwargs) - set(FSDP2_KEYWORDS)
    if unknown:
        raise ValueError(
            f"fully_shard got unknown keywords {sorted(unknown)}; FSDP1 keywords: {list(FSDP1_KEYWORDS)}, "
            f"FSDP1 switches FSDP2 does anyway: {list(NO_OP_KEYWORDS)}, FSDP2 keywords: {list(FSDP2_KEYWORDS)}."
        )
    _check_fsdp2_keywords(kwargs)
    if not (fsdp1 or no_ops or prefetch):
        if kwargs.get("mesh") is None and not dist.is_initialized():  # torch would try env:// and ask for RANK
            raise RuntimeError(
                "fully_shard needs an initialised process group (or mesh=): call f2.init_distributed() "
                "or torch.distributed.init_process_group() first."
            )
        return cast(nn.Module, _torch_fully_shard(module, **kwargs))
    clashes = [
        (a, b)
        for a, b in (
            ("mixed_precision", "mp_policy"),
            ("cpu_offload", "offload_policy"),
            ("ignored_modules", "ignored_params"),
            ("device_mesh", "mesh"),
            ("process_group", "mesh"),
            ("process_group", "device_mesh"),
        )
        if a in fsdp1 and (b in kwargs or b in fsdp1)
    ]
    if clashes:
        raise ValueError(f"fully_shard got two keywords for the same setting: {clashes}; keep one of each pair.")
    if "shard_placement_fn" in kwargs or "ignored_params" in kwargs:
        raise ValueError(
            "shard_placement_fn/ignored_params cannot be combined with FSDP1 keywords; use FSDP2 keywords only."
        )
    return _shard_fsdp1(module, fsdp1, kwargs, prefetch)


def _shard_fsdp1(module: nn.Module, fsdp1: dict, fsdp2: dict, prefetch: dict) -> nn.Module:
    ignored = (
        modules_matching(module, list(fsdp1["ignored_modules"]), "ignored_modules")
        if fsdp1.get("ignored_modules")
        else []
    )
    policy = fsdp1.get("auto_wrap_policy")
    chosen = set(policy_groups(module, policy, ignored)) if policy is not None else set()
    config: dict[str, Any] = {"wrap_policy": (lambda m, name: name in chosen) if chosen else None, "log_plan": False}
    if "sharding_strategy" in fsdp1:
        config["sharding_strategy"] = fsdp1["sharding_strategy"]
    if "reshard_after_forward" in fsdp2:
        config["reshard_after_forward"] = fsdp2["reshard_after_forward"]
    mp = fsdp1.get("mixed_precision", fsdp2.get("mp_policy"))
    root_cast, fp32_modules = None, {}
    if isinstance(mp, MixedPrecision):
        _check_mixed_precision(mp)
        config["mixed_precision"] = _fsdp2_policy(mp, mp.cast_forward_inputs)
        if policy is not None:
            fp32_modules = config["module_overrides"] = _ignored_class_overrides(module, mp, ignored)
        if mp.param_dtype is not None and mp.cast_root_forward_inputs and not mp.cast_forward_inputs:
            root_cast = mp.param_dtype
    elif mp is not None:
        config["mixed_precision"] = mp
    if "cpu_offload" in fsdp1:
        config["cpu_offload"] = _cpu_offload(fsdp1["cpu_offload"])
    elif "offload_policy" in fsdp2:
        config["cpu_offload"] = type(fsdp2["offload_policy"]).__name__ == "CPUOffloadPolicy"
    if ignored:
        config["ignored_modules"] = [module.get_submodule(n) for n in ignored]
    for key, value in prefetch.items():
        config[key] = _prefetch(value)
    mesh = fsdp1.get("device_mesh", fsdp2.get("mesh"))
    if "process_group" in fsdp1:
        mesh = _mesh_from_process_group(fsdp1["process_group"])
    shard_model(module, config, mesh=mesh)
    # After sharding, so that a refused config leaves the buffers as they were. Modules kept in
    # fp32 keep their buffers too: FSDP1 gives them no mixed precision at all.
    buffer_note = (
        _cast_buffers(module, mp.buffer_dtype, ignored + list(fp32_modules)) if isinstance(mp, MixedPrecision) else ""
    )
    _mark_root(module, root_cast, buffer_note)
    return module


def _mark_root(module: nn.Module, root_cast: torch.dtype | None, buffer_note: str) -> None:
    """Install the root input cast and record both precision choices for the plan."""
    notes = [buffer_note] if buffer_note else []
    if root_cast is not None:
        module.register_forward_pre_hook(_root_input_cast(root_cast), with_kwargs=True)
        notes.insert(0, f"inputs cast to {str(root_cast).removeprefix('torch.')} when root")
    state = recorded_state(module)
    if state is not None and state.group is not None:
        state.group = dataclasses.replace(state.group, precision_note="; ".join(notes))

"""Every private torch name the core uses, in one place, checked at import.

FSDP2's public API (`fully_shard`, `FSDPModule`'s methods) cannot say which groups are gathered,
drop the gradients an aborted accumulation left, hold a group gathered across micro-batches with
an int reshard choice, or gather around a method without casting its arguments. For that the core
reads FSDP2's private state, and a few other private torch helpers; only through this module:

- FSDP2 state: `FSDPModule._get_fsdp_state()`, `FSDPState._fsdp_param_groups` (before torch
  2.13 the one `._fsdp_param_group`), `._is_root`,
  `._lazy_init`, `._pre_forward`, `._post_forward`; `FSDPParamGroup.fsdp_params`, `.mesh_info`,
  `.post_forward_mesh_info`, `.device`, `.is_unsharded`; `FSDPParam._unsharded_param`,
  `._module_info` (where the module holds it), `.offload_to_cpu`, `.to_sharded_dtensor`,
  `.reset_sharded_param` and
  `.unsharded_accumulated_grad` (an attribute FSDP accumulated into up to torch 2.14, a read-only
  view of `_unsharded_param.grad` from 2.15: `drop_unreduced_grads` handles both);
  `FSDPMeshInfo.shard_process_group`, `.shard_mesh_size`; `AllGather`/`ReduceScatter` (the
  custom-collective interfaces `set_custom_all_gather` takes).
- FSDP1 vocabulary: `ModuleWrapPolicy._module_classes`, `_Policy._run_policy`,
  `MixedPrecision._module_classes_to_ignore`, `torch.distributed.utils._apply_to_tensors`.
- Elsewhere: `torch.distributed._composable.checkpoint` (activation checkpointing without a
  wrapper module, so parameter names stay), `torch.distributed.tensor._utils.
  compute_local_shape_and_global_offset`, `torch.utils._python_dispatch.TorchDispatchMode`,
  `_disable_current_modes` and `is_traceable_wrapper_subclass`, `torch.utils._pytree`,
  `torch._fused_sdp_choice`, `torch.cpu._is_avx512_bf16_supported` / `_is_amx_tile_supported` /
  `_is_amx_fp16_supported` (whether the CPU computes in bf16 or fp16 natively), `aten._scaled_dot_product_flash_attention_for_cpu` and
  `UntypedStorage._cdata` (the memory simulation), `torch._guards.active_fake_mode` (the
  tuner's live-bytes probe), `torch._foreach_mul_` (clipping), `nn.Module._parameters` /
  `._buffers` (moving a model to meta without untying shared weights), DCP's
  `DefaultStager._stage` / `._state_dict_stager` (keeping its host buffers between saves on torch
  2.11-2.12; the state walk of `checkpoint.stream_copy`) and `._staging_executor` (holding an
  "overlap" save's copy until `save()` returns; completing the stream-ordered one);
  `DefaultSavePlanner._cached_plans_key` and `SavePlanner`'s plan caches (one plan cache per
  asynchronous saver, dropped when it closes).
- Context parallelism (`sequence`): torch's ring attention, `_templated_ring_attention` and
  `_templated_ring_attention_backward`, its dispatcher table `custom_ops`, options `_cp_options`
  and `set_rotate_method` (of `torch.distributed.tensor.experimental._context_parallel._attention`), to
  register the CPU flash-attention kernel torch's ring leaves out; `DeviceMesh._flatten` (FSDP's
  data x context parallel dim, as torchtitan builds it).

`check_private_api()` runs when this module is imported (so at `import fsdp2_strategy`) and raises
ImportError naming every name that moved and the torch releases known to work
(`versions.TESTED`), instead of failing mid-training.
"""

from __future__ import annotations

import importlib
import inspect
import re
import threading
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle

from ._torch_backports import StagerKeepingBuffers, reset_iter_state_before_2_13
from .versions import minor, private_api_error

_missing: list[str] = []


def _private(module: str, attribute: str) -> Any:
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError):
        _missing.append(f"{module}.{attribute}")
        return None


_FSDP = "torch.distributed.fsdp._fully_shard"
FSDPState = _private(f"{_FSDP}._fsdp_state", "FSDPState")
FSDPParamGroup = _private(f"{_FSDP}._fsdp_param_group", "FSDPParamGroup")
FSDPParam = _private(f"{_FSDP}._fsdp_param", "FSDPParam")
FSDPMeshInfo = _private(f"{_FSDP}._fsdp_common", "FSDPMeshInfo")
TrainingState = _private(f"{_FSDP}._fsdp_common", "TrainingState")
AllGather = _private(f"{_FSDP}._fsdp_api", "AllGather")
ReduceScatter = _private(f"{_FSDP}._fsdp_api", "ReduceScatter")
composable_checkpoint = _private("torch.distributed._composable", "checkpoint")
compute_local_shape_and_global_offset = _private(
    "torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"
)
apply_to_tensors = _private("torch.distributed.utils", "_apply_to_tensors")
TorchDispatchMode = _private("torch.utils._python_dispatch", "TorchDispatchMode")
disable_current_modes = _private("torch.utils._python_dispatch", "_disable_current_modes")
is_traceable_wrapper_subclass = _private("torch.utils._python_dispatch", "is_traceable_wrapper_subclass")
cpu_has_avx512_bf16 = _private("torch.cpu", "_is_avx512_bf16_supported")
cpu_has_amx_tile = _private("torch.cpu", "_is_amx_tile_supported")
cpu_has_amx_fp16 = _private("torch.cpu", "_is_amx_fp16_supported")
active_fake_mode = _private("torch._guards", "active_fake_mode")
tree_flatten = _private("torch.utils._pytree", "tree_flatten")
tree_map_only = _private("torch.utils._pytree", "tree_map_only")
WrapPolicy = _private("torch.distributed.fsdp.wrap", "_Policy")
ModuleWrapPolicy = _private("torch.distributed.fsdp.wrap", "ModuleWrapPolicy")
MixedPrecision = _private("torch.distributed.fsdp", "MixedPrecision")
_CP = "torch.distributed.tensor.experimental._context_parallel._attention"
ring_attention = _private(_CP, "_templated_ring_attention")
ring_attention_backward = _private(_CP, "_templated_ring_attention_backward")
cp_dispatch_table = _private(_CP, "custom_ops")
cp_options = _private(_CP, "_cp_options")
set_rotate_method = _private(_CP, "set_rotate_method")


def _declares(owner: Any, name: str) -> bool:
    """Whether `owner` has `name`: as an attribute, an annotation, or (instance attributes, set in
    `__init__`) an assignment `self.<name> =` in its source."""
    if owner is None:
        return True  # already reported as missing
    if hasattr(owner, name):
        return True
    if not inspect.isclass(owner):
        return False
    for cls in owner.__mro__:
        if name in getattr(cls, "__annotations__", {}):
            return True
        try:
            if re.search(rf"self\.{re.escape(name)}\s*(:[^=\n]*)?=", inspect.getsource(cls)):
                return True
        except (OSError, TypeError):
            continue
    return False


_PLAN_CACHES = (
    "_cached_save_plan",
    "_cached_all_plans",
    "_cached_global_plan",
    "_cached_metadata",
    "_cached_final_save_plan",
)
"""`SavePlanner`'s class-level plan caches (dicts keyed by the planner's cache key)."""


_ATTRIBUTES = (
    (FSDPModule, "_get_fsdp_state"),
    *((FSDPState, n) for n in ("_is_root", "_lazy_init", "_pre_forward", "_post_forward", "_modules")),
    *((FSDPState, n) for n in ("_pre_forward_hook_handle", "_post_forward_hook_handle")),
    (RemovableHandle, "hooks_dict_ref"),
    (nn.Module, "_forward_pre_hooks"),
    *((FSDPParamGroup, n) for n in ("fsdp_params", "mesh_info", "post_forward_mesh_info", "device", "is_unsharded")),
    *(
        (FSDPParam, n)
        for n in (
            "_unsharded_param",
            "unsharded_accumulated_grad",
            "_module_info",
            "offload_to_cpu",
            "to_sharded_dtensor",
            "reset_sharded_param",
        )
    ),
    *((FSDPMeshInfo, n) for n in ("shard_process_group", "shard_mesh_size")),
    (ModuleWrapPolicy, "_module_classes"),
    (WrapPolicy, "_run_policy"),
    (MixedPrecision, "_module_classes_to_ignore"),
    (torch, "_fused_sdp_choice"),
    (torch.utils._foreach_utils, "_get_foreach_kernels_supported_devices"),
    (torch, "_foreach_mul_"),
    (torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"),
    (torch.UntypedStorage, "_cdata"),
    (torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"),
    (cp_options, "enable_load_balance"),
    (DeviceMesh, "_flatten"),
    (nn.Module, "_parameters"),
    (nn.Module, "_buffers"),
    (DefaultStager, "_stage"),
    (DefaultStager, "_state_dict_stager"),
    (DefaultStager, "_staging_executor"),
    (DefaultSavePlanner, "_cached_plans_key"),
    *((SavePlanner, n) for n in _PLAN_CACHES),
)


_BEFORE_2_13 = minor(torch.__version__) < (2, 13)
FSDP_SHARDS_INTEGER_PARAMS = not _BEFORE_2_13
"""Whether `fully_shard` can shard a non-floating parameter: torch 2.11-2.12 wrap every sharded
parameter as `nn.Parameter(dtensor)` (requires_grad=True, refused for integer dtypes) before
copying the original's `requires_grad`; torch 2.13 passes it to the constructor."""
_ATTRIBUTES_BEFORE_2_13 = (
    # `reset_iter_state` below: torch 2.13 made this recovery public (`FSDPModule.reset_iter_state`).
    *(
        (FSDPState, n)
        for n in ("_comm_ctx", "_state_ctx", "_device_handle", "_training_state", "_modules_to_run_forward")
    ),
    *(
        (FSDPParamGroup, n)
        for n in (
            "_all_gather_result",
            "_post_reduce_event",
            "_all_reduce_state",
            "_reshard_after_forward_event",
            "_partial_reduce_output",
            "_post_forward_indices",
            "_training_state",
            "_to_sharded",
            "_wait_all_gather_streams_on_event",
        )
    ),
)
"""Private names only torch 2.11-2.12 need (checked there only)."""

_ANY_OF = (
    # torch >= 2.13: a list of groups per state (`fully_shard` can split a module's parameters);
    # torch 2.11-2.12: one optional group.
    (FSDPState, ("_fsdp_param_groups", "_fsdp_param_group")),
)
"""(owner, names): names of which one must exist (a private name renamed between supported releases)."""


def _qualname(owner: Any) -> str:
    return getattr(owner, "__qualname__", getattr(owner, "__name__", owner))


def missing_private_names() -> list[str]:
    """The private torch names the core uses that this torch lacks (empty on a supported torch)."""
    missing = list(_missing)
    for owner, name in _ATTRIBUTES:
        if not _declares(owner, name):
            missing.append(f"{_qualname(owner)}.{name}")
    for owner, name in _ATTRIBUTES_BEFORE_2_13 if _BEFORE_2_13 else ():
        if not _declares(owner, name):
            missing.append(f"{_qualname(owner)}.{name}")
    for owner, names in _ANY_OF:
        if not any(_declares(owner, n) for n in names):
            missing.append(f"{_qualname(owner)}.{' or '.join(names)}")
    return missing


def check_private_api() -> None:
    """Raise ImportError naming every private torch name that moved, and the tested torch releases."""
    missing = missing_private_names()
    if missing:
        raise private_api_error("fsdp2_strategy", "torch", torch.__version__, missing)


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """`mesh`'s dims as one dim called `name`, which its root mesh can then be sliced by."""
    return mesh._flatten(name)


# --------------------------------------------------------------------------- FSDP2 state
def fsdp_state(module: nn.Module | FSDPModule) -> Any:
    """The module's `FSDPState`."""
    return cast(FSDPModule, module)._get_fsdp_state()


def fsdp_groups(model: nn.Module) -> list[FSDPModule]:
    """One FSDPModule per FSDP group of `model`, in module order: `fully_shard([a, b])` makes both
    FSDPModules with one state (one all-gather, one reduce-scatter), which must be driven once."""
    seen: set[int] = set()
    out: list[FSDPModule] = []
    for m in model.modules():
        if isinstance(m, FSDPModule) and id(state := fsdp_state(m)) not in seen:
            seen.add(id(state))
            out.append(m)
    return out


def group_modules(module: nn.Module | FSDPModule) -> tuple[nn.Module, ...]:
    """The modules sharded together with `module` (itself alone unless `fully_shard` got a list)."""
    return tuple(fsdp_state(module)._modules)


def _state_groups(state: Any) -> list:
    # torch >= 2.13: a list per state; 2.11-2.12: one optional group.
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []


def param_groups(module: nn.Module | FSDPModule) -> list:
    """The module's FSDP parameter groups ([] for a module `fully_shard` was not applied to)."""
    if not isinstance(module, FSDPModule):
        return []
    return _state_groups(fsdp_state(module))


def reset_iter_state(root: FSDPModule) -> None:
    """FSDP's recovery after an exception aborted a forward or backward: wait for collectives in
    flight, drop their results and any unreduced gradients' state, reshard every group, clear the
    iteration's trackers. `FSDPModule.reset_iter_state()` from torch 2.13; before it, the same steps
    on FSDP's private state (`_torch_backports`).

    Raises:
        RuntimeError: `root` is not the root FSDP module.
    """
    if hasattr(root, "reset_iter_state"):
        root.reset_iter_state()
        return
    state = fsdp_state(root)
    if state._is_root is False:
        raise RuntimeError("reset_iter_state must be called on the root FSDP module")
    groups = [_state_groups(each) for each in state._state_ctx.all_states]
    reset_iter_state_before_2_13(state, groups, TrainingState)


def reusable_stager(options: StagingOptions) -> DefaultStager:
    """DCP's stager with `options`, reusing its host buffers from one save to the next on every
    supported torch (torch 2.11-2.12's own empties them after each stage: `_torch_backports`)."""
    return StagerKeepingBuffers(options) if _BEFORE_2_13 else DefaultStager(options)


def hold_staging(stager: DefaultStager) -> Callable[[], None]:
    """Queue a wait in front of `stager`'s next background copy and return what ends it: the stager
    runs its copies on a one-worker executor, in order, so the copy `stage()` submits next starts
    only once the returned function is called (call it in a `finally`). A stager that copies in the
    caller's thread has nothing to hold."""
    executor = stager._staging_executor
    if executor is None:
        return lambda: None
    gate = threading.Event()
    executor.submit(gate.wait)
    return gate.set


def caching_save_planner(key: str) -> DefaultSavePlanner:
    """DCP's default save planner with its plan caching on, its caches kept under `key`.

    DCP keys the caches by the planner's class name, so every caching planner of a process would share
    one entry: a save of another state in between (another saver's, or a user's own) would replace it.
    A key of its own per saver keeps each saver's last plan. Every rank must save with the same key in
    the same order (as for any DCP save)."""
    planner = DefaultSavePlanner(enable_plan_caching=True)
    planner._cached_plans_key = key
    return planner


def drop_plan_cache(key: str) -> None:
    """Forget the plans cached under `key` (`caching_save_planner`): they stay in class-level dicts
    for the process's lifetime otherwise."""
    for name in _PLAN_CACHES:
        getattr(SavePlanner, name).pop(key, None)


def staging_parts(stager: DefaultStager) -> tuple[Any, Any]:
    """`stager`'s one-worker executor (None unless it stages in the background) and the state-dict
    stager that walks a state dict into its cached host buffers."""
    return stager._staging_executor, stager._state_dict_stager


def offloaded_params(model: nn.Module) -> list[Any]:
    """The `FSDPParam`s of `model` that FSDP offloads to the host."""
    return [p for g in fsdp_groups(model) for group in param_groups(g) for p in group.fsdp_params if p.offload_to_cpu]


def gathered_param_ids(model: nn.Module) -> set[int]:
    """`id`s of the parameter objects FSDP swaps in while `model`'s groups are gathered (one per
    managed parameter, reused across gathers; absent before a group's first gather)."""
    return {
        id(p._unsharded_param)
        for g in fsdp_groups(model)
        for group in param_groups(g)
        for p in group.fsdp_params
        if hasattr(p, "_unsharded_param")
    }


def sharded_params_by_gathered_id(model: nn.Module) -> dict[int, nn.Parameter]:
    """The sharded parameter of each gathered copy (`gathered_param_ids`), by the copy's `id`."""
    return {
        id(p._unsharded_param): p.sharded_param
        for g in fsdp_groups(model)
        for group in param_groups(g)
        for p in group.fsdp_params
        if hasattr(p, "_unsharded_param")
    }


def param_slots(fsdp_param: Any) -> list[tuple[nn.Module, str]]:
    """(module, attribute name) where modules hold an `FSDPParam`'s parameter (several if shared)."""
    info = fsdp_param._module_info
    return [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]


def sharded_dtensor(fsdp_param: Any, local: torch.Tensor) -> Any:
    """`local` (this rank's shard) as the DTensor FSDP makes of it: on `local`'s device, whatever
    the mesh's (`DTensor.from_local` would move it there)."""
    return fsdp_param.to_sharded_dtensor(local)


def reset_sharded_param(fsdp_param: Any) -> None:
    """Make FSDP re-read the parameter its module now holds, as it does after `nn.Module._apply`."""
    fsdp_param.reset_sharded_param()


def lazy_init(module: FSDPModule) -> None:
    """Run the root's lazy initialisation (FSDP runs it at the first forward; idempotent)."""
    fsdp_state(module)._lazy_init()


def is_root(module: nn.Module | FSDPModule) -> bool | None:
    """Whether FSDP made `module` the root (None until its first forward decides)."""
    return fsdp_state(module)._is_root


def pre_forward(module: FSDPModule, args: tuple, kwargs: dict) -> Any:
    """FSDP's pre-forward for `module` (gathers its groups)."""
    return fsdp_state(module)._pre_forward(module, args, kwargs)


def post_forward(module: FSDPModule, args: tuple, output: Any) -> Any:
    """FSDP's post-forward for `module` (reshards as the group's choice says)."""
    return fsdp_state(module)._post_forward(module, args, output)


def forward_hook_slots(module: nn.Module | FSDPModule) -> list[tuple[dict, int, bool]]:
    """Where the forward hooks of `module`'s FSDP group sit: (hooks dict, key, whether a pre-hook) for
    each, on every module of the group (`fully_shard([a, b])` hooks each)."""
    state = fsdp_state(module)
    pre_dicts = {id(m._forward_pre_hooks) for m in state._modules}
    slots: dict[tuple[int, int], tuple[dict, int, bool]] = {}
    for handle in (state._pre_forward_hook_handle, state._post_forward_hook_handle):
        for one in getattr(handle, "handles", (handle,)):  # a group of modules: one handle of several
            ref = getattr(one, "hooks_dict_ref", None)  # absent: not a hook we know, left alone
            hooks = ref() if ref is not None else None
            if hooks is not None and one.id in hooks:
                slots[(id(hooks), one.id)] = (hooks, one.id, id(hooks) in pre_dicts)
    return list(slots.values())


def post_forward_mesh_info(group: Any) -> Any:
    """A group's reshard-after-forward choice as torch stores it (None: stay gathered)."""
    return group.post_forward_mesh_info


def set_post_forward_mesh_info(group: Any, info: Any) -> None:
    """Set a group's reshard-after-forward choice (`set_reshard_after_forward` takes only a bool)."""
    group.post_forward_mesh_info = info


def wrap_policy_classes(policy: Any) -> tuple[type, ...]:
    """The module classes an FSDP1 `ModuleWrapPolicy` wraps."""
    return tuple(policy._module_classes)


def run_wrap_policy(policy: Any, model: nn.Module, ignored_modules: set[nn.Module]) -> dict[nn.Module, dict]:
    """Ask an FSDP1 `_Policy` object which modules of `model` it wraps (module -> its FSDP kwargs)."""
    return policy._run_policy(model, ignored_modules, {})


def classes_to_ignore(mixed_precision: Any) -> tuple[type, ...]:
    """FSDP1 `MixedPrecision._module_classes_to_ignore` (modules kept in fp32)."""
    return tuple(mixed_precision._module_classes_to_ignore or ())


def shard_process_group(group: Any) -> torch.distributed.ProcessGroup | None:
    """The process group a parameter group is sharded over (None when it is not sharded)."""
    info = group.mesh_info
    return info.shard_process_group if getattr(info, "shard_mesh_size", 1) > 1 else None


# --------------------------------------------------------------------------- other private helpers
def foreach_mul_(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every tensor in place by `factor` (one fused kernel per device and dtype)."""
    torch._foreach_mul_(tensors, factor)


def foreach_devices() -> list[str]:
    """Device types on which torch's optimizers default to their foreach (multi-tensor) kernels."""
    return torch.utils._foreach_utils._get_foreach_kernels_supported_devices()


def fused_sdp_choice(*args: Any, **kwargs: Any) -> int:
    """Which `SDPBackend` `scaled_dot_product_attention` would pick for these arguments."""
    return torch._fused_sdp_choice(*args, **kwargs)


def cpu_flash_attention(*args: Any, **kwargs: Any) -> Any:
    """The CPU flash-attention kernel (its meta implementation stands for every fused kernel)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*args, **kwargs)


def tensor_tables(module: nn.Module) -> tuple[dict, dict]:
    """The module's own parameter and buffer tables (assigning there keeps a tied tensor tied)."""
    return module._parameters, module._buffers


def storage_key(storage: torch.UntypedStorage) -> int:
    """An id of the storage itself, the same for every tensor viewing it."""
    return storage._cdata


def _accumulated_grad_is_attribute() -> bool:
    # torch <= 2.14: FSDP accumulated unreduced gradients in this instance attribute; torch 2.15
    # made it a read-only property over `_unsharded_param.grad` (the autograd leaf accumulates).
    return not isinstance(inspect.getattr_static(FSDPParam, "unsharded_accumulated_grad", None), property)


def unreduced_grads(fsdp_param: Any) -> list[torch.Tensor]:
    """The distinct unreduced gradient tensors a parameter holds between micro-batches."""
    grads: list[torch.Tensor] = []
    candidates = [getattr(fsdp_param, "unsharded_accumulated_grad", None)]
    if hasattr(fsdp_param, "_unsharded_param"):
        candidates.append(fsdp_param._unsharded_param.grad)
    for grad in candidates:
        if grad is not None and not any(grad is g for g in grads):
            grads.append(grad)
    return grads


def drop_unreduced_grads(group: Any) -> None:
    """Forget the gradients unsynchronised backwards accumulated on a group's unsharded parameters."""
    attribute = _accumulated_grad_is_attribute()
    for param in group.fsdp_params:
        if attribute:
            param.unsharded_accumulated_grad = None
        if hasattr(param, "_unsharded_param"):
            param._unsharded_param.grad = None


check_private_api()

"""Materialising a meta-device model after sharding.

A model built under `torch.device("meta")` has shapes but no storage. After `fully_shard`
its parameters are sharded DTensors, so `to_empty` allocates only each rank's shard; the
model's own initialisation then fills them.

On accelerators DTensor's random ops keep the shards of one tensor consistent (each rank draws its
part of one stream). On a CPU mesh torch has no such generator: every rank would draw its shard
from its own CPU generator, so with equal seeds all shards of a weight came out identical (a
16x8 Linear's rows 8-15 repeated rows 0-7). There, each module's `reset_parameters()` runs on
full-size CPU tensors of that module alone (a model's `init_weights()`: of the whole model), from
rank 0's generator state on every rank, and each rank keeps its shard: the weights equal a
one-process `torch.manual_seed(s); Model()`, at the cost of one module's (or the model's) full
tensors at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .. import _torch_compat as tc
from ..distributed import log_rank_zero
from ..mesh import mesh_device
from .quantise_on_load import pending_4bit


def has_meta_tensors(model: nn.Module) -> bool:
    """True when any parameter or buffer lives on the meta device."""
    return any(t.is_meta for t in model.parameters()) or any(b.is_meta for b in model.buffers())


def move_to_meta(model: nn.Module) -> None:
    """Replace every parameter and buffer by a meta tensor of the same shape, keeping ties.

    `model.to("meta")` makes one new Parameter per module attribute, so a weight shared by
    two modules (an embedding tied to the head) would come back as two parameters.
    """
    memo: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table, make in zip(tc.tensor_tables(module), (_meta_param, _meta_buffer)):
            for name, tensor in list(table.items()):
                if tensor is not None:
                    if id(tensor) not in memo:
                        memo[id(tensor)] = make(tensor)
                    table[name] = memo[id(tensor)]


def _meta_param(p: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)


def _meta_buffer(b: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(b, device="meta")


def _has_init_weights(model: nn.Module) -> bool:
    return callable(getattr(model, "init_weights", None))


def check_initialisable(model: nn.Module) -> None:
    """Refuse, before any sharding, a meta model that nothing could initialise.

    Without `init_weights()` on the model, every module that directly owns parameters or
    buffers must define `reset_parameters()`; otherwise those tensors would silently keep
    the uninitialised memory `to_empty` returns.
    """
    if _has_init_weights(model):
        return
    missing = [
        f"{name or '<root>'} ({type(m).__name__})"
        for name, m in model.named_modules()
        if (any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False)))
        and not callable(getattr(m, "reset_parameters", None))
    ]
    if missing:
        raise ValueError(
            "The model is on the meta device but these modules own tensors and define no "
            f"reset_parameters(): {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}. "
            "Define init_weights() on the model (it is called after sharding) or reset_parameters() on them, "
            "or load real weights with fsdp2_strategy.load_full_weights after building it on the meta device."
        )


@torch.no_grad()
def materialize(model: nn.Module, mesh: DeviceMesh) -> None:
    """Allocate each rank's shards on the mesh device and run the model's initialisation; then
    move the shards FSDP offloads to the host (`move_offloaded_shards_to_host`)."""
    model.to_empty(device=mesh_device(mesh))
    with _pending_4bit_hidden(model):
        _initialise(model, mesh)
    move_offloaded_shards_to_host(model)


@contextlib.contextmanager
def _pending_4bit_hidden(model: nn.Module) -> Iterator[None]:
    """Inside: each 4-bit weight waiting for `load_full_weights` shows the model's initialisation an
    empty float tensor (it would draw floats into packed bytes, or fail on uint8), then is back."""
    hidden = [(m, m._parameters["weight"]) for m in model.modules() if pending_4bit(m) is not None]
    for module, _ in hidden:
        module._parameters["weight"] = nn.Parameter(torch.empty(0), requires_grad=False)
    try:
        yield
    finally:
        for module, weight in hidden:
            module._parameters["weight"] = weight


@torch.no_grad()
def move_offloaded_shards_to_host(model: nn.Module) -> None:
    """Under CPU offload FSDP keeps the shards in host memory, and its first forward refuses any
    elsewhere ("should be materialized on CPU"). A meta model is initialised on its mesh's
    device (where random shards are drawn consistently, module docstring), then its offloaded
    shards are moved (pinned where FSDP pins them), shared parameters under each of their names,
    and FSDP told to re-read them, as `to_empty` does."""
    for fsdp_param in tc.offloaded_params(model):
        slots = tc.param_slots(fsdp_param)
        owner, name = slots[0]
        param = owner._parameters[name]
        if not isinstance(param, DTensor) or param.device.type == "cpu":
            continue
        # `to_empty` made FSDP re-read it, which already moved its data to the host (pinned there)
        # but left the DTensor saying the mesh's device, which FSDP's check reads.
        local = param.to_local()
        host = tc.sharded_dtensor(fsdp_param, local if local.device.type == "cpu" else local.cpu())
        moved = nn.Parameter(host, requires_grad=param.requires_grad)
        for owner, name in slots:
            owner._parameters[name] = moved
        tc.reset_sharded_param(fsdp_param)


def _initialise(model: nn.Module, mesh: DeviceMesh) -> None:
    # Elsewhere DTensor's random ops draw consistent shards; on CPU they would not (module docstring).
    on_cpu = mesh.device_type == "cpu"
    run = _on_full_size if on_cpu else _in_place
    with _rank_zero_rng() if on_cpu else contextlib.nullcontext():
        if _has_init_weights(model):
            if on_cpu:
                log_rank_zero(
                    "Initialising the meta-device model on a CPU mesh: init_weights() runs on full-size "
                    "tensors of the whole model, then each rank keeps its shards (define "
                    "reset_parameters() on the modules instead to hold one module at a time)."
                )
            run(list(model.modules()), model.init_weights)
        else:
            for module in model.modules():
                if callable(getattr(module, "reset_parameters", None)):
                    run([module], module.reset_parameters)
        _reset_lora(model, run)


def _reset_lora(model: nn.Module, run) -> None:
    """PEFT's own LoRA initialisation (B = 0, so the adapter starts as the identity), after the
    model's: a Hugging Face model's `init_weights()` treats LoRA's A and B as any `nn.Linear`."""
    peft_models: list[Any] = [m for m in model.modules() if hasattr(m, "peft_config") and hasattr(m, "get_base_model")]
    for peft_model in peft_models:
        module: Any
        for module in peft_model.modules():
            reset = getattr(module, "reset_lora_parameters", None)
            if not callable(reset) or not isinstance(getattr(module, "lora_A", None), nn.ModuleDict):
                continue
            for adapter in module.lora_A:
                init = peft_model.peft_config[adapter].init_lora_weights
                run([module.lora_A[adapter], module.lora_B[adapter]], lambda r=reset, a=adapter, i=init: r(a, i))


def _in_place(modules: list[nn.Module], initialise) -> None:
    """Run `initialise()` on the modules' own (sharded) tensors."""
    initialise()


@contextlib.contextmanager
def _rank_zero_rng() -> Iterator[None]:
    """Inside: every rank's CPU generator in rank 0's state (so all draw the same full tensors);
    afterwards each rank's own state is back."""
    state = torch.get_rng_state()
    if dist.is_available() and dist.is_initialized():
        box = [state]
        dist.broadcast_object_list(box, src=0)
        state = box[0]
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(state)
        yield


def _on_full_size(modules: list[nn.Module], initialise) -> None:
    """Run `initialise()` with the modules' own tensors replaced by full-size CPU stand-ins (tied
    tensors share one), then copy each rank's region of every stand-in into the real tensor."""
    stand_ins: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(real) -> (real, stand-in)
    swapped = []
    for module in modules:
        for table in tc.tensor_tables(module):
            for name, tensor in list(table.items()):
                if tensor is None:
                    continue
                if id(tensor) not in stand_ins:
                    full = torch.empty(tensor.shape, dtype=tensor.dtype)  # a DTensor's shape is the global one
                    if isinstance(tensor, nn.Parameter):
                        full = nn.Parameter(full, requires_grad=tensor.requires_grad)
                    stand_ins[id(tensor)] = (tensor, full)
                table[name] = stand_ins[id(tensor)][1]
                swapped.append((table, name, tensor))
    try:
        initialise()
        # What initialise() left in the tables (it may have assigned new tensors) is the result.
        results = {id(tensor): table[name] for table, name, tensor in swapped}
    finally:
        for table, name, tensor in swapped:
            table[name] = tensor
    for key, (tensor, _) in stand_ins.items():
        copy_from_full(tensor, results[key].detach())


def local_region(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's part of a DTensor (whole tensor if plain)."""
    if not isinstance(tensor, DTensor):
        return tuple(tensor.shape), (0,) * tensor.ndim
    shape, offset = tc.compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(shape), tuple(offset)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's tensor: a DTensor's local part, a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def copy_from_full(tensor: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's region of `full` (the whole tensor) into `tensor` (sharded or plain)."""
    shape, offset = local_region(tensor)
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
    local_tensor(tensor).copy_(full[index])

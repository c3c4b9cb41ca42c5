"""`estimate_memory`: per-rank memory and communication of one FSDP2 setting, before running.

Nothing is materialised and no process group is needed. The model is copied onto the meta
device (parameters in the compute dtype) and one training step of `example_batch` runs there
under a live-storage counter (`simulate.LiveBytes`). Hooks on the would-be FSDP groups add what
FSDP2 itself holds at each moment - sharded parameters, gradients and optimizer state, the
gathered groups alive at once (reshard choice, prefetch depth), all-gather and reduce-scatter
buffers - so the peak is found where it really happens, not as a sum of separate maxima.
Activations are therefore measured, not modelled, and activation checkpointing is honoured by
applying it to the meta copy. Optimizer state and the step's temporaries are measured by
stepping the optimizer on meta tensors of the local shard sizes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..activation_checkpoint import apply_activation_checkpointing
from ..config import FSDP2Config
from ..groups import ignored_names, resolve_groups
from ..train import AccumulationMode, accumulation_mode, install_chunked_loss
from .reference import reference_sizes
from .sim_device import resolve_device_type
from .sim_model import meta_copy
from .sim_optimizer import measure_optimizer
from .sim_sizes import GroupSizes, group_sizes
from .simulate import LiveBytes, run_step, states_without_batch


@dataclass
class MemoryEstimate:
    """Per-rank memory (bytes) and communication of one setting, for one optimizer step."""

    strategy: str
    """Sharding strategy of the root group."""
    world_size: int
    """Ranks in the job."""
    shard_size: int
    """Ranks one parameter is sharded over (1 for NO_SHARD)."""
    cpu_offload: bool
    """Whether sharded parameters, gradients and optimizer state live in host memory."""
    activation_checkpointing: bool
    """Whether activations are recomputed in backward."""
    accumulation: str
    """Gradient accumulation mode ("sync_each", "sync_last", "keep_gathered")."""
    micro_batches: int
    """Micro-batches per optimizer step."""
    param_bytes: int
    """Sharded parameters held by this rank (their own dtype; 0 on the device when offloaded)."""
    gathered_param_bytes: int
    """Most bytes of gathered (unsharded, compute-dtype) parameter groups alive at one moment."""
    grad_bytes: int
    """Gradients at the moment of the peak: sharded ones, plus unsharded ones that accumulation
    keeps between micro-batches ("sync_last", "keep_gathered")."""
    optimizer_bytes: int
    """Optimizer state of this rank's shard (0 on the device when offloaded)."""
    mixed_precision_bytes: int
    """Low-precision copies of parameters held besides the fp32 shards (part of
    `gathered_param_bytes`; 0 without mixed precision)."""
    buffer_bytes: int
    """Module buffers (not sharded by FSDP2: every rank holds all of them)."""
    activation_bytes: int
    """Activations and backward temporaries alive at the peak (measured on meta)."""
    activation_peak_bytes: int
    """Highest activation + temporary bytes at any moment of forward and backward."""
    communication_buffer_bytes: int
    """All-gather / reduce-scatter buffers alive for an instant at the peak."""
    peak_bytes: int
    """Peak live tensor bytes on the device of one rank."""
    peak_phase: str
    """Where the peak happens: "forward", "backward", "optimizer step" (or "reference forward")."""
    host_bytes: int = 0
    """Host memory for offloaded state (sharded params, grads, optimizer state)."""
    communication: dict = field(default_factory=dict)
    """Bytes each rank sends per optimizer step, by collective ("all_gather", "reduce_scatter",
    "all_reduce"), counted as ring algorithms move them."""
    collective_calls: dict = field(default_factory=dict)
    """Collective calls per optimizer step, by the same names (each costs one latency; groups
    sharded over one rank make none)."""
    gathering_groups: int = 0
    """FSDP groups that all-gather (parameters sharded over more than one rank): the all-gathers
    of one forward."""
    local_calls: dict = field(default_factory=dict)
    """FSDP's per-group operations per optimizer step that no collective carries, by the name of
    the collective they stand in for: unshards ("all_gather") of groups sharded over one rank,
    which FSDP still makes by copying each shard into its unsharded parameter (cast to the
    compute dtype), and their gradient syncs ("reduce_scatter") when no replica all-reduces them.
    They cost no latency or bandwidth; their copies and hooks are `ComputeProfile.local_call_s`
    each."""
    local_groups: int = 0
    """FSDP groups with parameters sharded over one rank: the local unshards of one forward."""
    reference_bytes: int = 0
    """A forward-only model's shards beside this one (`estimate_memory(reference=...)`), in `peak_bytes`."""
    reference_gathered_bytes: int = 0
    """Its largest group gathered while its forward runs (between this model's steps)."""
    host_copy_bytes: int = 0
    """Bytes copied between host and device per optimizer step under CPU offload (`host_copies`):
    every unshard from the sharded state copies the group's shard to the device, every gradient
    sync its gradient shard back; 0 without offload (on a CPU mesh the copies are no-ops)."""

    @property
    def communication_bytes(self) -> int:
        """All collectives together."""
        return sum(self.communication.values())

    def __str__(self) -> str:
        lines = [
            f"{self.strategy} on {self.world_size} ranks (shard size {self.shard_size})"
            f"{', CPU offload' if self.cpu_offload else ''}"
            f"{', activation checkpointing' if self.activation_checkpointing else ''}:"
        ]
        for name in (
            "param_bytes",
            "gathered_param_bytes",
            "grad_bytes",
            "optimizer_bytes",
            "buffer_bytes",
            "activation_bytes",
            "communication_buffer_bytes",
            *(("reference_bytes", "reference_gathered_bytes") if self.reference_bytes else ()),
            "peak_bytes",
            "host_bytes",
        ):
            lines.append(f"  {name:27s} {human_bytes(getattr(self, name)):>12s}")
        lines.append(
            f"  peak during {self.peak_phase}; communication {human_bytes(self.communication_bytes)}/step ("
            + ", ".join(f"{k} {human_bytes(v)}" for k, v in self.communication.items())
            + ")"
        )
        return "\n".join(lines)


def human_bytes(n: float) -> str:
    """1536 -> "1.50 KiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.2f} TiB"


def _shard_and_replicate(strategy: str, config: FSDP2Config, world_size: int, nodes: int) -> tuple[int, int]:
    """(shard size, replicate size) of a strategy's mesh, as `mesh.strategy_mesh_shape` builds it."""
    if strategy == "NO_SHARD":
        return 1, world_size
    if strategy in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
        if config.mesh_shape is not None and len(config.mesh_shape) == 2:
            return config.mesh_shape[1], config.mesh_shape[0]
        return world_size // nodes, nodes
    return world_size, 1


def _check_args(world_size: Any, nodes: Any, micro_batches: Any) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"estimate_memory: world_size={world_size!r} is invalid; use a positive int (ranks in the job)."
        )
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1 or world_size % nodes:
        raise ValueError(
            f"estimate_memory: nodes={nodes!r} is invalid; use a positive int that divides world_size={world_size}."
        )
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"estimate_memory: micro_batches={micro_batches!r} is invalid; use a positive int.")


def estimate_memory(
    model: nn.Module,
    config: FSDP2Config | Mapping[str, Any] | str | None = None,
    *,
    world_size: int,
    nodes: int = 1,
    optimizer: Any = "adamw",
    example_batch: Any = None,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    accumulation: str | None = None,
    micro_batches: int = 1,
    device_type: str | None = None,
    reference: nn.Module | None = None,
) -> MemoryEstimate:
    """Estimate per-rank memory and communication of training `model` with `config`.

    The model is copied onto the meta device and one training step is simulated there; no
    process group, device or real weights are needed.

    Args:
        model: The unsharded model, on any device (it is not modified, only copied onto meta).
        config: An `FSDP2Config`, a dict of its fields, a YAML path, or None for the defaults; its
            `sharding_strategy` must be concrete (not "auto").
        world_size: Ranks in the job being planned.
        nodes: Nodes the ranks are spread over (it must divide `world_size`); it sets the
            replicate dimension of HYBRID_SHARD.
        optimizer: "adamw", "adam", "sgd" (with momentum), "sgd_plain", "none", an optimizer class,
            or a callable `params -> optimizer`; its state is measured by stepping it on meta tensors.
        example_batch: One rank's micro-batch: a tensor, a tuple of positional inputs, or a dict of
            keyword inputs (tensors may be real, meta or fake); None estimates without activations.
            With `context_parallel_size=N` its whole sequences (dim 1): each rank's activations are
            measured on 1/N of every sequence.
        loss_fn: `loss_fn(model, batch)` returns the loss (default: the output's `.loss`, else the
            first output tensor's mean).
        accumulation: The gradient accumulation mode (None: the config's `accumulation`).
        micro_batches: Micro-batches per optimizer step.
        device_type: The device the job trains on ("cpu", "cuda", ...; None: this machine's
            accelerator, else "cpu"). It decides which attention kernel the activations are
            measured with and the scratch a reduce-scatter holds (gloo's copy of its input, or the
            ring's receive buffer of `FSDP2Config.collectives`); see `sim_device`.
        reference: A forward-only model trained beside `model` (RL's reference, a teacher), sharded as
            `f2.shard_reference(reference, config)` does: its shards stay on the device, its
            forward gathers one group at a time (`estimate.reference`). The pair's peak is in
            `peak_bytes`; its parts are `reference_bytes` and `reference_gathered_bytes`.

    Returns:
        The per-rank estimate: peak bytes and what is alive at the peak, resident and host bytes,
        and the bytes and calls of each collective per optimizer step.

    Raises:
        ValueError: If `config` is invalid or its `sharding_strategy` is "auto", or if
            `world_size`, `nodes`, `accumulation` or `micro_batches` is invalid.
    """
    config = FSDP2Config.coerce(config, log_plan=False)
    if config.sharding_strategy == "auto":
        raise ValueError("estimate_memory needs a concrete sharding_strategy; use compare_strategies to choose one.")
    _check_args(world_size, nodes, micro_batches)
    try:
        mode = accumulation_mode(config.accumulation if accumulation is None else accumulation)
    except ValueError as exc:
        raise ValueError(f"estimate_memory: {exc}") from None
    device_type = resolve_device_type(device_type)
    ignored = ignored_names(model, config)
    specs = resolve_groups(model, config, ignored)  # what shard_model would apply, root first
    root = specs[0].settings
    shard, _ = _shard_and_replicate(root.strategy, config, world_size, nodes)
    compute_dtype = root.mp_policy.param_dtype
    sim_model, batch = meta_copy(
        model, example_batch, compute_dtype, root.mp_policy.cast_forward_inputs, config.context_parallel_size
    )
    sizes = group_sizes(
        model,
        specs,
        ignored,
        config.frozen_dtype,
        lambda s: _shard_and_replicate(s, config, world_size, nodes),
        config.quantised_weights,
    )
    # The loss the sharded model will compute: chunked where shard_model installs the chunked loss.
    install_chunked_loss(sim_model, config.chunked_loss, config.tensor_parallel_size > 1)
    groups = [m for spec in specs[1:] for m in spec.modules]
    apply_activation_checkpointing(sim_model, config.activation_checkpointing, groups)
    opt_bytes, step_temp = measure_optimizer(optimizer, sizes, "cpu" if config.cpu_offload else device_type)
    base = _resident_bytes(sizes, opt_bytes, config.cpu_offload)
    tracker = LiveBytes()
    if batch is not None:
        run_step(sim_model, batch, loss_fn, sizes, tracker, base, config, mode, micro_batches, device_type)
    else:
        states_without_batch(
            sizes, tracker, base, config.backward_prefetch or 1, config.cpu_offload, device_type, config.collectives
        )
    estimate = _result(
        root.strategy,
        world_size,
        shard,
        config,
        mode,
        micro_batches,
        sizes,
        opt_bytes,
        step_temp,
        tracker,
    )
    if reference is None:
        return estimate
    ref = reference_sizes(reference, config, lambda s: _shard_and_replicate(s, config, world_size, nodes))
    # Its forward runs between this model's steps, when only the resident state is alive.
    during_step, during_reference = estimate.peak_bytes + ref.resident, base + ref.resident + ref.gathered
    return dataclasses.replace(
        estimate,
        peak_bytes=max(during_step, during_reference),
        peak_phase=estimate.peak_phase if during_step >= during_reference else "reference forward",
        reference_bytes=ref.resident,
        reference_gathered_bytes=ref.gathered,
    )


def _resident_bytes(sizes: dict[str, GroupSizes], opt_bytes: int, offload: bool) -> int:
    """Bytes alive on the device for the whole step: shards, replicated leftovers, buffers, optimizer state."""
    shards = sum(g.sharded for g in sizes.values())
    fixed = sum(g.replicated + g.quantised_whole + g.buffers for g in sizes.values())
    return fixed + (0 if offload else shards + opt_bytes)


def _result(
    strategy,
    world_size,
    shard,
    config,
    mode: AccumulationMode,
    micro_batches,
    sizes,
    opt_bytes,
    step_temp,
    tracker: LiveBytes,
) -> MemoryEstimate:
    shards = sum(g.sharded for g in sizes.values())
    grads = sum(g.trainable_sharded for g in sizes.values())  # frozen parameters have none
    replicated = sum(g.replicated for g in sizes.values())
    quantised = sum(g.quantised_whole for g in sizes.values())
    buffers = sum(g.buffers for g in sizes.values())
    offload = config.cpu_offload
    # Optimizer step: shards, the trainable ones' gradients, the state and the step's temporaries.
    step_device = 0 if offload else shards + grads + opt_bytes + step_temp
    # A replicated parameter has its gradient and optimizer state beside it; a quantised one has none.
    step_peak = replicated * 3 + quantised + buffers + step_device
    peak, phase = tracker.peak, tracker.peak_phase
    at_peak = tracker.at_peak
    if step_peak > peak:
        peak, phase = step_peak, "optimizer step"
        at_peak = {"gathered": 0, "grads": 0 if offload else grads, "activations": 0, "mp": 0}
    mp = at_peak.get("mp", 0)
    return MemoryEstimate(
        strategy=strategy,
        world_size=world_size,
        shard_size=shard,
        cpu_offload=offload,
        activation_checkpointing=config.activation_checkpointing is not None,
        accumulation=mode.name,
        micro_batches=micro_batches,
        param_bytes=(0 if offload else shards) + replicated + quantised,
        gathered_param_bytes=at_peak.get("gathered", 0),
        grad_bytes=at_peak.get("grads", 0),
        optimizer_bytes=0 if offload else opt_bytes,
        mixed_precision_bytes=mp,
        buffer_bytes=buffers,
        activation_bytes=at_peak.get("activations", 0),
        activation_peak_bytes=tracker.activation_peak,
        communication_buffer_bytes=at_peak.get("transient", 0),
        peak_bytes=int(peak),
        peak_phase=phase,
        host_bytes=(shards + grads + opt_bytes + step_temp) if offload else 0,
        communication=communication_bytes(sizes, mode, micro_batches),
        collective_calls=collective_calls(sizes, mode, micro_batches),
        gathering_groups=sum(1 for g in sizes.values() if g.params and g.shard_size > 1),
        local_calls=local_calls(sizes, mode, micro_batches),
        local_groups=sum(1 for g in sizes.values() if g.params and g.shard_size == 1),
        host_copy_bytes=host_copies(sizes, mode, micro_batches) if offload else 0,
    )


def communication_bytes(sizes: dict[str, GroupSizes], mode: AccumulationMode, micro_batches: int) -> dict[str, int]:
    """Bytes each rank sends per optimizer step, by collective (ring algorithms).

    All-gather and reduce-scatter of N bytes over S ranks send N*(S-1)/S per rank; an all-reduce
    sends twice that. How many of each a step runs per group is what `mode` says
    (`AccumulationMode.unshards`, `.reduce_scatters`, `.all_reduces`).
    """
    ag = rs = ar = 0.0
    for g in sizes.values():
        s = g.shard_size
        ring = (s - 1) / s
        ag += mode.unshards(micro_batches, g.keep_after_forward) * g.gathered * ring
        rs += mode.reduce_scatters(micro_batches) * g.reduce_bytes * ring
        if g.replicate_size > 1:
            ar += mode.all_reduces(micro_batches) * 2 * (g.replicate_size - 1) / g.replicate_size * g.reduce_bytes / s
    return {"all_gather": int(math.ceil(ag)), "reduce_scatter": int(math.ceil(rs)), "all_reduce": int(math.ceil(ar))}


def collective_calls(sizes: dict[str, GroupSizes], mode: AccumulationMode, micro_batches: int) -> dict[str, int]:
    """Collective calls per optimizer step, by collective, counted as `communication_bytes` counts
    their bytes, for the groups with parameters: all-gathers and reduce-scatters where a group is
    sharded over several ranks, all-reduces across replicas."""
    ag = rs = ar = 0
    for g in sizes.values():
        if not g.params:
            continue
        if g.shard_size > 1:
            ag += mode.unshards(micro_batches, g.keep_after_forward)
            rs += mode.reduce_scatters(micro_batches) if g.reduce_bytes else 0
        if g.replicate_size > 1 and g.reduce_bytes:
            ar += mode.all_reduces(micro_batches)
    return {"all_gather": ag, "reduce_scatter": rs, "all_reduce": ar}


def local_calls(sizes: dict[str, GroupSizes], mode: AccumulationMode, micro_batches: int) -> dict[str, int]:
    """`MemoryEstimate.local_calls`: what `collective_calls` counts for a group sharded over
    several ranks, for the groups sharded over one rank, less the all-reduces it does count."""
    ag = rs = 0
    for g in sizes.values():
        if g.params and g.shard_size == 1:
            ag += mode.unshards(micro_batches, g.keep_after_forward)
            rs += mode.reduce_scatters(micro_batches) if g.reduce_bytes and g.replicate_size == 1 else 0
    return {"all_gather": ag, "reduce_scatter": rs}


def host_copies(sizes: dict[str, GroupSizes], mode: AccumulationMode, micro_batches: int) -> int:
    """Bytes an offloaded step copies between host and device: FSDP2 copies a group's shard to the
    device for every all-gather from the sharded state (each forward's; backward's too unless
    the group stays gathered or keeps a partial copy, `reshard_to`) and each reduced gradient
    shard back to the host (one per reduce-scatter)."""
    total = 0
    for g in sizes.values():
        if not g.params:
            continue
        unshards = mode.unshards(micro_batches, g.keep_after_forward)
        from_host = micro_batches if g.reshard_to and unshards > micro_batches else unshards
        reduced = mode.reduce_scatters(micro_batches) * g.trainable_sharded if g.reduce_bytes else 0
        total += from_host * g.sharded + reduced
    return total

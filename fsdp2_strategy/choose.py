"""Settings the engine chooses for the user, resolved before anything is sharded.

`sharding_strategy="auto"` is chosen by the memory planner (`objective="memory"`, `estimate`) or by
measuring candidate settings on the process group (`objective="throughput"`, `tuning`), and
`compare_strategies(time=True)` measures a step-time model with the tuner. This module sits above
both the sharding (`shard`) and the tuner (which shards copies of the model to measure them), so
neither reaches up: `shard.shard_model` takes a concrete config, and nothing is registered at import.
`f2.shard_model`, `f2.compare_strategies` and the adapters' `resolve_strategy` are the functions here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from . import estimate, shard
from .config import FSDP2Config
from .distributed import log_rank_zero
from .estimate import StepTimeModel, StrategyComparison
from .mesh import detect_num_nodes, mesh_device_type
from .tuning import measure_time_model, resolve_throughput


def resolve_strategy(
    model: nn.Module,
    config: FSDP2Config,
    world_size: int,
    nodes: int,
    *,
    example_batch: Any = None,
    loss_fn: Any = None,
    device_type: str | None = None,
) -> FSDP2Config:
    """`config` with `sharding_strategy="auto"` resolved for `world_size` ranks on `nodes` nodes.

    `objective="memory"`: the memory planner's choice; `objective="throughput"`: the setting the tuner
    measured fastest on the process group (or the cached decision). The choice and its reason are
    logged on rank 0. `shard_model` calls it with the process group's size; adapters that must build
    a mesh before sharding (Lightning, Fabric) call it first with the node count their launcher knows.

    Args:
        model: The model to be sharded (real, meta or on any device).
        config: The config; returned unchanged when its strategy is concrete.
        world_size: Ranks in the job.
        nodes: Nodes the ranks are spread over.
        example_batch: One rank's micro-batch (needed by `objective="throughput"`; lets the planner
            count activations).
        loss_fn: `loss_fn(model, batch)` computes the loss.
        device_type: The device the job trains on (None: this machine's).

    Returns:
        A config with a concrete `sharding_strategy`.

    Raises:
        ValueError: If nothing fits the memory budget, or `objective="throughput"` has no example batch.
        RuntimeError: If `objective="throughput"` finds no process group of `world_size` ranks.
    """
    if config.sharding_strategy != "auto":
        return config
    inputs = dict(example_batch=example_batch, loss_fn=loss_fn, device_type=device_type)
    if config.objective == "throughput":
        return resolve_throughput(model, config, world_size, nodes, **inputs)
    resolved, reason = estimate.resolve_auto(model, config, world_size, nodes, **inputs)
    log_rank_zero("%s", reason)
    return resolved


def shard_model(
    model: nn.Module,
    config: FSDP2Config | Mapping[str, Any] | str | None = None,
    *,
    mesh: DeviceMesh | None = None,
    example_batch: Any = None,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    **overrides: Any,
) -> nn.Module:
    """Shard `model` in place with FSDP2 according to `config` and return it.

    Groups are chosen by `config.wrap_policy` and `config.module_overrides` and sharded
    children first, the root last. Tied weights are kept in one group; scalar parameters are
    replicated; a meta-device model is materialised (`init_weights()` or each module's
    `reset_parameters()`). Tensor parallelism is applied before FSDP. Build the optimizer
    afterwards. Every rank must call it, with an initialised process group.

    Args:
        model: The model to shard, on CPU, an accelerator or the meta device.
        config: An `FSDP2Config`, a dict of its fields, a YAML path, or None for the defaults.
        mesh: The device mesh of the global strategy (None: built from the world size and
            `config.mesh_shape`). With `tensor_parallel_size > 1` it is the whole (data...,
            tensor-parallel) mesh, its last dim the TP one.
        example_batch: With `sharding_strategy="auto"`, one rank's micro-batch (a tensor, a tuple
            of positional inputs or a dict of keyword inputs; real, meta or fake tensors), so
            that the memory planner counts the activations of forward and backward against
            `memory_budget` (`objective="throughput"` measures steps on it); without one the
            activations are left to the budget's margin. Ignored for other strategies.
        loss_fn: With `sharding_strategy="auto"`, `loss_fn(model, batch)` computes the loss (as in
            `f2.estimate_memory`). Ignored for other strategies.
        **overrides: `FSDP2Config` fields that override `config`'s.

    Returns:
        `model`, sharded: its FSDP groups hold DTensor parameters.

    Raises:
        ValueError: If the config or an override is invalid, or does not fit the world size or
            `mesh`.
        RuntimeError: If no process group is initialised.
    """
    config = FSDP2Config.coerce(config, **overrides)
    config = resolve_on_process_group(model, config, mesh=mesh, example_batch=example_batch, loss_fn=loss_fn)
    return shard.shard_model(model, config, mesh=mesh)


def shard_reference(
    model: nn.Module,
    config: FSDP2Config | Mapping[str, Any] | str | None = None,
    *,
    mesh: DeviceMesh | None = None,
    **overrides: Any,
) -> nn.Module:
    """Shard a model that only runs forward: a reference or teacher model beside the one in training.

    The same policy as `shard_model` (one group per block), with what a forward-only model wants:
    every parameter frozen (no gradients, so no reduce-scatter and no optimizer state), stored in the
    compute dtype (`frozen_dtype="auto"`: bf16 under a bf16 policy), the model in eval mode, and
    every group resharded after its forward, the root and the last block included (they stay
    gathered only where a backward follows).

    Args:
        model: The model to shard.
        config: An `FSDP2Config`, a dict of its fields, a YAML path, or None (e.g. the policy model's
            config: `mixed_precision` and `wrap_policy` carry over).
        mesh: As for `shard_model`.
        **overrides: `FSDP2Config` fields over `config` (`reshard_after_forward=False` keeps the groups
            gathered after forward, for a reference run many times over the same batch).

    Returns:
        `model`, sharded, frozen and in eval mode.
    """
    # Checked before the model is frozen: a bad config changes nothing.
    config = FSDP2Config.coerce(config, **{"reshard_after_forward": True, **overrides})
    model.requires_grad_(False)
    model.eval()
    return shard_model(model, config, mesh=mesh)


def resolve_on_process_group(
    model: nn.Module,
    config: FSDP2Config,
    *,
    mesh: DeviceMesh | None = None,
    example_batch: Any = None,
    loss_fn: Any = None,
) -> FSDP2Config:
    """`resolve_strategy` for the initialised process group: its size, the node count of
    `config.mesh_shape` (else detected), and the device of `mesh` (else this machine's).

    Raises:
        RuntimeError: If the strategy is "auto" and no process group is initialised.
    """
    if config.sharding_strategy != "auto":
        return config
    if not dist.is_initialized():
        raise RuntimeError(
            "shard_model needs an initialised process group (sharding_strategy='auto' plans for its world size)."
        )
    world = dist.get_world_size()
    nodes = config.mesh_shape[0] if config.mesh_shape and len(config.mesh_shape) == 2 else detect_num_nodes(world)
    # The device the job trains on decides attention kernels and collective buffers (`estimate.sim_device`).
    device_type = mesh.device_type if mesh is not None else mesh_device_type()
    return resolve_strategy(
        model, config, world, nodes, example_batch=example_batch, loss_fn=loss_fn, device_type=device_type
    )


def compare_strategies(
    model: nn.Module,
    config: FSDP2Config | dict | str | None = None,
    *,
    time: bool | StepTimeModel | None = None,
    **planner_inputs: Any,
) -> StrategyComparison:
    """Estimate every strategy x CPU offload x activation checkpointing and recommend one.

    The memory planner's table (`estimate.compare_strategies`): each setting is `config` with that
    strategy, offload and checkpointing, estimated by `f2.estimate_memory`; the recommendation is the
    fitting setting with the least communication (`f2.tune` picks by measured time instead).

    Args:
        model: The unsharded model, on any device (it is only copied onto meta).
        config: The base `FSDP2Config`, a dict of its fields, a YAML path, or None for the defaults.
        time: Adds a predicted step time per row (`PlanRow.predicted`): a `StepTimeModel` (e.g.
            `f2.tune(...).time_model`), or True to measure one now on the initialised process group
            (a collective sweep and one step of `model`, which must then hold real weights and
            `example_batch` real tensors; every rank must call). None or False: no times.
        **planner_inputs: `world_size` (required), `nodes`, `device_memory` (the budget per rank,
            bytes or text like "80GiB"; None judges nothing), `strategies`, `offload`,
            `checkpointing` (the values to compare), and what `estimate_memory` takes
            (`optimizer`, `example_batch`, `loss_fn`, `accumulation`, `micro_batches`, `device_type`).

    Returns:
        Every row in the order tried, the budget, and the recommended row with the reason (or why
        nothing fits).

    Raises:
        ValueError: If `config`, `device_memory`, `time` or an argument of `estimate_memory` is
            invalid.
    """
    if time is True:
        keys = ("example_batch", "loss_fn", "optimizer", "device_type")
        time = measure_time_model(model, config, **{k: planner_inputs[k] for k in keys if k in planner_inputs})
    return estimate.compare_strategies(model, config, time=time, **planner_inputs)

"""`gathered(model)`: every FSDP group gathered once and kept so, for generation.

Outside it, every forward of a sharded model all-gathers each group again and frees it after: one
all-gather per group per generated token, which is what makes generation on a sharded model slow
(and every rank must then run the same number of forwards). Inside it, the groups are gathered once,
all their all-gathers started together, and stay gathered for every forward, so decoding runs no
collective at all; on exit each group's own reshard choices come back and every group is resharded.
When the gathered model would not fit the memory budget, nothing is held: generation runs as
without the context (one group gathered at a time) and a warning says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from .. import _torch_compat as tc
from ..config_checks import parse_bytes
from ..distributed import log_rank_zero
from ..estimate import default_budget, human_bytes
from ..groups import own_named_params
from ..mesh import detect_num_nodes
from ..train import KeptGroups, recorded_state


def gathered_bytes(model: nn.Module) -> int:
    """Bytes the model's FSDP-managed parameters take gathered, floating ones in their group's compute
    dtype (the mixed-precision policy's `param_dtype` where one is set). A parameter's `numel()` is
    its full size (a DTensor's global one; under tensor parallelism that over-counts the TP shard)."""
    total = 0
    for module in tc.fsdp_groups(model):
        state = recorded_state(cast(nn.Module, module))
        compute = state.group.mp_policy.param_dtype if state is not None and state.group is not None else None
        for member in tc.group_modules(module):
            for _, p in own_named_params(member):
                dtype = compute if compute is not None and p.is_floating_point() else p.dtype
                total += p.numel() * torch.empty((), dtype=dtype, device="meta").element_size()
    return total


@contextlib.contextmanager
def gathered(*models: nn.Module, memory_budget: int | str | None = None) -> Iterator[None]:
    """Keep every FSDP group of `models` gathered inside the context (for generation).

    Every rank must enter and leave it together (the first gather and the last reshard are
    collective); inside, forwards run without collectives, so ranks may even generate different
    lengths: pass Hugging Face `generate` `synced_gpus=False` (its default on a sharded model is True,
    one all-reduce per token so that every rank runs the same number of forwards, which only a
    sharded forward needs). Use it around `model.generate(...)` or a hand-written decoding loop, not
    around training steps (every group would stay gathered through backward).

    Args:
        *models: Models `shard_model` sharded (a model without FSDP groups is left as it is).
        memory_budget: Bytes per rank the gathered parameters may take, an int or text like "20GiB";
            None: the accelerator's total memory, or on CPU the available RAM divided by the local
            ranks, less a margin (`estimate.default_budget`). Above it the groups are not held and
            a warning says so.

    Example:
        ```python
        with f2.gathered(model), torch.no_grad():
            tokens = model.generate(input_ids, max_new_tokens=64, synced_gpus=False)
        ```
    """
    budget = parse_bytes(memory_budget, "gathered(memory_budget)") or default_budget(_local_ranks())
    needed = sum(gathered_bytes(m) for m in models)
    if needed > budget:
        log_rank_zero(
            "f2.gathered: the gathered model needs %s per rank, over the budget of %s; not holding the groups "
            "(each forward gathers them one at a time). Pass gathered(..., memory_budget=...) or free memory.",
            human_bytes(needed),
            human_bytes(budget),
            level=30,
        )
        yield
        return
    held = []
    for model in models:
        modules = tc.fsdp_groups(model)
        if not modules:
            continue
        # The root's lazy init (normally at its first forward) fixes its reshard choice: run it first,
        # so the choices saved and restored are the final ones. Idempotent.
        tc.lazy_init(modules[0])
        kept = KeptGroups(modules)
        held.append(kept)
        kept.keep(gather_now=True)
    try:
        yield
    finally:
        for kept in held:
            kept.restore_flags()
            for module in kept.modules:
                module.reshard()


def _local_ranks() -> int:
    """Ranks on this node, as the memory planner counts them (`choose.resolve_on_process_group`)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return world // detect_num_nodes(world)

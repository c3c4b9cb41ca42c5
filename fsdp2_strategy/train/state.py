"""The engine's record of a module it sharded: one `EngineState` per module, reached by `engine_state`.

Like torch's `fully_shard.state(module)`, the record lives outside the user's object (a weak
mapping keyed by the module, dropped with it), so the engine adds no attributes to user modules.
`shard_model` fills the record of the model it returns (accumulation mode, replicated parameters)
and of every module it gave a `fully_shard` call or a tensor-parallel style; `no_sync` keeps its
per-model runtime state there; the sharding report reads it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..groups import GroupSettings
from .accumulation_mode import DEFAULT_MODE, AccumulationMode
from .kept_gathered import KeptGroups
from .replicated import ReplicatedParams


@dataclass(eq=False)
class EngineState:
    """What the engine remembers about one module.

    The first seven fields belong to the model `shard_model` (or `f2.replicate`) returned, the others
    to the modules inside it; a field that does not apply keeps its default.
    """

    accumulation: AccumulationMode = DEFAULT_MODE
    """The mode `no_sync` follows for this model (`FSDP2Config.accumulation`)."""
    replicated: ReplicatedParams | None = None
    """Parameters kept replicated and synchronised by hand (0-dim ones, `f2.replicate`'s)."""
    kept_groups: KeptGroups | None = None
    """The groups "keep_gathered" holds unsharded, built at the model's first `no_sync`."""
    gathered_once: bool = False
    """Whether every group was gathered once before the first unsynchronised backward
    (`train.accumulation` says why that is needed)."""
    wrap_choice: str = ""
    """What `wrap_policy="auto"` chose for this model and why ("" for any other policy)."""
    cp_mesh: Any = None
    """The context-parallel mesh of a model sharded with `context_parallel_size > 1`
    (`f2.context_parallel` runs attention as a ring over it), else None."""
    loss_choice: str = ""
    """What computes a causal LM's training loss (`FSDP2Config.chunked_loss`), as the plan shows it."""
    group: GroupSettings | None = None
    """The settings of the `fully_shard` call this module received (its group's first module)."""
    ring_comms: bool = False
    """Whether the group's collectives run as point-to-point rings (`FSDP2Config.collectives`)."""
    tp_style: str | None = None
    """The tensor-parallel style this module was split with ("colwise", "user", ...)."""
    packed_4bit: bool = False
    """Whether this is a bitsandbytes 4-bit layer whose weight FSDP shards as packed bytes."""
    pending_4bit: Any = None
    """On such a layer built on the meta device: the format (`shard.quantise_on_load.FourBitFormat`)
    `load_full_weights` quantises its weight in; None once it holds values."""


_STATES: weakref.WeakKeyDictionary[nn.Module, EngineState] = weakref.WeakKeyDictionary()


def engine_state(module: nn.Module) -> EngineState:
    """The engine's record of `module` (created empty, with every default, on first use).

    Args:
        module: A model `shard_model` returned, or any module inside one.

    Returns:
        The one `EngineState` of `module`: the same object on every call.
    """
    state = _STATES.get(module)
    if state is None:
        state = _STATES[module] = EngineState()
    return state


def recorded_state(module: nn.Module) -> EngineState | None:
    """The record of `module` if the engine made one, without creating it."""
    return _STATES.get(module)


def replicated_params_of(model: nn.Module) -> ReplicatedParams | None:
    """The `ReplicatedParams` that `shard_model` or `replicate` recorded for `model`, if any."""
    state = recorded_state(model)
    return state.replicated if state is not None else None

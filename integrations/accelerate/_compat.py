"""Every private Accelerate symbol the adapter touches, in one place, checked at import.

Accelerate has no plugin interface for a sharding engine, so the adapter relies on:

- `AcceleratorState` attributes `distributed_type`, `fsdp_plugin` and the private
  `_mixed_precision`: set after `Accelerator.__init__` so that `distributed_type` reports
  FSDP (on CPU Accelerate would say MULTI_CPU or NO and wrap the model in DDP, or not
  synchronise it at all) and `mixed_precision` reports the FSDP2 policy in use.
- `Accelerator` private attributes `_models`, `_optimizers`, `_schedulers`,
  `_dataloaders`, `_custom_objects`, `_save_model_state_pre_hook`,
  `_load_model_state_pre_hook`: the registries `prepare`, `save_state` and `load_state` walk,
  reached only through `registries()`.
- `accelerate.checkpointing.save_accelerator_state` / `load_accelerator_state`: reused for
  the state Accelerate owns (schedulers, samplers, RNG, step, scaler), with empty model and
  optimizer lists: the core writes those.
- `accelerate.checkpointing.save_custom_state`: objects registered with
  `register_for_checkpointing`, written as `CUSTOM_STATE_FILE` (a name that function hard-codes);
  read back by the adapter as data (Accelerate's `load_custom_state` unpickles any type).
- Stock `Accelerator.__init__` takes `fsdp_plugin`: `refuse_in_stock_accelerator` makes it refuse
  an `FSDP2Plugin` by name. Where stock Accelerate reads the plugin differs between releases (1.15
  read `fsdp_version` in `Accelerator.__init__`, 1.16 only in `AcceleratorState` on accelerators and
  wraps CPU processes in DDP without reading it), so the refusal does not wait for a read.
- `accelerate.big_modeling._attach_context_parallel_hooks(model)`: what stock `prepare` does to a
  model under `ParallelismConfig(cp_size>1)` (drop each attention's mask, ask for a causal one),
  applied to ours the same way; `Accelerator.maybe_context_parallel`, which ours replaces.

Each is checked by behaviour, signature or attribute, never by the text of Accelerate's source.
`check_private_api()` runs at import and raises ImportError naming what moved;
`check_accelerator(acc)` checks the instance attributes once an Accelerator exists.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import accelerate
from accelerate import Accelerator
from accelerate import big_modeling as _big_modeling
from accelerate import checkpointing as _checkpointing
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

from fsdp2_strategy.versions import private_api_error

PRIVATE_ATTRIBUTES = (
    "_models",
    "_optimizers",
    "_schedulers",
    "_dataloaders",
    "_custom_objects",
    "_save_model_state_pre_hook",
    "_load_model_state_pre_hook",
)
_SAVE_PARAMS = (
    "output_dir",
    "model_states",
    "optimizers",
    "schedulers",
    "dataloaders",
    "process_index",
    "step",
    "scaler",
    "save_on_each_node",
    "safe_serialization",
)
_LOAD_PARAMS = (
    "input_dir",
    "models",
    "optimizers",
    "schedulers",
    "dataloaders",
    "process_index",
    "scaler",
    "map_location",
    "load_kwargs",
)

save_accelerator_state = _checkpointing.save_accelerator_state
load_accelerator_state = _checkpointing.load_accelerator_state
save_custom_state = _checkpointing.save_custom_state
CUSTOM_STATE_FILE = "custom_checkpoint_{}.pkl"
attach_context_parallel_hooks = getattr(_big_modeling, "_attach_context_parallel_hooks", None)


def _problems() -> list[str]:
    problems = []
    if not hasattr(DistributedType, "FSDP"):
        problems.append("accelerate.utils.DistributedType.FSDP")
    for name, func, params in (
        ("save_accelerator_state", save_accelerator_state, _SAVE_PARAMS),
        ("load_accelerator_state", load_accelerator_state, _LOAD_PARAMS),
    ):
        have = list(inspect.signature(func).parameters)
        if have[: len(params)] != list(params):
            problems.append(f"accelerate.checkpointing.{name}{tuple(params)} (found {tuple(have)})")
    if not callable(attach_context_parallel_hooks):
        problems.append("accelerate.big_modeling._attach_context_parallel_hooks")
    for method in (
        "prepare_data_loader",
        "prepare_optimizer",
        "prepare_scheduler",
        "no_sync",
        "unscale_gradients",
        "maybe_context_parallel",
    ):
        if not callable(getattr(Accelerator, method, None)):
            problems.append(f"Accelerator.{method}")
    fields = getattr(FullyShardedDataParallelPlugin, "__dataclass_fields__", {})
    if "fsdp_version" not in fields:
        problems.append("FullyShardedDataParallelPlugin.fsdp_version")
    if "fsdp_plugin" not in inspect.signature(Accelerator.__init__).parameters:
        problems.append("Accelerator.__init__(fsdp_plugin=...) (the stock-Accelerator refusal)")
    if not _state_reports_private_precision():
        problems.append("AcceleratorState.mixed_precision reading AcceleratorState._mixed_precision")
    return problems


def _state_reports_private_precision() -> bool:
    """Whether `AcceleratorState.mixed_precision` reports `_mixed_precision` for an FSDP run (what
    `claim_fsdp_state` sets). Asked of a bare instance: no `__init__`, so no shared state is touched."""
    probe = object.__new__(AcceleratorState)
    probe.__dict__ = {"distributed_type": DistributedType.FSDP, "_mixed_precision": "bf16"}
    try:
        return probe.mixed_precision == "bf16"
    except Exception:  # an attribute of another name, or another shape: moved either way
        return False


def refuse_in_stock_accelerator(plugin_type: type, message: str) -> None:
    """Make `accelerate.Accelerator(fsdp_plugin=<plugin_type>)` raise TypeError(`message`).

    Nothing else changes: any other argument reaches the stock `__init__` as given, and
    `FSDP2Accelerator` hands Accelerate no plugin (it claims the state afterwards). Idempotent.
    """
    stock_init = Accelerator.__init__
    if getattr(stock_init, "_fsdp2_refuses", None) is plugin_type:
        return
    signature = inspect.signature(stock_init)

    @functools.wraps(stock_init)
    def __init__(self: Accelerator, *args: Any, **kwargs: Any) -> None:
        try:
            plugin = signature.bind_partial(self, *args, **kwargs).arguments.get("fsdp_plugin")
        except TypeError:  # arguments the stock __init__ refuses itself, with its own message
            plugin = None
        if isinstance(plugin, plugin_type):
            raise TypeError(message)
        stock_init(self, *args, **kwargs)

    __init__._fsdp2_refuses = plugin_type  # type: ignore[attr-defined]
    Accelerator.__init__ = __init__  # type: ignore[method-assign]


def check_private_api() -> None:
    """Raise ImportError if an Accelerate symbol the adapter relies on is gone or changed shape."""
    problems = _problems()
    if problems:
        raise private_api_error("fsdp2_strategy's Accelerate adapter", "accelerate", accelerate.__version__, problems)


@dataclass(frozen=True)
class Registries:
    """What an Accelerator has prepared: its private lists, shared (appending here registers)."""

    models: list
    optimizers: list
    """`AcceleratedOptimizer`s."""
    schedulers: list
    dataloaders: list
    custom_objects: list
    """Objects given to `register_for_checkpointing`."""
    save_hooks: dict
    """`register_save_state_pre_hook` hooks."""
    load_hooks: dict
    """`register_load_state_pre_hook` hooks."""


def registries(accelerator: Accelerator) -> Registries:
    """The adapter's only way to the Accelerator's private registries (checked by `check_accelerator`)."""
    return Registries(
        accelerator._models,
        accelerator._optimizers,
        accelerator._schedulers,
        accelerator._dataloaders,
        accelerator._custom_objects,
        accelerator._save_model_state_pre_hook,
        accelerator._load_model_state_pre_hook,
    )


def check_accelerator(accelerator: Accelerator) -> None:
    """Raise if a constructed Accelerator lacks a private attribute `registries` reads."""
    missing = [f"Accelerator.{name}" for name in PRIVATE_ATTRIBUTES if not hasattr(accelerator, name)]
    if missing:
        raise private_api_error("fsdp2_strategy's Accelerate adapter", "accelerate", accelerate.__version__, missing)


def claim_fsdp_state(state: AcceleratorState, plugin: Any, mixed_precision: str) -> None:
    """Make the shared Accelerate state describe what really runs: FSDP with `plugin`.

    `distributed_type` lives in the state shared with `PartialState`, so `gather`,
    `wait_for_everyone` and data-loader RNG sync keep treating the run as distributed.
    """
    state.distributed_type = DistributedType.FSDP
    PartialState().distributed_type = DistributedType.FSDP  # a second shared dict, read by utils.operations
    state.fsdp_plugin = plugin
    state._mixed_precision = mixed_precision


def release_reported_precision() -> None:
    """Before a second Accelerator in one process: Accelerate refuses a precision that differs
    from the state's, and the state reports our policy while Accelerate itself runs with "no"."""
    if AcceleratorState._shared_state:
        AcceleratorState._shared_state["_mixed_precision"] = "no"


check_private_api()

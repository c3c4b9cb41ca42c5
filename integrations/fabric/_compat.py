"""Every private Lightning Fabric symbol the Fabric adapter touches, in one place, checked at import.

- `lightning.fabric.connector._Connector._check_and_init_precision`: Fabric picks the precision
  plugin there and refuses `precision="16-mixed"` for every `ModelParallelStrategy` subclass
  (its manual FSDP2 has no sharded grad scaler). `FSDP2FabricStrategy` has one, so for it the
  choice is made by `precision.precision_for` (the Trainer adapter's five strings) instead.
- `lightning.fabric.strategies.launchers.multiprocessing._MultiProcessingLauncher._wrapping_function`:
  the spawned worker's body, extended to end the worker through `fsdp2_strategy.shutdown()`.
- `lightning.fabric.strategies.strategy._BackwardSyncControl`: the base of the object
  `fabric.no_backward_sync` asks, subclassed to run `f2.no_sync`.
- torch's `torch._dynamo.OptimizedModule`: what `torch.compile(module)` returns; a `parallelize_fn`
  that compiles returns one, and the engine shards the module inside it.

Each is reached through `versions.find_private`; `check_private_api()` runs at import, before
anything is built on them, and raises ImportError naming every symbol a Lightning release moved,
instead of failing later mid-training.
"""

from __future__ import annotations

from typing import Any

import lightning
import torch
from lightning.fabric.plugins.precision import Precision

from fsdp2_strategy.versions import find_private, private_api_error

from .._lightning_shared import ShutdownAfterWorker
from .precision import precision_for

_missing: list[str] = []
_Connector = find_private("lightning.fabric.connector:_Connector", _missing)
find_private("lightning.fabric.connector:_Connector._check_and_init_precision", _missing)
_MultiProcessingLauncher = find_private(
    "lightning.fabric.strategies.launchers.multiprocessing:_MultiProcessingLauncher", _missing
)
find_private(
    "lightning.fabric.strategies.launchers.multiprocessing:_MultiProcessingLauncher._wrapping_function", _missing
)
BackwardSyncControl = find_private("lightning.fabric.strategies.strategy:_BackwardSyncControl", _missing)
_torch_missing: list[str] = []
OptimizedModule = find_private("torch._dynamo:OptimizedModule", _torch_missing)


def check_private_api() -> None:
    """Raise ImportError naming every Fabric symbol above that a release moved."""
    if _missing:
        raise private_api_error("fsdp2_strategy's Fabric adapter", "lightning", lightning.__version__, _missing)
    if _torch_missing:
        raise private_api_error("fsdp2_strategy's Fabric adapter", "torch", torch.__version__, _torch_missing)


check_private_api()  # before the classes below subclass what it checked


def install_precision_choice(strategy_cls: type) -> None:
    """Let `Fabric(strategy=<strategy_cls>, precision=...)` choose among the FSDP2 plugins."""
    original = _Connector._check_and_init_precision
    if getattr(original, "_fsdp2_for", None) is strategy_cls:
        return  # installed already (module re-imported)

    def check_and_init_precision(self: Any) -> Precision:
        if isinstance(self.strategy, strategy_cls) and not isinstance(self._precision_instance, Precision):
            return precision_for(self._precision_input, torch.device(self._parallel_devices[0]).type)
        return original(self)

    check_and_init_precision._fsdp2_for = strategy_cls  # type: ignore[attr-defined]
    _Connector._check_and_init_precision = check_and_init_precision  # type: ignore[method-assign]


class ShutdownMultiProcessingLauncher(ShutdownAfterWorker, _MultiProcessingLauncher):  # type: ignore[misc,valid-type]
    """Fabric's spawn launcher whose workers end through `fsdp2_strategy.shutdown()` (see `ShutdownAfterWorker`)."""

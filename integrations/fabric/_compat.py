"""Every private Lightning Fabric symbol the Fabric adapter touches, in one place, checked at import.

- `lightning.fabric.connector._Connector._check_and_init_precision`: Fabric picks the precision
  plugin there and refuses `precision="16-mixed"` for every `ModelParallelStrategy` subclass
  (its manual FSDP2 has no sharded grad scaler). `FSDP2FabricStrategy` has one, so for it the
  choice is made by `precision.precision_for` (the Trainer adapter's five strings) instead.
- `lightning.fabric.strategies.launchers.multiprocessing._MultiProcessingLauncher._wrapping_function`:
  the spawned worker's body, extended to end the worker through `fsdp2_strategy.shutdown()`.

`check_private_api()` runs at import and raises ImportError naming the missing symbol if a
Lightning release moved one, instead of failing later mid-training.
"""

from __future__ import annotations

from typing import Any

import lightning
import torch
from lightning.fabric.connector import _Connector
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher

from fsdp2_strategy.distributed import shutdown
from fsdp2_strategy.versions import private_api_error

from .precision import precision_for

META_FILE = "meta.pt"  # Fabric's name for the non-tensor state in a sharded checkpoint (as Lightning's)


def check_private_api() -> None:
    """Raise ImportError if a Fabric symbol we rely on is gone."""
    problems = [
        name for owner, attr, name in (
            (_Connector, "_check_and_init_precision", "_Connector._check_and_init_precision"),
            (_MultiProcessingLauncher, "_wrapping_function", "_MultiProcessingLauncher._wrapping_function"),
        ) if not callable(getattr(owner, attr, None))
    ]
    if problems:
        raise private_api_error("fsdp2_strategy's Fabric adapter", "lightning", lightning.__version__, problems)


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


class ShutdownMultiProcessingLauncher(_MultiProcessingLauncher):
    """Fabric's spawn launcher whose workers end through `fsdp2_strategy.shutdown()`.

    A spawned worker otherwise leaves through interpreter finalisation with the gloo process
    group alive (Fabric never destroys it), which can abort after a DCP save (see the Trainer
    adapter's launcher); the user's function cannot add the call after Fabric's own code runs.
    """

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)  # rank 0 has put its result on the queue
        shutdown()


check_private_api()

"""Every private Lightning symbol the adapter touches, in one place, checked at import.

- `lightning.pytorch.core.saving.pl_load`: `LightningModule.load_from_checkpoint` reads
  checkpoints through it; the adapter teaches it sharded checkpoint directories (it only reads
  files).
- `_MultiProcessingLauncher._collect_rank_zero_results`: with a spawn start method it sends
  `lightning_module.state_dict()` back to the parent, which holds an unsharded copy; the adapter
  sends the full (gathered) state instead of DTensor shards; `_wrapping_function` (the worker's
  body) is extended to end the worker cleanly.
- `lightning.pytorch.strategies.launchers.subprocess_script._SubprocessScriptLauncher`: the
  "popen" launcher `ModelParallelStrategy` uses, configured the same way here.
- `lightning.fabric.utilities.optimizer._optimizers_to_device`: moves optimizer state to the
  root device after setup, as Lightning's own strategies do.
- `lightning.pytorch.trainer.connectors.data_connector._request_dataloader`: how the fit loop asks
  its data source for the train dataloader; `objective="throughput"` asks the same way for the
  loader its example batch comes from.

Each is reached through `versions.find_private`; `check_private_api()` runs at import, before
anything is built on them, and raises ImportError naming every symbol a Lightning release moved
(tests call it too), instead of failing later mid-training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch.core.saving as _saving
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdp2_strategy.checkpoint import directory as cdir
from fsdp2_strategy.checkpoint import read_full_model_state
from fsdp2_strategy.versions import find_private, private_api_error

from .._lightning_shared import ShutdownAfterWorker, is_sharded_checkpoint, read_meta

_missing: list[str] = []
find_private("lightning.pytorch.core.saving:pl_load", _missing)
_LAUNCHERS = "lightning.pytorch.strategies.launchers"
_MultiProcessingLauncher = find_private(f"{_LAUNCHERS}.multiprocessing:_MultiProcessingLauncher", _missing)
for _method in ("_collect_rank_zero_results", "_wrapping_function"):
    find_private(f"{_LAUNCHERS}.multiprocessing:_MultiProcessingLauncher.{_method}", _missing)
SubprocessScriptLauncher = find_private(f"{_LAUNCHERS}.subprocess_script:_SubprocessScriptLauncher", _missing)
optimizers_to_device = find_private("lightning.fabric.utilities.optimizer:_optimizers_to_device", _missing)
request_dataloader = find_private("lightning.pytorch.trainer.connectors.data_connector:_request_dataloader", _missing)


def check_private_api() -> None:
    """Raise ImportError naming every Lightning symbol above that a release moved."""
    if _missing:
        raise private_api_error("fsdp2_strategy's Lightning adapter", "lightning", lightning.__version__, _missing)


check_private_api()  # before the classes below subclass what it checked


def load_sharded_as_full(path: str | Path, map_location: Any = None, weights_only: Any = None) -> dict[str, Any]:
    """A sharded checkpoint as the dict a full `.ckpt` file holds (model weights gathered).

    For one process (`load_from_checkpoint`, inference): checksums are verified first, then
    `meta.pt` and the model tensors are read as data (`meta.pt` trusted with `weights_only=False`),
    the tensors unsharded onto the CPU; optimizer state is not loaded.
    """
    path = Path(path)
    cdir.verify_dir(path)
    checkpoint = read_meta(path, weights_only)
    checkpoint["state_dict"] = read_full_model_state(path, verify=False)  # verified above
    return checkpoint


_original_pl_load = _saving.pl_load


def _pl_load(path_or_url: Any, map_location: Any = None, weights_only: Any = None) -> Any:
    if is_sharded_checkpoint(path_or_url):
        return load_sharded_as_full(path_or_url, map_location, weights_only)
    return _original_pl_load(path_or_url, map_location=map_location, weights_only=weights_only)


def install_checkpoint_loader() -> None:
    """Make `LightningModule.load_from_checkpoint(dir)` read sharded checkpoint directories."""
    _saving.pl_load = _pl_load


@contextlib.contextmanager
def _state_dict_returns(module: nn.Module, state: dict) -> Iterator[None]:
    module.state_dict = lambda *args, **kwargs: state  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.state_dict


class FullStateMultiProcessingLauncher(ShutdownAfterWorker, _MultiProcessingLauncher):  # type: ignore[misc,valid-type]
    """Lightning's spawn launcher, returning full weights to the (unsharded) parent process; its
    workers end through `fsdp2_strategy.shutdown()` (see `ShutdownAfterWorker`)."""

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        module = trainer.lightning_module
        # A collective: every rank takes part; rank 0 ends up with the full state on CPU.
        full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        with _state_dict_returns(module, full):
            return super()._collect_rank_zero_results(trainer, results)

"""Every private Lightning symbol the adapter touches, in one place, checked at import.

- `lightning.pytorch.core.saving.pl_load`: `LightningModule.load_from_checkpoint` reads
  checkpoints through it; we teach it sharded checkpoint directories (it only reads files).
- `_MultiProcessingLauncher._collect_rank_zero_results`: with a spawn start method it sends
  `lightning_module.state_dict()` back to the parent, which holds an unsharded copy; we send
  the full (gathered) state instead of DTensor shards; `_wrapping_function` (the worker's body)
  is extended to end the worker cleanly.

`check_private_api()` runs at import and raises ImportError naming the missing symbol if a
Lightning release moved one (tests call it too), instead of failing later mid-training.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import lightning
import lightning.pytorch.core.saving as _saving
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdp2_strategy.checkpoint import directory as cdir
from fsdp2_strategy.distributed import shutdown
from fsdp2_strategy.checkpoint import read_full_model_state
from fsdp2_strategy.versions import private_api_error

META_FILE = "meta.pt"  # Lightning's name for the non-tensor state in a sharded checkpoint


def check_private_api() -> None:
    """Raise ImportError if a Lightning symbol we rely on is gone or changed shape."""
    problems = []
    if not callable(getattr(_saving, "pl_load", None)):
        problems.append("lightning.pytorch.core.saving.pl_load")
    for method in ("_collect_rank_zero_results", "_wrapping_function"):
        if not callable(getattr(_MultiProcessingLauncher, method, None)):
            problems.append(f"_MultiProcessingLauncher.{method}")
    if problems:
        raise private_api_error("fsdp2_strategy's Lightning adapter", "lightning", lightning.__version__, problems)


def is_sharded_checkpoint(path: Any) -> bool:
    """A DCP directory with Lightning's `meta.pt` (what `state_dict_type="sharded"` writes)."""
    return isinstance(path, (str, Path)) and cdir.is_committed(Path(path)) and (Path(path) / META_FILE).is_file()


def load_sharded_as_full(path: str | Path, map_location: Any = None, weights_only: Any = None) -> dict[str, Any]:
    """A sharded checkpoint as the dict a full `.ckpt` file holds (model weights gathered).

    For one process (`load_from_checkpoint`, inference): checksums are verified first, then
    the model tensors are read unsharded; optimizer state is not loaded.
    """
    path = Path(path)
    cdir.verify_dir(path)
    checkpoint = _original_pl_load(path / META_FILE, map_location=map_location, weights_only=weights_only)
    checkpoint["state_dict"] = read_full_model_state(path)
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


class FullStateMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's spawn launcher, returning full weights to the (unsharded) parent process.

    Its workers end through `fsdp2_strategy.shutdown()`: a spawned worker otherwise leaves
    through interpreter finalisation with the gloo process group alive (Lightning never
    destroys it) and aborted "terminate called without an active exception" in 1 of 6 runs
    of tests/lightning_scripts/spawn.py. The user cannot add that call: the worker runs only
    Lightning's function, so the launcher does.
    """

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)  # rank 0 has put its results on the queue
        # A worker that raised never gets here: torch.multiprocessing reports its traceback.
        shutdown()

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        module = trainer.lightning_module
        # A collective: every rank takes part; rank 0 ends up with the full state on CPU.
        full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        with _state_dict_returns(module, full):
            return super()._collect_rank_zero_results(trainer, results)


check_private_api()

"""`fabric.save(path, state)` / `fabric.load(path, state)` on the core's one checkpoint directory.

Fabric's `state` is a dict mixing modules, optimizers and anything else. Modules and optimizers go
through the core (`checkpoint.directory.save_dir` / `load_dir`, under their keys in `state`); the rest
is rank 0's `meta.pt` in the same directory (Fabric's own name for it), stateful objects by their
`state_dict()`. Nothing here shards or writes tensors: this module only sorts `state`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer

from fsdp2_strategy.checkpoint import AsyncSaver, owning_models, sharded_state
from fsdp2_strategy.checkpoint import directory as cdir

from .._lightning_shared import META_FILE, is_sharded_checkpoint, not_committed_error, read_meta, trusts

__all__ = ["load", "save", "split_state"]


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def split_state(state: dict[str, Any], action: str) -> tuple[dict, dict, dict]:
    """`state` as (models by key, optimizers by key -> (their model, optimizer), the rest).

    Each optimizer is paired with the model in `state` that owns its parameters; raises
    ValueError (naming the key and the fix) when there is no model or an optimizer has no owner.
    """
    models = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    if not models:
        raise ValueError(
            f"fabric.{action}(path, state) with strategy='fsdp2' needs the model in `state`, e.g. "
            f"{{'model': model, 'optimizer': optimizer, ...}}; got the keys {sorted(state)}."
        )
    optimizers = {}
    for key, optimizer in state.items():
        if not isinstance(optimizer, Optimizer):
            continue
        owners = owning_models(optimizer, models)
        if not owners:
            raise ValueError(
                f"fabric.{action}: the optimizer under {key!r} updates none of the models in `state` "
                f"({sorted(models)}); put its model in the same state, set up with fabric.setup."
            )
        optimizers[key] = (models[owners[0]], optimizer)
    rest = {k: v for k, v in state.items() if k not in models and k not in optimizers}
    return models, optimizers, rest


def save(
    path: Path, state: dict[str, Any], *, trainable_only: bool | str = "auto", saver: AsyncSaver | None = None
) -> None:
    """Collective: models and optimizers as DCP shards, the rest in `meta.pt`, committed atomically.
    `trainable_only`: `FSDP2Config.checkpoint_trainable_only`; `saver`: writes in the background
    (`FSDP2Config.checkpoint_async_save`), committed by its `wait()`.

    A name saved again is replaced whole (the old directory stays loadable until the new one is
    committed), so a crash mid-save loses at most that save.
    """
    models, optimizers, rest = split_state(state, "save")
    files = {META_FILE: {k: v.state_dict() if _is_stateful(v) else v for k, v in rest.items()}}
    shards = sharded_state(models, optimizers, trainable_only=trainable_only)
    cdir.save_dir(path, shards, files=files, replace=True, saver=saver, models=models)


def load(path: Path, state: dict[str, Any], *, strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
    """Collective: restore `state`'s models, optimizers and other entries from directory `path`;
    return what the checkpoint holds beyond `state` (Fabric's contract).

    The checksums, then `meta.pt` and every non-tensor entry read as data (`weights_only=False`
    trusts the checkpoint: `f2.UntrustedCheckpointError` names what was refused), and the models'
    keys and shapes are checked before any tensor changes (then,
    as in Fabric, a requested non-tensor entry missing from `meta.pt` raises KeyError); a
    directory without `.metadata` (a save that did not finish) is refused. Other entries: a
    stateful object gets `load_state_dict`, anything else is replaced in `state`.
    """
    if not is_sharded_checkpoint(path):
        raise not_committed_error(path, "Pick another checkpoint, or use fabric.load_raw for a file of full weights.")
    models, optimizers, rest = split_state(state, "load")
    cdir.verify_dir(path)  # every file (meta.pt too) before any is parsed
    meta = read_meta(path, weights_only)  # as data unless weights_only=False, before any tensor changes
    cdir.load_dir(path, models, optimizers, strict=strict, trusted=trusts(weights_only), verify=False)
    missing = sorted(set(rest) - set(meta))
    if strict and missing:
        raise KeyError(  # Fabric's own wording first: code that matches it keeps working
            f"The requested state contains a key {missing[0]!r} that does not exist in the loaded checkpoint "
            f"{path} (missing: {missing}; it holds {sorted(meta)}); pass strict=False to load the rest."
        )
    for key in set(rest) & set(meta):
        value = meta.pop(key)
        if _is_stateful(state[key]):
            state[key].load_state_dict(value)
        else:
            state[key] = value
    return meta

"""Which FSDP1 save a path is, and where its model, optimizer and trainer state lie.

| what the user passes | format | model | optimizer | trainer state |
|---|---|---|---|---|
| a DCP folder with `meta.pt` | Lightning `FSDPStrategy(state_dict_type="sharded")` | "model" | "optimizer_0" | `meta.pt` |
| a DCP folder | torch `SHARDED_STATE_DICT` saved with `dcp.save` | "model" | "optim" or "optimizer" | other top-level entries |
| a file holding "state_dict" and "optimizer_states" | Lightning full `.ckpt` | "state_dict" | "optimizer_states"[0] | the rest |
| a folder with `pytorch_model_fsdp_0/` or `pytorch_model_fsdp.bin` | Accelerate FSDP1 `save_state` | that | `optimizer_0/` or `optimizer.bin` | `scheduler.bin`, `random_states_0.pkl` |
| a file holding a model state dict (+ `optimizer_file`) | torch `FULL_STATE_DICT` | the file | `FSDP.optim_state_dict` file | none |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .fsdp1_files import (
    TensorSource,
    dcp_small_entries,
    dcp_source,
    dcp_top_keys,
    dcp_world_size,
    dict_source,
    is_dcp_folder,
    load_torch_file,
)

DCP_OPTIM_KEYS = ("optim", "optimizer_0", "optimizer")
"""Top-level keys under which FSDP1 users' DCP saves hold `FSDP.optim_state_dict` (torch's recipe,
Lightning, Accelerate)."""
LIGHTNING_META = "meta.pt"
ACCELERATE_MODEL, ACCELERATE_OPTIM = "pytorch_model_fsdp", "optimizer"


@dataclass
class FSDP1Save:
    """One FSDP1 save, read: its model and optimizer state and what the trainer kept beside them."""

    format: str
    model: TensorSource
    optim: TensorSource | None
    trainer_state: dict[str, Any] = field(default_factory=dict)
    counter: int | None = None  # the trainer's step counter, when it kept one
    source_world_size: int | None = None


def read_fsdp1_save(source: Path, optimizer_file: Path | None = None, *, trusted: bool = False) -> FSDP1Save:
    """The save at `source` (see the module's table), its optimizer from `optimizer_file` for a full
    model file; its torch files read as data unless `trusted` (`fsdp1_files.load_torch_file`).

    Raises:
        FileNotFoundError: `source` (or `optimizer_file`) does not exist.
        UntrustedCheckpointError: a torch file holds a type not read as data (not `trusted`).
        ValueError: naming the path when it is none of the formats read here.
    """
    if not source.exists():
        raise FileNotFoundError(f"FSDP1 checkpoint {source} does not exist")
    if optimizer_file is not None and not optimizer_file.is_file():
        raise FileNotFoundError(f"optimizer file {optimizer_file} does not exist")
    if is_dcp_folder(source):
        if optimizer_file is not None:
            raise ValueError(f"{source} is a DCP folder holding its optimizer state: pass no optimizer file")
        return _dcp_save(source, trusted)
    if source.is_dir():
        return _accelerate_save(source, trusted)
    return _file_save(source, optimizer_file, trusted)


def _dcp_save(folder: Path, trusted: bool) -> FSDP1Save:
    keys = dcp_top_keys(folder)
    if "model" not in keys:
        raise ValueError(
            f"{folder} is a DCP folder without a 'model' entry (top-level keys: {sorted(keys)}): FSDP1 saves put "
            "the model under 'model' (dcp.save({'model': model.state_dict(), 'optim': ...}))"
        )
    optim_key = next((k for k in DCP_OPTIM_KEYS if k in keys), None)
    world = dcp_world_size(folder)
    if (folder / LIGHTNING_META).is_file():
        meta = load_torch_file(folder / LIGHTNING_META, trusted=trusted)
        return FSDP1Save(
            "lightning-sharded",
            dcp_source(folder, "model"),
            dcp_source(folder, optim_key) if optim_key else None,
            _lightning_state(meta),
            _int(meta.get("global_step")),
            world,
        )
    others = sorted(keys - {"model", optim_key})
    other_values = dcp_small_entries(folder, others)
    counter = other_values.get("step")
    return FSDP1Save(
        "torch-sharded",
        dcp_source(folder, "model"),
        dcp_source(folder, optim_key) if optim_key else None,
        {"source_state": _unflatten(other_values)} if other_values else {},
        _int(counter),
        world,
    )


def _accelerate_save(folder: Path, trusted: bool) -> FSDP1Save:
    model_dcp, model_bin = folder / f"{ACCELERATE_MODEL}_0", folder / f"{ACCELERATE_MODEL}.bin"
    optim_dcp, optim_bin = folder / f"{ACCELERATE_OPTIM}_0", folder / f"{ACCELERATE_OPTIM}.bin"
    if is_dcp_folder(model_dcp):
        model, world = dcp_source(model_dcp, "model"), dcp_world_size(model_dcp)
    elif model_bin.is_file():
        model, world = dict_source(model_bin, load_torch_file(model_bin, trusted=trusted)), None
    else:
        names = sorted(p.name for p in folder.iterdir())[:10]
        raise ValueError(
            f"{folder} is neither a DCP folder (no .metadata) nor an Accelerate FSDP save_state folder (no "
            f"{model_dcp.name}/ or {model_bin.name}); found: {names or 'nothing'}. Pass the folder "
            "save_state wrote, a DCP folder, or a full model file."
        )
    if is_dcp_folder(optim_dcp):
        optim: TensorSource | None = dcp_source(optim_dcp, "optimizer")
    elif optim_bin.is_file():
        optim = dict_source(optim_bin, load_torch_file(optim_bin, trusted=trusted))
    else:
        optim = None
    state: dict[str, Any] = {}
    if (folder / "scheduler.bin").is_file():
        state["lr_scheduler"] = load_torch_file(folder / "scheduler.bin", trusted=trusted)
    rng = folder / "random_states_0.pkl"
    counter = _int(load_torch_file(rng, trusted=trusted).get("step")) if rng.is_file() else None
    return FSDP1Save("accelerate", model, optim, state, counter, world)


def _file_save(path: Path, optimizer_file: Path | None, trusted: bool) -> FSDP1Save:
    state = load_torch_file(path, trusted=trusted)
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict or a Lightning checkpoint")
    if "state_dict" in state and "optimizer_states" in state:
        if optimizer_file is not None:
            raise ValueError(f"{path} is a Lightning checkpoint holding its optimizer state: pass no optimizer file")
        optims = state["optimizer_states"]
        if len(optims) > 1:
            raise ValueError(f"{path} holds {len(optims)} optimizers' states; one optimizer is converted")
        return FSDP1Save(
            "lightning-full",
            dict_source(path, state["state_dict"]),
            dict_source(path, optims[0]) if optims else None,
            _lightning_state(state),
            _int(state.get("global_step")),
        )
    tensors = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if tensors:
        raise ValueError(
            f"{path} is neither a Lightning checkpoint nor a model state dict (non-tensor entries "
            f"{sorted(map(str, tensors))[:5]}); pass a FULL_STATE_DICT model file, a DCP folder or a save_state folder"
        )
    optim = dict_source(optimizer_file, load_torch_file(optimizer_file, trusted=trusted)) if optimizer_file else None
    return FSDP1Save("torch-full", dict_source(path, state), optim)


def _lightning_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What Lightning kept beside the model and optimizer: the first scheduler as `lr_scheduler`, the
    counters, and everything else under "lightning"."""
    rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    schedulers = rest.get("lr_schedulers") or []
    return {
        "lr_scheduler": schedulers[0] if schedulers else None,
        "global_step": rest.get("global_step"),
        "epoch": rest.get("epoch"),
        "lightning": rest,
    }


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    """DCP's flattened keys ("scheduler.last_epoch") back into nested dicts."""
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def _int(value: Any) -> int | None:
    if isinstance(value, torch.Tensor):
        value = value.item()
    return None if value is None else int(value)

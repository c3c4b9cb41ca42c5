"""Consolidate a sharded DCP checkpoint into full weights, and describe a checkpoint.

Runs in one process, without a process group: tensors are read from the DCP files with
`no_dist=True`, a bounded batch at a time, so memory stays near one output file's size.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..distributed import logger
from ..precision import dtype_from_name
from . import directory as cdir
from . import integrity as integrity
from . import safe_load
from .hf_files import DEFAULT_MAX_SHARD_BYTES, ShardWriter
from .layout import saved_world_size
from .peft import PEFT_ENTRY

# Where the model's tensors sit in a DCP checkpoint: `Checkpointer` ("model.") and
# Lightning's sharded checkpoints ("state_dict."; also what our Lightning adapter writes).
MODEL_PREFIXES = ("model.", "state_dict.")


def resolve_checkpoint_dir(path: str | Path, step: int | None = None) -> Path:
    """A DCP directory: `path` itself, or a step of a `Checkpointer` root (the latest by default)."""
    path = Path(path)
    if step is None and cdir.is_committed(path):
        return path
    return cdir.resolve_step(path, "latest" if step is None else step)


def verified_checkpoint_dir(checkpoint_dir: str | Path, step: int | None = None) -> Path:
    """`resolve_checkpoint_dir`, its files checked against `checksums.json` (ValueError if damaged)."""
    ckpt_dir = resolve_checkpoint_dir(checkpoint_dir, step)
    integrity.warn_if_unverified(ckpt_dir)
    problems = integrity.check(ckpt_dir)  # one process: every file listed in checksums.json
    if problems:
        raise ValueError(
            f"Checkpoint {ckpt_dir} is damaged and was not exported:\n  "
            + "\n  ".join(problems)
            + "\nExport an earlier step (step=N, or --step N)."
        )
    return ckpt_dir


def read_objects(ckpt_dir: Path, keys: list[str]) -> dict[str, Any]:
    """Non-tensor entries (pickled objects) of a checkpoint, in this one process."""
    state: dict[str, Any] = dict.fromkeys(keys, "")
    _dcp_read(ckpt_dir, state)
    return state


def model_tensor_keys(metadata: Metadata) -> dict[str, str]:
    """Output name -> DCP key for the model's tensors (keys under a known model prefix when present)."""
    tensors = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    for prefix in MODEL_PREFIXES:
        prefixed = {k for k in tensors if k.startswith(prefix)}
        if prefixed:
            return {k[len(prefix) :]: k for k in sorted(prefixed)}
    return {k: k for k in sorted(tensors)}


def read_full_model_state(
    checkpoint_dir: str | Path, step: int | None = None, *, verify: bool = True
) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) tensors from a sharded checkpoint, in this one process.

    For single-process use (inference, `load_from_checkpoint`): every tensor is materialised,
    so this needs host memory for the whole model; `export_full` streams instead. The files are
    checked against `checksums.json` first (`verify=False`: the caller did), then read as data.

    Raises:
        ValueError: a file does not match `checksums.json`, or the metadata is unreadable
            (`UntrustedCheckpointError` where it holds a type DCP's metadata does not).
    """
    ckpt_dir = resolve_checkpoint_dir(checkpoint_dir, step)
    problems = integrity.check(ckpt_dir) if verify else []  # one process: not the collective verify_dir
    if problems:
        raise ValueError(f"Checkpoint {ckpt_dir} is damaged and was not read:\n  " + "\n  ".join(problems))
    metadata = cdir.read_metadata(ckpt_dir)
    keys = model_tensor_keys(metadata)
    return _read(ckpt_dir, metadata, keys, list(keys), None)


def write_model_view(checkpoint_dir: str | Path, key: str, view: str, *, as_key: str = "model") -> Path:
    """Write `checkpoint_dir/view/.metadata`: a DCP directory holding only the entries saved under
    `key` (renamed to `as_key`), whose data is the parent's own shard files (no tensor is written
    twice). For tools that expect one model per DCP directory, such as `accelerate merge-weights`
    (`merge_fsdp_weights`) on Accelerate's `pytorch_model_fsdp_0/`. Rank 0, before the commit
    (so `checksums.json` covers it). Returns the view directory.
    """
    checkpoint_dir = Path(checkpoint_dir)
    metadata = cdir.read_metadata(checkpoint_dir)
    prefix = key + "."

    def renamed(fqn: str) -> str:
        return as_key + "." + fqn[len(prefix) :]

    view_metadata = Metadata(
        state_dict_metadata={renamed(k): v for k, v in metadata.state_dict_metadata.items() if k.startswith(prefix)},
        planner_data={
            renamed(k): (as_key, *path[1:]) for k, path in (metadata.planner_data or {}).items() if k.startswith(prefix)
        },
        storage_data={
            dataclasses.replace(index, fqn=renamed(index.fqn)): dataclasses.replace(
                info, relative_path=f"../{info.relative_path}"
            )
            for index, info in metadata.storage_data.items()
            if index.fqn.startswith(prefix)
        },
        storage_meta=metadata.storage_meta,
        version=metadata.version,
    )
    if not view_metadata.state_dict_metadata:
        raise ValueError(
            f"{checkpoint_dir} holds no entries under {key!r}; saved keys start with "
            f"{sorted({k.split('.')[0] for k in metadata.state_dict_metadata})}."
        )
    out = checkpoint_dir / view
    out.mkdir(exist_ok=True)
    with open(out / cdir.METADATA, "wb") as f:
        pickle.dump(view_metadata, f)  # DCP's own format for `.metadata`
        f.flush()
        os.fsync(f.fileno())
    return out


def _nbytes(meta: Any, dtype: torch.dtype | None) -> int:
    """Bytes of one tensor entry (`TensorStorageMetadata`; `tensor_keys` chose only those) in `dtype`."""
    dt = dtype or meta.properties.dtype
    return torch.Size(meta.size).numel() * torch.empty((), dtype=dt).element_size()


def _read(ckpt_dir: Path, metadata: Metadata, keys: dict[str, str], names: list[str], dtype) -> dict[str, torch.Tensor]:
    state = {}
    for name in names:
        meta = cast(TensorStorageMetadata, metadata.state_dict_metadata[keys[name]])
        state[keys[name]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    _dcp_read(ckpt_dir, state)
    return {name: (state[keys[name]].to(dtype) if dtype else state[keys[name]]).contiguous() for name in names}


def _dcp_read(ckpt_dir: Path, state: dict[str, Any]) -> None:
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        try:
            reader = safe_load.SafeFileSystemReader(ckpt_dir)  # `.metadata` read as data again here
            dcp.load(state, storage_reader=reader, planner=safe_load.SafeLoadPlanner(ckpt_dir), no_dist=True)
        except CheckpointException as exc:  # a BaseException whose text is a whole traceback
            raise ValueError(
                f"Reading the shards of {ckpt_dir} failed ({cdir.dcp_failure(exc)}): the checkpoint is damaged or "
                "incomplete. Use an earlier step (step=N, or --step N)."
            ) from None


def read_tensors(ckpt_dir: Path, metadata: Metadata, keys: list[str]) -> dict[str, torch.Tensor]:
    """Full tensors of the DCP `keys` (as saved), in this one process."""
    return _read(ckpt_dir, metadata, {k: k for k in keys}, keys, None)


def _progress(total: int, desc: str):
    try:
        from tqdm.auto import tqdm  # optional: without it, no progress bar

        return tqdm(total=total, desc=desc, unit="B", unit_scale=True)
    except ImportError:  # tqdm is optional: fall back to log lines

        class _Log:
            def __init__(self):
                self.done = 0

            def update(self, n):
                self.done += n
                logger.info("%s: %.1f%%", desc, 100 * self.done / max(total, 1))

            def close(self):
                pass

        return _Log()


def export_full(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    *,
    format: str = "safetensors",
    dtype: str | torch.dtype | None = None,
    step: int | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write the model weights of a sharded checkpoint as full tensors.

    Runs in one process, without a process group; the files are checked against
    `checksums.json` first, and one output file's tensors are read at a time.

    Args:
        checkpoint_dir: A DCP directory, or a `Checkpointer` root (its latest committed step, or
            `step`).
        out_dir: The folder to write (created if missing).
        format: "safetensors" writes `model.safetensors`, or Hugging Face style
            `model-0000i-of-0000N.safetensors` plus `model.safetensors.index.json` when the weights
            exceed `max_shard_size` bytes; "torch" writes one `model.pt` state dict.
        dtype: "bf16", "fp16" or "fp32" (or a torch dtype) to convert to on the way out; None keeps
            the saved dtypes.
        step: The step of a `Checkpointer` root to export (None: the latest committed one).
        max_shard_size: The most bytes per safetensors file (default 5 GiB, Hugging Face's).

    Returns:
        `out_dir`, as a Path.

    Raises:
        ValueError: If `format` or `dtype` is invalid, the checkpoint is damaged or holds no
            tensors, or `out_dir` is a file.
        FileNotFoundError: If `checkpoint_dir` holds no committed checkpoint (or not `step`).
    """
    if format not in ("safetensors", "torch"):
        raise ValueError(f"format={format!r} is invalid; use 'safetensors' or 'torch'.")
    target_dtype = dtype_from_name(dtype, "dtype")
    ckpt_dir = verified_checkpoint_dir(checkpoint_dir, step)
    metadata = cdir.read_metadata(ckpt_dir)
    keys = model_tensor_keys(metadata)
    if not keys:
        raise ValueError(f"{ckpt_dir} holds no tensors to export.")
    if any(k.startswith(PEFT_ENTRY + ".") for k in metadata.state_dict_metadata):
        logger.warning(
            "%s holds a PEFT model: its full weights under PEFT's names load in neither PeftModel nor AutoModel. "
            "Use export_peft (fsdp2-strategy export) for the adapter or merged weights.",
            ckpt_dir,
        )
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"export_full: out_dir {out} is a file; pass a folder (it is created if missing).")
    sizes = {name: _nbytes(metadata.state_dict_metadata[key], target_dtype) for name, key in keys.items()}
    total = sum(sizes.values())
    bar = _progress(total, f"export {ckpt_dir.name}")
    try:
        if format == "torch":
            state = _read(ckpt_dir, metadata, keys, list(keys), target_dtype)
            bar.update(total)
            out.mkdir(parents=True, exist_ok=True)
            torch.save(state, out / "model.pt")
        else:
            _write_safetensors(ckpt_dir, metadata, keys, ShardWriter(out, sizes, max_shard_size), target_dtype, bar)
    finally:
        bar.close()
    logger.info("Exported %d tensors from %s to %s", len(keys), ckpt_dir, out)
    return out


def _write_safetensors(
    ckpt_dir: Path, metadata: Metadata, keys: dict[str, str], writer: ShardWriter, dtype, bar
) -> None:
    for names in writer.files:  # one output file's tensors read at a time
        state = _read(ckpt_dir, metadata, keys, names, dtype)
        for name in names:  # the folder is created by the first write: an unreadable checkpoint leaves none
            writer.add(name, state[name])
        bar.update(sum(t.numel() * t.element_size() for t in state.values()))
    writer.close()


@dataclass
class CheckpointInfo:
    """What `inspect_checkpoint` reports."""

    path: Path
    """The DCP directory described."""
    steps: dict[int, bool]
    """Step -> committed, for every step-N folder of a Checkpointer root."""
    world_size: int
    """Ranks that wrote this checkpoint."""
    tensors: dict[str, tuple[tuple[int, ...], str]]
    """DCP key -> (shape, dtype) of every tensor."""
    other_keys: list[str]
    """Non-tensor entries (pickled objects such as extra state)."""
    checksummed: bool = False
    """Whether the directory holds `checksums.json` (written by every fsdp2_strategy save)."""
    problems: list[str] = field(default_factory=list)
    """Files whose size or checksum differs from `checksums.json` (empty: intact)."""

    def __str__(self) -> str:
        lines = [f"checkpoint: {self.path}", f"saved by {self.world_size} rank(s)"]
        if self.steps:
            lines.append("steps: " + ", ".join(f"{s}{'' if ok else ' (partial)'}" for s, ok in self.steps.items()))
        width = max((len(k) for k in self.tensors), default=10)
        lines.append(f"{'tensor'.ljust(width)}  shape  dtype")
        lines += [f"{k.ljust(width)}  {list(shape)}  {dt}" for k, (shape, dt) in self.tensors.items()]
        if self.other_keys:
            lines.append("other entries: " + ", ".join(self.other_keys))
        if self.problems:
            lines.append("DAMAGED: " + "; ".join(self.problems))
        else:
            lines.append(
                "checksums: " + ("every file matches" if self.checksummed else "none (plain DCP, not verified)")
            )
        return "\n".join(lines)


def inspect_checkpoint(path: str | Path, step: int | None = None) -> CheckpointInfo:
    """Describe a checkpoint: its tensors, the world size that saved it and whether it is intact.

    Runs in one process, without a process group; `str()` of the result is what the
    `fsdp2-strategy inspect` command prints.

    Args:
        path: A DCP directory, or a `Checkpointer` root.
        step: The step of a `Checkpointer` root to describe (None: the latest committed one).

    Returns:
        The directory described, every step of a root (committed or partial), each tensor's shape
        and dtype, the other entries, the saving world size, and the files whose size or checksum
        differs from `checksums.json` (empty when intact).

    Raises:
        FileNotFoundError: If `path` holds no committed checkpoint (or not `step`).
        ValueError: If its metadata cannot be read.
    """
    path = Path(path)
    steps = {step: cdir.is_committed(child) for step, child in cdir.step_dirs(path).items()}
    ckpt_dir = resolve_checkpoint_dir(path, step)
    problems = integrity.check(ckpt_dir)  # before any file is parsed
    unverified = [p for p in problems if p.split(":")[0] in (cdir.METADATA, integrity.CHECKSUMS_FILE)]
    if unverified:
        raise ValueError(
            f"Checkpoint {ckpt_dir} is damaged: " + "; ".join(unverified) + f". Its {cdir.METADATA} is not read "
            f"when it does not match {integrity.CHECKSUMS_FILE}. {cdir.alternatives_hint(ckpt_dir)}"
        )
    metadata = cdir.read_metadata(ckpt_dir)
    tensors, others = {}, []
    for key, meta in sorted(metadata.state_dict_metadata.items()):
        if isinstance(meta, TensorStorageMetadata):
            tensors[key] = (tuple(meta.size), str(meta.properties.dtype).removeprefix("torch."))
        else:
            others.append(key)
    return CheckpointInfo(
        ckpt_dir,
        steps,
        saved_world_size(metadata),
        tensors,
        others,
        checksummed=(ckpt_dir / integrity.CHECKSUMS_FILE).is_file(),
        problems=problems,
    )

"""The sharded-checkpoint format both Lightning adapters write: a committed DCP directory plus
rank 0's `meta.pt` (the non-tensor state; Lightning's and Fabric's own name for it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsdp2_strategy.checkpoint import directory as cdir
from fsdp2_strategy.checkpoint import load_small_file

META_FILE = "meta.pt"


def is_sharded_checkpoint(path: Any) -> bool:
    """Whether `path` is a committed sharded checkpoint: `.metadata` (the commit marker) and `meta.pt`."""
    return isinstance(path, (str, Path)) and cdir.is_committed(Path(path)) and (Path(path) / META_FILE).is_file()


def not_committed_error(path: Path, alternative: str) -> FileNotFoundError:
    """The error for a directory that is not a committed sharded checkpoint (`alternative`: what to do instead)."""
    return FileNotFoundError(
        f"{path} is not a committed fsdp2 checkpoint (no .metadata and {META_FILE}): a save "
        f"that did not finish is never loaded. {alternative}"
    )


def trusts(weights_only: bool | None) -> bool:
    """Whether a load trusts the checkpoint: only an explicit `weights_only=False`, Lightning's and
    torch's own switch for "unpickle anything". None (Lightning's default) and True read it as data."""
    return weights_only is False


def read_meta(path: Path, weights_only: bool | None) -> dict[str, Any]:
    """`meta.pt` of a sharded checkpoint, or a whole `.ckpt` file (memory-mapped: its tensors are read
    when used), read as data unless `trusts(weights_only)`.

    Raises:
        UntrustedCheckpointError: it holds a type the reader does not admit (the error says how to trust it).
        ValueError: it is unreadable.
    """
    path = Path(path)
    file = path / META_FILE if path.is_dir() else path
    return load_small_file(file, name=file, trusted=trusts(weights_only), mmap=True)

"""The sharded-checkpoint format both Lightning adapters write: a committed DCP directory plus
rank 0's `meta.pt` (the non-tensor state; Lightning's and Fabric's own name for it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsdp2_strategy.checkpoint import directory as cdir

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

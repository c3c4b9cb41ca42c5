"""Checkpoint files read as data: loading a checkpoint never runs code that its author put in it.

A checkpoint may come from someone else (a colleague's fine-tune, a run from a hub), and Python's
unpickler calls whatever a pickle names. So each file of a checkpoint directory is read by a reader
that admits only the types such a file holds:

- DCP's `.metadata` (`read_metadata_file`, `SafeFileSystemReader`): DCP's metadata classes and the
  torch and builtin types they hold (`METADATA_GLOBALS`);
- the non-tensor entries of DCP's shard files (optimizer hyperparameters, counters) and the small
  files beside them (`extra.pt`): `torch.load(weights_only=True)`, which admits tensors, containers
  and primitives, plus NumPy arrays and scalars (RNG states, `NUMPY_GLOBALS`).

Both also admit what `torch.serialization.add_safe_globals` (or its `safe_globals` context) admits:
that is how a user trusts a type of their own. `trusted=True` reads a checkpoint you wrote yourself
with the full unpickler. A refusal is an `UntrustedCheckpointError` (a ValueError) that names the
file, the type and both switches.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta

__all__ = [
    "METADATA_GLOBALS",
    "NUMPY_GLOBALS",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "UntrustedCheckpointError",
    "check_byte_entries",
    "load_small_file",
    "read_metadata_file",
]

METADATA_GLOBALS = frozenset(
    {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a name -> torch.layout lookup
        ("pathlib", "Path"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("collections", "OrderedDict"),
    }
)
"""What DCP's `.metadata` pickles besides the classes of `torch.distributed.checkpoint.metadata` and
torch's dtypes, layouts and memory formats (all admitted)."""

NUMPY_GLOBALS = (
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.multiarray", "scalar"),
)
"""NumPy arrays and scalars (`np.random.get_state()`, metric values): admitted in small files."""

TRUST_HINT = (
    "If you trust where this checkpoint came from (you wrote it), admit this one type with "
    "torch.serialization.add_safe_globals([...]), or trust the whole checkpoint: trusted=True "
    "(Checkpointer.load, load_step_dir, convert_*_checkpoint), weights_only=False (fabric.load, "
    "LightningModule.load_from_checkpoint; accelerator.load_state(dir, load_kwargs={'weights_only': False})), "
    "--trust (the convert commands)."
)
_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_TORCH_KINDS = (torch.dtype, torch.layout, torch.memory_format)


class UntrustedCheckpointError(ValueError):
    """A checkpoint file holds a type that only a trusted checkpoint may hold (see the module docstring)."""

    def __init__(self, file: Path | str, what: str) -> None:
        super().__init__(
            f"{file} holds {what}, which checkpoint files are not read with: unpickling an arbitrary type "
            f"can run code its author chose. Nothing was loaded (the model and optimizer are unchanged). "
            f"{TRUST_HINT}"
        )
        self.file = str(file)


def _user_safe_globals() -> set[tuple[str, str]]:
    """What `torch.serialization.add_safe_globals` admits now, as (module, name)."""
    names = set()
    for entry in torch.serialization.get_safe_globals():
        obj, name = entry if isinstance(entry, tuple) else (entry, None)
        if name is not None:
            module, _, qualname = name.rpartition(".")
            names.add((module, qualname))
        else:
            names.add((getattr(obj, "__module__", ""), getattr(obj, "__qualname__", "")))
    return names


def _metadata_global(module: str, name: str) -> bool:
    if (module, name) in METADATA_GLOBALS or (module, name) in _user_safe_globals():
        return True
    if module == "torch":
        return isinstance(getattr(torch, name, None), _TORCH_KINDS)
    if module == _DCP_METADATA_MODULE:
        return isinstance(getattr(importlib.import_module(module), name, None), type)
    return False


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if not _metadata_global(module, name):
            raise UntrustedCheckpointError(self._path, f"the type {module}.{name}")
        return super().find_class(module, name)


def read_metadata_file(path: Path, *, trusted: bool = False) -> Metadata:
    """DCP's `Metadata` from the file `path` (a directory's `.metadata`), by the restricted unpickler.

    Raises:
        UntrustedCheckpointError: the file names a type outside `METADATA_GLOBALS` (not `trusted`).
        ValueError: the file is unreadable or holds something other than DCP metadata.
    """
    path = Path(path)
    with open(path, "rb") as f:
        try:
            metadata = pickle.load(f) if trusted else _MetadataUnpickler(f, path).load()
        except UntrustedCheckpointError:
            raise
        except Exception as exc:  # truncated or bit-flipped: fails anywhere inside unpickling
            raise ValueError(f"{path} is unreadable ({type(exc).__name__}: {exc}): the checkpoint is damaged.") from exc
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{path} holds a {type(metadata).__name__}, not DCP metadata: the checkpoint is damaged.")
    return metadata


def load_small_file(source: Path | io.BytesIO, *, name: str | Path, trusted: bool = False, mmap: bool = False) -> Any:
    """`torch.load` of a small checkpoint file (or a shard file's non-tensor entry) onto the CPU:
    `weights_only` plus `NUMPY_GLOBALS` unless `trusted`. `name` is what the error calls it; `mmap`:
    a file's tensors are read when used (a large file whose small entries are wanted).

    Raises:
        UntrustedCheckpointError: it holds another type (not `trusted`).
        ValueError: it is unreadable.
    """
    if trusted:
        return torch.load(source, map_location="cpu", weights_only=False, mmap=mmap)
    try:
        with _numpy_admitted():
            return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        refused = re.search(r"GLOBAL ([\w.]+)|got <class '([\w.]+)'>", str(exc))
        if refused or "weights_only" in str(exc).lower():
            what = f"the type {refused.group(1) or refused.group(2)}" if refused else "a type"
            raise UntrustedCheckpointError(name, what) from None
        raise ValueError(f"{name} is unreadable (UnpicklingError: {exc}): the checkpoint is damaged.") from exc
    except Exception as exc:
        raise ValueError(f"{name} is unreadable ({type(exc).__name__}: {exc}): the checkpoint is damaged.") from exc


@contextlib.contextmanager
def _numpy_admitted() -> Iterator[None]:
    """`NUMPY_GLOBALS` admitted for the block only (the process's own safe globals are left alone)."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        yield
        return
    found: list[Any] = []
    for module, name in NUMPY_GLOBALS:
        with contextlib.suppress(ImportError, AttributeError):
            found.append(getattr(importlib.import_module(module), name))
    # The dtype classes of numeric arrays (np.dtypes.UInt32DType, ...); object arrays stay refused.
    dtypes = importlib.import_module("numpy.dtypes")
    found += [t for t in vars(dtypes).values() if isinstance(t, type) and t.__name__ != "ObjectDType"]
    with torch.serialization.safe_globals(found):
        yield


def check_byte_entries(checkpoint: Path, metadata: Metadata) -> dict[str, Any]:
    """Read every non-tensor entry of the shard files with `load_small_file` before DCP loads anything,
    so that a refused entry leaves the model and optimizer unchanged (DCP fills tensors in place as it
    reads). Entries DCP wrote through a transform (compression) are left to `SafeLoadPlanner`.

    Returns:
        The entries read, by fqn: give them to `SafeLoadPlanner(checked=)` so each is unpickled once.

    Raises:
        UntrustedCheckpointError: an entry holds a type the reader does not admit.
        ValueError: an entry or its shard file is unreadable.
    """
    checkpoint = Path(checkpoint)
    checked: dict[str, Any] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        info = metadata.storage_data.get(MetadataIndex(fqn)) if isinstance(entry, BytesStorageMetadata) else None
        if info is None or getattr(info, "transform_descriptors", None):
            continue
        name = f"{checkpoint} (its entry {fqn!r})"
        try:
            with open(checkpoint / info.relative_path, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
        except OSError as exc:
            raise ValueError(f"{name} is unreadable ({exc}): the checkpoint is damaged.") from exc
        checked[fqn] = load_small_file(io.BytesIO(data), name=name)
    return checked


class SafeFileSystemReader(FileSystemReader):
    """DCP's `FileSystemReader` whose `.metadata` is read by `read_metadata_file` (unless `trusted`)."""

    def __init__(self, path: str | Path, *, trusted: bool = False) -> None:
        super().__init__(str(path))
        self._trusted = trusted

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        metadata = read_metadata_file(Path(str(self.path)) / name, trusted=self._trusted)
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id  # as DCP's own reader does
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner whose non-tensor entries are read by `load_small_file` (DCP's own
    `load_bytes` is `torch.load(weights_only=False)`), or taken from `checked` (`check_byte_entries`)."""

    def __init__(self, checkpoint: Path, *, trusted: bool = False, checked: dict[str, Any] | None = None) -> None:
        super().__init__()
        self._checkpoint = Path(checkpoint)
        self._trusted = trusted
        self._checked = checked or {}

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        if self._trusted:
            super().load_bytes(read_item, value)
            return
        fqn = read_item.dest_index.fqn
        if fqn in self._checked:
            obj = copy.deepcopy(self._checked[fqn])  # a load may read the same entry twice
        else:
            obj = load_small_file(value, name=f"{self._checkpoint} (its entry {fqn!r})")
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes, minus its full unpickler
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj

"""Fixtures shared by the bad-input tables: rows, and a folder of good and damaged files.

`Env(root)` writes a model's weights (other values than the model holds, so any copy shows),
damaged safetensors/torch/index files, and checkpoints (intact, with a flipped byte, with an
unreadable `.metadata`, without shards, without `checksums.json`). `Env.snapshot()` records every file, folder and model
tensor, so a row can assert that a refused input changed nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import fsdp2_strategy as f2
from helpers.models import TinyGPT


@dataclass
class Row:
    """One bad input: `call(env)` must raise `error` whose message holds every phrase in `says`."""

    id: str
    call: Callable[[Env], Any]
    error: type[BaseException]
    says: tuple[str, ...]


@dataclass
class CliRow:
    """One bad command line: exit status `status`, stderr holding `says`, no traceback."""

    id: str
    argv: Callable[[Env], list[str]]
    status: int
    says: tuple[str, ...]


class Env:
    """The fixtures every row sees: a model and files (good and damaged) under `root`."""

    def __init__(self, root: Path):
        from safetensors.torch import save_file

        self.root = root
        torch.manual_seed(0)
        self.model = TinyGPT(tied=False)
        # Other values than the model holds: a load that copied anything would show in the snapshot.
        state = {k: v.detach() + 1 for k, v in self.model.state_dict().items()}
        save_file(state, str(root / "good.safetensors"))
        data = (root / "good.safetensors").read_bytes()
        (root / "empty.safetensors").write_bytes(b"")
        (root / "random.safetensors").write_bytes(bytes(range(256)) * 8)  # length field ~ 5e17
        (root / "truncated.safetensors").write_bytes(data[: len(data) // 2])
        (root / "not_json.safetensors").write_bytes((16).to_bytes(8, "little") + b"\xff" * 16 + b"\0" * 64)
        _write_raw_safetensors(
            root / "overlap.safetensors",
            {
                "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
            },
            24,
        )
        _write_raw_safetensors(
            root / "wrong_size.safetensors", {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, 8
        )
        _write_raw_safetensors(
            root / "float8.safetensors", {"a": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]}}, 4
        )
        (root / "random.pt").write_bytes(bytes(range(256)) * 4)
        (root / "index_bad").mkdir()
        (root / "index_bad" / "model.safetensors.index.json").write_text("{not json")
        (root / "index_gap").mkdir()
        (root / "index_gap" / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"tok.weight": "model-00001-of-00002.safetensors"}})
        )
        (root / "two_files").mkdir()
        for name in ("a.safetensors", "b.safetensors"):
            shutil.copy(root / "good.safetensors", root / "two_files" / name)
        (root / "a_file.txt").write_text("not a folder")
        (root / "bad.yaml").write_text("wrap_policy: [Block\n")
        (root / "list.yaml").write_text("- FULL_SHARD\n")
        self._write_checkpoints(root)

    def _write_checkpoints(self, root: Path) -> None:
        f2.Checkpointer(root / "ckpt").save(1, model=self.model)
        edits = (
            ("damaged", _flip_byte),
            ("garbage", _garbage_metadata),
            ("shardless", _drop_shards),
            ("plain", _drop_checksums),
            ("crafted", _code_in_metadata),
        )
        for name, edit in edits:
            shutil.copytree(root / "ckpt", root / name)
            edit(root / name / "step-000001")
        torch.save({"state_dict": self.model.state_dict(), "hook": _RunsCode()}, root / "crafted.pt")

    def snapshot(self) -> tuple:
        """Every file's digest, every folder, and the model's tensors (to assert nothing changed)."""
        files = {
            str(p.relative_to(self.root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(self.root.rglob("*"))
            if p.is_file()
        }
        dirs = sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_dir())
        return files, dirs, {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def other_model(self) -> TinyGPT:
        return TinyGPT(dim=16, tied=False)


def _write_raw_safetensors(path: Path, header: dict, data_bytes: int) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * data_bytes)


def _flip_byte(step: Path) -> None:
    shard = next(step.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def _garbage_metadata(step: Path) -> None:
    (step / "checksums.json").unlink()  # plain DCP: nothing to catch it before unpickling
    (step / ".metadata").write_bytes(b"\x80\x04garbage")


class _RunsCode:
    """Unpickled by the full unpickler, it would call `os.getcwd` (harmless: the row checks it is refused)."""

    def __reduce__(self):
        return (os.getcwd, ())


def _code_in_metadata(step: Path) -> None:
    (step / ".metadata").write_bytes(pickle.dumps(_RunsCode()))  # checksums.json left stale: unlink it
    (step / "checksums.json").unlink()


def _drop_checksums(step: Path) -> None:
    (step / "checksums.json").unlink()  # as plain DCP or an older version writes it


def _drop_shards(step: Path) -> None:
    (step / "checksums.json").unlink()
    for shard in step.glob("*.distcp"):
        shard.unlink()


@contextlib.contextmanager
def environ_restored():
    """Some entry points export variables (Accelerate sets ACCELERATE_USE_FSDP): undo them."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def assert_unchanged(before: tuple, after: tuple) -> None:
    assert after[0] == before[0], "files on disk changed"
    assert after[1] == before[1], "folders on disk changed"
    assert all(torch.equal(after[2][k], v) for k, v in before[2].items()), "model weights changed"

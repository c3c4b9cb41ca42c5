"""Checkpoint files crafted to run code when unpickled, as someone sharing a checkpoint could write
them: the payload creates a marker file, so a test sees whether any reader ran it."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch

from fsdp2_strategy.checkpoint import UntrustedCheckpointError, integrity


class Payload:
    """Unpickled by the full unpickler, it runs `touch MARKER` (and leaves os.system's 0 in its place)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class OwnType:
    """A user's own harmless class in a checkpoint: refused by default, admitted by torch's safe globals."""

    def __init__(self, value: float = 0.5) -> None:
        self.value = value


def plant(path: Path, marker: Path, *, checksums: bool = True) -> None:
    """Add a `payload` entry that runs `touch MARKER` to the dict in torch file `path` (`add_entry`)."""
    add_entry(path, "payload", Payload(marker), checksums=checksums)


def add_entry(path: Path, key: str, value: object, *, checksums: bool = True) -> None:
    """Add `key: value` to the dict in torch file `path` (this test's own file, read with the full
    unpickler); `checksums`: rewrite `checksums.json` beside it to match, as whoever crafted it can.
    One process's work (no collective): call it on one rank."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    state[key] = value
    torch.save(state, path)
    if checksums:
        rewrite_checksums(path.parent)


def rewrite_checksums(directory: Path) -> None:
    """`checksums.json` of `directory` made to match its files now, every rank's shards included."""
    ranks = {int(p.name[2:].split("_")[0]) for p in directory.glob("__*_*.distcp")} | {0}
    files: dict = {}
    for rank in sorted(ranks):
        files.update(integrity.local_entries(directory, rank))
    data = json.loads((directory / integrity.CHECKSUMS_FILE).read_text())
    data["files"] = dict(sorted(files.items()))
    (directory / integrity.CHECKSUMS_FILE).write_text(json.dumps(data, indent=1))


def assert_refused_then_trusted(
    convert: Callable[..., object], command: str, source: Path, marker: Path, planted: Path | None = None
) -> None:
    """`source` (or its file `planted`) holds a payload (`plant`): the converter `convert(source, target)`
    and the command line `command` refuse it naming that file, the type and `--trust`, with nothing run or
    written; `trusted=True` and `--trust` convert it (and so run it: the user trusted it)."""
    import pytest  # here: the flow scripts that plant payloads run without pytest

    from fsdp2_strategy.cli import main

    work = marker.parent
    with pytest.raises(
        UntrustedCheckpointError,
        match=rf"{re.escape((planted or source).name)} holds the type (posix|os)\.system.*--trust",
    ):
        convert(source, work / "out")
    assert main([command, str(source), str(work / "out")]) == 2
    assert not marker.exists() and not (work / "out").exists()
    convert(source, work / "out", trusted=True, progress=False)
    assert marker.exists()
    marker.unlink()
    assert main([command, str(source), str(work / "cli"), "--trust", "--no-progress"]) == 0
    assert marker.exists()

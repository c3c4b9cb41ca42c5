"""Checkpoint files crafted to run code when unpickled, as someone sharing a checkpoint could write
them: the payload creates a marker file, so a test sees whether any reader ran it."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fsdp2_strategy.checkpoint import integrity


class Payload:
    """Unpickled by the full unpickler, it runs `touch MARKER` (and leaves os.system's 0 in its place)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(path: Path, marker: Path, *, checksums: bool = True) -> None:
    """Add a `payload` entry to the dict in torch file `path` (this test's own file, read with the full
    unpickler); `checksums`: rewrite `checksums.json` beside it to match, as whoever crafted it can."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    state["payload"] = Payload(marker)
    torch.save(state, path)
    if checksums:
        assert integrity.write_checksums(path.parent, 0) is None

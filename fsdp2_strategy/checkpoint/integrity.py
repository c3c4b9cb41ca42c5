"""Checksums for committed checkpoints: DCP itself has none, so a flipped byte in a shard
would load silently wrong values.

At commit time every rank hashes the files it wrote (`__<rank>_<n>.distcp`; rank 0 also
every other file: `.metadata` and the small files a trainer adds, such as `extra.pt` or `meta.pt`), rank 0 gathers the results and writes `checksums.json` into the
temporary directory before the rename. At load time the ranks verify a share of the listed
files each (size, then CRC-32) and exchange their findings, so every rank raises the same
ValueError together. A checkpoint without `checksums.json` (plain DCP) is loaded unverified, with a warning.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..distributed import is_distributed, logger

CHECKSUMS_FILE = "checksums.json"
ALGORITHM = "crc32"
_CHUNK = 4 << 20


def file_checksum(path: Path) -> str:
    """Streaming CRC-32 of a file, as 8 hex digits."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc & 0xFFFFFFFF:08x}"


def local_entries(directory: Path, rank: int) -> dict[str, dict[str, Any]]:
    """{file name: {"size", "crc32"}} for the files `rank` wrote into `directory`."""
    names = sorted(p.name for p in directory.glob(f"__{rank}_*.distcp"))
    if rank == 0:  # the files written once (DCP's `.metadata`, the trainer's non-tensor state, views)
        names += sorted(
            str(p.relative_to(directory))
            for p in directory.rglob("*")
            if p.is_file() and not p.name.endswith(".distcp") and p.name != CHECKSUMS_FILE
        )
    return {n: {"size": (directory / n).stat().st_size, ALGORITHM: file_checksum(directory / n)} for n in names}


def write_checksums(directory: Path, rank: int) -> str | None:
    """Collective: hash each rank's files and have rank 0 write `checksums.json` (fsynced).

    Returns an error message or None (rank 0's answer is the one that counts).
    """
    try:
        mine: Any = ("ok", local_entries(directory, rank))
    except Exception as exc:  # reported, never left to hang the other ranks
        mine = ("error", f"rank {rank}: {type(exc).__name__}: {exc}")
    if is_distributed():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    errors = [payload for status, payload in gathered if status == "error"]
    if errors:
        return "computing checkpoint checksums failed: " + "; ".join(errors)
    if rank == 0:  # the caller passes rank 0's result on to every rank
        files: dict[str, Any] = {}
        for _, entries in gathered:
            files.update(entries)
        data = {"format": 1, "algorithm": ALGORITHM, "files": dict(sorted(files.items()))}
        try:
            with open(directory / CHECKSUMS_FILE, "w") as f:
                json.dump(data, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            return f"writing {directory / CHECKSUMS_FILE} failed: {exc}"
    return None


def _problems(directory: Path, expected: dict[str, dict[str, Any]], names: list[str]) -> list[str]:
    out = []
    for name in names:
        path, want = directory / name, expected[name]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            out.append(f"{name}: missing")
            continue
        if size != want["size"]:
            kind = "truncated" if size < want["size"] else "longer than written"
            out.append(f"{name}: {kind} ({size} bytes, {want['size']} written)")
        elif file_checksum(path) != want[ALGORITHM]:
            out.append(f"{name}: corrupted (checksum mismatch, contents changed after the save)")
    return out


def check(directory: Path, rank: int = 0, world_size: int = 1) -> list[str]:
    """The problems in this rank's share of the files `checksums.json` lists (every file for one
    process); not a collective. No `checksums.json`: nothing to check."""
    manifest = directory / CHECKSUMS_FILE
    if not manifest.is_file():
        return []
    try:
        data = json.loads(manifest.read_text())
        expected = data["files"]
        if data.get("algorithm") != ALGORITHM:
            raise ValueError(f"unknown checksum algorithm {data.get('algorithm')!r}")
        return _problems(directory, expected, sorted(expected)[rank::world_size])
    except Exception as exc:  # also unreadable JSON: every rank hits it alike
        return [f"{CHECKSUMS_FILE}: unreadable ({type(exc).__name__}: {exc})"] if rank == 0 else []


_warned_unverified: set[Path] = set()


def warn_if_unverified(directory: Path) -> bool:
    """Log a warning, once per directory, when `directory` has no `checksums.json` (written by
    plain DCP or an older version): it loads, but nothing can tell whether a file changed.
    Returns whether the directory is unverified."""
    directory = Path(directory)
    if (directory / CHECKSUMS_FILE).is_file():
        return False
    key = directory.resolve()
    if key not in _warned_unverified:
        _warned_unverified.add(key)
        logger.warning(
            "Checkpoint %s has no %s (written by plain DCP or an older version): it is loaded without "
            "verifying its files, so a damaged shard would load silently wrong values. Save it again with "
            "fsdp2_strategy to get checksums.",
            directory,
            CHECKSUMS_FILE,
        )
    return True


def verify(directory: Path, rank: int, world_size: int) -> list[str]:
    """Collective when distributed: the problems found in `directory` (same list on every rank).

    Each rank checks every `world_size`-th listed file; no `checksums.json`: nothing to check
    (rank 0 says so once, see `warn_if_unverified`).
    """
    if rank == 0:
        warn_if_unverified(directory)
    found = check(directory, rank, world_size)
    if is_distributed():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, found)
        found = sorted(p for part in gathered for p in part)
    return found

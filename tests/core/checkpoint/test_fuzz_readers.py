"""Fuzzed checkpoint readers: each reader is fed seeded, damaged variants of a valid file (truncated,
bit-flipped, empty, not a pickle, the wrong type, a pickle that runs `touch MARKER`, pickles that
would build a huge object) and each read ends in one ValueError naming the file, or (a flip that
still parses, in a format without checksums) in a value of the right kind: no other exception, no
hang, no payload run, the model unchanged. One process, no group; the cases are seeded."""

from __future__ import annotations

import collections
import io
import json
import pickle
import random
import struct
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers.untrusted import Payload
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata

import fsdp2_strategy as f2
from fsdp2_strategy.checkpoint import directory as cdir
from fsdp2_strategy.checkpoint import integrity, load_small_file, read_metadata_file
from fsdp2_strategy.migrate import fsdp1_files, zero_files

SEED = 65
RANDOM_CASES = 34  # per reader, besides the fixed ones: 7 readers x ~45 cases
SLOW = 5.0  # seconds: a read taking longer is reported as a hang


class HugeAlloc:
    """Unpickled by the full unpickler, it asks for an impossible amount of memory."""

    def __reduce__(self):
        return (bytearray, (1 << 62,))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _deepspeed_file(path: Path, model: nn.Module) -> None:
    """A model-states file shaped as DeepSpeed writes it, holding one of DeepSpeed's classes
    (pickled under its DeepSpeed name through a stand-in module, as DeepSpeed itself is not needed)."""
    name = "deepspeed.runtime.zero.config"
    parts = name.split(".")
    modules = {".".join(parts[: i + 1]): types.ModuleType(".".join(parts[: i + 1])) for i in range(len(parts))}
    enum = type("ZeroStageEnum", (), {"__module__": name, "__reduce__": lambda self: (type(self), (2,))})
    modules[name].ZeroStageEnum = enum
    sys.modules.update(modules)
    try:
        state = {
            "module": model.state_dict(),
            "param_shapes": [collections.OrderedDict((n, p.shape) for n, p in model.named_parameters())],
            "zero_stage": enum(),
            "global_steps": 3,
            "ds_version": "0.19.8",
        }
        torch.save(state, path)
    finally:
        for module in modules:
            del sys.modules[module]


@dataclass
class Reader:
    name: str
    file: Path  # the file each variant replaces
    read: Callable[[], Any]
    parsed: Callable[[Any], bool]  # what a read that succeeds must return
    model: nn.Module | None = None  # what it loads into: unchanged unless the read succeeds
    named: str = ""  # what the error names (default: the file's name)


@pytest.fixture(scope="module")
def readers(tmp_path_factory) -> list[Reader]:
    root = tmp_path_factory.mktemp("fuzz")
    model = _model()
    ckpt = f2.Checkpointer(root / "ckpt")
    extra = {"step": 3, "rng": torch.get_rng_state(), "numpy_rng": np.random.get_state(), "note": "x"}
    ckpt.save(3, model=model, extra=extra)
    step = ckpt.step_path(3)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, root / "model.safetensors")
    _deepspeed_file(root / "mp_rank_00_model_states.pt", model)
    lightning = {"state_dict": model.state_dict(), "global_step": 3, "optimizer_states": [], "lr_schedulers": []}
    torch.save(lightning, root / "lightning.ckpt")
    into_safetensors, into_checkpoint = _model(), _model()
    return [
        Reader(".metadata", step / ".metadata", lambda: read_metadata_file(step / ".metadata"), _is(Metadata)),
        Reader("extra.pt", step / "extra.pt", lambda: load_small_file(step / "extra.pt", name=step / "extra.pt"), _any),
        # A damaged manifest that still parses blames the files it lists: the error names the checkpoint.
        Reader(
            "checksums.json", step / "checksums.json", lambda: cdir.verify_dir(step), _is(type(None)), named=step.name
        ),
        Reader(
            "DeepSpeed file",
            root / "mp_rank_00_model_states.pt",
            lambda: zero_files.load_file(root / "mp_rank_00_model_states.pt"),
            _is(dict),
        ),
        Reader(
            "FSDP1 file", root / "lightning.ckpt", lambda: fsdp1_files.load_torch_file(root / "lightning.ckpt"), _any
        ),
        Reader(
            "safetensors",
            root / "model.safetensors",
            lambda: f2.load_full_weights(into_safetensors, root / "model.safetensors"),
            _is(nn.Module),
            into_safetensors,
        ),
        # The whole load with the checksums the save wrote: every damaged variant is caught before parsing.
        Reader(
            "Checkpointer.load", step / ".metadata", lambda: ckpt.load(model=into_checkpoint), _never, into_checkpoint
        ),
    ]


def _is(kind: type) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, kind)


def _any(value: Any) -> bool:
    return True


def _never(value: Any) -> bool:
    return False


def _variants(data: bytes, marker: Path, rng: random.Random) -> list[tuple[str, bytes]]:
    cases = [
        ("empty", b""),
        ("not a pickle", b"\x80\x04garbage"),
        ("a pickle that runs code", pickle.dumps({"state": Payload(marker)})),
        ("a torch file that runs code", _torch_bytes({"state": Payload(marker)})),
        ("a pickle asking for 4 EiB", pickle.dumps(HugeAlloc())),
        ("a torch file asking for 4 EiB", _torch_bytes({"x": HugeAlloc()})),
        ("a frame declaring 1 EiB", b"\x80\x04\x95" + struct.pack("<Q", 1 << 60)),
        ("the wrong type (a list)", _torch_bytes([1, 2, 3])),
        ("the wrong type (an int)", pickle.dumps(7)),
        ("the wrong type (JSON)", json.dumps({"files": []}).encode()),
        ("half", data[: len(data) // 2]),
    ]
    for i in range(RANDOM_CASES):
        if i % 2:
            cases.append((f"truncated #{i}", data[: rng.randrange(len(data))]))
        else:
            flipped = bytearray(data)
            for _ in range(rng.randint(1, 8)):
                flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            cases.append((f"bit-flipped #{i}", bytes(flipped)))
    return cases


def _outcome(reader: Reader) -> tuple[str, float]:
    """'parsed', 'refused' (ValueError naming the file) or what went wrong, and the seconds it took."""
    named = reader.named or reader.file.name
    start = time.perf_counter()
    try:
        value = reader.read()
    except ValueError as exc:
        kind = "refused" if named in str(exc) else f"ValueError not naming {named}: {exc}"
    except Exception as exc:  # noqa: BLE001 - any other exception is what this test reports
        kind = f"{type(exc).__name__}: {str(exc)[:200]}"
    else:
        kind = "parsed" if reader.parsed(value) else f"parsed as {type(value).__name__}"
    return kind, time.perf_counter() - start


def _params(model: nn.Module | None) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()] if model is not None else []


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # the raw pickles among the variants
def test_damaged_files_end_in_one_value_error_naming_the_file(readers, tmp_path):
    rng = random.Random(SEED)
    marker = tmp_path / "ran"
    bad, counts = [], collections.Counter()
    for reader in readers:
        original = reader.file.read_bytes()
        try:
            for case, data in _variants(original, marker, rng):
                reader.file.write_bytes(data)
                if reader.name not in ("checksums.json", "Checkpointer.load"):
                    integrity.write_checksums(reader.file.parent, 0)  # as whoever crafted it can
                before = _params(reader.model)
                kind, seconds = _outcome(reader)
                counts[reader.name, kind if kind in ("parsed", "refused") else "other"] += 1
                ran = marker.exists()
                if kind not in ("parsed", "refused") or seconds > SLOW or ran:
                    bad.append(f"{reader.name} / {case}: {kind} in {seconds:.1f} s, payload ran: {ran}")
                    marker.unlink(missing_ok=True)
                if kind != "parsed" and not all(torch.equal(a, b) for a, b in zip(before, _params(reader.model))):
                    bad.append(f"{reader.name} / {case}: the model changed")
        finally:
            reader.file.write_bytes(original)
            integrity.write_checksums(reader.file.parent, 0)
    assert not bad, "\n".join(bad[:20])
    assert sum(counts.values()) >= 300, counts
    # Most variants are refused by every reader: a reader that parses everything tests nothing.
    for reader in readers:
        assert counts[reader.name, "refused"] >= 15, (reader.name, counts)

"""The bad inputs that need a process group, all in one 2-rank world (the table's distributed part).

Each `WorldRow` builds its situation on a fresh model (`setup`, which may shard it) and
returns the call that must fail. Every rank must raise the same exception type with the same
message, naming the field/file and the fix, and leave its local shards, the model's sharding
and the files on disk as they were. The same world checks the warning for a checkpoint
without `checksums.json`: once per directory, on rank 0 only.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from helpers.bad_inputs import Env
from helpers.harness import run_distributed
from helpers.models import TinyGPT, loss_fn, make_batch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import fsdp2_strategy as f2


@dataclass
class WorldRow:
    """`setup(model, root)` returns the call that must raise `error` with every phrase of `says`."""

    id: str
    setup: Callable[[torch.nn.Module, Path], Callable[[], Any]]
    error: type[BaseException]
    says: tuple[str, ...]
    dim: int = 32
    """Width of the row's TinyGPT (16: another architecture than the files hold)."""
    meta: bool = False
    """Build the row's model on the meta device (it must stay there when loading fails)."""


def _shard(model: torch.nn.Module) -> torch.nn.Module:
    return f2.shard_model(model, log_plan=False)


def _optimizer_before_sharding(model: torch.nn.Module, root: Path) -> Callable[[], Any]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _shard(model)
    loss_fn(model, *make_batch(2)).backward()
    return optimizer.step


def _optimizer_while_gathered(model: torch.nn.Module, root: Path) -> Callable[[], Any]:
    _shard(model)
    with torch.no_grad():  # an evaluation: no backward follows, the root and the last block stay gathered
        model(make_batch(2)[0])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # State before its first step (a loaded state dict) for a gathered copy: it cannot move to the shard.
    gathered = next(p for p in model.parameters() if type(p) is torch.nn.Parameter)
    optimizer.state[gathered]["momentum_buffer"] = torch.zeros_like(gathered)
    loss_fn(model, *make_batch(2)).backward()
    return optimizer.step


WORLD_ROWS = [
    WorldRow(
        "shard_model wrap_policy class name",
        lambda m, r: lambda: f2.shard_model(m, wrap_policy=["Blok"]),
        ValueError,
        ("FSDP2Config.wrap_policy", "'Blok'", "Did you mean 'Block'"),
    ),
    WorldRow(
        "shard_model mesh_shape vs world size",
        lambda m, r: lambda: f2.shard_model(m, mesh_shape=(3,)),
        ValueError,
        ("mesh_shape=(3,)", "world size is 2", "must equal the world size"),
    ),
    WorldRow(
        "shard_model reshard_after_forward factor",
        lambda m, r: lambda: f2.shard_model(m, reshard_after_forward=3),
        ValueError,
        ("reshard_after_forward=3 does not divide the shard group size 2", "[1, 2]"),
    ),
    WorldRow(
        "shard_model module_overrides reshard",
        lambda m, r: lambda: f2.shard_model(m, module_overrides={"blocks.0": {"reshard_after_forward": 3}}),
        ValueError,
        ("module_overrides['blocks.0'].reshard_after_forward=3", "[1, 2]"),
    ),
    WorldRow(
        "shard_model activation_checkpointing without blocks",
        lambda m, r: lambda: f2.shard_model(m, wrap_policy=None, activation_checkpointing="auto"),
        ValueError,
        ("activation_checkpointing='auto'", "name the block classes"),
    ),
    WorldRow(
        "shard_model ignored_modules class name",
        lambda m, r: lambda: f2.shard_model(m, ignored_modules=["Nope"]),
        ValueError,
        ("FSDP2Config.ignored_modules", "'Nope'", "Classes in the model"),
    ),
    WorldRow(
        "fully_shard FSDP2 reshard_after_forward factor",
        lambda m, r: lambda: f2.fully_shard(m, reshard_after_forward=3),
        ValueError,
        ("reshard_after_forward as an int", "factor of 2, not 3"),
    ),  # torch's own message
    WorldRow(
        "optimizer created before shard_model",
        _optimizer_before_sharding,
        ValueError,
        ("SGD was created before shard_model()", "Create the optimizer after"),
    ),
    WorldRow(
        "optimizer built while the model was gathered, with state for a gathered copy",
        _optimizer_while_gathered,
        ValueError,
        ("SGD holds gathered copies of sharded parameters", "f2.reshard(model)"),
    ),
    WorldRow(
        "forward() called directly",
        lambda m, r: (_shard(m), lambda: m.blocks[0].forward(torch.randn(2, 4, 32)))[1],
        ValueError,
        ("Block.forward() was called directly", "model(inputs)", "register_fsdp_forward_method"),
    ),
    WorldRow(
        "a method of the model called without registering it",
        lambda m, r: (_shard(m), lambda: m.score(torch.randn(2, 4, 32)))[1],
        ValueError,
        (
            "TinyGPT.score() computed on the sharded parameters",
            "register_fsdp_forward_method(model, 'score')",
            "mixed torch.Tensor and DTensor",  # torch's own words, which users search for
        ),
    ),
    WorldRow(
        "load_full_weights damaged file",
        lambda m, r: (_shard(m), lambda: f2.load_full_weights(m, r / "random.safetensors"))[1],
        ValueError,
        ("random.safetensors", "header length", "download or export"),
    ),
    WorldRow(
        "load_full_weights damaged file, meta model",
        lambda m, r: (_shard(m), lambda: f2.load_full_weights(m, r / "truncated.safetensors"))[1],
        ValueError,
        ("truncated.safetensors", "truncated?", "download or export"),
        meta=True,
    ),
    WorldRow(
        "load_full_weights other architecture",
        lambda m, r: (_shard(m), lambda: f2.load_full_weights(m, r / "good.safetensors"))[1],
        ValueError,
        ("shape mismatch", "pos: checkpoint (16, 32), model (16, 16)", "same architecture"),
        dim=16,
    ),
    WorldRow(
        "Checkpointer.load other architecture",
        lambda m, r: (_shard(m), lambda: f2.Checkpointer(r / "ckpt").load(model=m))[1],
        ValueError,
        ("does not match the model", "shape mismatch"),
        dim=16,
    ),
    WorldRow(
        "Checkpointer.load damaged shard",
        lambda m, r: (_shard(m), lambda: f2.Checkpointer(r / "damaged").load(model=m))[1],
        ValueError,
        ("damaged and was not loaded", ".distcp: corrupted", "Load an earlier step"),
    ),
]


def _state(model: torch.nn.Module) -> dict[str, Any]:
    """This rank's view of the model: local shards (unless on the meta device), which modules are sharded."""
    local = {k: (v.to_local() if isinstance(v, DTensor) else v).detach() for k, v in model.state_dict().items()}
    meta = all(t.is_meta for t in local.values())
    return {
        "tensors": {} if meta else {k: t.clone() for k, t in local.items()},
        "sharded": [n for n, m in model.named_modules() if isinstance(m, FSDPModule)],
        "meta": meta,
    }


def _same(a: dict, b: dict) -> bool:
    return (
        a["sharded"] == b["sharded"]
        and a["meta"] == b["meta"]
        and all(torch.equal(a["tensors"][k], b["tensors"][k]) for k in a["tensors"])
    )


def _files(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() or p.is_dir() and not any(p.iterdir())
    }


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _world(root_text: str) -> dict[str, Any]:
    root = Path(root_text)
    results: dict[str, Any] = {}
    files = _files(root)
    for row in WORLD_ROWS:
        torch.manual_seed(0)
        with torch.device("meta" if row.meta else "cpu"):
            model = TinyGPT(dim=row.dim, tied=False)
        call = row.setup(model, root)
        before = _state(model)
        try:
            call()
            results[row.id] = None
        except Exception as exc:
            results[row.id] = ([c.__name__ for c in type(exc).__mro__], str(exc), _same(before, _state(model)))
    results["files unchanged"] = _files(root) == files
    records = _Records()
    logging.getLogger("fsdp2_strategy").addHandler(records)
    model = _shard(TinyGPT(tied=False))
    for _ in range(2):
        f2.Checkpointer(root / "plain").load(model=model)
    results["warnings"] = [m for m in records.messages if "checksums.json" in m]
    return results


def test_bad_inputs_that_need_a_process_group(tmp_path):
    Env(tmp_path)  # rank-independent fixture files, written before the world starts
    ranks = run_distributed(_world, 2, str(tmp_path))
    for row in WORLD_ROWS:
        outcomes = [r[row.id] for r in ranks]
        assert all(o is not None for o in outcomes), f"{row.id}: did not raise"
        (mro, message, unchanged), other = outcomes[0], outcomes[1]
        assert row.error.__name__ in mro, (row.id, mro, message)
        assert other[1] == message, (row.id, "ranks disagree", other[1], message)
        for phrase in row.says:
            assert phrase in message, (row.id, phrase, message)
        assert unchanged and other[2], f"{row.id}: the model changed"
    assert all(r["files unchanged"] for r in ranks)
    # No checksums.json: said once (two loads), by rank 0 only, naming the directory.
    assert len(ranks[0]["warnings"]) == 1 and ranks[1]["warnings"] == []
    assert f"{tmp_path}/plain/step-000001 has no checksums.json" in ranks[0]["warnings"][0]
    assert "without verifying" in ranks[0]["warnings"][0]

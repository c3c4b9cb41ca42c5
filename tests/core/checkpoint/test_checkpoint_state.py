"""The core's one load path and removal helpers: `checkpoint_dir.load_dir`, `checkpoint_state`,
`remove_dir`/`prune`; a save before the first optimizer step changes nothing (Checkpointer front
door; the Lightning and Accelerate front doors are tested in their own modules); the strategy
table every layer reads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers.harness import run_distributed
from helpers.models import TinyGPT, loss_fn, make_batch

from fsdp2_strategy.checkpoint import directory as cdir

TIMEOUT = 150


def _build(seed: int = 0):
    import fsdp2_strategy as f2

    torch.manual_seed(seed)
    model = TinyGPT()
    f2.shard_model(model, log_plan=False)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _step(model, optimizer, seed: int, *, step: bool = True) -> None:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    idx, target = make_batch(n=8, seed=seed)
    local = slice(rank * 8 // world, (rank + 1) * 8 // world)
    loss_fn(model, idx[local], target[local]).backward()
    if step:
        optimizer.step()
        optimizer.zero_grad()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _params(model) -> dict:
    return {n: _full(p) for n, p in model.named_parameters()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _unstepped_world(root: str) -> dict:
    from fsdp2_strategy import Checkpointer

    out = {}
    # Reference: three steps, no save.
    model, opt = _build()
    for seed in range(3):
        _step(model, opt, seed)
    reference = _params(model)

    # A save before the first step (also with gradients already accumulated) changes nothing.
    model, opt = _build()
    ck = Checkpointer(f"{root}/a")
    ck.save(0, model=model, optimizer=opt)
    out["state_after_save"] = len(opt.state)
    _step(model, opt, 0, step=False)  # gradients exist, no state yet
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    ck.save(1, model=model, optimizer=opt)
    out["grads_kept"] = all(torch.equal(grads[n], _full(p.grad)) for n, p in model.named_parameters())
    opt.step()
    opt.zero_grad()
    for seed in (1, 2):
        _step(model, opt, seed)
    out["save_changes_nothing"] = _same(reference, _params(model))
    out["adam_step"] = max(float(s["step"]) for s in opt.state.values())

    # Resume from the unstepped checkpoint: the optimizer has no state again, training matches.
    model, opt = _build(seed=5)
    _step(model, opt, 7)  # a stepped live optimizer: the load must empty it
    ck.load(model=model, optimizer=opt, step=0)
    out["state_after_load"] = len(opt.state)
    for seed in range(3):
        _step(model, opt, seed)
    out["resume_matches"] = _same(reference, _params(model))

    # A stepped checkpoint loads into an optimizer that never stepped (state restored, not emptied).
    model, opt = _build()
    _step(model, opt, 0)
    ck.save(2, model=model, optimizer=opt)
    fresh, fresh_opt = _build(seed=3)
    ck.load(model=fresh, optimizer=fresh_opt, step=2)
    out["stepped_state_loaded"] = len(fresh_opt.state) == len(list(fresh.parameters())) and all(
        float(s["step"]) == 1.0 for s in fresh_opt.state.values()
    )

    # load_dir, non-strict: a model with an extra parameter loads the keys both sides have.
    from fsdp2_strategy.checkpoint.state import sharded_state

    torch.manual_seed(0)
    bigger = TinyGPT(temperature=True)
    import fsdp2_strategy as f2

    f2.shard_model(bigger, log_plan=False)
    path = Path(ck.step_path(2))
    try:
        cdir.load_dir(path, {"model": bigger})
        out["strict"] = "no error"
    except ValueError as exc:
        out["strict"] = str(exc)
    cdir.load_dir(path, {"model": bigger}, strict=False)
    out["non_strict_loaded"] = _same(_params(model), {n: v for n, v in _params(bigger).items() if n != "temperature"})
    try:
        cdir.load_dir(Path(ck.step_path(2)), {"model": bigger}, {"optim_1": (bigger, opt)}, strict=False)
        out["absent_optimizer"] = "no error"
    except ValueError as exc:
        out["absent_optimizer"] = str(exc)
    out["keys"] = sorted(sharded_state({"model": model}, {"optim": (model, opt)}))
    return out


@pytest.fixture(scope="module")
def unstepped(tmp_path_factory):
    return run_distributed(_unstepped_world, 2, str(tmp_path_factory.mktemp("unstepped")), timeout=TIMEOUT)


def test_save_before_first_step_changes_nothing(unstepped):
    for r in unstepped:
        assert r["state_after_save"] == 0  # torch's state-dict call had stepped Adam once
        assert r["grads_kept"]
        assert r["save_changes_nothing"]
        assert r["adam_step"] == 3.0


def test_unstepped_checkpoint_resumes_without_state(unstepped):
    for r in unstepped:
        assert r["state_after_load"] == 0
        assert r["resume_matches"]
        assert r["stepped_state_loaded"]


def test_load_dir_strict_and_optimizer_errors(unstepped):
    for r in unstepped:
        assert "missing in checkpoint (1): temperature" in r["strict"]
        assert r["non_strict_loaded"]
        assert "no optimizer state under 'optim_1' in checkpoint" in r["absent_optimizer"]
        assert r["keys"] == ["model", "optim"]


# ---------------------------------------------------------------------- removal, one process
def _committed(path: Path) -> Path:
    cdir.save_dir(path, {"m": {"w": torch.ones(2)}})
    return path


def test_remove_dir_survives_stale_temp_and_trash(tmp_path):
    final = _committed(tmp_path / "epoch=1.ckpt")
    cdir.tmp_path_for(final).mkdir()  # a save to that name that crashed: the old rename target
    cdir.trash_path_for(final).mkdir()  # a delete that crashed
    (cdir.trash_path_for(final) / "x").write_text("stale")
    cdir.remove_dir(final)
    assert not final.exists() and not cdir.trash_path_for(final).exists()
    assert cdir.tmp_path_for(final).exists()  # a save's temp dir is the save's business


def test_prune_keeps_newest_committed(tmp_path):
    for step in (1, 2, 3, 4):
        _committed(tmp_path / f"step-{step}")
    (tmp_path / "step-9").mkdir()  # uncommitted: neither counted nor removed
    removed = cdir.prune(tmp_path, 2)
    assert [p.name for p in removed] == ["step-1", "step-2"]
    assert sorted(os.listdir(tmp_path)) == ["step-3", "step-4", "step-9"]


def test_replace_leaves_no_trash(tmp_path):
    final = _committed(tmp_path / "last.ckpt")
    cdir.save_dir(final, {"m": {"w": torch.zeros(2)}}, replace=True)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


# ---------------------------------------------------------------------- one table of strategies
def test_every_layer_reads_the_strategy_table():
    from fsdp2_strategy import sharding_strategies as strategies
    from fsdp2_strategy.config import SHARDING_STRATEGIES
    from fsdp2_strategy.mesh import default_reshard_after_forward, strategy_mesh_shape

    assert SHARDING_STRATEGIES == strategies.NAMES
    shapes = {name: strategy_mesh_shape(name, None, 4) for name in strategies.NAMES}
    assert shapes == {
        "FULL_SHARD": (4,),
        "SHARD_GRAD_OP": (4,),
        "HYBRID_SHARD": (1, 4),
        "HYBRID_SHARD_ZERO2": (1, 4),
        "NO_SHARD": (4, 1),
    }
    assert [default_reshard_after_forward(n) for n in strategies.NAMES] == [None, False, None, False, False]
    pytest.importorskip("accelerate")
    from fsdp2_strategy.integrations.accelerate import FSDP2Plugin
    from fsdp2_strategy.integrations.accelerate.env import STRATEGIES

    assert STRATEGIES == strategies.NAMES
    mirrored = {n: FSDP2Plugin(read_env=False, sharding_strategy=n).reshard_after_forward for n in strategies.NAMES}
    assert mirrored == {
        "FULL_SHARD": True,
        "SHARD_GRAD_OP": False,
        "HYBRID_SHARD": True,
        "HYBRID_SHARD_ZERO2": False,
        "NO_SHARD": False,
    }

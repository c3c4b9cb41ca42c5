"""Checkpointer: DCP save/load round trip, atomic commit, retention, async save, clear errors,
damaged files, and a rank killed by SIGKILL in the middle of a save (2 gloo ranks). Resharding and
exact resume on other layouts: test_resume_matrix.py."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from helpers.harness import DistributedTestError, run_distributed
from helpers.models import TinyGPT, loss_fn, make_batch

TIMEOUT = 150


# ---------------------------------------------------------------------- helpers run on every rank
def _build(seed: int = 0, shard: bool = True, shard_kwargs: dict | None = None, **model_kwargs):
    import fsdp2_strategy as f2

    torch.manual_seed(seed)
    model = TinyGPT(**model_kwargs)
    if shard:
        f2.shard_model(model, log_plan=False, **(shard_kwargs or {}))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(model, optimizer, steps: int) -> None:
    """Each step's batch comes from the global RNG, so a resume must restore the RNG too."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    for _ in range(steps):
        idx, target = make_batch(n=8, seed=int(torch.randint(0, 10_000, (1,))))
        local = slice(rank * 8 // world, (rank + 1) * 8 // world)
        loss_fn(model, idx[local], target[local]).backward()
        optimizer.step()
        optimizer.zero_grad()


def _full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _snapshot(model, optimizer=None) -> dict:
    """Full (gathered) parameters and optimizer state, keyed by name: what must survive a round trip."""
    out = {f"param/{n}": _full(p) for n, p in model.named_parameters()}
    if optimizer is not None:
        for n, p in model.named_parameters():
            for key, value in optimizer.state.get(p, {}).items():
                out[f"optim/{n}/{key}"] = _full(value)
    return out


def _mismatches(a: dict, b: dict) -> list[str]:
    """Keys missing on one side or not bitwise equal (empty list: identical)."""
    bad = sorted(set(a) ^ set(b))
    bad += [k for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]
    return bad


def _error_of(fn, *args, **kwargs) -> tuple[str, str]:
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


# ---------------------------------------------------------------------- world 1: most checks
def _main_world(root: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.checkpoint.planner import SavePlanner

    from fsdp2_strategy.checkpoint.checkpointer import Checkpointer

    rank = dist.get_rank()
    out: dict = {}
    ck = Checkpointer(f"{root}/main")

    # (1): train 3 steps, save with extra, train 3 more.
    model, opt = _build(seed=0)
    _train(model, opt, 3)
    saved = _snapshot(model, opt)
    rng = torch.get_rng_state()
    ck.save(3, model=model, optimizer=opt, extra={"step": 3, "rng": rng, "loader": [1, 2]})
    _train(model, opt, 3)

    # (1) load into a freshly built, differently initialised model and optimizer.
    fresh, fresh_opt = _build(seed=1)
    extra = ck.load(model=fresh, optimizer=fresh_opt)
    out["roundtrip_mismatches"] = _mismatches(saved, _snapshot(fresh, fresh_opt))
    out["roundtrip_checked"] = len(saved)
    out["extra_ok"] = extra["step"] == 3 and extra["loader"] == [1, 2] and torch.equal(extra["rng"], rng)

    # (6) an existing step is never rewritten.
    out["resave"] = _error_of(ck.save, 3, model=model, optimizer=opt)

    # (7) a checkpoint from a different model: layers=2 (blocks.2 unexpected), vocab=80 (shape),
    # temperature (missing).
    other, other_opt = _build(seed=0, layers=2, vocab=80, temperature=True)
    out["mismatch"] = _error_of(ck.load, model=other, optimizer=other_opt)
    out["missing_step"] = _error_of(ck.load, model=fresh, step=4)
    out["empty_root"] = _error_of(Checkpointer(f"{root}/nothing").load, model=fresh)

    # (4) partial saves: a crashed temp dir and a step dir without .metadata are ignored.
    if rank == 0:
        Path(f"{root}/main/.tmp-step-000005").mkdir()
        Path(f"{root}/main/step-000007").mkdir()
        Path(f"{root}/main/step-000007/__0_0.distcp").write_bytes(b"partial")
    dist.barrier()
    out["partial_latest"] = ck.latest_step()
    out["partial_load_7"] = _error_of(ck.load, model=fresh, step=7)
    again, again_opt = _build(seed=2)
    ck.load(model=again, optimizer=again_opt)
    out["partial_load_latest_mismatches"] = _mismatches(saved, _snapshot(again, again_opt))
    out["partial_dirs_before_save"] = sorted(os.listdir(f"{root}/main"))
    dist.barrier()  # every rank listed before rank 0 creates the next temp dir
    ck.save(7, model=again)  # replaces the uncommitted step-000007, cleans the stale temp dir
    out["partial_latest_after_save_7"] = ck.latest_step()
    ck.close()  # stale temp dirs are deleted in the background
    out["partial_dirs_after_save"] = sorted(os.listdir(f"{root}/main"))

    # (5) keep_last=2 keeps the two newest and removes stale temp dirs.
    keep = Checkpointer(f"{root}/keep", keep_last=2)
    if rank == 0:
        Path(f"{root}/keep/.tmp-step-000099").mkdir(parents=True)
    dist.barrier()
    for step in (1, 2, 3, 4):
        keep.save(step, model=model)
    keep.close()  # the pruned steps are deleted in the background
    out["keep_dirs"] = sorted(os.listdir(f"{root}/keep"))
    out["keep_latest"] = keep.latest_step()

    # (8) async save: save() returns after staging; the step is committed only by wait(). Each saver
    # plans a structure once: rank 0 counts the global plans DCP makes.
    planned = _counting_global_plans()
    asyn = Checkpointer(f"{root}/async", async_save=True)
    before = _snapshot(model, opt)
    asyn.save(10, model=model, optimizer=opt, extra={"k": "v"})
    out["async_latest_before_wait"] = asyn.latest_step()
    _train(model, opt, 1)  # changes parameters in place while the write may still run
    asyn.wait()
    out["async_latest_after_wait"] = asyn.latest_step()
    asyn.save(11, model=model)  # another structure (no optimizer): planned again
    _train(model, opt, 1)
    other = Checkpointer(f"{root}/async_other", async_save=True)
    other_before = _snapshot(model, opt)
    other.save(1, model=model, optimizer=opt)  # another saver, another structure, between two of `asyn`
    other.close()
    before_12 = _snapshot(model)
    asyn.save(12, model=model)  # ...first commits step 11; 11's structure: its plan reused
    out["async_latest_after_next_save"] = asyn.latest_step()
    _train(model, opt, 1)
    asyn.close()
    out["async_global_plans"] = len(planned)
    out["async_plans_left"] = [k for k in SavePlanner._cached_all_plans if k.startswith("fsdp2_strategy")]
    back, back_opt = _build(seed=3)
    out["async_extra"] = asyn.load(model=back, optimizer=back_opt, step=10)
    out["async_mismatches"] = _mismatches(before, _snapshot(back, back_opt))
    asyn.load(model=back, step=12)
    out["async_reused_plan_mismatches"] = _mismatches(before_12, _snapshot(back))
    other.load(model=back, optimizer=back_opt, step=1)
    out["async_other_mismatches"] = _mismatches(other_before, _snapshot(back, back_opt))
    out["async_dirs"] = sorted(os.listdir(f"{root}/async"))
    return out


def _counting_global_plans() -> list:
    """A list that grows by one each time DCP's default planner makes a global plan (rank 0)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    calls: list = []
    make = DefaultSavePlanner._create_global_plan

    def counted(self, all_plans):
        calls.append(len(all_plans))
        return make(self, all_plans)

    DefaultSavePlanner._create_global_plan = counted
    return calls


@pytest.fixture(scope="module")
def main_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    results = run_distributed(_main_world, 2, str(root), timeout=TIMEOUT)
    return root, results


def test_roundtrip_restores_params_optimizer_and_extra(main_world):
    _, results = main_world
    for r in results:
        assert r["roundtrip_checked"] > 40  # params and AdamW's exp_avg/exp_avg_sq/step were compared
        assert r["roundtrip_mismatches"] == []
        assert r["extra_ok"]


def test_existing_step_is_never_rewritten(main_world):
    _, results = main_world
    for r in results:
        kind, msg = r["resave"]
        assert kind == "ValueError" and "step 3" in msg and "new step" in msg


def test_different_model_lists_mismatched_keys(main_world):
    _, results = main_world
    kind, msg = results[0]["mismatch"]
    assert kind == "ValueError"
    assert "missing in checkpoint" in msg and "temperature" in msg
    assert "unexpected in checkpoint" in msg and "blocks.2.attn.qkv.weight" in msg
    assert "shape mismatch" in msg and "tok.weight: checkpoint (64, 32) vs model (80, 32)" in msg
    assert results[1]["mismatch"][0] == "ValueError"  # every rank raises, none hangs


def test_missing_checkpoint_is_a_clear_error(main_world):
    _, results = main_world
    kind, msg = results[0]["missing_step"]
    assert kind == "FileNotFoundError" and "step 4" in msg and "[3]" in msg
    kind, msg = results[0]["empty_root"]
    assert kind == "FileNotFoundError" and "No committed checkpoint" in msg


def test_partial_saves_are_ignored(main_world):
    root, results = main_world
    for r in results:
        assert r["partial_latest"] == 3
        assert r["partial_load_7"][0] == "FileNotFoundError"
        assert r["partial_load_latest_mismatches"] == []
        assert r["partial_dirs_before_save"] == [".tmp-step-000005", "step-000003", "step-000007"]
        assert r["partial_latest_after_save_7"] == 7
        assert r["partial_dirs_after_save"] == ["step-000003", "step-000007"]
    assert (root / "main" / "step-000007" / ".metadata").is_file()


def test_keep_last_keeps_the_two_newest(main_world):
    _, results = main_world
    for r in results:
        assert r["keep_dirs"] == ["step-000003", "step-000004"]  # stale .tmp-step-000099 removed too
        assert r["keep_latest"] == 4


def test_async_save_commits_on_wait(main_world):
    _, results = main_world
    for r in results:
        assert r["async_latest_before_wait"] is None
        assert r["async_latest_after_wait"] == 10
        assert r["async_latest_after_next_save"] == 11
        assert r["async_mismatches"] == []  # the copy was taken before the next optimizer step
        assert r["async_reused_plan_mismatches"] == []
        assert r["async_other_mismatches"] == []
        assert r["async_plans_left"] == []  # close() forgets the saver's plan
        assert r["async_extra"] == {"k": "v"}
        assert r["async_dirs"] == ["step-000010", "step-000011", "step-000012"]
    # Rank 0 plans step 10, step 11 (no optimizer: another structure) and the other saver's step 1; step
    # 12 reuses step 11's plan although another structure was saved in between. Rank 1 makes no global
    # plan.
    assert [r["async_global_plans"] for r in results] == [3, 0]


@pytest.mark.parametrize("mode", [True, "overlap"])
def test_async_saves_reuse_the_stagers_host_buffers(tmp_path, mode):
    """Every save of one Checkpointer stages into the same host buffers (torch 2.11-2.12's stager
    emptied them after each stage, so a second save failed; a new stager per save would allocate and
    pin the whole state again each time), and each save still holds its own step's weights."""
    from fsdp2_strategy.checkpoint.checkpointer import Checkpointer

    torch.manual_seed(0)
    model = TinyGPT()
    ck = Checkpointer(tmp_path, async_save=mode)
    saved = []
    for step in range(3):
        with torch.no_grad():
            model.pos.add_(1.0)
        saved.append(model.pos.detach().clone())
        ck.save(step, model=model)
        ck.wait()
        if step == 0:
            stager = ck._saver._stager
            buffers = dict(stager._state_dict_stager._cached_storage_mapping)
            assert buffers  # the first save's host copies, kept for the next
        assert ck._saver._stager is stager
        assert set(stager._state_dict_stager._cached_storage_mapping) == set(buffers)
    for step, pos in enumerate(saved):
        torch.manual_seed(5)
        other = TinyGPT()
        ck.load(model=other, step=step)
        assert torch.equal(other.pos, pos), step
    ck.close()


def test_single_process_without_process_group(tmp_path):
    """No process group at all: plain model, extra-only saves, argument errors."""
    from fsdp2_strategy.checkpoint.checkpointer import Checkpointer

    torch.manual_seed(0)
    model = TinyGPT()
    ck = Checkpointer(tmp_path)
    ck.save(0, extra={"only": "extra"})
    assert ck.load() == {"only": "extra"}
    ck.save(1, model=model)
    torch.manual_seed(1)
    other = TinyGPT()
    assert ck.load(model=other) is None  # no extra saved
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    shard = tmp_path / "step-000001" / "__0_0.distcp"
    good = shard.read_bytes()
    _damage(shard, "flip")
    with pytest.raises(ValueError, match=r"(?s)step-000001.*__0_0\.distcp: corrupted.*committed steps: \[0\]"):
        ck.load(model=other)
    shard.write_bytes(good)
    opt = torch.optim.AdamW(other.parameters())
    with pytest.raises(ValueError, match="no optimizer state"):
        ck.load(model=other, optimizer=opt)
    with pytest.raises(ValueError, match="needs model="):
        ck.save(2, optimizer=opt)
    with pytest.raises(ValueError, match="step must be an int"):
        ck.save(-1, model=model)
    with pytest.raises(ValueError, match="keep_last"):
        Checkpointer(tmp_path, keep_last=0)
    assert sorted(os.listdir(tmp_path)) == ["step-000000", "step-000001"]


# ---------------------------------------------------------------------- resharding
# Loading on other world sizes and meshes (1, 2, 3 ranks, HSDP 2x2, FSDP x TP 2x2, from six saved
# layouts), continuing exactly, lives in test_resume_matrix.py.


# ---------------------------------------------------------------------- 2 ranks: damaged files
_DAMAGE = {  # name -> (file in step-000002, what is done to it)
    "flip": ("__1_0.distcp", "flip"),
    "truncate": ("__0_0.distcp", "truncate"),
    "delete": ("__1_0.distcp", "delete"),
    "extra": ("extra.pt", "flip"),
}


def _damage(path: Path, how: str) -> None:
    if how == "delete":
        path.unlink()
        return
    data = bytearray(path.read_bytes())
    if how == "truncate":
        data = data[: len(data) // 2]
    else:  # one byte in the middle
        data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _integrity_world(root: str) -> dict:
    import shutil

    import torch.distributed as dist

    from fsdp2_strategy.checkpoint.checkpointer import Checkpointer

    rank = dist.get_rank()
    out: dict = {}
    # Damaged committed files: every rank raises ValueError, the model stays unchanged.
    ck = Checkpointer(f"{root}/integrity")
    model, opt = _build(seed=16)
    _train(model, opt, 1)
    ck.save(1, model=model, optimizer=opt, extra={"step": 1})
    step1 = _snapshot(model, opt)
    _train(model, opt, 1)
    ck.save(2, model=model, optimizer=opt, extra={"step": 2})
    step2 = _snapshot(model, opt)
    out["files"] = sorted(os.listdir(ck.step_path(2)))
    target, target_opt = _build(seed=17)
    untouched = _snapshot(target)
    for case, (name, how) in _DAMAGE.items():
        path = ck.step_path(2) / name
        if rank == 0:
            shutil.copy(path, f"{root}/backup")
            _damage(path, how)
        dist.barrier()
        out[case] = _error_of(ck.load, model=target, optimizer=target_opt, step=2)
        out[f"{case}_model_changed"] = _mismatches(untouched, _snapshot(target))
        dist.barrier()  # every rank is done reading before rank 0 repairs the file
        if rank == 0:
            shutil.copy(f"{root}/backup", path)
        dist.barrier()
    # Repaired: loads; and a checkpoint without checksums.json (plain DCP) still loads.
    out["repaired_extra"] = ck.load(model=target, optimizer=target_opt, step=2)
    out["repaired_mismatches"] = _mismatches(step2, _snapshot(target, target_opt))
    if rank == 0:
        (ck.step_path(1) / "checksums.json").unlink()
    dist.barrier()
    plain, plain_opt = _build(seed=18)
    out["plain_dcp_extra"] = ck.load(model=plain, optimizer=plain_opt, step=1)
    out["plain_dcp_mismatches"] = _mismatches(step1, _snapshot(plain, plain_opt))
    return out


@pytest.fixture(scope="module")
def integrity_world(main_world):
    root, _ = main_world
    return root, run_distributed(_integrity_world, 2, str(root), timeout=TIMEOUT)


@pytest.mark.parametrize("case", sorted(_DAMAGE))
def test_damaged_checkpoint_file_is_a_clear_error(integrity_world, case):
    _, results = integrity_world
    name, _ = _DAMAGE[case]
    assert name in results[0]["files"] and "checksums.json" in results[0]["files"]
    for r in results:  # every rank raises the same error, none hangs
        kind, msg = r[case]
        assert kind == "ValueError", (kind, msg)
        assert name in msg and "step-000002" in msg
        assert {"flip": "corrupted", "truncate": "truncated", "delete": "missing", "extra": "corrupted"}[case] in msg
        assert "earlier step" in msg and "[1]" in msg  # committed steps to fall back to
        assert r[f"{case}_model_changed"] == []


def test_repaired_and_plain_dcp_checkpoints_load(integrity_world):
    _, results = integrity_world
    for r in results:
        assert r["repaired_extra"] == {"step": 2} and r["repaired_mismatches"] == []
        assert r["plain_dcp_extra"] == {"step": 1} and r["plain_dcp_mismatches"] == []


# ---------------------------------------------------------------------- SIGKILL in the middle of a save
def _crashing_checkpointer(root: str):
    from torch.distributed.checkpoint import FileSystemWriter

    from fsdp2_strategy.checkpoint.checkpointer import Checkpointer

    class DieAfterWritingShards(FileSystemWriter):
        """Rank 1 writes its shard files, then is killed before `.metadata` exists."""

        def write_data(self, plan, planner):
            import torch.distributed as dist

            future = super().write_data(plan, planner)
            future.wait()
            if dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return future

    class Crashing(Checkpointer):
        crash = False

        def _storage_writer(self, path):
            return DieAfterWritingShards(str(path)) if self.crash else super()._storage_writer(path)

    return Crashing(root)


def _killed_world(root: str) -> None:
    import torch.distributed as dist

    ck = _crashing_checkpointer(root)
    model, opt = _build(seed=0)
    _train(model, opt, 1)
    ck.save(1, model=model, optimizer=opt, extra={"step": 1})
    snapshot = _snapshot(model, opt)  # collective (full_tensor): every rank gathers
    if dist.get_rank() == 0:
        torch.save(snapshot, f"{root}/../expected_step1.pt")
    _train(model, opt, 1)
    ck.crash = True
    ck.save(2, model=model, optimizer=opt, extra={"step": 2})  # rank 1 dies in here


def _after_kill_world(root: str) -> dict:
    from fsdp2_strategy.checkpoint.checkpointer import Checkpointer

    ck = Checkpointer(root, keep_last=3)
    out = {"latest": ck.latest_step()}
    model, opt = _build(seed=9)
    out["extra"] = ck.load(model=model, optimizer=opt)
    out["restored"] = _snapshot(model, opt)
    _train(model, opt, 1)
    ck.save(2, model=model, optimizer=opt, extra={"step": 2})  # the crashed step can be saved again
    out["latest_after_save"] = ck.latest_step()
    out["dirs"] = sorted(os.listdir(root))
    return out


def test_sigkill_during_save_loses_only_that_step(tmp_path):
    root = tmp_path / "run"
    with pytest.raises(DistributedTestError, match=r"rank 1 exited without a result with code -9 \(SIGKILL\)"):
        run_distributed(_killed_world, 2, str(root), timeout=TIMEOUT)
    partial = root / ".tmp-step-000002"
    assert (root / "step-000001" / ".metadata").is_file()
    assert partial.is_dir() and not (partial / ".metadata").exists() and not (root / "step-000002").exists()
    assert any(name.startswith("__1_") for name in os.listdir(partial))  # rank 1 died after writing shards

    results = run_distributed(_after_kill_world, 2, str(root), timeout=TIMEOUT)
    expected = torch.load(tmp_path / "expected_step1.pt")
    for r in results:
        assert r["latest"] == 1
        assert r["extra"] == {"step": 1}
        assert _mismatches(expected, r["restored"]) == []
        assert r["latest_after_save"] == 2
        assert r["dirs"] == ["step-000001", "step-000002"]  # the crashed temp dir is gone

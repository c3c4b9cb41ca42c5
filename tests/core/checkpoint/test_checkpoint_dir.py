"""The atomic DCP directory primitives (checkpoint_dir) in one process: what the trainer adapters
rely on when they rewrite a name such as Lightning's `last.ckpt`."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from fsdp2_strategy.checkpoint import directory as cdir


class _DieMidWrite(FileSystemWriter):
    """Writes the shard files, then dies before DCP can write `.metadata`."""

    def finish(self, metadata, results):
        raise OSError("disk gone mid-save")


def _state(value: float) -> dict:
    return {"state_dict": {"w": torch.full((4, 3), value)}}


def _load(path) -> torch.Tensor:
    state = {"state_dict": {"w": torch.zeros(4, 3)}}
    cdir.verify_dir(path)
    cdir.load_dcp(state, path)
    return state["state_dict"]["w"]


def test_replace_swaps_whole_directory(tmp_path):
    final = tmp_path / "last.ckpt"
    cdir.save_dir(final, _state(1.0), files={"meta.pt": {"step": 1}})
    cdir.save_dir(final, _state(2.0), files={"meta.pt": {"step": 2}}, replace=True)
    assert torch.equal(_load(final), torch.full((4, 3), 2.0))
    assert torch.load(final / "meta.pt")["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no .tmp-* or old copy left


def test_committed_directory_never_rewritten_without_replace(tmp_path):
    final = tmp_path / "step.ckpt"
    cdir.save_dir(final, _state(1.0))
    with pytest.raises(RuntimeError, match="never rewritten"):
        cdir.save_dir(final, _state(2.0))
    assert torch.equal(_load(final), torch.full((4, 3), 1.0))


def test_save_killed_mid_write_leaves_previous_checkpoint(tmp_path):
    final = tmp_path / "last.ckpt"
    cdir.save_dir(final, _state(1.0), files={"meta.pt": {"step": 1}})
    tmp = cdir.prepare_tmp(final, {"meta.pt": {"step": 2}})
    with pytest.raises(RuntimeError, match="DCP save into"):
        cdir.write_dcp(_state(2.0), tmp, _DieMidWrite(str(tmp)))
    assert any(tmp.glob("*.distcp")) and not cdir.is_committed(tmp)  # shards written, never committed
    assert torch.equal(_load(final), torch.full((4, 3), 1.0))
    assert torch.load(final / "meta.pt")["step"] == 1
    # The next save clears the debris and commits.
    cdir.save_dir(final, _state(3.0), replace=True)
    assert torch.equal(_load(final), torch.full((4, 3), 3.0)) and not tmp.exists()


def test_checksums_cover_trainer_files(tmp_path):
    final = tmp_path / "c.ckpt"
    cdir.save_dir(final, _state(1.0), files={"meta.pt": {"step": 1}})
    (final / "meta.pt").write_bytes(b"tampered")
    with pytest.raises(ValueError, match="meta.pt"):
        cdir.verify_dir(final)


def test_mismatch_lists_keys_and_shapes(tmp_path):
    final = tmp_path / "c.ckpt"
    cdir.save_dir(final, {"state_dict": {"w": torch.zeros(4, 3), "old": torch.zeros(1)}})
    current = {"w": torch.zeros(5, 3), "new": torch.zeros(2)}
    with pytest.raises(ValueError) as info:
        cdir.check_compatible(cdir.read_metadata(final), current, "state_dict.", final)
    message = str(info.value)
    assert "missing in checkpoint (1): new" in message and "unexpected in checkpoint (1): old" in message
    assert "w: checkpoint (4, 3) vs model (5, 3)" in message
    # Non-strict (Lightning's `strict_loading = False`): only the shape mismatch remains.
    with pytest.raises(ValueError) as info:
        cdir.check_compatible(cdir.read_metadata(final), current, "state_dict.", final, strict=False)
    assert "missing" not in str(info.value) and "w: checkpoint (4, 3) vs model (5, 3)" in str(info.value)
    cdir.check_compatible(
        cdir.read_metadata(final), {"w": torch.zeros(4, 3), "new": torch.zeros(2)}, "state_dict.", final, strict=False
    )


def test_one_save_sequence_runs_its_steps_in_order(tmp_path):
    # prepare (rank 0's files), add_files, write (the shards), complete (sees them), commit, on_commit.
    final, seen = tmp_path / "c.ckpt", []

    def add_files(tmp):
        seen.append(("add_files", sorted(p.name for p in tmp.iterdir())))
        torch.save({"sched": 1}, tmp / "scheduler.pt")

    def complete(tmp):
        seen.append(("complete", cdir.is_committed(tmp), final.exists()))
        (tmp / "view.txt").write_text("written after the shards")

    cdir.save_dir(
        final,
        _state(1.0),
        files={"meta.pt": {"step": 1}},
        add_files=add_files,
        complete=complete,
        on_commit=lambda path: seen.append(("on_commit", path, cdir.is_committed(path))),
    )
    assert seen == [("add_files", ["meta.pt"]), ("complete", True, False), ("on_commit", final, True)]
    for name in ("scheduler.pt", "view.txt"):  # what the caller added is covered by the checksums too
        original = (final / name).read_bytes()
        (final / name).write_bytes(b"tampered")
        with pytest.raises(ValueError, match=name):
            cdir.verify_dir(final)
        (final / name).write_bytes(original)
    cdir.verify_dir(final)


def test_prune_keeps_the_newest_and_the_protected_and_unpublishes_first(tmp_path, monkeypatch):
    for step in range(1, 6):
        cdir.save_dir(tmp_path / f"step-{step}", _state(float(step)))
    (tmp_path / "step-9").mkdir()  # not committed: never counted, never removed
    order = []
    real_unpublish = cdir.unpublish
    monkeypatch.setattr(cdir, "unpublish", lambda p: order.append(p.name) or real_unpublish(p))
    removed = cdir.prune(tmp_path, 2, protect=[tmp_path / "step-2"])
    assert [p.name for p in removed] == ["step-1", "step-3", "step-4"] == order  # each renamed away first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-5", "step-9"]
    # keep_newest=False (the Hugging Face Trainer's end of training): only the protected one stays.
    assert [p.name for p in cdir.prune(tmp_path, 1, protect=[tmp_path / "step-2"], keep_newest=False)] == ["step-5"]
    assert sorted(cdir.committed_steps(tmp_path)) == [2]

"""transformers.Trainer (and TRL's SFTTrainer) on the engine: `FSDP2Trainer` under `accelerate launch
--config_file` on 2 CPU processes, and unit tests of its refusals.

The scripts in tests/integrations/transformers/scripts/ check what each flow claims where it runs (`helpers.checks.Checks`,
on every rank) and write every rank's report; the launch tests here launch them and report their checks.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import transformers  # noqa: E402
from helpers.checks import FlowReports  # noqa: E402
from helpers.harness import launch, rank_reports  # noqa: E402

from fsdp2_strategy.integrations.transformers import (  # noqa: E402
    FSDP2Trainer,
    FSDP2TrainerMixin,
    committed_checkpoints,
    fsdp2_trainer,
    latest_checkpoint,
)
from fsdp2_strategy.integrations.transformers.checkpoint import keep_only_best, rotate  # noqa: E402
from fsdp2_strategy.integrations.transformers.trainer import _refuse_other_engines  # noqa: E402

SCRIPTS = Path(__file__).parent / "scripts"
PER_RANK = [
    # The Trainer's own timings, each rank's:
    "parity.eval.eval_model_preparation_time",
    "parity.eval.eval_runtime",
    "parity.eval.eval_samples_per_second",
    "parity.eval.eval_steps_per_second",
]
"""Report values that differ between ranks by nature ("flow.key"); every other value must agree on both
(what rank 0 alone reads from the files it wrote, each flow hands to every rank before checking it)."""


# The launches: `accelerate launch --config_file CONFIG SCRIPT ARGS...` on 2 CPU processes, as a user runs
# it. The config file alone decides (no FSDP_*/ACCELERATE_* from outside), except ACCELERATE_USE_CPU:
# Accelerate's FSDP launcher drops the file's `use_cpu: true`, and on a GPU machine these tests stay on CPU.
QUIET = {"TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> FlowReports:
    """fsdp2_sharded.yaml: parity + evaluate + save_model, checkpoints and resume, bf16, preemption."""
    work = tmp_path_factory.mktemp("transformers_sharded")
    config = SCRIPTS / "fsdp2_sharded.yaml"
    launch("accelerate", "flows.py", work / "out.json", work, cwd=SCRIPTS, config=config, env=QUIET)
    return FlowReports(rank_reports(work / "out.json", 2), PER_RANK)


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> FlowReports:
    """fsdp2_full.yaml: a run killed mid-save (killed.py), then FULL_STATE_DICT checkpoints and save_model,
    a LoRA model, TRL's SFTTrainer and the resume of the killed run."""
    pytest.importorskip("peft")
    pytest.importorskip("trl")
    work = tmp_path_factory.mktemp("transformers_full")
    # Without ACCELERATE_USE_CPU where no GPU exists: the launch a CPU user runs (TrainingArguments then
    # sets Accelerate up as one process per rank, which the adapter must undo).
    no_gpu = not torch.cuda.is_available()
    config = SCRIPTS / "fsdp2_full.yaml"
    killed = launch("accelerate", "killed.py", work / "killed", cwd=SCRIPTS, config=config, env=QUIET, check=False)
    # The launch itself: killed inside the save with killed.py's exit status (its ranks leave files
    # that flows_full.py's resume_after_kill checks).
    assert "exitcode  : 17" in killed.stdout + killed.stderr, killed.stdout[-2000:] + killed.stderr[-2000:]
    # Without ACCELERATE_USE_CPU where no GPU exists, as a user's launch on a machine without GPU.
    env = {**QUIET, "ACCELERATE_USE_CPU": None} if no_gpu else QUIET
    launch("accelerate", "flows_full.py", work / "out.json", work, cwd=SCRIPTS, config=config, env=env)
    return FlowReports(rank_reports(work / "out.json", 2), PER_RANK)


# ---------------------------------------------------------------------------------------- 2-process runs
def test_two_processes_train_evaluate_and_save_like_one(sharded):
    """2 processes x accumulation 2 x max_grad_norm against one process on the same global batches (the
    global norm before clipping too); evaluate() sees every sample once; save_model() loads with
    from_pretrained."""
    sharded.assert_passed("parity")


def test_checkpoints_rotate_keep_best_and_resume_skipping_the_partial_one(sharded):
    sharded.assert_passed("checkpoints")


def test_bf16_is_the_fsdp2_policy(sharded):
    sharded.assert_passed("bf16")


def test_log_throughput_adds_per_step_metrics_to_the_training_logs(sharded):
    sharded.assert_passed("throughput")


def test_context_parallel_halves_every_sequence_and_matches_one_process(sharded):
    sharded.assert_passed("context_parallel")


def test_sigterm_to_one_rank_saves_that_step_and_stops_every_rank(sharded):
    sharded.assert_passed("preemption")


def test_kill_mid_save_then_resume_continues_exactly(full):
    full.assert_passed("resume_after_kill")


def test_full_state_dict_checkpoint_and_save_model_load_with_from_pretrained(full):
    full.assert_passed("full_state_dict")


def test_peft_model_trains_and_saves_a_loadable_adapter(full):
    full.assert_passed("peft_lora")


def test_trl_sft_trainer_through_fsdp2_trainer(full):
    full.assert_passed("sft")


# ---------------------------------------------------------------------------------------- unit tests
def test_mixin_refuses_a_class_that_is_not_a_trainer():
    class NotATrainer(FSDP2TrainerMixin):
        pass

    with pytest.raises(TypeError, match="mixin for transformers.Trainer subclasses"):
        NotATrainer()
    with pytest.raises(TypeError, match="takes a transformers.Trainer subclass"):
        fsdp2_trainer(object)


def test_mixin_must_come_first():
    with pytest.raises(TypeError, match="must come before the Trainer class"):

        class Wrong(transformers.Trainer, FSDP2TrainerMixin):
            pass


def test_fsdp2_trainer_helper_builds_the_subclass():
    cls = fsdp2_trainer(transformers.Trainer)
    assert issubclass(cls, FSDP2TrainerMixin) and issubclass(cls, transformers.Trainer)
    assert cls.__mro__.index(FSDP2TrainerMixin) < cls.__mro__.index(transformers.Trainer)
    assert fsdp2_trainer(FSDP2Trainer) is FSDP2Trainer


@pytest.mark.parametrize(
    "name, value, words",
    [
        ("deepspeed", "ds.json", "DeepSpeed is another engine"),
        ("fsdp", ["full_shard"], "fsdp_version: 2"),
        ("save_only_model", True, "trainer.save_model()"),
        ("auto_find_batch_size", True, "drop auto_find_batch_size"),
    ],
)
def test_other_engines_refused_by_name(name, value, words):
    fields = dict.fromkeys(("deepspeed", "fsdp", "save_only_model", "auto_find_batch_size"))
    with pytest.raises(ValueError, match=rf"{name}: .*{words}".replace("(", r"\(").replace(")", r"\)")):
        _refuse_other_engines(SimpleNamespace(**{**fields, name: value}))


def test_fsdp_plugin_must_be_an_fsdp2_plugin():
    with pytest.raises(TypeError, match="fsdp_plugin must be an FSDP2Plugin"):
        FSDP2Trainer(fsdp_plugin=object())


def _checkpoint_dirs(root: Path, committed: list[int], partial: list[int]) -> None:
    for step in committed + partial:
        (root / f"checkpoint-{step}").mkdir(parents=True)
    for step in committed:
        (root / f"checkpoint-{step}" / ".metadata").write_bytes(b"")


def test_rotation_counts_only_committed_and_keeps_newest_and_best(tmp_path):
    _checkpoint_dirs(tmp_path, committed=[2, 4, 6, 8], partial=[10])
    removed = rotate(tmp_path, 2, best=str(tmp_path / "checkpoint-4"))
    assert [p.name for p in removed] == ["checkpoint-2", "checkpoint-6"]
    assert sorted(committed_checkpoints(tmp_path)) == [4, 8]
    assert (tmp_path / "checkpoint-10").is_dir()  # not ours to judge: a partial save is left alone
    assert Path(latest_checkpoint(tmp_path)).name == "checkpoint-8"


def test_end_of_training_keeps_only_the_best_through_the_crash_safe_pruning(tmp_path, monkeypatch):
    """save_total_limit=1 with a best checkpoint: the stock end of training deletes every other one
    with shutil.rmtree. FSDP2TrainerMixin._finalize_training prunes them first (each un-published
    before it is deleted), so the stock loop, given what `sort_checkpoints` lists, has nothing left."""
    from transformers.trainer_utils import sort_checkpoints

    from fsdp2_strategy.checkpoint import directory as cdir

    _checkpoint_dirs(tmp_path, committed=[2, 4, 6], partial=[])
    unpublished, waited, order = [], [], []
    real_unpublish = cdir.unpublish
    monkeypatch.setattr(cdir, "unpublish", lambda p: unpublished.append(p.name) or real_unpublish(p))
    best = str(tmp_path / "checkpoint-4")
    trainer = SimpleNamespace(
        args=SimpleNamespace(save_total_limit=1, should_save=True),
        state=SimpleNamespace(best_model_checkpoint=best),
        accelerator=SimpleNamespace(wait_for_checkpoint=lambda: waited.append(True)),
        _get_output_dir=lambda trial: str(tmp_path),
    )
    removed = keep_only_best(trainer, None)
    assert [p.name for p in removed] == ["checkpoint-2", "checkpoint-6"] == unpublished and waited == [True]
    assert sort_checkpoints(str(tmp_path), best_model_checkpoint=best) == [best]  # the stock loop skips the best
    trainer.args.save_total_limit = 2  # any other limit: the stock end of training deletes nothing, nor do we
    assert keep_only_best(trainer, None) == []

    class Stock:
        def _finalize_training(self, trial, *args):
            order.append(sorted(committed_checkpoints(tmp_path)))

    class Wrapped(FSDP2TrainerMixin, Stock):
        pass

    _checkpoint_dirs(tmp_path, committed=[6, 10], partial=[])
    trainer.args.save_total_limit = 1
    wrapped = Wrapped.__new__(Wrapped)
    wrapped.__dict__.update(vars(trainer))
    wrapped._finalize_training(None)  # the mixin prunes, then the stock method runs
    assert order == [[4]]


def test_resume_true_without_a_committed_checkpoint_names_the_partial_ones(tmp_path):
    _checkpoint_dirs(tmp_path, committed=[], partial=[3])
    with pytest.raises(ValueError, match=r"No valid checkpoint found.*not committed: \['checkpoint-3'\]"):
        latest_checkpoint(tmp_path)

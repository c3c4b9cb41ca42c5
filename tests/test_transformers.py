"""transformers.Trainer (and TRL's SFTTrainer) on the engine: `FSDP2Trainer` under `accelerate launch
--config_file` on 2 CPU processes, and unit tests of its refusals.

The scripts in tests/transformers_scripts/ measure and write JSON; the assertions live here.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import transformers  # noqa: E402
from _collect import close_lists  # noqa: E402
from _harness import agreed_report, assert_no_flow_failed, launch, rank_reports  # noqa: E402

from fsdp2_strategy.integrations.transformers import (  # noqa: E402
    FSDP2Trainer,
    FSDP2TrainerMixin,
    committed_checkpoints,
    fsdp2_trainer,
    latest_checkpoint,
)
from fsdp2_strategy.integrations.transformers.checkpoint import keep_only_best, rotate  # noqa: E402
from fsdp2_strategy.integrations.transformers.trainer import _refuse_other_engines  # noqa: E402

SCRIPTS = Path(__file__).parent / "transformers_scripts"
PER_RANK = [
    # The Trainer's own timings, each rank's:
    "parity.eval.eval_model_preparation_time",
    "parity.eval.eval_runtime",
    "parity.eval.eval_samples_per_second",
    "parity.eval.eval_steps_per_second",
    # Rank 0 alone reads back the files it wrote:
    "parity.saved_files",
    "parity.saved_rel_diff",
    "full_state_dict.checkpoint_files",
    "full_state_dict.checkpoint_rel_diff",
    "full_state_dict.saved_files",
    "full_state_dict.saved_rel_diff",
    "peft_lora.adapter_rel_diff",
    "peft_lora.adapter_tensors",
    "peft_lora.saved_files",
    "sft.reloads",
]
"""Report values that differ between ranks by nature ("flow.key"); every other value must agree on both."""
TOL = 1e-5  # fp32 parity, relative


# The launches: `accelerate launch --config_file CONFIG SCRIPT ARGS...` on 2 CPU processes, as a user runs
# it. The config file alone decides (no FSDP_*/ACCELERATE_* from outside), except ACCELERATE_USE_CPU:
# Accelerate's FSDP launcher drops the file's `use_cpu: true`, and on a GPU machine these tests stay on CPU.
QUIET = {"TOKENIZERS_PARALLELISM": "false"}


def _load(path: Path) -> dict:
    out = json.loads(path.read_text())
    assert_no_flow_failed(out)
    return out


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> dict:
    """fsdp2_sharded.yaml: parity + evaluate + save_model, checkpoints and resume, bf16, preemption."""
    work = tmp_path_factory.mktemp("transformers_sharded")
    config = SCRIPTS / "fsdp2_sharded.yaml"
    launch("accelerate", "flows.py", work / "out.json", work, cwd=SCRIPTS, config=config, env=QUIET)
    return agreed_report(rank_reports(work / "out.json", 2), PER_RANK)


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> dict:
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
    # Without ACCELERATE_USE_CPU where no GPU exists, as a user's launch on a machine without GPU.
    env = {**QUIET, "ACCELERATE_USE_CPU": None} if no_gpu else QUIET
    launch("accelerate", "flows_full.py", work / "out.json", work, cwd=SCRIPTS, config=config, env=env)
    report = agreed_report(rank_reports(work / "out.json", 2), PER_RANK)
    return {**report, "without_cpu_variable": no_gpu, "killed_output": killed.stdout + killed.stderr}


# ---------------------------------------------------------------------------------------- 2-process runs
def test_two_processes_train_like_one(sharded):
    r = sharded["parity"]
    assert r["num_processes"] == 2 and r["world_size"] == 2 and r["distributed_type"] == "DistributedType.FSDP"
    assert r["update_size"] > 1e-4  # training moved the weights: the comparison is not vacuous
    assert r["param_rel_diff"] < TOL and r["update_rel_diff"] < TOL, r
    # max_grad_norm: the global norm before clipping is the one-process norm, and clipping happened.
    assert all(n > 0.05 for n in r["ref_norms"])
    assert len(r["grad_norms"]) == 3
    assert all(abs(a - b) <= TOL * b for a, b in zip(r["grad_norms"], r["ref_norms"])), r


def test_evaluate_sees_every_sample_once(sharded):
    r = sharded["parity"]
    assert abs(r["eval_before_train"] - r["ref_eval_before_train"]) <= TOL * r["ref_eval_before_train"]
    # Saving after evaluate() prepared the model first (the Trainer's free_memory() forgets it).
    assert r["checkpoints"] == ["checkpoint-3"], r["checkpoints"]
    assert r["seen"] == list(range(11))  # 11 samples over 2 ranks x 3: the padded duplicate is dropped
    assert abs(r["eval"]["eval_ce"] - r["ref_eval"]["ce"]) <= TOL * r["ref_eval"]["ce"]
    assert r["eval"]["eval_acc"] == pytest.approx(r["ref_eval"]["acc"], abs=1e-7)


def test_save_model_loads_with_from_pretrained_sharded(sharded):
    r = sharded["parity"]
    assert {"config.json", "model.safetensors"} <= set(r["saved_files"])
    assert r["saved_rel_diff"] < 1e-7


def test_checkpoints_rotate_committed_and_keep_best(sharded):
    r = sharded["checkpoints"]
    assert r["committed_run1"] == [2, 6]  # save_total_limit=2: the newest and the best (step 2) stay
    assert r["best"] == "checkpoint-2" and r["best_loaded_rel_diff"] == 0.0
    assert r["step6_vs_step2"] > 1e-3  # loading the best changed the weights
    assert {".metadata", "checksums.json", "trainer_state.json", "scheduler.pt", "rng_state_1.pth"} <= set(r["files"])


def test_resume_skips_partial_and_continues_exactly(sharded):
    r = sharded["checkpoints"]
    assert r["latest_run2"] == "checkpoint-4"  # checkpoint-6 there is partial (no .metadata)
    assert "not a committed FSDP2Trainer checkpoint" in r["partial_error"]
    assert r["resume_global_step"] == 6
    assert r["resume_rel_diff"] < TOL, r
    assert r["committed_run2"] == [4, 6]  # the partial checkpoint-6 was replaced by a committed one


def test_bf16_is_the_fsdp2_policy(sharded):
    r = sharded["bf16"]
    assert r["accelerator_precision"] == "bf16" and r["policy"] == "bf16"
    assert r["compute_dtypes"] == ["torch.bfloat16"] and r["param_dtypes"] == ["torch.float32"]
    # Each step's loss (the mean over the ranks) is the policy's, written out in one process on the samples
    # each rank saw, up to one bf16 rounding (measured: equal); the second step shows the first's update
    # (without it, or with the gradients twice or half as large, the second loss moves by 0.06 or more).
    assert len(r["losses"]) == 2 and close_lists(r["losses"], r["ref_losses"], 2**-7), r
    assert r["train_loss"] == pytest.approx(sum(r["ref_losses"]) / 2, rel=2**-7), r


def test_log_throughput_adds_per_step_metrics_to_the_training_logs(sharded):
    r = sharded["throughput"]
    assert r["off_by_default"]
    for logs in r["logs"]:  # each rank's log history
        assert [row["step"] for row in logs] == [1, 2, 3, 4]
        assert "mfu" not in logs[0]  # the first step starts the clock: nothing to report yet
        for row in logs[1:]:
            # 2 sequences of 8 tokens a step on each rank, counted by the model's forward.
            assert row["tokens_per_s"] * row["step_time_s"] == pytest.approx(16)
            assert 0 < row["mfu"] < 1 and row["peak_memory_gib"] > 0


def test_sigterm_to_one_rank_saves_that_step_and_stops_every_rank(sharded):
    r = sharded["preemption"]
    assert r["global_step"] == [3, 3] and r["preempted"] == [True, True] and r["committed"] == [3], r


def test_kill_mid_save_then_resume_continues_exactly(full):
    assert "exitcode  : 17" in full["killed_output"]  # both processes died inside the save of checkpoint-6
    r = full["resume_after_kill"]
    assert r["left"] == [".tmp-checkpoint-6", "checkpoint-2", "checkpoint-4"]
    assert r["latest"] == "checkpoint-4"
    assert r["resume_rel_diff"] < TOL, r
    assert r["committed_after"] == [2, 4, 6] and r["left_after"] == []


def test_full_state_dict_checkpoint_and_save_model_load_with_from_pretrained(full):
    r = full["full_state_dict"]
    assert r["world_size"] == 2 and r["num_processes"] == 2
    if full["without_cpu_variable"]:
        assert r["args_world_size_before"] == 1  # what the stock Trainer would have run with
    assert r["state_dict_type"] == "FULL_STATE_DICT"
    assert {".metadata", "checksums.json", "model.safetensors", "config.json"} <= set(r["checkpoint_files"])
    assert r["checkpoint_rel_diff"] < 1e-7 and r["saved_rel_diff"] < 1e-7
    assert {"config.json", "model.safetensors"} <= set(r["saved_files"])


def test_peft_model_trains_and_saves_a_loadable_adapter(full):
    r = full["peft_lora"]
    # The adapters (LoRA A and B of query and value in both layers) and the classifier copy after 3 steps:
    # SGD in one process on the same global batches (measured 1.8e-07 of the update, which moved 10 %).
    assert sum("lora_" in n for n in r["trained"]) == 8 and any("modules_to_save" in n for n in r["trained"]), r
    assert r["update_rel_diff"] < TOL and r["update_size"] > 0.01, r
    assert r["frozen_unchanged"] == 0.0  # the base weights stayed frozen
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(r["saved_files"])
    assert "model.safetensors" not in r["saved_files"]
    assert r["adapter_tensors"] == 8 and r["adapter_rel_diff"] < 1e-7


def test_trl_sft_trainer_through_fsdp2_trainer(full):
    r = full["sft"]
    assert r["class"] == "FSDP2SFTTrainer" and r["accelerator"] == "FSDP2Accelerator"
    # Every step's loss and the trained weights are those of the same 8 SGD steps written out in one process
    # on the batches each rank's model received (bf16 policy, token mean over the global batch): measured
    # equal, the weights bitwise. The loss falls (2.83 to 1.50) and the weights moved 34 %.
    assert len(r["losses"]) == 8 and close_lists(r["losses"], r["ref_losses"], TOL), r
    assert r["update_rel_diff"] < TOL and r["update_size"] > 0.1, r
    assert r["losses"][-1] < r["losses"][0], r
    assert r["reloads"] == "LlamaForCausalLM"


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

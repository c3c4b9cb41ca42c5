"""A DeepSpeed ZeRO-1/2/3 checkpoint converted into ours (`f2.convert_deepspeed_checkpoint`, the command
`fsdp2-strategy convert-deepspeed`) continues training exactly where DeepSpeed would have, on 1, 2 and 3
ranks; the converter's errors name the file and the fix; its memory peak is one parameter, not the model.

Real DeepSpeed (0.19.8, CPU, gloo) trains in its own 2-process world, from a copy installed for these
tests only (`deepspeed_path`: installing it into the project's environment would change how Accelerate,
transformers and Lightning behave in the other tests). The converter itself never imports DeepSpeed.

Tolerance: both sides run torch's AdamW in fp32 (DeepSpeed over flat partitions, ours over per-parameter
shards) on the same global batches; they differ only in the order of the gradient reductions (2 ranks of 3
samples vs 1, 2 or 3 ranks), which moves the results by float32 rounding. After 3 steps the worst
relative difference (norm of the difference / norm) of parameters and moments measured 2.5e-7 on 1
rank, 1.8e-7 on 3, and 0 on 2 (DeepSpeed's own split); 2e-6 is asserted. The converted state itself must equal DeepSpeed's at the save bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import ROOT
from helpers.deepspeed_models import (
    K_STEPS,
    LR,
    M_STEPS,
    batch_for,
    lm_loss,
    make_model,
    make_optimizer,
    make_scheduler,
    snapshot,
    worst_difference,
)
from helpers.harness import launch, run_distributed
from helpers.untrusted import assert_refused_then_trusted, plant

import fsdp2_strategy as f2
from fsdp2_strategy.cli import main

STAGES = (1, 2, 3)
TOLERANCE = 2e-6


@pytest.fixture(scope="module")
def deepspeed_run(deepspeed_path, tmp_path_factory) -> Path:
    """DeepSpeed's ZeRO-1, 2 and 3 runs in one 2-process world: checkpoints and reference states."""
    out = tmp_path_factory.mktemp("deepspeed")
    scripts = Path(__file__).parent / "scripts"
    launch(
        "torchrun",
        "train_zero.py",
        out,
        cwd=scripts,
        pythonpath=[deepspeed_path],
        env={"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore::FutureWarning"},  # errors stay in view
        timeout=240,
    )
    return out


@pytest.fixture(scope="module")
def converted(deepspeed_run, tmp_path_factory) -> dict:
    """Each stage converted: ZeRO-1 and 2 through the API, ZeRO-3 through the command line."""
    root = tmp_path_factory.mktemp("converted")
    results = {}
    for stage in (1, 2):
        results[stage] = f2.convert_deepspeed_checkpoint(deepspeed_run / f"zero{stage}", root / f"zero{stage}")
    assert main(["convert-deepspeed", str(deepspeed_run / "zero3"), str(root / "zero3")]) == 0
    results[3] = root / "zero3"
    return results


def _snapshot(model, optimizer, scheduler) -> dict:
    return {**snapshot(model, optimizer), "lr": scheduler.get_last_lr()[0]}


def _continue(roots: dict) -> dict:
    """On every rank of this world: each stage's converted checkpoint loaded into a sharded model, M more
    steps; rank 0 returns the full parameters and moments."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    results = {}
    for stage, root in roots.items():
        model = f2.shard_model(make_model(), log_plan=False)
        optimizer = make_optimizer(model)
        scheduler = make_scheduler(optimizer)
        extra = f2.Checkpointer(root).load(model=model, optimizer=optimizer)
        scheduler.load_state_dict(extra["lr_scheduler"])
        start = extra["global_steps"]
        for step in range(start, start + M_STEPS):
            idx, tgt = batch_for(step, rank, world)
            lm_loss(model, idx, tgt).backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        snap = _snapshot(model, optimizer, scheduler)
        results[stage] = {"snapshot": snap, "extra": extra} if rank == 0 else None
    return results


@pytest.fixture(scope="module")
def continued(converted) -> dict:
    roots = {stage: str(getattr(c, "path", c)).rsplit("/step-", 1)[0] for stage, c in converted.items()}
    return {world: run_distributed(_continue, world, roots)[0] for world in (1, 2, 3)}


@pytest.mark.parametrize("stage", STAGES)
def test_converted_state_is_deepspeeds_at_the_save(deepspeed_run, converted, stage):
    result = converted[stage]
    root = getattr(result, "path", None) or next(Path(result).glob("step-*"))
    reference = torch.load(deepspeed_run / "reference.pt", weights_only=False)[stage]["at_save"]
    model = make_model()
    optimizer = make_optimizer(model)
    make_scheduler(optimizer)  # adds `initial_lr` to the groups, which the load then asks for
    extra = f2.Checkpointer(Path(root).parent).load(model=model, optimizer=optimizer, step=K_STEPS)
    assert worst_difference(_snapshot_plain(model, optimizer), reference)[0] == 0.0  # bit for bit
    assert extra["client_state"] == {"epoch": 3, "data_position": 1234}
    assert (extra["global_steps"], extra["global_samples"], extra["lr_scheduler"]["last_epoch"]) == (3, 18, 3)
    assert extra["deepspeed"]["zero_stage"] == stage and extra["deepspeed"]["dp_world_size"] == 2
    assert model.head.weight is model.tok.weight  # tied names came back as one parameter
    group = optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(reference["lr"]) and group["initial_lr"] == LR
    assert all(state["step"].item() == K_STEPS for state in optimizer.state.values())


def _snapshot_plain(model, optimizer) -> dict:
    names = {p: n for n, p in model.named_parameters()}
    return {
        "param": {n: p.detach() for p, n in names.items()},
        **{k: {names[p]: s[k] for p, s in optimizer.state.items()} for k in ("exp_avg", "exp_avg_sq")},
    }


@pytest.mark.parametrize("world", (1, 2, 3))
@pytest.mark.parametrize("stage", STAGES)
def test_training_continues_as_deepspeed_would(deepspeed_run, continued, stage, world):
    reference = torch.load(deepspeed_run / "reference.pt", weights_only=False)[stage]["continued"]
    got = continued[world][stage]["snapshot"]
    worst, where = worst_difference(got, reference)
    assert worst < TOLERANCE, f"ZeRO-{stage} resumed on {world} rank(s): {where} differs by {worst:.2e} (relative)"
    assert got["lr"] == pytest.approx(reference["lr"], rel=1e-12)


# ---------------------------------------------------------------------- what the converter refuses
def _copy_tag(deepspeed_run: Path, stage: int, dest: Path) -> Path:
    """A copy of stage `stage`'s save as `dest/global_step3` (without `latest`)."""
    import shutil

    shutil.copytree(deepspeed_run / f"zero{stage}" / f"global_step{K_STEPS}", dest / f"global_step{K_STEPS}")
    return dest / f"global_step{K_STEPS}"


def _as_sgd(step_dir: Path) -> None:
    """Rewrite a ZeRO-2 save's optimizer files as if the optimizer kept SGD's momentum instead of Adam's
    moments (DeepSpeed's own objects replaced by plain values, so that torch can save them)."""
    from fsdp2_strategy.migrate.zero_files import load_file

    for path in step_dir.glob("*_optim_states.pt"):
        state = load_file(path)
        osd = state["optimizer_state_dict"]
        osd.update(zero_stage=2, loss_scaler=None, param_slice_mappings=None)
        for group in osd["base_optimizer_state"]["state"].values():
            group["momentum_buffer"] = group.pop("exp_avg").clone()
            del group["exp_avg_sq"]
        torch.save(state, path.with_suffix(".new"))  # not over `path`: its tensors are memory-mapped from it
        path.with_suffix(".new").replace(path)


def test_refusals_name_the_file_and_the_fix(deepspeed_run, tmp_path):
    untagged = tmp_path / "untagged"
    _copy_tag(deepspeed_run, 1, untagged)
    with pytest.raises(FileNotFoundError, match=r"no 'latest' file .* pass the tag .*global_step3"):
        f2.convert_deepspeed_checkpoint(untagged, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match=r"no tag folder 'global_step9'; folders there: \['global_step3'\]"):
        f2.convert_deepspeed_checkpoint(untagged, tmp_path / "out", tag="global_step9")

    parallel = _copy_tag(deepspeed_run, 1, tmp_path / "tp")
    (parallel / "mp_rank_01_model_states.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"tensor- or pipeline-parallel run \(mp_rank_01_model_states.pt\)"):
        f2.convert_deepspeed_checkpoint(parallel, tmp_path / "out")

    partial = _copy_tag(deepspeed_run, 3, tmp_path / "partial")
    (partial / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(ValueError, match=r"lacks the optimizer-state files of rank\(s\) \[0\]"):
        f2.convert_deepspeed_checkpoint(partial, tmp_path / "out")

    sgd = _copy_tag(deepspeed_run, 2, tmp_path / "sgd")
    _as_sgd(sgd)
    with pytest.raises(ValueError, match=r"holds \['momentum_buffer', 'step'\], not Adam/AdamW's .* weights_only=True"):
        f2.convert_deepspeed_checkpoint(sgd, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written by a refused conversion

    weights = f2.convert_deepspeed_checkpoint(sgd, tmp_path / "out", weights_only=True, progress=False)
    assert not weights.optimizer_state and weights.step == K_STEPS
    model = make_model()
    f2.Checkpointer(tmp_path / "out").load(model=model)
    with pytest.raises(ValueError, match="no optimizer state under 'optim'"):
        f2.Checkpointer(tmp_path / "out").load(model=model, optimizer=make_optimizer(model))
    with pytest.raises(ValueError, match="step-000003 already exists"):
        f2.convert_deepspeed_checkpoint(sgd, tmp_path / "out", weights_only=True)
    assert main(["convert-deepspeed", str(untagged), str(tmp_path / "cli")]) == 2  # a message, no traceback


def test_a_file_that_runs_code_is_refused_and_trust_converts_it(deepspeed_run, tmp_path):
    """A model-states file carrying a pickle that runs code (as a `client_state` entry can): refused
    naming the file, the type and the switch, nothing run or written; `trusted=True` / `--trust`
    convert it. DeepSpeed's own classes (ZeroStageEnum, LossScaler, fragment_address) are read as
    data: every other test here converts real saves without the switch."""
    marker = tmp_path / "ran"
    crafted = _copy_tag(deepspeed_run, 2, tmp_path / "crafted")
    planted = crafted / "mp_rank_00_model_states.pt"
    plant(planted, marker, checksums=False)
    assert_refused_then_trusted(f2.convert_deepspeed_checkpoint, "convert-deepspeed", crafted, marker, planted)


def test_the_deepspeed_comparison_runs_as_the_device_suite_runs_it(deepspeed_path, tmp_path):
    """benchmarks/deepspeed_compare.py at a tiny size, as `device_suite.py --parts deepspeed` runs it on a
    GPU (bf16, one rank), so it cannot rot: the four engines interleaved, each with a ratio to its ZeRO
    stage, then each engine's peak memory in a world of its own (the measured tables are in
    benchmarks/results)."""
    launch(
        "python",
        "benchmarks/device_suite.py",
        *["--dry-run", "--parts", "deepspeed", "--out", tmp_path],
        cwd=ROOT,
        pythonpath=[deepspeed_path],
        env={"PYTHONWARNINGS": "ignore"},
        timeout=300,
    )
    part = json.loads((tmp_path / "device_suite.json").read_text())["parts"]["deepspeed"]
    assert "result" in part, part
    timed, memory = part["result"]["time"], part["result"]["memory"]
    engines = {"ZeRO-2", "SHARD_GRAD_OP", "ZeRO-3", "FULL_SHARD"}
    assert set(timed) == set(memory) == engines, part["result"]["table"]
    assert timed["ZeRO-2"][-2] == timed["ZeRO-3"][-2] == "1.000" and float(timed["FULL_SHARD"][-2]) > 0
    assert memory["ZeRO-3"][-2] == "1.000" and all(float(memory[e][1]) > 0 for e in engines)  # rise MiB


# ---------------------------------------------------------------------- resumed by the trainers
def test_lightning_fit_resumes_a_converted_checkpoint_as_deepspeed_would(deepspeed_run, converted):
    """ZeRO-3 converted, then `fit(ckpt_path=<the step>)` on 2 ranks: the LightningModule holds the model
    as `self.model` (names `model.<name>`), found by the strategy; M more steps continue from global
    step K on DeepSpeed's path."""
    from helpers.trainer_resume import LIGHTNING_ENV, lightning_continue

    step_dir = next(Path(converted[3]).glob("step-*"))
    got = run_distributed(lightning_continue, 2, str(step_dir), K_STEPS, env=LIGHTNING_ENV, timeout=240)[0]
    reference = torch.load(deepspeed_run / "reference.pt", weights_only=False)[3]["continued"]
    assert got["steps"] == list(range(K_STEPS, K_STEPS + M_STEPS)) and got["global_step"] == K_STEPS + M_STEPS
    stripped = {k: {n.removeprefix("model."): t for n, t in got[k].items()} for k in ("param", "exp_avg", "exp_avg_sq")}
    worst, where = worst_difference(stripped, reference)
    assert worst < TOLERANCE, f"Lightning resumed ZeRO-3: {where} differs by {worst:.2e} (relative)"
    assert got["lr"] == pytest.approx(reference["lr"], rel=1e-12)


def test_the_hf_trainer_resumes_a_converted_step_where_deepspeed_would_continue(deepspeed_run, converted, tmp_path):
    """ZeRO-3 converted, then `FSDP2Trainer.train(resume_from_checkpoint=<the step>)` on 2 ranks (no
    trainer_state.json there): the global step continues from K, M more steps on DeepSpeed's path."""
    from helpers.trainer_resume import hf_continue

    step_dir = next(Path(converted[3]).glob("step-*"))
    got = run_distributed(hf_continue, 2, str(step_dir), K_STEPS, str(tmp_path), timeout=240)[0]
    reference = torch.load(deepspeed_run / "reference.pt", weights_only=False)[3]["continued"]
    assert got["steps"] == list(range(K_STEPS, K_STEPS + M_STEPS)) and got["global_step"] == K_STEPS + M_STEPS
    worst, where = worst_difference({k: got[k] for k in ("param", "exp_avg", "exp_avg_sq")}, reference)
    assert worst < TOLERANCE, f"the HF Trainer resumed ZeRO-3: {where} differs by {worst:.2e} (relative)"
    assert got["lr"] == pytest.approx(reference["lr"], rel=1e-12)


def test_a_converted_step_is_refused_by_name_when_no_or_several_submodules_fit(converted):
    from fsdp2_strategy.checkpoint import load_into

    step_dir = converted[1].path
    twins = torch.nn.ModuleDict({"student": make_model(), "teacher": make_model()})
    with pytest.raises(ValueError, match="fits several submodules of ModuleDict: student, teacher"):
        load_into(step_dir, twins)
    with pytest.raises(ValueError, match="fits student, teacher of ModuleDict, but the optimizer also updates"):
        load_into(step_dir, twins, torch.optim.AdamW(twins.parameters()))
    load_into(step_dir, twins, make_optimizer(twins["student"]))  # the optimizer says which one
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="matches no submodule of Linear.*missing in the model: blocks"):
        load_into(step_dir, other, torch.optim.AdamW(other.parameters()))

"""FSDP1 checkpoints converted into ours (`f2.convert_fsdp1_checkpoint`, the command `fsdp2-strategy
convert-fsdp1`) continue training exactly where FSDP1 would have, on 1 and 2 ranks; the converter's errors
name the file and the fix.

One 2-process world (`helpers.fsdp1_sources.save_sources`) trains with torch FSDP1 (gloo, CPU, fp32,
`use_orig_params=True`, AdamW), writes every format the converter reads (torch sharded DCP and full files,
Lightning's sharded folder and `.ckpt`, Accelerate's sharded and full `save_state` folders) and continues
M steps: the reference.

Tolerance: both sides run torch's AdamW in fp32 on the same global batches; FSDP1 reduces the gradients of
2 ranks of 3 samples, ours of 1 or 2 ranks: only the order of the reductions differs, which moves results by
float32 rounding. After 3 steps the worst relative difference (norm of the difference / norm) of parameters and
moments measured 2.5e-7 on 1 rank (exp_avg_sq of the tied embedding) and 0 on 2, the same for every format;
2e-6 is asserted (as for DeepSpeed). The frozen attention
biases keep Adam off the one parameter whose gradient is exactly zero. The converted state itself must equal
FSDP1's at the save bit for bit.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers.deepspeed_models import (
    K_STEPS,
    M_STEPS,
    batch_for,
    lm_loss,
    make_model,
    make_optimizer,
    make_scheduler,
    snapshot,
    worst_difference,
)
from helpers.fsdp1_sources import save_sources
from helpers.harness import run_distributed
from helpers.untrusted import assert_refused_then_trusted, plant

import fsdp2_strategy as f2
from fsdp2_strategy.cli import main

TOLERANCE = 2e-6
SOURCES = {  # name -> (path under the run's folder, optimizer file, format, command line)
    "torch_sharded": ("torch_sharded", None, "torch-sharded", False),
    "torch_full": ("torch_full/model.pt", "torch_full/optim.pt", "torch-full", True),
    "lightning_sharded": ("lightning_sharded", None, "lightning-sharded", False),
    "lightning_full": ("lightning_full.ckpt", None, "lightning-full", True),
    "accelerate_sharded": ("accelerate_sharded", None, "accelerate", True),
    "accelerate_full": ("accelerate_full", None, "accelerate", False),
}


@pytest.fixture(scope="module")
def fsdp1_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp1")
    run_distributed(save_sources, 2, str(out))
    return out


@pytest.fixture(scope="module")
def converted(fsdp1_run, tmp_path_factory) -> dict[str, Path]:
    """Every source converted, half through the API, half through the command line; name -> target root."""
    root = tmp_path_factory.mktemp("converted")
    roots = {}
    for name, (path, optim, fmt, cli) in SOURCES.items():
        roots[name] = root / name
        source, optim_file = fsdp1_run / path, (fsdp1_run / optim if optim else None)
        if not cli:
            result = f2.convert_fsdp1_checkpoint(source, roots[name], optimizer_file=optim_file, progress=False)
            assert (result.source_format, result.step, result.tensors, result.optimizer_params) == (fmt, 3, 29, 26)
            continue
        args = ["convert-fsdp1", str(source), str(roots[name]), "--no-progress"]
        args += ["--optimizer-file", str(optim_file)] if optim_file else []
        args += ["--model", "helpers.deepspeed_models:make_model"] if name == "lightning_full" else []
        assert main(args) == 0
    return roots


def _scheduler_state(extra: dict, reference: dict) -> dict:
    """The scheduler as the source kept it (a torch full save keeps none: the run's own is used)."""
    if extra.get("lr_scheduler") is not None:
        return extra["lr_scheduler"]
    return extra.get("source_state", {}).get("scheduler") or reference["at_save"]["scheduler"]


def _snapshot(model, optimizer, scheduler) -> dict:
    return {**snapshot(model, optimizer), "lr": scheduler.get_last_lr()[0]}


def _continue(roots: dict, reference: dict) -> dict:
    """On every rank: each converted checkpoint loaded into a sharded model, M more steps; rank 0 returns
    the full parameters and moments."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    results = {}
    for name, root in roots.items():
        model = f2.shard_model(make_model(), log_plan=False)
        optimizer = make_optimizer(model)
        scheduler = make_scheduler(optimizer)
        extra = f2.Checkpointer(root).load(model=model, optimizer=optimizer)
        scheduler.load_state_dict(_scheduler_state(extra, reference))
        for step in range(K_STEPS, K_STEPS + M_STEPS):
            idx, tgt = batch_for(step, rank, world)
            lm_loss(model, idx, tgt).backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        snapshot = _snapshot(model, optimizer, scheduler)  # collective: every rank gathers
        results[name] = snapshot if rank == 0 else None
    return results


@pytest.fixture(scope="module")
def continued(fsdp1_run, converted) -> dict:
    reference = torch.load(fsdp1_run / "reference.pt", weights_only=False)
    roots = {name: str(root) for name, root in converted.items()}
    return {world: run_distributed(_continue, world, roots, reference)[0] for world in (1, 2)}


@pytest.mark.parametrize("name", SOURCES)
def test_converted_state_is_fsdp1s_at_the_save(fsdp1_run, converted, name):
    reference = torch.load(fsdp1_run / "reference.pt", weights_only=False)["at_save"]
    model = make_model()
    optimizer = make_optimizer(model)
    make_scheduler(optimizer)  # adds `initial_lr` to the groups, which the load then asks for
    extra = f2.Checkpointer(converted[name]).load(model=model, optimizer=optimizer, step=K_STEPS)
    names = {p: n for n, p in model.named_parameters()}
    got = {
        "param": {n: p.detach() for p, n in names.items()},
        **{k: {names[p]: s[k] for p, s in optimizer.state.items()} for k in ("exp_avg", "exp_avg_sq")},
    }
    assert worst_difference(got, reference)[0] == 0.0  # bit for bit
    assert model.head.weight is model.tok.weight  # tied names came back as one parameter
    assert optimizer.param_groups[0]["lr"] == pytest.approx(reference["lr"])
    assert all(state["step"].item() == K_STEPS for state in optimizer.state.values())
    assert extra["fsdp1"]["format"] == SOURCES[name][2]
    assert extra["fsdp1"]["source_world_size"] == (2 if "sharded" in name else None)
    assert _scheduler_state(extra, {"at_save": reference})["last_epoch"] == K_STEPS
    if name.startswith(("lightning", "accelerate")):
        assert extra["global_step"] == K_STEPS and extra["lr_scheduler"]["last_epoch"] == K_STEPS
    if name.startswith("lightning"):
        assert extra["epoch"] == 1 and "loops" in extra["lightning"]
    if name == "torch_sharded":
        assert extra["source_state"]["step"] == K_STEPS


@pytest.mark.parametrize("world", (1, 2))
@pytest.mark.parametrize("name", SOURCES)
def test_training_continues_as_fsdp1_would(fsdp1_run, continued, name, world):
    reference = torch.load(fsdp1_run / "reference.pt", weights_only=False)["continued"]
    got = continued[world][name]
    worst, where = worst_difference(got, reference)
    assert worst < TOLERANCE, f"{name} resumed on {world} rank(s): {where} differs by {worst:.2e} (relative)"
    assert got["lr"] == pytest.approx(reference["lr"], rel=1e-12)


# ---------------------------------------------------------------------- names, positions, refusals
def _rename(path: Path, dest: Path, rename) -> Path:
    """A copy of full model file `path` with every key passed through `rename`."""
    torch.save({rename(k): v for k, v in torch.load(path).items()}, dest)
    return dest


def test_wrapper_prefixes_are_dropped(fsdp1_run, tmp_path):
    """Names saved through FSDP1's or activation checkpointing's wrappers load under the model's names."""

    def wrapped(name: str) -> str:
        return "_fsdp_wrapped_module." + name.replace("blocks.0.", "blocks.0._checkpoint_wrapped_module.")

    model_file = _rename(fsdp1_run / "torch_full/model.pt", tmp_path / "model.pt", wrapped)
    optim = torch.load(fsdp1_run / "torch_full/optim.pt")
    optim["state"] = {wrapped(k): v for k, v in optim["state"].items()}
    optim["param_groups"][0]["params"] = [wrapped(p) for p in optim["param_groups"][0]["params"]]
    torch.save(optim, tmp_path / "optim.pt")
    f2.convert_fsdp1_checkpoint(model_file, tmp_path / "out", optimizer_file=tmp_path / "optim.pt", progress=False)
    model = make_model()
    f2.Checkpointer(tmp_path / "out").load(model=model, optimizer=make_optimizer(model))


def test_positions_need_the_model_when_the_order_differs(fsdp1_run, tmp_path):
    """Lightning's full checkpoint keys its optimizer state by position: a buffer before the parameters
    shifts the state dict's order, which the shape check catches; the model names the positions."""
    checkpoint = torch.load(fsdp1_run / "lightning_full.ckpt", weights_only=False)
    checkpoint["state_dict"] = {"scale": torch.ones(64, 32), **checkpoint["state_dict"]}
    torch.save(checkpoint, tmp_path / "shifted.ckpt")
    with pytest.raises(ValueError, match=r"keyed by position .* pass the model \(model="):
        f2.convert_fsdp1_checkpoint(tmp_path / "shifted.ckpt", tmp_path / "out", progress=False)
    result = f2.convert_fsdp1_checkpoint(tmp_path / "shifted.ckpt", tmp_path / "out", model=make_model())
    assert result.optimizer_params == 26 and result.tensors == 30


def test_refusals_name_the_file_and_the_fix(fsdp1_run, tmp_path):
    full = fsdp1_run / "torch_full"
    with pytest.raises(FileNotFoundError, match="FSDP1 checkpoint .*missing does not exist"):
        f2.convert_fsdp1_checkpoint(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"neither a DCP folder .* found: \['notes.txt'\]"):
        f2.convert_fsdp1_checkpoint(tmp_path / "other", tmp_path / "out")
    with pytest.raises(ValueError, match=r"holds no optimizer state .*optimizer_file= / --optimizer-file"):
        f2.convert_fsdp1_checkpoint(full / "model.pt", tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written by a refused conversion

    flat = torch.load(full / "optim.pt")
    flat["state"]["pos"]["exp_avg"] = flat["state"]["pos"]["exp_avg"].flatten()
    torch.save(flat, tmp_path / "flat.pt")
    with pytest.raises(
        ValueError, match=r"optimizer state state.pos.exp_avg has shape \(512,\).*FSDP.optim_state_dict"
    ):
        f2.convert_fsdp1_checkpoint(full / "model.pt", tmp_path / "out", optimizer_file=tmp_path / "flat.pt")

    other = _rename(full / "model.pt", tmp_path / "other_model.pt", lambda k: f"module.{k}")
    with pytest.raises(ValueError, match=r"parameters \['blocks.0.attn.proj.bias'.* are not in the model state"):
        f2.convert_fsdp1_checkpoint(other, tmp_path / "out", optimizer_file=full / "optim.pt")

    weights = f2.convert_fsdp1_checkpoint(full / "model.pt", tmp_path / "out", weights_only=True, progress=False)
    assert (weights.step, weights.optimizer_params) == (0, 0)
    model = make_model()
    with pytest.raises(ValueError, match="no optimizer state under 'optim'"):
        f2.Checkpointer(tmp_path / "out").load(model=model, optimizer=make_optimizer(model))
    with pytest.raises(ValueError, match="step-000000 already exists"):
        f2.convert_fsdp1_checkpoint(full / "model.pt", tmp_path / "out", weights_only=True)
    assert main(["convert-fsdp1", str(tmp_path / "other"), str(tmp_path / "cli")]) == 2  # a message, no traceback
    shutil.rmtree(tmp_path / "out")


def test_a_file_that_runs_code_is_refused_and_trust_converts_it(fsdp1_run, tmp_path):
    """A Lightning checkpoint file carrying a pickle that runs code (as a hyperparameter can): refused
    naming the file, the type and the switch, nothing run or written; `trusted=True` / `--trust` convert
    it. Lightning's, Accelerate's and torch's own files are read as data: the fixture converts them all."""
    marker, crafted = tmp_path / "ran", tmp_path / "crafted.ckpt"
    shutil.copy(fsdp1_run / "lightning_full.ckpt", crafted)
    plant(crafted, marker, checksums=False)
    assert_refused_then_trusted(f2.convert_fsdp1_checkpoint, "convert-fsdp1", crafted, marker)


# ---------------------------------------------------------------------- resumed by the trainers
@pytest.mark.parametrize("trainer, source", [("lightning", "lightning_sharded"), ("hf", "accelerate_sharded")])
def test_the_trainers_resume_a_converted_fsdp1_step_where_fsdp1_would_continue(
    fsdp1_run, converted, trainer, source, tmp_path
):
    """Lightning's FSDPStrategy folder converted, then `fit(ckpt_path=<the step>)`; Accelerate's FSDP1
    `save_state` folder converted, then `FSDP2Trainer.train(resume_from_checkpoint=<the step>)`; on 2
    ranks: the global step continues from K and M more steps follow FSDP1's own continuation. The
    fixture's Lightning source keeps a minimal loop state (not all a fit loop saves): the loops restart
    from the step's counters, with a warning, instead of failing inside Lightning's loop loading."""
    from helpers.trainer_resume import LIGHTNING_ENV, hf_continue, lightning_continue

    step_dir = str(next(Path(converted[source]).glob("step-*")))
    if trainer == "lightning":
        got = run_distributed(lightning_continue, 2, step_dir, K_STEPS, env=LIGHTNING_ENV, timeout=240)[0]
        got = {
            k: {n.removeprefix("model."): t for n, t in v.items()} if isinstance(v, dict) else v for k, v in got.items()
        }
    else:
        got = run_distributed(hf_continue, 2, step_dir, K_STEPS, str(tmp_path), timeout=240)[0]
    reference = torch.load(fsdp1_run / "reference.pt", weights_only=False)["continued"]
    assert got["steps"] == list(range(K_STEPS, K_STEPS + M_STEPS)) and got["global_step"] == K_STEPS + M_STEPS
    worst, where = worst_difference({k: got[k] for k in ("param", "exp_avg", "exp_avg_sq")}, reference)
    assert worst < TOLERANCE, f"{trainer} resumed the converted step: {where} differs by {worst:.2e} (relative)"
    assert got["lr"] == pytest.approx(reference["lr"], rel=1e-12)


def test_a_kept_lightning_loop_state_is_used_only_when_it_is_complete():
    """`fit(ckpt_path=<converted step>)` hands Lightning the source's own loop state when it has every
    entry this Lightning's fit loop saves, else loops rebuilt at the step's counters (and says so)."""
    import lightning.pytorch as pl

    from fsdp2_strategy.integrations.lightning.converted import lightning_state

    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    complete = trainer.fit_loop.state_dict()
    complete["epoch_loop.state_dict"]["_batches_that_stepped"] = 7
    kept = {"loops": {"fit_loop": complete}, "epoch": 2, "global_step": 7, "callbacks": {"c": 1}}
    assert lightning_state(trainer, {"lightning": kept, "global_step": 7})["loops"]["fit_loop"] is complete
    minimal = {**kept, "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 1}}}}}
    with pytest.warns(UserWarning, match="loops restart at its global step 3 and epoch 1"):
        state = lightning_state(trainer, {"lightning": minimal, "global_step": 3, "epoch": 1})
    fit_loop = state["loops"]["fit_loop"]
    assert fit_loop["epoch_loop.state_dict"]["_batches_that_stepped"] == 3 and state["callbacks"] == {"c": 1}

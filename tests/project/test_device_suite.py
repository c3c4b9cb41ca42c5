"""`benchmarks/device_suite.py --dry-run`: every part of the GPU run, on CPU with tiny sizes, so the
one command a GPU session runs does not rot between the sessions that have a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import ROOT
from helpers.harness import launch

SUITE = ROOT / "benchmarks" / "device_suite.py"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("suite")
    launch("python", SUITE, "--dry-run", "--out", out, "--budget", "600", cwd=ROOT, timeout=900)
    return json.loads((out / "device_suite.json").read_text()), out


def test_every_part_ran_and_left_its_files(dry_run):
    results, out = dry_run
    assert list(results["parts"]) == [
        "tests",
        "throughput",
        "levers",
        "compile",
        "float8",
        "float8_sweep",
        "checkpoint",
        "generation",
        "planner",
        "largest",
        "qlora",
        "deepspeed",
    ]
    failed = {name: part.get("error") or part.get("not_run") for name, part in results["parts"].items()}
    assert all("result" in part for part in results["parts"].values()), failed
    env = results["environment"]
    assert env["versions"]["torch"] and env["date"] and "--dry-run" in env["command"]
    assert env["peak_flops"]["measured"]["flops"] > 0 and env["peak_flops"]["table"] is None  # a CPU: measured only
    text = (out / "device_suite.txt").read_text()
    for name in results["parts"]:
        assert f"## {name}" in text
    assert "test_device.py" in (out / "tests.log").read_text()


def test_the_device_tests_are_collected_and_skip_without_an_accelerator(dry_run):
    tests = dry_run[0]["parts"]["tests"]["result"]
    assert tests["returncode"] == 0 and "skipped" in tests["summary"]
    assert len(tests["outcomes"]) == 5 and all(o.endswith("SKIPPED") for o in tests["outcomes"]), tests["outcomes"]


def test_every_training_path_trains_the_same_model(dry_run):
    result = dry_run[0]["parts"]["throughput"]["result"]
    rows = {row["path"]: row for row in result["rows"]}
    assert set(rows) == {
        "hand",
        "core",
        "lightning_fsdp2",
        "lightning_model_parallel",
        "fsdp2_accelerator",
        "stock_accelerator",
        "hf_trainer_fsdp2",
        "hf_trainer_stock",
    }
    assert all("error" not in row for row in rows.values()), {p: r.get("error") for p, r in rows.items()}
    params = {row["params"] for row in rows.values()}
    assert len(params) == 1, params
    # One model, one seed, one batch: our paths start at the hand-written loop's loss (Lightning's
    # bf16-mixed adds autocast; the HF Trainer shuffles its data, so neither is compared).
    assert rows["core"]["first_loss"] == pytest.approx(rows["hand"]["first_loss"], rel=1e-3)
    assert rows["fsdp2_accelerator"]["first_loss"] == pytest.approx(rows["hand"]["first_loss"], rel=1e-3)
    # Every path but the stock Accelerate ones shards (on CPU those leave the model as it is).
    for path in ("core", "lightning_fsdp2", "lightning_model_parallel", "fsdp2_accelerator", "hf_trainer_fsdp2"):
        assert rows[path]["sharded_params"] == rows["hand"]["sharded_params"] > 0, path
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] and row["vs_hand"] > 0
    assert rows["hand"]["vs_hand"] == 1.0


def test_levers_part_measures_the_chunked_loss_alone(dry_run):
    rows = {row["path"]: row for row in dry_run[0]["parts"]["levers"]["result"]["rows"]}
    assert set(rows) == {"hand", "core", "core+own_loss", "core+fused_adamw", "core+max_batch"}
    assert all("error" not in row for row in rows.values()), rows
    # The same model, seed and batch: the chunked loss (core) starts where the model's own loss does.
    assert rows["core"]["first_loss"] == pytest.approx(rows["core+own_loss"]["first_loss"], rel=1e-3)
    assert rows["core+own_loss"]["first_loss"] == pytest.approx(rows["hand"]["first_loss"], rel=1e-3)
    # Each lever against the plain hand-written loop (not a "hand+own_loss" that does not exist).
    for path in ("core", "core+own_loss", "core+fused_adamw", "core+max_batch"):
        assert rows[path]["vs_hand"] == rows[path]["tokens_per_s"] / rows["hand"]["tokens_per_s"], path
    # The planner's largest batch: on this CPU the RAM holds the cap, 4x the tiny size's 2 rows.
    assert rows["core+max_batch"]["batch"] == 8 and rows["core"]["batch"] == 2
    assert rows["core+max_batch"]["tokens_per_s"] == 8 * 64 / rows["core+max_batch"]["step_s"]


def test_compiled_paths_and_float8_status(dry_run):
    result = dry_run[0]["parts"]["compile"]["result"]
    assert {row["path"] for row in result["rows"]} == {"hand+compile", "core+compile"}
    assert all("error" not in row for row in result["rows"])
    rows = {row["path"]: row for row in result["rows"]}  # each against the hand-written loop compiled too
    assert rows["hand+compile"]["vs_hand"] == 1.0
    assert (
        rows["core+compile"]["vs_hand"] == rows["core+compile"]["tokens_per_s"] / rows["hand+compile"]["tokens_per_s"]
    )
    # float8 is a part of its own (one round, so the compiled pair keeps its rounds): not run without
    # torchao or a GPU with float8 tensor cores, and saying which.
    for part in ("float8", "float8_sweep"):
        float8 = dry_run[0]["parts"][part]["result"]
        assert float8["not_run"].startswith(("torchao is not installed", "float8 matrix products need")), float8
    assert "not run: " + float8["not_run"] in (dry_run[1] / "device_suite.txt").read_text()


def test_checkpoint_stall_and_overhead_per_mode(dry_run):
    result = dry_run[0]["parts"]["checkpoint"]["result"]
    assert set(result["modes"]) == {"sync", "async", "overlap"}
    assert result["saved_bytes"] > 0 and result["sync_save_s"] > 0
    assert result["modes"]["sync"]["stall_over_sync_save"] >= 1.0  # a sync save blocks for all of itself
    assert result["holds_state_at_save"] == {"async": True, "overlap": True}  # loaded back after 2 more steps
    assert "checkpointer.py" in result["overlap_save_profile"]  # where the overlap save()'s blocking went
    assert "(save)" in result["overlap_save_profile"]


def test_generation_rows(dry_run):
    rows = {r["run"]: r for r in dry_run[0]["parts"]["generation"]["result"]["rows"]}
    assert list(rows) == ["sharded", "sharded, f2.gathered", "unsharded copy"]
    assert all(r["same_tokens"] for r in rows.values())  # greedy: every run the unsharded model's tokens
    assert rows["unsharded copy"]["vs_unsharded"] == 1.0
    # Gathered once, before generate; generate's synced_gpus defaults to False inside: no collective.
    assert rows["sharded, f2.gathered"]["all_gathers_per_token"] == 0
    assert rows["sharded, f2.gathered"]["other_collectives_per_token"] == 0
    assert len(dry_run[0]["parts"]["generation"]["result"]["gathered_vs_unsharded"]) == 1  # one rank on the device


def test_planner_rows_against_measured_peaks(dry_run):
    rows = dry_run[0]["parts"]["planner"]["result"]
    assert [r["setting"] for r in rows] == [
        "FULL_SHARD",
        "SHARD_GRAD_OP",
        "NO_SHARD",
        "FULL_SHARD+AC",
        "FULL_SHARD+offload",
        "keep_gathered k=2",
    ]
    for r in rows:
        assert r["estimate"] > 0 and r["measured"] > 0
        assert r["error"] == pytest.approx(r["estimate"] / r["measured"] - 1)


def test_largest_model_predicted_then_run(dry_run):
    result = dry_run[0]["parts"]["largest"]["result"]
    assert set(result) == {"FULL_SHARD", "FULL_SHARD+AC", "FULL_SHARD+offload"}
    for setting, row in result.items():
        budget = row["budget"]
        predicted = row["predicted_largest"]
        assert predicted is not None and row["estimates"][predicted] <= budget, setting
        sizes = list(row["estimates"])
        if predicted != sizes[-1]:
            assert row["estimates"][sizes[sizes.index(predicted) + 1]] > budget
        assert row["runs"] and row["runs"][0]["size"] == predicted and row["runs"][0]["fits"], row["runs"]


def test_qlora_unsharded_and_sharded_train_the_same_4bit_model(dry_run):
    result = dry_run[0]["parts"]["qlora"]["result"]
    runs = result["runs"]
    assert all("error" not in r for r in runs.values()), runs
    unsharded, sharded = runs["unsharded"], runs["sharded"]
    # A world of one holds the whole packed base: the same bytes as bitsandbytes' own layers.
    assert sharded["quantised_bytes"] == unsharded["quantised_bytes"] > 0
    assert sharded["trainable"] == unsharded["trainable"] > 0
    # One seed, one batch: the first loss agrees (bf16 compute on both paths).
    assert sharded["losses"][0] == pytest.approx(unsharded["losses"][0], rel=1e-2)
    assert result["estimate"]["peak_bytes"] > 0 and result["step_ratio"] > 0


def test_the_deepspeed_part_names_what_to_carry_where_deepspeed_is_absent(dry_run):
    """The project's environment has no DeepSpeed (it would change how Accelerate and transformers
    behave); the part says how to bring it. Where it is importable, tests/core/migrate runs the part."""
    assert dry_run[0]["parts"]["deepspeed"]["result"] == {
        "not_run": "DeepSpeed is not importable (carry it and put it on PYTHONPATH)"
    }

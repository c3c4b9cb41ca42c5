"""Accelerate adapter: `accelerate launch --config_file` runs on 2 CPU processes, a 1-process resume,
and unit tests of the config mapping and of the private-API guard.

The scripts in tests/accelerate_scripts/ measure and write JSON; the assertions live here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from _collect import close_lists, max_rel_diff  # noqa: E402
from _harness import agreed_report, assert_no_flow_failed, launch, rank_reports  # noqa: E402
from _precision import TIED_TOL  # noqa: E402

from fsdp2_strategy.integrations.accelerate import (  # noqa: E402
    FSDP2Accelerator,
    FSDP2Plugin,
    read_accelerate_env,  # noqa: E402
)
from fsdp2_strategy.integrations.accelerate import _compat as compat  # noqa: E402
from fsdp2_strategy.integrations.accelerate.env import accelerate_cpu_requested  # noqa: E402
from fsdp2_strategy.integrations.accelerate.plugin import STOCK_ACCELERATOR_ERROR  # noqa: E402

SCRIPTS = Path(__file__).parent / "accelerate_scripts"
PER_RANK = [
    "overlap_save.returned",  # seconds, each rank's own
    "overlap_save.waited",
    # Rank 0 alone reads the files it wrote (the other ranks report none of these):
    "checkpoints.export_diff",
    "checkpoints.merged_equal",
    "checkpoints.merged_keys_match",
    "hf_export.logits_rel",
    "hf_export.state_diff",
    "hf_export.weight_diff",
    "peft_lora.merged_rel",
    "peft_lora.peft_recipe_rel",
    "peft_lora.peft_save_model_rel",
    "rank0_loading.diff",
    "launch_variant.fp32_loss",
    "launch_variant.update_rel",
]
"""Report values that differ between ranks by nature ("flow.key"); every other value must agree on both."""
TOL = 1e-5  # fp32 parity, relative


def _load(path: Path) -> dict:
    out = json.loads(path.read_text())
    assert_no_flow_failed(out)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """fsdp2.yaml (every flow) -> one process resuming its checkpoints (and saving one) -> fsdp2_variant.yaml
    (which also resumes that one on 2 processes)."""
    work = tmp_path_factory.mktemp("accelerate")
    launch("accelerate", "flows.py", work / "flows.json", work, cwd=SCRIPTS, config=SCRIPTS / "fsdp2.yaml")
    launch("python", "resume.py", work / "resume.json", work / "state_step2", work, cwd=SCRIPTS, timeout=120)
    # The same resume as a 1-process `accelerate launch` (torchrun's agent store: env://).
    launch(
        "accelerate",
        "resume.py",
        work / "resume_launched.json",
        work / "state_step2",
        cwd=SCRIPTS,
        config=SCRIPTS / "fsdp2.yaml",
        nproc=1,
        timeout=120,
    )
    launch(
        "accelerate",
        "flows.py",
        work / "variant.json",
        work / "variant",
        "config_from_launch,launch_variant,resume_from_one",
        cwd=SCRIPTS,
        config=SCRIPTS / "fsdp2_variant.yaml",
    )
    return {
        "flows": agreed_report(rank_reports(work / "flows.json", 2), PER_RANK),
        "resume": _load(work / "resume.json"),
        "resume_launched": _load(work / "resume_launched.json"),
        "variant": agreed_report(rank_reports(work / "variant.json", 2), PER_RANK),
    }


def _close(a: list[float], b: list[float], tol: float = TOL) -> bool:
    return close_lists(a, b, tol)


# ---------------------------------------------------------------------------------------- launch runs
def test_config_file_keys_reach_the_core(runs):
    std, var = runs["flows"]["config_from_launch"], runs["variant"]["config_from_launch"]
    assert std["wrap_policy"] == ["Block"] and std["reshard_after_forward"] is True
    assert std["cpu_offload"] is False and std["activation_checkpointing"] is None and std["mixed_precision"] is None
    assert var["wrap_policy"] == 10000 and var["reshard_after_forward"] is False and var["cpu_offload"] is True
    assert var["activation_checkpointing"] == "auto" and var["mixed_precision"] == "bf16"
    for r in (std, var):  # real FSDP on gloo, where stock Accelerate would run DDP
        assert r["distributed_type"] == "DistributedType.FSDP" and r["is_fsdp2"] and r["num_processes"] == 2
        assert r["backend"] == "gloo"
    assert var["accelerator_precision"] == "bf16" and std["accelerator_precision"] == "no"


def test_stock_accelerator_refuses_the_plugin_by_name(flows):
    assert flows["config_from_launch"]["stock_error"] == STOCK_ACCELERATOR_ERROR


def test_variant_config_file_trains_with_every_value(runs):
    r = runs["variant"]["launch_variant"]
    assert r["groups"] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]  # SIZE_BASED_WRAP 10000: each block
    assert r["offload"] == [True] and r["reshard"] == ["False"] and r["precision"] == ["bf16/fp32"]
    assert r["mlp_forward_calls"] == 2  # activation checkpointing recomputes the block in backward
    assert "model.safetensors" in r["listing"]  # FULL_STATE_DICT
    # Rank 0's real weights reached every shard (rank 1 built on meta): bf16 step close to fp32.
    assert abs(r["loss"] - r["fp32_loss"]) / r["fp32_loss"] < 1e-2 and r["update_rel"] < 2e-2


def test_prepare_shards_and_matches_one_process(flows):
    r = flows["parity"]
    assert r["root_is_fsdp"] and r["groups"] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
    assert r["optimizer_params_dtensor"]  # built before prepare, rebound to the shards
    assert r["indices"] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the prepared DataLoader splits the batch
    assert r["grad_rel"] < TOL and r["param_rel"] < TOL
    assert r["after_prepare_param_rel"] < TOL  # the other order: optimizer built after prepare(model)


def test_plugin_keywords_offload_and_checkpointing(flows):
    r = flows["variants"]
    assert r["offload"] == [True] and r["param_rel"] < TOL


def test_accumulate_skips_reduce_scatter_until_the_last_micro_batch(flows):
    r = flows["accumulation"]
    assert r["micro_batches"] == 2 and r["sync_gradients"] == [False, True]
    assert r["reduce_scatters_after_each_backward"] == [0, r["groups"]]  # one per group, on the last only
    assert r["reduce_scatters_two_plain_backwards"] == 2 * r["groups"]
    assert r["param_rel"] < TOL


def test_a_deepspeed_launch_trains_on_this_engine(flows):
    r = flows["deepspeed_launch"]
    assert r["strategies"] == ["SHARD_GRAD_OP"] and r["param_rel"] < TOL, r
    assert r["use_deepspeed_after"] == "true"  # hidden from Accelerate only while it was built


def test_log_throughput_every_reports_through_the_trackers_on_the_main_process(flows):
    r = flows["throughput_logging"]
    main, other = r["rows"]
    assert other == []  # Accelerator.log: the main process only
    # 5 optimizer steps: the first starts the clock, then a report every 2 (optimizer steps 3 and 5).
    assert [step for step, _ in main] == [3, 5] and r["last_step"] == 5
    for _, m in main:
        assert set(m) == {
            "throughput/tokens_per_s",
            "throughput/step_time_s",
            "throughput/mfu",
            "throughput/peak_memory_gib",
        }
        # 4 sequences of 16 tokens a step on this rank, counted by the model's forward.
        assert m["throughput/tokens_per_s"] * m["throughput/step_time_s"] == pytest.approx(64)
        assert 0 < m["throughput/mfu"] < 1  # against the CPU's measured peak
    assert r["pending_after_eval"] == 0  # a forward under no_grad counts no training tokens


def test_accumulation_modes_through_accumulate(flows):
    r = flows["accumulation_modes"]
    kept, each = r["keep_gathered"], r["sync_each_batch"]
    # keep_gathered: every FSDP group reduce-scattered once and all-gathered once per optimizer step,
    # plus the one-time gather of every group before the first unsynchronised backward.
    assert kept["mode"] == "keep_gathered" and kept["all_gathers"] == 2 * kept["reduce_scatters"] > 0
    # sync_each_batch=True is "sync_each": a reduce-scatter per group on both micro-batches.
    assert each["mode"] == "sync_each" and each["reduce_scatters"] == 2 * kept["reduce_scatters"]
    assert each["all_gathers"] > kept["all_gathers"]
    assert kept["param_rel"] < TOL and each["param_rel"] < TOL
    assert "sync_each_batch=True" in r["conflict_error"] and "accumulation='keep_gathered'" in r["conflict_error"]
    # Accelerate's RegressionModel scalars (replicated by the core) follow sync_each too: averaged on the
    # first micro-batch already, equal on every rank and to one process (its test_sync.py checks this).
    scalars = r["scalar_sync_each"]
    assert not scalars["sync_step"] and scalars["grads"][0] == scalars["grads"][1]
    assert all(abs(g - w) <= 1e-6 * abs(w) for g, w in zip(scalars["grads"][0], scalars["ref"])), scalars


def test_clip_grad_norm_is_the_global_norm(flows):
    r = flows["clipping"]
    assert r["norm_is_plain"] and abs(r["norm"] - r["ref_norm"]) <= TOL * r["ref_norm"]
    assert r["param_rel"] < TOL and r["unclipped_rel"] > 1  # clipping changed the step, like one process's


def test_bf16_is_an_fsdp2_policy(flows):
    r = flows["bf16"]
    assert r["precision"] == ["bf16/fp32"] and r["accelerator_precision"] == "bf16"
    assert r["out_dtype"] == "torch.bfloat16" and r["stored_dtypes"] == r["grad_dtypes"] == ["torch.float32"]
    # One SGD step against the policy written out without the engine (tests/_precision.py: bf16 copy under
    # autocast, fp32 gradients averaged, fp32 update): untied weights up to fp32 summation order (measured
    # 3.9e-08), the tied embedding within one bf16 rounding of its gradient (4.4e-06); reductions in fp32.
    assert r["update_diff"] < TOL and r["tied_update_diff"] < TIED_TOL
    assert {d for _, d in r["reductions"]} == {"float32"} and r["reductions"]


def test_fp16_uses_the_sharded_scaler(flows):
    default, small = flows["fp16"]["default"], flows["fp16"]["init_1024"]
    for r in (default, small):
        assert r["scaler"] == "ShardedGradScaler" and r["out_dtype"] == "torch.float16"
    # 65536 x a loss of ~26 overflows fp16: every rank skips the step, the scale halves.
    assert default["skipped"] == [True, True] and default["unchanged"] and default["scale"] == 32768.0
    assert math.isinf(default["norm"])
    # GradScalerKwargs(init_scale=1024) is honoured: no step skipped, unscaled before clipping (the global
    # norm equals the policy's, measured 1e-7 relative), and the step equals the policy written out with
    # the loss scaled by 1024 (measured 7.6e-08); reductions in fp32.
    assert small["skipped"] == [False, False] and small["scale"] == 1024.0
    assert abs(small["norm"] - small["ref_norm"]) / small["ref_norm"] < TOL
    assert small["update_diff"] < TOL and small["tied_update_diff"] < TIED_TOL
    assert {d for _, d in small["reductions"]} == {"float32"}


def test_several_models_in_one_prepare(flows):
    r = flows["multi_model"]
    assert r["models"] == 2 and r["both_fsdp"] and r["a_rel"] < TOL and r["b_rel"] < TOL


def test_prepare_model_alone_for_evaluation(flows):
    r = flows["evaluation"]
    assert r["root_is_fsdp"] and r["rel"] < 1e-6
    # The forward left the root gathered; save_state resharded it: only shards remain.
    assert r["gathered_after_forward"] and r["plain_after_save"] == []


def test_save_state_load_state_resume_exactly(flows):
    r = flows["checkpoints"]
    assert _close(r["resumed"], r["continued"]) and r["lr_resumed"] == r["lr_continued"]
    for name in (
        ".metadata",
        "checksums.json",
        "__0_0.distcp",
        "__1_0.distcp",
        "scheduler.bin",
        "random_states_0.pkl",
        "random_states_1.pkl",
        "model.safetensors",
    ):
        assert name in r["listing"], name
    assert r["export_diff"] == 0.0  # state_dict_type="full": consolidated weights beside the shards
    assert not [p for p in r["parent"] + r["parent_after_resave"] if p.startswith(".tmp")]


def test_save_state_before_the_first_step_changes_nothing(flows):
    r = flows["checkpoints"]
    assert r["early_state_entries"] == 0
    assert _close(r["early_trained"], r["first"] + r["continued"])  # the same seed-9 run without that save
    assert r["early_state_after_load"] == 0 and _close(r["early_resumed"], r["first"] + r["continued"])


def test_accelerate_merge_weights_reads_the_model_view(flows):
    r = flows["checkpoints"]
    assert "pytorch_model_fsdp_0" in r["listing"]
    assert r["merged_keys_match"] and r["merged_equal"]


def test_load_state_refuses_partial_and_damaged_directories(flows):
    r = flows["checkpoints"]
    assert r["partial_error"].startswith("FileNotFoundError") and "not a committed" in r["partial_error"]
    assert r["damaged_error"].startswith("ValueError") and "__1_0.distcp" in r["damaged_error"]
    assert "checksum" in r["damaged_error"]


def test_automatic_naming_keeps_the_newest(flows):
    assert flows["checkpoints"]["auto_listing"] == ["checkpoint_1", "checkpoint_2"]
    assert flows["checkpoints"]["auto_after_resume"] == "checkpoint_3"


def test_auto_strategy_picks_what_the_planner_picks_for_the_budget(flows):
    """FSDP2Plugin(sharding_strategy="auto", memory_budget=B) under accelerate launch: the core
    planner's choice for B reaches the prepared model and trains like one process; a budget below
    every estimate fails in `prepare` with the planner's error naming memory_budget."""
    r = flows["auto_strategy"]
    est = r["estimates"]
    assert est["FULL_SHARD"] < est["SHARD_GRAD_OP"] < est["NO_SHARD"]
    full, zero2 = r["FULL_SHARD"], r["SHARD_GRAD_OP"]
    assert full["strategies"] == ["FULL_SHARD"] and full["mesh_shapes"] == ["(2,)"]
    assert [full["reshard"][f"blocks.{i}"] for i in range(8)] == [True] * 7 + [False]  # the last block stays
    assert zero2["strategies"] == ["SHARD_GRAD_OP"] and set(zero2["reshard"].values()) == {False}
    assert r["FULL_SHARD_plugin_reshard"] is None  # unknown until prepare picks
    assert full["param_rel"] < TOL and zero2["param_rel"] < TOL
    assert r["too_small_error"] and "sharding_strategy='auto'" in r["too_small_error"]
    assert "smallest peak" in r["too_small_error"] and "memory_budget" in r["too_small_error"]


def test_throughput_objective_tunes_on_the_prepared_loader_and_caches_the_pick(flows):
    """FSDP2Plugin(sharding_strategy="auto", objective="throughput"): prepare(model, optimizer, loader)
    tunes on the loader's first batch, caches the pick, shards with it on both ranks and trains like
    one process; prepare(model) without a loader names what to pass."""
    t = flows["auto_strategy"]["throughput"]
    assert t["rows"][:2] == ["FULL_SHARD/blocks", "FULL_SHARD/one group"]  # the default candidates, measured
    picked = t["entry"]["changes"]
    assert t["strategies"] == [picked["sharding_strategy"]]
    assert (t["groups"] == ["<root>"]) == ("wrap_policy" in picked and picked["wrap_policy"] is None)
    assert t["every_rank"][0] == t["every_rank"][1]
    assert t["param_rel"] < TOL
    assert "prepare(model, optimizer, train_dataloader)" in t["no_loader_error"]


def test_auto_strategy_with_parallelism_config_is_refused_by_name():
    from accelerate.parallelism_config import ParallelismConfig

    from fsdp2_strategy.integrations.accelerate.parallelism import apply_parallelism_config

    plugin = FSDP2Plugin(read_env=False, sharding_strategy="auto", memory_budget="1GiB")
    with pytest.raises(ValueError, match="sharding_strategy='auto'.*ParallelismConfig"):
        apply_parallelism_config(plugin.fsdp2_config, ParallelismConfig(dp_shard_size=2), 2)


def _state_rel(a: dict, b: dict) -> float:
    """Largest relative difference of parameters and momentum between two `resume_flows.record`s."""
    return max(
        max_rel_diff({k: torch.tensor(v) for k, v in a[part].items()}, {k: torch.tensor(v) for k, v in b[part].items()})
        for part in ("params", "momentum")
    )


def test_resume_on_another_number_of_processes_with_split_batches(runs):
    """2 -> 1 and 1 -> 2 (onto the variant config's layout) from a save_state in the middle of epoch 1,
    with split_batches=True (the global batch is the loader's batch on any number of processes): the
    restored scheduler and Progress, set_epoch and skip_first_batches give the resumed steps the step
    numbers, learning rates and samples of the uninterrupted run, and the same parameters and momentum."""
    one, from_two = runs["resume"]["other_world_sizes"]["one"], runs["resume"]["other_world_sizes"]["from_two"]
    two, from_one = runs["flows"]["resume_on_two"]["two"], runs["variant"]["resume_from_one"]["from_one"]
    assert (one["processes"], two["processes"], from_one["processes"], from_two["processes"]) == (1, 2, 2, 1)
    assert one["samples"] == two["samples"] and one["lrs"] == two["lrs"]  # the same global batches anywhere
    assert len({tuple(s) for s in one["samples"]}) == 8 and one["steps"] == list(range(8))
    for resumed, uninterrupted in ((from_one, two), (from_two, one)):
        assert resumed["steps"] == uninterrupted["steps"][6:] == [6, 7]
        assert resumed["lrs"] == uninterrupted["lrs"][6:]
        assert resumed["samples"] == uninterrupted["samples"][6:]
        assert _state_rel(resumed, uninterrupted) < TOL


def test_resume_on_one_process_with_per_process_batches_continues_at_the_same_sample(runs):
    """Accelerate's default (split_batches=False): a batch of 4 per process, so 8 per step on 2 and 4
    on 1, and the scheduler steps once per process per optimizer step. 2 -> 1 from sample 48 continues
    at sample 48 with the learning rate and samples the uninterrupted 1-process run had at each sample
    position (it trains with the smaller global batch, so its parameters follow neither run)."""
    r = runs["resume"]["other_world_sizes"]
    one, resumed = r["one_default"], r["from_two_default"]
    two = runs["flows"]["resume_on_two"]["two_default"]
    assert two["positions"] == list(range(0, 64, 8)) and one["positions"] == list(range(0, 64, 4))
    assert resumed["positions"] == [48, 52, 56, 60]
    at = {pos: (lr, samples) for pos, lr, samples in zip(one["positions"], one["lrs"], one["samples"])}
    assert [(lr, samples) for lr, samples in zip(resumed["lrs"], resumed["samples"])] == [
        at[pos] for pos in resumed["positions"]
    ]
    assert two["lrs"][6] == one["lrs"][12]  # the 2-process run's scheduler had stepped twice per step


@pytest.mark.parametrize("how", ["resume", "resume_launched"])
def test_two_rank_state_resumes_in_one_process(runs, how):
    """DCP reshards the 2-rank shards onto 1 process (plain `python`, or `accelerate launch` with one
    process); the losses continue as the 2-rank run did."""
    r = runs[how]
    assert r["num_processes"] == 1
    assert _close(r["resumed"], runs["flows"]["checkpoints"]["continued"])
    assert r["lr_loaded"] == runs["flows"]["checkpoints"]["lr_saved"]
    # Accelerate steps a prepared scheduler once per process (StepLR gamma 0.7): twice per step on
    # 2 ranks, once here.
    assert r["lr"][0] == pytest.approx(r["lr_loaded"][0] * 0.7**2)
    assert runs["flows"]["checkpoints"]["lr_continued"][0] == pytest.approx(r["lr_loaded"][0] * 0.7**4)


def test_save_model_loads_with_from_pretrained(flows):
    r = flows["hf_export"]
    assert r["groups"] == ["<root>", "transformer.h.0", "transformer.h.1"]  # "auto" found GPT2Block
    assert {"config.json", "model.safetensors"} <= set(r["files"])
    assert r["weight_diff"] == 0.0 and r["logits_rel"] < 1e-6
    assert r["state_sizes"] == [r["state_keys"], 0] and r["state_diff"] == 0.0  # full on rank 0 only


def test_cpu_ram_efficient_loading_broadcasts_rank0_weights(flows):
    r = flows["rank0_loading"]
    assert r["diff"] == 0.0 and r["meta_after"] == [False, False]


# ---------------------------------------------------------------------------------------- config mapping
ENV = {"FSDP_VERSION": "2", "ACCELERATE_MIXED_PRECISION": "no"}


@pytest.mark.parametrize(
    "env, expected",
    [
        (
            {"FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_TRANSFORMER_CLS_TO_WRAP": "GPT2Block, Block"},
            {"wrap_policy": ["GPT2Block", "Block"]},
        ),
        ({"FSDP_AUTO_WRAP_POLICY": "transformer_based_wrap"}, {"wrap_policy": "auto"}),  # _no_split_modules
        ({"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP", "FSDP_MIN_NUM_PARAMS": "5000"}, {"wrap_policy": 5000}),
        ({"FSDP_AUTO_WRAP_POLICY": "NO_WRAP"}, {"wrap_policy": None}),
        ({"FSDP_RESHARD_AFTER_FORWARD": "false"}, {"reshard_after_forward": False}),
        ({"FSDP_RESHARD_AFTER_FORWARD": "2"}, {"reshard_after_forward": 2}),
        ({"FSDP_RESHARD_AFTER_FORWARD": "NO_RESHARD"}, {"sharding_strategy": "SHARD_GRAD_OP"}),
        ({"FSDP_SHARDING_STRATEGY": "HYBRID_SHARD"}, {"sharding_strategy": "HYBRID_SHARD"}),
        ({"FSDP_OFFLOAD_PARAMS": "true"}, {"cpu_offload": True}),
        ({"FSDP_ACTIVATION_CHECKPOINTING": "true"}, {"activation_checkpointing": "auto"}),
        ({"FSDP_FORWARD_PREFETCH": "true"}, {"forward_prefetch": 1}),
        ({"ACCELERATE_MIXED_PRECISION": "bf16"}, {"mixed_precision": "bf16"}),
        ({"FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"}, {"state_dict_type": "full"}),
        ({"FSDP_CPU_RAM_EFFICIENT_LOADING": "True"}, {"cpu_ram_efficient_loading": True}),
    ],
)
def test_each_accelerate_key_maps_to_a_field(env, expected):
    got = read_accelerate_env({**ENV, **env})
    assert {k: got[k] for k in expected} == expected
    assert read_accelerate_env({}) == {}  # outside `accelerate launch`: nothing


DEEPSPEED = {
    "ACCELERATE_USE_DEEPSPEED": "true",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none",
    "ACCELERATE_GRADIENT_CLIPPING": "1.0",
    "ACCELERATE_MIXED_PRECISION": "bf16",
}


def test_a_deepspeed_launch_is_read_as_its_fsdp2_equivalent(tmp_path, caplog):
    """`distributed_type: DEEPSPEED`: the inline keys or the config file, translated by the core."""
    import logging

    with caplog.at_level(logging.INFO, logger="fsdp2_strategy"):
        got = read_accelerate_env(DEEPSPEED)
    assert got == {"sharding_strategy": "FULL_SHARD", "cpu_offload": True, "mixed_precision": "bf16"}
    assert any("zero_optimization.stage -> sharding_strategy=FULL_SHARD" in r.getMessage() for r in caplog.records)
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}}))
    file_env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(tmp_path / "ds.json")}
    assert read_accelerate_env(file_env) == {"sharding_strategy": "SHARD_GRAD_OP", "mixed_precision": "fp16"}
    with pytest.raises(FileNotFoundError, match="`deepspeed_config_file`"):
        read_accelerate_env({**file_env, "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(tmp_path / "no.json")})
    with pytest.raises(
        ValueError, match=r"ACCELERATE_DEEPSPEED_ZERO_STAGE \(accelerate config key `zero_stage`\)='three'"
    ):
        read_accelerate_env({**DEEPSPEED, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "three"})


def test_one_table_names_each_key_in_both_directions(tmp_path):
    """`keys.KEYS`: the YAML written with every listed key gives each one's variable, and an error about
    that variable names the key again; booleans read alike everywhere (DeepSpeed's switch included)."""
    import yaml

    from fsdp2_strategy.integrations.accelerate import accelerate_config_env, keys
    from fsdp2_strategy.integrations.accelerate.deepspeed_env import deepspeed_requested

    for distributed_type in ("FSDP", "DEEPSPEED"):
        config: dict = {"distributed_type": distributed_type}
        for key in keys.KEYS:
            if key.section != keys.DEEPSPEED or distributed_type == "DEEPSPEED":
                (config.setdefault(key.section, {}) if key.section else config)[key.key] = f"v-{key.key}"
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
        env = accelerate_config_env(tmp_path / "c.yaml")
        for key in keys.KEYS:
            if key.section != keys.DEEPSPEED or distributed_type == "DEEPSPEED":
                assert env[key.var] == f"v-{key.key}", key
                assert keys.where(key.var) == f"{key.var} (accelerate config key `{key.key}`)"
    assert len({k.var for k in keys.KEYS}) == len(keys.KEYS)  # no two keys share a variable
    for spelling in ("on", "Y", "1"):
        assert deepspeed_requested({"ACCELERATE_USE_DEEPSPEED": spelling}) and accelerate_cpu_requested(
            {"ACCELERATE_USE_CPU": spelling}
        )


def test_use_cpu_from_the_launcher():
    assert accelerate_cpu_requested({"ACCELERATE_USE_CPU": "True"})
    assert not accelerate_cpu_requested({"ACCELERATE_USE_CPU": "False"}) and not accelerate_cpu_requested({})


@pytest.mark.parametrize(
    "env, words",
    [
        ({"FSDP_VERSION": "1"}, ["FSDP_VERSION", "fsdp_version: 2"]),
        ({"FSDP_OFFLOAD_PARAMS": "maybe"}, ["FSDP_OFFLOAD_PARAMS", "`fsdp_offload_params`", "true or false"]),
        ({"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP"}, ["FSDP_MIN_NUM_PARAMS", "`fsdp_min_num_params`"]),
        ({"FSDP_AUTO_WRAP_POLICY": "LAMBDA"}, ["FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP"]),
        ({"FSDP_RESHARD_AFTER_FORWARD": "sometimes"}, ["`fsdp_reshard_after_forward`", "a positive int"]),
        ({"FSDP_STATE_DICT_TYPE": "LOCAL_STATE_DICT"}, ["`fsdp_state_dict_type`", "FSDP1-only"]),
        ({"ACCELERATE_MIXED_PRECISION": "fp8"}, ["`mixed_precision`", "no, bf16, fp16"]),
        ({"FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "true"}, ["FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "false"]),
    ],
)
def test_bad_accelerate_values_name_the_key(env, words):
    with pytest.raises(ValueError) as info:
        read_accelerate_env({**ENV, **env})
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_plugin_sources_in_order_env_then_config_file_then_keywords(monkeypatch, tmp_path):
    for key, value in {
        "FSDP_VERSION": "2",
        "FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP",
        "FSDP_MIN_NUM_PARAMS": "5000",
        "FSDP_OFFLOAD_PARAMS": "true",
        "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT",
    }.items():
        monkeypatch.setenv(key, value)
    yaml_file = tmp_path / "fsdp2.yaml"
    yaml_file.write_text(
        "wrap_policy: [Block]\nforward_prefetch: 2\nmodule_overrides:\n  head: {mixed_precision: fp32}\n"
    )
    plugin = FSDP2Plugin(config=str(yaml_file), forward_prefetch=3, keep_last=2)
    cfg = plugin.fsdp2_config
    assert cfg.wrap_policy == ["Block"]  # the FSDP2Config file beats the accelerate config
    assert cfg.forward_prefetch == 3  # a keyword beats both
    assert cfg.cpu_offload is True and plugin.full_state_dict  # the accelerate config where nobody else spoke
    assert "head" in cfg.module_overrides and plugin.keep_last == 2
    # Accelerate code that reads the plugin's own fields sees the same choices.
    assert plugin.transformer_cls_names_to_wrap == ["Block"] and plugin.cpu_offload is not None
    assert FSDP2Plugin(read_env=False).fsdp2_config.cpu_offload is False


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"keep_last": 0}, ["keep_last", "int >= 1"]),
        ({"state_dict_type": "local"}, ["state_dict_type", "'sharded'", "'full'"]),
        ({"cpu_ram_efficient_loading": "yes"}, ["cpu_ram_efficient_loading", "True or False"]),
        ({"wrap_policy": 3.5}, ["wrap_policy"]),
        ({"config": 42}, ["FSDP2Config, a dict or a YAML path"]),
    ],
)
def test_bad_plugin_arguments_name_the_field(kwargs, words):
    with pytest.raises(ValueError) as info:
        FSDP2Plugin(read_env=False, **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_precision_given_twice_must_agree():
    plugin = FSDP2Plugin(read_env=False, mixed_precision="bf16")
    plugin.with_precision("bf16")
    with pytest.raises(ValueError, match="conflicts with FSDP2Plugin"):
        plugin.with_precision("fp16")
    with pytest.raises(ValueError, match="no, bf16, fp16"):
        FSDP2Plugin(read_env=False).with_precision("fp8")
    unset = FSDP2Plugin(read_env=False)
    unset.with_precision("fp16")
    assert unset.accelerate_precision == "fp16"


def test_plugin_refuses_stock_accelerator_until_claimed():
    plugin = FSDP2Plugin(read_env=False)
    with pytest.raises(TypeError, match="FSDP2Accelerator"):
        _ = plugin.fsdp_version  # the first thing stock Accelerator.__init__ reads
    plugin.claim()
    assert plugin.fsdp_version == 2


def test_accelerator_refuses_other_engines_and_plugins():
    from accelerate.utils import FullyShardedDataParallelPlugin

    with pytest.raises(ValueError, match="deepspeed_plugin"):
        FSDP2Accelerator(fsdp_plugin=FSDP2Plugin(read_env=False), deepspeed_plugin=object())
    with pytest.raises(TypeError, match="needs an FSDP2Plugin"):
        FSDP2Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))


def test_quantised_model_offloaded_by_its_device_map_is_refused_as_the_stock_accelerator_does(monkeypatch):
    """An 8-bit model whose `hf_device_map` puts it on CPU (bitsandbytes without multi-backend) or disk:
    the stock `Accelerator.prepare` raises its ValueError; `FSDP2Accelerator.prepare_model` the same,
    before sharding anything."""
    from types import SimpleNamespace

    import accelerate.accelerator as stock_module
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    from fsdp2_strategy.integrations.accelerate import device_map

    def quantised(placement: dict) -> torch.nn.Module:
        model = torch.nn.Linear(2, 2)
        model.is_loaded_in_8bit, model.hf_device_map = True, placement
        return model

    ours = SimpleNamespace(device=torch.device("cpu"), distributed_type=DistributedType.FSDP)
    prepare_model = FSDP2Accelerator.prepare_model
    for module in (stock_module, device_map):
        monkeypatch.setattr(module, "is_bitsandbytes_multi_backend_available", lambda: False)
    offload = "You can't train a model that has been loaded in 8-bit or 4-bit precision with CPU or disk offload"
    try:
        with pytest.raises(ValueError, match=offload):
            Accelerator(cpu=True).prepare(quantised({"": "cpu"}))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    for placement in ({"": "cpu"}, {"": "disk"}):  # (the stock one fails on "disk" with torch's RuntimeError)
        model = quantised(placement)
        with pytest.raises(ValueError, match=offload):
            prepare_model(ours, model)
        assert not any(type(p).__name__ == "DTensor" for p in model.parameters())
    # With bitsandbytes' multi-backend a CPU placement is accepted, as by the stock one.
    monkeypatch.setattr(device_map, "is_bitsandbytes_multi_backend_available", lambda: True)
    device_map.check_quantised_device_map(quantised({"": "cpu"}), ours)
    with pytest.raises(ValueError, match="on multiple devices in any distributed mode"):
        device_map.check_quantised_device_map(quantised({"a": "cpu", "b": 0}), ours)


def test_more_processes_than_devices_is_refused_with_the_ways_out(monkeypatch):
    """2 processes on a 1-GPU node (e.g. a CPU config whose `use_cpu` the launcher dropped): a
    clear error before any process group is started, naming num_processes and the CPU switches."""
    import torch

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    with pytest.raises(RuntimeError) as err:
        FSDP2Accelerator(fsdp_plugin=FSDP2Plugin(read_env=False))
    for words in ("LOCAL_RANK=1", "1 cuda device(s)", "num_processes", "cpu=True", "ACCELERATE_USE_CPU=true"):
        assert words in str(err.value)


# ---------------------------------------------------------------------------------------- private API guard
def test_private_api_matches_installed_accelerate():
    assert compat._problems() == []
    compat.check_private_api()


def test_private_api_change_fails_loudly(monkeypatch):
    def save_accelerator_state(output_dir, models):  # a changed signature
        return None

    monkeypatch.setattr(compat, "save_accelerator_state", save_accelerator_state)
    with pytest.raises(ImportError) as info:
        compat.check_private_api()
    assert "accelerate.checkpointing.save_accelerator_state" in str(info.value)
    assert "Install accelerate>=" in str(info.value) and "tested with accelerate" in str(info.value)
    with pytest.raises(ImportError, match="_models"):
        compat.check_accelerator(object())


def test_peft_state_holds_the_adapter_and_every_save_path_loads(flows):
    r = flows["peft_lora"]
    assert r["saved_model_keys"] and all("lora_" in k for k in r["saved_model_keys"]), r["saved_model_keys"]
    assert r["fingerprint"]
    assert r["reloaded_rel"] == 0.0  # load_state of the adapter-only directory
    for key in ("peft_recipe_rel", "peft_save_model_rel", "merged_rel"):  # Accelerate's recipe; save_model; merged
        assert r[key] < TOL, (key, r[key])


def test_overlap_save_state_holds_the_saved_state_and_resumes_exactly(flows):
    r = flows["overlap_save"]
    # save_state returned before the copy ended; a step waited for it
    assert not r["copied_before_return"] and r["waited"] >= 0.45, r
    assert r["changed_by_next_step"] and not r["committed_before_end"] and r["committed_after_wait"], r
    assert r["differs"] == [] and r["resumed"] == r["continued"], r


def test_sigterm_to_one_rank_sets_the_trigger_on_every_rank(flows):
    r = flows["preemption"]
    assert r["triggers"] == [[False, False, True]] * 2 and r["committed"], r  # both ranks stop after step 3


def test_sync_each_batch_means_the_sync_each_mode():
    """GradientAccumulationPlugin(sync_each_batch=True) reduces every micro-batch: "sync_each"; it cannot
    combine with a mode that keeps parameters gathered across the step."""
    plugin = FSDP2Plugin(read_env=False)
    assert plugin.config_for(sync_each_batch=False) is plugin.fsdp2_config
    assert plugin.config_for(sync_each_batch=True).accumulation == "sync_each"
    kept = FSDP2Plugin(accumulation="keep_gathered", read_env=False)
    with pytest.raises(ValueError, match="accumulation='keep_gathered'; drop sync_each_batch"):
        kept.config_for(sync_each_batch=True)

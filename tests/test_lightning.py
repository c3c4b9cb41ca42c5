"""Lightning adapter end to end: real `Trainer` runs on 2 CPU processes (torchrun, Lightning's own
subprocess launcher, spawn) and on 1, each in a subprocess with a timeout.

The scripts in tests/lightning_scripts/ measure and write JSON; the assertions live here.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from _checks import FlowReports  # noqa: E402
from _collect import close_lists, max_rel_diff, rank_path  # noqa: E402
from _harness import free_port, launch, rank_reports  # noqa: E402

from fsdp2_strategy.integrations.lightning import FSDP2Strategy  # noqa: E402

SCRIPTS = Path(__file__).parent / "lightning_scripts"
TOL = 1e-5  # fp32 parity, relative


# Values each rank of flows.py measures on its own (the tests read them on every rank); everything
# else every rank reports alike.
PER_RANK = ["throughput_monitor.cpu_peak"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """1 process (reference + checkpoint) -> 2 ranks (all flows, resume from it) -> 1 process (resume)."""
    work = tmp_path_factory.mktemp("lightning")
    launch("python", "single.py", "train", work / "single.json", work, cwd=SCRIPTS, timeout=120)
    single_ckpt = work / "single_ckpts" / "epoch=0-step=4.ckpt"
    flows = work / "flows.json"
    launch("torchrun", "flows.py", flows, work, single_ckpt, cwd=SCRIPTS, timeout=240, reports=flows)
    resume_args = [work / "resume.json", work / "ckpts" / "epoch=0-step=4.ckpt", rank_path(flows, 0)]
    launch("python", "single.py", "resume", *resume_args, cwd=SCRIPTS, timeout=120)
    out = {name: json.loads((work / f"{name}.json").read_text()) for name in ("single", "resume")}
    # Every rank's report (a flow that raised on any rank fails here, naming it), equal on every rank.
    out["flow_ranks"] = rank_reports(flows, 2)
    out["flows"] = FlowReports(out["flow_ranks"], PER_RANK)
    out["work"] = work
    return out


def _close(a: list[float], b: list[float], tol: float = TOL) -> bool:
    return close_lists(a, b, tol)


def test_one_step_shards_by_policy_and_matches_single_process(flows):
    flows.assert_passed("one_step_parity")


def test_registry_variants_train_like_one_process(flows):
    hybrid, offload = flows["registry_variants"]["fsdp2_hybrid"], flows["registry_variants"]["fsdp2_cpu_offload"]
    assert hybrid["mesh_shapes"] == ["(1, 2)"] and hybrid["strategies"] == ["HYBRID_SHARD"]  # (nodes, devices per node)
    assert offload["offload"] == [True] and offload["mesh_shapes"] == ["(2,)"]
    assert hybrid["max_rel_diff"] < TOL and offload["max_rel_diff"] < TOL


def test_hybrid_mesh_follows_lightning_node_count():
    strategy = FSDP2Strategy(sharding_strategy="HYBRID_SHARD")
    strategy.num_nodes = 2
    strategy.parallel_devices = [None] * 4
    assert strategy._effective_config().mesh_shape == (2, 4)
    assert FSDP2Strategy(sharding_strategy="HYBRID_SHARD", mesh_shape=(1, 8))._effective_config().mesh_shape == (1, 8)


def test_accumulation_reduces_once_per_optimizer_step(flows):
    r = flows["accumulation"]
    assert r["micro_batches"] == 2
    # One reduce-scatter per FSDP group per optimizer step; without no_sync it would be per micro-batch.
    assert r["reduce_scatters"] == r["groups"] == 4
    assert r["reduce_scatters_two_plain_steps"] == 2 * r["groups"]
    assert r["max_rel_diff"] < TOL  # the accumulated step equals one step on the whole batch


def test_throughput_monitor_logs_per_step_metrics_on_rank_zero_only(flows):
    rank0, rank1 = flows["throughput_monitor"]["rows"]
    assert rank1 == []  # rank 0 only
    assert [step for step, _ in rank0] == [2, 4]  # every 2 optimizer steps
    for _, m in rank0:
        assert set(m) == {
            "throughput/tokens_per_s",
            "throughput/step_time_s",
            "throughput/mfu",
            "throughput/peak_memory_gib",
        }
        # A report averages its 2 steps; each step saw 2 micro-batches of 4 samples (the batch's
        # integer tensor: one "token" a sample): 8 tokens a step on this rank.
        assert m["throughput/tokens_per_s"] * m["throughput/step_time_s"] == pytest.approx(8)
        assert 0 < m["throughput/mfu"] < 1  # against the CPU's measured peak
        assert m["throughput/peak_memory_gib"] > 0.01  # the process's resident peak on the CPU


def test_accumulation_modes_under_accumulate_grad_batches(flows):
    r = flows["accumulation_modes"]
    g, k = r["keep_gathered"]["groups"], 2
    for mode in ("sync_each", "sync_last", "keep_gathered"):
        assert r[mode]["plan_mode"] == mode and r[mode]["max_rel_diff"] < TOL, r[mode]
    assert r["sync_each"]["reduce_scatters"] == k * g  # every micro-batch
    assert r["sync_last"]["reduce_scatters"] == r["keep_gathered"]["reduce_scatters"] == g  # the last only
    # Per step, sync modes gather k * (2 per resharded block + 1 for the root and 1 for the last block),
    # keep_gathered each group once; sync_last and keep_gathered add a one-time gather of every group.
    # The rest of the fit (the same in every mode) cancels out.
    assert r["sync_last"]["all_gathers"] - r["keep_gathered"]["all_gathers"] == k * (2 * (g - 2) + 2) - g
    assert r["sync_last"]["all_gathers"] - r["sync_each"]["all_gathers"] == g


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_gradient_clipping_matches_single_process(flows, algorithm):
    r = flows["clipping"][algorithm]
    assert r["max_rel_diff"] < TOL
    assert r["unclipped_diff"] > 0.1  # the clip was active: it changed the step
    if algorithm == "norm":
        assert abs(r["norm"] - r["ref_norm"]) <= TOL * r["ref_norm"]


def test_precision_strings_map_to_fsdp2_policies(flows):
    p = flows["precision"]
    bf16 = p["bf16_mixed"]
    assert bf16["plugin"] == "FSDP2MixedPrecision" and bf16["precision"] == ["bf16/fp32"]
    assert bf16["out_dtype"] == "torch.bfloat16" and bf16["stored_dtypes"] == ["torch.float32"]
    # The root is gathered around training_step without casting the batch: float targets stay fp32.
    assert bf16["input_dtype"] == bf16["target_dtype"] == "torch.float32"
    # One SGD step against the policy written out without the engine (tests/_precision.py: bf16 copy
    # under autocast, fp32 gradients averaged, fp32 update): the same arithmetic up to fp32 summation
    # order (measured 2.2e-08); the fp32 update is measurably different (6.0e-03), so compute was bf16.
    assert bf16["update_diff"] < TOL and bf16["fp32_update_diff"] > 1e-3
    # fp32 optimizer state holding the fp32 gradient; gradients reduce-scattered in fp32.
    assert bf16["state_dtypes"] == ["torch.float32"] and bf16["momentum_diff"] < TOL
    assert _reduced_in(bf16, "float32")
    # 16-mixed: an initial scale of 2**10 does not overflow, so the step ran (scale unchanged), and the
    # update equals the policy written out with the loss scaled by 2**10 and unscaled in fp32 (5.3e-09).
    fp16 = p["fp16_mixed"]
    assert (
        fp16["sharded_scaler"] and fp16["out_dtype"] == "torch.float16" and fp16["stored_dtypes"] == ["torch.float32"]
    )
    assert fp16["scale_after"] == 2.0**10 and fp16["update_diff"] < TOL and _reduced_in(fp16, "float32")
    # bf16-true: weights, batch, compute, reduction and update all bf16; equal to one bf16 process (measured 0).
    true = p["bf16_true"]
    assert true["param_dtypes"] == ["torch.bfloat16"] and true["target_dtype"] == "torch.bfloat16"
    assert true["update_diff"] < TOL and _reduced_in(true, "bfloat16")
    assert "64-true" in p["double_error"] and "bf16-mixed" in p["double_error"]


def _reduced_in(result: dict, dtype: str) -> bool:
    """Every gradient reduce-scatter of the step ran in `dtype` (Lightning's own all-reduces are int64 flags)."""
    scatters = [d for name, d in result["reductions"] if name.startswith("reduce_scatter")]
    return bool(scatters) and set(scatters) == {dtype}


def test_validate_test_predict_without_training(flows):
    r = flows["evaluation"]
    assert r["root_is_fsdp"]
    # Each entry point ends resharded; a forward outside them leaves the root gathered (what they undo).
    assert {k: v for k, v in r["plain_after"].items() if k != "own_forward"} == {
        "validate": [],
        "test": [],
        "predict": [],
        "fit": [],
    }
    assert "inp.weight" in r["plain_after"]["own_forward"]
    assert abs(r["val"] - r["ref"]) <= TOL * r["ref"] and abs(r["test"] - r["ref"]) <= TOL * r["ref"]
    assert r["predicted"] == 16 and r["pred_diff"] < 1e-5  # this rank's half of the 32 samples


def test_own_tensor_parallel_under_the_default_is_noted_once(flows):
    """FSDP2Strategy() keeps FSDP over every device (tensor_parallel_size=1), unlike
    ModelParallelStrategy(); a module doing TP itself gets one warning saying so, on rank 0."""
    rank0, rank1 = flows["own_tp_with_default_strategy"]["tp_notes"]
    assert len(rank0) == 1 and rank1 == []
    assert "OwnTensorParallel" in rank0[0] and "tensor_parallel_size='auto'" in rank0[0]


def test_configure_model_sharding_is_kept(flows):
    r = flows["manual_configure_model"]
    assert r["groups"] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
    assert all(r["user_settings_kept"])
    assert r["max_rel_diff"] < TOL


def test_init_module_meta_device(flows):
    r = flows["meta_init"]
    assert r["meta_before"] and not r["meta_after"]
    # Materialised weights are the modules' own reset_parameters() draws, as in one process (exactly:
    # shards of one draw, not each rank's own), and the first step from them matches one process.
    assert r["init_diff"] == 0.0 and r["max_rel_diff"] < TOL


def test_checkpoint_layout_is_lightnings(flows):
    c = flows["checkpoints"]
    assert c["listing"] == ["epoch=0-step=4.ckpt", "last.ckpt"]  # no .tmp-* left behind
    assert c["step_files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "checksums.json", "meta.pt"]
    assert c["explicit_is_dir"] and c["full_is_file"]
    assert c["top1_listing"] == ["epoch=1-step=8.ckpt"]  # save_top_k removed the older directory whole


def test_lightning_consolidation_tool_reads_our_checkpoints(runs, tmp_path):
    """`python -m lightning.pytorch.utilities.consolidate_checkpoint` (FSDPStrategy's tool) turns our
    sharded directory into one file the Trainer loads; `fsdp2-strategy consolidate` agrees."""
    from safetensors.torch import load_file

    ckpt = runs["work"] / "ckpts" / "epoch=0-step=4.ckpt"
    out = tmp_path / "consolidated.ckpt"
    consolidate = "lightning.pytorch.utilities.consolidate_checkpoint"
    launch("python", "-m", consolidate, ckpt, "--output_file", out, cwd=SCRIPTS, timeout=120)
    full = torch.load(out, weights_only=False)
    expected = {k: torch.tensor(v) for k, v in runs["flows"]["checkpoints"]["epoch0_params"].items()}
    assert sorted(full["state_dict"]) == sorted(expected)
    assert all(torch.equal(full["state_dict"][k], v) for k, v in expected.items())
    assert len(full["optimizer_states"]) == 1 and full["optimizer_states"][0]["state"]  # Adam's moments
    assert full["global_step"] == 4 and full["epoch"] == 0  # Lightning's meta.pt merged in
    launch("python", "-m", "fsdp2_strategy.cli", "consolidate", ckpt, tmp_path / "hf", cwd=SCRIPTS, timeout=120)
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(weights) == sorted(expected) and all(torch.equal(weights[k], v) for k, v in expected.items())


def test_model_parallel_strategy_checkpoint_resumes(flows):
    """A directory in ModelParallelStrategy's layout (model under "state_dict") resumes exactly."""
    assert flows["checkpoints"]["mps_resumed_diff"] == 0.0


def test_resume_from_last_continues_exactly(flows):
    c = flows["checkpoints"]
    assert c["first_losses"] == c["ref_losses"][:4]
    assert c["resumed_losses"] == c["ref_losses"][4:]
    assert c["resumed_diff"] == 0.0
    assert _close(c["full_resumed_losses"], c["ref_losses"][4:])


def test_resume_across_world_sizes(runs):
    ref = runs["flows"]["checkpoints"]["ref_losses"]
    assert _close(runs["single"]["ref_losses"], ref)  # 1 process, batch 8 == 2 ranks x 4
    c = runs["flows"]["checkpoints"]
    assert _close(c["from_single_losses"], ref[4:]) and c["from_single_diff"] < TOL  # 1 -> 2
    assert _close(runs["resume"]["losses"], ref[4:])  # 2 -> 1


def _state_rel(a: dict, b: dict) -> float:
    """Largest relative difference of parameters and momentum between two `resume_flows.record`s."""
    return max(
        max_rel_diff({k: torch.tensor(v) for k, v in a[part].items()}, {k: torch.tensor(v) for k, v in b[part].items()})
        for part in ("params", "momentum")
    )


def test_mid_epoch_resume_on_another_number_of_processes(runs):
    """2 -> 1 and 1 -> 2 from a checkpoint in the middle of epoch 1 (step 6 of 8), global batch 8 on
    either: Lightning restores the global step, the scheduler and, with a resumable loader, the data
    position; the resumed steps see the same learning rates and samples as the uninterrupted run on
    that number of processes, and end at the same parameters and momentum."""
    one = runs["single"]["other_world_sizes"]["one"]
    two, from_one = (
        runs["flows"]["resume_other_world_sizes"]["two"],
        runs["flows"]["resume_other_world_sizes"]["from_one"],
    )
    from_two = runs["resume"]["from_two"]
    assert one["samples"] == two["samples"] and one["lrs"] == two["lrs"]  # 1 and 2 processes: same global batches
    assert len({tuple(s) for s in one["samples"]}) == 8  # 8 different global batches over the 2 epochs
    for resumed, uninterrupted in ((from_one, two), (from_two, one)):
        assert resumed["global_steps"] == uninterrupted["global_steps"][6:] == [6, 7]
        assert resumed["lrs"] == uninterrupted["lrs"][6:]  # StepLR(gamma=0.8), stepped every optimizer step
        assert resumed["samples"] == uninterrupted["samples"][6:]
        assert resumed["final_global_step"] == uninterrupted["final_global_step"] == 8
        assert _state_rel(resumed, uninterrupted) < TOL


def test_mid_epoch_resume_with_a_plain_loader_repeats_the_epoch_start(runs):
    """What the docs warn about: a plain DataLoader has no position to restore, so Lightning (with a
    warning) starts epoch 1's data again: global step and learning rate are right, the samples are
    those of the epoch's first batches, and its last two batches are never seen."""
    r = runs["single"]["other_world_sizes"]
    plain, resumed = r["plain"], r["plain_resumed"]
    assert resumed["global_steps"] == [6, 7] and resumed["lrs"] == plain["lrs"][6:]
    assert resumed["samples"] == plain["samples"][4:6] != plain["samples"][6:]


def test_load_from_checkpoint_reads_sharded_dir_in_one_process(runs):
    assert runs["resume"]["loaded_diff"] == 0.0
    assert runs["resume"]["lightning_reader_diff"] == 0.0  # Lightning's own reader agrees
    assert runs["resume"]["loaded_hparams"] == {"optimizer": "adam", "lr": 0.1}


def test_save_before_the_first_step_changes_nothing(flows):
    r = flows["checkpoints"]
    assert r["early_sharded_diff"] < 1e-6 and r["early_full_diff"] < 1e-6
    assert r["early_resumed_diff"] < 1e-6


def test_damaged_checkpoint_refused_on_every_rank(flows):
    c = flows["checkpoints"]
    assert "damaged" in c["damaged_error"] and "__1_0.distcp" in c["damaged_error"]
    assert c["damaged_errors_all_ranks"] == [True, True]


def test_auto_strategy_picks_what_the_planner_picks_for_the_budget(flows):
    """FSDP2Strategy(sharding_strategy="auto", memory_budget=B) on 2 ranks: the core planner's choice
    for B reaches the model (plan, reshard choices), trains like one process, and a budget below
    every estimate fails with the planner's error naming memory_budget."""
    r = flows["auto_strategy"]
    est = r["estimates"]
    assert est["FULL_SHARD"] < est["SHARD_GRAD_OP"] < est["NO_SHARD"]
    full, zero2 = r["FULL_SHARD"], r["SHARD_GRAD_OP"]
    assert full["strategies"] == ["FULL_SHARD"] and full["mesh_shapes"] == ["(2,)"]
    # FULL_SHARD frees the blocks after forward (not the last, which backward needs at once).
    assert [full["reshard"][f"blocks.{i}"] for i in range(8)] == [True] * 7 + [False]
    assert zero2["strategies"] == ["SHARD_GRAD_OP"] and set(zero2["reshard"].values()) == {False}
    assert full["max_rel_diff"] < TOL and zero2["max_rel_diff"] < TOL
    assert r["too_small_error"] and "sharding_strategy='auto'" in r["too_small_error"]
    assert "smallest peak" in r["too_small_error"] and "memory_budget" in r["too_small_error"]


def test_throughput_objective_tunes_on_the_train_loader_and_caches_the_pick(flows):
    """FSDP2Strategy(sharding_strategy="auto", objective="throughput"): the core tunes on the train
    loader's first batch with training_step's loss, caches the pick, and the model is sharded with it
    on both ranks; training then matches one process and sees the same data and random state as an
    untuned run; a second fit takes the cached pick without tuning."""
    r = flows["auto_strategy"]
    t = r["throughput"]
    assert t["rows"][:2] == ["FULL_SHARD/blocks", "FULL_SHARD/one group"]  # the default candidates, measured
    picked = t["entry"]["changes"]
    # NO_SHARD is a (replicate 2, shard 1) mesh; the others shard over both ranks.
    mesh = "(2, 1)" if picked["sharding_strategy"] == "NO_SHARD" else "(2,)"
    assert t["strategies"] == [picked["sharding_strategy"]] and t["mesh_shapes"] == [mesh]
    assert (t["groups"] == 1) == ("wrap_policy" in picked and picked["wrap_policy"] is None)  # one group or blocks
    assert t["every_rank"][0] == t["every_rank"][1]
    assert t["max_rel_diff"] < TOL
    assert t["rng_after"] == r["FULL_SHARD"]["rng_after"]
    assert t["reused_same_plan"]


def test_spawn_start_method_returns_full_weights(tmp_path):
    out = tmp_path / "spawn.json"
    launch("python", "spawn.py", out, cwd=SCRIPTS, timeout=180)
    r = json.loads(out.read_text())
    assert not r["parent_has_process_group"] and r["plain_tensors"]
    assert r["ranks_vs_single_process"] < TOL and r["parent_vs_ranks"] == 0.0


def test_two_nodes_hybrid_replicates_across_nodes(tmp_path):
    """Trainer(num_nodes=2, devices=1) with two torchrun agents, one per "node", on this machine."""
    out, port = tmp_path / "nodes.json", free_port()

    def agent(node_rank: int) -> None:
        rendezvous = ["--nnodes=2", f"--node_rank={node_rank}", "--master_addr=127.0.0.1", f"--master_port={port}"]
        launch("torchrun", "nodes.py", out, cwd=SCRIPTS, nproc=1, launcher_args=rendezvous, timeout=150)

    with ThreadPoolExecutor(2) as pool:  # both agents at once; each fails naming its command and output
        for agent_done in [pool.submit(agent, r) for r in (0, 1)]:
            agent_done.result()
    r = json.loads(out.read_text())
    assert r["node_ranks"] == [0, 1] and r["world_size"] == 2
    assert r["mesh_shapes"] == ["(2, 1)"]  # replicate across the nodes, shard within each
    assert r["max_rel_diff"] < TOL


_CLI_YAML = """
trainer:
  accelerator: {accelerator}
  devices: {devices}
  max_steps: 2
  precision: bf16-mixed
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  strategy: {strategy}
"""


def test_lightning_cli_yaml_and_subprocess_launcher(tmp_path):
    """`strategy:` as class_path + init_args (FSDP2Config fields), launched by Lightning itself."""
    strategy = (
        "\n    class_path: fsdp2_strategy.integrations.lightning.FSDP2Strategy"
        "\n    init_args:\n      wrap_policy: [ResidualBlock]\n      reshard_after_forward: false"
    )
    config = tmp_path / "cli.yaml"
    config.write_text(_CLI_YAML.format(accelerator="cpu", devices=2, strategy=strategy))
    out = tmp_path / "cli.json"
    launch("python", "cli.py", "fit", "--config", config, cwd=SCRIPTS, timeout=180, env={"FSDP2_CLI_OUT": out})
    r = json.loads(out.read_text())
    assert r["strategy"] == "FSDP2Strategy" and r["world_size"] == 2 and len(r["losses"]) == 2
    assert r["wrap_policy"] == "['ResidualBlock']" and r["groups"] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
    assert set(r["precision"]) == {"bf16/fp32"}


def test_lightning_cli_registry_string(tmp_path):
    """`strategy: fsdp2` with `accelerator: auto` (CPU here, the GPU on a GPU machine)."""
    config = tmp_path / "cli.yaml"
    config.write_text(_CLI_YAML.format(accelerator="auto", devices=1, strategy="fsdp2"))
    out = tmp_path / "cli.json"
    launch("python", "cli.py", "fit", "--config", config, cwd=SCRIPTS, timeout=120, env={"FSDP2_CLI_OUT": out})
    r = json.loads(out.read_text())
    assert r["strategy"] == "FSDP2Strategy" and r["world_size"] == 1
    accel = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    assert r["device_type"] == (accel.type if accel else "cpu")


# ---------------------------------------------------------------------- construction (no processes)
def test_invalid_config_raises_core_error():
    with pytest.raises(ValueError, match="FSDP2Config.sharding_strategy"):
        FSDP2Strategy(sharding_strategy="FULLY")
    with pytest.raises(ValueError, match="state_dict_type"):
        FSDP2Strategy(state_dict_type="zip")
    with pytest.raises(ValueError, match="start_method"):
        FSDP2Strategy(start_method="thread")


def test_config_object_dict_and_yaml(tmp_path):
    import fsdp2_strategy as f2

    path = tmp_path / "fsdp2.yaml"
    path.write_text("wrap_policy: [Block]\nforward_prefetch: 1\n")
    assert FSDP2Strategy(config=str(path)).fsdp2_config.forward_prefetch == 1
    assert FSDP2Strategy(config={"cpu_offload": True}).fsdp2_config.cpu_offload is True
    strategy = FSDP2Strategy(config=f2.FSDP2Config(wrap_policy=["Block"]), forward_prefetch=2)
    assert strategy.fsdp2_config.wrap_policy == ["Block"] and strategy.fsdp2_config.forward_prefetch == 2


def test_state_dict_type_maps_to_distributed_checkpoint():
    assert FSDP2Strategy()._save_distributed_checkpoint is True
    assert FSDP2Strategy(state_dict_type="full")._save_distributed_checkpoint is False


def test_sharded_save_without_a_model_says_how_to_save(tmp_path):
    # Lightning's own unit test saves through a bare strategy; ours has no sharded model to write then.
    with pytest.raises(RuntimeError, match=r"no model is attached.*trainer.save_checkpoint\(path\)"):
        FSDP2Strategy().save_checkpoint({"state_dict": {}, "optimizer_states": []}, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_registered_names():
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["fsdp2"]["strategy"] is FSDP2Strategy
    assert StrategyRegistry["fsdp2_hybrid"]["init_params"] == {"sharding_strategy": "HYBRID_SHARD"}
    assert StrategyRegistry.get("fsdp2_cpu_offload").fsdp2_config.cpu_offload is True
    assert StrategyRegistry.get("fsdp2_spawn")._start_method == "spawn"


def test_unsupported_precision_refused_at_trainer_construction():
    import lightning.pytorch as pl

    with pytest.raises(ValueError, match="cannot honour.*32-true, bf16-mixed, 16-mixed, bf16-true, 16-true"):
        pl.Trainer(accelerator="cpu", devices=2, strategy="fsdp2", precision="64-true", logger=False)


def test_accelerator_backend_includes_cpu_for_async_checkpoints():
    import torch

    strategy = FSDP2Strategy()
    strategy.parallel_devices = [torch.device("cuda", 0)]
    assert strategy._get_process_group_backend() == "cpu:gloo,cuda:nccl"
    strategy.parallel_devices = [torch.device("cpu")]
    assert strategy._get_process_group_backend() == "gloo"
    assert FSDP2Strategy(process_group_backend="gloo")._get_process_group_backend() == "gloo"


def test_private_lightning_api_present():
    """Fails loudly when a Lightning release moves a private symbol the adapter patches."""
    from fsdp2_strategy.integrations.lightning import _compat

    _compat.check_private_api()
    import lightning.pytorch.core.saving as saving

    assert saving.pl_load is _compat._pl_load  # installed by importing the adapter


def test_peft_checkpoints_hold_the_adapters_and_resume_on_the_same_base(flows):
    r = flows["peft_checkpoints"]
    assert r["saved_model_keys"] and all("lora_" in k for k in r["saved_model_keys"]), r["saved_model_keys"]
    assert r["frozen_base_entry"]
    assert r["resumed_diff"] < TOL, r["resumed_diff"]
    assert "another frozen base" in r["other_base_error"] and "blocks.0.fc" in r["other_base_error"]


def test_overlap_checkpoints_hold_the_saved_state_and_resume_exactly(flows):
    r = flows["async_checkpoints"]
    assert r["listing"] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]  # both committed by the end of fit
    assert r["mode"] == "overlap" and not r["copied_before_return"], r  # the save returned before its copy
    assert r["pending_at_next_step"], r  # epoch 1 began while the save was written
    # Bit for bit the state at the save (parameters and momentum), although epoch 1 changed all of it.
    assert any(k.startswith("optim.") for k in r["keys"]) and r["changed_by_epoch_1"] == r["keys"], r
    assert r["saved_differs"] == [], r
    assert r["trained_diff"] == 0.0 and r["resumed_diff"] < 1e-6, r
    assert r["checkpoint_io_mode"] is True  # Trainer(plugins=[AsyncCheckpointIO()])


def test_sigterm_to_one_rank_saves_an_hpc_checkpoint_exits_143_and_resumes_exactly(tmp_path):
    """FSDP2Strategy(checkpoint_on_preemption=True): rank 1 receives SIGTERM inside step 4; both ranks
    save hpc_ckpt_1.ckpt after that step and exit 143 (no hang); fit(ckpt_path="hpc") continues from
    step 4 to the parameters of the uninterrupted run."""
    proc = launch("torchrun", "preempt.py", "preempt", tmp_path, cwd=SCRIPTS, timeout=180, check=False)
    assert proc.returncode != 0 and proc.stderr.count("exitcode  : 143") == 2, proc.stderr[-3000:]
    saved = tmp_path / "hpc_ckpt_1.ckpt"
    assert (saved / ".metadata").is_file() and torch.load(saved / "meta.pt", weights_only=False)["global_step"] == 4
    launch("torchrun", "preempt.py", "resume", tmp_path / "resume.json", tmp_path, cwd=SCRIPTS, timeout=180)
    r = json.loads((tmp_path / "resume.json").read_text())
    assert r["start_step"] == 4 and r["diff"] < TOL, r

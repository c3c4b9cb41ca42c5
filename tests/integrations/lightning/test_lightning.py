"""Lightning adapter end to end: real `Trainer` runs on 2 CPU processes (torchrun, Lightning's own
subprocess launcher, spawn) and on 1, each in a subprocess with a timeout.

The scripts in tests/integrations/lightning/scripts/ check what they claim where they run (named checks,
`helpers.checks.Checks`, on every rank); this file launches them and reports each flow's failed checks
(`FlowReports.assert_passed`). The in-process tests at the end assert here.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("lightning")

from helpers.checks import FlowReports  # noqa: E402
from helpers.collect import rank_path  # noqa: E402
from helpers.harness import free_port, launch, rank_reports  # noqa: E402

from fsdp2_strategy.integrations.lightning import FSDP2Strategy  # noqa: E402

SCRIPTS = Path(__file__).parent / "scripts"


# Values each rank of flows.py measures on its own (left out of the rank agreement; the checks are
# judged on every rank); everything else every rank reports alike.
PER_RANK = ["throughput_monitor.cpu_peak"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """1 process (reference + checkpoints) -> 2 ranks (all flows, resume from it) -> 1 process (resume);
    each launch checks its runs against the launches before it (their reports are its arguments)."""
    work = tmp_path_factory.mktemp("lightning")
    single, flows, resume = work / "single.json", work / "flows.json", work / "resume.json"
    launch("python", "single.py", "train", single, work, cwd=SCRIPTS, timeout=120, reports=single, nproc=1)
    launch("torchrun", "flows.py", flows, work, rank_path(single, 0), cwd=SCRIPTS, timeout=240, reports=flows)
    resume_args = [resume, work / "ckpts" / "epoch=0-step=4.ckpt", rank_path(flows, 0), rank_path(single, 0)]
    launch("python", "single.py", "resume", *resume_args, cwd=SCRIPTS, timeout=180, reports=resume, nproc=1)
    # Every rank's report (a flow that raised on any rank fails here, naming it), equal on every rank.
    return {
        "single": FlowReports(rank_reports(single, 1)),
        "flows": FlowReports(rank_reports(flows, 2), PER_RANK),
        "resume": FlowReports(rank_reports(resume, 1)),
    }


def test_one_step_shards_by_policy_and_matches_single_process(flows):
    flows.assert_passed("one_step_parity")


def test_registry_variants_train_like_one_process(flows):
    flows.assert_passed("registry_variants")


def test_hybrid_mesh_follows_lightning_node_count():
    strategy = FSDP2Strategy(sharding_strategy="HYBRID_SHARD")
    strategy.num_nodes = 2
    strategy.parallel_devices = [None] * 4
    assert strategy._effective_config().mesh_shape == (2, 4)
    assert FSDP2Strategy(sharding_strategy="HYBRID_SHARD", mesh_shape=(1, 8))._effective_config().mesh_shape == (1, 8)


def test_accumulation_reduces_once_per_optimizer_step(flows):
    flows.assert_passed("accumulation")


def test_throughput_monitor_logs_per_step_metrics_on_rank_zero_only(flows):
    flows.assert_passed("throughput_monitor")


def test_accumulation_modes_under_accumulate_grad_batches(flows):
    flows.assert_passed("accumulation_modes")


def test_gradient_clipping_matches_single_process(flows):
    """By norm and by value."""
    flows.assert_passed("clipping")


def test_precision_strings_map_to_fsdp2_policies(flows):
    flows.assert_passed("precision")


def test_validate_test_predict_without_training(flows):
    flows.assert_passed("evaluation")


def test_own_tensor_parallel_under_the_default_is_noted_once(flows):
    """FSDP2Strategy() keeps FSDP over every device (tensor_parallel_size=1), unlike
    ModelParallelStrategy(); a module doing TP itself gets one warning saying so, on rank 0."""
    flows.assert_passed("own_tp_with_default_strategy")


def test_configure_model_sharding_is_kept(flows):
    flows.assert_passed("manual_configure_model")


def test_init_module_meta_device(flows):
    flows.assert_passed("meta_init")


def test_checkpoints_lightnings_layout_exact_resumes_and_damage_refused(flows):
    """Lightning's layout (top-k removal, explicit and full saves); resume exactly from "last", from
    ModelParallelStrategy's layout, from a full file and from one process's checkpoint (1 -> 2); a save
    before the first step changes nothing; a damaged checkpoint is refused on every rank."""
    flows.assert_passed("checkpoints")


def test_lightning_consolidation_tool_reads_our_checkpoints(runs):
    """`python -m lightning.pytorch.utilities.consolidate_checkpoint` (FSDPStrategy's tool) turns our
    sharded directory into one file the Trainer loads; `fsdp2-strategy consolidate` agrees."""
    runs["resume"].assert_passed("consolidation")


def test_resume_across_world_sizes(runs):
    """2 -> 1 from the end of epoch 0; mid-epoch (step 6 of 8, global batch 8 on either) 1 -> 2 and
    2 -> 1: Lightning restores the global step, the scheduler and, with a resumable loader, the data
    position; the resumed steps see the same learning rates and samples as the uninterrupted run on
    that number of processes, and end at the same parameters and momentum."""
    runs["flows"].assert_passed("resume_other_world_sizes")
    runs["resume"].assert_passed("resume_from_two_ranks")


def test_mid_epoch_resume_with_a_plain_loader_repeats_the_epoch_start(runs):
    """What the docs warn about: a plain DataLoader has no position to restore (single.py train)."""
    runs["single"].assert_passed("plain_loader_resume")


def test_load_from_checkpoint_reads_sharded_dir_in_one_process(runs):
    runs["resume"].assert_passed("load_from_checkpoint")


def test_auto_strategy_picks_what_the_planner_picks_for_the_budget(flows):
    """FSDP2Strategy(sharding_strategy="auto", memory_budget=B) on 2 ranks: the core planner's choice
    for B reaches the model (plan, reshard choices), trains like one process, and a budget below
    every estimate fails with the planner's error naming memory_budget. objective="throughput": the
    core tunes on the train loader's first batch with training_step's loss, caches the pick, and the
    model is sharded with it on both ranks; training then matches one process and sees the same data
    and random state as an untuned run; a second fit takes the cached pick without tuning."""
    flows.assert_passed("auto_strategy")


def test_spawn_start_method_returns_full_weights(tmp_path):
    out = tmp_path / "spawn.json"
    launch("python", "spawn.py", out, cwd=SCRIPTS, timeout=180, reports=out, nproc=1)
    FlowReports(rank_reports(out, 1)).assert_passed("spawn")


def test_two_nodes_hybrid_replicates_across_nodes(tmp_path):
    """Trainer(num_nodes=2, devices=1) with two torchrun agents, one per "node", on this machine."""
    out, port = tmp_path / "nodes.json", free_port()

    def agent(node_rank: int) -> None:
        rendezvous = ["--nnodes=2", f"--node_rank={node_rank}", "--master_addr=127.0.0.1", f"--master_port={port}"]
        launch("torchrun", "nodes.py", out, cwd=SCRIPTS, nproc=1, launcher_args=rendezvous, timeout=150)

    with ThreadPoolExecutor(2) as pool:  # both agents at once; each fails naming its command and output
        for agent_done in [pool.submit(agent, r) for r in (0, 1)]:
            agent_done.result()
    FlowReports(rank_reports(out, 2)).assert_passed("two_nodes")


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


def _cli(tmp_path, case: str, accelerator: str, devices: int, strategy: str) -> None:
    """`python cli.py fit --config C` with this YAML; its ranks check what `case` claims."""
    config = tmp_path / "cli.yaml"
    config.write_text(_CLI_YAML.format(accelerator=accelerator, devices=devices, strategy=strategy))
    out = tmp_path / "cli.json"
    env = {"FSDP2_CLI_OUT": out, "FSDP2_CLI_CASE": case}
    launch("python", "cli.py", "fit", "--config", config, cwd=SCRIPTS, timeout=180, env=env, reports=out, nproc=devices)
    FlowReports(rank_reports(out, devices)).assert_passed(case)


def test_lightning_cli_yaml_and_subprocess_launcher(tmp_path):
    """`strategy:` as class_path + init_args (FSDP2Config fields), launched by Lightning itself."""
    strategy = (
        "\n    class_path: fsdp2_strategy.integrations.lightning.FSDP2Strategy"
        "\n    init_args:\n      wrap_policy: [ResidualBlock]\n      reshard_after_forward: false"
    )
    _cli(tmp_path, "yaml", "cpu", 2, strategy)


def test_lightning_cli_registry_string(tmp_path):
    """`strategy: fsdp2` with `accelerator: auto` (CPU here, the GPU on a GPU machine)."""
    _cli(tmp_path, "registry", "auto", 1, "fsdp2")


# ---------------------------------------------------------------------- construction (no processes)
def test_invalid_config_raises_core_error():
    with pytest.raises(ValueError, match="FSDP2Config.sharding_strategy"):
        FSDP2Strategy(sharding_strategy="FULLY")
    with pytest.raises(ValueError, match="state_dict_type"):
        FSDP2Strategy(state_dict_type="zip")
    with pytest.raises(ValueError, match="start_method"):
        FSDP2Strategy(start_method="thread")
    # Everything wrong at once, in one error: the strategy's own arguments and the config's names and values.
    with pytest.raises(ValueError) as info:
        FSDP2Strategy(state_dict_type="zip", start_method="thread", wrap_polcy="auto", mixed_precision="bf32")
    message = str(info.value)
    assert message.startswith("FSDP2Strategy has 3 invalid fields:"), message
    for part in ("state_dict_type='zip'", "start_method='thread'", "Did you mean 'wrap_policy'", "Did you mean 'bf16'"):
        assert part in message, (part, message)


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
    flows.assert_passed("peft_checkpoints")


def test_overlap_checkpoints_hold_the_saved_state_and_resume_exactly(flows):
    flows.assert_passed("async_checkpoints")


def test_sigterm_to_one_rank_saves_an_hpc_checkpoint_exits_143_and_resumes_exactly(tmp_path):
    """FSDP2Strategy(checkpoint_on_preemption=True): rank 1 receives SIGTERM inside step 4; both ranks
    save hpc_ckpt_1.ckpt after that step and exit 143 (no hang); fit(ckpt_path="hpc") continues from
    step 4 to the parameters of the uninterrupted run (the resume launch checks the save and itself)."""
    proc = launch("torchrun", "preempt.py", "preempt", tmp_path, cwd=SCRIPTS, timeout=180, check=False)
    # How the preempted launch ended is the launcher's to see, not the killed ranks'.
    assert proc.returncode != 0 and proc.stderr.count("exitcode  : 143") == 2, proc.stderr[-3000:]
    out = tmp_path / "resume.json"
    launch("torchrun", "preempt.py", "resume", out, tmp_path, cwd=SCRIPTS, timeout=180, reports=out)
    FlowReports(rank_reports(out, 2)).assert_passed("resume_from_hpc")


def test_context_parallel_halves_every_sequence_and_matches_one_process(flows):
    flows.assert_passed("context_parallel")


def test_a_held_causal_lm_computes_its_loss_in_chunks_and_matches_one_process(flows):
    flows.assert_passed("chunked_loss")

"""Accelerate adapter: `accelerate launch --config_file` runs on 2 CPU processes, a 1-process resume,
and unit tests of the config mapping and of the private-API guard.

The scripts in tests/integrations/accelerate/scripts/ check what each flow claims where it runs (`helpers.checks.Checks`,
on every rank) and write every rank's report; the launch tests here launch them and report their checks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from helpers.checks import FlowReports  # noqa: E402
from helpers.collect import rank_path  # noqa: E402
from helpers.harness import launch, rank_reports  # noqa: E402

from fsdp2_strategy.integrations.accelerate import (  # noqa: E402
    FSDP2Accelerator,
    FSDP2Plugin,
    read_accelerate_env,  # noqa: E402
)
from fsdp2_strategy.integrations.accelerate import _compat as compat  # noqa: E402
from fsdp2_strategy.integrations.accelerate.env import accelerate_cpu_requested  # noqa: E402

SCRIPTS = Path(__file__).parent / "scripts"
PER_RANK = ["overlap_save.returned", "overlap_save.waited"]  # seconds, each rank's own
"""Report values that differ between ranks by nature ("flow.key"); every other value must agree on both
(what rank 0 alone reads from the files it wrote, each flow hands to every rank before checking it)."""
RESUMES = ("resume", "resume_launched")
"""The one-process resumes of the 2-rank state: `python resume.py`, and `accelerate launch` of one process."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """fsdp2.yaml (every flow) -> one process resuming its checkpoints (and saving one) -> fsdp2_variant.yaml
    (which also resumes that one on 2 processes). The later launches get the first one's report (rank 0's)
    and check against it."""
    work = tmp_path_factory.mktemp("accelerate")
    launch("accelerate", "flows.py", work / "flows.json", work, cwd=SCRIPTS, config=SCRIPTS / "fsdp2.yaml")
    first = rank_path(work / "flows.json", 0)
    resume_args = [work / "state_step2", first]
    launch("python", "resume.py", work / "resume.json", *resume_args, work, cwd=SCRIPTS, timeout=120)
    # The same resume as a 1-process `accelerate launch` (torchrun's agent store: env://).
    launch(
        "accelerate",
        "resume.py",
        work / "resume_launched.json",
        *resume_args,
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
        "config_from_variant_launch,launch_variant,resume_from_one",
        first,
        cwd=SCRIPTS,
        config=SCRIPTS / "fsdp2_variant.yaml",
    )
    one_process = {name: FlowReports([json.loads((work / f"{name}.json").read_text())]) for name in RESUMES}
    return {
        "flows": FlowReports(rank_reports(work / "flows.json", 2), PER_RANK),
        **one_process,
        "variant": FlowReports(rank_reports(work / "variant.json", 2), PER_RANK),
    }


# ---------------------------------------------------------------------------------------- launch runs
def test_config_file_keys_reach_the_core_and_the_stock_accelerator_refuses_the_plugin(runs):
    """Real FSDP on gloo, where stock Accelerate would run DDP, with each config file's values."""
    runs["flows"].assert_passed("config_from_launch")
    runs["variant"].assert_passed("config_from_variant_launch")


def test_variant_config_file_trains_with_every_value(runs):
    runs["variant"].assert_passed("launch_variant")


def test_prepare_shards_and_matches_one_process(flows):
    flows.assert_passed("parity")


def test_plugin_keywords_offload_and_checkpointing(flows):
    flows.assert_passed("variants")


def test_accumulate_skips_reduce_scatter_until_the_last_micro_batch(flows):
    flows.assert_passed("accumulation")


def test_a_deepspeed_launch_trains_on_this_engine(flows):
    flows.assert_passed("deepspeed_launch")


def test_log_throughput_every_reports_through_the_trackers_on_the_main_process(flows):
    flows.assert_passed("throughput_logging")


def test_accumulation_modes_through_accumulate(flows):
    flows.assert_passed("accumulation_modes")


def test_clip_grad_norm_is_the_global_norm(flows):
    flows.assert_passed("clipping")


def test_bf16_is_an_fsdp2_policy(flows):
    flows.assert_passed("bf16")


def test_fp16_uses_the_sharded_scaler(flows):
    flows.assert_passed("fp16")


def test_several_models_in_one_prepare(flows):
    flows.assert_passed("multi_model")


def test_prepare_model_alone_for_evaluation(flows):
    flows.assert_passed("evaluation")


def test_save_state_load_state_resume_refuse_damage_and_keep_the_newest(flows):
    """save_state/load_state resume exactly; a save before the first step changes nothing; Accelerate's
    merge_fsdp_weights reads the model view; partial and damaged directories are refused; automatic
    naming keeps the newest."""
    flows.assert_passed("checkpoints")


def test_auto_strategy_picks_what_the_planner_picks_and_the_throughput_objective_caches_its_pick(flows):
    """FSDP2Plugin(sharding_strategy="auto", memory_budget=B) under accelerate launch: the core
    planner's choice for B reaches the prepared model and trains like one process; a budget below
    every estimate fails in `prepare` with the planner's error naming memory_budget.
    objective="throughput": prepare(model, optimizer, loader) tunes on the loader's first batch, caches
    the pick, shards with it on both ranks and trains like one process; prepare(model) without a loader
    names what to pass."""
    flows.assert_passed("auto_strategy")


def test_auto_strategy_with_parallelism_config_is_refused_by_name():
    from accelerate.parallelism_config import ParallelismConfig

    from fsdp2_strategy.integrations.accelerate.parallelism import apply_parallelism_config

    plugin = FSDP2Plugin(read_env=False, sharding_strategy="auto", memory_budget="1GiB")
    with pytest.raises(ValueError, match="sharding_strategy='auto'.*ParallelismConfig"):
        apply_parallelism_config(plugin.fsdp2_config, ParallelismConfig(dp_shard_size=2), 2)


def test_resume_on_another_number_of_processes(runs):
    """2 -> 1 and 1 -> 2 (onto the variant config's layout) from a save_state in the middle of epoch 1.
    split_batches=True (the global batch is the loader's batch on any number of processes): the restored
    scheduler and Progress, set_epoch and skip_first_batches give the resumed steps the step numbers,
    learning rates and samples of the uninterrupted run, and the same parameters and momentum.
    Accelerate's default (split_batches=False): 2 -> 1 continues at the same sample with the learning
    rate and samples the uninterrupted 1-process run had there."""
    runs["flows"].assert_passed("resume_on_two")
    runs["resume"].assert_passed("other_world_sizes")
    runs["variant"].assert_passed("resume_from_one")


@pytest.mark.parametrize("how", RESUMES)
def test_two_rank_state_resumes_in_one_process(runs, how):
    """DCP reshards the 2-rank shards onto 1 process (plain `python`, or `accelerate launch` with one
    process); the losses continue as the 2-rank run did."""
    runs[how].assert_passed("resume")


def test_save_model_loads_with_from_pretrained(flows):
    flows.assert_passed("hf_export")


def test_cpu_ram_efficient_loading_broadcasts_rank0_weights(flows):
    flows.assert_passed("rank0_loading")


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


def test_a_deepspeed_launch_is_read_as_its_fsdp2_equivalent(tmp_path):
    """`distributed_type: DEEPSPEED`: the inline keys or the config file, translated by the core."""
    got = read_accelerate_env(DEEPSPEED)
    launch = got.pop("deepspeed")
    assert got == {"sharding_strategy": "FULL_SHARD", "cpu_offload": True, "mixed_precision": "bf16"}
    # Inline keys: the launcher's mixed_precision decides; clipping is applied by the accelerator.
    assert (launch.mixed_precision, launch.max_grad_norm, launch.source) == (
        "bf16",
        1.0,
        "the inline deepspeed_config keys",
    )
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}}))
    file_env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(tmp_path / "ds.json")}
    got = read_accelerate_env(file_env)
    assert got.pop("deepspeed").source == f"deepspeed_config_file {tmp_path / 'ds.json'}"
    assert got == {"sharding_strategy": "SHARD_GRAD_OP", "mixed_precision": "fp16"}
    with pytest.raises(FileNotFoundError, match="`deepspeed_config_file`"):
        read_accelerate_env({**file_env, "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(tmp_path / "no.json")})
    with pytest.raises(
        ValueError, match=r"ACCELERATE_DEEPSPEED_ZERO_STAGE \(accelerate config key `zero_stage`\)='three'"
    ):
        read_accelerate_env({**DEEPSPEED, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "three"})


EXPLICIT_DS = {
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    "bf16": {"enabled": True},
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 0.5,
}
"""A DeepSpeed file with every mapped key stated (not "auto")."""


def _explicit_file(tmp_path, **changes) -> dict:
    path = tmp_path / "explicit_ds.json"
    path.write_text(json.dumps({**EXPLICIT_DS, **changes}))
    return {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path),
        "ACCELERATE_MIXED_PRECISION": "no",  # what the launcher sets when the accelerate config has none
        "ACCELERATE_CONFIG_DS_FIELDS": "deepspeed_config_file,zero3_init_flag",
    }


def _deepspeed_reading(env: dict) -> tuple[dict, object]:
    got = read_accelerate_env(env)
    return got, got.pop("deepspeed")


def test_a_deepspeed_file_decides_precision_accumulation_and_clipping(tmp_path):
    """As stock Accelerate with DeepSpeed: the file's stated values win over the launcher's defaults,
    each one (a dropped mapping fails its own assertion)."""
    got, launch = _deepspeed_reading(_explicit_file(tmp_path))
    assert got == {"sharding_strategy": "FULL_SHARD", "cpu_offload": True, "mixed_precision": "bf16"}
    assert (launch.mixed_precision, launch.gradient_accumulation_steps, launch.max_grad_norm) == ("bf16", 4, 0.5)
    # fp32 stated in the file is kept too, over the launcher's bf16 only by refusing it (below).
    got, launch = _deepspeed_reading(_explicit_file(tmp_path, bf16={"enabled": False}))
    assert got["mixed_precision"] is None and launch.mixed_precision == "no"
    # "auto" leaves precision to the accelerate config, as stock Accelerate fills it.
    auto = _explicit_file(tmp_path, bf16={"enabled": "auto"})
    got, launch = _deepspeed_reading({**auto, "ACCELERATE_MIXED_PRECISION": "fp16"})
    assert got["mixed_precision"] == "fp16" and launch.mixed_precision == "fp16"


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"ACCELERATE_MIXED_PRECISION": "fp16"},
            r"ACCELERATE_MIXED_PRECISION \(accelerate config key `mixed_precision`\)='fp16' conflicts with the "
            r"DeepSpeed config \(deepspeed_config_file .*explicit_ds.json\), whose bf16/fp16 sections say 'bf16'",
        ),
        (
            {"ACCELERATE_CONFIG_DS_FIELDS": "deepspeed_config_file,gradient_accumulation_steps,mixed_precision"},
            r"The accelerate config sets gradient_accumulation_steps, mixed_precision beside deepspeed_config_file "
            r".*explicit_ds.json, which holds them .*remove them from the accelerate config",
        ),
    ],
)
def test_a_deepspeed_file_with_other_values_in_the_accelerate_config_is_refused(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        read_accelerate_env({**_explicit_file(tmp_path), **changes})


def test_an_accelerate_config_file_of_deepspeed_reads_as_the_launch_does(tmp_path):
    """`apply_accelerate_config` (Ray, notebooks): the same variables as `accelerate launch`, the keys the
    config set listed, so a config that sets mixed_precision beside the DeepSpeed file is refused alike."""
    import yaml

    from fsdp2_strategy.integrations.accelerate import accelerate_config_env

    env = _explicit_file(tmp_path)
    config = {
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {"deepspeed_config_file": env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]},
    }
    (tmp_path / "ds.yaml").write_text(yaml.safe_dump(config))
    got, launch = _deepspeed_reading(accelerate_config_env(tmp_path / "ds.yaml"))
    assert got["mixed_precision"] == "bf16" and (launch.gradient_accumulation_steps, launch.max_grad_norm) == (4, 0.5)
    (tmp_path / "ds.yaml").write_text(yaml.safe_dump({**config, "mixed_precision": "bf16"}))
    with pytest.raises(ValueError, match="sets mixed_precision beside deepspeed_config_file"):
        read_accelerate_env(accelerate_config_env(tmp_path / "ds.yaml"))


def test_the_plugin_keeps_a_deepspeed_files_precision_over_the_accelerators(tmp_path, monkeypatch):
    """`Accelerator(mixed_precision="no")` leaves the file's bf16 (stock Accelerate's DeepSpeed path
    does); another low precision is refused, naming both."""
    for key, value in _explicit_file(tmp_path).items():
        monkeypatch.setenv(key, value)
    plugin = FSDP2Plugin()
    plugin.with_precision("no")
    assert plugin.fsdp2_config.mixed_precision == "bf16" and plugin.accelerate_precision == "bf16"
    with pytest.raises(ValueError, match=r"mixed_precision='fp16'\) conflicts with the DeepSpeed config .*say 'bf16'"):
        plugin.with_precision("fp16")


def test_accelerate_launch_of_a_deepspeed_config_trains_what_the_file_says(deepspeed_path, tmp_path):
    """`accelerate launch` of a DEEPSPEED config with DeepSpeed installed (its launcher path: torchrun,
    the file's path, mixed_precision "no"): ZeRO-3, bf16, 2 micro-batches a step and clipping at 0.05
    from ds_config.json are applied, equal to one fp32 process's clipped step over both micro-batches,
    and one WARNING block lists each key (deepspeed_launch.py checks it on every rank)."""
    out = tmp_path / "deepspeed.json"
    launch(
        "accelerate",
        "deepspeed_launch.py",
        out,
        tmp_path,
        cwd=SCRIPTS,
        config=SCRIPTS / "deepspeed.yaml",
        pythonpath=[deepspeed_path],
        env={"DS_ACCELERATOR": "cpu"},
    )
    FlowReports(rank_reports(out, 2)).assert_passed("deepspeed_file")


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


def test_every_bad_plugin_argument_is_named_in_one_error():
    with pytest.raises(ValueError) as info:
        FSDP2Plugin(read_env=False, state_dict_type="local", keep_last=0, wrap_polcy="auto", mixed_precision="bf32")
    message = str(info.value)
    assert message.startswith("FSDP2Plugin has 3 invalid fields:"), message
    for part in ("state_dict_type='local'", "keep_last=0", "Did you mean 'wrap_policy'", "Did you mean 'bf16'"):
        assert part in message, (part, message)


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
        _ = plugin.fsdp_version  # what stock Accelerate reads to tell FSDP1 from FSDP2
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
    # Patched where the stock check looks it up (as Accelerate's own test does), and only there.
    monkeypatch.setattr(stock_module, "is_bitsandbytes_multi_backend_available", lambda: False)
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
    monkeypatch.setattr(stock_module, "is_bitsandbytes_multi_backend_available", lambda: True)
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


def test_guard_judges_accelerate_by_behaviour_not_by_its_source(monkeypatch):
    """A release that reworded its source but behaves the same passes (1.16 no longer reads
    `fsdp_version` in `Accelerator.__init__`); one whose behaviour moved is named."""

    class Reworded(compat.AcceleratorState):  # no `_mixed_precision` in this class's source text
        pass

    class RewordedAccelerator(compat.Accelerator):
        def __init__(self, *args, fsdp_plugin=None, **kwargs):  # no `fsdp_version` read
            pass

    monkeypatch.setattr(compat, "AcceleratorState", Reworded)
    monkeypatch.setattr(compat, "Accelerator", RewordedAccelerator)
    assert compat._problems() == []

    class MovedPrecision(compat.AcceleratorState):
        @property
        def mixed_precision(self):
            return self.__dict__["_precision"]

    class NoPluginArgument(compat.Accelerator):
        def __init__(self, *args, cpu=False):
            pass

    monkeypatch.setattr(compat, "AcceleratorState", MovedPrecision)
    monkeypatch.setattr(compat, "Accelerator", NoPluginArgument)
    assert compat._problems() == [
        "Accelerator.__init__(fsdp_plugin=...) (the stock-Accelerator refusal)",
        "AcceleratorState.mixed_precision reading AcceleratorState._mixed_precision",
    ]
    with pytest.raises(ImportError) as info:
        compat.check_private_api()
    assert "requirements/lock.txt" in str(info.value) and "The newest release tested is accelerate" in str(info.value)


def test_stock_accelerator_refuses_the_plugin_by_keyword_or_position():
    """The refusal wraps `Accelerator.__init__` once; FSDP2Accelerator (which hands Accelerate no
    plugin) and every other caller reach the stock `__init__` unchanged (the rest of this file)."""
    import inspect

    import accelerate

    with pytest.raises(TypeError, match="FSDP2Accelerator"):
        accelerate.Accelerator(fsdp_plugin=FSDP2Plugin(read_env=False), cpu=True)
    position = list(inspect.signature(accelerate.Accelerator.__init__).parameters).index("fsdp_plugin") - 1
    with pytest.raises(TypeError, match="FSDP2Accelerator"):
        accelerate.Accelerator(*[None] * position, FSDP2Plugin(read_env=False))
    wrapped = accelerate.Accelerator.__init__
    compat.refuse_in_stock_accelerator(FSDP2Plugin, "again")
    assert accelerate.Accelerator.__init__ is wrapped  # idempotent: one wrapper, the documented message


def test_private_api_change_fails_loudly(monkeypatch):
    def save_accelerator_state(output_dir, models):  # a changed signature
        return None

    monkeypatch.setattr(compat, "save_accelerator_state", save_accelerator_state)
    with pytest.raises(ImportError) as info:
        compat.check_private_api()
    assert "accelerate.checkpointing.save_accelerator_state" in str(info.value)
    assert "install accelerate>=" in str(info.value) and "tested with accelerate" in str(info.value)
    with pytest.raises(ImportError, match="_models"):
        compat.check_accelerator(object())


def test_peft_state_holds_the_adapter_and_every_save_path_loads(flows):
    flows.assert_passed("peft_lora")


def test_overlap_save_state_holds_the_saved_state_and_resumes_exactly(flows):
    flows.assert_passed("overlap_save")


def test_sigterm_to_one_rank_sets_the_trigger_on_every_rank(flows):
    flows.assert_passed("preemption")


def test_sync_each_batch_means_the_sync_each_mode():
    """GradientAccumulationPlugin(sync_each_batch=True) reduces every micro-batch: "sync_each"; it cannot
    combine with a mode that keeps parameters gathered across the step."""
    plugin = FSDP2Plugin(read_env=False)
    assert plugin.config_for(sync_each_batch=False) is plugin.fsdp2_config
    assert plugin.config_for(sync_each_batch=True).accumulation == "sync_each"
    kept = FSDP2Plugin(accumulation="keep_gathered", read_env=False)
    with pytest.raises(ValueError, match="accumulation='keep_gathered'; drop sync_each_batch"):
        kept.config_for(sync_each_batch=True)

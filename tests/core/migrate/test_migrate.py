"""A DeepSpeed config read as an FSDP2Config plus trainer settings (`f2.translate_deepspeed`, the
`fsdp2-strategy from-deepspeed` command): what maps, what is listed as untranslated, and the errors."""

from __future__ import annotations

import json
import logging

import pytest

import fsdp2_strategy as f2
from fsdp2_strategy.cli import main

ZERO3 = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 8,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "weight_decay": 0.01}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "steps_per_print": 100,
    "some_future_key": 1,
}


def test_zero3_with_offload_bf16_and_trainer_settings(caplog):
    with caplog.at_level(logging.INFO, logger="fsdp2_strategy"):
        t = f2.translate_deepspeed(ZERO3)
    c = t.config
    assert (c.sharding_strategy, c.cpu_offload, c.mixed_precision, c.mesh_shape) == ("FULL_SHARD", True, "bf16", None)
    assert t.trainer == {"max_grad_norm": 1.0, "gradient_accumulation_steps": 8, "per_device_train_batch_size": 4}
    assert t.lightning_trainer() == {"gradient_clip_val": 1.0, "accumulate_grad_batches": 8}
    assert set(t.unmapped) == {
        "optimizer",
        "zero_optimization.overlap_comm",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "steps_per_print",
        "some_future_key",
    }
    assert "AdamW {'lr': 2e-05, 'weight_decay': 0.01}" in t.unmapped["optimizer"]
    assert t.unmapped["some_future_key"].startswith("unknown to this translation")
    assert t.precision == "bf16"
    # One WARNING block, visible by default: every key, mapped or not.
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and all(key in warnings[0] for key in [*t.unmapped, *t.mapped])
    for line in (
        "zero_optimization.stage -> sharding_strategy=FULL_SHARD",
        "bf16.enabled -> mixed_precision=bf16",
        "gradient_accumulation_steps -> trainer gradient_accumulation_steps=8",
        "gradient_clipping -> trainer max_grad_norm=1.0",
        "steps_per_print: not translated: no effect here",
    ):
        assert line in warnings[0], line


@pytest.mark.parametrize(
    "sections, stated",
    [
        ({"bf16": {"enabled": True}}, "bf16"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": False}}, "fp16"),
        ({"bf16": {"enabled": False}}, "no"),
        ({"bf16": {"enabled": False}, "fp16": {"enabled": False}}, "no"),
        ({"bf16": {"enabled": "auto"}}, None),
        ({"bf16": {"enabled": False}, "fp16": {"enabled": "auto"}}, None),
        ({}, None),
    ],
)
def test_the_precision_a_config_states(sections, stated):
    """Disabled is stated too (fp32, which a trainer's precision must not override); "auto" is not."""
    t = f2.translate_deepspeed({"zero_optimization": {"stage": 2}, **sections}, warn=False)
    assert t.precision == stated
    assert t.config.mixed_precision == (stated if stated in ("bf16", "fp16") else None)


@pytest.mark.parametrize(
    "stage, strategy", [(0, "NO_SHARD"), (1, "SHARD_GRAD_OP"), (2, "SHARD_GRAD_OP"), (3, "FULL_SHARD")]
)
def test_each_zero_stage(stage, strategy):
    t = f2.translate_deepspeed({"zero_optimization": {"stage": stage}}, warn=False)
    assert t.config.sharding_strategy == strategy and t.unmapped == {}


def test_hpz_partition_becomes_hybrid_sharding_auto_values_stay_with_the_trainer():
    ds = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}, "fp16": {"enabled": "auto"}}
    ds["gradient_accumulation_steps"] = "auto"
    t = f2.translate_deepspeed(ds, world_size=8, warn=False)
    assert t.config.sharding_strategy == "HYBRID_SHARD" and t.config.mesh_shape == (2, 4)
    assert t.config.mixed_precision is None and t.trainer == {}
    assert t.mapped["gradient_accumulation_steps"] == "auto: the trainer's gradient_accumulation_steps"
    assert f2.translate_deepspeed(ds, warn=False).config.mesh_shape is None  # no world size: the default
    with pytest.raises(ValueError, match="zero_hpz_partition_size=4 does not divide world_size=6"):
        f2.translate_deepspeed(ds, world_size=6, warn=False)


def test_nvme_offload_is_listed_not_mapped():
    t = f2.translate_deepspeed({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, warn=False)
    assert t.config.cpu_offload is False
    assert t.unmapped == {"zero_optimization.offload_param": "device 'nvme': only 'cpu' maps (cpu_offload=True)"}


def test_yaml_round_trip_and_the_command_line(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ZERO3))
    assert main(["from-deepspeed", str(path), "--out", str(tmp_path / "fsdp2.yaml")]) == 0
    text = (tmp_path / "fsdp2.yaml").read_text()
    assert "# trainer: max_grad_norm = 1.0" in text and "# not translated: optimizer:" in text
    back = f2.FSDP2Config.from_yaml(tmp_path / "fsdp2.yaml")
    want = f2.translate_deepspeed(path, warn=False).config
    assert (back.sharding_strategy, back.cpu_offload, back.mixed_precision) == (
        want.sharding_strategy,
        want.cpu_offload,
        want.mixed_precision,
    )
    capsys.readouterr()
    assert main(["from-deepspeed", str(tmp_path / "missing.json")]) == 2
    assert "missing.json does not exist" in capsys.readouterr().err


def test_bad_configs_name_the_problem(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not JSON"):
        f2.translate_deepspeed(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match="holds a list; a JSON object was expected"):
        f2.translate_deepspeed(tmp_path / "list.json")
    with pytest.raises(ValueError, match="stage=4 is unknown"):
        f2.translate_deepspeed({"zero_optimization": {"stage": 4}})
    with pytest.raises(ValueError, match="enables both bf16 and fp16"):
        f2.translate_deepspeed({"bf16": {"enabled": True}, "fp16": {"enabled": True}})

"""`FSDP2Trainer(deepspeed=...)`: the DeepSpeed config a run gave `TrainingArguments(deepspeed=...)`
becomes the FSDP2 settings (ZeRO stage, offload, precision), its trainer values are checked against
`TrainingArguments` as the stock DeepSpeed integration checks them, and the run equals one given the
equivalent FSDP2 settings directly. The 2-rank world checks what it claims on every rank (`helpers.checks.Checks`);
the test runs it and reports its checks."""

from __future__ import annotations

import pytest
from helpers.checks import Checks, FlowReports
from helpers.harness import run_distributed

DS = {
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    "bf16": {"enabled": "auto"},
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": 1.0,
}


def _world(out_dir: str) -> dict:
    import torch
    from helpers.models import tiny_llama
    from transformers import TrainingArguments

    from fsdp2_strategy.integrations.accelerate import FSDP2Plugin
    from fsdp2_strategy.integrations.transformers import FSDP2Trainer

    def args(**changes):
        values = dict(output_dir=out_dir, max_steps=2, per_device_train_batch_size=2, max_grad_norm=1.0)
        values.update(save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
        return TrainingArguments(**{**values, **changes})

    rows = [{"input_ids": torch.arange(i, i + 8) % 32, "labels": torch.arange(i, i + 8) % 32} for i in range(16)]
    trainer = FSDP2Trainer(model=tiny_llama(32), args=args(), train_dataset=rows, deepspeed=DS)
    config = trainer.accelerator.fsdp2_config
    trainer.train()
    train_loss = trainer.state.log_history[-1]["train_loss"]
    plugin = FSDP2Plugin(config={"sharding_strategy": "FULL_SHARD", "cpu_offload": True})
    explicit = FSDP2Trainer(model=tiny_llama(32), args=args(), train_dataset=rows, fsdp_plugin=plugin)
    explicit.train()
    refused = {}
    for name, build in {
        "mismatch": lambda: FSDP2Trainer(model=tiny_llama(32), args=args(per_device_train_batch_size=4, max_grad_norm=0.5), deepspeed=DS),
        "both": lambda: FSDP2Trainer(model=tiny_llama(32), args=args(), deepspeed=DS, fsdp_plugin=FSDP2Plugin()),
    }.items():  # fmt: skip
        try:
            build()
            refused[name] = "no error"
        except ValueError as exc:
            refused[name] = str(exc)
    r = {
        "strategy": config.sharding_strategy,
        "cpu_offload": config.cpu_offload,
        "sharded": sum(type(p).__name__ == "DTensor" for p in trainer.model.parameters()),
        "steps": trainer.state.global_step,
        "train_loss": train_loss,
        "explicit_loss": explicit.state.log_history[-1]["train_loss"],
        "refused": refused,
    }
    check = Checks(r)
    check.equal("ZeRO-3 is FULL_SHARD", r["strategy"], "FULL_SHARD")
    check.that("offload_optimizer is cpu offload", r["cpu_offload"] is True, r["cpu_offload"])
    check.equal("2 steps", r["steps"], 2)
    check.that("the parameters are sharded", r["sharded"] > 0, r["sharded"])
    # The same run as with the equivalent settings written out (same seed, data and order).
    check.equal("the loss equals the equivalent FSDP2 settings'", r["train_loss"], r["explicit_loss"])
    check.that("the loss is positive", r["train_loss"] > 0, r["train_loss"])
    mismatch = refused["mismatch"]
    check.that(
        "a micro batch mismatch is named with both values",
        "DeepSpeed train_micro_batch_size_per_gpu=2 vs TrainingArguments per_device_train_batch_size=4" in mismatch,
        mismatch,
    )
    check.that(
        "a clipping mismatch is named with both values",
        "DeepSpeed gradient_clipping=1.0 vs TrainingArguments max_grad_norm=0.5" in mismatch,
        mismatch,
    )
    check.that('the mismatch error says to set "auto"', 'Set those DeepSpeed values to "auto"' in mismatch, mismatch)
    check.that("deepspeed= with fsdp_plugin= is refused: give one", "give one" in refused["both"], refused["both"])
    return {"deepspeed_config": r}


PER_RANK = ["deepspeed_config.train_loss", "deepspeed_config.explicit_loss"]
"""Each rank's own logged train_loss (of its own batches), in both runs."""


def test_a_deepspeed_config_becomes_the_fsdp2_settings_and_trains(tmp_path):
    results = run_distributed(_world, 2, str(tmp_path), timeout=240)
    FlowReports(results, PER_RANK).assert_passed("deepspeed_config")


def test_training_arguments_deepspeed_is_refused_with_the_move(monkeypatch):
    """Where DeepSpeed is installed `TrainingArguments(deepspeed=...)` builds; FSDP2Trainer then names the move."""
    from fsdp2_strategy.integrations.transformers.trainer import _refuse_other_engines

    class Args:
        deepspeed = "ds_config.json"

    with pytest.raises(ValueError, match=r"move the file to FSDP2Trainer\(deepspeed=\.\.\.\)"):
        _refuse_other_engines(Args())


EXPLICIT = {
    "zero_optimization": {"stage": 2},
    "bf16": {"enabled": True},
    "train_micro_batch_size_per_gpu": 3,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 0.5,
    "train_batch_size": 24,
}
"""Every trainer value stated (not "auto"): each one is compared with TrainingArguments."""


@pytest.mark.parametrize(
    "change, named",
    [
        ({"gradient_accumulation_steps": 2}, "DeepSpeed gradient_accumulation_steps=4 vs TrainingArguments gradient_accumulation_steps=2"),
        ({"max_grad_norm": 1.0}, "DeepSpeed gradient_clipping=0.5 vs TrainingArguments max_grad_norm=1.0"),
        ({"per_device_train_batch_size": 2}, "DeepSpeed train_micro_batch_size_per_gpu=3 vs TrainingArguments per_device_train_batch_size=2"),
        ({"bf16": False}, "DeepSpeed bf16.enabled=true vs TrainingArguments bf16=False, fp16=False"),
        ({"bf16": False, "fp16": True}, "DeepSpeed bf16.enabled=true vs TrainingArguments bf16=False, fp16=True"),
    ],
)  # fmt: skip
def test_each_stated_deepspeed_value_is_checked_against_training_arguments(change, named):
    """`FSDP2Trainer(deepspeed=...)`'s check, value by value: equal arguments pass; one argument changed
    is named with both values (the stock integration's `fill_match` check)."""
    from types import SimpleNamespace

    import fsdp2_strategy as f2
    from fsdp2_strategy.integrations.transformers.trainer import _check_deepspeed_agrees

    translation = f2.translate_deepspeed(EXPLICIT, warn=False)
    agreeing = dict(
        gradient_accumulation_steps=4, max_grad_norm=0.5, per_device_train_batch_size=3, bf16=True, fp16=False
    )
    _check_deepspeed_agrees(translation, SimpleNamespace(**agreeing), world_size=2)  # 3 x 4 x 2 = 24
    with pytest.raises(ValueError, match="disagrees with TrainingArguments") as info:
        _check_deepspeed_agrees(translation, SimpleNamespace(**{**agreeing, **change}), world_size=2)
    assert named in str(info.value)
    with pytest.raises(ValueError, match="DeepSpeed train_batch_size=24 vs TrainingArguments train_batch_size=36"):
        _check_deepspeed_agrees(translation, SimpleNamespace(**agreeing), world_size=3)


def test_a_deepspeed_config_stating_fp32_is_checked_against_bf16_arguments():
    from types import SimpleNamespace

    import fsdp2_strategy as f2
    from fsdp2_strategy.integrations.transformers.trainer import _check_deepspeed_agrees

    translation = f2.translate_deepspeed({"bf16": {"enabled": False}}, warn=False)
    args = dict(gradient_accumulation_steps=1, max_grad_norm=1.0, per_device_train_batch_size=2, fp16=False)
    _check_deepspeed_agrees(translation, SimpleNamespace(**args, bf16=False), world_size=1)
    with pytest.raises(ValueError, match=r"DeepSpeed bf16/fp16 disabled \(fp32\) vs TrainingArguments bf16=True"):
        _check_deepspeed_agrees(translation, SimpleNamespace(**args, bf16=True), world_size=1)

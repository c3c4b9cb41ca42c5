"""An accelerate config with `distributed_type: DEEPSPEED`, run on this engine instead of DeepSpeed.

`accelerate launch` passes a DeepSpeed config as `ACCELERATE_USE_DEEPSPEED=true` plus either the
file (`deepspeed_config_file:` -> `ACCELERATE_DEEPSPEED_CONFIG_FILE`) or the inline
`deepspeed_config:` keys (`ACCELERATE_DEEPSPEED_ZERO_STAGE`, ...). `deepspeed_launch()` rebuilds
that DeepSpeed config, has the core translate it (`f2.translate_deepspeed`) and resolves it as stock
Accelerate does with DeepSpeed: the file's precision, accumulation and clipping win over the
accelerate config's defaults, and an accelerate config that also sets them beside a file is refused.
`FSDP2Plugin()` shards by the result; `FSDP2Accelerator` applies the trainer values
(`apply_to_accelerator`) and logs one summary.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import fsdp2_strategy as f2
from fsdp2_strategy.distributed import log_rank_zero

from .keys import deepspeed_keys, flag, where

SET_IN_THE_FILE = (
    "gradient_accumulation_steps",
    "gradient_clipping",
    "zero_stage",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_optimizer_nvme_path",
    "offload_param_nvme_path",
    "zero3_save_16bit_model",
    "mixed_precision",
)
"""accelerate config keys that stock Accelerate refuses beside a `deepspeed_config_file` (the file
holds them); `accelerate launch` lists the keys a config set in ACCELERATE_CONFIG_DS_FIELDS."""


def deepspeed_requested(env: Mapping[str, str] | None = None) -> bool:
    """Whether the launch asked for DeepSpeed (`distributed_type: DEEPSPEED`)."""
    return bool(flag(os.environ if env is None else env, "ACCELERATE_USE_DEEPSPEED"))


def deepspeed_config(env: Mapping[str, str]) -> dict[str, Any]:
    """The DeepSpeed config the launch carries: its file, else the inline keys.

    Raises:
        FileNotFoundError: `deepspeed_config_file` names a file that does not exist.
        ValueError: a variable that is not a number where DeepSpeed wants one.
    """
    path = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if path and path.strip().lower() != "none":
        if not Path(path).is_file():
            raise FileNotFoundError(
                f"{where('ACCELERATE_DEEPSPEED_CONFIG_FILE')}={path!r} does not exist; fix the path in your "
                "accelerate config."
            )
        return json.loads(Path(path).read_text())
    config: dict[str, Any] = {}
    for key in deepspeed_keys():
        raw = env.get(key.var)
        if raw is None or raw.strip().lower() in ("", "none"):
            continue
        try:
            value = key.number(raw) if key.number is not None else raw
        except ValueError:
            raise ValueError(f"{where(key.var)}={raw!r} is not a number.") from None
        node = config
        for part in key.deepspeed_path[:-1]:
            node = node.setdefault(part, {})
        node[key.deepspeed_path[-1]] = value
    return config


@dataclass(frozen=True)
class DeepSpeedLaunch:
    """A `distributed_type: DEEPSPEED` launch, resolved as stock Accelerate resolves it.

    Attributes:
        translation: the DeepSpeed config, translated by the core.
        source: where the config came from (the file, or the inline keys), for messages.
        launcher_precision: the accelerate config's `mixed_precision` (ACCELERATE_MIXED_PRECISION).
    """

    translation: f2.DeepSpeedTranslation
    source: str
    launcher_precision: str | None

    @property
    def mixed_precision(self) -> str | None:
        """The precision ("no", "bf16" or "fp16"): the DeepSpeed config's where it states one (as stock Accelerate's
        DeepSpeed path), else the accelerate config's; None where neither says."""
        return self.translation.precision or self.launcher_precision

    @property
    def gradient_accumulation_steps(self) -> int | None:
        return self.translation.trainer.get("gradient_accumulation_steps")

    @property
    def max_grad_norm(self) -> float | None:
        return self.translation.trainer.get("max_grad_norm")

    def fields(self) -> dict[str, Any]:
        """The `FSDP2Config` fields (the stage's strategy stated even where it is the default)."""
        changed = self.translation.changed_fields()
        changed.pop("mixed_precision", None)  # `mixed_precision` above decides
        return {"sharding_strategy": self.translation.config.sharding_strategy, **changed}


def deepspeed_launch(env: Mapping[str, str] | None = None) -> DeepSpeedLaunch | None:
    """The DeepSpeed launch in `env` (default `os.environ`); None for any other launch.

    Raises:
        ValueError: the accelerate config sets values beside a `deepspeed_config_file` that the file
            must hold (stock Accelerate refuses them too), or a `mixed_precision` other than the file's;
            any error of `deepspeed_config` or `f2.translate_deepspeed`.
    """
    env = os.environ if env is None else env
    if not deepspeed_requested(env):
        return None
    config = deepspeed_config(env)
    file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    source = "the inline deepspeed_config keys" if file.strip().lower() == "none" else f"deepspeed_config_file {file}"
    if source != "the inline deepspeed_config keys":
        _refuse_keys_beside_the_file(env, file)
    world = env.get("WORLD_SIZE")
    translation = f2.translate_deepspeed(
        config, world_size=int(world) if world and world.isdigit() else None, warn=False
    )
    launcher = (env.get("ACCELERATE_MIXED_PRECISION") or "").strip().lower() or None
    stated = translation.precision
    if stated is not None and launcher not in (None, "no", stated):
        raise ValueError(
            f"{where('ACCELERATE_MIXED_PRECISION')}={launcher!r} conflicts with the DeepSpeed config ({source}), "
            f"whose bf16/fp16 sections say {stated!r}; the DeepSpeed config decides: set mixed_precision: no in "
            "the accelerate config, or change the DeepSpeed config."
        )
    return DeepSpeedLaunch(translation, source, launcher)


def _refuse_keys_beside_the_file(env: Mapping[str, str], file: str) -> None:
    given = [k.strip() for k in env.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",") if k.strip()]
    both = [k for k in given if k in SET_IN_THE_FILE]
    if both:
        raise ValueError(
            f"The accelerate config sets {', '.join(both)} beside deepspeed_config_file {file}, which holds "
            "them (stock Accelerate refuses this too): remove them from the accelerate config and set them in "
            "the DeepSpeed file (bf16/fp16 sections, gradient_accumulation_steps, gradient_clipping, "
            "zero_optimization)."
        )


def apply_to_accelerator(accelerator: Any, launch: DeepSpeedLaunch) -> list[str]:
    """Give `accelerator` the DeepSpeed config's accumulation (which wins, as in stock Accelerate)
    and return what was applied, one line each, for the summary (clipping: `clip_before_each_step`)."""
    stated, launcher = launch.translation.precision, launch.launcher_precision
    if stated is None:
        why = "the accelerate config's mixed_precision; the DeepSpeed config leaves it open"
    else:
        why = "the DeepSpeed config's" + (
            f", over the accelerate config's {launcher!r}" if launcher not in (None, stated) else ""
        )
    applied = [f"mixed precision: {accelerator.mixed_precision} ({why})"]
    steps = launch.gradient_accumulation_steps
    if steps is not None:
        before = accelerator.gradient_accumulation_steps
        accelerator.gradient_accumulation_steps = steps
        over = f" (over the accelerator's {before})" if before != steps else ""
        applied.append(f"gradient accumulation: {steps} micro-batches a step{over}")
    if launch.max_grad_norm is not None:
        applied.append(f"gradient clipping: global norm {launch.max_grad_norm}, before each optimizer step")
    for name in ("per_device_train_batch_size", "train_batch_size"):
        if name in launch.translation.trainer:
            key = launch.translation.source_key(name)
            value = launch.translation.trainer[name]
            applied.append(f"{key}={value}: your DataLoader's batch_size decides (as with stock Accelerate)")
    return applied


def log_summary(launch: DeepSpeedLaunch, applied: list[str]) -> None:
    """One WARNING block (rank 0): each DeepSpeed key, what it became or what to do, and what the
    accelerator applied."""
    log_rank_zero(
        "distributed_type: DEEPSPEED runs on FSDP2 here. The DeepSpeed config (%s) became:\n%s\nApplied:\n%s",
        launch.source,
        launch.translation.summary(),
        "\n".join(f"  {line}" for line in applied),
        level=30,
    )


def clip_before_each_step(optimizer: torch.optim.Optimizer, max_norm: float | None) -> None:
    """Clip the gradients of `optimizer`'s parameters to global norm `max_norm` right before each of
    its steps, as DeepSpeed's `gradient_clipping` does inside its engine (once per optimizer)."""
    if max_norm is None or getattr(optimizer, "_fsdp2_deepspeed_clipping", None) is not None:
        return

    def clip(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        f2.clip_grad_norm_([p for group in opt.param_groups for p in group["params"]], max_norm)

    optimizer._fsdp2_deepspeed_clipping = optimizer.register_step_pre_hook(clip)  # type: ignore[attr-defined]

"""An accelerate config with `distributed_type: DEEPSPEED`, run on this engine instead of DeepSpeed.

`accelerate launch` passes a DeepSpeed config as `ACCELERATE_USE_DEEPSPEED=true` plus either the
file (`deepspeed_config_file:` -> `ACCELERATE_DEEPSPEED_CONFIG_FILE`) or the inline
`deepspeed_config:` keys (`ACCELERATE_DEEPSPEED_ZERO_STAGE`, ...). `deepspeed_fields()` rebuilds
that DeepSpeed config and has the core translate it (`f2.translate_deepspeed`: one log line saying
what was mapped, one warning listing what was not); `FSDP2Plugin()` shards by the result.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import fsdp2_strategy as f2

INLINE = {
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": (("zero_optimization", "stage"), int),
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": (("zero_optimization", "offload_optimizer", "device"), str),
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": (("zero_optimization", "offload_param", "device"), str),
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": (("gradient_accumulation_steps",), int),
    "ACCELERATE_GRADIENT_CLIPPING": (("gradient_clipping",), float),
    "ACCELERATE_DEEPSPEED_ZERO3_INIT": (("zero3_init_flag",), str),
    "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": (("zero3_save_16bit_model",), str),
}
"""`accelerate launch`'s variable -> (path in the DeepSpeed config, type)."""


def deepspeed_requested(env: Mapping[str, str] | None = None) -> bool:
    """Whether the launch asked for DeepSpeed (`distributed_type: DEEPSPEED`)."""
    env = os.environ if env is None else env
    return env.get("ACCELERATE_USE_DEEPSPEED", "false").strip().lower() in ("true", "1", "yes")


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
                f"ACCELERATE_DEEPSPEED_CONFIG_FILE={path!r} (accelerate config `deepspeed_config_file`) does not "
                "exist; fix the path in your accelerate config."
            )
        return json.loads(Path(path).read_text())
    config: dict[str, Any] = {}
    for var, (keys, kind) in INLINE.items():
        raw = env.get(var)
        if raw is None or raw.strip().lower() in ("", "none"):
            continue
        try:
            value = kind(raw)
        except ValueError:
            raise ValueError(f"{var}={raw!r} (accelerate config `deepspeed_config`) is not a number.") from None
        node = config
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return config


def deepspeed_fields(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`FSDP2Config` fields for a DeepSpeed launch ({} for any other launch; errors: `deepspeed_config`)."""
    env = os.environ if env is None else env
    if not deepspeed_requested(env):
        return {}
    world = env.get("WORLD_SIZE")
    translated = f2.translate_deepspeed(
        deepspeed_config(env), world_size=int(world) if world and world.isdigit() else None
    )
    # The stage's strategy stated even where it is the default.
    return {"sharding_strategy": translated.config.sharding_strategy, **translated.changed_fields()}

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

from .keys import deepspeed_keys, flag, where


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

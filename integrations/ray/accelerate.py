"""`FSDP2Accelerator` inside a Ray train function, configured from an accelerate config file.

Ray starts the workers and the process group, so no `accelerate launch` turns the config file
into the `FSDP_*` variables `FSDP2Plugin()` reads; `accelerator_from_config` does that step.
"""

from __future__ import annotations

import os
from typing import Any

from fsdp2_strategy.integrations.accelerate import FSDP2Accelerator, FSDP2Plugin
from fsdp2_strategy.integrations.accelerate.config_file import apply_accelerate_config

__all__ = ["accelerator_from_config"]


def accelerator_from_config(config_file: str | os.PathLike, **kwargs: Any) -> FSDP2Accelerator:
    """An `FSDP2Accelerator` configured as `accelerate launch --config_file config_file` would configure it.

    `kwargs` go to `FSDP2Accelerator` (e.g. `gradient_accumulation_steps`).
    """
    apply_accelerate_config(config_file)
    return FSDP2Accelerator(fsdp_plugin=FSDP2Plugin(), **kwargs)

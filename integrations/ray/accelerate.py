"""`FSDP2Accelerator` inside a Ray train function, configured from an accelerate config file, its
`save_state` directories reported to Ray.

Ray starts the workers and the process group, so no `accelerate launch` turns the config file
into the `FSDP_*` variables `FSDP2Plugin()` reads; `accelerator_from_config` does that step.
`RayFSDP2Accelerator.save_state(..., metrics=...)` reports each directory once committed (with
`checkpoint_async_save`, when the next save, `load_state`, `end_training()` or
`wait_for_checkpoint()` commits it), as `RayFSDP2Strategy` does for Lightning; after a restart,
`accelerator.load_state(ray.train.get_checkpoint().path)` resumes from Ray's copy.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

from fsdp2_strategy.integrations.accelerate import FSDP2Accelerator, FSDP2Plugin
from fsdp2_strategy.integrations.accelerate import checkpoint as accelerate_checkpoint
from fsdp2_strategy.integrations.accelerate.config_file import apply_accelerate_config

from .checkpoint import report_dir

__all__ = ["RayFSDP2Accelerator", "accelerator_from_config"]


class RayFSDP2Accelerator(FSDP2Accelerator):
    """`FSDP2Accelerator` whose `save_state` reports every committed directory to Ray.

    Args:
        report_checkpoints: report each `save_state` directory (`ray.train.report`) with the
            `metrics` passed to `save_state` (default True). Saves are collective, so every worker
            reports the same number of times, as Ray requires.
        **kwargs: `FSDP2Accelerator`'s arguments.
    """

    def __init__(self, *, report_checkpoints: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.report_checkpoints = report_checkpoints

    def save_state(
        self,
        output_dir: str | os.PathLike | None = None,
        safe_serialization: bool = True,
        *,
        metrics: Mapping[str, Any] | None = None,
        **save_model_func_kwargs: Any,
    ) -> str:
        """`FSDP2Accelerator.save_state`, then the committed directory reported to Ray with `metrics`."""
        if save_model_func_kwargs or not self.report_checkpoints:
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        report = functools.partial(report_dir, metrics=dict(metrics or {}))
        return accelerate_checkpoint.save_state(self, output_dir, safe_serialization, on_commit=report)


def accelerator_from_config(
    config_file: str | os.PathLike, *, plugin: Mapping[str, Any] | None = None, **kwargs: Any
) -> RayFSDP2Accelerator:
    """A `RayFSDP2Accelerator` configured as `accelerate launch --config_file config_file` would configure it.

    `plugin`: `FSDP2Plugin` keywords on top of the file's (`FSDP2Config` fields such as
    `checkpoint_async_save`, `keep_last`); `kwargs` go to `RayFSDP2Accelerator` (e.g.
    `gradient_accumulation_steps`, `project_config`, `report_checkpoints`).
    """
    apply_accelerate_config(config_file)
    return RayFSDP2Accelerator(fsdp_plugin=FSDP2Plugin(**dict(plugin or {})), **kwargs)

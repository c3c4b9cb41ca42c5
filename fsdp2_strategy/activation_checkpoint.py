"""Activation checkpointing: recompute the activations of chosen blocks in backward.

`FSDP2Config.activation_checkpointing` names the blocks: "auto" (the blocks the wrap policy
made groups of), or module classes / class names. Used by `shard_model` on the real model and
by the memory estimator on its meta-device copy, so both see the same recomputation.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from . import _torch_compat as tc
from .groups import top_level
from .wrap_policy import resolve_classes


def apply_activation_checkpointing(model: nn.Module, spec: Any, groups: list[str]) -> None:
    """Checkpoint, in place and before `fully_shard`, the outermost modules `spec` selects
    (`groups`: the qualified names of the wrapped blocks, which "auto" means)."""
    if spec is None:
        return
    if spec == "auto":
        names = top_level(groups)
        if not names:
            raise ValueError(
                "FSDP2Config.activation_checkpointing='auto' checkpoints the wrapped blocks, but the wrap "
                "policy selected none; name the block classes explicitly."
            )
    else:
        classes = resolve_classes(model, spec, "FSDP2Config.activation_checkpointing")
        names = top_level([n for n, m in model.named_modules() if n and isinstance(m, classes)])
    for name in names:
        # The composable API keeps parameter names unchanged (a wrapper module would add a
        # prefix to every checkpoint key).
        tc.composable_checkpoint(model.get_submodule(name))

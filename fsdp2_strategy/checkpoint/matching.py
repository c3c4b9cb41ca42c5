"""Whether a checkpoint fits a model: keys, shapes and (trainable-only checkpoints) the frozen base.

Every check raises `ValueError` naming what differs before anything is loaded (`directory.load_dir`
runs them first); `directory` re-exports them for the adapters.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .trainable import base_mismatches

MAX_LISTED = 20
"""Keys listed per category in a mismatch error."""


def check_same_base(path: Path, key: str, saved: str, model: nn.Module) -> None:
    """Collective: raise ValueError (before anything is applied) if the frozen parameters of `model`
    are not the base the trainable-only checkpoint at `path` was trained on."""
    problems = base_mismatches(saved, model)
    if problems:
        raise ValueError(
            f"Checkpoint {path} holds only the trainable state of {key!r}, trained on another frozen base than "
            f"this model's ({len(problems)} parameters differ):\n  "
            + "\n  ".join(problems[:MAX_LISTED])
            + "\nBuild the model from the same pretrained weights (and adapter config) before loading."
        )


def check_compatible(
    metadata: Metadata,
    current: Mapping[str, Any],
    prefix: str,
    path: Path,
    extra_problems: list[str] | None = None,
    *,
    strict: bool = True,
) -> None:
    """Raise ValueError listing keys and shapes that differ between the checkpoint and `current`.

    `current` is the model's (sharded) state dict; its keys sit under `prefix` in the checkpoint.
    `strict=False` tolerates missing and unexpected keys (shape mismatches still raise).
    """
    saved = saved_keys(metadata, prefix)
    missing = sorted(set(current) - set(saved)) if strict else []
    unexpected = sorted(set(saved) - set(current)) if strict else []
    shapes = sorted(
        f"{k}: checkpoint {tuple(saved[k].size)} vs model {tuple(current[k].shape)}"
        for k in set(saved) & set(current)
        if isinstance(saved[k], TensorStorageMetadata)
        and isinstance(current[k], torch.Tensor)
        and tuple(saved[k].size) != tuple(current[k].shape)
    )
    problems = [
        f"{label} ({len(items)}): {_listing(items)}"
        for label, items in (
            ("missing in checkpoint", missing),
            ("unexpected in checkpoint", unexpected),
            ("shape mismatch", shapes),
        )
        if items
    ] + list(extra_problems or [])
    if problems:
        raise ValueError(f"Checkpoint {path} does not match the model:\n  " + "\n  ".join(problems))


def saved_keys(metadata: Metadata, prefix: str) -> dict[str, Any]:
    """The checkpoint's entries under `prefix`, keyed without it."""
    return {k[len(prefix) :]: v for k, v in metadata.state_dict_metadata.items() if k.startswith(prefix)}


def has_prefix(metadata: Metadata, prefix: str) -> bool:
    """Whether any saved key starts with `prefix` (e.g. optimizer state was saved)."""
    return any(k.startswith(prefix) for k in metadata.state_dict_metadata)


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:MAX_LISTED])
    return shown + (f", ... and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else "")

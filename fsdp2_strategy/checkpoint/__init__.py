"""Checkpoints: models and optimizers to and from the sharded state dict (`state`), one atomic
DCP directory with its commit marker and checksums (`directory`, `integrity`), one directory per
step (`Checkpointer`), and full weights in and out (`full_weights`, `export`).

Imports the base modules and `shard` (full-weight loading copies into shards). `__all__` is what
other packages and the adapters use; `directory` is the atomic-directory API the adapters build
their own checkpoint layouts on.
"""

from . import directory
from .checkpointer import Checkpointer, load_step_dir, step_dir_name
from .export import export_full, inspect_checkpoint, read_full_model_state, write_model_view
from .full_weights import load_full_weights
from .state import Models, Optimizers, optimizer_state_dict, owning_models, sharded_state, unstepped_kept

__all__ = [
    "Checkpointer",
    "Models",
    "Optimizers",
    "directory",
    "export_full",
    "inspect_checkpoint",
    "load_full_weights",
    "load_step_dir",
    "optimizer_state_dict",
    "owning_models",
    "read_full_model_state",
    "sharded_state",
    "step_dir_name",
    "unstepped_kept",
    "write_model_view",
]

"""Checkpoints: models and optimizers to and from the sharded state dict (`state`), one atomic
DCP directory with its commit marker and checksums (`directory`, `integrity`), asynchronous and
overlapped saves (`async_save`), one directory per step (`Checkpointer`), whether a checkpoint fits
a model (`matching`), the layouts a failed load names and the optimizer groups it checks
(`layout`), every checkpoint file read as data (`safe_load`), resuming a trainer from a converted step (`converted`), full weights in and out (`full_weights`,
`export`, `weight_stream`), trainable-only checkpoints (`trainable`) and PEFT adapters and merged
weights out (`peft`, `peft_export`).

Imports the base modules and `shard` (full-weight loading copies into shards). `__all__` is what
other packages and the adapters use; `directory` is the atomic-directory API the adapters build
their own checkpoint layouts on.
"""

from . import directory
from .async_save import AsyncSaver, make_saver
from .checkpointer import EXTRA_FILE, MODEL_KEY, OPTIM_KEY, Checkpointer, load_step_dir, step_dir_name
from .converted import is_checkpointer_step, load_into, resume_counters, step_extra
from .export import export_full, inspect_checkpoint, read_full_model_state, write_model_view
from .full_weights import load_full_weights
from .peft import peft_models, save_peft_adapter
from .peft_export import export_peft
from .safe_load import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UntrustedCheckpointError,
    load_small_file,
    read_metadata_file,
)
from .state import (
    Models,
    Optimizers,
    model_state,
    optimizer_state_dict,
    owning_models,
    sharded_state,
    side_entries,
    unstepped_kept,
)
from .trainable import saves_trainable_only
from .weight_stream import full_weights, save_merged

__all__ = [
    "EXTRA_FILE",
    "MODEL_KEY",
    "OPTIM_KEY",
    "AsyncSaver",
    "Checkpointer",
    "Models",
    "Optimizers",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "UntrustedCheckpointError",
    "directory",
    "export_full",
    "export_peft",
    "inspect_checkpoint",
    "is_checkpointer_step",
    "load_full_weights",
    "load_into",
    "load_small_file",
    "load_step_dir",
    "make_saver",
    "model_state",
    "optimizer_state_dict",
    "owning_models",
    "peft_models",
    "read_full_model_state",
    "read_metadata_file",
    "resume_counters",
    "step_extra",
    "full_weights",
    "save_merged",
    "save_peft_adapter",
    "saves_trainable_only",
    "side_entries",
    "sharded_state",
    "step_dir_name",
    "unstepped_kept",
    "write_model_view",
]

"""Every private transformers / Accelerate name the Trainer adapter touches, in one place, checked at import.

`transformers.Trainer` (5.x) has no hook for another sharding engine; the adapter overrides these
methods of it (their stock bodies call Accelerate's FSDP1-shaped helpers or build the stock
`Accelerator`):

- `create_accelerator_and_postprocess` (builds the `Accelerator`; reuses `_build_accelerator_args`);
- `_save_checkpoint`, `_load_from_checkpoint`, `_load_optimizer_and_scheduler`, `_load_best_model`
  (checkpoints become `FSDP2Accelerator.save_state` directories) and `_save_rng_state`, `_save`
  (reused inside them);
- `_finalize_training` (its end-of-training deletion of checkpoints other than the best is done
  crash-safely before it runs);
- `_has_mixed_mesh_grads` (the Trainer clips by its own per-mesh norm when it sees gradients on
  several meshes; the core's `clip_grad_norm_` spans meshes itself);
- `_prepare_context_parallel_inputs` and `get_cp_size` (they read Accelerate's parallelism_config,
  which FSDP2Accelerator leaves None; the adapter's own read its mesh), and `_get_num_items_in_batch`
  (transformers 5.17-5.18 divide its count by that config's sizes: the adapter divides by cp);
- the file names `TRAINER_STATE_NAME`, `SCHEDULER_NAME`, `TRAINING_ARGS_NAME` of `transformers.trainer`.

And `accelerate.state.AcceleratorState._reset_state`: `TrainingArguments` sets up Accelerate's state
before the Trainer exists; on CPU without `use_cpu` it decides "one process, not distributed" for
every rank of a launch, and that state has to be dropped before `FSDP2Accelerator` builds the real one.

`check_private_api()` runs at import and raises one ImportError naming everything that moved.
"""

from __future__ import annotations

import transformers

from fsdp2_strategy.versions import find_private, private_api_error

_missing: list[str] = []
TRAINER_METHODS = (
    "create_accelerator_and_postprocess",
    "_build_accelerator_args",
    "_save_checkpoint",
    "_load_from_checkpoint",
    "_load_optimizer_and_scheduler",
    "_load_best_model",
    "_save_rng_state",
    "_save",
    "_has_mixed_mesh_grads",
    "_get_output_dir",
    "_push_from_checkpoint",
    "_finalize_training",
    "_prepare_context_parallel_inputs",
    "get_cp_size",
    "_get_num_items_in_batch",
)
for _name in TRAINER_METHODS:
    find_private(f"transformers.trainer:Trainer.{_name}", _missing)
TRAINER_STATE_NAME: str = find_private("transformers.trainer:TRAINER_STATE_NAME", _missing)
SCHEDULER_NAME: str = find_private("transformers.trainer:SCHEDULER_NAME", _missing)
TRAINING_ARGS_NAME: str = find_private("transformers.trainer:TRAINING_ARGS_NAME", _missing)
_reset_state = find_private("accelerate.state:AcceleratorState._reset_state", _missing)


def check_private_api() -> None:
    """Raise ImportError naming every transformers / Accelerate name above that a release moved."""
    if _missing:
        raise private_api_error(
            "fsdp2_strategy's transformers adapter", "transformers", transformers.__version__, _missing
        )


def reset_accelerate_state() -> None:
    """Drop Accelerate's shared process state (and the Accelerator state on top of it)."""
    _reset_state(reset_partial_state=True)


check_private_api()

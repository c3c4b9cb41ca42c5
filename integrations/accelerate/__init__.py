"""Hugging Face Accelerate adapter: `FSDP2Accelerator` + `FSDP2Plugin`, backed by the core.

    from fsdp2_strategy.integrations.accelerate import FSDP2Accelerator, FSDP2Plugin

    accelerator = FSDP2Accelerator(fsdp_plugin=FSDP2Plugin())   # reads `accelerate launch`'s FSDP config
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

Run it with `accelerate launch --config_file fsdp2.yaml train.py`, where `fsdp2.yaml` is an
ordinary accelerate FSDP config with `fsdp_version: 2` (see examples/accelerate_fsdp2.yaml).

What changes against the stock `Accelerator` (same arguments, same methods):
- `prepare` shards every model with `fsdp2_strategy.shard_model` (several models per call,
  a model alone for evaluation) and points optimizers built before it at the shards;
  on CPU it runs real FSDP2 over gloo, where Accelerate 1.15 falls back to DDP or to
  unsynchronised processes;
- `accumulate`/`no_sync` follow `FSDP2Config.accumulation` on non-final micro-batches (core
  `no_sync`): "sync_last" (default) skips the reduce-scatter, "keep_gathered" also keeps the
  parameters gathered for the whole step (one all-gather per group per optimizer step), and
  `GradientAccumulationPlugin(sync_each_batch=True)` selects "sync_each" (reduce every
  micro-batch, sharded gradients; HSDP's all-reduce still waits for the last one);
  `clip_grad_norm_` is the core's global norm; mixed precision is an FSDP2 policy
  ("bf16": bf16 compute, fp32 master weights and gradient reduction), not autocast;
- `save_state`/`load_state` write and read atomic, checksummed DCP directories (any world
  size on load); `get_state_dict` gathers full weights to rank 0 one tensor at a time and
  `save_model` writes them as Hugging Face safetensors (plus `config.json` for HF models).
"""

from .accelerator import FSDP2Accelerator
from .config_file import accelerate_config_env, apply_accelerate_config
from .env import read_accelerate_env
from .plugin import FSDP2Plugin

__all__ = [
    "FSDP2Accelerator",
    "FSDP2Plugin",
    "accelerate_config_env",
    "apply_accelerate_config",
    "read_accelerate_env",
]

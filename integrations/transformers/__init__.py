"""Hugging Face `transformers.Trainer` (and TRL's trainers, its subclasses) on the fsdp2_strategy engine.

    from fsdp2_strategy.integrations.transformers import FSDP2Trainer as Trainer   # the one-line change

    from trl import SFTTrainer
    from fsdp2_strategy.integrations.transformers import fsdp2_trainer
    SFTTrainer = fsdp2_trainer(SFTTrainer)                # or: class MySFT(FSDP2TrainerMixin, SFTTrainer)

Run it with `accelerate launch --config_file fsdp2.yaml train.py` (an accelerate FSDP config with
`fsdp_version: 2`, see examples/accelerate_fsdp2.yaml). The Trainer then builds `FSDP2Accelerator`
instead of the stock `Accelerator`: the model is sharded by the core on CPU (gloo) as on GPUs, each
process gets its share of every batch, `max_grad_norm` clips by the global norm, `bf16=True` is an
FSDP2 policy, checkpoints are committed, checksummed `save_state` directories, and `save_model()`
writes Hugging Face safetensors (or a PEFT adapter) for either `fsdp_state_dict_type`.
See docs/integrations/transformers.md.
"""

from .checkpoint import committed_checkpoints, latest_checkpoint
from .trainer import FSDP2Trainer, FSDP2TrainerMixin, fsdp2_trainer

__all__ = ["FSDP2Trainer", "FSDP2TrainerMixin", "committed_checkpoints", "fsdp2_trainer", "latest_checkpoint"]

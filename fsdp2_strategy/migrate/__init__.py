"""Coming from another engine: a DeepSpeed config read as an `FSDP2Config` plus what the trainer
must set (`translate_deepspeed`), and a DeepSpeed ZeRO checkpoint converted into a resumable checkpoint
of ours (`convert_deepspeed_checkpoint`; its files read without DeepSpeed in `zero_files`, its
parameters assembled in `zero_tensors`).

Imports the base modules and `checkpoint`. `__all__` is what other packages, the CLI and the adapters use.
"""

from .convert_deepspeed import ConvertedCheckpoint, convert_deepspeed_checkpoint
from .deepspeed import DeepSpeedTranslation, translate_deepspeed

__all__ = ["ConvertedCheckpoint", "DeepSpeedTranslation", "convert_deepspeed_checkpoint", "translate_deepspeed"]

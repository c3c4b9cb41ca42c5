"""Coming from another engine: a DeepSpeed config read as an `FSDP2Config` plus what the trainer
must set (`translate_deepspeed`), and a DeepSpeed ZeRO checkpoint converted into a resumable checkpoint
of ours (`convert_deepspeed_checkpoint`; its files read without DeepSpeed in `zero_files`, its
parameters assembled in `zero_tensors`); an FSDP1 checkpoint (torch, Lightning, Accelerate; sharded or
full) likewise (`convert_fsdp1_checkpoint`; its formats in `fsdp1_formats`, read tensor by tensor in
`fsdp1_files`). Both write through `stream_write`, one tensor at a time.

Imports the base modules and `checkpoint`. `__all__` is what other packages, the CLI and the adapters use.
"""

from .convert_deepspeed import ConvertedCheckpoint, convert_deepspeed_checkpoint
from .convert_fsdp1 import ConvertedFSDP1Checkpoint, convert_fsdp1_checkpoint
from .deepspeed import DeepSpeedTranslation, translate_deepspeed

__all__ = [
    "ConvertedCheckpoint",
    "ConvertedFSDP1Checkpoint",
    "DeepSpeedTranslation",
    "convert_deepspeed_checkpoint",
    "convert_fsdp1_checkpoint",
    "translate_deepspeed",
]

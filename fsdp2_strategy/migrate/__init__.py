"""Coming from another engine: a DeepSpeed config read as an `FSDP2Config` plus what the trainer
must set (`translate_deepspeed`).

Imports the base modules only. `__all__` is what other packages, the CLI and the adapters use.
"""

from .deepspeed import DeepSpeedTranslation, translate_deepspeed

__all__ = ["DeepSpeedTranslation", "translate_deepspeed"]

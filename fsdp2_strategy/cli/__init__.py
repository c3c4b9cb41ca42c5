"""The `fsdp2-strategy` command line: `consolidate`, `export` (PEFT) and `inspect` sharded checkpoints (`main`),
`plan` memory for a model (`plan`), `tune` its throughput (`tune`), translate a DeepSpeed config
(`from_deepspeed`), convert DeepSpeed and FSDP1 checkpoints (`convert_deepspeed`, `convert_fsdp1`), `--version`. Run as
`fsdp2-strategy ...` or `python -m fsdp2_strategy.cli ...`.

The top layer: imports any package of the core, and nothing imports it.
"""

from .main import build_parser, main

__all__ = ["build_parser", "main"]

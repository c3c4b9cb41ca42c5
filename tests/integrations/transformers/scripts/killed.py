"""A run killed in the middle of a save: both processes exit (os._exit) while `checkpoint-6` is being written.

Usage: accelerate launch --config_file CONFIG killed.py OUTPUT_DIR

Leaves committed checkpoint-2 and checkpoint-4 and an unfinished `.tmp-checkpoint-6/`, and beside
OUTPUT_DIR a file `OUTPUT_DIR.died_in_save.rankN` from each rank that died there; the launch exits with
status 17 (flows_full.py's `resume_after_kill` checks those files and resumes the run).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist
from common import Tokens, bert, checkpoint_args

from fsdp2_strategy.integrations.transformers import FSDP2Trainer

KILLED_AT = 6


def main() -> None:
    trainer = FSDP2Trainer(
        model=bert(0), args=checkpoint_args(Path(sys.argv[1]), save_total_limit=3), train_dataset=Tokens(48, 3)
    )

    def die(models, weights, tmp_dir):  # runs inside save_state, after Accelerate's files, before any shard
        if trainer.state.global_step == KILLED_AT:
            out = Path(sys.argv[1])
            out.with_name(f"{out.name}.died_in_save.rank{dist.get_rank()}").write_text(str(KILLED_AT))
            os._exit(17)

    trainer.accelerator.register_save_state_pre_hook(die)
    trainer.train()


if __name__ == "__main__":
    main()

"""One process, no launcher: resume the 2-rank `save_state` directory and continue training.

Usage: python resume.py OUT.json STATE_DIR

DCP reshards the 2-rank shards onto one process; the losses must continue exactly as the
uninterrupted 2-rank run did (same global batches: 8 samples per step here, 4 per rank there).
"""

from __future__ import annotations

import sys

from common import setup_resumable, train, write_json

import fsdp2_strategy as f2


def main() -> None:
    out_path, state_dir = sys.argv[1], sys.argv[2]
    acc, model, opt, sched = setup_resumable(99)
    acc.load_state(state_dir)
    lr_loaded = sched.get_last_lr()
    losses = train(acc, model, opt, sched, range(2, 4))
    write_json(
        out_path,
        {"resumed": losses, "lr_loaded": lr_loaded, "lr": sched.get_last_lr(), "num_processes": acc.num_processes},
    )
    f2.shutdown()


if __name__ == "__main__":
    main()

"""One process, no launcher: resume the 2-rank `save_state` directory and continue training.

Usage: python resume.py OUT.json STATE_DIR [WORKDIR]

DCP reshards the 2-rank shards onto one process; the losses must continue exactly as the
uninterrupted 2-rank run did (same global batches: 8 samples per step here, 4 per rank there).
With WORKDIR, also the one-process runs of `resume_flows` (2 -> 1 from the checkpoints the
2-process flows saved there, and the checkpoint the variant world continues on 2: 1 -> 2).
"""

from __future__ import annotations

import sys
from pathlib import Path

from common import setup_resumable, train, write_json
from resume_flows import one_process

import fsdp2_strategy as f2


def main() -> None:
    out_path, state_dir = sys.argv[1], sys.argv[2]
    acc, model, opt, sched = setup_resumable(99)
    acc.load_state(state_dir)
    lr_loaded = sched.get_last_lr()
    losses = train(acc, model, opt, sched, range(2, 4))
    out = {"resumed": losses, "lr_loaded": lr_loaded, "lr": sched.get_last_lr(), "num_processes": acc.num_processes}
    if len(sys.argv) > 3:
        out["other_world_sizes"] = one_process(Path(sys.argv[3]))
    write_json(out_path, out)
    f2.shutdown()


if __name__ == "__main__":
    main()

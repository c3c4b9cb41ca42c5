"""One process, no launcher: resume the 2-rank `save_state` directory and continue training.

Usage: python resume.py OUT.json STATE_DIR EARLIER [WORKDIR]

EARLIER: rank 0's report of the 2-rank launch (flows.py) that saved STATE_DIR. DCP reshards the 2-rank
shards onto one process; the losses must continue exactly as the uninterrupted 2-rank run did (same
global batches: 8 samples per step here, 4 per rank there), checked here (`helpers.checks.Checks`, flow
"resume"). With WORKDIR, also the one-process runs of `resume_flows` (2 -> 1 from the checkpoints the
2-process flows saved there, and the checkpoint the variant world continues on 2: 1 -> 2), flow
"other_world_sizes".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from common import setup_resumable, train, write_json
from helpers.checks import Checks
from resume_flows import TOL, one_process

import fsdp2_strategy as f2


def main() -> None:
    out_path, state_dir = sys.argv[1], sys.argv[2]
    earlier = json.loads(Path(sys.argv[3]).read_text())
    acc, model, opt, sched = setup_resumable(99)
    acc.load_state(state_dir)
    lr_loaded = sched.get_last_lr()
    losses = train(acc, model, opt, sched, range(2, 4))
    out = {"resumed": losses, "lr_loaded": lr_loaded, "lr": sched.get_last_lr(), "num_processes": acc.num_processes}
    saved = earlier["checkpoints"]
    check = Checks(out)
    check.equal("one process", out["num_processes"], 1)
    check.close("the losses continue as the 2-rank run's", losses, saved["continued"], TOL)
    check.equal("the scheduler resumes at the saved learning rate", lr_loaded, saved["lr_saved"])
    # Accelerate steps a prepared scheduler once per process (StepLR gamma 0.7): twice per step on
    # 2 ranks, once here.
    check.close("the scheduler steps once per step here", out["lr"][0], lr_loaded[0] * 0.7**2, 1e-6)
    check.close("the 2-rank scheduler stepped twice per step", saved["lr_continued"][0], lr_loaded[0] * 0.7**4, 1e-6)
    report = {"resume": out}
    if len(sys.argv) > 4:
        report["other_world_sizes"] = one_process(Path(sys.argv[4]), earlier["resume_on_two"])
    write_json(out_path, report)
    f2.shutdown()


if __name__ == "__main__":
    main()

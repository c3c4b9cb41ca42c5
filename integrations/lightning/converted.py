"""What `fit(ckpt_path=<Checkpointer step>)` hands Lightning once the core loaded model and optimizer
(`fsdp2_strategy.checkpoint.load_into`): the counters and the scheduler in Lightning's checkpoint keys."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from fsdp2_strategy.checkpoint import resume_counters


def lightning_state(trainer: Any, extra: Any) -> dict[str, Any]:
    """The Lightning checkpoint dict (less model and optimizer) a converted step resumes from.

    A source trained by Lightning kept its own (`extra["lightning"]` from an FSDPStrategy checkpoint,
    DeepSpeedStrategy's `client_state`): that is used as it is. Otherwise the loops are set to the
    converted step's global step and epoch, and the first scheduler gets `extra["lr_scheduler"]`.
    """
    extra = extra if isinstance(extra, dict) else {}
    for kept in (extra.get("lightning"), extra.get("client_state")):
        if isinstance(kept, dict) and "loops" in kept:
            return {**kept, "lr_schedulers": kept.get("lr_schedulers", [])}
    step, epoch = resume_counters(extra)
    scheduler = extra.get("lr_scheduler")
    return {
        "pytorch-lightning_version": pl.__version__,
        "epoch": epoch,
        "global_step": step,
        "loops": {"fit_loop": _fit_loop_at(trainer.fit_loop.state_dict(), step, epoch)},
        "lr_schedulers": [scheduler] if scheduler is not None and trainer.lr_scheduler_configs else [],
    }


def _fit_loop_at(state: dict[str, Any], step: int, epoch: int) -> dict[str, Any]:
    """A fresh fit loop's state with `step` optimizer steps and `epoch` finished epochs done."""
    optimizer = state["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["total"]
    optimizer.update(ready=step, completed=step)
    state["epoch_loop.manual_optimization.optim_step_progress"]["total"].update(ready=step, completed=step)
    state["epoch_loop.state_dict"]["_batches_that_stepped"] = step
    for counters in state["epoch_progress"].values():
        counters.update({k: epoch for k in counters})
    return state

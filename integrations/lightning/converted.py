"""What `fit(ckpt_path=<Checkpointer step>)` hands Lightning once the core loaded model and optimizer
(`fsdp2_strategy.checkpoint.load_into`): the counters and the scheduler in Lightning's checkpoint keys."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

from fsdp2_strategy.checkpoint import resume_counters


def lightning_state(trainer: Any, extra: Any) -> dict[str, Any]:
    """The Lightning checkpoint dict (less model and optimizer) a converted step resumes from.

    A source trained by Lightning kept its own (`extra["lightning"]` from an FSDPStrategy checkpoint,
    DeepSpeedStrategy's `client_state`): that is used as it is when its loop state has every entry
    this Lightning's fit loop saves. Otherwise the loops are set to the converted step's global step
    and epoch (with a warning when a kept loop state is replaced), and the first scheduler gets
    `extra["lr_scheduler"]` unless the kept state has its schedulers.
    """
    extra = extra if isinstance(extra, dict) else {}
    kept = next((k for k in (extra.get("lightning"), extra.get("client_state")) if _has_loops(k)), None)
    if kept is not None and _fits(kept["loops"].get("fit_loop"), trainer.fit_loop.state_dict()):
        return {**kept, "lr_schedulers": kept.get("lr_schedulers", [])}
    step, epoch = resume_counters(extra)
    scheduler = extra.get("lr_scheduler")
    rebuilt = {
        "pytorch-lightning_version": pl.__version__,
        "epoch": epoch,
        "global_step": step,
        "loops": {"fit_loop": _fit_loop_at(trainer.fit_loop.state_dict(), step, epoch)},
        "lr_schedulers": [scheduler] if scheduler is not None and trainer.lr_scheduler_configs else [],
    }
    if kept is None:
        return rebuilt
    rank_zero_warn(
        f"The converted checkpoint's Lightning loop state does not match the fit loop of Lightning "
        f"{pl.__version__} (entries are missing): the loops restart at its global step {step} and epoch "
        f"{epoch}; the rest of its Lightning state is kept."
    )
    return {**kept, **rebuilt, "lr_schedulers": kept.get("lr_schedulers") or rebuilt["lr_schedulers"]}


def _has_loops(state: Any) -> bool:
    return isinstance(state, dict) and isinstance(state.get("loops"), dict)


def _fits(got: Any, wanted: dict[str, Any]) -> bool:
    """Whether `got` has every key of `wanted`, nested dicts included (values are not compared)."""
    return isinstance(got, dict) and all(
        key in got and (not isinstance(value, dict) or _fits(got[key], value)) for key, value in wanted.items()
    )


def _fit_loop_at(state: dict[str, Any], step: int, epoch: int) -> dict[str, Any]:
    """A fresh fit loop's state with `step` optimizer steps and `epoch` finished epochs done."""
    optimizer = state["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["total"]
    optimizer.update(ready=step, completed=step)
    state["epoch_loop.manual_optimization.optim_step_progress"]["total"].update(ready=step, completed=step)
    state["epoch_loop.state_dict"]["_batches_that_stepped"] = step
    for counters in state["epoch_progress"].values():
        counters.update({k: epoch for k in counters})
    return state

"""LightningCLI with `trainer.strategy` from a YAML file; launched as plain `python cli.py fit --config C`
so that Lightning's own subprocess launcher starts the second rank.

$FSDP2_CLI_CASE names what the config is ("yaml": `strategy:` as class_path + init_args on 2 CPU
devices; "registry": `strategy: fsdp2` with `accelerator: auto` on 1 device): each rank checks what
that case claims at the end of training (`helpers.checks.Checks`) and writes its report (strategy class,
sharding plan, losses, the checks) to $FSDP2_CLI_OUT's rank file (OUT.rank0.json, ...: as
`helpers.collect.run_flows` names them; the flow is the case).
"""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl
import torch
from common import LitMLP, gather, loader
from helpers.checks import Checks
from helpers.collect import rank_path
from lightning.pytorch.cli import LightningCLI

import fsdp2_strategy as f2


class Data(pl.LightningDataModule):
    def __init__(self, batch_size: int = 4):
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        return loader(self.batch_size)


def _check(case: str, r: dict, check: Checks) -> None:
    check.equal("the strategy is FSDP2Strategy", r["strategy"], "FSDP2Strategy")
    if case == "yaml":
        check.equal("a world of 2 (Lightning's own launcher started the second rank)", r["world_size"], 2)
        check.equal("losses gathered from both ranks", len(r["losses"]), 2)
        check.equal("the YAML's wrap_policy reached the config", r["wrap_policy"], "['ResidualBlock']")
        check.equal("groups by the YAML's policy", r["groups"], ["<root>", "blocks.0", "blocks.1", "blocks.2"])
        check.equal("every group bf16/fp32 (precision: bf16-mixed)", sorted(set(r["precision"])), ["bf16/fp32"])
    else:
        check.equal("a world of 1", r["world_size"], 1)
        accel = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        check.equal("accelerator auto: this machine's device", r["device_type"], accel.type if accel else "cpu")


class Report(pl.Callback):
    def on_train_end(self, trainer, module):
        strategy = trainer.strategy
        case = os.environ["FSDP2_CLI_CASE"]
        entry = {
            "strategy": type(strategy).__name__,
            "world_size": trainer.world_size,
            "device_type": strategy.root_device.type,
            "wrap_policy": repr(strategy.fsdp2_config.wrap_policy),
            "groups": [g.name for g in f2.sharding_plan(module).groups],
            "precision": [g.precision for g in f2.sharding_plan(module).groups],
            "losses": gather(module.losses),
        }
        _check(case, entry, Checks(entry))
        path = rank_path(os.environ["FSDP2_CLI_OUT"], trainer.global_rank)
        path.write_text(json.dumps({case: entry}, indent=1, default=str))


if __name__ == "__main__":
    LightningCLI(LitMLP, Data, trainer_defaults={"callbacks": [Report()]}, save_config_callback=None)
    f2.shutdown()  # every rank (Lightning's launcher runs this line in each): no gloo exit-time abort

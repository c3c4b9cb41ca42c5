"""LightningCLI with `trainer.strategy` from a YAML file; launched as plain `python cli.py fit --config C`
so that Lightning's own subprocess launcher starts the second rank.

The result (strategy class, sharding plan, loss) is written to the file named by $FSDP2_CLI_OUT.
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
from common import LitMLP, gather, loader, write_json
from lightning.pytorch.cli import LightningCLI

import fsdp2_strategy as f2


class Data(pl.LightningDataModule):
    def __init__(self, batch_size: int = 4):
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        return loader(self.batch_size)


class Report(pl.Callback):
    def on_train_end(self, trainer, module):
        strategy = trainer.strategy
        losses = gather(module.losses)
        write_json(
            os.environ["FSDP2_CLI_OUT"],
            {
                "strategy": type(strategy).__name__,
                "world_size": trainer.world_size,
                "device_type": strategy.root_device.type,
                "wrap_policy": repr(strategy.fsdp2_config.wrap_policy),
                "groups": [g.name for g in f2.sharding_plan(module).groups],
                "precision": [g.precision for g in f2.sharding_plan(module).groups],
                "losses": losses,
            },
        )


if __name__ == "__main__":
    LightningCLI(LitMLP, Data, trainer_defaults={"callbacks": [Report()]}, save_config_callback=None)
    f2.shutdown()  # every rank (Lightning's launcher runs this line in each): no gloo exit-time abort

"""One-process Lightning runs (devices=1, global batch 8 = 2 ranks x 4) for the resharding tests.

single.py train  OUT.json WORKDIR           reference run of 2 epochs + a 1-epoch checkpoint; the
                                            1-process runs of resume_flows (mid-epoch checkpoints)
single.py resume OUT.json CKPT FLOWS.json   load_from_checkpoint(CKPT), then resume fit from it; the
                                            2-rank mid-epoch checkpoint continued (2 -> 1)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from common import LitMLP, full_params, loader, max_rel_diff, trainer, write_json
from lightning.pytorch.callbacks import ModelCheckpoint
from resume_flows import checkpoint, one_process_runs, record

import fsdp2_strategy as f2

BATCH = 8


def train(out_path: str, work: str) -> None:
    torch.manual_seed(0)
    ref = LitMLP(optimizer="adam")
    trainer(devices=1, max_epochs=2).fit(ref, loader(BATCH))
    torch.manual_seed(0)
    first = LitMLP(optimizer="adam")
    callback = ModelCheckpoint(dirpath=Path(work) / "single_ckpts", save_top_k=-1)
    trainer(devices=1, max_epochs=1, enable_checkpointing=True, callbacks=[callback]).fit(first, loader(BATCH))
    write_json(
        out_path,
        {
            "ref_losses": ref.losses,
            "params": {k: v.tolist() for k, v in full_params(ref).items()},
            "other_world_sizes": one_process_runs(Path(work)),
        },
    )


def resume(out_path: str, ckpt: str, flows_json: str) -> None:
    import json

    # Single process, no trainer: the sharded directory is read with its weights gathered.
    loaded = LitMLP.load_from_checkpoint(ckpt)
    saved = json.loads(Path(flows_json).read_text())["checkpoints"]["epoch0_params"]
    loaded_diff = max_rel_diff(
        {k: v.detach() for k, v in loaded.named_parameters()}, {k: torch.tensor(v) for k, v in saved.items()}
    )
    # Lightning's own reader of sharded checkpoints (behind its consolidation CLI) reads ours; the
    # model is under FSDPStrategy's key "model" (which that CLI renames to "state_dict").
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    lightning_view = _load_distributed_checkpoint(Path(ckpt))["model"]
    lightning_diff = max_rel_diff({k: lightning_view[k] for k in saved}, {k: torch.tensor(v) for k, v in saved.items()})
    torch.manual_seed(7)
    model = LitMLP(optimizer="adam")
    trainer(devices=1, max_epochs=2).fit(model, loader(BATCH), ckpt_path=ckpt)
    write_json(
        out_path,
        {
            "loaded_diff": loaded_diff,
            "lightning_reader_diff": lightning_diff,
            "loaded_hparams": dict(loaded.hparams),
            "losses": model.losses,
            "params": {k: v.tolist() for k, v in full_params(model).items()},
            # 2 -> 1: the mid-epoch checkpoint of flows.py's 2-rank run, continued on one process.
            "from_two": record(Path(flows_json).parent, "", 1, checkpoint(Path(flows_json).parent, "lit_two")),
        },
    )


if __name__ == "__main__":
    {"train": train, "resume": resume}[sys.argv[1]](*sys.argv[2:])
    f2.shutdown()

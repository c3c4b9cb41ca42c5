"""Shared pieces of the transformers flow scripts: the tiny BERT, data, arguments, the one-process reference."""

from __future__ import annotations

import copy
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from helpers.collect import full_params, gather, run_flows  # noqa: F401
from helpers.models import tiny_llama, word_tokenizer  # noqa: F401
from helpers.precision import cast_copy, policy_grads  # noqa: F401
from torch.utils.data import Dataset

import fsdp2_strategy as f2

VOCAB, SEQ, LABELS = 100, 8, 3
TOL = 1e-5  # fp32 parity, relative


def rank0s(value):
    """Rank 0's `value` on every rank (what rank 0 alone measured, from the files it alone reads)."""
    return gather(value)[0]


def missing(wanted, present) -> list:
    """The names of `wanted` not in `present` (checked equal to [] to show what is missing)."""
    return [name for name in wanted if name not in present]


def bert(seed: int = 0) -> transformers.BertForSequenceClassification:
    """A tiny BERT classifier built from a config (no download), without dropout."""
    config = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        num_labels=LABELS,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(seed)
    model = transformers.BertForSequenceClassification(config)
    # BERT's forward takes **kwargs but its loss ignores `num_items_in_batch`: told so, the Trainer
    # divides by the accumulation steps itself (otherwise the loss is scaled by processes x steps).
    model.accepts_loss_kwargs = False
    return model


class Tokens(Dataset):
    """`n` random sequences; token 0 of sample i is `10 + i`, so metrics can tell samples apart."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.x[:, 0] = 10 + torch.arange(n)
        self.y = torch.randint(0, LABELS, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.y[i]}


def args(output_dir: Path, **kwargs) -> transformers.TrainingArguments:
    """TrainingArguments for these flows: SGD at a constant rate unless told otherwise, no reporting."""
    base = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=3,
        learning_rate=0.1,
        optim="sgd",
        lr_scheduler_type="constant",
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        ddp_timeout=120,  # a stuck rank fails the run
        dataloader_pin_memory=False,
    )
    return transformers.TrainingArguments(**{**base, **kwargs})


class Snapshots(transformers.TrainerCallback):
    """Full parameters at given steps (collective: every rank runs callbacks); copies a checkpoint once saved."""

    def __init__(self, steps: tuple[int, ...], copy_step: int | None = None, copy_to: Path | None = None) -> None:
        self.steps, self.copy_step, self.copy_to, self.params = steps, copy_step, copy_to, {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step in self.steps:
            self.params[state.global_step] = full_params(model)

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.copy_step and dist.get_rank() == 0:
            name = f"checkpoint-{state.global_step}"
            shutil.copytree(Path(args.output_dir) / name, self.copy_to / name)
        dist.barrier()


def checkpoint_args(output_dir: Path, **kwargs) -> transformers.TrainingArguments:
    """Six Adam steps with a linear decay, a committed checkpoint every 2, the newest 2 kept."""
    base = dict(
        optim="adamw_torch",  # optimizer state and a decaying rate: a resume must restore both
        learning_rate=0.01,
        lr_scheduler_type="linear",
        max_steps=6,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=2,
    )
    return args(output_dir, **{**base, **kwargs})


def reference_sgd(initial, data: Tokens, steps: int, global_batch: int, lr: float, clip: float):
    """One process: SGD on consecutive global batches, clipped by total norm: (params, norms, model)."""
    model = copy.deepcopy(initial)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    norms = []
    for step in range(steps):
        idx = slice(step * global_batch, (step + 1) * global_batch)
        loss = model(input_ids=data.x[idx], labels=data.y[idx]).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms, model


def vector_rel_diff(got: dict, want: dict, start: dict | None = None) -> float:
    """||got - want|| / ||want|| over all parameters as one vector; with `start`, of the updates
    (got - start vs want - start): per-tensor ratios would blow up on near-zero biases."""
    base = {k: torch.zeros_like(v) for k, v in want.items()} if start is None else start
    diff = torch.cat([(got[k].float() - want[k].float()).flatten() for k in want])
    ref = torch.cat([(want[k].float() - base[k].float()).flatten() for k in want])
    return (diff.norm() / ref.norm()).item()


def main(flows: list) -> None:
    """`python SCRIPT OUT.json WORKDIR [FLOW,FLOW...]` under accelerate launch: run the named flows (default:
    all), each checking what it claims (`helpers.checks.Checks`); every rank writes its report (OUT.rankN.json,
    `helpers.collect.run_flows`)."""
    out_path, work = sys.argv[1], Path(sys.argv[2])
    by_name = {f.__name__: f for f in flows}
    chosen = [by_name[n] for n in sys.argv[3].split(",")] if len(sys.argv) > 3 else flows
    run_flows(chosen, out_path, work)
    f2.shutdown()

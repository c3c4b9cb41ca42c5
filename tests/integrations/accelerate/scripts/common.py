"""Shared pieces of the Accelerate flow scripts: data, single-process references, helpers."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.collect import full, full_grads, full_params, gather, max_rel_diff, write_json  # noqa: F401
from helpers.models import TinyGPT
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQ, N_SAMPLES = 64, 16, 32
GLOBAL_BATCH = 8
PER_RANK = 4  # on 2 ranks


def dataset(seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (N_SAMPLES, SEQ), generator=g)
    return TensorDataset(torch.arange(N_SAMPLES), idx, torch.roll(idx, -1, dims=1))


def loader(batch: int, shuffle: bool = False) -> DataLoader:
    return DataLoader(dataset(), batch_size=batch, shuffle=shuffle)


def fresh(seed: int = 0, **kwargs) -> tuple[nn.Module, nn.Module]:
    """A model and an identical unsharded copy (the single-process reference)."""
    torch.manual_seed(seed)
    model = TinyGPT(vocab=VOCAB, seq=SEQ, **kwargs)
    return model, copy.deepcopy(model)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def all_indices(local: list[int]) -> list[int]:
    return [i for rank in gather(local) for i in rank]


def reference(initial: nn.Module, micro_batches: list[list[int]], *, lr: float = 0.1, clip: float | None = None):
    """One SGD step of one process over `micro_batches` (sample indices; mean of micro-batch means,
    as accumulation computes it). Returns (params after the step, grads, norm before clipping)."""
    model = copy.deepcopy(initial)
    _, xs, ys = dataset().tensors
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for mb in micro_batches:
        (lm_loss(model, xs[mb], ys[mb]) / len(micro_batches)).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item() if clip else None
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, grads, norm


def update_rel_diff(start: dict, got: dict, want: dict) -> float:
    """Relative difference of the whole update (all parameters as one vector): got - start vs want - start."""
    diff = torch.cat([((got[k] - start[k]) - (want[k] - start[k])).flatten() for k in want])
    ref = torch.cat([(want[k] - start[k]).flatten() for k in want])
    return (diff.norm() / ref.norm()).item()


def reduce_scatters(counts) -> int:
    return sum(v for k, v in counts.items() if k.startswith("reduce_scatter"))


def rank_batch(step: int = 0):
    """This rank's share of global batch `step` (8 samples, split over the ranks), as (indices, x, y)."""
    per = GLOBAL_BATCH // dist.get_world_size()
    start = (GLOBAL_BATCH * step + per * dist.get_rank()) % N_SAMPLES
    idx = list(range(start, start + per))
    _, xs, ys = dataset().tensors
    return idx, xs[idx], ys[idx]


def train(acc, model, opt, sched, steps: range) -> list[float]:
    """Plain steps on the global batches `steps`; returns the global mean loss of each."""
    losses = []
    for step in steps:
        _, x, y = rank_batch(step)
        loss = lm_loss(model, x, y)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(sum(gather(loss.item())) / dist.get_world_size())
    return losses


def setup_resumable(seed: int, **plugin):
    """Accelerator, model, Adam and a scheduler, prepared (the state `save_state` covers)."""
    from fsdp2_strategy.integrations.accelerate import FSDP2Accelerator, FSDP2Plugin

    model, _ = fresh(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    acc = FSDP2Accelerator(fsdp_plugin=FSDP2Plugin(**plugin), mixed_precision="no")
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched

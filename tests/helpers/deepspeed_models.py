"""What the converter tests (DeepSpeed, FSDP1) share between the source engine's ranks and ours: the
model, the data, the optimizer and its schedule, DeepSpeed's config (ZeRO stage aside), and the
snapshots and differences the parity checks compare."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from helpers.models import TinyGPT, make_batch

K_STEPS, M_STEPS = 3, 3
"""DeepSpeed trains K steps, saves, and both engines continue M steps."""
WORLD = 2
"""DeepSpeed's world size."""
GLOBAL_BATCH = 6
"""Samples per step, split evenly over 1, 2 or 3 ranks."""
LR, WEIGHT_DECAY, BETAS = 1e-2, 0.05, (0.9, 0.95)


def make_model() -> torch.nn.Module:
    """A GPT with tied embeddings and frozen attention biases (the key bias gets a zero gradient, on
    which Adam turns float rounding into visible updates: frozen, it cannot blur the comparison)."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=32, heads=4, layers=2, seq=16, tied=True)
    for block in model.blocks:
        block.attn.qkv.bias.requires_grad_(False)
    return model


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, eps=1e-8)


def batch_for(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of step `step`'s global batch (the same samples whatever the world size)."""
    idx, tgt = make_batch(GLOBAL_BATCH, seq=16, vocab=64, seed=100 + step)
    per = GLOBAL_BATCH // world
    return idx[rank * per : (rank + 1) * per], tgt[rank * per : (rank + 1) * per]


def lm_loss(model, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def ds_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // WORLD,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def worst_difference(got: dict, expected: dict) -> tuple[float, str]:
    """The largest relative difference of parameters and Adam moments (`{"param": {name: tensor},
    "exp_avg": ..., "exp_avg_sq": ...}`), and where; the frozen parameters (carried over, not
    trained) must be there unchanged."""
    diffs = [
        (rel(got[kind][name], expected[kind][name]), f"{kind} {name}")
        for kind in ("param", "exp_avg", "exp_avg_sq")
        for name in expected[kind]
    ]
    frozen = {n: p for n, p in make_model().named_parameters() if not p.requires_grad}
    assert set(got["param"]) == set(expected["param"]) | set(frozen) and len(frozen) == 2
    assert all(torch.equal(got["param"][n], p) for n, p in frozen.items())  # frozen, carried over as they were
    return max(diffs)


def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """The schedule every source run and every continuation uses."""
    return torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.3, total_iters=10)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Full parameters and Adam moments by name (collective for sharded ones)."""
    names = {p: n for n, p in model.named_parameters()}
    out: dict = {"param": {n: _full(p) for p, n in names.items()}, "exp_avg": {}, "exp_avg_sq": {}}
    for p, state in optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            out[key][names[p]] = _full(state[key])
    return out

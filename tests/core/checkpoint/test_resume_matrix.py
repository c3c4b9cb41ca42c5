"""Any checkpoint loads on any mesh (issue 28, section 2): checkpoints saved by `f2.Checkpointer` on
six layouts, each loaded on five and trained on, against one process trained without a break.

Sources (where each was saved): one process without a process group; 1-D FSDP on 2 ranks; NO_SHARD
on 2 ranks; FSDP with `accumulation="keep_gathered"` (2 micro-batches a step) on 2 ranks; HSDP 2x2;
FSDP x TP 2x2; FSDP x context parallel 2x2 (each sequence split across 2 ranks). Targets: one process
without a process group (a plain model), FSDP on 2 ranks, FSDP on 3 ranks (uneven shards, and a
parameter with an empty shard), HSDP 2x2, FSDP x TP 2x2, FSDP x CP 2x2.

Every cell loads model and optimizer (SGD with momentum: exact, where Adam would amplify float
noise), trains `MORE` steps on the global batches `SAVE_AT..SAVE_AT+MORE-1` split by data-parallel
rank, and must equal one process trained `SAVE_AT + MORE` steps without a break: parameters and
momentum buffers within `TOL` relative. A cell that loads on the layout it was saved on must
continue bit for bit like that layout's own uninterrupted run. Worlds: 2 ranks save three sources;
4 ranks save two and load all on HSDP and FSDP x TP; 3 ranks and 2 ranks load all; the one-process
source and target run in the test process.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers.harness import run_distributed
from helpers.models import TP_PLAN, TPGPT
from torch import nn

TIMEOUT = 120
GLOBAL = 12  # samples per step: divisible by every data-parallel size here (1, 2, 3, 4)
SEQ, VOCAB, DIM = 8, 64, 32
SAVE_AT, MORE = 2, 2
LR, MOMENTUM = 0.1, 0.9
TOL = 1e-5
# Tensors that are ~0 in exact arithmetic (the key bias: softmax ignores a constant added to every
# key) are compared against this norm instead of their own.
NORM_FLOOR = 1e-3

LAYOUTS: dict[str, dict] = {  # name -> (world size, shard_model kwargs, micro-batches per step)
    "one": {"world": 1, "shard": None},
    "fsdp2": {"world": 2, "shard": {}},
    "noshard2": {"world": 2, "shard": {"sharding_strategy": "NO_SHARD"}},
    "keep_gathered2": {"world": 2, "shard": {"accumulation": "keep_gathered"}, "micro": 2},
    "fsdp3": {"world": 3, "shard": {}},
    "hsdp2x2": {"world": 4, "shard": {"sharding_strategy": "HYBRID_SHARD", "mesh_shape": (2, 2)}},
    "tp2x2": {"world": 4, "shard": {"tensor_parallel_size": 2, "tensor_parallel_plan": TP_PLAN}},
    "cp2x2": {"world": 4, "shard": {"context_parallel_size": 2}},
}
SOURCES = ("one", "fsdp2", "noshard2", "keep_gathered2", "hsdp2x2", "tp2x2", "cp2x2")
TARGETS = ("one", "fsdp2", "fsdp3", "hsdp2x2", "tp2x2", "cp2x2")


class MatrixGPT(TPGPT):
    """TPGPT plus the parameters resharding trips on: `gate` has 2 elements (one rank of 3 holds an
    empty shard of it), `temperature` is 0-dim (kept replicated)."""

    def __init__(self, vocab: int = VOCAB) -> None:
        super().__init__(vocab=vocab, dim=DIM, heads=4, layers=2)
        self.gate = nn.Parameter(torch.tensor([1.0, 0.5]))
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) * self.gate.repeat_interleave(DIM // 2)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) / self.temperature


# ---------------------------------------------------------------------- on every rank
def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def _data_rank(layout: str) -> tuple[int, int]:
    """(this rank's index among the data-parallel ranks, their number): the TP or CP ranks of one group
    share data."""
    import torch.distributed as dist

    if LAYOUTS[layout]["shard"] is None:
        return 0, 1
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = LAYOUTS[layout]["shard"]
    group = shard.get("tensor_parallel_size", 1) * shard.get("context_parallel_size", 1)
    return rank // group, world // group


def _build(layout: str, seed: int, groups: str = "two", vocab: int = VOCAB) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model on `layout` and SGD over it. `groups`: "two" parameter groups (weight decay on the
    matrices only, half the learning rate for the rest), as fine-tunes use, so that every parameter's
    group must come back by name on any layout; "swapped" (the same two in the other order); "one"."""
    import fsdp2_strategy as f2

    torch.manual_seed(seed)
    model = MatrixGPT(vocab)
    if LAYOUTS[layout]["shard"] is not None:
        f2.shard_model(model, log_plan=False, **LAYOUTS[layout]["shard"])
    matrices = [p for n, p in model.named_parameters() if n.endswith("weight") and p.ndim == 2]
    others = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.ndim == 2)]
    two = [{"params": matrices, "weight_decay": 0.01}, {"params": others, "lr": LR / 2}]
    param_groups = {"two": two, "swapped": two[::-1], "one": [{"params": list(model.parameters())}]}[groups]
    return model, torch.optim.SGD(param_groups, lr=LR, momentum=MOMENTUM)


def _train(model: nn.Module, opt: torch.optim.Optimizer, layout: str, first: int, steps: int) -> None:
    """Steps `first..first+steps-1`: each data-parallel rank takes its slice of the global batch."""
    import fsdp2_strategy as f2

    dp_rank, dp = _data_rank(layout)
    micro = LAYOUTS[layout].get("micro", 1)
    per_rank = GLOBAL // dp
    for step in range(first, first + steps):
        idx, target = _batch(step)
        mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        idx, target = idx[mine], target[mine]
        for m in range(micro):
            part = slice(m * per_rank // micro, (m + 1) * per_rank // micro)
            ctx = f2.no_sync(model) if m < micro - 1 else contextlib.nullcontext()
            with ctx, f2.context_parallel(model, {"idx": idx[part], "target": target[part]}) as cp:
                # The loss over every token of the sequences (each rank holds part of each with cp).
                (cp.loss(model(cp["idx"]), labels=cp["target"]) / micro).backward()
        opt.step()
        opt.zero_grad()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Gathered parameters and momentum buffers by name (collective)."""
    out = {f"param/{n}": _full(p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        out[f"momentum/{n}"] = _full(opt.state[p]["momentum_buffer"])
    return out


def _save(root: str, layout: str) -> dict[str, torch.Tensor]:
    """Train `SAVE_AT` steps on `layout`, save, train on without a break; return that run's end."""
    import fsdp2_strategy as f2

    model, opt = _build(layout, seed=0)
    _train(model, opt, layout, 0, SAVE_AT)
    f2.Checkpointer(f"{root}/{layout}").save(SAVE_AT, model=model, optimizer=opt)
    _train(model, opt, layout, SAVE_AT, MORE)
    return _snapshot(model, opt)


def _resume(root: str, source: str, target: str) -> dict[str, torch.Tensor]:
    """Load `source`'s checkpoint into a differently initialised `target` model and train on."""
    import fsdp2_strategy as f2

    model, opt = _build(target, seed=1 + TARGETS.index(target))
    f2.Checkpointer(f"{root}/{source}").load(model=model, optimizer=opt)
    _train(model, opt, target, SAVE_AT, MORE)
    return _snapshot(model, opt)


def _refusals(root: str, layout: str) -> dict:
    """Loads of the FSDP x TP checkpoint that cannot work, on `layout`: each raises on every rank, names
    both layouts, and leaves model and optimizer as they were (no partial load)."""
    import fsdp2_strategy as f2

    out = {}
    for case, kwargs in (("vocab", {"vocab": VOCAB - 16}), ("one_group", {"groups": "one"})):
        model, opt = _build(layout, seed=9, **kwargs)
        before = {n: _full(p) for n, p in model.named_parameters()}
        try:
            f2.Checkpointer(f"{root}/tp2x2").load(model=model, optimizer=opt)
            out[case] = "no error"
        except ValueError as exc:
            out[case] = str(exc)
        out[f"{case}_changed"] = [n for n, p in model.named_parameters() if not torch.equal(_full(p), before[n])]
        out[f"{case}_optimizer_state"] = len(opt.state)
    return out


def _only_rank_zero(value):
    import torch.distributed as dist

    return value if dist.get_rank() == 0 else None


def _world(
    root: str, sources: tuple[str, ...], targets: tuple[str, ...], load_from: tuple[str, ...], refuse_on: str = ""
) -> dict:
    """Save `sources` (in order), load every checkpoint in `load_from` on every layout in `targets`,
    then try the loads that cannot work on layout `refuse_on` (if given)."""
    out: dict = {"uninterrupted": {}, "cells": {}}
    for source in sources:
        out["uninterrupted"][source] = _only_rank_zero(_save(root, source))
    for target in targets:
        for source in load_from:
            out["cells"][(source, target)] = _only_rank_zero(_resume(root, source, target))
    if refuse_on:
        out["refusals"] = _refusals(root, refuse_on)
    return out


# ---------------------------------------------------------------------- in the test process
def _reference() -> dict[str, torch.Tensor]:
    """One process trained `SAVE_AT + MORE` steps on the global batches without a break."""
    model, opt = _build("one", seed=0)
    _train(model, opt, "one", 0, SAVE_AT + MORE)
    return _snapshot(model, opt)


def _worst(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest relative difference over every tensor, and its name."""
    assert got.keys() == expected.keys(), sorted(got.keys() ^ expected.keys())
    return max((((got[k] - expected[k]).norm() / expected[k].norm().clamp_min(NORM_FLOOR)).item(), k) for k in expected)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("matrix"))
    uninterrupted: dict = {"one": _save(root, "one")}
    cells: dict = {}
    refusals: list[dict] = []
    for world, sources, targets, load_from, refuse_on in (
        (2, ("fsdp2", "noshard2", "keep_gathered2"), (), (), ""),
        (4, ("hsdp2x2", "tp2x2", "cp2x2"), ("hsdp2x2", "tp2x2", "cp2x2"), SOURCES, ""),
        (3, (), ("fsdp3",), SOURCES, "fsdp3"),
        (2, (), ("fsdp2",), SOURCES, ""),
    ):
        results = run_distributed(_world, world, root, sources, targets, load_from, refuse_on, timeout=TIMEOUT)
        uninterrupted.update(results[0]["uninterrupted"])
        cells.update(results[0]["cells"])
        refusals += [r["refusals"] for r in results if "refusals" in r]
    for source in SOURCES:
        cells[(source, "one")] = _resume(root, source, "one")
    return _reference(), uninterrupted, cells, refusals, root


@pytest.mark.parametrize("source", SOURCES)
def test_every_source_layout_trains_like_one_process(matrix, source):
    reference, uninterrupted, *_ = matrix
    worst, name = _worst(uninterrupted[source], reference)
    assert worst < TOL, (source, name, worst)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("source", SOURCES)
def test_checkpoint_continues_on_another_layout(matrix, source, target):
    reference, uninterrupted, cells, *_ = matrix
    got = cells[(source, target)]
    worst, name = _worst(got, reference)
    assert worst < TOL, f"{source} -> {target}: {name} differs by {worst:.2e} relative"
    if source == target:  # same layout and world: the same float operations as the run that saved
        different = [k for k in got if not torch.equal(got[k], uninterrupted[source][k])]
        assert different == [], f"{source} -> {target} is not bitwise its uninterrupted run: {different}"


@pytest.mark.parametrize("case", ["vocab", "one_group"])
def test_a_load_that_cannot_work_names_both_layouts_and_changes_nothing(matrix, case):
    """No layout pair fails above; what does fail (here another vocabulary, or one optimizer group
    where two were saved) raises on every rank, names the saved and the loading layout, and leaves
    model and optimizer untouched. Before the group check, the one-group load went through silently
    and gave every parameter group 0's learning rate and weight decay."""
    refusals = matrix[3]
    assert len(refusals) == 3  # every rank of the 3-rank world reported
    for r in refusals:
        message = r[case]
        assert "Layouts of 'model': checkpoint saved by 4 rank(s)" in message, message
        assert "this model 3 rank(s), mesh " in message and "chunk grids 3" in message, message
        assert {
            "vocab": "tok.weight: checkpoint (64, 32) vs model (48, 32)",
            "one_group": "the checkpoint holds 2 parameter group(s) of sizes [14, 25], this optimizer 1 of sizes [39]",
        }[case] in message, message
        assert r[f"{case}_changed"] == [] and r[f"{case}_optimizer_state"] == 0


def test_parameter_groups_come_back_by_name_in_any_order(matrix):
    """One process: the same two groups in the other order load exactly (torch maps by name); a
    optimizer with one group is refused by name (the 3-rank case above, without a process group)."""
    import fsdp2_strategy as f2

    root = matrix[4]
    model, opt = _build("one", seed=3, groups="swapped")
    f2.Checkpointer(f"{root}/fsdp2").load(model=model, optimizer=opt)
    assert [(len(g["params"]), g["lr"], g["weight_decay"]) for g in opt.param_groups] == [
        (25, LR / 2, 0),
        (14, LR, 0.01),
    ]
    model, opt = _build("one", seed=3, groups="one")
    with pytest.raises(ValueError, match=r"(?s)grouped differently.*this model one process without a process group"):
        f2.Checkpointer(f"{root}/hsdp2x2").load(model=model, optimizer=opt)

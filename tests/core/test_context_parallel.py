"""Context parallelism on CPU ranks: a tiny Hugging Face Llama (SDPA, causal, grouped-query attention)
trained on 256-token sequences split across 2 "cp" ranks (and 2 dp x 2 cp on 4 ranks) equals one
process on whole sequences; each rank holds half of every sequence; checkpoints move between cp sizes;
bad sizes and models without SDPA are refused naming the fix."""

from __future__ import annotations

import pytest
import torch
from helpers.checks import Checks, FlowReports
from helpers.collect import full, max_rel_diff
from helpers.harness import run_distributed
from helpers.models import tiny_llama

TIMEOUT = 300
SEQ = 256
VOCAB = 64


def _llama(**config):
    fields = dict(
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )
    return tiny_llama(VOCAB, **{**fields, **config})


def _batch(step: int, rows: int) -> dict[str, torch.Tensor]:
    """`rows` random sequences; the first 40 labels of row 0 have no target, so the ranks' token counts differ."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(3, VOCAB, (rows, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :40] = -100
    return {"input_ids": ids, "labels": labels}


def _reference(batches: list[dict[str, torch.Tensor]], groups: int) -> tuple[list[dict], dict]:
    """One process on whole sequences: gradients of each step (the mean of the `groups` data-parallel
    groups' per-token mean losses, as data parallelism averages) and the parameters after the last."""
    model = _llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    grads = []
    for batch in batches:
        rows = batch["input_ids"].size(0) // groups
        for g in range(groups):
            part = slice(g * rows, (g + 1) * rows)
            loss = model(input_ids=batch["input_ids"][part], labels=batch["labels"][part]).loss / groups
            loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(model, batches: list[dict[str, torch.Tensor]], dp_rank: int, dp_size: int) -> tuple[list[dict], list]:
    import fsdp2_strategy as f2

    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    grads, shapes = [], []
    for batch in batches:
        rows = batch["input_ids"].size(0) // dp_size
        mine = {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in batch.items()}
        with f2.context_parallel(model, mine) as part:
            shapes.append(tuple(part["input_ids"].shape))
            logits = model(input_ids=part["input_ids"], position_ids=part["position_ids"]).logits
            part.loss(logits).backward()
        grads.append({n: full(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return grads, shapes


def _parity(checks: Checks, cp: int, dp: int, **config) -> object:
    """Two steps with cp x dp ranks against one process; returns the trained model."""
    import torch.distributed as dist

    import fsdp2_strategy as f2

    batches = [_batch(step, rows=2 * dp) for step in range(2)]
    ref_grads, ref_params = _reference(batches, groups=dp)
    model = f2.shard_model(_llama(), context_parallel_size=cp, log_plan=False, **config)
    model_parallel = cp * config.get("tensor_parallel_size", 1)
    grads, shapes = _train(model, batches, dp_rank=dist.get_rank() // model_parallel, dp_size=dp)
    checks.below("gradients equal one process (relative)", max(map(max_rel_diff, grads, ref_grads)), 1e-5)
    checks.below(
        "parameters after 2 steps equal one process (relative)",
        max_rel_diff({n: full(p) for n, p in model.named_parameters()}, ref_params),
        1e-5,
    )
    checks.equal("each rank holds 1/cp of every sequence", shapes, [(2, SEQ // cp)] * 2)
    return model


def _world_cp2(root: str) -> dict:
    import torch.distributed as dist
    from torch import nn

    import fsdp2_strategy as f2

    report: dict = {}
    checks = Checks(report.setdefault("parity", {}))
    model = _parity(checks, cp=2, dp=1)

    checks = Checks(report.setdefault("layout", {}))
    rank = dist.get_rank()
    with f2.context_parallel(model, _batch(0, rows=2)) as part:
        positions = part["position_ids"][0].tolist()
        checks.equal("a rank holds chunks r and 3 - r of four (causal balance)", positions, _chunks(rank, 2))
        checks.equal("labels shifted before the split", part["shift_labels"][1].tolist(), _shifted(rank))
        model(input_ids=part["input_ids"], position_ids=part["position_ids"])
    checks.equal("the caller's tensors keep their shape", tuple(_batch(0, rows=2)["input_ids"].shape), (2, SEQ))

    checks = Checks(report.setdefault("full_attention", {}))
    # causal=False (an encoder): each rank holds one chunk; gradients equal one process.
    ids = _batch(0, rows=2)["input_ids"]
    labels = torch.roll(ids, 1, dims=1)  # a target per token: no shift (an encoder's per-token labels)
    reference = _Encoder()
    torch.nn.functional.cross_entropy(reference(ids).reshape(-1, VOCAB), labels.reshape(-1)).backward()
    encoder = f2.shard_model(_Encoder(), context_parallel_size=2, log_plan=False)
    with f2.context_parallel(encoder, {"ids": ids, "labels": labels}, causal=False) as part:
        checks.equal("one chunk per rank", part["ids"].shape[1], SEQ // 2)
        part.loss(encoder(part["ids"]), labels=part["labels"]).backward()
    checks.below(
        "full attention: gradients equal one process (relative)",
        max_rel_diff(
            {n: full(p.grad) for n, p in encoder.named_parameters()},
            {n: p.grad for n, p in reference.named_parameters()},
        ),
        1e-5,
    )

    checks = Checks(report.setdefault("errors", {}))
    checks.raises(
        "a length the ranks cannot split",
        lambda: _enter(model, {"input_ids": torch.zeros(1, 250, dtype=torch.long)}),
        ValueError,
        "250 tokens",
        "multiple of 4",
    )
    mask = torch.ones(1, SEQ, dtype=torch.long)
    mask[0, -3:] = 0
    checks.raises(
        "padding in the attention mask",
        lambda: _enter(model, {"input_ids": torch.zeros(1, SEQ, dtype=torch.long), "attention_mask": mask}),
        ValueError,
        "padding",
        "drop the attention_mask",
    )
    eager = f2.shard_model(tiny_llama(VOCAB, attn_implementation="eager"), context_parallel_size=2, log_plan=False)
    checks.raises(
        "a model with eager attention", lambda: _enter(eager, _batch(0, 1)), ValueError, "attn_implementation='sdpa'"
    )
    plain = f2.shard_model(nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)), context_parallel_size=2)
    checks.raises(
        "a model that never calls SDPA",
        lambda: _enter(plain, {"input_ids": torch.zeros(1, SEQ, dtype=torch.long)}, forward=True),
        RuntimeError,
        "scaled_dot_product_attention",
    )
    checks.raises(
        "cp not dividing the world",
        lambda: f2.shard_model(_llama(), context_parallel_size=3),
        ValueError,
        "context_parallel_size=3",
    )
    checks.raises(
        "cp with NO_SHARD",
        lambda: f2.FSDP2Config(sharding_strategy="NO_SHARD", context_parallel_size=2),
        ValueError,
        "FULL_SHARD",
    )

    checks = Checks(report.setdefault("memory", {}))
    # Activation memory per rank: the peak of one forward and backward on 1024-token sequences.
    long_batch = {k: v.repeat(1, 4) for k, v in _batch(0, rows=2).items()}
    peaks = {
        cp: _step_peak(
            f2.shard_model(_llama(max_position_embeddings=4 * SEQ), context_parallel_size=cp, log_plan=False),
            long_batch,
        )
        for cp in (1, 2)
    }
    report["memory"]["peaks"] = peaks
    checks.within("activation memory per rank with cp=2, of cp=1's (MemTracker)", peaks[2] / peaks[1], 0.4, 0.65)

    checks = Checks(report.setdefault("resume", {}))
    # Saved with cp=2, loaded with cp=1 (FSDP over both ranks, whole sequences): the same parameters.
    f2.Checkpointer(f"{root}/ckpt").save(1, model=model)
    whole = f2.shard_model(_llama(), log_plan=False)
    f2.Checkpointer(f"{root}/ckpt").load(model=whole)
    checks.below(
        "a cp=2 checkpoint loads with cp=1",
        max_rel_diff(
            {n: full(p) for n, p in whole.named_parameters()}, {n: full(p) for n, p in model.named_parameters()}
        ),
        1e-7,
    )
    return report


class _Encoder(torch.nn.Module):
    """Token embedding, one full (non-causal) SDPA self-attention, a head: the same weights each time."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=False)
        return self.head(x + y.transpose(1, 2).flatten(-2))


def _step_peak(model, batch: dict) -> int:
    """Peak live bytes (torch's MemTracker) of one forward and backward inside `f2.context_parallel`."""
    from torch.distributed._tools.mem_tracker import MemTracker

    import fsdp2_strategy as f2

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker, f2.context_parallel(model, batch) as part:
        logits = model(input_ids=part["input_ids"], position_ids=part["position_ids"]).logits
        part.loss(logits).backward()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def _chunks(rank: int, cp: int) -> list[int]:
    size = SEQ // (2 * cp)
    return [*range(rank * size, (rank + 1) * size), *range((2 * cp - 1 - rank) * size, (2 * cp - rank) * size)]


def _shifted(rank: int) -> list[int]:
    labels = _batch(0, rows=2)["labels"][1]
    shifted = [*labels[1:].tolist(), -100]
    return [shifted[i] for i in _chunks(rank, 2)]


def _enter(model, batch: dict, forward: bool = False) -> None:
    import fsdp2_strategy as f2

    with f2.context_parallel(model, batch) as part:
        if forward:
            model(part["input_ids"])


def _world_dp2_cp2(root: str) -> dict:
    report: dict = {}
    _parity(Checks(report.setdefault("dp2_cp2", {})), cp=2, dp=2)
    _parity(Checks(report.setdefault("hsdp_cp2", {})), cp=2, dp=2, sharding_strategy="HYBRID_SHARD", mesh_shape=(2, 1))
    # 3-D: data x context x tensor parallel (the Llama's declared TP plan), dp=1 on 4 ranks.
    _parity(Checks(report.setdefault("cp2_tp2", {})), cp=2, dp=1, tensor_parallel_size=2)
    return report


@pytest.fixture(scope="module")
def cp2(tmp_path_factory) -> FlowReports:
    root = str(tmp_path_factory.mktemp("cp2"))
    return FlowReports(run_distributed(_world_cp2, 2, root, timeout=TIMEOUT), per_rank=["memory.peaks"])


@pytest.mark.parametrize("flow", ["parity", "layout", "full_attention", "errors", "memory", "resume"])
def test_two_cp_ranks(cp2: FlowReports, flow: str) -> None:
    cp2.assert_passed(flow)


def test_dp2_x_cp2_equals_one_process(tmp_path) -> None:
    reports = FlowReports(run_distributed(_world_dp2_cp2, 4, str(tmp_path), timeout=TIMEOUT))
    reports.assert_passed("dp2_cp2")
    reports.assert_passed("hsdp_cp2")
    reports.assert_passed("cp2_tp2")


def test_the_planner_counts_activations_of_one_cp_ranks_part() -> None:
    """`estimate_memory` with context_parallel_size=2 measures activations on half of each sequence."""
    import fsdp2_strategy as f2

    batch = {k: v.repeat(1, 4) for k, v in _batch(0, rows=2).items()}
    model = _llama(max_position_embeddings=4 * SEQ)
    peaks = {
        cp: f2.estimate_memory(
            model, {"context_parallel_size": cp}, world_size=2, example_batch=batch
        ).activation_peak_bytes
        for cp in (1, 2)
    }
    assert 0.4 <= peaks[2] / peaks[1] <= 0.65, peaks


def test_ring_rotation_is_set_by_name_and_a_wrong_name_refused() -> None:
    from fsdp2_strategy import _torch_compat as tc
    from fsdp2_strategy.sequence import set_ring_rotation

    with pytest.raises(ValueError, match=r"'ring'.*\['allgather', 'alltoall'\]"):
        set_ring_rotation("ring")
    try:
        set_ring_rotation("alltoall")
        assert tc.cp_options.rotate_method.name == "ALL_TO_ALL"
    finally:
        set_ring_rotation("allgather")
    assert tc.cp_options.rotate_method.name == "ALL_GATHER"

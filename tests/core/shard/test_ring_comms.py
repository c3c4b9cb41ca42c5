"""`FSDP2Config.collectives`: the point-to-point rings that replace gloo's all-gather and reduce-scatter.

One spawned 4-rank world checks the rings against torch's collectives (world 4 and a 2-rank
subgroup; fp32, bf16, bytes; sum, average, async), their scratch memory, and training with
"auto" against "torch": the same weights, the rings carrying every FSDP collective, the plan
naming them. Training parity with one process in every accumulation mode runs through the rings
too: `test_accumulation` and the other gloo tests use the default "auto".
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from helpers.comm import count_collectives
from helpers.harness import run_distributed
from helpers.models import TinyGPT, loss_fn, make_batch, rel_diff

WORLD = 4


def _collective_checks() -> dict:
    import torch.distributed as dist

    from fsdp2_strategy.shard.ring_comms import RingAllGather, RingReduceScatter

    rank = dist.get_rank()
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]  # every rank makes both groups
    out = {}
    for gname, group in (("world", dist.group.WORLD), ("pair", pair)):
        n = group.size()
        for dtype in (torch.float32, torch.bfloat16, torch.uint8):
            gen = torch.Generator().manual_seed(100 + rank)
            shard = (torch.randn(1000, generator=gen) * 50).to(dtype)
            want = torch.empty(1000 * n, dtype=dtype)
            dist.all_gather_into_tensor(want, shard, group=group)
            got = torch.zeros(1000 * n, dtype=dtype)
            RingAllGather()(got, shard, group)
            out[f"ag_{gname}_{dtype}"] = torch.equal(got, want)
            if dtype == torch.uint8:
                continue
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX):
                full = torch.randn(1000 * n, generator=gen).to(dtype)
                want = torch.empty(1000, dtype=dtype)
                # gloo refuses AVG: the reference sums and divides.
                dist.reduce_scatter_tensor(
                    want, full.clone(), op=dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op, group=group
                )
                if op == dist.ReduceOp.AVG:
                    want = want / n
                got = torch.zeros(1000, dtype=dtype)
                RingReduceScatter()(got, full.clone(), group, op)
                out[f"rs_{gname}_{dtype}_{op}"] = rel_diff(got.float(), want.float())
        # async: a 2-rank all-gather comes back unfinished as a Work
        shard = torch.full((5,), float(rank))
        buf = torch.empty(5 * n)
        work = RingAllGather()(buf, shard, group, async_op=True)
        if work is not None:
            assert isinstance(work, dist.Work)
            work.wait()
        out[f"async_{gname}"] = (work is not None, buf.view(n, 5)[:, 0].tolist())
    out["scratch"] = _scratch_bytes(pair)
    try:  # refused before anything is sent, so no rank waits on another
        RingReduceScatter()(torch.empty(3), torch.empty(7), pair)
    except ValueError as exc:
        out["size_error"] = str(exc)
    return out


def _scratch_bytes(group) -> dict:
    """Peak bytes of the tensors the ring reduce-scatter touches or allocates (MemTracker)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from fsdp2_strategy.shard.ring_comms import RingReduceScatter

    numel = 2**18  # 1 MiB of fp32
    full, output = torch.randn(numel), torch.empty(numel // group.size())
    tracker = MemTracker()
    with tracker:
        RingReduceScatter()(output, full, group)
    peak = sum(v for k, v in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items() if k == "Total")
    return {"ring": peak, "input": numel * 4, "output": numel // group.size() * 4}


def _train(collectives: str, ref: torch.nn.Module, **config) -> dict:
    import torch.distributed as dist

    import fsdp2_strategy as f2
    from fsdp2_strategy import _torch_compat as tc
    from fsdp2_strategy.shard.ring_comms import RingAllGather

    rank = dist.get_rank()
    model = f2.shard_model(
        copy.deepcopy(ref), collectives=collectives, accumulation="keep_gathered", log_plan=False, **config
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # AdamW would magnify rounding where a gradient is ~0
    idx, target = make_batch(n=4 * WORLD * 2, seed=3)
    with count_collectives() as counts:
        for step in range(2):
            for micro in range(2):
                rows = slice((step * 2 + micro) * 2 * WORLD + 2 * rank, (step * 2 + micro) * 2 * WORLD + 2 * rank + 2)
                with f2.no_sync(model) if micro == 0 else contextlib.nullcontext():
                    (loss_fn(model, idx[rows], target[rows]) / 2).backward()
            f2.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    weights = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    plan = next(line for line in str(f2.sharding_plan(model)).splitlines() if line.startswith("collectives:"))
    rings = sum(isinstance(g._all_gather_comm, RingAllGather) for m in model.modules() for g in tc.param_groups(m))
    return {"weights": weights, "counts": dict(counts), "plan": plan, "rings": rings}


def _world() -> dict:
    import fsdp2_strategy as f2

    torch.manual_seed(0)
    ref = TinyGPT()
    out = {
        "collectives": _collective_checks(),
        "auto": _train("auto", ref),
        "torch": _train("torch", ref),
        "ring": _train("ring", ref),
    }
    # HSDP 2x2: rings inside each 2-rank shard group, torch's all-reduce across the replicas.
    hsdp = {"sharding_strategy": "HYBRID_SHARD", "mesh_shape": (2, 2)}
    out["hsdp_auto"], out["hsdp_torch"] = _train("auto", ref, **hsdp), _train("torch", ref, **hsdp)
    try:
        f2.FSDP2Config(collectives="nccl")
    except ValueError as exc:
        out["bad_value"] = str(exc)
    return out


@pytest.fixture(scope="module")
def world():
    return run_distributed(_world, WORLD, timeout=240)


def test_ring_all_gather_equals_torch(world):
    for rank, result in enumerate(world):
        checks = result["collectives"]
        for key, same in checks.items():
            if key.startswith("ag_"):
                assert same is True, (rank, key)


def test_ring_reduce_scatter_equals_torch(world):
    for rank, result in enumerate(world):
        for key, err in result["collectives"].items():
            if not key.startswith("rs_"):
                continue
            # Two ranks add the same two numbers as gloo; four add in another order.
            tol = 0.0 if "_pair_" in key else (1e-2 if "bfloat16" in key else 1e-6)
            assert err <= tol, (rank, key, err)


def test_async_all_gather(world):
    for rank, result in enumerate(world):
        checks = result["collectives"]
        returned_work, firsts = checks["async_pair"]
        assert returned_work  # 2 ranks: left unfinished for FSDP's prefetch to overlap
        assert firsts == ([0.0, 1.0] if rank < 2 else [2.0, 3.0])
        returned_work, firsts = checks["async_world"]
        assert not returned_work and firsts == [0.0, 1.0, 2.0, 3.0]  # more ranks: finished on return


def test_mismatched_sizes_are_refused(world):
    assert world[0]["collectives"]["size_error"] == (
        "RingReduceScatter: the full buffer has 7 elements, not 2 x 3 (the chunk's) for a group of 2 ranks."
    )


def test_ring_scratch_is_one_output(world):
    """What `simdevice.reduce_scatter_scratch` assumes: besides its input and output, the ring holds
    one output-sized receive buffer."""
    scratch = world[0]["collectives"]["scratch"]
    assert scratch["ring"] == scratch["input"] + 2 * scratch["output"], scratch


def test_training_with_rings_equals_torch_collectives(world):
    for result in world:
        for variant in ("auto", "ring"):
            for name, want in result["torch"]["weights"].items():
                assert rel_diff(result[variant]["weights"][name], want) < 1e-5, (variant, name)


def test_hsdp_shard_groups_use_rings_and_match(world):
    for result in world:
        auto, torch_ = result["hsdp_auto"], result["hsdp_torch"]
        assert auto["rings"] == 4 and torch_["rings"] == 0
        assert auto["counts"]["all_reduce"] == torch_["counts"]["all_reduce"] > 0  # across replicas, unchanged
        for name, want in torch_["weights"].items():
            assert rel_diff(auto["weights"][name], want) < 1e-5, name
            # and the same training as 1-D FSDP over all four ranks
            assert rel_diff(want, result["torch"]["weights"][name]) < 1e-5, name


def test_rings_carry_every_fsdp_collective_on_gloo(world):
    groups = 4  # blocks.0-2 and the root
    for result in world:
        auto, torch_ = result["auto"], result["torch"]
        assert auto["rings"] == result["ring"]["rings"] == groups and torch_["rings"] == 0
        # Counted once whichever carried them: the same FSDP collectives per step.
        assert auto["counts"]["all_gather_single"] == torch_["counts"]["all_gather_single"] > 0
        assert auto["counts"]["reduce_scatter_single"] == torch_["counts"]["reduce_scatter_single"] == 2 * groups
        assert (
            auto["plan"]
            == f"collectives: point-to-point rings on {groups} of {groups} FSDP groups, torch's on the rest"
        )
        assert torch_["plan"] == "collectives: torch's"


def test_bad_collectives_value_names_field(world):
    assert "FSDP2Config.collectives='nccl' is invalid; use one of auto, ring, torch" in world[0]["bad_value"]

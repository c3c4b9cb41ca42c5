"""FSDP + tensor parallel (2-D) on 4 CPU ranks: 2 dp x 2 tp training equals one process, helpers on
2-D DTensors (clipping, no_sync), a user-parallelised block, checkpoints 2x2 -> 4x1 -> 1 and export,
and the errors for sizes that do not divide."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.harness import run_distributed
from helpers.models import TP_PLAN as PLAN
from helpers.models import TPGPT

TIMEOUT = 240


def _model(seed: int = 0, **kwargs) -> TPGPT:
    torch.manual_seed(seed)
    return TPGPT(**kwargs)


def _batch(step: int, n: int = 8):
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, 64, (n, 12), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def _loss(model, idx, target):
    return F.cross_entropy(model(idx).reshape(-1, 64), target.reshape(-1))


def _full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _rel(a: dict, b: dict) -> float:
    """Largest relative difference per tensor; the floor covers tensors that are ~0 in exact
    arithmetic (the key bias's gradient: softmax ignores a constant added to every key)."""
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-3)).item() for k in b)


def _reference(steps: int = 2, micro: int = 1) -> tuple[list[dict], list[dict], list[float]]:
    """One process on the global batches: grads and params after each step, and the clip norms."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads, params, norms = [], [], []
    for step in range(steps):
        idx, target = _batch(step)
        for m in range(micro):
            part = slice(m * 8 // micro, (m + 1) * 8 // micro)
            (_loss(model, idx[part], target[part]) / micro).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return grads, params, norms


def _train_2d(model, opt, steps: int, micro: int = 1):
    """Each dp rank takes its half of the global batch; both tp ranks of a dp group see the same."""
    import torch.distributed as dist

    import fsdp2_strategy as f2

    dp_rank = dist.get_rank() // 2
    grads, params, norms = [], [], []
    for step in range(steps):
        idx, target = _batch(step)
        mine = slice(dp_rank * 4, dp_rank * 4 + 4)
        idx, target = idx[mine], target[mine]
        for m in range(micro):
            part = slice(m * 4 // micro, (m + 1) * 4 // micro)
            ctx = f2.no_sync(model) if m < micro - 1 else torch.enable_grad()
            with ctx:
                (_loss(model, idx[part], target[part]) / micro).backward()
        grads.append({n: _full(p.grad) for n, p in model.named_parameters()})
        norms.append(float(f2.clip_grad_norm_(list(model.parameters()), 1.0)))
        opt.step()
        opt.zero_grad()
        params.append({n: _full(p) for n, p in model.named_parameters()})
    return grads, params, norms


def _world_2x2(root: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import fsdp2_strategy as f2

    out: dict = {}
    ref_grads, ref_params, ref_norms = _reference()
    # (1) the core applies TP then FSDP; 2 steps with clipping equal one process.
    model = f2.shard_model(_model(), tensor_parallel_size=2, tensor_parallel_plan=PLAN, log_plan=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads, params, norms = _train_2d(model, opt, 2)
    out["grad_rel"] = max(_rel(g, r) for g, r in zip(grads, ref_grads))
    out["param_rel"] = max(_rel(p, r) for p, r in zip(params, ref_params))
    out["norm_rel"] = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
    out["plan"] = str(f2.sharding_plan(model))
    out["mesh"] = tuple(model.blocks[0].attn.q.weight.device_mesh.shape)

    # (2) accumulation over 2 micro-batches with no_sync.
    acc_grads, _, _ = _reference(steps=1, micro=2)
    model2 = f2.shard_model(_model(), tensor_parallel_size=2, tensor_parallel_plan=PLAN, log_plan=False)
    grads2, _, _ = _train_2d(model2, torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9), 1, micro=2)
    out["no_sync_rel"] = _rel(grads2[0], acc_grads[0])

    # (3) checkpoint 2x2, load into 4x1 FSDP (same world), export; compare with the trained params.
    ck = f2.Checkpointer(f"{root}/ckpt")
    ck.save(2, model=model, optimizer=opt)
    flat = f2.shard_model(_model(seed=5), log_plan=False)
    flat_opt = torch.optim.SGD(flat.parameters(), lr=0.1, momentum=0.9)
    ck.load(model=flat, optimizer=flat_opt)
    out["load_4x1_rel"] = _rel({n: _full(p) for n, p in flat.named_parameters()}, params[-1])
    # one more step on both layouts stays equal (optimizer state resharded too)
    _, p2d, _ = _train_2d(model, opt, 1)
    idx, target = _batch(0)
    mine = slice(dist.get_rank() * 2, dist.get_rank() * 2 + 2)
    _loss(flat, idx[mine], target[mine]).backward()
    f2.clip_grad_norm_(list(flat.parameters()), 1.0)
    flat_opt.step()
    out["step_after_load_rel"] = _rel({n: _full(p) for n, p in flat.named_parameters()}, p2d[-1])
    if dist.get_rank() == 0:
        f2.export_full(ck.step_path(2), f"{root}/export")
    dist.barrier()
    info = f2.inspect_checkpoint(ck.step_path(2))
    out["inspect"] = (info.world_size, info.tensors["model.blocks.0.attn.q.weight"][0])
    # Full weights into a 2x2 model: each rank reads its own (TP x FSDP) rows.
    fresh2d = f2.shard_model(_model(seed=11), tensor_parallel_size=2, tensor_parallel_plan=PLAN, log_plan=False)
    f2.load_full_weights(fresh2d, f"{root}/export/model.safetensors")
    out["load_full_2d_rel"] = _rel({n: _full(p) for n, p in fresh2d.named_parameters()}, params[-1])

    # (4) a block the user made tensor-parallel and sharded on mesh["dp"], then shard_model on mesh["dp"].
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    user = _model()
    for block in user.blocks:
        parallelize_module(block.mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    f2.shard_model(user, wrap_policy=None, mesh=mesh["dp"], log_plan=False)
    grads_user, _, _ = _train_2d(user, torch.optim.SGD(user.parameters(), lr=0.1, momentum=0.9), 1)
    out["user_block_rel"] = _rel(grads_user[0], ref_grads[0])

    # (5) a direct forward() on a sharded TP module is still caught.
    try:
        model.blocks[0].forward(torch.zeros(1, 4, 32))
        out["direct_forward"] = "no error"
    except ValueError as exc:
        out["direct_forward"] = str(exc)

    # (6) sizes that do not divide.
    errors = {}
    for label, kwargs, make in (
        ("world", {"tensor_parallel_size": 3}, _model),
        ("heads", {"tensor_parallel_size": 2}, lambda: _model(dim=24, heads=3)),
        ("glob", {"tensor_parallel_size": 2, "tensor_parallel_plan": {"nope.*": "colwise"}}, _model),
    ):
        try:
            f2.shard_model(make(), log_plan=False, **{"tensor_parallel_plan": PLAN, **kwargs})
            errors[label] = "no error"
        except ValueError as exc:
            errors[label] = str(exc)
    out["errors"] = errors
    return out


def _world_one(root: str) -> dict:
    import fsdp2_strategy as f2

    model = f2.shard_model(_model(seed=9), log_plan=False)
    f2.Checkpointer(f"{root}/ckpt").load(model=model)
    from safetensors.torch import load_file

    exported = load_file(f"{root}/export/model.safetensors")
    loaded = {n: _full(p) for n, p in model.named_parameters()}
    return {"export_rel": _rel(exported, loaded), "export_keys": sorted(exported) == sorted(loaded)}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tp"))
    results = run_distributed(_world_2x2, 4, root, timeout=TIMEOUT)
    return root, results


def test_2d_training_equals_one_process(world):
    _, results = world
    for r in results:
        assert r["mesh"] == (2, 2)
        assert r["grad_rel"] < 1e-5 and r["param_rel"] < 1e-5 and r["norm_rel"] < 1e-5
        assert r["no_sync_rel"] < 1e-5


def test_plan_shows_tensor_parallel_styles(world):
    plan = world[1][0]["plan"]
    assert "colwise 4, rowwise 2" in plan and "2x2" in plan


def test_user_parallelised_block_runs_and_guard_still_catches_direct_forward(world):
    for r in world[1]:
        assert r["user_block_rel"] < 1e-5
        assert "called directly on a sharded module" in r["direct_forward"]


def test_2x2_checkpoint_loads_on_4x1_and_one_process_and_exports(world):
    root, results = world
    for r in results:
        assert r["load_4x1_rel"] < 1e-6 and r["step_after_load_rel"] < 1e-5
        assert r["load_full_2d_rel"] == 0.0
        assert r["inspect"] == (4, (32, 32))
    one = run_distributed(_world_one, 1, root, timeout=TIMEOUT)[0]
    assert one["export_keys"] and one["export_rel"] == 0.0


def test_sizes_that_do_not_divide_name_the_field(world):
    errors = world[1][0]["errors"]
    assert "tensor_parallel_size=3 does not divide the world size 4" in errors["world"]
    assert "tensor_parallel_size=2 does not divide" in errors["heads"] and "heads=3" in errors["heads"]
    assert "'nope.*' matches no module" in errors["glob"]


def test_config_validates_tensor_parallel_fields():
    import fsdp2_strategy as f2

    with pytest.raises(ValueError, match="tensor_parallel_size=0 is invalid"):
        f2.FSDP2Config(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="invalid styles"):
        f2.FSDP2Config(tensor_parallel_plan={"a": "diagonal"})
    with pytest.raises(ValueError, match="change the sharding strategy"):
        f2.FSDP2Config(tensor_parallel_size=2, module_overrides={"a": {"sharding_strategy": "HYBRID_SHARD"}})

"""Every code block of the seed texts (`shared/seeds/*.txt`), run as a new user would on 2 ranks.

Each block is adapted only from cuda to cpu and imports `fully_shard` from `fsdp2_strategy`
(where a block has no model or no forward, the smallest one that fits is supplied). Each
either trains with gradients equal to one process on the same global batch (fp32: relative
difference < 1e-5), or for a bf16/fp16 policy computes in the policy's dtype inside the layer
with a loss within 2e-2 of one fp32 process, or raises the documented clear error.

Blocks (seed file: block):
- fsdp1_api_docs: `FSDP(my_module)` + Adam loop; `custom_auto_wrap_policy(module, recurse,
  unwrapped_params, min_num_params)` passed as `fsdp_auto_wrap_policy`.
- sharding_strategies_notebook: the four `ShardingStrategy` members; the `FSDP(model,
  auto_wrap_policy=..., mixed_precision=..., backward_prefetch=..., sharding_strategy=
  SHARD_GRAD_OP, device_id=..., forward_prefetch=True)` init.
- fully_shard_overview: 1 basic per-layer sharding in `__init__`; 2 per-module fp16
  `MixedPrecision`; 3 combining with DDP; FAQ 2 sharding the attention layers in a loop (and
  "just shard one layer", `limit_all_gathers=True`); FAQ 4 `checkpoint_wrapper`; `overlap_comm=True`;
  custom process groups; meta-device initialisation.
- fsdp2_skill: bottom-up `fully_shard` of a block then the root, both with
  `MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from helpers.harness import run_agreeing, run_distributed
from helpers.models import Block, rel_diff
from torch import nn

GLOBAL = 8  # global batch; each of the 2 ranks takes 4 rows


# --------------------------------------------------------------------------- helpers
def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(x):
    import torch.distributed as dist

    per = x.shape[0] // dist.get_world_size()
    return x[dist.get_rank() * per : (dist.get_rank() + 1) * per]


def _name(n: str) -> str:
    """Parameter names without wrapper prefixes (DDP's `module.`, checkpoint_wrapper's)."""
    return n.replace("_checkpoint_wrapped_module.", "").removeprefix("module.")


def _grads(model):
    return {_name(n): _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def _worst(got: dict, want: dict) -> float:
    assert set(got) == set(want), (sorted(got), sorted(want))
    return max(rel_diff(got[n], want[n]) for n in want)


def _full_state(model):
    return {_name(n): _full(p).detach().clone() for n, p in model.named_parameters()}


def _deltas(after: dict, before: dict) -> dict:
    return {n: after[n] - before[n] for n in before}


def _mean_over_ranks(loss):
    import torch.distributed as dist

    t = loss.detach().float().clone()
    dist.all_reduce(t)
    return (t / dist.get_world_size()).item()


def _error(exc_type, fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        return str(exc)
    raise AssertionError(f"{fn} did not raise {exc_type.__name__}")


def _batch(*shape, seed=0):
    return torch.randn(GLOBAL, *shape, generator=torch.Generator().manual_seed(seed))


def _fp32_parity(model, ref, x, y, **call):
    """One step of MSE on the local rows vs one process on all rows: worst relative grad diff."""
    F.mse_loss(model(_local(x), **call), _local(y)).backward()
    F.mse_loss(ref(x, **call), y).backward()
    return _worst(_grads(model), _grads(ref))


class MLP(nn.Module):
    def __init__(self, d_in=16, hidden=64, d_out=4):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, d_out)
        )

    def forward(self, x):
        return self.net(x)


class KwargsModule(MLP):
    """The api docs call `sharded_module(x, y=3, z=torch.Tensor([1]))`."""

    def forward(self, x, y=0, z=None):
        return self.net(x) * y + z


# --------------------------------------------------------------------------- world 1: fp32 blocks
def _api_docs_blocks(out):
    import fsdp2_strategy as f2
    from fsdp2_strategy import fully_shard as FSDP  # the docs' `FullyShardedDataParallel as FSDP`

    torch.manual_seed(0)
    my_module = KwargsModule()
    ref = copy.deepcopy(my_module)
    sharded_module = FSDP(my_module)
    optim = torch.optim.Adam(sharded_module.parameters(), lr=0.0001)
    x = _batch(16)
    out_local = sharded_module(_local(x), y=3, z=torch.Tensor([1]))
    loss = out_local.sum()
    loss.backward()
    # Each rank sums its rows and FSDP averages: one process sums all rows over the world size.
    (ref(x, y=3, z=torch.Tensor([1])).sum() / 2).backward()
    out["docs_fsdp"] = _worst(_grads(sharded_module), _grads(ref))
    before = _full_state(ref)
    optim.step()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.0001)
    ref_opt.step()
    out["docs_fsdp_step"] = _worst(_deltas(_full_state(sharded_module), before), _deltas(_full_state(ref), before))

    def custom_auto_wrap_policy(
        module: nn.Module,
        recurse: bool,
        unwrapped_params: int,
        # These are customizable for this policy function.
        min_num_params: int = int(1e8),
    ) -> bool:
        return unwrapped_params >= min_num_params

    torch.manual_seed(1)
    model = MLP()
    ref = copy.deepcopy(model)
    FSDP(
        model, process_group=None, fsdp_auto_wrap_policy=functools.partial(custom_auto_wrap_policy, min_num_params=1000)
    )
    out["docs_policy_groups"] = [g.name for g in f2.sharding_plan(model).groups]
    out["docs_policy"] = _fp32_parity(model, ref, _batch(16), _batch(4, seed=1))

    # FSDP1's recurse=True question: False for a parent stops the descent into it.
    def no_descent_into_net(module, recurse, nonwrapped_numel):
        return not isinstance(module, nn.Sequential) if recurse else isinstance(module, nn.Linear)

    wrapper = MLP()
    wrapper.out = nn.Linear(4, 4)
    FSDP(wrapper, auto_wrap_policy=no_descent_into_net)
    out["docs_recurse_groups"] = [g.name for g in f2.sharding_plan(wrapper).groups]


def _notebook_strategies(out):
    from torch.distributed.fsdp import ShardingStrategy

    from fsdp2_strategy import fully_shard as FSDP

    x, y = _batch(16), _batch(4, seed=1)
    for strategy in (
        ShardingStrategy.FULL_SHARD,
        ShardingStrategy.SHARD_GRAD_OP,
        ShardingStrategy.NO_SHARD,
        ShardingStrategy.HYBRID_SHARD,
    ):
        torch.manual_seed(2)
        model = MLP()
        ref = copy.deepcopy(model)
        model = FSDP(model, sharding_strategy=strategy)
        out[f"notebook_{strategy.name}"] = _fp32_parity(model, ref, x, y)


class MyModel(nn.Module):
    """fully_shard_overview example 1, as written (a forward added: the seed has none)."""

    def __init__(self):
        from torch.distributed.fsdp.api import ShardingStrategy

        from fsdp2_strategy import fully_shard

        super().__init__()
        self.layer1 = nn.Linear(1024, 4096)
        self.layer2 = nn.Linear(4096, 4096)
        self.layer3 = nn.Linear(4096, 1024)

        # Shard only specific layers
        fully_shard(self.layer1, sharding_strategy=ShardingStrategy.FULL_SHARD)
        fully_shard(self.layer2, sharding_strategy=ShardingStrategy.HYBRID_SHARD)

    def forward(self, x):
        return self.layer3(torch.relu(self.layer2(torch.relu(self.layer1(x)))))


def _overview_basic(out):
    import fsdp2_strategy as f2

    torch.manual_seed(3)
    model = MyModel().to("cpu")  # the seed's .cuda()
    ref = nn.Module()
    ref.layer1, ref.layer2, ref.layer3 = nn.Linear(1024, 4096), nn.Linear(4096, 4096), nn.Linear(4096, 1024)
    ref.load_state_dict(_full_state(model))
    ref.forward = functools.partial(MyModel.forward, ref)
    x, y = _batch(1024, seed=3), _batch(1024, seed=4)
    F.mse_loss(model(_local(x)), _local(y)).backward()
    F.mse_loss(ref(x), y).backward()
    got, want = _grads(model), _grads(ref)
    out["basic_sharded"] = max(rel_diff(got[n], want[n]) for n in want if not n.startswith("layer3"))
    # As written, layer3 is not data-parallel: its gradient is this rank's rows only.
    local_ref = copy.deepcopy(ref)
    local_ref.zero_grad()
    F.mse_loss(local_ref(_local(x)), _local(y)).backward()
    out["basic_layer3_local"] = rel_diff(got["layer3.weight"], local_ref.layer3.weight.grad)
    out["basic_layer3_global"] = rel_diff(got["layer3.weight"], want["layer3.weight"])
    # The one added line, f2.replicate(model), makes the rest data-parallel.
    f2.replicate(model)
    model.zero_grad()
    ref.zero_grad()
    out["basic_replicated"] = _fp32_parity(model, ref, x, y)


class AttnStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.attention_layers = nn.ModuleList(Block(32, 4) for _ in range(2))
        self.your_biggest_layer = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.attention_layers:
            x = layer(x)
        return self.out(torch.relu(self.your_biggest_layer(x)))


def _overview_faq(out):
    import fsdp2_strategy as f2
    from fsdp2_strategy import fully_shard

    torch.manual_seed(4)
    model = AttnStack()
    ref = copy.deepcopy(model)
    # Shard only the attention layers
    for attn_layer in model.attention_layers:
        fully_shard(attn_layer)
    # Just shard one layer to start (FAQ 3's limit_all_gathers=True is what FSDP2 does anyway)
    fully_shard(model.your_biggest_layer, limit_all_gathers=True)
    f2.replicate(model)
    x, y = _batch(6, 16, seed=5), _batch(6, 4, seed=6)
    out["faq_loop"] = _fp32_parity(model, ref, x, y)

    # FAQ 4. The seed's import path does not exist in torch; the class lives in _checkpoint.
    try:
        import importlib

        importlib.import_module("torch.distributed.algorithms.checkpoint")
        out["faq_ckpt_import"] = "imported"
    except ImportError as exc:
        out["faq_ckpt_import"] = type(exc).__name__
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(5)
    big = MLP()
    ref = copy.deepcopy(big)
    layer = checkpoint_wrapper(big)
    fully_shard(layer)  # Works perfectly
    out["faq_checkpoint_wrapper"] = _fp32_parity(layer, ref, _batch(16), _batch(4, seed=1))


def _overview_advanced(out):
    import torch.distributed as dist
    from torch.distributed import new_group

    from fsdp2_strategy import fully_shard

    # 1. Overlap communication: no FSDP has this keyword.
    out["overlap_comm"] = _error(ValueError, fully_shard, MLP(), process_group=None, overlap_comm=True)

    # 2. Custom process groups.
    torch.manual_seed(6)
    module = MLP()
    ref = copy.deepcopy(module)
    shard_group = new_group(ranks=list(range(dist.get_world_size())))
    fully_shard(module, process_group=shard_group)
    out["process_group_mesh"] = tuple(next(module.parameters()).device_mesh.shape)
    out["process_group"] = _fp32_parity(module, ref, _batch(16), _batch(4, seed=1))

    # 3. Memory-efficient initialisation.
    class MyGiantModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer1 = nn.Linear(16, 64)
            self.layer2 = nn.Linear(64, 4)

        def forward(self, x):
            return self.layer2(torch.relu(self.layer1(x)))

    with torch.device("meta"):  # Create model without allocating memory
        huge_model = MyGiantModel()

    # Materialize parameters only when sharded
    fully_shard(huge_model.layer1)
    huge_model.layer1.to_empty(device="cpu")
    out["meta_layer1"] = [(p.device.type, tuple(p.to_local().shape)) for p in huge_model.layer1.parameters()]
    # The seed stops here; the same two lines for the other layer, then an init (to_empty
    # leaves memory uninitialised), make the model trainable.
    fully_shard(huge_model.layer2)
    huge_model.layer2.to_empty(device="cpu")
    torch.manual_seed(7)
    huge_model.layer1.reset_parameters()
    huge_model.layer2.reset_parameters()
    ref = MyGiantModel()
    ref.load_state_dict(_full_state(huge_model))
    out["meta_init"] = _fp32_parity(huge_model, ref, _batch(16), _batch(4, seed=1))


def _fp32_world():
    out: dict = {}
    _api_docs_blocks(out)
    _notebook_strategies(out)
    _overview_basic(out)
    _overview_faq(out)
    _overview_advanced(out)
    return out


def test_seed_blocks_fp32_train_like_one_process():
    for res in run_distributed(_fp32_world, 2, timeout=240):  # layer3 trains on each rank's own rows
        _check_fp32_world(res)


def _check_fp32_world(res: dict) -> None:
    parity = {k: v for k, v in res.items() if isinstance(v, float) and k not in ("basic_layer3_global",)}
    assert all(v < 1e-5 for v in parity.values()), parity
    assert len(parity) == 14, sorted(parity)
    # Policy at 1000 params: Linear(16, 64) and Linear(64, 64) reach it, Linear(64, 4) does not.
    assert res["docs_policy_groups"] == ["<root>", "net.0", "net.2"]
    # recurse=True answered False for the Sequential: none of its Linears became a group.
    assert res["docs_recurse_groups"] == ["<root>", "out"]
    # As written, the unsharded layer3 trains on this rank's rows only (FSDP1 did the same).
    assert res["basic_layer3_local"] < 1e-5 and res["basic_layer3_global"] > 1e-2
    assert res["faq_ckpt_import"] == "ModuleNotFoundError"
    assert "overlap_comm" in res["overlap_comm"] and "forward_prefetch" in res["overlap_comm"]
    assert res["process_group_mesh"] == (2,)
    assert res["meta_layer1"] == [("cpu", (32, 16)), ("cpu", (32,))]


# --------------------------------------------------------------------------- world 2: precision
class Attention(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.register_buffer("scale", torch.tensor(dim**-0.5))

    def forward(self, x):
        att = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) * self.scale, dim=-1)
        return self.o(att @ self.v(x))


class AttnModel(nn.Module):
    """A model whose other layers are not sharded: `model.attention_layer` gets the fp16 policy."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.attention_layer = Attention()
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        x = self.inp(x)
        x = x + self.attention_layer(x)  # fp32 + fp16 promotes back to fp32
        return self.head(x)


class BlockNet(nn.Module):
    """Float inputs, transformer blocks and a BatchNorm (FSDP1's `_module_classes_to_ignore`)."""

    def __init__(self):
        super().__init__()
        self.proj_in = nn.Linear(8, 32)
        self.norm = nn.BatchNorm1d(32).eval()  # running statistics: the same on every rank
        self.blocks = nn.ModuleList(Block(32, 4) for _ in range(2))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        x = self.proj_in(x)
        x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _record_dtypes(module, seen, key):
    def hook(mod, args):
        seen.setdefault(key, set()).update({str(args[0].dtype), str(mod.weight.dtype)})

    module.register_forward_pre_hook(hook)


def _policy_parity(model, ref, x, y, dtype, cast=None) -> dict:
    """One backward of this rank's rows against the policy written out without the engine
    (tests/helpers/precision.py): relative gradient difference per parameter, and the reductions' dtypes."""
    import torch.distributed as dist
    from helpers.comm import collective_dtypes
    from helpers.precision import policy_grads

    with collective_dtypes() as reductions:
        F.mse_loss(model(_local(x)).float(), _local(y)).backward()
    per = x.shape[0] // dist.get_world_size()
    halves = [[(x[r * per : (r + 1) * per], y[r * per : (r + 1) * per])] for r in range(dist.get_world_size())]
    ref_grads = policy_grads(ref, halves, lambda low, xs, ys: F.mse_loss(low(xs).float(), ys), dtype, cast=cast)
    got = _grads(model)
    assert set(got) == set(ref_grads), (sorted(got), sorted(ref_grads))
    # Relative to at least 1e-3: the key bias's gradient is zero in exact arithmetic (softmax ignores a
    # shift), ~1e-6 of rounding noise here, which a low-precision reduction changes relatively a lot.
    errors = {n: ((got[n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-3)).item() for n in ref_grads}
    return {"errors": errors, "reductions": sorted(reductions)}


def _cast_inputs(module: nn.Module, dtype: torch.dtype, output_dtype: torch.dtype | None = None) -> None:
    """What FSDP's policy does at a group's boundary: floating inputs cast to `dtype`, output to `output_dtype`."""
    module.register_forward_pre_hook(lambda m, args: tuple(a.to(dtype) if a.is_floating_point() else a for a in args))
    if output_dtype is not None:
        module.register_forward_hook(lambda m, args, out: out.to(output_dtype))


def _attention_in(dtype):
    """fully_shard_overview example 2's policy: only the attention layer (weights, buffer, inputs) in `dtype`."""

    def cast(model):
        low = copy.deepcopy(model)
        low.attention_layer.to(dtype)
        _cast_inputs(low.attention_layer, dtype)
        return low

    return cast


def _blocks_in_bf16_norm_in_fp32(model):
    """The notebook's policy: bf16 everywhere (inputs cast at the root) but the BatchNorm, an fp32 group
    whose output goes back to bf16 (FSDP1's `_module_classes_to_ignore`)."""
    low = copy.deepcopy(model).to(torch.bfloat16)
    low.norm.to(torch.float32)
    _cast_inputs(low, torch.bfloat16)
    _cast_inputs(low.norm, torch.float32, output_dtype=torch.bfloat16)
    return low


def _all_in_bf16(model):
    """The nested example's policy: every group's parameters bf16 (buffers keep their dtype: no
    buffer_dtype), the root casting the fp32 input."""
    from helpers.precision import cast_copy

    low = cast_copy(model, torch.bfloat16)
    _cast_inputs(low, torch.bfloat16)
    return low


def _precision_world():
    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    import fsdp2_strategy as f2
    from fsdp2_strategy import fully_shard

    out: dict = {}
    seen: dict = {}
    # fully_shard_overview example 2.
    torch.manual_seed(10)
    model = AttnModel()
    ref = copy.deepcopy(model)
    fp16_policy = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16)
    fully_shard(model.attention_layer, sharding_strategy=ShardingStrategy.FULL_SHARD, mixed_precision=fp16_policy)
    f2.replicate(model)  # the layers left unsharded are data-parallel too
    _record_dtypes(model.attention_layer.q, seen, "fp16_attention")
    out["fp16_buffer"] = str(model.attention_layer.scale.dtype)
    out["fp16_plan_note"] = f2.sharding_plan(model).groups[0].note
    out["fp16_grad_err"] = _policy_parity(
        model, ref, _batch(5, 8, seed=11), _batch(5, 4, seed=12), torch.float16, cast=_attention_in(torch.float16)
    )

    # sharding_strategies_notebook's FSDP init, with the most common FSDP1 precision setting.
    torch.manual_seed(11)
    model = BlockNet()
    ref = copy.deepcopy(model)
    my_auto_wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    mp_policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    prefetch_policy = BackwardPrefetch.BACKWARD_PRE
    model = fully_shard(
        model,
        auto_wrap_policy=my_auto_wrap_policy,
        mixed_precision=mp_policy,
        backward_prefetch=prefetch_policy,
        # sharding control
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,  # Zero2 or DDP, or Full_Shard (FSDP default)
        device_id=torch.device("cpu"),  # the seed's torch.cuda.current_device()
        forward_prefetch=True,
    )
    _record_dtypes(model.blocks[0].mlp[0], seen, "bf16_block")
    _record_dtypes(model.norm, seen, "bf16_batchnorm")
    plan = f2.sharding_plan(model)
    out["bf16_rows"] = [(g.name, g.strategy, g.precision) for g in plan.groups]
    out["bf16_root_note"] = plan.groups[0].note
    out["bf16_buffers"] = sorted({str(b.dtype) for b in model.buffers() if b.is_floating_point()})
    out["bf16_grad_err"] = _policy_parity(
        model, ref, _batch(5, 8, seed=13), _batch(5, 4, seed=14), torch.bfloat16, cast=_blocks_in_bf16_norm_in_fp32
    )

    # buffer_dtype=bf16: the BatchNorm group computes in fp32 and keeps fp32 statistics (as in FSDP1).
    torch.manual_seed(11)
    model = fully_shard(
        BlockNet(),
        auto_wrap_policy=my_auto_wrap_policy,
        mixed_precision=MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16
        ),
    )
    out["bf16_bn_buffers"] = sorted({str(b.dtype) for b in model.norm.buffers() if b.is_floating_point()})
    out["bf16_bn_forward"] = str(model(_local(_batch(5, 8))).dtype)

    # fsdp2_skill: bottom-up, a nested block and its parent with the same FSDP1 policy.
    torch.manual_seed(12)
    model = AttnModel()
    ref = copy.deepcopy(model)
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model.attention_layer, mixed_precision=bf16)
    fully_shard(model, mixed_precision=bf16)
    _record_dtypes(model.inp, seen, "nested_root")
    _record_dtypes(model.attention_layer.q, seen, "nested_block")
    out["nested_grad_err"] = _policy_parity(
        model, ref, _batch(5, 8, seed=15), _batch(5, 4, seed=16), torch.bfloat16, cast=_all_in_bf16
    )

    # FSDP1 fields with no FSDP2 meaning are refused, naming the field.
    out["low_precision_grads"] = _error(
        ValueError,
        fully_shard,
        MLP(),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True),
    )
    out["seen"] = {k: sorted(v) for k, v in seen.items()}
    return out


def test_seed_precision_blocks_compute_in_the_policy_dtype():
    res = run_agreeing(_precision_world, 2, timeout=240)
    seen = res["seen"]
    # fp16 per-module policy: inputs and weights are fp16 inside the layer; buffers cast, plan says so.
    assert seen["fp16_attention"] == ["torch.float16"]
    assert res["fp16_buffer"] == "torch.float16" and "1 buffers cast to float16" in res["fp16_plan_note"]
    assert "inputs cast to float16 when root" in res["fp16_plan_note"]
    # Gradients against the policy written out (only the attention layer in fp16): its reduction runs in
    # fp16 (reduce_dtype=float16), one fp16 rounding (2**-11) from the reference's fp32 average (measured
    # <= 2.6e-4); the replicated fp32 layers exactly. The attention group reduce-scatters in fp16.
    fp16 = res["fp16_grad_err"]
    assert max(fp16["errors"].values()) < 2.0**-10, fp16
    assert {d for n, d in fp16["reductions"] if n.startswith("reduce_scatter")} == {"float16"}, fp16
    # Wrapper kwargs: blocks compute in bf16; BatchNorm is its own fp32 group (FSDP1's default).
    assert seen["bf16_block"] == ["torch.bfloat16"]
    assert seen["bf16_batchnorm"] == ["torch.float32"]
    rows = {name: (strategy, precision) for name, strategy, precision in res["bf16_rows"]}
    assert rows == {
        "<root>": ("SHARD_GRAD_OP", "bf16/fp32"),
        "norm": ("SHARD_GRAD_OP", "fp32/fp32"),
        "blocks.0": ("SHARD_GRAD_OP", "bf16/fp32"),
        "blocks.1": ("SHARD_GRAD_OP", "bf16/fp32"),
    }
    # buffer_dtype=float32 equals the buffers' dtype: nothing cast, nothing said about buffers.
    assert res["bf16_buffers"] == ["torch.float32"] and "buffers" not in res["bf16_root_note"]
    bf16 = res["bf16_grad_err"]  # against the policy written out (BatchNorm in fp32), fp32 reduction
    assert max(bf16["errors"].values()) < 1e-5 and {d for _, d in bf16["reductions"]} == {"float32"}, bf16
    assert res["bf16_bn_buffers"] == ["torch.float32"] and res["bf16_bn_forward"] == "torch.bfloat16"
    # Nested + parent: the root casts the fp32 input once; the nested block computes in bf16.
    assert seen["nested_root"] == ["torch.bfloat16"] and seen["nested_block"] == ["torch.bfloat16"]
    # Nested: exact but for `inp`, upstream of the residual `x + attention(x)`, where the two branches'
    # bf16 gradients meet: the engine and the reference add them at different points (one bf16
    # rounding, measured 3.1e-3); the reductions run in fp32.
    nested = res["nested_grad_err"]
    assert all(e < (2.0**-8 if n.startswith("inp.") else 1e-5) for n, e in nested["errors"].items()), nested
    assert {d for _, d in nested["reductions"]} == {"float32"}, nested
    assert "keep_low_precision_grads" in res["low_precision_grads"]


# --------------------------------------------------------------------------- world 3: shard + replicate
class GPTish(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.gpt_layers = nn.Sequential(Block(32, 4), Block(32, 4))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.gpt_layers(self.embed(x)))


def _ddp_world(root):
    import torch.distributed as dist
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fsdp2_strategy as f2
    from fsdp2_strategy import fully_shard

    out: dict = {}
    x, y = _batch(5, 8, seed=20), _batch(5, 4, seed=21)

    # As written: torch's DDP cannot take DTensor parameters.
    torch.manual_seed(20)
    model = GPTish()
    fully_shard(model.gpt_layers, sharding_strategy=ShardingStrategy.FULL_SHARD)
    out["ddp_as_written"] = _error(Exception, DDP, model)

    # torch as written plus one line: DDP told to ignore the parameters FSDP owns.
    torch.manual_seed(20)
    model = GPTish()
    ref = copy.deepcopy(model)
    fully_shard(model.gpt_layers, sharding_strategy=ShardingStrategy.FULL_SHARD)
    DDP._set_params_and_buffers_to_ignore_for_model(
        model, [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    )
    ddp = DDP(model)
    out["ddp_ignore"] = _fp32_parity(ddp, ref, x, y)

    # The FSDP2 form: f2.replicate(model).
    torch.manual_seed(20)
    model = GPTish()
    ref = copy.deepcopy(model)
    fully_shard(model.gpt_layers, sharding_strategy=ShardingStrategy.FULL_SHARD)
    f2.replicate(model)
    out["plan"] = [(g.name, g.module_type, g.strategy, g.num_params) for g in f2.sharding_plan(model).groups]
    out["plan_text"] = str(f2.sharding_plan(model))
    # Accumulation: two micro-batches per rank, the first under no_sync.
    local_x, local_y = _local(x), _local(y)
    with f2.no_sync(model):
        (F.mse_loss(model(local_x[:2]), local_y[:2]) / 2).backward()
        out["unsynced_head_grad"] = model.head.weight.grad.clone()
    (F.mse_loss(model(local_x[2:]), local_y[2:]) / 2).backward()
    F.mse_loss(ref(x), y).backward()
    out["accumulate"] = _worst(_grads(model), _grads(ref))
    norm = f2.clip_grad_norm_(model.parameters(), max_norm=0.05)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.05)
    out["clip_norm"] = rel_diff(norm, ref_norm)
    out["clipped"] = _worst(_grads(model), _grads(ref))
    # SGD with momentum: an exact function of the gradient, with optimizer state to checkpoint.
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt.step()
    ref_opt.step()
    # Parameters, not updates: an update of ~1e-3 loses digits when subtracted back out.
    out["after_step"] = _worst(_full_state(model), _full_state(ref))
    # Checkpointer: save, spoil, load back.
    saved = _full_state(model)
    ck = f2.Checkpointer(root)
    ck.save(1, model=model, optimizer=opt)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    ck.load(model=model, optimizer=opt)
    out["restored"] = _worst(_full_state(model), saved)
    with torch.device("meta"):
        on_meta = GPTish()
    out["meta_error"] = _error(ValueError, f2.replicate, on_meta)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, model.head.weight.detach().clone())
    out["ranks_agree"] = rel_diff(gathered[0], gathered[1])
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out.pop("unsynced_head_grad"))
    out["unsynced_differs"] = rel_diff(gathered[0], gathered[1])
    return out


def test_shard_part_replicate_the_rest(tmp_path):
    res = run_agreeing(_ddp_world, 2, str(tmp_path / "ckpt"), timeout=240)
    assert "DTensor" in res["ddp_as_written"]
    for key in ("ddp_ignore", "accumulate", "clip_norm", "clipped", "after_step", "restored", "ranks_agree"):
        assert res[key] < 1e-5, (key, res[key])
    # Under no_sync the replicated gradients stayed local (they differ across ranks).
    assert res["unsynced_differs"] > 1e-3
    block = sum(p.numel() for p in Block(32, 4).parameters())
    assert res["plan"] == [
        ("gpt_layers", "Sequential", "FULL_SHARD", 2 * block),
        ("embed, head", "replicate", "REPLICATED", 8 * 32 + 32 + 32 * 4 + 4),
    ], res["plan"]
    assert "f2.replicate" in res["plan_text"]
    assert "meta device" in res["meta_error"] and "to_empty" in res["meta_error"]


# --------------------------------------------------------------------------- no world needed
def test_fsdp1_policy_objects_and_size_policy_resolve_like_fsdp1():
    from torch.distributed.fsdp.wrap import CustomPolicy, size_based_auto_wrap_policy

    from fsdp2_strategy.fsdp1.wrap import policy_groups

    model = MLP()
    model.extra = nn.Sequential(nn.Linear(4, 400), nn.Linear(400, 4))
    # size_based_auto_wrap_policy(module, recurse, nonwrapped_numel, min_num_params) positionally;
    # net.0 (1088) and net.2 (4160) reach 1000, and so do extra.0 (2000) and extra.1 (1604).
    size = functools.partial(size_based_auto_wrap_policy, min_num_params=1000)
    assert policy_groups(model, size, []) == ["net.0", "net.2", "extra.0", "extra.1"]
    # Ignored modules are neither asked nor counted.
    assert policy_groups(model, size, ["extra"]) == ["net.0", "net.2"]
    linear = CustomPolicy(lambda m: isinstance(m, nn.Linear))
    assert policy_groups(model, linear, ["net"]) == ["extra.0", "extra.1"]
    per_module = CustomPolicy(lambda m: {"reshard_after_forward": False} if isinstance(m, nn.Linear) else False)
    with pytest.raises(ValueError, match="module_overrides"):
        policy_groups(model, per_module, [])
    with pytest.raises(ValueError, match="auto_wrap_policy=.*transformer_auto_wrap_policy"):
        policy_groups(model, "Linear", [])


def test_replicate_needs_a_process_group():
    import fsdp2_strategy as f2

    with pytest.raises(RuntimeError, match="init_distributed"):
        f2.replicate(MLP())

"""Trainable-only checkpoints: store what training changes, identify the frozen base by a fingerprint.

A LoRA model's base is frozen: it comes from the pretrained weights the model is built from and
never changes, so saving it again at every step costs its whole size per checkpoint for nothing,
typically hundreds of times the adapter's size. A trainable-only checkpoint
holds the parameters that require gradients, the buffers and the optimizer state, plus a
fingerprint of the frozen parameters under `frozen_base.<model key>`: per parameter its shape and
the float64 sum and sum of squares of its values rounded to bf16 (rounded so that the same base
stored in fp32 or in bf16, `FSDP2Config.frozen_dtype`, gives the same fingerprint). Loading
compares the live model's fingerprint and refuses another base by parameter name.

The fingerprint is computed on each rank's shards and summed in one all-reduce, so it does not
depend on the world size or mesh it was taken on (sums in another order differ by float64
rounding only: compared with a relative tolerance of 1e-9).
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from ..distributed import is_distributed
from ..shard import as_packed_bytes, quantised_param_names

FROZEN_BASE = "frozen_base"
"""Top-level checkpoint key prefix of the fingerprints: `frozen_base.<model key>` (JSON text)."""
_REL_TOL = 1e-9


def fingerprint_key(model_key: str) -> str:
    """Where the fingerprint of the model saved under `model_key` is stored."""
    return f"{FROZEN_BASE}.{model_key}"


def _is_peft_model(model: nn.Module) -> bool:
    """Whether `model` contains PEFT (Hugging Face `peft`) layers: its classes come from `peft.`."""
    return any(c.__module__.startswith("peft.") for m in model.modules() for c in type(m).__mro__[:2])


def saves_trainable_only(model: nn.Module, trainable_only: Any) -> bool:
    """Resolve "auto" (True for a PEFT model that has frozen parameters) against `model`."""
    if trainable_only == "auto":
        return _is_peft_model(model) and any(not p.requires_grad for p in model.parameters())
    return bool(trainable_only)


def frozen_names(model: nn.Module) -> list[str]:
    """Names of the frozen parameters a fingerprint covers (quantised ones included: they are the base
    too), tied ones under each of their names (a tied head is a state-dict key of its own)."""
    return [n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad]


def frozen_fingerprint(model: nn.Module) -> dict[str, list]:
    """Collective: `{name: [shape, sum, sum of squares]}` of every frozen parameter (see module doc)."""
    names = frozen_names(model)
    packed = quantised_param_names(model)
    # A 4-bit weight as its packed bytes, kept whole or sharded (`FSDP2Config.quantised_weights`),
    # whatever words store them (bf16 words on torch 2.11-2.12, or `bnb_4bit_quant_storage`).
    params = {n: as_packed_bytes(p) for n, p in model.named_parameters(remove_duplicate=False)}
    shapes = {n: list(params[n].shape) for n in names}
    stats = torch.zeros(len(names), 2, dtype=torch.float64)
    for i, name in enumerate(names):
        local, copies = _local_values(params[name])
        if name in packed:
            local = local.detach().reshape(-1).view(torch.uint8)
            shapes[name] = [params[name].numel() * params[name].element_size(), 1]
        x = local.detach().to(torch.bfloat16).to(device="cpu", dtype=torch.float64)
        stats[i, 0], stats[i, 1] = x.sum() / copies, (x * x).sum() / copies
    if is_distributed():
        dist.all_reduce(stats)
    return {n: [shapes[n], *stats[i].tolist()] for i, n in enumerate(names)}


def _local_values(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's values of `param` and on how many ranks the same values sit (summed once each)."""
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        copies = math.prod(mesh.size(d) for d, p in enumerate(param.placements) if isinstance(p, Replicate))
        return param.to_local(), copies * (dist.get_world_size() // mesh.size())
    return param, dist.get_world_size() if is_distributed() else 1


def fingerprint_text(model: nn.Module) -> str:
    """Collective: the fingerprint as the JSON text stored in a checkpoint."""
    return json.dumps(frozen_fingerprint(model), sort_keys=True)


def base_mismatches(saved: str, model: nn.Module) -> list[str]:
    """Collective: how the live model's frozen parameters differ from a saved fingerprint (empty: the same base)."""
    old, new = json.loads(saved), frozen_fingerprint(model)
    problems = [f"{n}: frozen in the checkpoint's base, not in this model" for n in sorted(set(old) - set(new))]
    problems += [f"{n}: frozen in this model, not in the checkpoint's base" for n in sorted(set(new) - set(old))]
    for name in sorted(set(old) & set(new)):
        (shape_a, *vals_a), (shape_b, *vals_b) = old[name], new[name]
        if shape_a != shape_b:
            problems.append(f"{name}: shape {shape_a} in the checkpoint's base vs {shape_b}")
        elif not all(math.isclose(a, b, rel_tol=_REL_TOL, abs_tol=1e-12) for a, b in zip(vals_a, vals_b)):
            problems.append(f"{name}: different values (sum {vals_a[0]:.6g} saved vs {vals_b[0]:.6g} now)")
    return problems


def trainable_keys(model: nn.Module, state_keys: list[str]) -> list[str]:
    """The keys of `model`'s state dict that a trainable-only checkpoint keeps (all but frozen parameters)."""
    frozen = set(frozen_names(model)) | quantised_param_names(model)
    return [k for k in state_keys if k not in frozen]

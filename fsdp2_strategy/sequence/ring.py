"""torch's ring attention, registered for the CPU flash-attention kernel too.

Inside torch's `context_parallel`, `scaled_dot_product_attention` turns query, key and value into
DTensors sharded on the sequence dim, and the attention kernel they dispatch to runs as a ring:
each rank attends with its own keys and values, passes them on, and merges the partial results by
their log-sum-exp. torch registers that ring for the CUDA kernels (flash, efficient, cuDNN) only;
on a CPU, SDPA dispatches to `_scaled_dot_product_flash_attention_for_cpu`, for which nothing is
registered, and raises NotImplementedError. `register_cpu_ring()` adds that kernel and its backward
to the same table, running torch's own ring (`_templated_ring_attention`: the same merge, the same
load balance) with the CPU kernel, so context parallelism runs, and is tested, on CPU and gloo.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .. import _torch_compat as tc

aten = torch.ops.aten
SEQ_DIM = 2
"""The sequence dim of SDPA's (batch, heads, sequence, head_dim) tensors, which torch's ring splits."""


def _check_ring_inputs(dropout_p: float, attn_mask: Any) -> None:
    if attn_mask is not None:
        raise NotImplementedError(
            "context parallelism runs scaled_dot_product_attention without attn_mask (a causal mask through "
            "is_causal=True, or full attention); drop the attention mask from the batch (pack sequences "
            "without padding) so the model passes none."
        )
    if dropout_p:
        raise NotImplementedError(
            f"context parallelism on a CPU runs attention without dropout (dropout_p={dropout_p}); set the "
            "model's attention dropout to 0."
        )


def _ring_forward(
    mesh: DeviceMesh,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    _check_ring_inputs(dropout_p, attn_mask)
    return tc.ring_attention(
        mesh.get_group(),
        SEQ_DIM,
        aten._scaled_dot_product_flash_attention_for_cpu,
        query=query,
        key=key,
        value=value,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
    )


def _ring_backward(
    mesh: DeviceMesh,
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    _check_ring_inputs(dropout_p, attn_mask)
    return tc.ring_attention_backward(
        mesh.get_group(),
        SEQ_DIM,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=grad_out,
        grad_out_name="grad_out",
        query=query,
        key=key,
        value=value,
        out=out,
        logsumexp=logsumexp,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
    )


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def _cpu_ring_handler(op_call: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """DTensor's handler for the CPU kernel (and its backward): the ring on the local shards, whose
    results (output and log-sum-exp, or the three gradients) are sharded on the sequence dim too."""
    ring = _ring_forward if op_call is aten._scaled_dot_product_flash_attention_for_cpu.default else _ring_backward
    mesh = next(a.device_mesh for a in (*args, *kwargs.values()) if isinstance(a, DTensor))
    results = ring(mesh, *map(_local, args), **{k: _local(v) for k, v in kwargs.items()})
    return tuple(DTensor.from_local(t, mesh, [Shard(SEQ_DIM)], run_check=False) for t in results)


def register_cpu_ring() -> None:
    """Add the CPU flash-attention kernel and its backward to torch's context-parallel dispatch table
    (read each time a `context_parallel` context starts); idempotent."""
    for op in (
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    ):
        tc.cp_dispatch_table.setdefault(op, _cpu_ring_handler)

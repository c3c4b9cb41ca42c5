"""What the training device changes in the meta simulation behind `estimate_memory`.

The meta run has no device, but two things it imitates depend on one:

- Which scaled-dot-product-attention kernel runs. A fused kernel keeps O(sequence) statistics
  for backward; the math fallback saves the attention matrix (with dropout also the mask and
  the dropped matrix). Meta tensors always get the math fallback. Accelerators run a fused
  kernel (with grouped-query attention too); on CPU torch 2.13 picks its flash kernel only
  without dropout, so a model training with attention dropout (BERT's 0.1) runs the math path
  there. `attention_kernels` asks torch's own selection (`torch._fused_sdp_choice`) on CPU
  stand-ins of the meta shapes.
- The scratch memory of a reduce-scatter. gloo's (the CPU backend) copies its whole input
  before reducing, so while a group's gradients are reduce-scattered its flat input, that copy
  and the output shard are alive together (torch's MemTracker sees the copy); NCCL reduces
  without the copy. gloo's all-gather and all-reduce make no such copy. The point-to-point ring that
  replaces gloo's by default (`ring_comms`, `FSDP2Config.collectives`) holds one receive buffer
  of the output's size instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.nn.attention import SDPBackend

from .. import _torch_compat as tc


def default_device_type() -> str:
    """The accelerator's device type ("cuda", "xpu", ...) when one is available, else "cpu"."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None without a usable one
    return accelerator.type if accelerator is not None else "cpu"


def resolve_device_type(value: str | None) -> str:
    """`value` checked ("cpu" or an accelerator type such as "cuda"), or the default when None."""
    if value is None:
        return default_device_type()
    if not isinstance(value, str) or not value or value == "meta":
        raise ValueError(
            f"estimate_memory: device_type={value!r} is invalid; use 'cpu' or an accelerator type "
            "such as 'cuda' (the device the job trains on), or None for this machine's."
        )
    return value


def reduce_scatter_scratch(device_type: str, collectives: str, input_bytes: int, shard_size: int) -> int:
    """Bytes a reduce-scatter of `input_bytes` over `shard_size` ranks holds besides its input and
    output on `device_type` (gloo on CPU) with `FSDP2Config.collectives`."""
    if shard_size <= 1:
        return 0
    if _uses_ring_comms(device_type, collectives):
        return input_bytes // shard_size
    return input_bytes if device_type == "cpu" else 0


def _stand_in(t: torch.Tensor | None) -> torch.Tensor | None:
    """A CPU tensor of `t`'s shape and dtype that owns one row: zero strides but the last (the
    kernel checks look at shapes, dtypes and the last stride, never at values)."""
    if t is None or not isinstance(t, torch.Tensor) or t.dim() == 0:
        return t
    row = torch.empty(t.shape[-1], dtype=t.dtype)
    return row.as_strided(t.shape, (0,) * (t.dim() - 1) + (1,))


def _cpu_runs_fused(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> bool:
    with tc.disable_current_modes():
        choice = tc.fused_sdp_choice(
            _stand_in(query),
            _stand_in(key),
            _stand_in(value),
            _stand_in(attn_mask),
            dropout_p,
            is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    return SDPBackend(choice) == SDPBackend.FLASH_ATTENTION


def _sdpa_for(original, device_type: str):
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        # Grouped-query attention (`enable_gqa`, fewer key/value heads) runs fused too: the CUDA
        # flash kernel and torch's CPU flash kernel take it, and so does the meta implementation.
        fused = query.dim() == 4
        if fused and device_type == "cpu":
            fused = _cpu_runs_fused(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if not fused:
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        # The CPU flash kernel's meta implementation stands for every fused kernel: its saved
        # statistics are the O(sequence) log-sum-exp, as the accelerators' kernels keep.
        return tc.cpu_flash_attention(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]

    return sdpa


@contextlib.contextmanager
def attention_kernels(device_type: str) -> Iterator[None]:
    """Route `F.scaled_dot_product_attention` on meta tensors to what `device_type` would run:
    a fused kernel's meta implementation, or the math fallback where the device falls back."""
    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _sdpa_for(original, device_type)
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def _uses_ring_comms(device_type: str, collectives: str) -> bool:
    """Whether a job on `device_type` with `FSDP2Config.collectives` runs `shard.ring_comms`'s rings
    ("auto" installs them where the shard group is gloo, which is the CPU backend)."""
    return collectives == "ring" or (collectives == "auto" and device_type == "cpu")

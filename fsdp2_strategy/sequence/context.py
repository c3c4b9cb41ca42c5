"""`f2.context_parallel`: one step on sequence-sharded batch tensors.

Built on torch's `context_parallel` (`torch.distributed.tensor.experimental`), which splits the
buffers it is given along their sequence dim and routes `scaled_dot_product_attention` to a ring
over the "cp" ranks. What it leaves to the caller is done here: the inputs a rank cannot derive
from its part (shifted labels, position ids; `batch`), the CPU kernel torch's ring lacks (`ring`),
a copy of the batch so the caller's tensors keep their shape (torch resizes its buffers in place,
which tensors that require grad refuse), and the checks that make a wrong setup fail loudly: a
length the ranks cannot split, a model whose attention never reaches SDPA (it would attend within
each rank's chunk only and train on wrong numbers, without an error).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel

from .. import _torch_compat as tc
from ..train import recorded_state
from .batch import IGNORE_INDEX, ContextParallelBatch, prepare, sequence_keys
from .ring import register_cpu_ring

SDPA_IMPLEMENTATIONS = (None, "sdpa")
"""A Hugging Face model's `config._attn_implementation` values whose attention calls SDPA."""


def context_mesh(model: nn.Module) -> DeviceMesh | None:
    """The context-parallel mesh `shard_model` built for `model` or a module inside it (a trainer's
    wrapper: Fabric's module, a LightningModule holding the model); None without context parallelism."""
    for module in model.modules():
        state = recorded_state(module)
        if state is not None and state.cp_mesh is not None:
            return state.cp_mesh
    return None


def check_sdpa_attention(model: nn.Module) -> None:
    """Raise ValueError when a Hugging Face model in `model` has attention that does not call
    `scaled_dot_product_attention` (its `config._attn_implementation`)."""
    for module in model.modules():
        implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if implementation not in SDPA_IMPLEMENTATIONS:
            raise ValueError(
                f"context parallelism needs attention through torch's scaled_dot_product_attention, but "
                f"{type(module).__name__} uses attn_implementation={implementation!r}; load it with "
                "from_pretrained(..., attn_implementation='sdpa') (or set model.config._attn_implementation = 'sdpa')."
            )


def check_split(lengths: int, cp_size: int, causal: bool) -> None:
    """Raise ValueError unless a sequence of `lengths` tokens splits into the chunks the ranks hold."""
    chunks = 2 * cp_size if causal else cp_size
    if lengths % chunks:
        raise ValueError(
            f"f2.context_parallel: a sequence of {lengths} tokens does not split into {chunks} equal chunks "
            f"({'two per rank, for a causal mask' if causal else 'one per rank'}, context_parallel_size={cp_size}); "
            f"pad or pack sequences to a multiple of {chunks} tokens (labels=-100 on the padding)."
        )


@contextlib.contextmanager
def _count_sdpa_calls() -> Iterator[list[int]]:
    """Count calls of `F.scaled_dot_product_attention` (as patched on entry) until exit."""
    patched = F.scaled_dot_product_attention
    calls = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return patched(*args, **kwargs)

    F.scaled_dot_product_attention = counted
    try:
        yield calls
    finally:
        F.scaled_dot_product_attention = patched


@contextlib.contextmanager
def context_parallel(
    model: nn.Module,
    batch: Mapping[str, Any],
    *,
    seq_dim: int = 1,
    causal: bool = True,
    ignore_index: int = IGNORE_INDEX,
) -> Iterator[ContextParallelBatch]:
    """Run the enclosed forward and backward on this rank's part of every sequence of `batch`.

    With `FSDP2Config(context_parallel_size=N)` each sequence is split into equal chunks across the
    N "cp" ranks (every rank of a "cp" group must be given the same batch, as with tensor
    parallelism) and the model's `scaled_dot_product_attention` calls run as a ring over them, so
    each rank holds the activations of 1/N of every sequence. Without context parallelism the
    batch is yielded whole: the same training code runs with any `context_parallel_size`.

    Typical step::

        with f2.context_parallel(model, {"input_ids": ids, "labels": labels}) as part:
            logits = model(part["input_ids"], position_ids=part["position_ids"]).logits
            loss = part.loss(logits)
            loss.backward()
        optimizer.step()

    Args:
        model: A model `shard_model` returned.
        batch: The step's tensors by name (the model's inputs and "labels"), with whole sequences
            along `seq_dim`. "position_ids" and "shift_labels" (labels moved one token left) are
            added when absent; an all-ones "attention_mask" is dropped (it means no mask).
        seq_dim: The sequence dim of the batch's tensors.
        causal: Whether the attention is causal (a decoder): then each rank holds a head and a tail
            chunk, so all do equal work. False for full attention (an encoder).
        ignore_index: The label of tokens without a target.

    Yields:
        A `ContextParallelBatch`: this rank's part of each tensor, and `.loss(logits)`.

    Raises:
        ValueError: A sequence length the ranks cannot split, padding in the attention mask, or a
            Hugging Face model whose attention is not SDPA.
        RuntimeError: On exit, when no attention ran through `scaled_dot_product_attention`
            inside the context (the model computes attention another way).
    """
    tensors = prepare(batch, seq_dim, ignore_index)
    mesh = context_mesh(model)
    if mesh is None:
        yield ContextParallelBatch(tensors, group=None, cp_size=1, ignore_index=ignore_index)
        return
    check_sdpa_attention(model)
    names = sequence_keys(tensors, seq_dim)
    check_split(tensors[names[0]].size(seq_dim), mesh.size(), causal)
    # Copies: torch resizes its buffers in place to this rank's part.
    buffers = [tensors[k].detach().clone() for k in names]
    with ring_attention(mesh, buffers, [seq_dim] * len(buffers), no_restore=buffers, causal=causal):
        with _count_sdpa_calls() as calls:
            yield ContextParallelBatch(
                {**tensors, **dict(zip(names, buffers))},
                group=mesh.get_group(),
                cp_size=mesh.size(),
                ignore_index=ignore_index,
            )
        if not calls[0]:
            raise RuntimeError(
                f"f2.context_parallel: no attention of {type(model).__name__} ran through "
                "torch.nn.functional.scaled_dot_product_attention, so each rank attended within its own "
                "chunk of the sequences only; use a model whose attention calls it (Hugging Face: "
                "attn_implementation='sdpa'), and run the forward inside the context."
            )


ROTATIONS = ("allgather", "alltoall")
"""How the ring passes keys and values (torch's `set_rotate_method`; Accelerate's `cp_comm_strategy`)."""


def set_ring_rotation(method: str) -> None:
    """How every ring from now on passes keys and values around: "allgather" (torch's default) or
    "alltoall". Raises ValueError for another name."""
    if method not in ROTATIONS:
        raise ValueError(f"ring rotation {method!r} is invalid; use one of {list(ROTATIONS)}.")
    tc.set_rotate_method(method)


@contextlib.contextmanager
def ring_attention(
    mesh: DeviceMesh,
    buffers: Sequence[torch.Tensor],
    seq_dims: Sequence[int],
    *,
    no_restore: Iterable[torch.Tensor] = (),
    causal: bool = True,
) -> Iterator[None]:
    """torch's `context_parallel` on any device: `buffers` split in place along `seq_dims` (restored
    on exit unless in `no_restore`), `scaled_dot_product_attention` a ring over `mesh` inside.

    What `f2.context_parallel` and the adapters' context managers (Accelerate's
    `maybe_context_parallel`) run: on accelerators it is torch's as shipped; on CPUs the ring runs
    the CPU flash-attention kernel (`sequence.ring`).

    Args:
        mesh: The 1-D context-parallel mesh.
        buffers: Tensors with whole sequences (no `requires_grad`: they are resized in place).
        seq_dims: The sequence dim of each buffer.
        no_restore: Buffers left split on exit.
        causal: Balance a causal mask's work (each rank a head and a tail chunk); False for full attention.
    """
    register_cpu_ring()
    balanced = tc.cp_options.enable_load_balance
    tc.cp_options.enable_load_balance = causal  # read by torch for the buffers' split and by its ring
    try:
        with torch_context_parallel(
            mesh,
            buffers=list(buffers),
            buffer_seq_dims=list(seq_dims),
            no_restore_buffers=set(no_restore),
        ):
            yield
    finally:
        tc.cp_options.enable_load_balance = balanced

"""Context parallelism in the Hugging Face `Trainer`: `TrainingArguments(parallelism_config=
ParallelismConfig(cp_size=N))` on FSDP2Accelerator.

The stock Trainer reads the sizes from `accelerator.parallelism_config`, which FSDP2Accelerator
leaves None (Accelerate's own TP/FSDP code paths must not run): the mixin asks `cp_size` here
instead, and builds the step's context as the stock `_prepare_context_parallel_inputs` does:
shifted labels and position ids made from the whole sequences, then the model inputs split by
`accelerator.maybe_context_parallel` for the forward and the backward. The Trainer's own token
count (`num_items_in_batch`, divided by the cp size: `token_count`) then makes the loss the one of
whole sequences.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import transformers
from torch import nn

from fsdp2_strategy.sequence import IGNORE_INDEX, check_sdpa_attention, prepare
from fsdp2_strategy.versions import minor

_SPLIT = ("input_ids", "labels", "shift_labels", "position_ids")
"""The inputs split along the sequence (dim 1), as the stock Trainer splits them."""


STOCK_COUNT_PER_CP_RANK = minor(transformers.__version__) >= (5, 19)
"""Whether the stock Trainer divides its token count by `get_cp_size()` (transformers 5.19 on), which
the mixin answers; 5.17-5.18 divide by Accelerate's `parallelism_config.non_data_parallel_size`,
which FSDP2Accelerator leaves None, so the division is the adapter's (`token_count`)."""


def token_count(count: Any, cp: int) -> Any:
    """The stock `_get_num_items_in_batch` result per context-parallel rank: each rank of a cp group
    sums its part of the same sequences, so the whole sequences' count is divided by `cp`."""
    if count is None or cp == 1 or STOCK_COUNT_PER_CP_RANK:
        return count
    return count / cp


def cp_size(accelerator: Any) -> int:
    """Ranks each sequence is split across (1 without context parallelism)."""
    return accelerator.fsdp2_config.context_parallel_size


def context_parallel_inputs(
    accelerator: Any, model: nn.Module, inputs: dict[str, Any]
) -> tuple[Callable[[], Any], dict[str, Any]]:
    """(the step's context, its inputs): what the stock `_prepare_context_parallel_inputs` returns.

    Raises:
        ValueError: a model whose attention is not SDPA, or an attention mask with padding.
    """
    if cp_size(accelerator) == 1:
        return contextlib.nullcontext, inputs
    check_sdpa_attention(model)
    # shift_labels and position_ids from the whole sequences; an all-ones attention_mask dropped, padding refused.
    inputs = prepare(inputs, seq_dim=1, ignore_index=IGNORE_INDEX)
    buffers = [inputs[k] for k in _SPLIT if isinstance(inputs.get(k), torch.Tensor)]
    context = functools.partial(
        accelerator.maybe_context_parallel,
        buffers=buffers,
        buffer_seq_dims=[1] * len(buffers),
        no_restore_buffers=set(buffers),
    )
    return context, inputs

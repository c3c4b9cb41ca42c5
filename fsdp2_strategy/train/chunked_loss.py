"""The causal-LM cross-entropy computed in chunks of tokens, never building the full logits.

The plain loss of a causal LM projects every position's hidden state onto the vocabulary
(tokens x vocabulary logits: 8,192 tokens x 32,000 are 1 GiB in fp32, x 128,256 for Llama 3 are
4 GiB), takes their log-softmax in fp32 and keeps those logits for backward. Here the positions
are taken a chunk at a time: each chunk's logits are computed, turned into its loss and, when
gradients are needed, straight into its gradients (the softmax minus the one-hot label, times the
projection), then freed. The gradients of the hidden states and of the projection are returned by
backward scaled by the incoming gradient: the same matrix products as the plain loss (one forward,
two backward), no recomputation, and at most one chunk's logits alive. Only positions whose label
is not ignored are projected at all (prompt tokens masked with -100 cost nothing).

The numbers are the plain loss's (`transformers`' `ForCausalLMLoss`: logits in fp32, mean over
the labelled tokens or sum divided by `num_items_in_batch`); in fp32 they agree to float rounding,
in bf16 the projection's gradient is summed over chunks in the weight's dtype, within bf16 rounding
of the plain one.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

IGNORE_INDEX = -100
"""The label that marks a position without a loss (Hugging Face's and torch's default)."""


MIN_CHUNK = 256
"""The fewest tokens per chunk: thinner products run below an accelerator's speed, and 256 tokens of a
128,256-token vocabulary take 128 MiB of fp32 logits."""


def chunk_tokens(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk: chunks whose logits take about as many elements as the hidden states of all
    `tokens` (so the loss adds about the memory of one more activation), a power of two, at least
    `MIN_CHUNK`."""
    per_chunk = math.ceil(tokens / max(1, math.ceil(vocab / max(1, hidden))))
    return max(MIN_CHUNK, 1 << max(0, (per_chunk - 1).bit_length()))


def chunked_causal_lm_loss(
    hidden_states: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    shift_labels: Tensor | None = None,
    num_items_in_batch: Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
) -> Tensor:
    """The causal-LM cross-entropy of `hidden_states @ weight.T (+ bias)` against the next tokens,
    computed a chunk of positions at a time (the full logits are never built).

    Args:
        hidden_states: The last hidden states, `(..., sequence, hidden)` (what the output layer takes).
        weight: The output layer's weight, `(vocabulary, hidden)`, as a plain tensor (under FSDP: the
            gathered parameter, i.e. inside the module's forward or a `f2.gathered` context).
        labels: Token ids `(..., sequence)`; position t is scored against `labels[..., t + 1]`, the
            last position against nothing. `ignore_index` marks positions without a loss.
        bias: The output layer's bias, if it has one.
        shift_labels: Labels already shifted (position t against `shift_labels[..., t]`), as context
            parallelism hands them; `labels` is then ignored.
        num_items_in_batch: Divide the summed loss by this (the labelled tokens of the whole step,
            as the Hugging Face Trainer passes under gradient accumulation); None: the mean over
            this batch's labelled tokens.
        ignore_index: The label of positions without a loss.
        chunk_size: Positions per chunk; None: `chunk_tokens`' choice (one chunk's logits about the
            size of the hidden states).

    Returns:
        The loss, a 0-dim fp32 tensor; 0 (still differentiable) when no position has a label.

    Raises:
        ValueError: The shapes of `hidden_states`, `weight` and the labels do not fit together.
    """
    targets = _targets(labels, shift_labels, ignore_index)
    if targets.shape != hidden_states.shape[:-1] or weight.dim() != 2 or weight.shape[1] != hidden_states.shape[-1]:
        raise ValueError(
            f"chunked_causal_lm_loss: hidden_states {tuple(hidden_states.shape)}, weight {tuple(weight.shape)} and "
            f"labels {tuple(targets.shape)} do not fit: expected hidden_states (..., sequence, hidden), weight "
            "(vocabulary, hidden) and labels (..., sequence)."
        )
    mask = targets != ignore_index
    if hidden_states.device.type == "meta":
        # The memory planner's copy: selecting by a mask needs values. Every position counts (the most).
        hidden, chosen = hidden_states.reshape(-1, hidden_states.shape[-1]), targets.reshape(-1).clamp(min=0)
    else:
        hidden, chosen = hidden_states[mask], targets[mask]  # only the labelled positions are projected
    if num_items_in_batch is None:
        denominator = mask.sum().clamp(min=1).to(torch.float32)
    else:
        denominator = torch.as_tensor(num_items_in_batch, device=hidden.device, dtype=torch.float32)
    size = chunk_size or chunk_tokens(hidden.shape[0], weight.shape[1], weight.shape[0])
    return _ChunkedCrossEntropy.apply(hidden, weight, bias, chosen, 1.0 / denominator, size)


def _targets(labels: Tensor, shift_labels: Tensor | None, ignore_index: int) -> Tensor:
    """Each position's target: `shift_labels`, or `labels` moved one to the left (the last: ignored)."""
    if shift_labels is not None:
        return shift_labels
    return torch.nn.functional.pad(labels[..., 1:], (0, 1), value=ignore_index)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Forward: the summed cross-entropy of `hidden @ weight.T + bias` times `scale`, chunk by chunk,
    and (when gradients are needed) each chunk's gradients of `hidden`, `weight` and `bias`; backward:
    those gradients times the incoming one."""

    @staticmethod
    def forward(
        ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, scale: Tensor, size: int
    ) -> Tensor:
        want_hidden, want_weight = hidden.requires_grad, weight.requires_grad
        want_bias = bias is not None and bias.requires_grad
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight) if want_weight else None
        grad_bias = torch.zeros_like(bias) if want_bias and bias is not None else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], size):
            rows, target = hidden[start : start + size], targets[start : start + size]
            logits = torch.nn.functional.linear(rows, weight, bias).float()
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(-1, target[:, None]).squeeze(-1)).sum()
            if not (want_hidden or want_weight or want_bias):
                continue
            # d(loss)/d(logits) = (softmax - one-hot) * scale, in the compute dtype as the plain loss's backward
            grad = logits.sub_(lse[:, None]).exp_()
            grad[torch.arange(grad.shape[0], device=grad.device), target] -= 1
            grad = grad.mul_(scale).to(rows.dtype)
            if grad_hidden is not None:
                torch.matmul(grad, weight, out=grad_hidden[start : start + size])
            if grad_weight is not None:
                grad_weight.addmm_(grad.t(), rows)
            if grad_bias is not None:
                grad_bias += grad.sum(0)
        ctx.save_for_backward(*(t if t is not None else torch.empty(0) for t in (grad_hidden, grad_weight, grad_bias)))
        ctx.wanted = (want_hidden, want_weight, want_bias)
        return total * scale

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        saved = ctx.saved_tensors
        grads = [g * grad_output.to(g.dtype) if wanted else None for g, wanted in zip(saved, ctx.wanted)]
        return grads[0], grads[1], grads[2], None, None, None

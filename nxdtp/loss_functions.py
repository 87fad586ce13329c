"""Cross-entropy on vocab-parallel logits, without ever gathering them.

The LM head of a tensor-parallel model leaves each TP rank with a contiguous slice of the vocabulary: rank ``r`` holds
columns ``[r * V/tp, (r + 1) * V/tp)``. Gathering the full ``[tokens, V]`` logits would cost tp times the memory and one
large all-gather per step. The softmax normaliser and the target logit are sums over the vocabulary, so each rank reduces
its slice to a few numbers per token and two small all-reduces finish the job:

1. MAX of the local maxima, so every rank shifts by the same value before ``exp`` (numerical stability);
2. one SUM of a stacked ``[..., 2 or 3]`` tensor: the target's logit (only the rank owning the target contributes),
   the sum of ``exp``, and, with label smoothing, the sum of the logits.

Everything is computed in fp32 whatever the logits' dtype, so bf16 logits lose no precision in the reductions.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import comm
from .parallel_state import ParallelGroup, tensor_parallel_group

_REDUCTIONS = ("none", "mean", "sum")
_INTEGRAL_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _vocab_mask(local_vocab: int, group: ParallelGroup, vocab_size: Optional[int], device) -> Optional[torch.Tensor]:
    """True for this shard's columns that are real vocabulary; None when the vocab was not padded (nothing to mask)."""
    full = local_vocab * group.size
    if vocab_size is None or vocab_size == full:
        return None
    first = group.rank * local_vocab
    return torch.arange(first, first + local_vocab, device=device) < vocab_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss ``(1 - eps) * nll + eps * (logZ - mean logit)``; returns 0 for ignored targets.

    Backward recomputes the softmax from the saved input logits and the per-token log-normaliser instead of saving the
    fp32 softmax: that keeps one fp32 copy of the (large) logits shard out of memory for the cost of one ``exp``.
    """

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, ignore_index, vocab_size, group):
        x = logits.float()
        local_vocab = x.shape[-1]
        real = _vocab_mask(local_vocab, group, vocab_size, x.device)
        num_classes = vocab_size if vocab_size is not None else local_vocab * group.size
        if real is not None:
            x = x.masked_fill(~real, float("-inf"))  # padded columns get probability 0

        global_max = comm.all_reduce(x.amax(dim=-1), group, op="max")
        shifted = x - global_max.unsqueeze(-1)

        ignored = target == ignore_index if ignore_index is not None else torch.zeros_like(target, dtype=torch.bool)
        local_target = target - group.rank * local_vocab
        in_shard = (local_target >= 0) & (local_target < local_vocab) & ~ignored
        safe_index = torch.where(in_shard, local_target, torch.zeros_like(local_target))
        picked = shifted.gather(-1, safe_index.unsqueeze(-1)).squeeze(-1)
        parts = [torch.where(in_shard, picked, torch.zeros_like(picked)), shifted.exp().sum(dim=-1)]
        if label_smoothing > 0:
            finite = shifted if real is None else shifted.masked_fill(~real, 0.0)
            parts.append(finite.sum(dim=-1))
        totals = comm.all_reduce(torch.stack(parts, dim=-1), group, op="sum")

        log_sum_exp = totals[..., 1].log()
        loss = log_sum_exp - totals[..., 0]
        if label_smoothing > 0:
            mean_logit = totals[..., 2] / num_classes
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_sum_exp - mean_logit)
        loss = torch.where(ignored, torch.zeros_like(loss), loss)

        ctx.save_for_backward(logits, global_max + log_sum_exp, safe_index, in_shard, ignored)
        ctx.label_smoothing, ctx.num_classes, ctx.vocab_size, ctx.group = label_smoothing, num_classes, vocab_size, group
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, log_normaliser, safe_index, in_shard, ignored = ctx.saved_tensors
        eps = ctx.label_smoothing
        x = logits.float()
        real = _vocab_mask(x.shape[-1], ctx.group, ctx.vocab_size, x.device)
        if real is not None:
            x = x.masked_fill(~real, float("-inf"))
        grad = (x - log_normaliser.unsqueeze(-1)).exp()  # this shard's softmax
        hit = in_shard.to(grad.dtype) * (1.0 - eps)
        grad.scatter_add_(-1, safe_index.unsqueeze(-1), -hit.unsqueeze(-1))
        if eps > 0:
            smoothing = torch.full_like(grad, eps / ctx.num_classes)
            grad = grad - (smoothing if real is None else smoothing * real)
        scale = torch.where(ignored, torch.zeros_like(grad_loss), grad_loss.float())
        grad = grad * scale.unsqueeze(-1)
        return grad.to(logits.dtype), None, None, None, None, None


def _check_inputs(logits, target, label_smoothing, reduction, vocab_size, group) -> None:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"vocab_parallel_logits must be a floating-point tensor, got "
                        f"{getattr(logits, 'dtype', type(logits).__name__)}")
    if not isinstance(target, torch.Tensor) or target.dtype not in _INTEGRAL_DTYPES:
        raise TypeError(f"target must be an integer tensor of vocabulary ids (int64 or another integer dtype), got "
                        f"{getattr(target, 'dtype', type(target).__name__)}")
    if logits.dim() < 1 or tuple(logits.shape[:-1]) != tuple(target.shape):
        raise ValueError(f"vocab_parallel_logits of shape {tuple(logits.shape)} needs a target of shape "
                         f"{tuple(logits.shape[:-1])} (its shape without the vocab dim), got {tuple(target.shape)}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not supported; valid values are {list(_REDUCTIONS)}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing!r} must be a number in [0, 1)")
    if vocab_size is not None:
        full = logits.shape[-1] * group.size
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= full:
            raise ValueError(f"vocab_size={vocab_size!r} must be an int in [1, {full}] (the padded vocab is "
                             f"{logits.shape[-1]} columns x {group.size} TP ranks = {full})")


def parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0,
                           ignore_index: int = -100, reduction: str = "none",
                           vocab_size: Optional[int] = None) -> torch.Tensor:
    """Cross-entropy of logits sharded over the vocab across the TP group; equals ``F.cross_entropy`` on the full logits.

    ``target`` holds global vocabulary ids and is the same on every TP rank. ``reduction="none"`` (NxD's behaviour)
    returns the fp32 per-token loss, 0 where ``target == ignore_index``; ``"mean"`` divides the sum by the number of
    non-ignored targets (NaN when there are none, as torch does). When the vocab was padded to a multiple of the TP size,
    pass the real ``vocab_size`` so the padded columns (at the end of the vocab) take no part in the softmax or the
    smoothing. Target values are not range-checked (that would need a host sync on XLA): they must be real vocab ids.
    """
    group = tensor_parallel_group()
    _check_inputs(vocab_parallel_logits, target, label_smoothing, reduction, vocab_size, group)
    target = target.long()
    loss = _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, float(label_smoothing), ignore_index,
                                            vocab_size, group)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()


def from_parallel_logits_to_logprobs(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                     inference: bool = True, vocab_size: Optional[int] = None) -> torch.Tensor:
    """Log-probability of the *next* token at each position, from vocab-parallel logits of shape [..., S, V/tp].

    As NxD's function of the same name: ``target`` is the unshifted token sequence; position ``s`` is scored against
    ``target[..., s + 1]``, so the result has shape [..., S - 1]. With ``inference=True`` (NxD's default) no autograd
    graph is kept; pass ``inference=False`` to differentiate through it (policy-gradient or preference losses). It is
    the negative unsmoothed cross-entropy against the shifted targets, computed without gathering the vocabulary.
    """
    group = tensor_parallel_group()
    _check_inputs(vocab_parallel_logits, target, 0.0, "none", vocab_size, group)
    next_tokens = target.long().roll(shifts=-1, dims=-1)
    with torch.set_grad_enabled(torch.is_grad_enabled() and not inference):
        logprobs = -_VocabParallelCrossEntropy.apply(vocab_parallel_logits, next_tokens, 0.0, None, vocab_size, group)
    return logprobs[..., :-1].contiguous()


__all__ = ["parallel_cross_entropy", "from_parallel_logits_to_logprobs"]

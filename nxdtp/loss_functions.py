"""Cross-entropy on vocab-parallel logits, without ever gathering them.

The LM head of a tensor-parallel model leaves each TP rank with a contiguous slice of the vocabulary: rank ``r`` holds
columns ``[r * V/tp, (r + 1) * V/tp)``. Gathering the full ``[tokens, V]`` logits would cost tp times the memory and one
large all-gather per step. The softmax normaliser and the target logit are sums over the vocabulary, so each rank
reduces its slice to a few numbers per token and two small all-reduces finish the job:

1. MAX of the local log-sum-exps, so every rank rescales by the same value (numerical stability);
2. one SUM of a stacked ``[..., 2 or 3]`` tensor: the target's logit (only the rank owning the target contributes),
   ``exp(local log-sum-exp - max)``, and, with label smoothing, the sum of the logits.

Everything is computed in fp32 whatever the logits' dtype, so bf16 logits lose no precision in the reductions.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from . import comm, mappings
from .record import read_note
from .topology import ParallelGroup, rank_tensor, tensor_parallel_group

_REDUCTIONS = ("none", "mean", "sum")
_INTEGRAL_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _first_id(group: ParallelGroup, local_vocab: int, device) -> torch.Tensor:
    """The global id of this shard's first column, as data (0-dim), so every rank traces one graph."""
    return (rank_tensor(group, device) * local_vocab).reshape(())


def _padding_mask(local_vocab: int, group: ParallelGroup, vocab_size: Optional[int],
                  first_id: torch.Tensor) -> Optional[torch.Tensor]:
    """Which columns of this shard's tail are padding, or None when the vocabulary has no padding.

    Padding sits at the end of the full vocabulary, so only the last ``local_vocab * size - vocab_size`` columns of
    the last shard(s) can be padding. Every rank looks at the same static tail of its shard (as wide as the padding,
    at most the shard), and which of those columns are padding on this rank is a bool mask computed from the rank as
    data: the graph's shapes do not depend on the rank, and only the tail, not the whole shard, is masked."""
    if vocab_size is None or vocab_size == local_vocab * group.size:
        return None
    padding = local_vocab * group.size - vocab_size
    tail = min(padding, local_vocab)
    return torch.arange(local_vocab - tail, local_vocab, device=first_id.device) + first_id >= vocab_size


def _tail(x: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
    """The view of ``x``'s last columns that ``padding_mask`` describes."""
    return x[..., x.shape[-1] - padding_mask.shape[0]:]


def _shard_log_sum_exp(x: torch.Tensor, padding_mask: Optional[torch.Tensor], group: ParallelGroup):
    """This shard's log-sum-exp over its real columns (-inf on a shard of padding only), and its maximum over the group
    (the softmax's stabiliser)."""
    if padding_mask is None:
        local_lse = torch.logsumexp(x, dim=-1)
    else:
        # The maximum over the real columns: the head of the shard as it is, the tail with its padding at -inf.
        top = _tail(x, padding_mask).masked_fill(padding_mask, float("-inf")).amax(dim=-1, keepdim=True)
        head = x.shape[-1] - padding_mask.shape[0]
        if head > 0:
            top = torch.maximum(top, x[..., :head].amax(dim=-1, keepdim=True))
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        # One shard-sized buffer, as logsumexp's own; the padding's exponentials are zeroed in place in the tail.
        exps = torch.sub(x, top).exp_()
        _tail(exps, padding_mask).masked_fill_(padding_mask, 0.0)
        local_lse = exps.sum(dim=-1).log_() + top.squeeze(-1)
    return local_lse, comm.all_reduce(local_lse, group, op="max")


def _real_sum(x: torch.Tensor, padding_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The sum of each row's real columns: the whole row less the padding in the tail."""
    if padding_mask is None:
        return x.sum(dim=-1)
    return x.sum(dim=-1) - (_tail(x, padding_mask) * padding_mask.to(x.dtype)).sum(dim=-1)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss ``(1 - eps) * nll + eps * (logZ - mean logit)``; returns 0 for ignored targets.

    The forward reduces each shard to its local log-sum-exp, so no shifted or exponentiated copy of the logits outlives
    a single reduction. The backward recomputes this shard's softmax from the saved logits and the global
    log-normaliser, in one buffer updated in place: one fp32 copy of the (large) logits shard at peak.
    """

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, ignore_index, vocab_size, group):
        x = logits.float()
        local_vocab = x.shape[-1]
        first_id = _first_id(group, local_vocab, x.device)
        padding_mask = _padding_mask(local_vocab, group, vocab_size, first_id)
        num_classes = vocab_size if vocab_size is not None else local_vocab * group.size
        local_lse, global_max = _shard_log_sum_exp(x, padding_mask, group)

        ignored = target == ignore_index if ignore_index is not None else torch.zeros_like(target, dtype=torch.bool)
        local_target = target - first_id
        in_shard = (local_target >= 0) & (local_target < local_vocab) & ~ignored
        safe_index = torch.where(in_shard, local_target, torch.zeros_like(local_target))
        picked = x.gather(-1, safe_index.unsqueeze(-1)).squeeze(-1)
        parts = [torch.where(in_shard, picked, torch.zeros_like(picked)), (local_lse - global_max).exp()]
        if label_smoothing > 0:
            parts.append(_real_sum(x, padding_mask))
        totals = comm.all_reduce(torch.stack(parts, dim=-1), group, op="sum")

        log_normaliser = global_max + totals[..., 1].log()
        loss = log_normaliser - totals[..., 0]
        if label_smoothing > 0:
            mean_logit = totals[..., 2] / num_classes
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_normaliser - mean_logit)
        loss = torch.where(ignored, torch.zeros_like(loss), loss)

        ctx.save_for_backward(logits, log_normaliser, safe_index, in_shard, ignored, padding_mask)
        ctx.label_smoothing, ctx.num_classes = label_smoothing, num_classes
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, log_normaliser, safe_index, in_shard, ignored, padding_mask = ctx.saved_tensors
        eps = ctx.label_smoothing
        # The fp32 normaliser promotes bf16 logits: one fp32 buffer, reused in place below.
        grad = torch.sub(logits, log_normaliser.unsqueeze(-1)).exp_()  # this shard's softmax
        hit = in_shard.to(grad.dtype) * (1.0 - eps)
        grad.scatter_add_(-1, safe_index.unsqueeze(-1), -hit.unsqueeze(-1))
        if eps > 0:
            grad.sub_(eps / ctx.num_classes)
        if padding_mask is not None:  # padded columns have probability 0 (targets are never padded columns)
            _tail(grad, padding_mask).masked_fill_(padding_mask, 0.0)
        scale = torch.where(ignored, torch.zeros_like(grad_loss), grad_loss.float())
        grad.mul_(scale.unsqueeze(-1))
        return grad.to(logits.dtype), None, None, None, None, None


@dataclasses.dataclass
class FullVocabularyNote:
    """On a logits tensor a parallelized model's forward gathered (``nxdtp.models.logits``): it holds the whole
    vocabulary on every TP rank, so the vocab-parallel losses, which take it for this rank's shard, refuse it."""
    full: bool = False


def _check_inputs(logits, target, label_smoothing, reduction, vocab_size, group) -> None:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"vocab_parallel_logits must be a floating-point tensor, got "
                        f"{getattr(logits, 'dtype', type(logits).__name__)}")
    if read_note(logits, FullVocabularyNote).full:
        raise ValueError(f"vocab_parallel_logits of shape {tuple(logits.shape)} are a parallelized model's "
                         "full-vocabulary logits (its forward's default), not this rank's shard: run the forward "
                         "inside nxdtp.models.vocab_parallel_logits(model) to get the shard, or use "
                         "torch.nn.functional.cross_entropy on the full logits")
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
    """Cross-entropy of logits sharded over the vocab across the TP group; equals ``F.cross_entropy`` on the full
    logits.

    ``target`` holds global vocabulary ids and is the same on every TP rank. ``reduction="none"`` (NxD's behaviour)
    returns the fp32 per-token loss, 0 where ``target == ignore_index``; ``"mean"`` divides the sum by the number of
    non-ignored targets (NaN when there are none, as torch does). When the vocab was padded to a multiple of the TP
    size, pass the real ``vocab_size`` so the padded columns (at the end of the vocab) take no part in the softmax or
    the smoothing. Target values are not range-checked (that would need a host sync on XLA): they must be real vocab
    ids.
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


class DistributedLogprob(torch.autograd.Function):
    """NxD's autograd Function: ``log p(target)`` at each position, from logits sharded over the vocab across the TP
    group.

    ``DistributedLogprob.apply(vocab_parallel_logits, target, inference=True, vocab_size=None)``. ``target`` holds
    global vocabulary ids for the *same* positions (it is not shifted here) and has the logits' shape without the last
    dim; the result has that shape too. A target that no rank holds (negative, past the vocab, or a padded column when
    ``vocab_size`` is given) gives 0 and no gradient, as in NxD. With ``inference=True`` nothing is saved for backward
    and the result does not require grad. Two small all-reduces (a MAX, then one stacked SUM), computed in fp32; the
    backward recomputes this shard's softmax from the saved logits and the log-normaliser and needs no communication.
    """

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, inference=True, vocab_size=None):
        group = tensor_parallel_group()
        _check_inputs(vocab_parallel_logits, target, 0.0, "none", vocab_size, group)
        if not isinstance(inference, bool):
            raise TypeError(f"inference={inference!r} must be True (no graph kept) or False (differentiable)")
        x = vocab_parallel_logits.float()
        local_vocab = x.shape[-1]
        first_id = _first_id(group, local_vocab, x.device)
        padding_mask = _padding_mask(local_vocab, group, vocab_size, first_id)
        local_lse, global_max = _shard_log_sum_exp(x, padding_mask, group)

        local_target = target.long() - first_id
        in_shard = (local_target >= 0) & (local_target < local_vocab)
        if vocab_size is not None:
            in_shard = in_shard & (target < vocab_size)
        safe_index = torch.where(in_shard, local_target, torch.zeros_like(local_target))
        picked = x.gather(-1, safe_index.unsqueeze(-1)).squeeze(-1)
        parts = [torch.where(in_shard, picked, torch.zeros_like(picked)), (local_lse - global_max).exp(),
                 in_shard.to(x.dtype)]
        totals = comm.all_reduce(torch.stack(parts, dim=-1), group, op="sum")
        log_normaliser = global_max + totals[..., 1].log()
        held = totals[..., 2] > 0  # some rank holds the target
        logprob = torch.where(held, totals[..., 0] - log_normaliser, torch.zeros_like(log_normaliser))
        if inference:
            ctx.mark_non_differentiable(logprob)
        else:
            ctx.save_for_backward(vocab_parallel_logits, log_normaliser, safe_index, in_shard, held, padding_mask)
        return logprob

    @staticmethod
    def backward(ctx, grad_logprob):
        logits, log_normaliser, safe_index, in_shard, held, padding_mask = ctx.saved_tensors
        # d logprob / d logit_j = [j == target] - softmax_j, for positions whose target some rank holds.
        grad = torch.sub(logits, log_normaliser.unsqueeze(-1)).exp_()  # this shard's softmax (fp32)
        if padding_mask is not None:
            _tail(grad, padding_mask).masked_fill_(padding_mask, 0.0)
        grad.scatter_add_(-1, safe_index.unsqueeze(-1), -in_shard.to(grad.dtype).unsqueeze(-1))
        scale = torch.where(held, -grad_logprob.float(), torch.zeros_like(grad_logprob, dtype=torch.float32))
        grad.mul_(scale.unsqueeze(-1))
        return grad.to(logits.dtype), None, None, None


def from_parallel_logits_to_logprobs(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                     inference: bool = True, vocab_size: Optional[int] = None) -> torch.Tensor:
    """Log-probability of the *next* token at each position, from vocab-parallel logits of shape [..., S, V/tp].

    As NxD's function of the same name: ``target`` is the unshifted token sequence; position ``s`` is scored against
    ``target[..., s + 1]``, so the result has shape [..., S - 1]. With ``inference=True`` (NxD's default) no autograd
    graph is kept; pass ``inference=False`` to differentiate through it (policy-gradient or preference losses). It is
    ``DistributedLogprob`` on the targets rolled by one position, without the last position.
    """
    next_tokens = target.roll(shifts=-1, dims=-1) if isinstance(target, torch.Tensor) else target
    logprobs = DistributedLogprob.apply(vocab_parallel_logits, next_tokens, inference, vocab_size)
    return logprobs[..., :-1].contiguous()


def vocab_parallel_token_statistics(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                    vocab_size: Optional[int] = None) -> dict:
    """Per position of vocab-parallel logits ``[..., V/tp]`` (targets: global ids of the same positions, each a real
    id): what a trainer reads of the softmax over the whole vocabulary, without gathering it. Returns fp32 tensors of
    ``target``'s shape: ``log_probs`` (log p(target)), ``entropy``, ``log_sum_sq_probs`` (log sum p^2), ``mean_logits``
    (over the real vocabulary) and ``is_top1`` (the target is the first largest logit, as ``argmax`` picks it).

    ``log_probs`` and ``entropy`` are differentiable: each rank's share of a vocabulary sum depends on its shard only,
    so the sums are all-reduced with an identity backward. Two all-reduces: a MAX of two stacked maxima (the softmax's
    stabiliser and the largest logit before the target), and one stacked SUM."""
    group = tensor_parallel_group()
    _check_inputs(vocab_parallel_logits, target, 0.0, "none", vocab_size, group)
    x = vocab_parallel_logits.float()
    local_vocab = x.shape[-1]
    first_id = _first_id(group, local_vocab, x.device)
    real_vocab = local_vocab * group.size if vocab_size is None else vocab_size
    column = torch.arange(local_vocab, device=x.device) + first_id
    real = column < real_vocab
    x = x.masked_fill(~real, float("-inf"))
    before_target = real & (column < target.unsqueeze(-1))
    maxima = torch.stack([x.detach().amax(dim=-1), x.detach().masked_fill(~before_target, float("-inf")).amax(dim=-1)],
                         dim=-1)
    top, top_before_target = comm.all_reduce(maxima, group, op="max").unbind(-1)
    shifted = torch.where(real, x - top.unsqueeze(-1), torch.zeros_like(x))
    exps = torch.where(real, shifted.exp(), torch.zeros_like(x))
    local_target = target.long() - first_id
    in_shard = (local_target >= 0) & (local_target < local_vocab)
    picked = x.gather(-1, torch.where(in_shard, local_target, 0).unsqueeze(-1)).squeeze(-1)
    parts = [exps.sum(-1), (exps * shifted).sum(-1), (exps * exps).sum(-1),
             torch.where(real, x, torch.zeros_like(x)).sum(-1), torch.where(in_shard, picked, torch.zeros_like(picked))]
    totals = mappings.reduce_from_tensor_model_parallel_region(torch.stack(parts, dim=-1), group)
    normaliser, weighted, squares, logit_sum, target_logit = totals.unbind(-1)
    log_normaliser = normaliser.log()
    return {"log_probs": target_logit - top - log_normaliser,
            "entropy": log_normaliser - weighted / normaliser,
            "log_sum_sq_probs": (squares.log() - 2 * log_normaliser).detach(),
            "mean_logits": (logit_sum / real_vocab).detach(),
            "is_top1": ((target_logit >= top) & (target_logit > top_before_target)).detach()}


__all__ = ["parallel_cross_entropy", "from_parallel_logits_to_logprobs", "DistributedLogprob",
           "vocab_parallel_token_statistics"]

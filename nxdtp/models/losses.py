"""The vocab-parallel LM loss for every family whose HF model computes its loss through ``self.loss_function``.

HF causal-LM models compute ``logits`` (after any processing of their own: soft-capping, scaling) and then call
``self.loss_function(logits=logits, labels=labels, vocab_size=config.vocab_size, **kwargs)``. Setting that attribute
on the model instance swaps HF's cross entropy, which needs full logits, for ``parallel_cross_entropy`` on the
vocab-parallel shard: the logits are never gathered, and the padded vocabulary columns take no part.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..loss_functions import parallel_cross_entropy


def vocab_parallel_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                           num_items_in_batch: Optional[torch.Tensor] = None, ignore_index: int = -100,
                           label_smoothing: float = 0.0) -> torch.Tensor:
    """Cross entropy of vocab-parallel ``logits`` against ``labels`` of the same positions (no shift), in fp32.

    The mean over counted targets, or, when ``num_items_in_batch`` is given (Trainer's global count over DP ranks and
    accumulation steps), their sum divided by it: HF's convention for a loss that gradient accumulation and data
    parallelism add up to the global-batch mean. The causal-LM loss and the encoders' MLM loss both end here.
    """
    loss = parallel_cross_entropy(logits.float(), labels.to(logits.device), label_smoothing=label_smoothing,
                                  ignore_index=ignore_index, reduction="mean" if num_items_in_batch is None else "sum",
                                  vocab_size=vocab_size)
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def vocab_parallel_causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                                  num_items_in_batch: Optional[torch.Tensor] = None, ignore_index: int = -100,
                                  shift_labels: Optional[torch.Tensor] = None, label_smoothing: float = 0.0,
                                  **_unused) -> torch.Tensor:
    """HF's causal-LM loss on vocab-parallel logits ``[batch, seq, padded_vocab / tp]``.

    As in transformers: position t predicts label t+1 (or ``shift_labels`` as given), ``ignore_index`` targets count
    for nothing, the loss is computed in fp32 and is the mean over counted targets, or their sum divided by
    ``num_items_in_batch`` when that is given (a global count, e.g. over gradient-accumulation steps).
    ``label_smoothing`` is an nxdtp addition, with ``F.cross_entropy``'s meaning.
    """
    if shift_labels is None:
        # Pad, then shift: the last position has no next token, exactly as HF does it.
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return vocab_parallel_lm_loss(logits, shift_labels, vocab_size, num_items_in_batch, ignore_index, label_smoothing)


def use_vocab_parallel_causal_lm_loss(model: nn.Module) -> None:
    """Make ``model`` (an HF model with a vocab-parallel LM head) compute its loss on the vocab-parallel logits."""
    if not hasattr(type(model), "loss_function"):
        raise TypeError(f"{type(model).__name__} has no loss_function attribute to replace; its loss cannot be made "
                        "vocab-parallel this way")
    model.loss_function = vocab_parallel_causal_lm_loss

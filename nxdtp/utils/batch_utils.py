"""NxD's ``neuronx_distributed.utils.batch_utils``: what a training loop calls on each batch before the forward.

NxD's Llama pretraining script calls ``get_batch_on_this_context_parallel_rank(batch)`` on every batch. Under context
parallelism NxD cuts each tensor's sequence into one chunk per context-parallel rank; nxdtp has no context
parallelism (its context-parallel size is always 1, ``initialize_model_parallel`` refuses any other), so the batch is
returned as it is. Should the size read anything else, the call raises instead of handing the model a whole sequence
where a chunk was expected.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from .. import parallel_state

# The label NxD pads shifted labels with: the ignore index of torch's and nxdtp's cross-entropy losses.
IGNORED_LABEL = -100


def shift_labels(batch: Dict[str, Any]) -> Dict[str, Any]:
    """A new dict: ``batch`` with its ``"labels"`` ([batch, seq]) moved one position left along the sequence and the
    freed last position set to -100 (ignored by the loss), so position i holds the label of token i + 1; every other
    entry is the same object. NxD shifts the labels this way before cutting a batch for context parallelism."""
    shifted = dict(batch)
    labels = batch.get("labels")
    if labels is not None:
        padding = torch.full((labels.shape[0], 1), IGNORED_LABEL, dtype=labels.dtype, device=labels.device)
        shifted["labels"] = torch.cat([labels[:, 1:], padding], dim=1)
    return shifted


def get_batch_on_this_context_parallel_rank(batch: Any) -> Any:
    """This context-parallel rank's part of ``batch`` (NxD's dict of ``[batch, seq, ...]`` tensors): with nxdtp's
    context-parallel size of 1, ``batch`` itself, unchanged (NxD's result at size 1).

    Raises ``ValueError`` naming the size if ``parallel_state.get_context_model_parallel_size()`` is above 1: cutting
    the sequence would need context-parallel attention, which nxdtp does not have, and the uncut batch would silently
    train on every token on every rank. Raises ``RuntimeError`` if model parallel is not initialized, as the getter
    does."""
    size = parallel_state.get_context_model_parallel_size()
    if size != 1:
        raise ValueError(f"get_batch_on_this_context_parallel_rank: context_parallel_size={size}: nxdtp has no "
                         "context parallelism, so it cannot give this rank its chunk of the sequence; only "
                         "context_parallel_size=1 is supported, where the batch is returned unchanged")
    return batch


__all__ = ["get_batch_on_this_context_parallel_rank", "shift_labels"]

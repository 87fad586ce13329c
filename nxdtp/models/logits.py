"""The logits a parallelized model's forward returns: the whole vocabulary by default, the vocab-parallel shards when
asked.

A vocab-parallel LM head leaves each TP rank a slice of the vocabulary. The model's own loss (labels given) runs on the
slices (``nxdtp.models.losses``), but whatever else reads ``outputs.logits`` (a user's loss, Trainer's
``compute_loss_func`` or label smoother, a KL or distillation term, metrics, ``generate``) expects the whole vocabulary,
and given a slice it computes a plausible, wrong number. So by default the forward all-gathers its logits over TP after
the loss and drops the padded vocabulary columns: every reader gets the dense model's logits, on every TP rank, and a
loss on them differentiates back into each rank's shard.

``vocab_parallel_logits(model)`` keeps the slices, for code written for them (``parallel_cross_entropy`` or
``from_parallel_logits_to_logprobs`` on ``outputs.logits``): it saves one all-gather per forward and a
``[tokens, vocabulary]`` tensor per rank (docs/performance.md has the figures). ``TensorParallelTrainer`` uses it for
the training forwards whose loss is the model's own.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from ..layers import ColumnParallelLinear
from ..loss_functions import FullVocabularyNote
from ..plan import wrap_forward
from ..record import note_of, read_note
from .common import gather_vocab_logits

LOGITS_KEYS = ("logits", "prediction_logits")


@dataclasses.dataclass
class LogitsNote:
    """On a parallelized model: how many ``vocab_parallel_logits`` contexts are open on it."""
    vocab_parallel: int = 0


def vocab_parallel_head(model: nn.Module):
    """The model's LM head if its logits are vocab-parallel (a column-parallel layer that does not gather, or PEFT's
    LoRA layer around one), else None (a head HF's tp_plan left replicated gives full logits already)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    layer = _parallel_layer(head)
    if isinstance(layer, ColumnParallelLinear) and not layer.gather_output:
        return head
    return None


def vocabulary_sizes(head: nn.Module) -> tuple:
    """(the columns of the logits a rank's ``head`` computes, the real vocabulary size) of a vocab-parallel head."""
    layer = _parallel_layer(head)
    return layer.output_size_per_partition, getattr(layer, "real_output_size", layer.output_size)


def _parallel_layer(head):
    return head.get_base_layer() if hasattr(head, "get_base_layer") else head


def has_vocab_parallel_head(model: nn.Module) -> bool:
    """Whether ``model`` (or the HF model a PEFT model wraps) has a vocab-parallel LM head."""
    return vocab_parallel_head(_hf_model(model)) is not None


def model_and_wrapped(model: nn.Module) -> list:
    """``model`` and, when it wraps one (PEFT, NxD's ``NxDModel``), the HF model inside it."""
    inner = _hf_model(model)
    return [model] if inner is model else [model, inner]


def _hf_model(model: nn.Module) -> nn.Module:
    """The HF model itself, also when PEFT (``get_base_model``) or NxD's trainer API (``NxDModel.original_module``)
    wraps it."""
    if hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model.original_module() if hasattr(type(model), "original_module") else model


@contextlib.contextmanager
def vocab_parallel_logits(model: nn.Module):
    """Inside, ``model``'s forward returns the vocab-parallel logits ``[..., padded_vocab / tp]`` of this rank, as its
    LM head computes them, instead of the full-vocabulary logits. Re-entrant."""
    inner = _hf_model(model)
    if not has_vocab_parallel_head(inner):
        raise TypeError(f"vocab_parallel_logits() needs a model parallelized by nxdtp with a vocab-parallel LM head; "
                        f"{type(inner).__name__} has none (its logits are full already)")
    note = note_of(inner, LogitsNote)
    note.vocab_parallel += 1
    try:
        yield model
    finally:
        note.vocab_parallel -= 1


@contextlib.contextmanager
def full_logits(model: nn.Module):
    """Inside, ``model``'s forward returns full-vocabulary logits even within ``vocab_parallel_logits`` (decoding
    needs them)."""
    note = note_of(_hf_model(model), LogitsNote)
    depth, note.vocab_parallel = note.vocab_parallel, 0
    try:
        yield model
    finally:
        note.vocab_parallel = depth


def _full_vocabulary_logits(forward, *args, **kwargs):
    """The forward wrapper: the model's outputs with their vocab-parallel logits gathered (module docstring). The
    forward runs with ``return_dict=True`` so the logits are found by name; a caller that asked for a tuple gets HF's
    tuple made from the outputs."""
    model = forward.__self__
    head = vocab_parallel_head(model)
    if head is None or read_note(model, LogitsNote).vocab_parallel:
        return forward(*args, **kwargs)
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    outputs = forward(*args, return_dict=True, **kwargs)
    local, real = vocabulary_sizes(head)
    if hasattr(outputs, "keys"):
        for key in LOGITS_KEYS:
            logits = outputs.get(key)
            if torch.is_tensor(logits) and logits.shape[-1] == local:
                outputs[key] = gather_vocab_logits(logits, real)
                note_of(outputs[key], FullVocabularyNote).full = True   # the vocab-parallel losses refuse them
    if return_dict:
        return outputs
    # HF's tuple holds the output class's own fields (keys a plan adds, such as BERT's mlm_loss, stay out of it).
    fields = {field.name for field in dataclasses.fields(outputs)} if dataclasses.is_dataclass(outputs) else None
    return tuple(value for key, value in outputs.items() if fields is None or key in fields)


def support_full_logits(model: nn.Module) -> None:
    """Make ``model``'s forward return full-vocabulary logits unless ``vocab_parallel_logits`` is open; a model
    without a vocab-parallel head is left as it is."""
    if vocab_parallel_head(model) is not None:
        wrap_forward(model, "full_vocabulary_logits", _full_vocabulary_logits)

"""Shard a Hugging Face model nxdtp has no hand-written plan for, from the tensor-parallel plan transformers ships
with it: the config's ``base_model_tp_plan`` (module patterns relative to the base model) and the model class's
``_tp_plan`` (the head).

HF's style strings map onto nxdtp styles:

| HF style | nxdtp style |
| --- | --- |
| ``colwise`` | ``ColumnParallel`` (output stays split) |
| ``rowwise`` | ``RowParallel`` (input already split) |
| ``colwise_gather_output``, ``colwise_rep`` | ``ColumnParallel(gather_output=True)``; on the LM head, better: a vocab-parallel head whose logits stay split, and the vocab-parallel loss |
| ``rowwise_split_input`` | ``RowParallel(input_is_parallel=False)`` |
| ``packed_colwise`` | ``ColumnParallel(stride=2)`` (fused gate/up: each rank keeps its share of both halves) |
| ``embedding_rowwise`` | ``VocabParallelEmbedding`` |
| ``replicated_with_grad_allreduce`` | ``ReplicatedWithGradAllReduce`` |

The input embedding is made vocab-parallel too, so a head tied to it stays consistent, unless its class has a forward
of its own (Gemma's scaled embedding): then it stays replicated, and so does a head tied to it (a warning says so).
Any other style is an error naming the style and the module. Sequence parallelism needs a hand-written plan.
"""

from __future__ import annotations

import logging
from typing import Dict

from torch import nn

from ..plan import ColumnParallel, Plan, ReplicatedWithGradAllReduce, RowParallel, VocabParallelEmbedding, \
    VocabParallelLMHead, has_own_forward
from .common import check_model
from .losses import use_vocab_parallel_causal_lm_loss

logger = logging.getLogger(__name__)

GATHERING = ("colwise_gather_output", "colwise_rep")


def has_tp_plan(config) -> bool:
    return bool(getattr(config, "base_model_tp_plan", None))


def tp_plan(model: nn.Module, sequence_parallel: bool = False, make_vocab_size_divisible_by: int = 1) -> Plan:
    """The nxdtp plan equivalent to ``model``'s HF tensor-parallel plan."""
    name = type(model).__name__
    if sequence_parallel:
        raise ValueError(f"sequence_parallel=True needs a hand-written plan; {name} is sharded from HF's tp_plan, "
                         "which has none: use sequence_parallel=False")
    pad = dict(pad_to_multiple_of=make_vocab_size_divisible_by)
    head_name = _output_embedding_name(model)
    styles: Dict[str, object] = {}
    prefix = model.base_model_prefix
    base_plan = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    head_plan = dict(getattr(type(model), "_tp_plan", None) or getattr(model, "_tp_plan", None) or {})
    for pattern, style in base_plan.items():
        full = f"{prefix}.{pattern}" if prefix and hasattr(model, prefix) else pattern
        styles[full] = _style(style, full, name, pad)
    embedding_module = model.get_input_embeddings()
    embedding = _module_name(model, embedding_module)
    shard_embedding = embedding is not None and not has_own_forward(embedding_module, nn.Embedding)
    head_module = model.get_output_embeddings()
    head_tied = head_module is not None and embedding_module is not None and \
        head_module.weight is embedding_module.weight
    vocab_parallel_head = False
    for pattern, style in head_plan.items():
        if pattern == head_name and head_tied and not shard_embedding:
            logger.warning("%s: '%s' is tied to '%s' (%s, which has a forward of its own and stays replicated): the "
                           "head stays replicated too", name, head_name, embedding, type(embedding_module).__name__)
        elif pattern == head_name and style in GATHERING:
            styles[pattern] = VocabParallelLMHead(**pad)  # no gather: the loss takes the vocab-parallel logits
            vocab_parallel_head = True
        else:
            styles[pattern] = _style(style, pattern, name, pad)
    if shard_embedding:
        styles.setdefault(embedding, VocabParallelEmbedding(**pad))
        if head_tied and head_name not in styles:
            # The head holds the embedding's weight: it must be split the same way, or it would compute garbage.
            styles[head_name] = VocabParallelLMHead(**pad)
            vocab_parallel_head = True

    def prepare(model: nn.Module) -> None:
        _validate(model)

    def finalize(model: nn.Module) -> None:
        if vocab_parallel_head:
            use_vocab_parallel_causal_lm_loss(model)

    return Plan(styles=styles, prepare=prepare, finalize=finalize)


def _style(style: str, module_pattern: str, model_name: str, pad: dict):
    if style == "colwise":
        return ColumnParallel()
    if style == "rowwise":
        return RowParallel()
    if style in GATHERING:
        return ColumnParallel(gather_output=True)
    if style == "rowwise_split_input":
        return RowParallel(input_is_parallel=False)
    if style == "packed_colwise":
        return ColumnParallel(stride=2)
    if style == "embedding_rowwise":
        return VocabParallelEmbedding(**pad)
    if style == "replicated_with_grad_allreduce":
        return ReplicatedWithGradAllReduce()
    raise ValueError(f"{model_name}'s tp_plan gives '{module_pattern}' the style {style!r}, which nxdtp does not map; "
                     "supported styles: colwise, rowwise, colwise_gather_output, colwise_rep, rowwise_split_input, "
                     "packed_colwise, embedding_rowwise, replicated_with_grad_allreduce")


def _validate(model: nn.Module) -> None:
    check_model(model, "HF tp_plan", None, {what: getattr(model.config, what, None) for what in
                                            ("num_attention_heads", "num_key_value_heads", "intermediate_size")})


def _module_name(model: nn.Module, module) -> str:
    return next((n for n, m in model.named_modules() if m is module), None) if module is not None else None


def _output_embedding_name(model: nn.Module):
    return _module_name(model, model.get_output_embeddings())


def checkpoint_keys_for(model_class: type):
    base = getattr(model_class, "base_model_prefix", "") + "."

    def keys(name: str):
        return [name, name[len(base):] if name.startswith(base) else base + name]

    return keys

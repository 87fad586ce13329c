"""Shard a Hugging Face model nxdtp has no hand-written plan for, from the tensor-parallel plan transformers ships
with it: the config's ``base_model_tp_plan`` (module patterns relative to the base model) and the model class's
``_tp_plan`` (the head).

HF's style strings map onto nxdtp styles:

| HF style | nxdtp style |
| --- | --- |
| ``colwise`` | ``ColumnParallel`` (output stays split) |
| ``rowwise`` | ``RowParallel`` (input already split) |
| ``colwise_gather_output``, ``colwise_rep`` | ``ColumnParallel(gather_output=True)``; on the LM head, better: (*) |
| ``rowwise_split_input``, ``rowwise_rep`` (its name in transformers 4.5x) | ``RowParallel(input_is_parallel=False)`` |
| ``packed_colwise`` | ``ColumnParallel(stride=2)`` (fused gate/up: each rank keeps its share of both halves) |
| ``embedding_rowwise`` | ``VocabParallelEmbedding`` |
| ``replicated_with_grad_allreduce`` | ``ReplicatedWithGradAllReduce`` |
| ``moe_tp_experts`` | ``ParallelExperts`` (``nxdtp.models.moe``), which splits the experts' weights itself |

(*) a vocab-parallel head (the model's forward gathers its logits) and the vocab-parallel loss.

The input embedding is made vocab-parallel too, so a head tied to it stays consistent, unless its class has a forward
of its own (Gemma's scaled embedding): then it stays replicated, and so does a head tied to it (a warning says so).
Any other style is an error naming the style and the module. Sequence parallelism needs a hand-written plan.

Attention blocks whose Q, K and V are ``colwise`` and whose output projection is ``rowwise`` (each rank runs whole
heads) get what HF's plan lacks: KV heads repeated when TP exceeds or does not divide them, and zero heads when TP does
not divide the query heads (``attention_styles.py``, as in the hand-written plans).
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Dict, Tuple

from torch import nn

from ..plan import (
    ColumnParallel,
    Plan,
    ReplicatedWithGradAllReduce,
    RowParallel,
    SetAttributes,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    has_own_forward,
)
from ..topology import ParallelGroup
from .attention_styles import attention_projection_styles, local_kv_groups
from .common import check_model, require_supported_transformers
from .hf_integration import finish_hf_model
from .losses import use_vocab_parallel_causal_lm_loss
from .moe import ParallelExperts, count_router_tokens_over_data_parallel

logger = logging.getLogger(__name__)

NAME = "HF tp_plan"   # for messages
GATHERING = ("colwise_gather_output", "colwise_rep")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def has_tp_plan(config) -> bool:
    return bool(getattr(config, "base_model_tp_plan", None))


def tp_plan(model: nn.Module, sequence_parallel: bool = False, make_vocab_size_divisible_by: int = 1,
            pad_heads: bool = True) -> Plan:
    """The nxdtp plan equivalent to ``model``'s HF tensor-parallel plan. Attention blocks whose Q, K, V are
    ``colwise`` and output ``rowwise`` get KV-head copies and zero heads when TP needs them, as the hand-written plans
    do (``pad_heads=False`` refuses zero heads)."""
    require_supported_transformers(NAME)
    name = type(model).__name__
    if sequence_parallel:
        raise ValueError(f"sequence_parallel=True needs a hand-written plan; {name} is sharded from HF's tp_plan, "
                         "which has none: use sequence_parallel=False")
    pad = dict(pad_to_multiple_of=make_vocab_size_divisible_by)
    styles, hf_styles = _base_model_styles(model, pad)
    attention_patterns = _head_split_attention(model, hf_styles)
    vocab_parallel_head = _add_vocabulary_styles(model, styles, pad)

    def prepare(model: nn.Module, group: ParallelGroup) -> dict:
        _validate(model, group, heads_handled=bool(attention_patterns))
        config = model.config
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        extra = {}
        for attention_pattern, head_dim in attention_patterns.items():
            projections = attention_projection_styles(name, heads, kv_heads, head_dim, group.size, pad_heads,
                                                      ColumnParallel(), RowParallel())
            extra.update({f"{attention_pattern}.{p}": style for p, style in zip(PROJECTIONS, projections)})
            extra[attention_pattern] = SetAttributes((("num_key_value_groups",
                                                       local_kv_groups(heads, kv_heads, group.size)),))
        return extra

    def finalize(model: nn.Module) -> None:
        if vocab_parallel_head:
            use_vocab_parallel_causal_lm_loss(model)
        if "moe_tp_experts" in hf_styles.values():
            count_router_tokens_over_data_parallel(model)
        finish_hf_model(model)

    return Plan(styles=styles, prepare=prepare, finalize=finalize)


def _base_model_styles(model: nn.Module, pad: dict) -> Tuple[Dict[str, object], Dict[str, str]]:
    """(nxdtp's style, HF's style name) of every module pattern of the config's ``base_model_tp_plan``, prefixed with
    the base model's attribute where the model wraps one."""
    prefix = model.base_model_prefix
    styles: Dict[str, object] = {}
    hf_styles: Dict[str, str] = {}
    plan = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    experts = [pattern for pattern, style in plan.items() if style == "moe_tp_experts"]
    for pattern, style in plan.items():
        if pattern.rpartition(".")[0] in experts:
            continue   # an experts module's weights: ParallelExperts splits them
        full = f"{prefix}.{pattern}" if prefix and hasattr(model, prefix) else pattern
        styles[full] = _style(style, full, type(model).__name__, pad)
        hf_styles[full] = style
    return styles, hf_styles


def _add_vocabulary_styles(model: nn.Module, styles: Dict[str, object], pad: dict) -> bool:
    """Add the styles of the class's own ``_tp_plan`` (the LM head) and of the input embedding to ``styles``; return
    whether the head ends vocab-parallel (then the loss must take vocab-parallel logits)."""
    name = type(model).__name__
    head_name = _output_embedding_name(model)
    head_plan = dict(getattr(type(model), "_tp_plan", None) or getattr(model, "_tp_plan", None) or {})
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
    return vocab_parallel_head


def _style(style: str, module_pattern: str, model_name: str, pad: dict):
    if style == "colwise":
        return ColumnParallel()
    if style == "rowwise":
        return RowParallel()
    if style in GATHERING:
        return ColumnParallel(gather_output=True)
    if style in ("rowwise_split_input", "rowwise_rep"):
        return RowParallel(input_is_parallel=False)
    if style == "packed_colwise":
        return ColumnParallel(stride=2)
    if style == "embedding_rowwise":
        return VocabParallelEmbedding(**pad)
    if style == "replicated_with_grad_allreduce":
        return ReplicatedWithGradAllReduce()
    if style == "moe_tp_experts":
        return ParallelExperts()
    raise ValueError(f"{model_name}'s tp_plan gives '{module_pattern}' the style {style!r}, which nxdtp does not map; "
                     "supported styles: colwise, rowwise, colwise_gather_output, colwise_rep, rowwise_split_input, "
                     "rowwise_rep, packed_colwise, embedding_rowwise, replicated_with_grad_allreduce, moe_tp_experts")


def _head_split_attention(model: nn.Module, hf_styles: Dict[str, str]) -> Dict[str, int]:
    """{attention module pattern: head size} for the attention blocks whose heads nxdtp can lay out for any head count:
    Q, K and V ``colwise`` and the output ``rowwise`` (so each rank runs whole heads), in a module whose forward reads
    its ``num_key_value_groups`` and ``head_dim`` attributes, as HF's attention classes do."""
    config = model.config
    if not (getattr(config, "num_attention_heads", None) and getattr(config, "num_key_value_heads", None)):
        return {}
    found = {}
    for pattern in hf_styles:
        attention = pattern[:-len(".q_proj")] if pattern.endswith(".q_proj") else None
        if attention is None or any(hf_styles.get(f"{attention}.{p}") != style
                                    for p, style in zip(PROJECTIONS, ("colwise",) * 3 + ("rowwise",))):
            continue
        module = next((m for n, m in model.named_modules() if fnmatch.fnmatchcase(n, attention)), None)
        if module is not None and hasattr(module, "num_key_value_groups") and isinstance(getattr(module, "head_dim",
                                                                                                 None), int):
            found[attention] = module.head_dim
    return found


def _validate(model: nn.Module, group: ParallelGroup, heads_handled: bool) -> None:
    sizes = ("intermediate_size",) if heads_handled else ("num_attention_heads", "num_key_value_heads",
                                                          "intermediate_size")
    check_model(model, NAME, None, {what: getattr(model.config, what, None) for what in sizes}, group)


def _module_name(model: nn.Module, module) -> str:
    return next((n for n, m in model.named_modules() if m is module), None) if module is not None else None


def _output_embedding_name(model: nn.Module):
    return _module_name(model, model.get_output_embeddings())


def checkpoint_keys_for(model_class: type):
    base = getattr(model_class, "base_model_prefix", "") + "."

    def keys(name: str):
        return [name, name[len(base):] if name.startswith(base) else base + name]

    return keys

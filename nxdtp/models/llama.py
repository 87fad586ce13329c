"""Tensor-parallel plan for the Llama family of Hugging Face decoders: LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM and Qwen3ForCausalLM (they share module names and structure; Qwen2 adds Q/K/V biases, Qwen3 per-head
q_norm / k_norm).

Megatron-style, as for BERT:

* Q, K and V are column-parallel behind one entry region, ``o_proj`` row-parallel: one all-reduce forward and one
  backward per attention block. ``gate_proj`` and ``up_proj`` are column-parallel behind one region, ``down_proj``
  row-parallel. Each rank runs ``num_attention_heads / tp`` query heads and ``num_key_value_heads / tp`` KV heads;
  rotary embeddings apply per head, so they need nothing. With fewer KV heads than TP ranks (or a count TP does not
  divide) each KV head is repeated until TP divides them (``KVReplicatedColumnParallel``); query heads TP does not
  divide get zero heads (``HeadPadded``, ``pad_heads``). ``attention_styles.py`` chooses these styles.
* ``embed_tokens`` and ``lm_head`` are vocab-parallel (padded to ``make_vocab_size_divisible_by * tp``), tied when the
  config ties them. The loss is the vocab-parallel causal-LM loss (``nxdtp.models.losses``); the forward
  returns full-vocabulary ``logits`` (``nxdtp.models.logits``).
* RMSNorms are replicated. Qwen3's q_norm / k_norm act on this rank's heads only, so their gradients are summed over
  TP in backward (``ReplicatedWithGradAllReduce``).
* ``sequence_parallel=True``: the hidden states are split along the sequence from the first decoder layer's input to
  the final norm's output; the RMSNorms run on sequence shards (their parameters are marked sequence-parallel: call
  ``nxdtp.grads.allreduce_sequence_parallel_gradients`` after backward); attention and MLP gather the sequence once
  on entry and reduce-scatter on exit.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from torch import nn

from ..plan import (
    Chain,
    ColumnParallel,
    Plan,
    Replicate,
    ReplicatedWithGradAllReduce,
    RowParallel,
    SetAttributes,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)
from ..topology import ParallelGroup
from .attention_styles import attention_projection_styles, local_kv_groups
from .common import (
    check_model,
    never_drops,
    require_supported_transformers,
    sequence_parallel_entry,
    sequence_parallel_exit,
    tensor_parallel_block_style,
    with_and_without_prefix,
)
from .family import Family
from .hf_integration import finish_hf_model
from .losses import use_vocab_parallel_causal_lm_loss

# HF decoders are batch-first: [batch, seq, hidden].
SEQUENCE_DIM = 1

NAME = "Llama-family"   # for messages
SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
LAYER = "model.layers.*."


def decoder_plan(sequence_parallel: bool = False, make_vocab_size_divisible_by: int = 1,
                 pad_heads: bool = True) -> Plan:
    """``pad_heads``: when TP does not divide the attention heads, add zero heads (with a logged warning naming the
    count) instead of refusing the model."""
    require_supported_transformers(NAME)
    sp = dict(sequence_parallel=sequence_parallel, sequence_dimension=SEQUENCE_DIM)
    return build_decoder_plan(NAME, SUPPORTED, lambda config: {"intermediate_size": config.intermediate_size},
                              lambda model, group: dense_mlp_styles(LAYER + "mlp", sp),
                              sequence_parallel, make_vocab_size_divisible_by, pad_heads)


def dense_mlp_styles(mlp: str, sp: dict) -> dict:
    """The styles of a gated MLP named ``mlp``: gate and up column-parallel behind one entry region, down
    row-parallel."""
    entry = dict(input_in_tensor_parallel_region=True)  # the block's wrapper opened the region already
    return {mlp: tensor_parallel_block_style("nxdtp_tp_mlp", SEQUENCE_DIM, sp["sequence_parallel"], never_drops),
            mlp + ".gate_proj": ColumnParallel(**entry), mlp + ".up_proj": ColumnParallel(**entry),
            mlp + ".down_proj": RowParallel(**sp)}


def build_decoder_plan(name: str, supported: Tuple[str, ...], sizes: Callable[[Any], dict],
                       mlp_styles: Callable[[nn.Module, ParallelGroup], dict], sequence_parallel: bool,
                       make_vocab_size_divisible_by: int, pad_heads: bool,
                       finalize: Optional[Callable[[nn.Module], None]] = None) -> Plan:
    """The plan of a Llama-shaped decoder: embeddings, attention, norms and LM head as for Llama, and the MLP styles
    ``mlp_styles(model, group)`` gives. ``sizes(config)``: the sizes TP must divide, beyond the heads'."""
    pad = dict(pad_to_multiple_of=make_vocab_size_divisible_by)
    styles = {"model.embed_tokens": VocabParallelEmbedding(**pad), "lm_head": VocabParallelLMHead(**pad)}
    if sequence_parallel:
        styles["model.layers.0"] = sequence_parallel_entry(SEQUENCE_DIM)
        for norm in (LAYER + "input_layernorm", LAYER + "post_attention_layernorm"):
            styles[norm] = Replicate(sequence_parallel=True)
        styles["model.norm"] = Chain((Replicate(sequence_parallel=True), sequence_parallel_exit(SEQUENCE_DIM)))

    def prepare(model: nn.Module, group: ParallelGroup) -> dict:
        check_model(model, name, supported, sizes(model.config), group)
        extra = _attention_styles(model, group, sequence_parallel, pad_heads)
        if "model.layers.0.self_attn.q_norm" in {name for name, _ in model.named_modules()}:
            extra.update({LAYER + "self_attn.q_norm": ReplicatedWithGradAllReduce(),
                          LAYER + "self_attn.k_norm": ReplicatedWithGradAllReduce()})
        extra.update(mlp_styles(model, group))
        return extra

    def finish(model: nn.Module) -> None:
        use_vocab_parallel_causal_lm_loss(model)
        if finalize is not None:
            finalize(model)
        finish_hf_model(model)

    return Plan(styles=styles, prepare=prepare, finalize=finish)


def _attention_styles(model: nn.Module, group: ParallelGroup, sequence_parallel: bool, pad_heads: bool) -> dict:
    """The styles of the attention block and its projections for this model's head counts."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    projections = attention_projection_styles(
        type(model).__name__, heads, kv_heads, head_dim, group.size, pad_heads,
        ColumnParallel(input_in_tensor_parallel_region=True),   # the block's wrapper opened the region already
        RowParallel(sequence_parallel=sequence_parallel, sequence_dimension=SEQUENCE_DIM))
    styles = {LAYER + "self_attn." + name: style for name, style in zip(("q_proj", "k_proj", "v_proj", "o_proj"),
                                                                         projections)}
    # Each rank runs its share of the query heads against the KV heads (or copies of them) it holds.
    styles[LAYER + "self_attn"] = Chain((
        SetAttributes((("num_key_value_groups", local_kv_groups(heads, kv_heads, group.size)),)),
        tensor_parallel_block_style("nxdtp_tp_attention", SEQUENCE_DIM, sequence_parallel, _attention_drops)))
    return styles


def _attention_drops(attention: nn.Module) -> bool:
    return attention.training and getattr(attention, "attention_dropout", 0.0) > 0


def checkpoint_keys(name: str):
    """Checkpoint keys that may hold parameter ``name``: as named, or without / with the base model's prefix."""
    return with_and_without_prefix(name, "model.")


FAMILY = Family(NAME, SUPPORTED, decoder_plan, checkpoint_keys)

"""Tensor-parallel plan for Hugging Face GPT-2: GPT2Model and GPT2LMHeadModel.

GPT-2 projects with HF's ``Conv1D``, whose weight is ``[in_features, out_features]`` (the transpose of ``nn.Linear``'s):

* ``attn.c_attn`` (fused Q, K, V: ``[hidden, 3 * hidden]``) is column-parallel with stride 3: each rank keeps its
  1/tp of Q, of K and of V, so the fused output splits into this rank's heads; nothing is gathered. When TP does not
  divide the heads, Q, K and V each get zero heads at their end, and ``c_proj`` the matching zero columns.
  ``attn.c_proj`` is row-parallel. ``mlp.c_fc`` is column-parallel, ``mlp.c_proj`` row-parallel. One all-reduce forward
  and one backward per block.
* The parallel layers keep Conv1D's weight layout, so state dicts, merged checkpoints and ``from_pretrained_sharded``
  read and write HF's shapes; the forward uses the transposed view.
* ``transformer.wte`` and ``lm_head`` are vocab-parallel and stay tied; the loss is the vocab-parallel causal-LM loss.
  ``wpe``, the LayerNorms and the dropouts outside attention are replicated.
* Attention dropout draws per-rank masks (each rank holds other heads); the residual dropout after ``c_proj``, which
  HF applies inside the attention module, acts on replicated activations and draws the same mask on every rank.
* ``sequence_parallel=True``: the hidden states are split along the sequence from the first block's input to
  ``ln_f``'s output; the LayerNorms run on shards (sequence-parallel parameters), attention and MLP gather the sequence
  on entry and reduce-scatter on exit, and the residual and MLP dropouts, now on each rank's own tokens, draw per-rank
  masks.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .. import mappings
from ..plan import (
    TENSOR_PARALLEL,
    Chain,
    ColumnParallel,
    Effect,
    Plan,
    Replicate,
    RowParallel,
    SetAttributes,
    Style,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    WrapForward,
    call_with_parameters_as,
    wrap_forward,
)
from ..topology import ParallelGroup
from .attention_styles import attention_projection_styles
from .common import (
    check_model,
    dropping,
    maybe_forked,
    never_drops,
    require_supported_transformers,
    sequence_parallel_entry,
    sequence_parallel_exit,
    splits_sequence,
    tensor_parallel_block,
    with_and_without_prefix,
)
from .family import Family
from .hf_integration import finish_hf_model
from .losses import use_vocab_parallel_causal_lm_loss

NAME = "GPT-2"   # for messages
SUPPORTED = ("GPT2Model", "GPT2LMHeadModel")
SEQUENCE_DIM = 1
BLOCK = "*h.*."


@dataclasses.dataclass(frozen=True)
class Conv1DParallel(Style):
    """HF ``Conv1D`` → the parallel layer ``linear_style`` makes from the equivalent ``nn.Linear``, with the weight
    kept in Conv1D's ``[in, out]`` layout (and its spec describing that layout)."""

    linear_style: Style  # ColumnParallel(...) or RowParallel(...)
    expects = nn.Module

    @property
    def effect(self) -> Effect:
        return self.linear_style.effect

    def check(self, module: nn.Module, name: str) -> None:
        if getattr(module, "weight", None) is None or module.weight.dim() != 2 or type(module).__name__ != "Conv1D":
            raise TypeError(f"{type(self).__name__} applies to transformers' Conv1D, but '{name}' is "
                            f"{type(module).__name__}")

    def convert(self, module: nn.Module, name: str, group: ParallelGroup) -> nn.Module:
        in_features, out_features = module.weight.shape
        linear = nn.Linear(in_features, out_features, bias=module.bias is not None, device="meta",
                           dtype=module.weight.dtype)
        linear.weight = nn.Parameter(module.weight.detach().t(), requires_grad=module.weight.requires_grad)
        if module.bias is not None:
            linear.bias = module.bias
        layer = self.linear_style.convert(linear, name, group)
        spec = layer.param_specs()["weight"]
        layer.weight = nn.Parameter(layer.weight.detach().t().contiguous(), requires_grad=layer.weight.requires_grad)
        layer.register_param_spec("weight", dataclasses.replace(
            spec, full_shape=tuple(reversed(spec.full_shape)), partition_dim=1 - spec.partition_dim,
            real_shape=tuple(reversed(spec.real_shape)) if spec.real_shape is not None else None))
        wrap_forward(layer, "nxdtp_conv1d_weight_layout", _with_conv1d_weight)
        return layer


def _with_conv1d_weight(forward, *args, **kwargs):
    return call_with_parameters_as(forward, torch.Tensor.t, *args, **kwargs)  # a 1-D bias is its own transpose


def gpt2_plan(sequence_parallel: bool = False, make_vocab_size_divisible_by: int = 1, pad_heads: bool = True) -> Plan:
    """``pad_heads``: when TP does not divide the attention heads, add zero heads to each of Q, K and V and to
    ``c_proj`` (with a logged warning naming the count) instead of refusing the model."""
    require_supported_transformers(NAME)
    pad = dict(pad_to_multiple_of=make_vocab_size_divisible_by)
    entry = dict(input_in_tensor_parallel_region=True)  # the block's wrapper opened the region already
    sp = dict(sequence_parallel=sequence_parallel, sequence_dimension=SEQUENCE_DIM)
    if sequence_parallel:
        mlp = WrapForward("nxdtp_tp_mlp_sp", _sequence_parallel_mlp, opens=TENSOR_PARALLEL)
    else:
        mlp = WrapForward("nxdtp_tp_mlp", _MLP, opens=TENSOR_PARALLEL)
    styles = {
        "*wte": VocabParallelEmbedding(**pad),
        BLOCK + "attn.c_attn": Conv1DParallel(ColumnParallel(stride=3, **entry)),
        BLOCK + "attn.c_proj": Conv1DParallel(RowParallel(**sp)),
        BLOCK + "mlp": mlp,
        BLOCK + "mlp.c_fc": Conv1DParallel(ColumnParallel(**entry)),
        BLOCK + "mlp.c_proj": Conv1DParallel(RowParallel(**sp)),
    }
    if sequence_parallel:
        styles["*h.0"] = sequence_parallel_entry(SEQUENCE_DIM)
        for norm in (BLOCK + "ln_1", BLOCK + "ln_2"):
            styles[norm] = Replicate(sequence_parallel=True)
        styles["*ln_f"] = Chain((Replicate(sequence_parallel=True), sequence_parallel_exit(SEQUENCE_DIM)))

    def prepare(model: nn.Module, group: ParallelGroup) -> dict:
        _validate(model, group)
        config = model.config
        heads, head_dim = config.n_head, config.n_embd // config.n_head
        q, _, _, o = attention_projection_styles(type(model).__name__, heads, heads, head_dim, group.size, pad_heads,
                                                 ColumnParallel(stride=3, **entry), RowParallel(**sp))
        local_heads = q.padded_heads // group.size
        if sequence_parallel:
            attention = WrapForward("nxdtp_tp_attention_sp", _sequence_parallel_attention, opens=TENSOR_PARALLEL)
        else:
            attention = WrapForward("nxdtp_tp_attention", _tensor_parallel_attention, opens=TENSOR_PARALLEL)
        extra = {
            # c_attn's local output is this rank's Q, K and V heads, zero heads included.
            BLOCK + "attn": Chain((SetAttributes((("num_heads", local_heads), ("split_size", local_heads * head_dim))),
                                   attention)),
            # c_attn is Q|K|V fused: each part gets its own zero heads (three padding groups), then the stride-3 split.
            BLOCK + "attn.c_attn": Conv1DParallel(dataclasses.replace(q, padded_heads=3 * q.padded_heads, groups=3)),
            BLOCK + "attn.c_proj": Conv1DParallel(o),
        }
        if hasattr(model, "lm_head"):
            extra["lm_head"] = VocabParallelLMHead(**pad)
        return extra

    def finalize(model: nn.Module) -> None:
        if hasattr(model, "lm_head"):
            use_vocab_parallel_causal_lm_loss(model)
        finish_hf_model(model)

    return Plan(styles=styles, prepare=prepare, finalize=finalize)


def _validate(model: nn.Module, group: ParallelGroup) -> None:
    config = model.config
    inner = config.n_inner if config.n_inner is not None else 4 * config.n_embd
    check_model(model, NAME, SUPPORTED, {"n_inner": inner}, group)
    if config.add_cross_attention:
        raise ValueError(f"{type(model).__name__} with add_cross_attention=True is not supported: use a decoder-only "
                         "GPT-2")


def _attention_drops(attention: nn.Module) -> bool:
    return attention.training and attention.attn_dropout.p > 0


def _tensor_parallel_attention(forward, hidden_states, *args, **kwargs):
    attention = forward.__self__
    hidden_states = mappings.copy_to_tensor_model_parallel_region(hidden_states)
    # HF applies the residual dropout inside the attention module, after c_proj's all-reduce: that one acts on
    # replicated activations and must draw the same mask on every rank, so it runs outside the RNG fork.
    residual_dropout = attention.resid_dropout
    attention._modules["resid_dropout"] = nn.Identity()
    try:
        output, weights = maybe_forked(_attention_drops(attention), forward, hidden_states, *args, **kwargs)
    finally:
        attention._modules["resid_dropout"] = residual_dropout
    return residual_dropout(output), weights


_MLP = tensor_parallel_block(SEQUENCE_DIM, False, never_drops)
# With sequence parallelism every dropout in a block acts on this rank's heads or this rank's tokens: per-rank masks.
_SEQUENCE_PARALLEL_BLOCK = tensor_parallel_block(SEQUENCE_DIM, True, dropping)


def _sequence_parallel_attention(forward, *args, **kwargs):
    """The attention block of a sequence-parallel model; run on the whole sequence (generation_mode), exactly the
    block of a model without sequence parallelism, whose residual dropout acts on replicated activations and so must
    draw the same mask on every rank."""
    if splits_sequence(forward.__self__):
        return _SEQUENCE_PARALLEL_BLOCK(forward, *args, **kwargs)
    return _tensor_parallel_attention(forward, *args, **kwargs)


def _sequence_parallel_mlp(forward, *args, **kwargs):
    """The MLP block of a sequence-parallel model; on the whole sequence, the one without (its dropout replicated)."""
    if splits_sequence(forward.__self__):
        return _SEQUENCE_PARALLEL_BLOCK(forward, *args, **kwargs)
    return _MLP(forward, *args, **kwargs)


def checkpoint_keys(name: str):
    """Checkpoint keys that may hold parameter ``name``: with or without the ``transformer.`` prefix (HF's own GPT-2
    checkpoints store the base model's keys without it)."""
    return with_and_without_prefix(name, "transformer.")


FAMILY = Family(NAME, SUPPORTED, gpt2_plan, checkpoint_keys)

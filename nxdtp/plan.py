"""Shard an existing model in place by a plan: module-name patterns mapped to parallel styles.

A plan names *what* is split; the styles know *how*. Converting a dense ``nn.Linear`` or ``nn.Embedding`` reslices its
existing weights into the parallel layer, so a converted model computes exactly what the dense one did. It works on the
meta device too (the slices are meta tensors, to be loaded later), so no rank has to materialise the full model.

Wiring is styles too: ``WrapForward`` (a forward wrapper: the region a block's projections share, where a
sequence-parallel region starts and ends), ``SetAttributes`` (the heads a rank runs), ``Chain`` (several on one
module). Every style declares its ``Effect`` (the style protocol below). A plan's ``prepare`` hook returns the styles
that depend on the model; its ``finalize`` hook keeps only what concerns the model as a whole, such as its loss. The
class swaps behind the wrappers are in ``nxdtp.forward_wrappers``; they keep parameter names, so HF state-dict keys stay
as they were.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import inspect
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from . import comm, mappings
from .agreement import RankLocalBuffers
from .forward_wrappers import (  # noqa: F401 - also nxdtp.plan's names, where plans and users import them
    add_mixin,
    call_with_parameters,
    call_with_parameters_as,
    has_own_forward,
    spec_owning_class,
    wrap_forward,
    wrapper_factory,
    wrapper_name_of,
)
from .layers import ColumnParallelLinear, LayerNorm, ParallelEmbedding, RowParallelLinear
from .record import note_of, read_note
from .replaced_parameters import record_replaced, weak_parameters
from .rounding import round_up
from .spec import ParamSpec, ShardedModule
from .storage import owning
from .topology import ParallelGroup, tensor_parallel_group
from .utils import retie_parameters, tied_parameter_names


def padded_size(size: int, multiple: int) -> int:
    """``size`` rounded up to a multiple of ``multiple`` (kept under this name for callers of nxdtp.plan)."""
    return round_up(size, multiple)


# ---- the style protocol ----------------------------------------------------------------------------------------------
# What a style may do to the module a plan applies it to is declared, not left to its code: ``Style.effect`` says
# whether it replaces the module or changes it in place, which regions it opens and closes, and which ParamSpec fields
# it records for checkpoints. ``parallelize`` acts on the first (only replacing styles must name leaves), tests check
# the declarations against what the styles do, and ``describe`` prints them for a model.

TENSOR_PARALLEL = "tensor-parallel"      # activations split by features / heads across the TP group
SEQUENCE_PARALLEL = "sequence-parallel"  # activations split along the sequence across the TP group


@dataclasses.dataclass(frozen=True)
class Effect:
    """What a style does to the module it is applied to.

    ``replaces``: ``convert`` returns a new module (a parallel layer) that takes the old one's place; such a style
    must name a leaf, as its conversion would drop converted children. Otherwise it changes the module in place (a
    forward wrapper, attributes) and may name a parent of other matches: it is applied after them.
    ``opens`` / ``closes``: the region entered at the module's input / left at its output (``TENSOR_PARALLEL``,
    ``SEQUENCE_PARALLEL``, or ``""`` for none). A column-parallel layer reading a region its block opened opens none.
    ``records``: the ParamSpec fields beyond the split itself (``partition_dim``, ``num_partitions``) that the
    converted parameters carry, so checkpoints can merge and reshard them.
    """

    replaces: bool
    opens: str = ""
    closes: str = ""
    records: Tuple[str, ...] = ()


class Style:
    """The style protocol. A style is a frozen dataclass (plans compare and print them) with:

    * ``expects``: the module class it applies to (checked for every match before anything changes);
    * ``check(module, name)``: further refusals before anything changes (optional);
    * ``convert(module, name, group)``: the module to put in its place (the same object for in-place styles), with
      ``group`` the tensor-parallel group the plan is applied over, passed in by ``parallelize``;
    * ``effect``: the declared ``Effect``.

    ``parallelize`` refuses any other object as a style, naming its pattern.
    """

    expects: type = nn.Module

    def check(self, module: nn.Module, name: str) -> None:
        """Refuse ``module`` before anything changes; the default accepts it."""

    def convert(self, module: nn.Module, name: str, group: ParallelGroup) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} is a Style without a convert method")

    @property
    def effect(self) -> Effect:
        raise NotImplementedError(f"{type(self).__name__} is a Style without a declared effect")


def _require_style(style, where: str) -> None:
    """Refuse ``style`` (named by ``where``) unless it follows the protocol."""
    if not isinstance(style, Style):
        raise TypeError(f"{where} is {type(style).__name__}, not an nxdtp.plan.Style: a style subclasses Style, with "
                        "convert(module, name, group) and a declared effect (docs/wrapping_hf_models.md, \"The style "
                        "protocol\")")


# ---- styles ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ColumnParallel(Style):
    """``nn.Linear`` → ColumnParallelLinear (output features split)."""

    expects = nn.Linear
    gather_output: bool = False
    stride: int = 1
    input_in_tensor_parallel_region: bool = False
    sequence_parallel: bool = False
    sequence_dimension: int = 0

    @property
    def effect(self) -> Effect:
        return Effect(replaces=True, opens="" if self.input_in_tensor_parallel_region else TENSOR_PARALLEL,
                      closes=TENSOR_PARALLEL if self.gather_output else "", records=("stride",))

    def convert(self, module: nn.Module, name: str, group: ParallelGroup) -> nn.Module:
        _expect(module, nn.Linear, self, name)
        layer = ColumnParallelLinear(
            module.in_features, module.out_features, bias=module.bias is not None, gather_output=self.gather_output,
            dtype=module.weight.dtype, device="meta", stride=self.stride,
            sequence_parallel_enabled=self.sequence_parallel, sequence_dimension=self.sequence_dimension,
            input_in_tensor_parallel_region=self.input_in_tensor_parallel_region)
        _load_shards(layer, module, group)
        return layer


@dataclasses.dataclass(frozen=True)
class RowParallel(Style):
    """``nn.Linear`` → RowParallelLinear (input features split; output all-reduced or reduce-scattered)."""

    expects = nn.Linear
    input_is_parallel: bool = True
    sequence_parallel: bool = False
    sequence_dimension: int = 0

    @property
    def effect(self) -> Effect:
        return Effect(replaces=True, opens="" if self.input_is_parallel else TENSOR_PARALLEL, closes=TENSOR_PARALLEL)

    def convert(self, module: nn.Module, name: str, group: ParallelGroup) -> nn.Module:
        _expect(module, nn.Linear, self, name)
        layer = RowParallelLinear(
            module.in_features, module.out_features, bias=module.bias is not None,
            input_is_parallel=self.input_is_parallel, dtype=module.weight.dtype, device="meta",
            sequence_parallel_enabled=self.sequence_parallel, sequence_dimension=self.sequence_dimension)
        _load_shards(layer, module, group)
        return layer


# Split by vocabulary: a replicated input of token ids in, a replicated output out (the layer all-reduces it).
_VOCABULARY_RECORDS = ("real_shape", "pad_to_multiple_of", "vocabulary")


@dataclasses.dataclass(frozen=True)
class VocabParallelEmbedding(Style):
    """``nn.Embedding`` → ParallelEmbedding split by vocabulary, padded to a multiple of ``pad_to_multiple_of * tp``."""

    expects = nn.Embedding
    pad_to_multiple_of: int = 1
    effect = Effect(replaces=True, records=_VOCABULARY_RECORDS)

    def check(self, module: nn.Module, name: str) -> None:
        if has_own_forward(module, nn.Embedding):
            raise TypeError(f"'{name}' is {type(module).__name__}, an nn.Embedding with a forward of its own (e.g. a "
                            "scaled embedding); converting it to ParallelEmbedding would drop that: keep it replicated")

    def convert(self, module: nn.Module, name: str, group: ParallelGroup) -> nn.Module:
        _expect(module, nn.Embedding, self, name)
        layer = ParallelEmbedding(module.num_embeddings, module.embedding_dim, padding_idx=module.padding_idx,
                                  dtype=module.weight.dtype, device="meta", pad=True,
                                  pad_to_multiple_of=self.pad_to_multiple_of)
        _load_shards(layer, module, group)
        return layer


@dataclasses.dataclass(frozen=True)
class VocabParallelLMHead(Style):
    """``nn.Linear(hidden, vocab)`` → ColumnParallelLinear over the padded vocabulary, logits left vocab-parallel.

    A weight tied to a vocab-parallel embedding stays tied (``parallelize`` keeps the model's ties); the shard ranges
    agree because both pad the vocabulary the same way. Padded bias entries are zero; the loss excludes padded columns
    (parallel_cross_entropy's ``vocab_size``), and gathering the logits strips them.
    """

    expects = nn.Linear
    pad_to_multiple_of: int = 1
    # The logits stay split by vocabulary: the vocab-parallel loss reads them there.
    effect = Effect(replaces=True, opens=TENSOR_PARALLEL, records=_VOCABULARY_RECORDS)

    def convert(self, module: nn.Module, name: str, group: ParallelGroup) -> nn.Module:
        _expect(module, nn.Linear, self, name)
        padded = padded_size(module.out_features, self.pad_to_multiple_of * group.size)
        layer = ColumnParallelLinear(module.in_features, padded, bias=module.bias is not None, gather_output=False,
                                     dtype=module.weight.dtype, device="meta")
        _record_real_rows(layer, module.out_features, self.pad_to_multiple_of)
        _load_shards(layer, module, group)
        return layer


@dataclasses.dataclass(frozen=True)
class Replicate(Style):
    """Keep the module whole on every TP rank. With ``sequence_parallel`` its parameters are marked so their gradients
    are summed over TP (each rank normalises only its sequence shard): an ``nn.LayerNorm`` becomes nxdtp's LayerNorm,
    and any other norm (RMSNorm of any family) keeps its class and code and gains the spec of replicated,
    sequence-parallel parameters."""

    sequence_parallel: bool = False
    expects = nn.Module

    @property
    def effect(self) -> Effect:
        # With sequence_parallel an nn.LayerNorm is replaced by nxdtp's (another norm only gains specs in place).
        return Effect(replaces=self.sequence_parallel, records=("sequence_parallel",) if self.sequence_parallel else ())

    def check(self, module: nn.Module, name: str) -> None:
        nested = [n for n, _ in module.named_parameters() if "." in n]
        if self.sequence_parallel and nested:
            raise TypeError(f"Replicate(sequence_parallel=True) marks a module's own parameters, but '{name}' "
                            f"({type(module).__name__}) has nested ones {nested[:3]}: name the norm modules themselves")

    def convert(self, module: nn.Module, name: str, group: ParallelGroup) -> nn.Module:
        if not self.sequence_parallel:
            return module
        if not isinstance(module, nn.LayerNorm) or has_own_forward(module, nn.LayerNorm):
            return _with_sequence_parallel_params(module, group)
        layer = LayerNorm(module.normalized_shape, eps=module.eps, elementwise_affine=module.elementwise_affine,
                          bias=module.bias is not None, sequence_parallel_enabled=True, device="meta",
                          dtype=module.weight.dtype if module.weight is not None else None)
        for param_name in ("weight", "bias"):
            if getattr(module, param_name, None) is not None:
                _replace_param(layer, param_name, getattr(module, param_name).detach(), getattr(module, param_name))
        return layer


@dataclasses.dataclass(frozen=True)
class KVReplicatedColumnParallel(Style):
    """A K or V projection (``nn.Linear`` with ``heads * head_dim`` outputs) for tensor parallelism beyond its head
    count: every head is repeated ``replicas`` times, then the outputs are split column-parallel, so each rank holds the
    KV heads its query heads attend with (NxD's ``kv_size_multiplier``). The copies' gradients are summed in backward,
    so copies on different ranks stay equal; the gradient norm counts each once; checkpoints merge to the dense
    projection and reshard to any degree. With ``replicas=1`` it is a plain column-parallel split whose spec still
    records the head size, so a checkpoint can later be resharded to a degree that needs copies."""

    head_dim: int
    replicas: int
    input_in_tensor_parallel_region: bool = True
    expects = nn.Linear

    @property
    def effect(self) -> Effect:
        return Effect(replaces=True, opens="" if self.input_in_tensor_parallel_region else TENSOR_PARALLEL,
                      records=("real_shape", "replicas", "replica_block"))

    def convert(self, module: nn.Module, name: str, group: ParallelGroup) -> nn.Module:
        block = dict(replicas=self.replicas, replica_block=self.head_dim)
        dense_spec = ParamSpec(full_shape=(module.out_features * self.replicas, module.in_features), partition_dim=0,
                               **block)
        expanded = nn.Linear(module.in_features, module.out_features * self.replicas, bias=module.bias is not None,
                             device="meta", dtype=module.weight.dtype)
        expanded.weight = nn.Parameter(dense_spec.expand_replicas(module.weight.detach()),
                                       requires_grad=module.weight.requires_grad)
        if module.bias is not None:
            expanded.bias = nn.Parameter(dense_spec.expand_replicas(module.bias.detach()),
                                         requires_grad=module.bias.requires_grad)
        layer = ColumnParallel(input_in_tensor_parallel_region=self.input_in_tensor_parallel_region).convert(
            expanded, name, group)
        for param_name, spec in layer.param_specs().items():
            dense = (module.out_features,) + tuple(spec.full_shape[1:])
            layer.register_param_spec(param_name, dataclasses.replace(spec, real_shape=dense, **block))
        if self.replicas > 1:
            wrap_forward(layer, f"nxdtp_kv_replicas_{self.replicas}x{self.head_dim}",
                         _kv_replica_forward(self.replicas, self.head_dim))
        return layer


@dataclasses.dataclass(frozen=True)
class HeadPadded(Style):
    """A projection whose attention heads TP does not divide: zero heads are added along ``dim`` (0: the output rows of
    Q/K/V, 1: the input columns of the output projection) until there are ``padded_heads``, then ``style`` splits it.
    With ``groups=1`` the zero heads follow all real heads; with ``groups=k`` (grouped-query attention, k KV heads)
    each of the k query groups gets its own zero heads at its end (``nxdtp.heads`` gives the counts).

    The output projection multiplies its input by a mask of this rank's real columns (a buffer, so the graph is the
    same on every rank): a zero query head that shares a real KV head still attends and produces values, and the mask
    keeps them out of the output and out of every gradient. Zero heads therefore stay zero in training. The specs
    record the real size, the head size and the groups, so merging strips the zero heads and resharding pads anew."""

    style: Style        # ColumnParallel(...) or RowParallel(...)
    head_dim: int
    padded_heads: int
    dim: int
    groups: int = 1
    expects = nn.Linear

    @property
    def effect(self) -> Effect:
        inner = self.style.effect
        return dataclasses.replace(inner, records=inner.records + ("real_shape", "pad_block", "pad_groups"))

    def convert(self, module: nn.Module, name: str, group: ParallelGroup) -> nn.Module:
        padding = dict(pad_block=self.head_dim, pad_groups=self.groups)
        dense_shape = tuple(module.weight.shape)
        full_shape = list(dense_shape)
        full_shape[self.dim] = self.padded_heads * self.head_dim
        weight_spec = ParamSpec(full_shape=tuple(full_shape), partition_dim=self.dim, real_shape=dense_shape, **padding)
        padded = nn.Linear(full_shape[1], full_shape[0], bias=module.bias is not None, device="meta",
                           dtype=module.weight.dtype)
        padded.weight = nn.Parameter(weight_spec.full_from_dense(module.weight.detach()),
                                     requires_grad=module.weight.requires_grad)
        if module.bias is not None:
            bias = module.bias.detach()
            if self.dim == 0:
                bias = ParamSpec(full_shape=(full_shape[0],), partition_dim=0, real_shape=tuple(bias.shape),
                                 **padding).full_from_dense(bias)
            padded.bias = nn.Parameter(bias, requires_grad=module.bias.requires_grad)
        layer = self.style.convert(padded, name, group)
        for param_name, spec in layer.param_specs().items():
            if spec.partition_dim == self.dim:
                dense = list(spec.full_shape)
                dense[spec.partition_dim] = dense_shape[self.dim]
                layer.register_param_spec(param_name, dataclasses.replace(spec, real_shape=tuple(dense), **padding))
        if self.dim == 1 and full_shape[1] != dense_shape[1]:
            _mask_padded_input_columns(layer, module.weight, group)
        return layer


def _mask_padded_input_columns(layer: nn.Module, like: torch.Tensor, group: ParallelGroup) -> None:
    spec = layer.param_specs()["weight"]
    local = spec.local_shape()[1]
    start = group.rank * local
    mask = torch.zeros(local, dtype=like.dtype, device="cpu" if like.is_meta else like.device)
    for position, length, dense_start in spec.dense_segments(start, start + local):
        if dense_start is not None:
            mask[position - start:position - start + length] = 1
    # Not persistent: it is derived from the spec, and state dicts stay as they were. Rank-local, so the broadcast of
    # replicated state must leave it alone.
    layer.register_buffer("nxdtp_real_columns", mask, persistent=False)
    note_of(layer, RankLocalBuffers).names = ("nxdtp_real_columns",)
    wrap_forward(layer, "nxdtp_mask_padded_heads", _forward_with_padded_heads_masked)


def _forward_with_padded_heads_masked(forward, input_, *args, **kwargs):
    mask = forward.__self__.nxdtp_real_columns
    return forward(input_ * mask.to(input_.dtype), *args, **kwargs)


@wrapper_factory   # one function per (replicas, block): wrap_forward keys its subclasses by wrapper name
def _kv_replica_forward(replicas: int, block: int) -> Callable:
    def forward_with_summed_copies(forward, *args, **kwargs):
        return call_with_parameters_as(
            forward, lambda p: mappings.sum_gradients_over_replicas(p, replicas, block), *args, **kwargs)

    return forward_with_summed_copies


@dataclasses.dataclass(frozen=True)
class ReplicatedWithGradAllReduce(Style):
    """Keep the module whole on every TP rank when it acts inside a TP region on this rank's share of the data (a
    per-head norm such as Qwen3's q_norm sees only this rank's heads): each rank then holds part of the parameters'
    gradient, and backward sums it over TP. The parameters enter the forward through a copy-to-TP region, so the sum
    happens in autograd itself, with no call to remember after backward (HF's ``replicated_with_grad_allreduce``)."""

    expects = nn.Module
    effect = Effect(replaces=False)

    def convert(self, module: nn.Module, name: str, group: ParallelGroup) -> nn.Module:
        wrap_forward(module, "nxdtp_replicated_with_grad_allreduce", _parameters_through_tp_region)
        return module


def _parameters_through_tp_region(forward, *args, **kwargs):
    # Identity forward, all-reduce of the gradient backward; the gradient flows on to the real parameter.
    return call_with_parameters_as(forward, mappings.copy_to_tensor_model_parallel_region, *args, **kwargs)


# ---- sequence-parallel gradients, summed inside backward -------------------------------------------------------------
# A replicated parameter applied to this rank's share of the sequence (a norm between SP regions, a row-parallel bias
# added after the reduce-scatter) gets only part of its gradient on each TP rank. Left to a call after backward
# (allreduce_sequence_parallel_gradients), a forgotten call lets the copies drift apart while the loss looks right.
# So the module's parameters enter its forward through an autograd region whose backward all-reduces their gradients
# over TP (one collective per module: a LayerNorm's weight and bias go together), before autograd accumulates them:
#
# * gradient accumulation: each micro-batch's contribution is summed before it is added to ``.grad``, and the sum is
#   linear, so any number of micro-batches gives the dense sum (an all-reduce of ``.grad`` after accumulation would
#   count earlier micro-batches tp times);
# * DDP and its ``no_sync``: DDP reads a gradient in its post-accumulate hook, when it is already whole. A sum queued
#   for the end of backward instead (``register_post_accumulate_grad_hook`` plus ``queue_callback``, which would bucket
#   all of them into one collective) would have to run after DDP's own end-of-backward callback writes the DP averages
#   back into ``.grad``, or be overwritten by it: two callbacks whose order nothing fixes. It would also miss
#   ``torch.autograd.grad``, which accumulates nothing;
# * activation checkpointing: the recompute runs this forward again, so its backward sums too;
# * XLA: the all-reduce is part of the backward graph, the same on every rank, and independent all-reduces may be
#   combined by the compiler; no host work.
# The cost is one small all-reduce per such module per backward (docs/performance.md measures it). The parameters'
# specs record it (``grad_allreduced_in_backward``), so allreduce_sequence_parallel_gradients, still called by NxD
# training scripts, leaves them alone instead of summing twice.

def sum_sequence_parallel_gradients_in_backward(module: nn.Module) -> bool:
    """Make ``module`` sum the gradients of its sequence-parallel parameters over TP inside backward (see above), and
    mark them so that ``allreduce_sequence_parallel_gradients`` skips them. Returns whether it had any. ``parallelize``
    does this for every module its plan converted."""
    if not isinstance(module, ShardedModule):
        return False
    specs = {name: spec for name, spec in module.param_specs().items() if spec.sequence_parallel}
    if not specs:
        return False
    for name, spec in specs.items():
        if not spec.grad_allreduced_in_backward:
            module.register_param_spec(name, dataclasses.replace(spec, grad_allreduced_in_backward=True))
    wrap_forward(module, "nxdtp_sequence_parallel_grads_in_backward", _forward_summing_sequence_parallel_grads)
    return True


def _forward_summing_sequence_parallel_grads(forward, *args, **kwargs):
    module = forward.__self__
    # Without autograd (eval, or the no-grad first pass of reentrant checkpointing) there is nothing to sum; at TP 1
    # nothing to sum with.
    if not torch.is_grad_enabled() or tensor_parallel_group().size == 1:
        return forward(*args, **kwargs)
    names = [name for name, spec in module.param_specs().items() if spec.grad_allreduced_in_backward
             and module._parameters.get(name) is not None and module._parameters[name].requires_grad]
    if not names:
        return forward(*args, **kwargs)
    summed = mappings.sum_gradients_over_tensor_parallel(*(module._parameters[name] for name in names))
    return call_with_parameters(forward, dict(zip(names, summed)), *args, **kwargs)


@dataclasses.dataclass(frozen=True)
class WrapForward(Style):
    """Make a module call ``wrapper(forward, *args, **kwargs)`` instead of its forward (``wrap_forward`` under
    ``wrapper_name``), in place. This is how a plan wires what no layer swap does: the region a block's projections
    share, where sequence parallelism starts and ends, dropout under the TP RNG fork. ``opens`` / ``closes`` declare
    the regions the wrapper enters and leaves. ``wrapper`` must be a module-level function or made by a
    ``wrapper_factory``, so the model pickles."""

    wrapper_name: str
    wrapper: Callable
    opens: str = ""
    closes: str = ""
    expects = nn.Module

    @property
    def effect(self) -> Effect:
        return Effect(replaces=False, opens=self.opens, closes=self.closes)

    def convert(self, module: nn.Module, name: str, group: ParallelGroup) -> nn.Module:
        wrap_forward(module, self.wrapper_name, self.wrapper)
        return module


@dataclasses.dataclass(frozen=True)
class SetAttributes(Style):
    """Set attributes of a module in place, from ``(name, value)`` pairs: what its own forward reads and TP changes,
    such as the number of heads a rank runs. Every attribute must exist already, so a plan naming the wrong module (or
    a transformers release that renamed one) fails before anything changes instead of setting an unread value."""

    attributes: Tuple[Tuple[str, object], ...]
    expects = nn.Module
    effect = Effect(replaces=False)

    def check(self, module: nn.Module, name: str) -> None:
        missing = [attribute for attribute, _ in self.attributes if not hasattr(module, attribute)]
        if missing:
            raise TypeError(f"SetAttributes sets {missing} on '{name}', but {type(module).__name__} has no such "
                            "attribute: the plan names the wrong module, or this transformers release calls it "
                            "something else")

    def convert(self, module: nn.Module, name: str, group: ParallelGroup) -> nn.Module:
        for attribute, value in self.attributes:
            setattr(module, attribute, value)
        return module


@dataclasses.dataclass(frozen=True)
class Chain(Style):
    """Several styles on one module, applied in order (a plan gives each module the first pattern that matches it):
    e.g. a final norm that is replicated with sequence-parallel parameters *and* ends the sequence-parallel region.
    Only the first may replace the module."""

    styles: Tuple[Style, ...]

    def __post_init__(self):
        for position, style in enumerate(self.styles):
            _require_style(style, f"Chain's style {position}")
        late = [type(style).__name__ for style in self.styles[1:] if style.effect.replaces]
        if late:
            raise ValueError(f"Chain: only the first style may replace the module, but {late} would replace what the "
                             "styles before it made")

    @property
    def expects(self) -> type:
        return self.styles[0].expects

    @property
    def effect(self) -> Effect:
        effects = [style.effect for style in self.styles]
        return Effect(replaces=effects[0].replaces, opens=next((e.opens for e in effects if e.opens), ""),
                      closes=next((e.closes for e in reversed(effects) if e.closes), ""),
                      records=tuple(r for e in effects for r in e.records))

    def check(self, module: nn.Module, name: str) -> None:
        for style in self.styles:
            style.check(module, name)

    def convert(self, module: nn.Module, name: str, group: ParallelGroup) -> nn.Module:
        for style in self.styles:
            module = style.convert(module, name, group)
        return module


# ---- the plan --------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Plan:
    """``styles`` maps fnmatch patterns over dotted module names (``"*.layer.*.attention.self.query"``) to styles; the
    first matching pattern wins. ``prepare`` validates the model before anything changes and may return more styles
    for this model (heads it has, norms only some variants have); the plan itself is never modified, so one plan can
    shard several models. ``finalize`` holds what no style can do, on the model as a whole (its loss, its HF
    integration) after the modules are converted. Each hook takes ``(model)`` or ``(model, group)``, the TP group."""

    styles: Dict[str, Style]
    prepare: Optional[Callable[..., Optional[Dict[str, Style]]]] = None
    finalize: Optional[Callable[..., None]] = None


def parallelize(model: nn.Module, plan: Plan, broadcast_replicated: bool = True) -> nn.Module:
    """Apply ``plan`` to ``model`` in place and return it.

    Weight ties that held before (e.g. MLM decoder and word embedding) hold after. With ``broadcast_replicated`` every
    replicated parameter and buffer is broadcast from TP rank 0, so TP ranks start identical even if they initialised
    the dense model differently. Sequence-parallel parameters of the converted modules have their gradients summed
    over TP inside backward (``sum_sequence_parallel_gradients_in_backward``): no call after backward is needed.
    """
    group = tensor_parallel_group()  # the one lookup: styles and hooks are given the group
    matched = _match(model, _styles_for(model, plan, group))
    before = weak_parameters(model)
    tie_groups = tied_parameter_names(model)
    converted_modules = []
    for name, style in matched:
        converted = style.convert(model.get_submodule(name), name, group)
        _set_submodule(model, name, converted)
        converted_modules.append(converted)
    _retie_after_conversion(model, tie_groups)
    record_replaced(before, model.parameters())
    if plan.finalize is not None:
        _call_hook(plan.finalize, model, group)
    # Only the modules this plan converted: sequence-parallel layers a model built itself keep NxD's contract (the
    # user's call after backward), which a second sum would break.
    for module in converted_modules:
        sum_sequence_parallel_gradients_in_backward(module)
    if broadcast_replicated:
        broadcast_replicated_state(model)
    return model


def _styles_for(model: nn.Module, plan: Plan, group: ParallelGroup) -> Dict[str, Style]:
    """The plan's styles with those its ``prepare`` adds for ``model`` (the plan itself is left as it is)."""
    styles = dict(plan.styles)
    if plan.prepare is not None:
        styles.update(_call_hook(plan.prepare, model, group) or {})
    for pattern, style in styles.items():
        _require_style(style, f"the plan's style for '{pattern}'")
    return styles


def _call_hook(hook: Callable, model: nn.Module, group: ParallelGroup):
    if len(inspect.signature(hook).parameters) >= 2:
        return hook(model, group)
    return hook(model)


def describe(model: nn.Module, plan: Plan) -> List[Tuple[str, str, Effect]]:
    """(module name, style, declared effect) for every module ``plan`` would change in ``model``, in the order
    ``parallelize`` applies them; nothing is changed (``prepare`` runs, as it only validates and adds styles)."""
    matched = _match(model, _styles_for(model, plan, tensor_parallel_group()))
    return [(name, repr(style), style.effect) for name, style in matched]


def _match(model: nn.Module, styles: Dict[str, Style]) -> List[Tuple[str, Style]]:
    """The (module name, style) pairs to apply, checked, in the order to apply them: modules that a style replaces
    first, then in-place changes from the innermost module out."""
    matched, used = [], set()
    for name, _ in model.named_modules():
        if not name:
            continue
        for pattern, style in styles.items():
            if fnmatch.fnmatchcase(name, pattern):
                matched.append((name, style))
                used.add(pattern)
                break
    unused = [p for p in styles if p not in used]
    if unused:
        raise ValueError(f"plan patterns {unused} match no module of {type(model).__name__}; "
                         f"module names look like {[n for n, _ in list(model.named_modules())[1:6]]}")
    # Check every match before converting any, so a bad plan leaves the model untouched.
    for name, style in matched:
        module = model.get_submodule(name)
        _expect(module, style.expects, style, name)
        style.check(module, name)
    # A replacing style's conversion would drop converted children, so it must name a leaf of the plan; a style that
    # changes its module in place may name a parent, and is applied after the children.
    replacing = [name for name, style in matched if style.effect.replaces]
    nested = [(a, b) for a in replacing for b, _ in matched if b.startswith(a + ".")]
    if nested:
        raise ValueError(f"plan matches nested modules {nested[0]}, and the style on '{nested[0][0]}' replaces it: "
                         "name leaf modules, or use a style that changes the module in place on the parent")
    return sorted(matched, key=lambda pair: (0, 0) if pair[1].effect.replaces else (1, -pair[0].count(".")))


def broadcast_replicated_state(model: nn.Module) -> None:
    """Make every replicated parameter and buffer equal to TP rank 0's copy (sharded parameters and rank-local
    buffers, which differ by rank on purpose, are left alone)."""
    group = tensor_parallel_group()
    if group.size == 1:
        return
    per_rank = {id(getattr(m, n)) for m in model.modules() if isinstance(m, ShardedModule)
                for n, spec in m.param_specs().items() if spec.is_sharded}
    # Parameters marked TP-sharded whose module holds no spec under their name: NxD attributes set by hand, and the
    # fused weight_qkv of GQAQKVColumnParallelLinear, whose specs are its parts'.
    per_rank |= {id(p) for p in model.parameters() if getattr(p, "tensor_model_parallel", False)}
    per_rank |= {id(getattr(m, n)) for m in model.modules() for n in read_note(m, RankLocalBuffers).names}
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            if id(tensor) in per_rank or tensor.device.type == "meta":
                continue
            tensor.copy_(comm.broadcast(tensor, group, src_group_rank=0))


# ---- conversion internals --------------------------------------------------------------------------------------------

def _with_sequence_parallel_params(module: nn.Module, group: ParallelGroup) -> nn.Module:
    """Give ``module`` a subclass of its own class that owns specs (state dicts and device moves keep them), and mark
    its direct parameters replicated and sequence-parallel."""
    base = type(module)
    if not isinstance(module, ShardedModule):
        module.__class__ = spec_owning_class(base)
    for name, param in module.named_parameters(recurse=False):
        module.register_param_spec(name, ParamSpec(full_shape=tuple(param.shape), num_partitions=group.size,
                                                   sequence_parallel=True))
    return module


def _expect(module: nn.Module, kind: type, style, name: str) -> None:
    if not isinstance(module, kind):
        again = (": it is sharded already (was the model parallelized before? shard a fresh dense model)"
                 if isinstance(module, ShardedModule) else "")
        raise TypeError(f"{type(style).__name__} applies to {kind.__name__}, but '{name}' is "
                        f"{type(module).__name__}{again}")


def _replace_param(layer: nn.Module, name: str, value: torch.Tensor, like: torch.Tensor) -> None:
    setattr(layer, name, nn.Parameter(owning(value), requires_grad=like.requires_grad))
    if isinstance(layer, ShardedModule):
        layer.reattach_spec_attributes()


def _load_shards(layer: ShardedModule, dense: nn.Module, group: ParallelGroup) -> None:
    """Give every parameter of ``layer`` this rank's piece of ``dense``'s parameter of the same name, as the layer's
    spec lays it out (padding, stride)."""
    for name, spec in layer.param_specs().items():
        source = getattr(dense, name, None)
        if source is not None:
            _replace_param(layer, name, spec.shard(source.detach(), group.rank), source)


def _record_real_rows(layer: ColumnParallelLinear, real_rows: int, pad_to_multiple_of: int) -> None:
    """Record the unpadded vocabulary and its padding rule in the LM head's specs, so merged checkpoints strip the
    padding and resharded ones pad it as the head is built at the new degree."""
    layer.real_output_size = real_rows
    for name, spec in layer.param_specs().items():
        layer.register_param_spec(name, dataclasses.replace(spec, real_shape=(real_rows,) + tuple(spec.full_shape[1:]),
                                                            pad_to_multiple_of=pad_to_multiple_of, vocabulary=True))


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def _retie_after_conversion(model: nn.Module, tie_groups: List[List[str]]) -> None:
    """Re-point tied names at one parameter, preferring a converted (sharded) one as the owner."""
    for names in tie_groups:
        present = [n for n in names if _has_parameter(model, n)]
        sharded = [n for n in present if getattr(model.get_parameter(n), "tensor_model_parallel", False)]
        owner = sharded[0] if sharded else present[0]
        retie_parameters(model, [[owner] + [n for n in present if n != owner]])


def _has_parameter(model: nn.Module, name: str) -> bool:
    try:
        model.get_parameter(name)
        return True
    except AttributeError:
        return False

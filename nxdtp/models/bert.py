"""Tensor-parallel plan for Hugging Face BERT (transformers 5): BertModel, BertForPreTraining, BertForMaskedLM and
BertForSequenceClassification.

Everything that can be split is split, Megatron-style:

* Q, K and V are column-parallel and share one entry region, and attention output is row-parallel: one all-reduce
  forward and one backward per attention block. Intermediate is column-parallel, output dense row-parallel: the same
  for the MLP. Each rank runs ``num_attention_heads / tp`` heads; when TP does not divide them, zero heads are added
  (``pad_heads``, as for the decoders: ``attention_styles.py``).
* The word embedding is vocab-parallel, padded to a multiple of ``make_vocab_size_divisible_by * tp``. The MLM decoder
  is vocab-parallel, tied to the embedding shard, with a sharded bias. Its logits are never gathered for the loss:
  ``outputs.loss`` comes from ``parallel_cross_entropy`` with the real vocabulary size, so padded columns take no part.
* Replicated: position and token-type embeddings, LayerNorms, pooler, NSP head, the MLM transform.
* ``sequence_parallel=True``: the encoder input is split along the sequence after the embeddings; LayerNorm and
  dropout between the blocks run on sequence shards; the encoder output is gathered (split in backward) before the
  pooler and MLM head.
* Dropout inside TP regions (attention probabilities, and sequence-parallel hidden dropout) runs under the RNG
  tracker's fork, so it differs across TP ranks; dropout in replicated regions uses the default generator, which
  ``model_parallel_xla_manual_seed`` seeds identically on all ranks.

Model outputs are HF's, with one difference: ``prediction_logits`` / ``logits`` of the MLM head are vocab-parallel
(``[batch, seq, padded_vocab / tp]``). ``gather_vocab_logits`` gives the full, unpadded logits.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import mappings
from ..checkpointing.index import TiedKeysNote
from ..loss_functions import parallel_cross_entropy
from ..plan import (
    SEQUENCE_PARALLEL,
    Chain,
    ColumnParallel,
    Plan,
    Replicate,
    RowParallel,
    SetAttributes,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    WrapForward,
    parallelize,
    wrap_forward,
)
from ..record import note_of, read_note
from ..topology import ParallelGroup, data_parallel_group
from .activation_checkpointing import checkpoint_layers  # noqa: F401 - re-exported
from .attention_styles import attention_projection_styles
from .common import (  # noqa: F401 - re-exports
    attention_bias,
    dropping,
    gather_vocab_logits,
    maybe_forked,
    require_supported_transformers,
    tensor_parallel_block_style,
    with_and_without_prefix,
)
from .family import Family
from .hf_integration import finish_hf_model
from .losses import vocab_parallel_lm_loss

# HF BERT is batch-first: [batch, seq, hidden].
SEQUENCE_DIM = 1

SUPPORTED = ("BertModel", "BertForPreTraining", "BertForMaskedLM", "BertForSequenceClassification")


@dataclasses.dataclass(frozen=True)
class EncoderFamily:
    """What differs between BERT-structured encoders (BERT, RoBERTa): class names, the base model's attribute and the
    MLM decoder's module name. The plan and its wiring are shared."""

    name: str                  # "BERT", for messages
    class_prefix: str          # "Bert": names the entry point in messages (parallelize_bert)
    supported: tuple
    mlm_decoder: str           # module name of the MLM head's decoder Linear
    base_prefix: str           # "bert.": the base model's attribute in checkpoints
    # Keys under which checkpoints store tied tensors, where the name HF's _tied_weights_keys implies does not load in
    # every supported transformers release (see RoBERTa).
    tied_keys_to_store: tuple = ()


BERT = EncoderFamily("BERT", "Bert", SUPPORTED, "cls.predictions.decoder", "bert.")


def bert_plan(sequence_parallel: bool = False, make_vocab_size_divisible_by: int = 1, pad_heads: bool = True) -> Plan:
    return encoder_plan(BERT, sequence_parallel, make_vocab_size_divisible_by, pad_heads)


def encoder_plan(family: EncoderFamily, sequence_parallel: bool = False, make_vocab_size_divisible_by: int = 1,
                 pad_heads: bool = True) -> Plan:
    """``pad_heads``: when TP does not divide the attention heads, add zero heads (with a logged warning naming the
    count) instead of refusing the model."""
    require_supported_transformers(family.name)
    sp = dict(sequence_parallel=sequence_parallel, sequence_dimension=SEQUENCE_DIM)
    layer = "*encoder.layer.*."
    styles = {
        "*embeddings.word_embeddings": VocabParallelEmbedding(pad_to_multiple_of=make_vocab_size_divisible_by),
        layer + "attention.self.query": ColumnParallel(input_in_tensor_parallel_region=True, **sp),
        layer + "attention.self.key": ColumnParallel(input_in_tensor_parallel_region=True, **sp),
        layer + "attention.self.value": ColumnParallel(input_in_tensor_parallel_region=True, **sp),
        layer + "attention.output.dense": RowParallel(**sp),
        layer + "intermediate.dense": ColumnParallel(**sp),
        layer + "output.dense": RowParallel(**sp),
    }
    if sequence_parallel:
        styles[layer + "attention.output.LayerNorm"] = Replicate(sequence_parallel=True)
        styles[layer + "output.LayerNorm"] = Replicate(sequence_parallel=True)
        # Both output blocks (attention's and the MLP's): hidden dropout on this rank's tokens draws its own mask.
        styles[layer + "output"] = WrapForward("nxdtp_sequence_parallel_dropout", _under_tp_rng_when_dropping)
        styles["*encoder"] = WrapForward("nxdtp_sequence_parallel_encoder", _sequence_parallel_encoder,
                                         opens=SEQUENCE_PARALLEL, closes=SEQUENCE_PARALLEL)

    def prepare(model: nn.Module, group: ParallelGroup) -> dict:
        _validate(family, model, group)
        config = model.config
        heads, head_size = config.num_attention_heads, config.hidden_size // config.num_attention_heads
        projections = attention_projection_styles(
            type(model).__name__, heads, heads, head_size, group.size, pad_heads,
            ColumnParallel(input_in_tensor_parallel_region=True, **sp), RowParallel(**sp))
        extra = {layer + name: style for name, style in
                 zip(("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"),
                     projections)}
        local_heads = projections[0].padded_heads // group.size
        extra[layer + "attention.self"] = Chain((
            SetAttributes((("num_attention_heads", local_heads), ("all_head_size", local_heads * head_size))),
            tensor_parallel_block_style("nxdtp_tp_attention", SEQUENCE_DIM, sequence_parallel, _attention_dropping)))
        if any(name == family.mlm_decoder for name, _ in model.named_modules()):
            extra[family.mlm_decoder] = VocabParallelLMHead(pad_to_multiple_of=make_vocab_size_divisible_by)
        return extra

    def finalize(model: nn.Module) -> None:
        if any(name == family.mlm_decoder for name, _ in model.named_modules()):
            _use_vocab_parallel_loss(family, model)
        finish_hf_model(model)

    return Plan(styles=styles, prepare=prepare, finalize=finalize)


def parallelize_bert(model: nn.Module, *, sequence_parallel: bool = False, make_vocab_size_divisible_by: int = 1,
                     broadcast_replicated: bool = True, pad_heads: bool = True) -> nn.Module:
    """``nxdtp.models.parallelize_model`` for a BERT model, under the name NxD's BERT tutorials use: shard it in place
    with the BERT plan and return it."""
    return parallelize(model, bert_plan(sequence_parallel, make_vocab_size_divisible_by, pad_heads),
                       broadcast_replicated=broadcast_replicated)


# ---- validation ------------------------------------------------------------------------------------------------------

def _validate(family: EncoderFamily, model: nn.Module, group: ParallelGroup) -> None:
    name = type(model).__name__
    entry = f"parallelize_{family.class_prefix.lower()}"
    if name not in family.supported:
        raise TypeError(f"{entry} supports {list(family.supported)}, not {name}")
    config = model.config
    if config.intermediate_size % group.size != 0:
        raise ValueError(f"{family.name} intermediate_size={config.intermediate_size} is not divisible by "
                         f"tensor_model_parallel_size={group.size}")
    if config.is_decoder or getattr(config, "add_cross_attention", False):
        raise ValueError(f"{entry} supports encoder {family.name} only (config.is_decoder=False, no cross-attention)")


# ---- wiring ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class EncoderForwardNote:
    """On an encoder model: its class's forward signature, for the loss wrapper to bind the user's arguments."""
    signature: Optional[inspect.Signature] = None


def _use_vocab_parallel_loss(family: EncoderFamily, model: nn.Module) -> None:
    """The MLM (and NSP) loss on the vocab-parallel logits, in the model's own forward: what no module style can do."""
    if family.tied_keys_to_store:
        note_of(model, TiedKeysNote).keys = family.tied_keys_to_store
    note_of(model, EncoderForwardNote).signature = inspect.signature(type(model).forward)
    wrap_forward(model, "nxdtp_vocab_parallel_loss", _vocab_parallel_loss)


def _attention_dropping(attention: nn.Module) -> bool:
    return attention.training and attention.dropout.p > 0


def _under_tp_rng_when_dropping(forward, *args, **kwargs):
    # Hidden dropout on a sequence shard: each rank owns different tokens, so each draws its own mask.
    return maybe_forked(dropping(forward.__self__), forward, *args, **kwargs)


def _sequence_parallel_encoder(forward, hidden_states, *args, **kwargs):
    hidden_states = mappings.scatter_to_sequence_parallel_region(hidden_states, sequence_dimension=SEQUENCE_DIM)
    output = forward(hidden_states, *args, **kwargs)
    # The pooler and the MLM head are replicated: gather the sequence; backward only splits.
    output.last_hidden_state = mappings.gather_from_sequence_parallel_region(
        output.last_hidden_state, to_model_parallel=False, sequence_dimension=SEQUENCE_DIM)
    return output


def _vocab_parallel_loss(forward, *args, **kwargs):
    """HF's loss views the logits as [-1, vocab_size], which vocab-parallel logits are not: compute it here instead.

    Extra keyword arguments ``mlm_denominator`` / ``nsp_denominator`` normalise the summed losses by global counts
    (masked tokens / sentences over all DP ranks and accumulation steps) instead of this batch's counts. The result is
    scaled by the DP size so that the DP-averaged gradient is the gradient of the global-batch mean loss.
    """
    self = forward.__self__
    mlm_denominator = kwargs.pop("mlm_denominator", None)
    nsp_denominator = kwargs.pop("nsp_denominator", None)
    signature = read_note(self, EncoderForwardNote).signature
    bound = signature.bind(self, *args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    arguments.pop("self")
    extra = arguments.pop("kwargs", {})
    # Trainer's global count of masked tokens, for the MLM loss; HF's encoder forward has no use for it.
    num_items_in_batch = extra.pop("num_items_in_batch", None)
    labels = arguments.pop("labels", None)
    next_sentence_label = arguments.pop("next_sentence_label", None)
    # HF's forward returns a tuple for return_dict=False (or config.return_dict=False); the loss is added to its
    # ModelOutput here, so ask for that and make the tuple at the end, as HF's @can_return_tuple does.
    return_dict = extra.pop("return_dict", arguments.pop("return_dict", None))
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    output = forward(**arguments, **extra, return_dict=True)

    is_pretraining = "next_sentence_label" in signature.parameters
    if labels is None or (is_pretraining and next_sentence_label is None):
        return output if return_dict else output.to_tuple()  # HF computes no loss in these cases either
    logits = output.prediction_logits if is_pretraining else output.logits
    dp = data_parallel_group().size
    mlm_loss = _mlm_loss(logits, labels, self.config.vocab_size, mlm_denominator, num_items_in_batch, dp)
    losses = {"mlm_loss": mlm_loss}
    loss = mlm_loss
    if is_pretraining:
        # In fp32 like the MLM loss, whatever the model's dtype.
        nsp = F.cross_entropy(output.seq_relationship_logits.float().view(-1, 2), next_sentence_label.view(-1),
                              reduction="none")
        nsp_loss = nsp.mean() if nsp_denominator is None else nsp.sum() * dp / nsp_denominator
        losses["nsp_loss"] = nsp_loss
        loss = mlm_loss + nsp_loss
    # Rebuild the output so the loss is its first key, as in HF: ``outputs[0]`` and ``outputs.to_tuple()[0]`` are the
    # loss (setting output["loss"] afterwards would append it after the logits).
    output = type(output)(loss=loss, **{k: v for k, v in output.items() if k != "loss"})
    if not return_dict:
        return output.to_tuple()  # HF's tuple: the extra mlm_loss / nsp_loss stay out of it
    for key, value in losses.items():
        output[key] = value  # after HF's keys, so positional access matches HF
    return output


def _mlm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, mlm_denominator, num_items_in_batch,
              dp: int):
    """The MLM loss: the mean over this batch's masked tokens; over Trainer's global count ``num_items_in_batch`` as
    the decoder families' loss takes it (Trainer multiplies the result by the DP size); or, with nxdtp's own
    ``mlm_denominator``, the sum over that global count times the DP size."""
    if mlm_denominator is None:
        return vocab_parallel_lm_loss(logits, labels, vocab_size, num_items_in_batch)
    per_token = parallel_cross_entropy(logits, labels, vocab_size=vocab_size, reduction="none")
    return per_token.sum() * dp / mlm_denominator


def local_head_count(model: nn.Module) -> Optional[int]:
    from transformers.models.bert import modeling_bert as hf

    for module in model.modules():
        if isinstance(module, hf.BertSelfAttention):
            return module.num_attention_heads
    return None


# ---- loading pretrained weights --------------------------------------------------------------------------------------

def checkpoint_keys(name: str, base_prefix: str = "bert."):
    """Checkpoint keys that may hold parameter ``name``: with or without the base-model prefix, and the legacy
    LayerNorm names (gamma/beta) of early BERT checkpoints."""
    variants = with_and_without_prefix(name, base_prefix)
    for variant in list(variants):
        if variant.endswith("LayerNorm.weight"):
            variants.append(variant[:-len("weight")] + "gamma")
        elif variant.endswith("LayerNorm.bias"):
            variants.append(variant[:-len("bias")] + "beta")
    return variants


def from_pretrained_sharded(model_dir: str, model_class=None, *, sequence_parallel: bool = False,
                            make_vocab_size_divisible_by: int = 1, dtype: torch.dtype = torch.float32, device="cpu",
                            config=None, pad_heads: bool = True) -> nn.Module:
    """Deprecated: ``nxdtp.models.from_pretrained_sharded``, which shards every supported family. This alias keeps its
    BERT defaults for one release: the config read as a BertConfig, and the class the first of
    ``config.architectures``, else BertForPreTraining."""
    import transformers

    from .hf_loading import read_config
    from .pretrained import build_from_pretrained, refuse_nxdtp_checkpoint

    warnings.warn("nxdtp.models.bert.from_pretrained_sharded is deprecated and goes in the next release: call "
                  "nxdtp.models.from_pretrained_sharded(model_dir, model_class=...), which shards every supported "
                  "family", DeprecationWarning, stacklevel=2)
    refuse_nxdtp_checkpoint(model_dir)
    config = config or read_config(model_dir, transformers.BertConfig)
    if model_class is None:
        architectures = getattr(config, "architectures", None) or ["BertForPreTraining"]
        model_class = getattr(transformers, architectures[0])
    plan = bert_plan(sequence_parallel, make_vocab_size_divisible_by, pad_heads)
    return build_from_pretrained(model_dir, model_class, config,
                                 lambda model: parallelize(model, plan, broadcast_replicated=False), checkpoint_keys,
                                 dtype=dtype, device=device)


FAMILY = Family(BERT.name, SUPPORTED, bert_plan, checkpoint_keys, oldest_transformers=(4, 26))

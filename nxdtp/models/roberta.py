"""Tensor-parallel plan for Hugging Face RoBERTa: RobertaModel, RobertaForMaskedLM and RobertaForSequenceClassification.

RoBERTa is BERT's encoder with another MLM head (``lm_head``: dense, LayerNorm, and a decoder tied to the word
embedding, with a bias tied to ``lm_head.bias``) and no NSP. BERT's encoder plan shards it as it shards BERT: Q/K/V
column-parallel behind one region, row-parallel output projections, a vocab-parallel word embedding and decoder, the
MLM loss on the vocab-parallel logits, and optional sequence parallelism; see ``nxdtp/models/bert.py``.
"""

from __future__ import annotations

from ..plan import Plan
from .bert import EncoderFamily, encoder_plan
from .bert import checkpoint_keys as _encoder_checkpoint_keys
from .family import Family

SUPPORTED = ("RobertaModel", "RobertaForMaskedLM", "RobertaForSequenceClassification")
# The MLM bias is one tensor under two names, lm_head.bias and lm_head.decoder.bias. transformers 4.48 loads it only
# from lm_head.decoder.bias (from a directory holding just lm_head.bias, as its own save_pretrained writes, it re-ties
# lm_head.bias to a freshly initialised decoder bias); every other supported release loads either name. So nxdtp's
# checkpoints, and the HF directories merged from them, store it as lm_head.decoder.bias.
ROBERTA = EncoderFamily("RoBERTa", "Roberta", SUPPORTED, "lm_head.decoder", "roberta.",
                        tied_keys_to_store=("lm_head.decoder.bias",))


def roberta_plan(sequence_parallel: bool = False, make_vocab_size_divisible_by: int = 1,
                 pad_heads: bool = True) -> Plan:
    return encoder_plan(ROBERTA, sequence_parallel, make_vocab_size_divisible_by, pad_heads)


def checkpoint_keys(name: str):
    return _encoder_checkpoint_keys(name, base_prefix=ROBERTA.base_prefix)


FAMILY = Family(ROBERTA.name, SUPPORTED, roberta_plan, checkpoint_keys)

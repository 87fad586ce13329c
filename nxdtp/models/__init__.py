"""Tensor parallelism for Hugging Face models: one entry point for every supported family.

``parallelize_model(model)`` shards an HF model in place with its family's plan; ``from_pretrained_sharded(model_dir)``
builds one from a local HF directory, each rank reading only its slices; ``gather_vocab_logits`` gives the full
logits of a vocab-parallel head. One file per family holds its plan (``bert.py``, ``roberta.py``, ``gpt2.py``, ``llama.py``); this module only maps
model classes to families. Importing it does not import transformers.
"""

from __future__ import annotations

from types import ModuleType
from typing import Dict, Optional

import torch
from torch import nn

from ..plan import parallelize
from . import bert, gpt2, llama, roberta
from .common import attention_bias, gather_vocab_logits

# HF class name -> its family's module, which lists the classes (SUPPORTED) and maps checkpoint keys
# (checkpoint_keys); _PLANS gives each family's plan(sequence_parallel, make_vocab_size_divisible_by).
_FAMILIES: Dict[str, ModuleType] = {name: family for family in (bert, roberta, gpt2, llama) for name in family.SUPPORTED}
_PLANS = {bert: bert.bert_plan, roberta: roberta.roberta_plan, gpt2: gpt2.gpt2_plan, llama: llama.decoder_plan}


def supported_models() -> list:
    return sorted(_FAMILIES)


def _family_of(model_class: type) -> ModuleType:
    family = _FAMILIES.get(model_class.__name__)
    if family is None:
        raise TypeError(f"nxdtp cannot shard {model_class.__name__}: supported models are {supported_models()}")
    return family


def parallelize_model(model: nn.Module, sequence_parallel: bool = False, make_vocab_size_divisible_by: int = 1,
                      broadcast_replicated: bool = True) -> nn.Module:
    """Shard a supported HF model in place over the tensor-parallel group and return it.

    ``make_vocab_size_divisible_by`` pads the vocabulary to a multiple of it times the TP size (merging strips the
    padding). ``broadcast_replicated`` makes replicated parameters equal to TP rank 0's. A model nxdtp cannot shard
    raises ``TypeError`` naming its class and the supported ones, before anything changes.
    """
    family = _family_of(type(model))
    return parallelize(model, _PLANS[family](sequence_parallel, make_vocab_size_divisible_by),
                       broadcast_replicated=broadcast_replicated)


def from_pretrained_sharded(model_dir: str, model_class: Optional[type] = None, sequence_parallel: bool = False,
                            make_vocab_size_divisible_by: int = 1, dtype: torch.dtype = torch.float32, device="cpu",
                            config=None) -> nn.Module:
    """Build a TP-sharded model from a local HF model directory; each rank reads only its own slices of the weights.

    ``model_class`` defaults to the first of ``config.architectures``; ``config`` replaces the directory's config.json
    (its shapes must match the checkpoint). The model is returned in eval mode, as HF does.
    """
    import transformers

    from .pretrained import build_from_pretrained

    if config is None:
        config = transformers.AutoConfig.from_pretrained(model_dir)
    if model_class is None:
        architectures = getattr(config, "architectures", None) or []
        if not architectures or not hasattr(transformers, architectures[0]):
            raise ValueError(f"{model_dir}: config.json names no known architecture ({architectures}); pass "
                             f"model_class=, one of {supported_models()}")
        model_class = getattr(transformers, architectures[0])
    family = _family_of(model_class)
    plan = _PLANS[family](sequence_parallel, make_vocab_size_divisible_by)
    return build_from_pretrained(model_dir, model_class, config,
                                 lambda model: parallelize(model, plan, broadcast_replicated=False),
                                 family.checkpoint_keys, dtype=dtype, device=device)


__all__ = ["parallelize_model", "from_pretrained_sharded", "gather_vocab_logits", "attention_bias",
           "supported_models"]

"""Tensor parallelism for Hugging Face models: one entry point for every supported family.

``parallelize_model(model)`` shards an HF model in place with its family's plan; ``from_pretrained_sharded(model_dir)``
builds one from a local HF directory, each rank reading only its slices; ``save_pretrained(model, dir)`` (also the
parallelized model's own ``save_pretrained``) writes the dense HF directory back; a parallelized model's forward returns
full-vocabulary logits, and ``vocab_parallel_logits(model)`` keeps its LM head's shards (``gather_vocab_logits`` gathers
them); ``generation_mode(model)`` runs a parallelized causal LM as ``model.generate``
does (full-vocabulary logits, the sequence not split). One file per family holds its plan (``bert.py``,
``roberta.py``, ``gpt2.py``, ``llama.py``), each ending in its ``Family`` record; ``registry.py`` lists them, and this
module maps a model class to its family there. Importing it does not import transformers.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..plan import Plan, parallelize
from . import hf_tp_plan
from .activation_checkpointing import checkpoint_layers
from .common import attention_bias, gather_vocab_logits, require_supported_transformers
from .generation import generation_mode
from .hf_saving import save_pretrained
from .logits import vocab_parallel_logits
from .registry import family_of, supported_models


def _plan_and_keys(model_class: type, config, sequence_parallel: bool, make_vocab_size_divisible_by: int,
                   pad_heads: bool = True):
    """(a function of the model giving its plan, the checkpoint-key function): the family's hand-written plan, else
    the one HF ships in the config (base_model_tp_plan), else a TypeError naming the class."""
    family = family_of(model_class.__name__)
    if family is not None:
        plan = family.plan(sequence_parallel, make_vocab_size_divisible_by, pad_heads)
        return (lambda model: plan), family.checkpoint_keys
    if hf_tp_plan.has_tp_plan(config):
        require_supported_transformers(hf_tp_plan.NAME)  # before from_pretrained_sharded reads anything
        return ((lambda model: hf_tp_plan.tp_plan(model, sequence_parallel, make_vocab_size_divisible_by, pad_heads)),
                hf_tp_plan.checkpoint_keys_for(model_class))
    raise TypeError(f"nxdtp cannot shard {model_class.__name__}: it has no hand-written plan (supported models are "
                    f"{supported_models()}) and its config has no base_model_tp_plan")


def parallelize_model(model: nn.Module, plan: Optional[Plan] = None, *, sequence_parallel: bool = False,
                      make_vocab_size_divisible_by: int = 1, broadcast_replicated: bool = True,
                      pad_heads: bool = True) -> nn.Module:
    """Shard a model in place over the tensor-parallel group and return it: the one way to shard a model.

    With ``plan=None`` the model's family picks the plan: the hand-written one of a supported HF family, else the one
    HF ships in the config (``base_model_tp_plan``, ``nxdtp.models.hf_tp_plan``); a model nxdtp cannot shard raises
    ``TypeError`` naming its class, before anything changes. Three options shape that plan: ``sequence_parallel``;
    ``make_vocab_size_divisible_by`` (the vocabulary padded to a multiple of it times the TP size; merging strips the
    padding); ``pad_heads`` (zero attention heads appended when TP does not divide them, with a logged warning;
    ``False`` makes that an error). A ``Plan`` of your own (``nxdtp.Plan``) is applied as it is, and those three
    options are then refused, as they would have no effect. ``broadcast_replicated`` makes replicated parameters equal
    to TP rank 0's.
    """
    if plan is not None:
        if not isinstance(plan, Plan):
            raise TypeError(f"parallelize_model: plan={plan!r} is not an nxdtp.Plan; pass a Plan, or None for the "
                            f"model family's plan")
        shaping = dict(sequence_parallel=(sequence_parallel, False),
                       make_vocab_size_divisible_by=(make_vocab_size_divisible_by, 1), pad_heads=(pad_heads, True))
        given = sorted(f"{name}={value!r}" for name, (value, default) in shaping.items() if value != default)
        if given:
            raise ValueError(f"parallelize_model: {', '.join(given)} shape a model family's plan and would be ignored "
                             f"with plan= given; build them into your Plan, or pass plan=None")
        return parallelize(model, plan, broadcast_replicated=broadcast_replicated)
    plan_of, _ = _plan_and_keys(type(model), getattr(model, "config", None), sequence_parallel,
                                make_vocab_size_divisible_by, pad_heads)
    return parallelize(model, plan_of(model), broadcast_replicated=broadcast_replicated)


def from_pretrained_sharded(model_dir: str, model_class: Optional[type] = None, *, sequence_parallel: bool = False,
                            make_vocab_size_divisible_by: int = 1, dtype: torch.dtype = torch.float32, device="cpu",
                            config=None, pad_heads: bool = True) -> nn.Module:
    """Build a TP-sharded model from a local HF model directory; each rank reads only its own slices of the weights.

    ``model_class`` defaults to the first of ``config.architectures``; ``config`` replaces the directory's config.json
    (its shapes must match the checkpoint). The model is returned in eval mode, as HF does.
    """
    import transformers

    from .hf_loading import read_config
    from .pretrained import build_from_pretrained, refuse_nxdtp_checkpoint

    refuse_nxdtp_checkpoint(model_dir)
    if config is None:
        config = read_config(model_dir)
    if model_class is None:
        architectures = getattr(config, "architectures", None) or []
        if not architectures or not hasattr(transformers, architectures[0]):
            raise ValueError(f"{model_dir}: config.json names no known architecture ({architectures}); pass "
                             f"model_class=, one of {supported_models()}")
        model_class = getattr(transformers, architectures[0])
    plan_of, checkpoint_keys = _plan_and_keys(model_class, config, sequence_parallel, make_vocab_size_divisible_by,
                                              pad_heads)
    return build_from_pretrained(model_dir, model_class, config,
                                 lambda model: parallelize(model, plan_of(model), broadcast_replicated=False),
                                 checkpoint_keys, dtype=dtype, device=device)


__all__ = ["parallelize_model", "from_pretrained_sharded", "gather_vocab_logits", "vocab_parallel_logits",
           "generation_mode", "attention_bias", "checkpoint_layers", "save_pretrained", "supported_models"]

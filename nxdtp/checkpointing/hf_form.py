"""The form transformers saves a model's weights in, where it differs from the tensors the model holds.

transformers 5 holds some tensors in another form than its files store (its weight conversions): a mixture of
experts keeps each layer's experts fused in one module (``mlp.experts.gate_up_proj``), and saves and reads them one
expert at a time (Mixtral's ``block_sparse_moe.experts.N.w1/w3/w2``, the Qwen models' ``mlp.experts.N.gate_proj/
up_proj/down_proj``), the form the Hub holds and transformers 4, vLLM and NxD's converters read. ``save_pretrained``
and ``nxdtp-merge`` write each dense tensor in that form, through transformers' own reversal
(``revert_weight_conversion``), so their directories are what the model's own ``save_pretrained`` writes.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

Layout = List[Tuple[str, torch.dtype, Tuple[int, ...]]]


class SavedForm:
    """How transformers saves the tensors of one model (a real model, or one built on the meta device)."""

    def __init__(self, model: nn.Module, revert):
        self._model, self._revert = model, revert

    @classmethod
    def of_model(cls, model: nn.Module) -> Optional["SavedForm"]:
        """The saved form of a transformers model; None where transformers converts nothing (or has no conversions:
        transformers 4), or for another kind of model."""
        try:
            from transformers import PreTrainedModel
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import revert_weight_conversion
        except ImportError:
            return None
        if not isinstance(model, PreTrainedModel) or not get_model_conversion_mapping(model, add_legacy=False):
            return None
        return cls(model, revert_weight_conversion)

    @classmethod
    def of_config(cls, config_path: Optional[str]) -> Optional["SavedForm"]:
        """The saved form of the model a ``config.json`` describes (its first architecture, built on the meta
        device); None without a config, or for a config transformers has no model class for."""
        if config_path is None:
            return None
        import transformers

        with open(config_path) as f:
            architectures = json.load(f).get("architectures") or []
        model_class = getattr(transformers, architectures[0], None) if architectures else None
        if model_class is None:
            return None
        config = transformers.AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(config_path)))
        with torch.device("meta"):
            model = model_class(config)
        return cls.of_model(model)

    def tensors(self, key: str, tensor: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The saved tensors, by key, of the model's tensor ``key``: itself, or its parts under their saved names."""
        return self._revert(self._model, {key: tensor})

    def parts(self, layout: Layout) -> List[Tuple[str, str, torch.dtype, Tuple[int, ...]]]:
        """(the model's key, a saved key, dtype, saved shape) of every saved tensor of ``layout`` (key, dtype, shape of
        the model's tensors), each tensor's parts in a row."""
        return [(key, name, dtype, tuple(part.shape)) for key, dtype, shape in layout
                for name, part in self.tensors(key, torch.empty(shape, dtype=dtype, device="meta")).items()]

    def layout(self, layout: Layout) -> Layout:
        """``layout`` in the saved form, each tensor's parts in a row."""
        return [(name, dtype, shape) for _, name, dtype, shape in self.parts(layout)]

    def converts(self, key: str, shape: Tuple[int, ...], dtype: torch.dtype) -> bool:
        """Whether tensor ``key`` is saved in another form than it is held."""
        parts = self.tensors(key, torch.empty(shape, dtype=dtype, device="meta"))
        return list(parts) != [key] or tuple(parts[key].shape) != tuple(shape)

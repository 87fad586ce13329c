"""The form transformers saves a model's weights in, where it differs from the tensors the model holds (transformers 5's
weight conversions: a mixture of experts' fused experts are saved one expert at a time). ``save_pretrained`` and
``nxdtp-merge`` write that form through transformers' own ``revert_weight_conversion``; a conversion that joins
several held tensors into one saved tensor is written as held."""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

Layout = List[Tuple[str, torch.dtype, Tuple[int, ...]]]


class SavedForm:
    """How transformers saves the tensors of one model's layout (the model real, or built on the meta device)."""

    def __init__(self, model: nn.Module, revert, parts: List[Tuple[str, str, torch.dtype, Tuple[int, ...]]],
                 saved_order: List[str]):
        self._model, self._revert, self._parts, self._saved_order = model, revert, parts, saved_order
        self._converted = {key for key, name, _, _ in parts if name != key} | {
            key for key, group in _by_key(parts).items() if len(group) > 1}

    @classmethod
    def of_model(cls, model: nn.Module, layout: Layout) -> Optional["SavedForm"]:
        """The saved form of a transformers model's ``layout``; None where transformers saves the tensors as held, or a
        saved tensor joins several held ones."""
        try:
            from transformers import PreTrainedModel
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import revert_weight_conversion
        except ImportError:
            return None
        if not isinstance(model, PreTrainedModel) or not get_model_conversion_mapping(model, add_legacy=False):
            return None
        meta = {key: torch.empty(shape, dtype=dtype, device="meta") for key, dtype, shape in layout}
        parts = [(key, name, dtype, tuple(part.shape)) for key, dtype, _ in layout
                 for name, part in revert_weight_conversion(model, {key: meta[key]}).items()]
        together = {name: tuple(part.shape) for name, part in revert_weight_conversion(model, meta).items()}
        if together != {name: shape for _, name, _, shape in parts}:
            return None
        form = cls(model, revert_weight_conversion, parts, list(together))
        return form if form._converted else None

    @classmethod
    def of_config(cls, config_path: Optional[str], layout: Layout) -> Optional["SavedForm"]:
        """The saved form of ``layout`` for the model a ``config.json`` describes (its first architecture, built on
        the meta device); None without a config, transformers, or a model class for it."""
        try:
            import transformers
        except ImportError:
            return None
        if config_path is None:
            return None
        try:
            with open(config_path) as f:
                architectures = json.load(f).get("architectures") or []
            model_class = getattr(transformers, architectures[0], None) if architectures else None
            if not isinstance(model_class, type):
                return None
            config = transformers.AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(config_path)))
            with torch.device("meta"):
                model = model_class(config)
        except Exception:  # noqa: BLE001 - a config transformers cannot build a model of: its tensors go as held
            return None
        return cls.of_model(model, layout)

    def tensors(self, key: str, tensor: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The saved tensors, by key, of the model's tensor ``key``: itself, or its parts under their saved names."""
        return self._revert(self._model, {key: tensor}) if key in self._converted else {key: tensor}

    def parts(self) -> List[Tuple[str, str, torch.dtype, Tuple[int, ...]]]:
        """(the model's key, a saved key, dtype, saved shape) of every saved tensor, each held tensor's in a row."""
        return list(self._parts)

    def layout(self) -> Layout:
        """The saved layout, each held tensor's parts in a row."""
        return [(name, dtype, shape) for _, name, dtype, shape in self._parts]

    def save_order(self) -> Layout:
        """The saved layout in the order transformers' save_pretrained plans its files in (the order its reversal of
        the whole state dict gives), so a sharded save puts each tensor in the file transformers would."""
        position = {name: i for i, name in enumerate(self._saved_order)}
        return sorted(self.layout(), key=lambda item: position[item[0]])

    def converts(self, key: str) -> bool:
        """Whether tensor ``key`` is saved in another form than it is held."""
        return key in self._converted


def _by_key(parts) -> Dict[str, list]:
    grouped: Dict[str, list] = {}
    for key, name, _, _ in parts:
        grouped.setdefault(key, []).append(name)
    return grouped

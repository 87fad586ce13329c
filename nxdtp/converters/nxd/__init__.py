"""Import checkpoints written by neuronx-distributed (NxD) into dense Hugging Face model directories.

NxD's per-rank files carry no sharding spec, so each model family has a module that knows how NxD's layers split it
(``bert.py``: NxD's BERT pretraining example; ``llama.py``: NxD's Llama training examples); ``reader.py`` finds and
reads the rank files for all of them. :func:`merge_nxd_checkpoint` picks the family from the config's ``model_type``
(``nxdtp-merge NXD_CKPT_DIR OUT_DIR --from-nxd --config CONFIG_JSON`` calls it).
"""

from __future__ import annotations

from typing import Dict

from . import bert, llama
from .reader import NxdCheckpointError, load_config_dict

# model_type -> the family module that imports it
FAMILIES: Dict[str, object] = {model_type: family for family in (bert, llama) for model_type in family.MODEL_TYPES}
SUPPORTED_MODEL_TYPES = tuple(sorted(FAMILIES))

# Configs without model_type (written by hand) are recognised by their architecture's class-name prefix.
_ARCHITECTURE_PREFIXES = {"Bert": "bert", "Llama": "llama", "Mistral": "mistral"}


def family_of(config_json):
    """The family module for a config (a config.json path, a directory holding one, or an HF config object)."""
    from transformers import PretrainedConfig

    if isinstance(config_json, PretrainedConfig):
        model_type, where = getattr(config_json, "model_type", None), type(config_json).__name__
    else:
        raw, where = load_config_dict(config_json)
        model_type = raw.get("model_type")
        if not model_type:
            architectures = raw.get("architectures") or []
            model_type = next((t for a in architectures for p, t in _ARCHITECTURE_PREFIXES.items()
                               if isinstance(a, str) and a.startswith(p)), None)
            if model_type is None:
                raise NxdCheckpointError(f"config {where} names no model_type (and no architecture nxdtp recognises: "
                                         f"{architectures}); the NxD import reads model_type "
                                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type not in FAMILIES:
        raise NxdCheckpointError(f"config {where} has model_type {model_type!r}; the NxD import reads model_type "
                                 f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    return FAMILIES[model_type]


def merge_nxd_checkpoint(checkpoint_dir, config_json, output_dir, force: bool = False, progress: bool = True,
                         **options) -> str:
    """Merge an NxD checkpoint into a dense HF directory with its family's importer; return ``output_dir``.

    ``options`` go to the family's ``merge_nxd_checkpoint`` (``bert.merge_nxd_checkpoint`` or
    ``llama.merge_nxd_checkpoint``; both take ``tag``, ``dtype`` and ``model_key``).
    """
    family = family_of(config_json)
    return family.merge_nxd_checkpoint(checkpoint_dir, config_json, output_dir, force=force, progress=progress,
                                       **options)


__all__ = ["merge_nxd_checkpoint", "family_of", "FAMILIES", "SUPPORTED_MODEL_TYPES", "NxdCheckpointError"]

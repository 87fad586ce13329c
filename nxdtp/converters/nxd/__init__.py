"""Import checkpoints written by neuronx-distributed (NxD) into dense Hugging Face model directories: one module per
model family knows how NxD's layers split it (``bert.py``, ``llama.py``, ``mixtral.py``), ``reader.py`` reads the rank
files for all; :func:`merge_nxd_checkpoint` picks the family from the config (``nxdtp-merge ... --from-nxd --config
CONFIG_JSON``).
"""

from __future__ import annotations

from typing import Dict

from ...models import bert as bert_plan
from ...models import llama as llama_plan
from ...models import moe as moe_plan
from ...models.registry import family_of as plan_family_of
from . import bert, llama, mixtral
from .reader import NxdCheckpointError, load_config_dict

# The importer of each model family (nxdtp.models.registry, the one list of families) whose NxD checkpoints nxdtp
# reads; each importer lists the model_types it reads (the Llama family's plan also covers Qwen, which NxD's examples
# do not train; the MoE family's, Qwen's MoE models, which NxD's examples do not train either).
IMPORTERS: Dict[str, object] = {bert_plan.FAMILY.name: bert, llama_plan.FAMILY.name: llama,
                                moe_plan.FAMILY.name: mixtral}
_BY_MODEL_TYPE = {model_type: importer for importer in IMPORTERS.values() for model_type in importer.MODEL_TYPES}
SUPPORTED_MODEL_TYPES = tuple(sorted(_BY_MODEL_TYPE))


def family_of(config_json):
    """The importer for a config (a config.json path, a directory holding one, or an HF config object): by its
    model_type, or for a config without one (written by hand) by the family of its architecture's class."""
    from transformers import PretrainedConfig

    if isinstance(config_json, PretrainedConfig):
        model_type, where = getattr(config_json, "model_type", None), type(config_json).__name__
    else:
        raw, where = load_config_dict(config_json)
        model_type = raw.get("model_type")
        if not model_type:
            architectures = raw.get("architectures") or []
            families = [plan_family_of(a) for a in architectures if isinstance(a, str)]
            importer = next((IMPORTERS[f.name] for f in families if f is not None and f.name in IMPORTERS), None)
            if importer is None:
                raise NxdCheckpointError(f"config {where} names no model_type (and no architecture nxdtp recognises: "
                                         f"{architectures}); the NxD import reads model_type "
                                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
            return importer
    if model_type not in _BY_MODEL_TYPE:
        raise NxdCheckpointError(f"config {where} has model_type {model_type!r}; the NxD import reads model_type "
                                 f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    return _BY_MODEL_TYPE[model_type]


def merge_nxd_checkpoint(checkpoint_dir, config_json, output_dir, force: bool = False, progress: bool = True,
                         **options) -> str:
    """Merge an NxD checkpoint into a dense HF directory with its family's importer (``options`` go to it: ``tag``,
    ``dtype``, ``model_key``, ...); return ``output_dir``."""
    family = family_of(config_json)
    return family.merge_nxd_checkpoint(checkpoint_dir, config_json, output_dir, force=force, progress=progress,
                                       **options)


__all__ = ["merge_nxd_checkpoint", "family_of", "IMPORTERS", "SUPPORTED_MODEL_TYPES", "NxdCheckpointError"]

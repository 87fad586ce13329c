"""Import a BERT checkpoint written by neuronx-distributed (NxD) into a dense Hugging Face model directory. NxD's
files record no split, so :data:`NXD_ATTENTION_ONLY_PLAN` gives it: NxD's BERT pretraining example splits Q, K and V
(weight and bias) along dim 0 and the attention output weight along dim 1; every other tensor is whole on every rank.
"""

from __future__ import annotations

import copy
import fnmatch
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ...spec import ParamSpec
from .reader import (
    AUTO,
    NxdCheckpointError,
    NxdSource,
    RankFiles,
    RankShard,
    check_pieces,
    check_saved_tp,
    expected_layout,
    import_checkpoint,
    load_config_dict,
    replicated,
    say,
)

MODEL_TYPES = ("bert",)

# Key pattern (fnmatch, over HF state-dict keys) -> dim along which NxD splits the tensor over TP ranks.
# Keys that match no pattern are replicated: every rank holds the whole tensor.
NXD_ATTENTION_ONLY_PLAN: Dict[str, int] = {
    "*encoder.layer.*.attention.self.query.weight": 0,
    "*encoder.layer.*.attention.self.query.bias": 0,
    "*encoder.layer.*.attention.self.key.weight": 0,
    "*encoder.layer.*.attention.self.key.bias": 0,
    "*encoder.layer.*.attention.self.value.weight": 0,
    "*encoder.layer.*.attention.self.value.bias": 0,
    "*encoder.layer.*.attention.output.dense.weight": 1,
}

# Buffers older transformers versions saved in the state dict (HF 4.26, the version of NxD's example, saves
# position_ids); they are not weights and current HF rebuilds them.
DROPPED_BUFFER_PATTERNS = ("*embeddings.position_ids", "*embeddings.token_type_ids")


def nxd_partition_dim(key: str, plan: Mapping[str, int] = NXD_ATTENTION_ONLY_PLAN) -> Optional[int]:
    """The dim along which ``plan`` splits ``key`` over TP ranks, or None when every rank holds all of it."""
    for pattern, dim in plan.items():
        if fnmatch.fnmatchcase(key, pattern):
            return dim
    return None


def _load_config(config_json):
    from transformers import BertConfig, PretrainedConfig

    if isinstance(config_json, PretrainedConfig):
        return copy.deepcopy(config_json)  # architectures is set on it before saving
    raw, path = load_config_dict(config_json)
    if raw.get("model_type", "bert") != "bert":
        raise NxdCheckpointError(f"{path}: model_type is {raw['model_type']!r}; nxdtp.converters.nxd.bert reads "
                                 "BERT only")
    return BertConfig.from_dict(raw)


def _model_class(config, model_class):
    import transformers

    from ...models.bert import SUPPORTED

    if model_class is None:
        names = [a for a in (getattr(config, "architectures", None) or []) if a in SUPPORTED]
        model_class = names[0] if names else "BertForPreTraining"
    if isinstance(model_class, str):
        if model_class not in SUPPORTED:
            raise ValueError(f"model_class must be one of {list(SUPPORTED)}, not {model_class}")
        model_class = getattr(transformers, model_class)
    return model_class


def _validate(shards: Sequence[RankShard], files: RankFiles, shapes: Dict[str, Tuple[int, ...]],
              tied: Dict[str, str], plan: Mapping[str, int]) -> Tuple[Dict[str, str], List[str]]:
    """Check the keys and every shard's shape; return (output key -> checkpoint key it is read from, dropped keys)."""
    tp = len(shards)
    reference = shards[0]
    keys = set(reference.state)
    dropped = sorted(k for k in keys if any(fnmatch.fnmatchcase(k, p) for p in DROPPED_BUFFER_PATTERNS))
    unexpected = sorted(keys - set(shapes) - set(dropped))
    if unexpected:
        raise NxdCheckpointError(f"{reference.path}: keys the BERT model of this config does not have: "
                                 f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    # What to write: HF's save_pretrained layout, each tied group once, under its source name.
    sources: Dict[str, str] = {}
    for key in shapes:
        # transformers 4.26's BERT keeps position_ids as a persistent buffer: not a weight, and not written either.
        if key in tied or any(fnmatch.fnmatchcase(key, p) for p in DROPPED_BUFFER_PATTERNS):
            continue
        aliases = [a for a, s in tied.items() if s == key]
        present = [k for k in [key] + aliases if k in keys]
        if not present:
            raise NxdCheckpointError(f"{reference.path}: '{key}' (shape {list(shapes[key])}) is missing from the "
                                     "checkpoint's model state dict")
        sources[key] = present[0]
    for key in sorted(keys - set(dropped)):
        expected = shapes[key]
        dim = nxd_partition_dim(key, plan)
        if dim is not None and dim < len(expected):
            check_saved_tp(files, reference, key, dim, expected[dim])
        if dim is not None and (dim >= len(expected) or expected[dim] % tp):
            raise NxdCheckpointError(f"'{key}' of shape {list(expected)} cannot be split along dim {dim} over {tp} "
                                     "TP ranks")
        check_pieces(shards, key, _spec(expected, dim, tp), "replicated on every TP rank" if dim is None else
                     f"its 1/{tp} slice along dim {dim} of the full {list(expected)}")
    return sources, dropped


def _spec(shape, dim: Optional[int], tp: int) -> ParamSpec:
    """NxD's layout of a BERT tensor: whole on every rank, or a plain split along ``dim``."""
    return ParamSpec(full_shape=tuple(shape)) if dim is None else ParamSpec(full_shape=tuple(shape),
                                                                           partition_dim=dim, num_partitions=tp)


def _source(shards: Sequence[RankShard], sources: Dict[str, str], shapes: Dict[str, Tuple[int, ...]],
            tied: Dict[str, str], plan: Mapping[str, int], dtype: Optional[torch.dtype]) -> NxdSource:
    """The dense tensors: a split one read through NxD's plain split along its dim, a replicated one TP rank 0's copy
    (warning if ranks differ). A tied pair held under both names must agree, or the HF model would use one."""
    source = NxdSource(shards, dtype)
    keys = set(shards[0].state)
    pairs = [(alias, key) for alias, key in tied.items() if alias in keys and key in keys]
    wanted = dict(sources, **{name: name for pair in pairs for name in pair if name not in sources})
    for key, nxd_key in wanted.items():
        shape, stored, dim = shapes[key], shards[0].get(nxd_key).dtype, nxd_partition_dim(nxd_key, plan)
        if dim is None:
            source.built(key, shape, stored, lambda nxd_key=nxd_key: replicated(shards, nxd_key), key in sources)
        else:
            source.laid_out(key, shape, stored, nxd_key, _spec(shape, dim, len(shards)), write=key in sources)
    for alias, key in pairs:
        source.check_tied(alias, key)
    return source


def merge_nxd_checkpoint(checkpoint_dir: str, config_json, output_dir: str, force: bool = False,
                         progress: bool = True, model_class=None, model_key: Optional[str] = AUTO,
                         plan: Mapping[str, int] = NXD_ATTENTION_ONLY_PLAN,
                         dtype: Optional[torch.dtype] = None, tag: Optional[str] = None,
                         verify_checksums: bool = True) -> str:
    """Merge an NxD BERT checkpoint into a dense HF directory, checked before anything is written, atomically; return
    ``output_dir`` (arguments: docs/api.md)."""
    config = _load_config(config_json)
    cls = _model_class(config, model_class)

    def layout(shards: List[RankShard], files: RankFiles, dtype: Optional[torch.dtype]) -> NxdSource:
        shapes, tied = expected_layout(config, cls)
        sources, dropped = _validate(shards, files, shapes, tied, plan)
        source = _source(shards, sources, shapes, tied, plan, dtype)
        if dropped:
            say(progress, f"dropping buffers that are not weights: {dropped}")
        return source

    return import_checkpoint(checkpoint_dir, output_dir, config, cls.__name__, layout, force=force, progress=progress,
                             model_key=model_key, tag=tag, dtype=dtype,
                             verify_checksums=verify_checksums)

"""Import a BERT checkpoint written by neuronx-distributed (NxD) into a dense Hugging Face model directory.

NxD's files record nothing about how the tensors are split, so the layout comes from here:
:data:`NXD_ATTENTION_ONLY_PLAN` describes NxD's BERT pretraining example, which shards attention only (Q, K and V are
``ColumnParallelLinear(gather_output=False)``: weight and bias split along dim 0; the attention output dense is
``RowParallelLinear(input_is_parallel=True)``: weight split along dim 1, bias whole). Every other tensor is the same on
every TP rank. Finding and reading the rank files is ``reader.py``'s job.
"""

from __future__ import annotations

import copy
import fnmatch
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ...spec import ParamSpec
from .reader import (
    AUTO,
    DenseTensor,
    NxdCheckpointError,
    RankFiles,
    RankShard,
    expected_layout,
    import_checkpoint,
    load_config_dict,
    missing_last_ranks,
    one_dtype,
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
            piece = reference.get(key).shape[dim] if reference.get(key).dim() > dim else 0
            if piece and expected[dim] % piece == 0 and expected[dim] // piece > tp:
                raise missing_last_ranks(files, expected[dim] // piece,
                                         f"{reference.tensor_file(key)}: '{key}' is a 1/{expected[dim] // piece} slice")
        one_dtype(shards, key)
        for shard in shards:
            shape = tuple(shard.get(key).shape)
            if dim is None:
                want = expected
                how = "replicated on every TP rank"
            else:
                if dim >= len(expected) or expected[dim] % tp:
                    raise NxdCheckpointError(f"'{key}' of shape {list(expected)} cannot be split along dim {dim} "
                                             f"over {tp} TP ranks")
                want = _split_spec(expected, dim, tp).local_shape()
                how = f"its 1/{tp} slice along dim {dim} of the full {list(expected)}"
            if shape != want:
                raise NxdCheckpointError(f"{shard.tensor_file(key)}: '{key}' has shape {list(shape)}, but the config "
                                         f"needs {list(want)} ({how})")
    return sources, dropped


def _split_spec(full_shape: Tuple[int, ...], dim: int, tp: int) -> ParamSpec:
    """NxD's split of a BERT tensor in the layout algebra: a plain split along ``dim``, no padding or copies."""
    return ParamSpec(full_shape=tuple(full_shape), partition_dim=dim, num_partitions=tp)


def _merged(shards: Sequence[RankShard], key: str, plan: Mapping[str, int]) -> torch.Tensor:
    """The dense tensor: the TP slices unsharded, or TP rank 0's copy of a replicated tensor (warning if ranks
    differ)."""
    dim = nxd_partition_dim(key, plan)
    if dim is None:
        return replicated(shards, key)
    pieces = [shard.get(key) for shard in shards]
    full = list(pieces[0].shape)
    full[dim] *= len(pieces)
    return _split_spec(tuple(full), dim, len(pieces)).unshard(pieces)


def _check_ties(shards: Sequence[RankShard], tied: Dict[str, str], plan: Mapping[str, int]) -> None:
    """A tied pair present under both names must hold the same values, or the HF model would silently use one."""
    keys = set(shards[0].state)
    for alias, source in tied.items():
        if alias in keys and source in keys:
            if not torch.equal(_merged(shards, alias, plan), _merged(shards, source, plan)):
                raise NxdCheckpointError(
                    f"{shards[0].path}: '{alias}' differs from '{source}', but the config ties them, so the HF model "
                    f"would use '{source}' for both; set tie_word_embeddings to false in the config to keep both")


def merge_nxd_checkpoint(checkpoint_dir: str, config_json, output_dir: str, force: bool = False,
                         progress: bool = True, model_class=None, model_key: Optional[str] = AUTO,
                         plan: Mapping[str, int] = NXD_ATTENTION_ONLY_PLAN,
                         dtype: Optional[torch.dtype] = None, tag: Optional[str] = None,
                         verify_checksums: bool = True) -> str:
    """Merge an NxD BERT checkpoint (one file per TP rank, no spec) into a dense HF directory; return ``output_dir``.

    ``checkpoint_dir`` holds ``tp_rank_XX_pp_rank_00/checkpoint.pt`` or another layout ``reader.py`` finds; tp is the
    number of ranks. ``config_json`` is the model's ``config.json`` (a file, a directory holding one, or a
    ``BertConfig``). The result, ``model.safetensors`` and ``config.json``, loads with
    ``BertForPreTraining.from_pretrained(output_dir)``. ``model_class`` (default: the config's architecture, else
    BertForPreTraining) sets which keys are expected; ``model_key`` is where the state dict sits in each rank's dict
    (None: the file is the state dict; default: as the layout stores it); ``plan`` maps key patterns to their TP split
    dim (default: NxD's BERT example); ``dtype`` casts floating tensors; ``tag`` picks a tag in a directory of NxD
    trainer tags; ``verify_checksums`` (default on) checks the CRC-32 of every entry of every rank file, so flipped
    bytes are an error, not wrong weights.

    Everything is checked before anything is written: every rank file present (ranks 0..tp-1, pp 0), keys equal on all
    ranks, every shape consistent with the config. The result is written to a temporary sibling and renamed into
    place, so an error leaves ``output_dir`` as it was. A non-empty ``output_dir`` is refused unless ``force``.
    """
    config = _load_config(config_json)
    cls = _model_class(config, model_class)

    def layout(shards: List[RankShard], files: RankFiles) -> List[DenseTensor]:
        shapes, tied = expected_layout(config, cls)
        sources, dropped = _validate(shards, files, shapes, tied, plan)
        _check_ties(shards, tied, plan)
        if dropped:
            say(progress, f"dropping buffers that are not weights: {dropped}")
        return [DenseTensor(key, shapes[key], shards[0].get(source).dtype,
                            lambda source=source: _merged(shards, source, plan))
                for key, source in sources.items()]

    return import_checkpoint(checkpoint_dir, output_dir, config, cls.__name__, layout, force=force, progress=progress,
                             model_key=model_key, tag=tag, dtype=dtype,
                             verify_checksums=verify_checksums)

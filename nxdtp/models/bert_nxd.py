"""Import a BERT checkpoint written by neuronx-distributed (NxD) into a dense Hugging Face model directory.

NxD's ``neuronx_distributed.parallel_layers.checkpointing.save`` writes one pickle per TP rank and records nothing about
how the tensors are split, so the layout comes from here: :data:`NXD_ATTENTION_ONLY_PLAN` describes NxD's BERT
pretraining example, which shards attention only (Q, K and V are ``ColumnParallelLinear(gather_output=False)``: weight
and bias split along dim 0; the attention output dense is ``RowParallelLinear(input_is_parallel=True)``: weight split
along dim 1, bias whole). Every other tensor is the same on every TP rank.

Forms read (``P`` is ``tp_rank_XX_pp_rank_00`` in the checkpoint directory):

* plain: ``P/checkpoint.pt``, a ``torch.save`` of ``{"model": state_dict, "optimizer": ..., ...}``;
* xser (``save(..., save_xser=True)``, i.e. ``torch_xla.utils.serialization.save``): the file ``P`` holds the same dict
  with every XLA tensor replaced by a ``TensorReference(tid)``, and tensor ``tid`` is ``P.tensors/tensor_<tid>.pt``.
  A reference file at ``P/checkpoint.pt`` with ``P/checkpoint.pt.tensors/`` is read the same way.

Every pickle is loaded with ``torch.load(weights_only=True)``. The only global allowed beyond torch's defaults is
torch_xla's ``TensorReference``, and it is rebuilt as a local stand-in that holds one integer, so torch_xla need not be
installed and no code from the file runs. Optimizer and scheduler entries are left unread (memory-mapped).
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import re
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..checkpointing.output_dir import check_output_dir, write_atomically
from ..checkpointing.safetensors_stream import StreamingSafetensorsWriter

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

CHECKPOINT_FILE = "checkpoint.pt"
XSER_TENSORS_SUFFIX = ".tensors"
SAFETENSORS_FILE = "model.safetensors"
XLA_TENSOR_REFERENCE = "torch_xla.utils.serialization.TensorReference"

_RANK_ENTRY = re.compile(r"^tp_rank_(\d+)_pp_rank_(\d+)(?:_dp_rank_(\d+))?$")


class NxdCheckpointError(ValueError):
    """An NxD checkpoint that cannot be imported: the message names the file and the tensor."""


class _XlaTensorReference:
    """Stand-in for ``torch_xla.utils.serialization.TensorReference``; only its integer ``tid`` is kept."""

    def __init__(self, tid: int = -1):
        self.tid = tid

    def __setstate__(self, state: Any) -> None:
        tid = state.get("tid") if isinstance(state, dict) else None
        if type(tid) is not int or tid < 0 or set(state) != {"tid"}:
            raise NxdCheckpointError(f"malformed torch_xla TensorReference state {state!r}")
        self.tid = tid


def nxd_partition_dim(key: str, plan: Mapping[str, int] = NXD_ATTENTION_ONLY_PLAN) -> Optional[int]:
    """The dim along which ``plan`` splits ``key`` over TP ranks, or None when every rank holds all of it."""
    for pattern, dim in plan.items():
        if fnmatch.fnmatchcase(key, pattern):
            return dim
    return None


# ---- finding and reading the rank files ------------------------------------------------------------------------------

def _rank_name(tp_rank: int, pp_rank: int = 0) -> str:
    return f"tp_rank_{tp_rank:02d}_pp_rank_{pp_rank:02d}"


def find_rank_files(checkpoint_dir: str) -> List[str]:
    """The checkpoint file of each TP rank, in rank order; checks pp is 0 and the ranks are 0..tp-1."""
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"NxD checkpoint directory {checkpoint_dir} does not exist")
    found: Dict[int, List[str]] = {}
    pipeline = []
    for name in sorted(os.listdir(checkpoint_dir)):
        match = _RANK_ENTRY.match(name)
        if not match:
            continue  # also skips the xser tensor folders, "<entry>.tensors"
        tp_rank, pp_rank, dp_rank = int(match[1]), int(match[2]), match[3]
        if pp_rank != 0:
            pipeline.append(name)
            continue
        if dp_rank is not None and int(dp_rank) != 0:
            continue  # save(master_dp_only=False) writes one copy per DP rank; DP rank 0's is as good as any
        path = os.path.join(checkpoint_dir, name)
        if os.path.isdir(path):
            path = os.path.join(path, CHECKPOINT_FILE)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} is missing: NxD rank directory {name} holds no {CHECKPOINT_FILE}")
        found.setdefault(tp_rank, []).append(path)
    if pipeline:
        raise NxdCheckpointError(f"{checkpoint_dir} is a pipeline-parallel NxD checkpoint ({', '.join(pipeline[:4])}"
                                 f"{' ...' if len(pipeline) > 4 else ''}); only pp_rank_00 (no pipeline parallelism) "
                                 "can be imported")
    if not found:
        legacy = [n for n in os.listdir(checkpoint_dir) if re.match(r"^tp_rank_\d+(_pp_rank\d+\.pt)?$", n)]
        hint = (f"; {legacy[0]} looks like the naming of NxD releases before Neuron SDK 2.15, which is not "
                "supported") if legacy else ""
        raise FileNotFoundError(f"{checkpoint_dir} holds no NxD rank checkpoint (tp_rank_XX_pp_rank_00/"
                                f"{CHECKPOINT_FILE} or the xser file tp_rank_XX_pp_rank_00){hint}")
    for tp_rank, paths in found.items():
        if len(paths) > 1:
            raise NxdCheckpointError(f"{checkpoint_dir} holds more than one checkpoint for TP rank {tp_rank}: "
                                     f"{', '.join(paths)}")
    tp = max(found) + 1
    missing = [_rank_name(r) for r in range(tp) if r not in found]
    if missing:
        raise FileNotFoundError(f"{checkpoint_dir}: TP ranks must be numbered 0..{tp - 1}, but {', '.join(missing)} "
                                f"{'is' if len(missing) == 1 else 'are'} missing (found "
                                f"{', '.join(_rank_name(r) for r in sorted(found))})")
    return [found[r][0] for r in range(tp)]


def _torch_load(path: str) -> Any:
    """``torch.load(weights_only=True)``, memory-mapped where the file allows it; refusals name the file."""
    import pickle

    def load(mmap: bool):
        with torch.serialization.safe_globals([(_XlaTensorReference, XLA_TENSOR_REFERENCE)]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)

    try:
        try:
            return load(mmap=True)
        except RuntimeError as error:
            if "mmap" not in str(error):
                raise
            return load(mmap=False)  # the legacy (pre-zipfile) torch.save format cannot be memory-mapped
    except NxdCheckpointError as error:  # a malformed TensorReference
        raise NxdCheckpointError(f"{path}: {error}") from error
    except pickle.UnpicklingError as error:
        raise NxdCheckpointError(f"{path}: refused to load with torch.load(weights_only=True); it holds Python objects "
                                 f"beyond tensors and plain containers. Only load it unrestricted if you trust "
                                 f"where it came from. Detail: {error}") from error
    except (RuntimeError, EOFError, OSError) as error:
        if isinstance(error, FileNotFoundError):
            raise
        raise NxdCheckpointError(f"{path}: cannot be read as a torch checkpoint: {error}") from error


class _RankShard:
    """One TP rank's model state dict; xser references are resolved (memory-mapped) on first use."""

    def __init__(self, path: str, model_key: Optional[str]):
        self.path = path
        checkpoint = _torch_load(path)
        if model_key is None:
            state = checkpoint
        else:
            if not isinstance(checkpoint, Mapping) or model_key not in checkpoint:
                keys = list(checkpoint)[:8] if isinstance(checkpoint, Mapping) else type(checkpoint).__name__
                raise NxdCheckpointError(f"{path}: expected a dict with the model state dict under '{model_key}', "
                                         f"found {keys}")
            state = checkpoint[model_key]
        if not isinstance(state, Mapping):
            raise NxdCheckpointError(f"{path}: '{model_key}' is a {type(state).__name__}, not a state dict")
        self.state: Dict[str, Any] = {}
        for key, value in state.items():
            if not isinstance(key, str):
                raise NxdCheckpointError(f"{path}: state dict key {key!r} is not a string")
            if key.endswith("_extra_state"):
                continue
            if not isinstance(value, (torch.Tensor, _XlaTensorReference)):
                raise NxdCheckpointError(f"{path}: '{key}' is a {type(value).__name__}, not a tensor")
            self.state[key] = value
        self._tensors_dir = path + XSER_TENSORS_SUFFIX
        refs = [v for v in self.state.values() if isinstance(v, _XlaTensorReference)]
        if refs and not os.path.isdir(self._tensors_dir):
            raise FileNotFoundError(f"{path} is an xser checkpoint (it references tensor files) but its tensor "
                                    f"directory {self._tensors_dir} is missing")
        self._resolved: Dict[int, torch.Tensor] = {}

    def tensor_file(self, key: str) -> str:
        value = self.state[key]
        if isinstance(value, _XlaTensorReference):
            return os.path.join(self._tensors_dir, f"tensor_{value.tid}.pt")
        return self.path

    def get(self, key: str) -> torch.Tensor:
        value = self.state[key]
        if not isinstance(value, _XlaTensorReference):
            return value
        if value.tid not in self._resolved:
            file = self.tensor_file(key)
            if not os.path.isfile(file):
                raise FileNotFoundError(f"{file} is missing: {self.path} needs it for '{key}'")
            tensor = _torch_load(file)
            if not isinstance(tensor, torch.Tensor):
                raise NxdCheckpointError(f"{file} (for '{key}' of {self.path}) holds a {type(tensor).__name__}, "
                                         "not a tensor")
            self._resolved[value.tid] = tensor
        return self._resolved[value.tid]


# ---- the expected model ----------------------------------------------------------------------------------------------

def _load_config(config_json):
    from transformers import BertConfig, PretrainedConfig

    if isinstance(config_json, PretrainedConfig):
        return copy.deepcopy(config_json)  # architectures is set on it before saving
    path = os.fspath(config_json)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"BERT config {path} does not exist")
    with open(path) as f:
        raw = json.load(f)
    if raw.get("model_type", "bert") != "bert":
        raise NxdCheckpointError(f"{path}: model_type is {raw['model_type']!r}; the NxD import knows BERT only")
    return BertConfig.from_dict(raw)


def _model_class(config, model_class):
    import transformers

    from .bert import SUPPORTED

    if model_class is None:
        names = [a for a in (getattr(config, "architectures", None) or []) if a in SUPPORTED]
        model_class = names[0] if names else "BertForPreTraining"
    if isinstance(model_class, str):
        if model_class not in SUPPORTED:
            raise ValueError(f"model_class must be one of {list(SUPPORTED)}, not {model_class}")
        model_class = getattr(transformers, model_class)
    return model_class


def _expected_layout(config, model_class) -> Tuple[Dict[str, Tuple[int, ...]], Dict[str, str]]:
    """Shapes of the dense model's state dict, and its tied aliases (alias -> source) as HF's config sets them."""
    with torch.device("meta"):
        model = model_class(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied = getattr(model, "all_tied_weights_keys", None)
    if tied is None:  # transformers < 5 has no such map: every key is then required in the checkpoint
        tied = {}
    return shapes, dict(tied)


# ---- merge -----------------------------------------------------------------------------------------------------------

def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"[nxdtp merge-nxd] {message}", file=sys.stderr, flush=True)


def _validate(shards: Sequence[_RankShard], shapes: Dict[str, Tuple[int, ...]], tied: Dict[str, str],
              plan: Mapping[str, int]) -> Tuple[Dict[str, str], List[str]]:
    """Check key sets and every shard's shape; return (output key -> checkpoint key it is read from, dropped keys)."""
    tp = len(shards)
    reference = shards[0]
    for shard in shards[1:]:
        extra = sorted(set(shard.state) - set(reference.state))
        absent = sorted(set(reference.state) - set(shard.state))
        if extra or absent:
            raise NxdCheckpointError(f"{shard.path}: its model keys differ from {reference.path}'s: "
                                     f"missing {absent[:5]}, extra {extra[:5]}")
    keys = set(reference.state)
    dropped = sorted(k for k in keys if any(fnmatch.fnmatchcase(k, p) for p in DROPPED_BUFFER_PATTERNS))
    unexpected = sorted(keys - set(shapes) - set(dropped))
    if unexpected:
        raise NxdCheckpointError(f"{reference.path}: keys the BERT model of this config does not have: "
                                 f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    # What to write: HF's save_pretrained layout, each tied group once, under its source name.
    sources: Dict[str, str] = {}
    for key in shapes:
        if key in tied:
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
            # A missing last rank leaves 0..tp-2 contiguous: the slice size tells.
            piece = reference.get(key).shape[dim] if reference.get(key).dim() > dim else 0
            if piece and expected[dim] % piece == 0 and expected[dim] // piece > tp:
                implied = expected[dim] // piece
                raise FileNotFoundError(
                    f"{reference.tensor_file(key)}: '{key}' is a 1/{implied} slice, so the checkpoint was saved at "
                    f"tp={implied}, but only {tp} rank(s) are present; missing: "
                    f"{', '.join(_rank_name(r) for r in range(tp, implied))}")
        dtypes = {shard.get(key).dtype for shard in shards}
        if len(dtypes) > 1:
            raise NxdCheckpointError(f"'{key}' has different dtypes across ranks: {sorted(map(str, dtypes))}")
        for shard in shards:
            shape = tuple(shard.get(key).shape)
            if dim is None:
                want = expected
                how = "replicated on every TP rank"
            else:
                if dim >= len(expected) or expected[dim] % tp:
                    raise NxdCheckpointError(f"'{key}' of shape {list(expected)} cannot be split along dim {dim} "
                                             f"over {tp} TP ranks")
                want = expected[:dim] + (expected[dim] // tp,) + expected[dim + 1:]
                how = f"its 1/{tp} slice along dim {dim} of the full {list(expected)}"
            if shape != want:
                raise NxdCheckpointError(f"{shard.tensor_file(key)}: '{key}' has shape {list(shape)}, but the config "
                                         f"needs {list(want)} ({how})")
    return sources, dropped


def _merged(shards: Sequence[_RankShard], key: str, plan: Mapping[str, int]) -> torch.Tensor:
    """The full tensor: TP slices concatenated, or TP rank 0's copy of a replicated tensor (warning if ranks differ)."""
    dim = nxd_partition_dim(key, plan)
    if dim is not None:
        return torch.cat([shard.get(key) for shard in shards], dim=dim)
    value = shards[0].get(key)
    for shard in shards[1:]:
        other = shard.get(key)
        if not torch.equal(other, value):
            diff = (other.double() - value.double()).abs().max().item() if value.is_floating_point() else "n/a"
            _say(True, f"warning: replicated '{key}' differs between {shards[0].path} and {shard.path} "
                       f"(max abs diff {diff}); using TP rank 0's")
    return value


def _check_ties(shards: Sequence[_RankShard], tied: Dict[str, str], plan: Mapping[str, int]) -> None:
    """A tied pair present under both names must hold the same values, or the HF model would silently use one."""
    keys = set(shards[0].state)
    for alias, source in tied.items():
        if alias in keys and source in keys:
            if not torch.equal(_merged(shards, alias, plan), _merged(shards, source, plan)):
                raise NxdCheckpointError(
                    f"{shards[0].path}: '{alias}' differs from '{source}', but the config ties them, so the HF model "
                    f"would use '{source}' for both; set tie_word_embeddings to false in the config to keep both")


def merge_nxd_checkpoint(checkpoint_dir: str, config_json, output_dir: str, force: bool = False,
                         progress: bool = True, model_class=None, model_key: Optional[str] = "model",
                         plan: Mapping[str, int] = NXD_ATTENTION_ONLY_PLAN,
                         dtype: Optional[torch.dtype] = None) -> str:
    """Merge an NxD BERT checkpoint (one file per TP rank, no spec) into a dense HF directory; return ``output_dir``.

    ``checkpoint_dir`` holds ``tp_rank_XX_pp_rank_00/checkpoint.pt`` (or NxD's xser form); tp is the number of ranks.
    ``config_json`` is the model's ``config.json`` (a file, a directory holding one, or a ``BertConfig``). The result,
    ``model.safetensors`` and ``config.json``, loads with ``BertForPreTraining.from_pretrained(output_dir)``.
    ``model_class`` (default: the config's architecture, else BertForPreTraining) sets which keys are expected;
    ``model_key`` is where the state dict sits in each rank's dict (None: the file is the state dict); ``plan`` maps
    key patterns to their TP split dim (default: NxD's BERT example); ``dtype`` casts floating tensors.

    Everything is checked before anything is written: every rank file present (ranks 0..tp-1, pp 0), keys equal on all
    ranks, every shape consistent with the config. The result is written to a temporary sibling and renamed into
    place, so an error leaves ``output_dir`` as it was. A non-empty ``output_dir`` is refused unless ``force``.
    """
    checkpoint_dir, output_dir = os.fspath(checkpoint_dir), os.fspath(output_dir)
    config = _load_config(config_json)
    cls = _model_class(config, model_class)
    check_output_dir(checkpoint_dir, output_dir, force)
    files = find_rank_files(checkpoint_dir)
    tp = len(files)
    shards = []
    for rank, path in enumerate(files):
        _say(progress, f"reading TP rank {rank + 1}/{tp}: {path}")
        shards.append(_RankShard(path, model_key))
    shapes, tied = _expected_layout(config, cls)
    sources, dropped = _validate(shards, shapes, tied, plan)
    _check_ties(shards, tied, plan)
    if dropped:
        _say(progress, f"dropping buffers that are not weights: {dropped}")

    def out_dtype(key):
        source_dtype = shards[0].get(sources[key]).dtype
        return dtype if dtype is not None and source_dtype.is_floating_point else source_dtype

    layout = [(key, out_dtype(key), shapes[key]) for key in sources]

    def write(staging: str) -> None:
        _say(progress, f"writing {len(layout)} tensors (tp={tp} merged) to {output_dir}")
        metadata = {"format": "pt", "source": "nxdtp merge of an NxD checkpoint", "nxd_tp_size": str(tp)}
        with StreamingSafetensorsWriter(os.path.join(staging, SAFETENSORS_FILE), layout, metadata) as writer:
            for key, dtype_, _ in layout:
                writer.write(key, _merged(shards, sources[key], plan).to(dtype_))
        config.architectures = [cls.__name__]
        config.save_pretrained(staging)

    write_atomically(output_dir, write)
    _say(progress, f"done: {output_dir}")
    return output_dir

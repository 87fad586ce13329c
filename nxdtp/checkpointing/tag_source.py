"""Reading a sharded nxdtp checkpoint tag as a source (merge, reshard, the DCP export): the tag to read, its checked
index, its rank files open and checked, and its config."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import integrity, tags
from .durable import copy_durably
from .index import CONFIG_FILE, INDEX_FILE, CheckpointIndex, dtype_from_name
from .output_dir import check_output_dir
from .safetensors_stream import SafetensorsFileReader

__all__ = ["choose_source", "model_file_names", "read_checked_index", "open_rank_file", "rank_file_opener",
           "check_piece", "open_model_files", "config_source", "copy_if_present", "progress_bar", "CONFIG_FILE"]


def choose_source(checkpoint_dir: str, tag: Optional[str], output_dir: str, force: bool, verify: bool,
                   reads: Callable[[str, CheckpointIndex], List[str]]) -> Tuple[str, CheckpointIndex, Dict[str, Any]]:
    """The tag directory to read, its checked index and its open model files. ``output_dir`` must lie outside the
    checkpoint; with ``verify`` the files ``reads(tag_dir, index)`` names pass their checksums. A named tag that
    fails a check raises; an unnamed one is skipped with a warning."""
    problems: List[str] = []
    for tag_dir, _, named in integrity.intact_candidates(checkpoint_dir, tag, problems, verify_index=verify):
        holder = os.path.dirname(os.path.abspath(tag_dir))
        if os.path.abspath(holder) != os.path.abspath(checkpoint_dir) \
                and os.path.isfile(os.path.join(holder, tags.NEWEST_FILE)):
            check_output_dir(holder, output_dir, force)
        check_output_dir(checkpoint_dir, output_dir, force)
        try:
            index = read_checked_index(tag_dir)
            if verify:
                integrity.verify_files(tag_dir, index, reads(tag_dir, index))
            return tag_dir, index, open_model_files(tag_dir, index)
        except (OSError, ValueError) as e:
            if named:
                raise
            integrity.skip(problems, tag_dir, f"{type(e).__name__}: {e}")
    raise AssertionError("unreachable: intact_candidates raises when it runs out")


def model_file_names(index: CheckpointIndex) -> List[str]:
    return sorted({f for e in index.tensors.values() for f in e.files(index.tensor_model_parallel_size)})


def read_checked_index(tag_dir: str) -> CheckpointIndex:
    path = os.path.join(tag_dir, INDEX_FILE)
    index = CheckpointIndex.read(tag_dir)  # refuses a malformed field itself
    tp = index.tensor_model_parallel_size
    if tp < 1:
        raise ValueError(f"{path} is damaged: tensor_model_parallel_size={tp!r}")
    for key, entry in index.tensors.items():
        spec = entry.spec
        try:
            dtype_from_name(entry.dtype)
        except ValueError as e:
            raise ValueError(f"{path}: '{key}': {e}") from None
        if len(spec.unpadded_shape) != len(spec.full_shape) or any(
                r > f for r, f in zip(spec.unpadded_shape, spec.full_shape)):
            raise ValueError(f"{path} is damaged: '{key}' has real shape {list(spec.unpadded_shape)} and full shape "
                             f"{list(spec.full_shape)}")
        if spec.is_sharded:
            if spec.num_partitions != tp or not 0 <= spec.partition_dim < len(spec.full_shape) or spec.stride < 1 \
                    or spec.full_shape[spec.partition_dim] % (tp * spec.stride) != 0:
                raise ValueError(f"{path} is damaged: '{key}' is split along dim {spec.partition_dim} into "
                                 f"{spec.num_partitions} partitions with stride {spec.stride}, full shape "
                                 f"{list(spec.full_shape)}, in a checkpoint of tensor_model_parallel_size={tp}")
    return index


def open_rank_file(path: str) -> SafetensorsFileReader:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file {path} is missing")
    try:
        return SafetensorsFileReader(path)
    except ValueError as e:
        raise ValueError(f"checkpoint file {path} is damaged or truncated: {e}") from None


def rank_file_opener(tag_dir: str) -> Callable[[str], SafetensorsFileReader]:
    """A rank file's name -> its reader, for the files of ``tag_dir``."""
    return lambda relative: open_rank_file(os.path.join(tag_dir, relative))


def check_piece(handle, path: str, key: str, expected: Tuple[int, ...]) -> None:
    if key not in handle.keys():
        raise ValueError(f"checkpoint file {path} lacks '{key}', which the index places there")
    shape = tuple(handle.get_slice(key).get_shape())
    if shape != tuple(expected):
        raise ValueError(f"checkpoint file {path}: '{key}' has shape {list(shape)}, the index says {list(expected)}")


def open_model_files(tag_dir: str, index: CheckpointIndex) -> Dict[str, Any]:
    """Open every model file the index names, checking each tensor's piece is there with the indexed shape."""
    handles: Dict[str, Any] = {}
    for relative in model_file_names(index):
        handles[relative] = open_rank_file(os.path.join(tag_dir, relative))
    for key, entry in index.tensors.items():
        for relative in entry.files(index.tensor_model_parallel_size):
            check_piece(handles[relative], os.path.join(tag_dir, relative), key, entry.spec.local_shape())
    return handles


def config_source(tag_dir: str, explicit: Optional[str]) -> Optional[str]:
    """The config.json to copy (``explicit``, else the tag's own, else None), checked to be a JSON object."""
    path = explicit if explicit is not None else os.path.join(tag_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        if explicit is not None:
            raise FileNotFoundError(f"config file {explicit} does not exist")
        return None
    try:
        with open(path) as f:
            if not isinstance(json.load(f), dict):
                raise ValueError
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"config file {path} is damaged: not a JSON object") from None
    return path


def copy_if_present(source: Optional[str], destination: str) -> None:
    if source is not None and os.path.isfile(source):
        copy_durably(source, destination)


def progress_bar(total: int, description: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=description, unit="tensor", file=sys.stderr, disable=not enabled, leave=False)

"""What every NxD-import family shares: finding NxD's rank files (layouts "v1", "v2" and "v2-ep"), loading them safely
(CRC-checked, ``weights_only=True``, torch_xla's ``TensorReference`` rebuilt as a stand-in) and ``NxdSource``, the
dense tensors as a pipeline source. Each family module supplies the layout, which NxD's files do not record
(docs/checkpoints.md, "Migrating NxD checkpoints")."""

from __future__ import annotations

import concurrent.futures
import json
import os
import pickle
import re
import sys
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ...checkpointing.dense import DenseWeightsWriter
from ...checkpointing.hf_form import SavedForm
from ...checkpointing.output_dir import check_output_dir, write_atomically
from ...checkpointing.pipeline import DenseSink, TagSource, narrowed, shifted, stream
from ...errors import DamagedInputError
from ...spec import ParamSpec

CHECKPOINT_FILE = "checkpoint.pt"
XSER_TENSORS_SUFFIX = ".tensors"
XLA_TENSOR_REFERENCE = "torch_xla.utils.serialization.TensorReference"
V2_MODEL_DIR = "model"

# The model_key default: the layout decides (v1 files hold a dict with the state dict under "model", v2 files are the
# state dict).
AUTO = "auto"

_V1_ENTRY = re.compile(r"^tp_rank_(\d+)_pp_rank_(\d+)(?:_dp_rank_(\d+))?$")
_V2_ENTRY = re.compile(r"^dp_rank_(\d+)_tp_rank_(\d+)_pp_rank_(\d+)\.pt$")
_V2_EXPERT_ENTRY = re.compile(r"^dp_rank_(\d+)_ep_rank_(\d+)_tp_rank_(\d+)_pp_rank_(\d+)\.pt$")


class NxdCheckpointError(DamagedInputError):
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


def say(progress: bool, message: str) -> None:
    if progress:
        print(f"[nxdtp merge-nxd] {message}", file=sys.stderr, flush=True)


# ---- finding the rank files ------------------------------------------------------------------------------------------

@dataclass
class RankFiles:
    """The checkpoint file of each TP rank (index = TP rank) in one of NxD's layouts; with expert parallelism, the file
    of each (TP rank, EP rank)."""

    directory: str
    paths: List[str]  # per TP rank; with expert parallelism, its EP rank 0 file (the only one with every tensor)
    # "v1" (parallel_layers.checkpointing.save), "v2" (trainer.save_checkpoint) or "v2-ep" (the same with expert
    # parallelism: dp_rank_00_ep_rank_XX_tp_rank_YY_pp_rank_00.pt)
    layout: str
    expert_paths: List[List[str]] = field(default_factory=list)  # per TP rank, the file of each EP rank in order

    @property
    def model_key(self) -> Optional[str]:
        return "model" if self.layout == "v1" else None

    @property
    def ep(self) -> int:
        """The expert-parallel degree: the number of EP ranks' files per TP rank."""
        return len(self.expert_paths[0]) if self.expert_paths else 1

    def entry_name(self, tp_rank: int, ep_rank: int = 0) -> str:
        """The name NxD gives the entry of TP rank ``tp_rank`` (and EP rank ``ep_rank``) in this layout (to name files
        that are absent)."""
        if self.layout == "v1":
            return f"tp_rank_{tp_rank:02d}_pp_rank_00"
        if self.layout == "v2-ep":
            return f"dp_rank_00_ep_rank_{ep_rank:02d}_tp_rank_{tp_rank:02d}_pp_rank_00.pt"
        return f"dp_rank_00_tp_rank_{tp_rank:02d}_pp_rank_00.pt"


def locate_rank_files(checkpoint_dir: str, tag: Optional[str] = None) -> RankFiles:
    """Find the per-TP-rank files under ``checkpoint_dir`` (see the module docstring for the layouts)."""
    checkpoint_dir = os.fspath(checkpoint_dir)
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"NxD checkpoint directory {checkpoint_dir} does not exist")
    names = os.listdir(checkpoint_dir)
    holds_ranks = any(_V1_ENTRY.match(n) or _V2_ENTRY.match(n) or _V2_EXPERT_ENTRY.match(n) for n in names)
    if tag is not None and holds_ranks:
        raise NxdCheckpointError(f"tag={tag!r} selects a tag in a directory of NxD trainer checkpoint tags, but "
                                 f"{checkpoint_dir} holds rank files itself")
    if holds_ranks:
        return _scan(checkpoint_dir)
    if tag is None and os.path.isdir(os.path.join(checkpoint_dir, V2_MODEL_DIR)):
        return _scan(_model_dir_of_tag(checkpoint_dir))
    tags = _complete_tags(checkpoint_dir)
    if tag is not None:
        path = os.path.join(checkpoint_dir, tag)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"NxD checkpoint tag {path} does not exist; complete tags: "
                                    f"{[os.path.basename(t) for t in tags]}")
        return _scan(_model_dir_of_tag(path))
    if tags:
        return _scan(_model_dir_of_tag(tags[-1]))
    started = [n for n in sorted(names) if os.path.isfile(os.path.join(checkpoint_dir, n, "checkpoint"))]
    if started:
        raise NxdCheckpointError(f"{checkpoint_dir} holds no complete NxD checkpoint: the tags {started[:4]} have no "
                                 "'done' file (their saves did not finish)")
    legacy = [n for n in names if re.match(r"^tp_rank_\d+(_pp_rank\d+\.pt)?$", n)]
    hint = (f"; {legacy[0]} looks like the naming of NxD releases before Neuron SDK 2.15, which is not supported"
            if legacy else "")
    raise FileNotFoundError(f"{checkpoint_dir} holds no NxD rank checkpoint (tp_rank_XX_pp_rank_00/{CHECKPOINT_FILE} "
                            f"or the xser file tp_rank_XX_pp_rank_00, written by parallel_layers.checkpointing.save; "
                            f"or {V2_MODEL_DIR}/dp_rank_00_tp_rank_XX_pp_rank_00.pt, written by "
                            f"trainer.save_checkpoint){hint}")


def _complete_tags(root: str) -> List[str]:
    """Tag directories with a ``done`` file, oldest first by that file's time (NxD loads the last one)."""
    found = []
    for name in os.listdir(root):
        done = os.path.join(root, name, "done")
        if os.path.isfile(done):
            found.append((os.path.getmtime(done), name))
    return [os.path.join(root, name) for _, name in sorted(found)]


def _model_dir_of_tag(tag_dir: str) -> str:
    # trainer.save_checkpoint writes "checkpoint" when a save starts and "done" when it ends; the converter's output
    # has neither, and is complete.
    if os.path.isfile(os.path.join(tag_dir, "checkpoint")) and not os.path.isfile(os.path.join(tag_dir, "done")):
        raise NxdCheckpointError(f"NxD checkpoint tag {tag_dir} is incomplete: it has no 'done' file (the save did "
                                 "not finish)")
    model_dir = os.path.join(tag_dir, V2_MODEL_DIR)
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"{model_dir} is missing: NxD checkpoint tag {tag_dir} holds no model")
    return model_dir


def _entry(name: str) -> Optional[Tuple[str, int, int, int, int]]:
    """(layout, DP rank, EP rank, TP rank, PP rank) of an NxD rank entry's name; None for any other name (xser tensor
    folders "<entry>.tensors" and v2's "<entry>.info.pt" too)."""
    v1, v2, ep = _V1_ENTRY.match(name), _V2_ENTRY.match(name), _V2_EXPERT_ENTRY.match(name)
    if v1:
        return "v1", int(v1[3] or 0), 0, int(v1[1]), int(v1[2])
    if v2:
        return "v2", int(v2[1]), 0, int(v2[2]), int(v2[3])
    if ep:
        return "v2-ep", int(ep[1]), int(ep[2]), int(ep[3]), int(ep[4])
    return None


def _entry_path(directory: str, name: str) -> str:
    path = os.path.join(directory, name)
    if _V1_ENTRY.match(name) and os.path.isdir(path):
        path = os.path.join(path, CHECKPOINT_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: NxD rank directory {name} holds no {CHECKPOINT_FILE}")
    return path


def _scan(directory: str) -> RankFiles:
    """The rank files in ``directory``; checks pp is 0, one layout, and ranks 0..tp-1 (by 0..ep-1)."""
    found: Dict[Tuple[int, int], List[str]] = {}  # (TP rank, EP rank) -> paths
    layouts, pipeline = set(), []
    for name in sorted(os.listdir(directory)):
        entry = _entry(name)
        if entry is None:
            continue
        layout, dp_rank, ep_rank, tp_rank, pp_rank = entry
        if pp_rank != 0:
            pipeline.append(name)
            continue
        if dp_rank != 0:
            continue  # DP replicas of the model; DP rank 0's copy is as good as any
        layouts.add(layout)
        found.setdefault((tp_rank, ep_rank), []).append(_entry_path(directory, name))
    if pipeline:
        raise NxdCheckpointError(f"{directory} is a pipeline-parallel NxD checkpoint ({', '.join(pipeline[:4])}"
                                 f"{' ...' if len(pipeline) > 4 else ''}); only pp_rank_00 (no pipeline parallelism) "
                                 "can be imported")
    if len(layouts) > 1:
        names = {"v1": "tp_rank_XX_pp_rank_XX", "v2": "dp_rank_XX_tp_rank_XX_pp_rank_XX.pt",
                 "v2-ep": "dp_rank_XX_ep_rank_XX_tp_rank_XX_pp_rank_XX.pt"}
        raise NxdCheckpointError(f"{directory} mixes the file names of NxD checkpoint layouts "
                                 f"({' and '.join(names[layout] for layout in sorted(layouts))}); keep one checkpoint "
                                 "per directory")
    files = RankFiles(directory, [], layouts.pop() if layouts else "v1")
    for (tp_rank, ep_rank), paths in found.items():
        if len(paths) > 1:
            raise NxdCheckpointError(f"{directory} holds more than one checkpoint for TP rank {tp_rank}"
                                     f"{f' and EP rank {ep_rank}' if files.layout == 'v2-ep' else ''}: "
                                     f"{', '.join(paths)}")
    _check_complete(files, found)
    files.expert_paths = [[found[(t, e)][0] for e in range(1 + max(e for _, e in found))]
                          for t in range(1 + max(t for t, _ in found))]
    files.paths = [row[0] for row in files.expert_paths]
    return files


def _check_complete(files: RankFiles, found: Dict[Tuple[int, int], List[str]]) -> None:
    """Every TP rank 0..tp-1 (by every EP rank 0..ep-1) has its file, else the absent ones are named."""
    if not found:
        raise FileNotFoundError(f"{files.directory} holds NxD rank files of DP ranks other than 0 only; NxD saves the "
                                "model from DP rank 0")
    tp, ep = 1 + max(t for t, _ in found), 1 + max(e for _, e in found)
    missing = [files.entry_name(t, e) for t in range(tp) for e in range(ep) if (t, e) not in found]
    if not missing:
        return
    verb = "is" if len(missing) == 1 else "are"
    if files.layout == "v2-ep":
        raise FileNotFoundError(f"{files.directory}: an expert-parallel checkpoint has a file for every TP rank "
                                f"0..{tp - 1} at every EP rank 0..{ep - 1}, but {', '.join(missing)} {verb} missing")
    raise FileNotFoundError(f"{files.directory}: TP ranks must be numbered 0..{tp - 1}, but {', '.join(missing)} "
                            f"{verb} missing (found {', '.join(files.entry_name(t) for t, _ in sorted(found))})")


def check_saved_tp(files: RankFiles, shard: RankShard, key: str, dim: int, full: int) -> None:
    """Refuse a checkpoint saved at more ranks than ``files`` holds: a missing last rank leaves 0..tp-2 contiguous,
    so only the slices tell, here how many of ``key``'s slices along ``dim`` make its ``full`` size."""
    piece = shard.get(key).shape[dim] if shard.get(key).dim() > dim else 0
    tp, saved_tp = len(files.paths), full // piece if piece and full % piece == 0 else 0
    if saved_tp > tp:
        raise FileNotFoundError(f"{shard.tensor_file(key)}: '{key}' is a 1/{saved_tp} slice, so the checkpoint was "
                                f"saved at tp={saved_tp}, but only {tp} rank(s) are present in {files.directory}; "
                                f"missing: {', '.join(files.entry_name(r) for r in range(tp, saved_tp))}")


def check_saved_ep(files: RankFiles, shard: RankShard, key: str, experts: int) -> None:
    """Refuse an expert-parallel checkpoint saved at more EP ranks than ``files`` holds: ``key``'s experts per file tell
    the saved degree."""
    local = shard.get(key).shape[0] if shard.get(key).dim() else 0
    saved_ep = experts // local if local and experts % local == 0 else 0
    if saved_ep > files.ep and files.layout == "v1":
        raise NxdCheckpointError(f"{shard.tensor_file(key)}: '{key}' holds {local} of the {experts} experts: it was "
                                 f"saved at ep={saved_ep} by parallel_layers.checkpointing.save (NxD's Lightning "
                                 "integration), whose files are per TP rank only and keep DP rank 0's experts; the "
                                 "other experts are in no file (save with trainer.save_checkpoint, which writes "
                                 "dp_rank_00_ep_rank_XX_tp_rank_XX_pp_rank_00.pt files, or with ep=1)")
    if saved_ep > files.ep and files.layout == "v2-ep":  # in the other layouts the shapes are refused later
        missing = [files.entry_name(t, e) for t in range(len(files.paths)) for e in range(files.ep, saved_ep)]
        raise FileNotFoundError(f"{shard.tensor_file(key)}: '{key}' holds {local} of the {experts} experts, so the "
                                f"checkpoint was saved at ep={saved_ep}, but only {files.ep} EP rank(s) are present in "
                                f"{files.directory}; missing: {', '.join(missing[:8])}"
                                f"{' ...' if len(missing) > 8 else ''} (or the config's expert count is not the "
                                "checkpoint's)")


# ---- reading the rank files ------------------------------------------------------------------------------------------

# Read size for the CRC check: large enough that the per-read overhead is negligible, small enough to bound memory.
_CRC_CHUNK_BYTES = 16 * 2**20
_CRC_THREADS = min(8, os.cpu_count() or 1)


def verify_zip_checksums(path: str, data_entries: bool = True) -> Dict[int, set]:
    """Read a ``torch.save`` zip archive's entries through ``zipfile``, which checks each CRC-32; damage is an
    ``NxdCheckpointError`` naming the file. With ``data_entries=False`` the storages' recorded CRCs are returned by
    size instead, for ``verify_storages``. A legacy (non-zip) file is left to ``torch.load``."""
    recorded: Dict[int, set] = {}
    try:
        if not zipfile.is_zipfile(path):
            return recorded
        with zipfile.ZipFile(path) as archive:
            for entry in archive.infolist():
                if not data_entries and "/data/" in entry.filename:
                    recorded.setdefault(entry.file_size, set()).add(entry.CRC)
                    continue
                with archive.open(entry) as data:
                    while data.read(_CRC_CHUNK_BYTES):
                        pass
    except FileNotFoundError:
        raise
    except Exception as error:  # noqa: BLE001 - BadZipFile, EOFError, struct.error, ... depending on the damage
        raise NxdCheckpointError(f"{path}: damaged zip archive (torch.save format): {type(error).__name__}: "
                                 f"{error}") from error
    return recorded


def verify_storages(path: str, tensors: Sequence[torch.Tensor], recorded: Dict[int, set]) -> None:
    """Each tensor's storage must have the CRC-32 the archive records for an entry of its size; only the storages used
    are read."""
    if not recorded:
        return  # legacy format: no checksums
    storages = list({t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}.values())

    def crc(storage) -> int:
        return zlib.crc32(torch.empty(0, dtype=torch.uint8).set_(storage).numpy())

    # zlib.crc32 releases the GIL on large buffers, so threads checksum storages in parallel.
    with concurrent.futures.ThreadPoolExecutor(min(_CRC_THREADS, len(storages) or 1)) as pool:
        for storage, value in zip(storages, pool.map(crc, storages)):
            if value not in recorded.get(storage.nbytes(), ()):
                raise NxdCheckpointError(f"{path}: a tensor storage of {storage.nbytes()} bytes fails its CRC-32 "
                                         "check (no entry of the archive records its checksum): the file is damaged")


def _torch_load(path: str, verify: bool = True, data_entries: bool = True) -> Tuple[Any, Dict[int, set]]:
    """``torch.load(weights_only=True)``, memory-mapped where possible, after the CRC checks; returns the object and the
    storages' recorded CRCs not yet checked."""
    recorded = verify_zip_checksums(path, data_entries) if verify else {}

    def load(mmap: bool):
        with torch.serialization.safe_globals([(_XlaTensorReference, XLA_TENSOR_REFERENCE)]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)

    try:
        try:
            return load(mmap=True), recorded
        except RuntimeError as error:
            if "mmap" not in str(error):
                raise
            return load(mmap=False), recorded  # the legacy (pre-zipfile) torch.save format cannot be memory-mapped
    except NxdCheckpointError as error:  # a malformed TensorReference
        raise NxdCheckpointError(f"{path}: {error}") from error
    except FileNotFoundError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever torch.load trips over in a damaged file, name the file
        if isinstance(error, pickle.UnpicklingError) and "Weights only load failed" in str(error):
            raise NxdCheckpointError(f"{path}: refused to load with torch.load(weights_only=True); it holds Python "
                                     f"objects beyond tensors and plain containers. Only load it unrestricted if you "
                                     f"trust where it came from. Detail: {error}") from error
        raise NxdCheckpointError(f"{path}: cannot be read as a torch checkpoint (truncated or damaged?): "
                                 f"{type(error).__name__}: {error}") from error


class RankShard:
    """One rank file's model state dict; xser references are resolved (memory-mapped) on first use. ``drop_none``
    drops keys whose value is None (what EP ranks other than 0 may hold for tensors they do not save)."""

    def __init__(self, path: str, model_key: Optional[str], verify_checksums: bool = True, drop_none: bool = False):
        self.path = path
        self.verify_checksums = verify_checksums
        # The storages are checked below, once it is known which of them hold the model.
        checkpoint, recorded = _torch_load(path, verify_checksums, data_entries=False)
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
            if key.endswith("_extra_state") or (value is None and drop_none):
                continue  # None: a tensor an expert-parallel rank other than 0 does not hold
            if not isinstance(value, (torch.Tensor, _XlaTensorReference)):
                raise NxdCheckpointError(f"{path}: '{key}' is a {type(value).__name__}, not a tensor")
            self.state[key] = value
        verify_storages(path, [v for v in self.state.values() if isinstance(v, torch.Tensor)], recorded)
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
            tensor, _ = _torch_load(file, self.verify_checksums)  # the file holds this tensor only: check it all
            if not isinstance(tensor, torch.Tensor):
                raise NxdCheckpointError(f"{file} (for '{key}' of {self.path}) holds a {type(tensor).__name__}, "
                                         "not a tensor")
            self._resolved[value.tid] = tensor
        return self._resolved[value.tid]

    get_tensor = get

    def get_rows(self, key: str, start: int, length: int) -> torch.Tensor:
        return self.get(key).narrow(0, start, length)


def open_shards(files: RankFiles, model_key: Optional[str], progress: bool,
                verify_checksums: bool = True) -> List[RankShard]:
    """Every rank's state dict (``model_key`` AUTO: the layout's), after checking that all ranks hold the same keys;
    ``verify_checksums`` checks each file's zip CRCs as it is read."""
    key = files.model_key if model_key == AUTO else model_key
    shards = []
    for rank, path in enumerate(files.paths):
        say(progress, f"reading TP rank {rank + 1}/{len(files.paths)}: {path}")
        shards.append(RankShard(path, key, verify_checksums))
    reference = shards[0]
    for shard in shards[1:]:
        extra = sorted(set(shard.state) - set(reference.state))
        absent = sorted(set(reference.state) - set(shard.state))
        if extra or absent:
            raise NxdCheckpointError(f"{shard.path}: its model keys differ from {reference.path}'s: "
                                     f"missing {absent[:5]}, extra {extra[:5]}")
    return shards


def open_expert_shards(files: RankFiles, shards: Sequence[RankShard], model_key: Optional[str], progress: bool,
                       verify_checksums: bool, is_expert: Callable[[str], bool]) -> List[List[RankShard]]:
    """Every (TP rank, EP rank)'s state dict, by TP rank then EP rank. Other EP ranks' files may lack the tensors that
    are not experts; their experts' keys must be EP rank 0's."""
    key = files.model_key if model_key == AUTO else model_key
    ranks = []
    for tp_rank, paths in enumerate(files.expert_paths):
        row = [shards[tp_rank]]
        for ep_rank, path in enumerate(paths[1:], start=1):
            say(progress, f"reading TP rank {tp_rank + 1}/{len(files.paths)}, EP rank {ep_rank + 1}/{files.ep}: {path}")
            row.append(RankShard(path, key, verify_checksums, drop_none=True))
            _check_expert_keys(row[0], row[-1], is_expert)
        ranks.append(row)
    return ranks


def _check_expert_keys(first: RankShard, other: RankShard, is_expert: Callable[[str], bool]) -> None:
    """``other`` (an EP rank's file) holds the experts' keys of ``first`` (EP rank 0's of the same TP rank), and no key
    ``first`` lacks."""
    mine = {k for k in other.state if is_expert(k)}
    theirs = {k for k in first.state if is_expert(k)}
    absent, extra = sorted(theirs - mine), sorted(set(other.state) - set(first.state))
    if absent or extra:
        raise NxdCheckpointError(f"{other.path}: its model keys differ from {first.path}'s (EP rank 0 of its TP rank): "
                                 f"missing experts {absent[:5]}, extra {extra[:5]}")


class ExpertPieces:
    """A TP rank's piece of each expert tensor, every expert in it, read from its EP ranks' files: a handle of
    ``NxdSource``'s ``TagSource``."""

    def __init__(self, shards: Sequence[RankShard]):
        self.shards, self.specs = list(shards), {}

    def get_rows(self, key: str, start: int, length: int) -> torch.Tensor:
        parts = [self.shards[ep_rank].get_rows(key, first, rows)
                 for ep_rank, first, rows in self.specs[key].expert_runs(start, length)]
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else self.shards[0].get_rows(key, 0, 0)

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.get_rows(key, 0, self.specs[key].full_shape[0])


def one_dtype(shards: Sequence[RankShard], key: str) -> torch.dtype:
    dtype = shards[0].get(key).dtype
    for shard in shards[1:]:
        if shard.get(key).dtype != dtype:
            raise NxdCheckpointError(f"{shard.tensor_file(key)}: '{key}' is {shard.get(key).dtype}, but "
                                     f"{shards[0].tensor_file(key)} holds it as {dtype}; the ranks must agree")
    return dtype


def check_pieces(shards: Sequence[RankShard], key: str, spec: ParamSpec, how: str) -> torch.dtype:
    """Every rank holds ``key`` as ``spec`` lays it out (else an error naming the file, the shape found and ``how``
    NxD lays it out), all in one dtype, which is returned."""
    want = spec.local_shape()
    for shard in shards:
        if tuple(shard.get(key).shape) != want:
            raise NxdCheckpointError(f"{shard.tensor_file(key)}: '{key}' has shape {list(shard.get(key).shape)}, but "
                                     f"the config needs {list(want)} ({how})")
    return one_dtype(shards, key)


def replicated(shards: Sequence[RankShard], key: str) -> torch.Tensor:
    """TP rank 0's copy of a tensor every rank holds whole; warns when another rank's copy differs."""
    value = shards[0].get(key)
    for shard in shards[1:]:
        other = shard.get(key)
        if not torch.equal(other, value):
            diff = (other.double() - value.double()).abs().max().item() if value.is_floating_point() else "n/a"
            say(True, f"warning: replicated '{key}' differs between {shards[0].path} and {shard.path} "
                      f"(max abs diff {diff}); using TP rank 0's")
    return value


# ---- the dense model -------------------------------------------------------------------------------------------------

def load_config_dict(config_json) -> Tuple[Dict[str, Any], str]:
    """The raw dict of a config.json (a file or a directory holding one), and its path."""
    path = os.fspath(config_json)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config {path} does not exist")
    with open(path) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as error:
            raise NxdCheckpointError(f"config {path} is not valid JSON: {error}") from error
    if not isinstance(raw, dict):
        raise NxdCheckpointError(f"config {path} holds a {type(raw).__name__}, not a JSON object")
    return raw, path


def expected_layout(config, model_class) -> Tuple[Dict[str, Tuple[int, ...]], Dict[str, str]]:
    """Shapes of the dense model's state dict, and its tied aliases (alias -> source) as HF's config sets them."""
    with torch.device("meta"):
        model = model_class(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    return shapes, tied_aliases(model)


def tied_aliases(model) -> Dict[str, str]:
    """{alias: source} for the tied parameters of an HF model: transformers 5's ``all_tied_weights_keys``, else every
    further name of one parameter object."""
    tied = getattr(model, "all_tied_weights_keys", None)
    if tied is not None:
        return dict(tied)
    names: Dict[int, List[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {alias: group[0] for group in names.values() for alias in group[1:]}


class NxdSource:
    """An NxD checkpoint's dense tensors as a ``TensorSource``, in the order added: ``laid_out`` reads one through NxD's
    layout of a key over the ranks' pieces (from dense row ``offset``, dims ``swap`` swapped); ``built`` builds one
    whole, kept until another is read. ``dtype`` casts floating tensors; ``keys`` are those written."""

    def __init__(self, shards: Sequence[RankShard], dtype: Optional[torch.dtype]):
        self.paths, self.cast = [shard.path for shard in shards], dtype
        self.tags = TagSource({shard.path: shard for shard in shards}, {})
        self.slab_bytes = self.tags.slab_bytes
        self.keys: List[str] = []
        self.entries: Dict[str, Tuple[Tuple[int, ...], torch.dtype, Any]] = {}
        self._last: Tuple[Optional[str], Optional[torch.Tensor]] = (None, None)

    def laid_out(self, key: str, shape, dtype: torch.dtype, nxd_key: str, spec: ParamSpec, offset: int = 0,
                 handles: Optional[List[str]] = None, swap: Optional[Tuple[int, int]] = None,
                 write: bool = True) -> None:
        self.tags.layout[nxd_key] = (spec, dtype, handles or self.paths)
        self._add(key, shape, dtype, (nxd_key, offset, swap), write)

    def add_handles(self, handles: Mapping[str, Any]) -> None:
        """Name further readers of pieces (``get_rows``, ``get_tensor``) for ``laid_out``'s ``handles``."""
        self.tags.handles.update(handles)

    def built(self, key: str, shape, dtype: torch.dtype, build: Callable[[], torch.Tensor], write: bool = True) -> None:
        self._add(key, shape, dtype, build, write)

    def _add(self, key: str, shape, dtype: torch.dtype, how, write: bool) -> None:
        self.entries[key] = (tuple(shape), dtype, how)
        if write:
            self.keys.append(key)

    def spec(self, key: str) -> ParamSpec:
        return ParamSpec(full_shape=self.entries[key][0])

    def dtype(self, key: str) -> torch.dtype:
        dtype = self.entries[key][1]
        return self.cast if self.cast is not None and dtype.is_floating_point else dtype

    def read_boxes(self, key: str, boxes) -> List[torch.Tensor]:
        how = self.entries[key][2]
        if callable(how):
            if self._last[0] != key:
                self._last = (None, None)  # the previous tensor is dropped before this one is built
                self._last = (key, how())
            return [narrowed(self._last[1], box) for box in boxes]
        nxd_key, offset, swap = how
        boxes = [shifted(box, offset) for box in boxes]
        if swap is None:
            return self.tags.read_boxes(nxd_key, boxes)
        read = self.tags.read_boxes(nxd_key, [_swapped(box, swap) for box in boxes])
        return [tensor.transpose(*swap).contiguous() for tensor in read]

    def whole(self, key: str) -> torch.Tensor:
        """The dense tensor of ``key`` in its stored dtype."""
        shape = self.entries[key][0]
        return self.read_boxes(key, [((0,) * len(shape), shape)])[0]

    def check_tied(self, alias: str, key: str) -> None:
        """A tied pair held under both names must agree, or the HF model would silently use one."""
        if not torch.equal(self.whole(alias), self.whole(key)):
            raise NxdCheckpointError(
                f"{self.paths[0]}: '{alias}' differs from '{key}', but the config ties them, so the HF model would "
                f"use '{key}' for both; set tie_word_embeddings to false in the config to keep both")


def _swapped(box, dims: Tuple[int, int]):
    """``box`` with its ``dims`` swapped: the box of the transposed tensor."""
    offsets, sizes = (list(part) for part in box)
    a, b = dims
    offsets[a], offsets[b], sizes[a], sizes[b] = offsets[b], offsets[a], sizes[b], sizes[a]
    return tuple(offsets), tuple(sizes)


def import_checkpoint(checkpoint_dir, output_dir, config, architecture: str,
                      plan: Callable[[List[RankShard], RankFiles, Optional[torch.dtype]], NxdSource], *, force: bool,
                      progress: bool, model_key: Optional[str], tag: Optional[str], dtype: Optional[torch.dtype],
                      verify_checksums: bool = True, reads_experts: bool = False) -> str:
    """The steps every family shares: check the output, open the rank files, let ``plan`` check everything and give the
    dense tensors, then write ``config.json`` and stream ``model.safetensors`` in transformers' saved form,
    atomically."""
    checkpoint_dir, output_dir = os.fspath(checkpoint_dir), os.fspath(output_dir)
    check_output_dir(checkpoint_dir, output_dir, force)
    files = locate_rank_files(checkpoint_dir, tag)
    if files.ep > 1 and not reads_experts:
        raise NxdCheckpointError(f"{files.directory} is an expert-parallel NxD checkpoint ({files.entry_name(0, 1)} "
                                 f"...: ep={files.ep}), but {architecture} has no experts; the NxD import reads "
                                 "expert-parallel checkpoints of Mixtral")
    shards = open_shards(files, model_key, progress, verify_checksums)
    source = plan(shards, files, dtype)

    def write(staging: str) -> None:
        parallel = f"tp={len(shards)}" + (f", ep={files.ep}" if files.ep > 1 else "")
        say(progress, f"writing {len(source.keys)} tensors ({parallel} merged) to {output_dir}")
        config.architectures = [architecture]
        config.save_pretrained(staging)
        layout = [(key, source.dtype(key), source.entries[key][0]) for key in source.keys]
        form = SavedForm.of_config(os.path.join(staging, "config.json"), layout)
        metadata = {"format": "pt", "source": "nxdtp merge of an NxD checkpoint", "nxd_tp_size": str(len(shards))}
        if files.ep > 1:
            metadata["nxd_ep_size"] = str(files.ep)
        with DenseWeightsWriter(staging, form.layout() if form else layout, metadata=metadata) as writer:
            stream(source, DenseSink(writer, form), source.keys)

    write_atomically(output_dir, write)
    say(progress, f"done: {output_dir}")
    return output_dir

"""The dense Hugging Face weights of a sharded model, written one tensor at a time by one writer
(``DenseWeightsWriter``) for ``nxdtp-merge``, the imports and ``save_pretrained`` (``save_dense``), so all write the
same directory for the same weights."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from .. import comm
from ..spec import ParamSpec
from ..topology import get_topology, tensor_parallel_group
from .durable import fsync_directory, make_directories, replace_atomically
from .experts import gather_experts
from .hf_form import SavedForm
from .index import TensorEntry, dtype_from_name, split_model_state
from .safetensors_stream import StreamingSafetensorsWriter

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# HF's names for the files of a sharded save (huggingface_hub's pattern "model{suffix}.safetensors").
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

Layout = List[Tuple[str, torch.dtype, Tuple[int, ...]]]


def dense_layout(entries: Dict[str, TensorEntry]) -> Layout:
    """(key, dtype, dense shape) of every stored tensor, in the entries' order."""
    return [(key, dtype_from_name(entry.dtype), tuple(entry.spec.unpadded_shape)) for key, entry in entries.items()]


def single_file(layout: Layout) -> Dict[str, List[str]]:
    """The shard plan of an unsharded save: every tensor in ``model.safetensors``."""
    return {WEIGHTS_NAME: [key for key, _, _ in layout]}


def write_order(files: Dict[str, List[str]]) -> List[str]:
    """The order in which the tensors of a shard plan are written: file by file, so one file is open at a time."""
    return [key for keys in files.values() for key in keys]


class DenseWeightsWriter:
    """Write the weight files of a dense HF directory, one tensor at a time in ``write_order(files)`` (``files``: a
    shard plan; more than one file adds HF's index). The files are renamed into place once all are complete; an
    earlier save's weight files not replaced are then removed."""

    def __init__(self, directory: str, layout: Layout, files: Optional[Dict[str, List[str]]] = None,
                 metadata: Optional[Dict[str, str]] = None, index_metadata: Optional[Dict[str, Any]] = None):
        self.directory = directory
        self.files = files if files is not None else single_file(layout)
        shapes = {key: (dtype, shape) for key, dtype, shape in layout}
        order = write_order(self.files)
        if sorted(order) != sorted(shapes):
            raise ValueError(f"the shard plan names tensors {sorted(set(order) ^ set(shapes))[:5]} that are not in the "
                             "layout once each")
        self._layouts = {name: [(key,) + shapes[key] for key in keys] for name, keys in self.files.items()}
        self._order = iter([(name, key) for name, keys in self.files.items() for key in keys])
        self._metadata = metadata
        self._index_metadata = dict(index_metadata or {})
        self._index_metadata["total_size"] = sum(
            torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for _, dtype, shape in layout)
        self._temporary = {name: os.path.join(directory, f".{name}.nxdtp-tmp-{os.getpid()}") for name in self.files}
        self._writer: Optional[StreamingSafetensorsWriter] = None
        self._file: Optional[str] = None
        self._closed = False

    def write(self, key: str, tensor: torch.Tensor) -> None:
        self._writer_for(key).write(key, tensor)

    def write_parts(self, key: str, parts: Iterable[torch.Tensor]) -> None:
        """Write tensor ``key`` from consecutive row ranges of it (``StreamingSafetensorsWriter.write_parts``)."""
        self._writer_for(key).write_parts(key, parts)

    def _writer_for(self, key: str) -> StreamingSafetensorsWriter:
        name, expected = next(self._order, (None, None))
        if key != expected:
            raise ValueError(f"{self.directory}: expected '{expected}' next, got '{key}'")
        if name != self._file:
            self._finish_file()
            self._writer = StreamingSafetensorsWriter(self._temporary[name], self._layouts[name], self._metadata)
            self._file = name
        return self._writer

    def _finish_file(self) -> None:
        if self._writer is not None:
            self._writer.close()  # checks that every tensor of the file was written; fsyncs it
            self._writer = None

    def close(self) -> List[str]:
        """Complete the save: every tensor written, the files renamed into place, the index written, stale weight
        files removed. Returns the weight files written, by name."""
        missing = next(self._order, None)
        if missing is not None:
            raise ValueError(f"{self.directory}: '{missing[1]}' and the tensors after it were never written")
        self._finish_file()
        for name, keys in self.files.items():
            if not keys:  # a model without tensors: an empty file, as HF writes one
                StreamingSafetensorsWriter(self._temporary[name], [], self._metadata).close()
        for name, temporary in self._temporary.items():
            os.replace(temporary, os.path.join(self.directory, name))
        written = list(self.files)
        if len(self.files) > 1:
            index = {"metadata": self._index_metadata,
                     "weight_map": {key: name for name, keys in self.files.items() for key in keys}}
            replace_atomically(os.path.join(self.directory, WEIGHTS_INDEX_NAME),
                               (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
            written.append(WEIGHTS_INDEX_NAME)
        for name in os.listdir(self.directory):
            stale = name in (WEIGHTS_NAME, WEIGHTS_INDEX_NAME) or _SHARD_FILE.fullmatch(name)
            if stale and name not in written and os.path.isfile(os.path.join(self.directory, name)):
                os.remove(os.path.join(self.directory, name))
        fsync_directory(self.directory)
        self._closed = True
        return written

    def abandon(self) -> None:
        """Leave the directory's weights as they were: close and remove the temporary files."""
        if self._writer is not None:
            self._writer.abandon()
            self._writer = None
        for temporary in self._temporary.values():
            if os.path.exists(temporary):
                os.remove(temporary)

    def __enter__(self) -> DenseWeightsWriter:
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None and not self._closed:
            self.close()
        elif kind is not None:
            self.abandon()


# ---- from a live model -----------------------------------------------------------------------------------------------

def save_dense(model: nn.Module, directory: str, *, state_dict: Optional[Dict[str, Any]] = None,
               is_writer: bool = True, plan_files: Optional[Callable[..., Dict[str, List[str]]]] = None,
               index_metadata: Optional[Callable[[Layout], Dict[str, Any]]] = None,
               write_beside: Optional[Callable[[str], None]] = None, check: Optional[Callable[[], None]] = None,
               what: str = "save_dense") -> None:
    """Collective: write the dense weights of the parallelized ``model`` to ``directory``, each tensor gathered on every
    rank, reassembled by its spec and written by the lowest rank whose ``is_writer`` is true. ``state_dict``: shards
    to write instead; ``plan_files(layout, held)``: the shard plan; ``index_metadata``, ``write_beside(directory)``
    and ``check()`` as named. An error on any rank raises on every rank after the last gather."""
    group = tensor_parallel_group()
    error: Optional[BaseException] = None
    plan: Optional[_DensePlan] = None
    try:
        if check is not None:
            check()
        plan = _plan_dense(model, state_dict, group.size, plan_files, what)
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        error = e
    comm.raise_on_every_rank_if_any_failed(error, what)
    writer: Optional[DenseWeightsWriter] = None
    if _is_the_writer(is_writer, what):
        try:
            writer = _open_dense_writer(directory, plan, index_metadata, what)
        except Exception as e:  # noqa: BLE001 - raised on every rank at the end, once every gather has run
            error = e
    writer, write_error = _gather_and_write(plan, group, writer)
    if writer is not None:
        write_error = _close_dense_writer(writer, directory, write_beside)
    comm.raise_on_every_rank_if_any_failed(error if error is not None else write_error, what)


@dataclasses.dataclass
class _DensePlan:
    """What ``save_dense`` writes, decided on every rank before any gather."""

    tensors: Dict[str, torch.Tensor]
    entries: Dict[str, TensorEntry]
    layout: Layout
    saved: Layout
    files: Dict[str, List[str]]
    order: List[str]
    form: Optional[SavedForm]

    def saved_tensors(self, key: str, dense: torch.Tensor) -> Dict[str, torch.Tensor]:
        return self.form.tensors(key, dense) if self.form is not None else {key: dense}


def _plan_dense(model: nn.Module, state_dict: Optional[Dict[str, Any]], tp_size: int,
                plan_files: Optional[Callable[..., Dict[str, List[str]]]], what: str) -> _DensePlan:
    state = _state_to_save(model, state_dict)
    # Before only the writer reads tensors to the host: on XLA a read of a pending tensor would run the step's
    # graph on the writer alone.
    comm.materialize(list(state.values()))
    try:
        tensors, entries = split_model_state(model, state, tp_size)
    except (ValueError, TypeError) as e:
        if state_dict is None:
            raise
        raise type(e)(f"{what}: the state_dict passed is not this rank's shards of the model ({e}); pass "
                      "model.state_dict(), or None to save the model's own weights") from None
    for key, entry in entries.items():
        if entry.spec.is_sharded and entry.spec.num_partitions != tp_size:
            raise ValueError(f"'{key}' is split into {entry.spec.num_partitions} pieces, but the tensor-parallel "
                             f"group has {tp_size} ranks")
    layout = dense_layout(entries)
    form = SavedForm.of_model(model, layout)
    parts = form.parts() if form is not None else [(key, key, dtype, shape) for key, dtype, shape in layout]
    saved = form.save_order() if form is not None else layout
    source_of = {name: key for key, name, _, _ in parts}
    nbytes = {key: torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
              for key, dtype, shape in layout}
    held = {name: (key, nbytes[key]) for key, name, _, _ in parts if form is not None and form.converts(key)}
    files = plan_files(saved, held) if plan_files is not None else single_file(saved)
    # Each dense tensor is gathered when the first of its saved parts is due in the files' order.
    order = list(dict.fromkeys(source_of[name] for name in write_order(files)))
    return _DensePlan(tensors, entries, layout, saved, files, order, form)


def _state_to_save(model: nn.Module, state_dict: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The model's state dict, or the user's ``state_dict`` with the model's ``_extra_state`` entries (its specs)."""
    live = model.state_dict(keep_vars=True)
    if state_dict is None:
        return live
    # The user's tensors with the model's specs, so a dict that lost its '_extra_state' entries still splits
    # as the model does (or is refused by shape), never written as if each rank's piece were a full tensor.
    state = {key: value for key, value in state_dict.items() if not key.endswith("_extra_state")}
    state.update({key: value for key, value in live.items() if key.endswith("_extra_state")})
    return state


def _is_the_writer(is_writer: Any, what: str) -> bool:
    """Collective: whether this rank writes, the lowest global rank whose ``is_writer`` is true."""
    writers = comm.all_gather_object(bool(is_writer))
    if not any(writers):
        raise ValueError(f"{what}: no rank is the main process (is_main_process=False on all {len(writers)} ranks); "
                         "pass True on the rank that should write (by default every rank passes True, and global "
                         "rank 0 writes)")
    return writers.index(True) == get_topology().rank


def _open_dense_writer(directory: str, plan: _DensePlan, index_metadata: Optional[Callable[[Layout], Dict[str, Any]]],
                       what: str) -> DenseWeightsWriter:
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(f"{what}: {directory} exists and is not a directory; pass a directory path")
    make_directories(directory)
    return DenseWeightsWriter(directory, plan.saved, plan.files, metadata={"format": "pt"},
                              index_metadata=index_metadata(plan.layout) if index_metadata else None)


def _gather_and_write(plan: _DensePlan, group, writer: Optional[DenseWeightsWriter]
                      ) -> Tuple[Optional[DenseWeightsWriter], Optional[BaseException]]:
    """Gather every tensor in the plan's order, and on the writer write each. Returns the writer (None once a write
    failed, its files abandoned) and that failure."""
    error: Optional[BaseException] = None
    due = iter(write_order(plan.files))
    pending: Dict[str, torch.Tensor] = {}   # saved parts gathered and not yet due in the files' order
    next_due = next(due, None)
    for key in plan.order:
        # Every rank runs every gather, whatever failed on the writer, so no rank waits alone in a collective.
        entry, dense = plan.entries[key], None
        try:
            dense = gather_dense(plan.tensors[key], entry.spec, group, dtype=dtype_from_name(entry.dtype),
                                 keep=writer is not None)
            if writer is not None:
                pending.update(plan.saved_tensors(key, dense))
                while next_due in pending:
                    writer.write(next_due, pending.pop(next_due).contiguous())
                    next_due = next(due, None)
        except Exception as e:  # noqa: BLE001 - only the keeping rank (the writer) assembles, so only it fails here
            if writer is not None:
                error = e
                writer.abandon()
                writer = None
        del dense
    return writer, error


def _close_dense_writer(writer: DenseWeightsWriter, directory: str,
                        write_beside: Optional[Callable[[str], None]]) -> Optional[BaseException]:
    """Finish the files, then write what goes beside them; on failure abandon the files and return the error."""
    try:
        writer.close()
        if write_beside is not None:
            write_beside(directory)
    except Exception as e:  # noqa: BLE001
        writer.abandon()
        return e
    return None


def gather_dense(local: torch.Tensor, spec: ParamSpec, group, *, dtype: Optional[torch.dtype] = None,
                 keep: bool = True) -> Optional[torch.Tensor]:
    """Collective over the TP ``group`` (and the expert-parallel one where ``spec`` splits experts): the dense host
    tensor of which ``local`` is this rank's piece, on the ranks that ``keep`` it (None elsewhere), from pieces
    broadcast one at a time. An error while assembling is raised after the remaining broadcasts. The result may be a
    view of the padded tensor."""
    dtype = dtype or local.dtype
    local, spec = gather_experts(local, spec)
    if not spec.is_sharded:
        return spec.dense_from_full(local.detach().to("cpu")) if keep else None
    piece = local.detach().to("cpu")
    received = 0

    def receive(rank: int) -> torch.Tensor:
        nonlocal received
        received += 1
        return comm.broadcast(piece, group, src_group_rank=rank)

    try:
        return spec.dense_from_full(spec.full_from_pieces(receive, dtype)) if keep else None
    finally:
        for rank in range(received, spec.num_partitions):
            receive(rank)

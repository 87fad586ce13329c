"""Export a sharded nxdtp checkpoint to a torch.distributed.checkpoint (DCP) directory, offline, in one process.

``export_dcp(checkpoint_dir, output_dir)`` (``nxdtp-merge CKPT OUT --to dcp``) writes what a native PyTorch job
(DTensor TP, FSDP2, TorchTitan, transformers) loads with ``torch.distributed.checkpoint.load``:

* the model's tensors at the top level under the dense Hugging Face ``state_dict`` names (no ``model.`` prefix), with
  the real shapes (vocabulary padding, zero heads and repeated KV heads dropped), each tied name as the dense model's
  ``state_dict`` has it (every name, the same values);
* the LR scheduler's ``last_epoch`` under ``lr_scheduler`` and the step under ``train_state`` (``step``,
  ``ntokens_seen``), where TorchTitan's checkpoints keep them;
* the optimizer state under ``optimizer``, keyed as ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(
  model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True))`` keys it for the dense model:
  ``optimizer.state.<param>.<exp_avg|exp_avg_sq|step>`` and ``optimizer.param_groups.<param>.<hyperparameter>``, so
  ``dcp.load`` then ``set_optimizer_state_dict`` restore it. Only state saved from a live optimizer and model (keyed
  by parameter name) can be named so; NxD's ``optimizer.state_dict()`` form (keyed by index) is left out with a
  warning.

The files are written by torch's own ``FileSystemWriter`` through ``dcp.save(..., no_dist=True)``; only the save
planner is nxdtp's: instead of whole tensors it plans one chunk per run of rows a TP rank's piece contributes to the
dense tensor (``ParamSpec.dense_runs_of_piece``, so fused/strided weights, padding and repeated heads are the layout
algebra's business, not this module's), at its offset in the dense tensor, cut along dim 0 into row ranges of at most
``CHUNK_BYTES``, and reads each from the rank file only when the writer asks for it. No full tensor is ever assembled.
DCP's global plan check (chunks inside the tensor, no overlap, full coverage) runs on the result.

Memory: ``FileSystemWriter`` keeps every tensor it wrote to a file until that file is closed, so with its default of
one file per rank the whole checkpoint would sit in memory. The export therefore writes one file per chunk
(``single_file_per_rank=False``), at the cost of many small files (``__0_<n>.distcp``; every DCP reader handles them),
and collects the chunks ``torch.save`` leaves in reference cycles as it goes (``nxdtp.checkpointing.cycles``): the peak
is one chunk (at most ``CHUNK_BYTES``) plus ``COLLECT_BYTES`` of written ones and the reader's buffers.

Safety is ``nxdtp-merge``'s: the source is checked (and its files verified) before anything is written, the output is
written into a temporary sibling and renamed into place, a non-empty ``output_dir`` is refused unless ``force``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..spec import ParamSpec
from ..version import __version__
from .cycles import CycleCollector
from .dense_optimizer import MASTER_PREFIX
from .durable import write_bytes_durably
from .index import CheckpointIndex, dtype_from_name, is_zero1_optimizer_index, optim_file
from .merge import (
    TRAINER_STATE_FILE,
    DenseOptimizerTensor,
    dense_optimizer_state,
    optimizer_file_names,
    optimizer_values,
    plan_plain_optimizer,
)
from .output_dir import write_atomically
from .tag_source import CONFIG_FILE, choose_source, config_source, copy_if_present, model_file_names, progress_bar

OPTIMIZER_KEY = "optimizer"
LR_SCHEDULER_KEY, TRAIN_STATE_KEY = "lr_scheduler", "train_state"  # TorchTitan's names
EXPORT_RECORD_FILE = "nxdtp_dcp_export.json"
# The most bytes one written chunk holds: a run of a TP piece larger than this is written as several chunks, row ranges
# along dim 0, so the export never holds more of a tensor than this (tests lower it to cut small tensors).
CHUNK_BYTES = 64 << 20
# Written chunks left for the garbage collector (below) are collected once they add up to this many bytes.
COLLECT_BYTES = 16 << 20

__all__ = ["export_dcp", "OPTIMIZER_KEY"]


@dataclasses.dataclass
class _Chunk:
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    read: Callable[[], torch.Tensor]


@dataclasses.dataclass
class _Tensor:
    shape: Tuple[int, ...]
    dtype: torch.dtype
    chunks: List[_Chunk]


@dataclasses.dataclass
class ExportResult:
    output_dir: str
    tag_dir: str
    model_keys: int
    optimizer_keys: int
    files: int
    notes: List[str]


def export_dcp(checkpoint_dir: str, output_dir: str, tag: Optional[str] = None, force: bool = False,
               progress: bool = True, config: Optional[str] = None, *, verify: bool = True) -> ExportResult:
    """Write the DCP form of a sharded nxdtp checkpoint to ``output_dir`` (module docstring); return what was written.

    ``checkpoint_dir``, ``tag``, ``force``, ``config`` and ``verify`` are as for ``merge``: a checkpoint directory
    (its newest intact tag, or ``tag``) or a complete tag directory; the tag's ``config.json`` (or ``config``) is
    copied beside the DCP files, where an import finds it."""
    def reads(tag_dir: str, index: CheckpointIndex) -> List[str]:
        names = model_file_names(index) + optimizer_file_names(index)
        if config is None and CONFIG_FILE in (index.files or {}):
            names.append(CONFIG_FILE)
        return [name for name in names if index.files is None or name in index.files]

    tag_dir, index, model_files = choose_source(checkpoint_dir, tag, output_dir, force, verify, reads)
    config_path = config_source(tag_dir, config)
    optim_files: Dict[str, Any] = {}
    notes: List[str] = []
    try:
        tensors = _model_tensors(index, model_files)
        optimizer_state = _exported_optimizer_state(tag_dir, index, optim_files, notes)

        trainer_state = None
        if os.path.isfile(os.path.join(tag_dir, TRAINER_STATE_FILE)):
            with open(os.path.join(tag_dir, TRAINER_STATE_FILE)) as f:
                trainer_state = json.load(f)
        titan_states = torchtitan_states(trainer_state, notes)

        def write(staging: str) -> int:
            bar = progress_bar(sum(len(t.chunks) for t in optimizer_state.values() if isinstance(t, _Tensor))
                            + sum(len(t.chunks) for t in tensors.values()), f"dcp {os.path.basename(tag_dir)}",
                            progress)
            try:
                _save(staging, tensors, optimizer_state, bar, titan_states)
            finally:
                bar.close()
            copy_if_present(config_path, os.path.join(staging, CONFIG_FILE))
            record = {"source": os.path.abspath(tag_dir), "source_tensor_model_parallel_size":
                      index.tensor_model_parallel_size, "nxdtp_version": __version__, "notes": notes}
            if trainer_state is not None:
                record["trainer_state"] = trainer_state
            write_bytes_durably(os.path.join(staging, EXPORT_RECORD_FILE), json.dumps(record, indent=1).encode())
            return sum(1 for name in os.listdir(staging) if name.endswith(".distcp"))

        files = write_atomically(output_dir, write)
    finally:
        model_files.clear()
        optim_files.clear()
    return ExportResult(output_dir=output_dir, tag_dir=tag_dir, model_keys=len(tensors),
                        optimizer_keys=len(optimizer_state), files=files, notes=notes)


# ---- what to write ---------------------------------------------------------------------------------------------------

def _exported_optimizer_state(tag_dir: str, index: CheckpointIndex, optim_files: Dict[str, Any],
                              notes: List[str]) -> Dict[str, Any]:
    """The optimizer state to export, by DCP key; the files it reads are added to ``optim_files`` (closed by the
    caller), and why state is left out to ``notes``."""
    if index.optimizer is None:
        notes.append("the checkpoint holds no optimizer state")
        return {}
    zero1 = is_zero1_optimizer_index(index.optimizer)
    try:
        if zero1:
            plan, files, why_not = dense_optimizer_state(tag_dir, index)
        else:
            plan, files, why_not = plan_plain_optimizer(tag_dir, index, index.tensors)
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{os.path.join(tag_dir, 'nxdtp_index.json')} is damaged: malformed optimizer entry "
                         f"{e}") from None
    optim_files.update(files)
    if plan is None:
        message = f"{tag_dir}: optimizer state left out of the DCP export: {why_not}"
        warnings.warn(message, stacklevel=3)
        notes.append(message)
        return {}
    return _zero1_optimizer_state(plan, notes) if zero1 else _optimizer_state(tag_dir, index, plan, optim_files)


def piece_chunks(spec: ParamSpec, rank: int, copies: bool = False
                 ) -> List[Tuple[Tuple[int, ...], Tuple[int, ...], Dict[int, Tuple[int, int]]]]:
    """The DCP chunks of the dense tensor of ``spec`` that TP rank ``rank``'s piece holds: ``(offsets, sizes, box)``,
    one per run of the piece's rows that is the first copy of its dense rows (``dense_runs_of_piece``), or with
    ``copies`` the other copies (``copy_runs_of_piece``); ``box`` is ``{dim: (start, length)}`` within the piece
    (``{}``: all of it). A tensor replicated over TP is one chunk, TP rank 0's (the others' are copies). The one
    chunk planner of both DCP paths: the offline export (``_chunks``) and a running job's state dict
    (``dcp_state.DenseView``)."""
    shape = tuple(spec.unpadded_shape)
    if not spec.is_sharded:
        return [((0,) * len(shape), shape, {})] if (rank == 0) != copies else []
    dim = spec.partition_dim
    chunks = []
    for start, length, dense_start in (spec.copy_runs_of_piece if copies else spec.dense_runs_of_piece)(rank):
        offsets, sizes = [0] * len(shape), list(shape)
        offsets[dim], sizes[dim] = dense_start, length
        chunks.append((tuple(offsets), tuple(sizes), {dim: (start, length)}))
    return chunks


def _chunks(spec: ParamSpec, dtype: torch.dtype, read_piece: Callable[[int, Dict[int, Tuple[int, int]]], torch.Tensor]
            ) -> List[_Chunk]:
    """The chunks of the dense tensor of ``spec`` (``piece_chunks`` of every rank), cut along dim 0 into row ranges
    of at most ``CHUNK_BYTES`` (``_row_ranges``); each is read by ``read_piece(rank, box)``, ``box`` being
    ``{dim: (start, length)}`` within the piece."""
    shape = tuple(spec.unpadded_shape)
    if not spec.is_sharded and (not shape or tuple(spec.full_shape) != shape):
        def read_whole() -> torch.Tensor:
            return spec.dense_from_full(read_piece(0, {})).to(dtype).contiguous()

        return [_Chunk(offsets=(0,) * len(shape), sizes=shape, read=read_whole)]
    dim = spec.partition_dim
    chunks = []
    for rank in range(spec.num_partitions if spec.is_sharded else 1):
        for offsets, sizes, box in piece_chunks(spec, rank):
            for row_start, rows, dense_row in _row_ranges(shape, dtype, dim, box, 0 if dim is None else offsets[dim]):
                cut = {**box, 0: (row_start, rows)}

                def read(rank=rank, cut=cut) -> torch.Tensor:
                    return read_piece(rank, cut).to(dtype).contiguous()

                chunks.append(_Chunk(offsets=(dense_row,) + offsets[1:], sizes=(rows,) + sizes[1:], read=read))
    return chunks


def _row_ranges(shape: Tuple[int, ...], dtype: torch.dtype, dim: Optional[int], box: Dict[int, Tuple[int, int]],
                dense_offset: int):
    """``(piece_row, rows, dense_row)``: the run ``box`` of a piece (along ``dim``; the whole piece when ``dim`` is
    None) cut along dim 0 into ranges of at most ``CHUNK_BYTES`` (at least one row each). Only dim 0 is cut, so a
    range of a run along dim 0 lies at ``dense_offset`` plus its place in the run, and any other range at its own
    rows (dim 0 is whole there)."""
    first, total = box.get(0, (0, shape[0]))
    row_elements = math.prod(box.get(d, (0, n))[1] for d, n in enumerate(shape) if d)
    step = max(1, CHUNK_BYTES // max(1, row_elements * torch.empty((), dtype=dtype).element_size()))
    for offset in range(0, total or 1, step):  # an empty tensor: one empty chunk
        rows = min(step, total - offset)
        yield first + offset, rows, (dense_offset if dim == 0 else first) + offset


def _rows_reader(handles: Dict[str, Any], files: List[str], key: str):
    """``read(rank, box)``: the part ``box`` (``{dim: (start, length)}``) of TP rank ``rank``'s piece of ``key``,
    reading from its file only the rows of dim 0 the box names (all of them when it names none)."""
    def read(rank: int, box: Dict[int, Tuple[int, int]]) -> torch.Tensor:
        handle = handles[files[rank]]
        tensor = handle.get_rows(key, *box[0]) if 0 in box else handle.get_tensor(key)
        return _narrowed(tensor, box)

    return read


def _narrowed(tensor: torch.Tensor, box: Dict[int, Tuple[int, int]], skip_rows: bool = True) -> torch.Tensor:
    """``tensor`` narrowed to ``box`` along every dim it names (but dim 0 when ``skip_rows``: already read so)."""
    for d, (start, length) in box.items():
        if d or not skip_rows:
            tensor = tensor.narrow(d, start, length)
    return tensor


def _piece_reader(read_piece: Callable[[int], torch.Tensor]):
    """``read(rank, box)`` for a piece only readable whole (ZeRO-1's, reassembled from its DP shards)."""
    def read(rank: int, box: Dict[int, Tuple[int, int]]) -> torch.Tensor:
        return _narrowed(read_piece(rank), box, skip_rows=False)

    return read


def _model_tensors(index: CheckpointIndex, model_files: Dict[str, Any]) -> Dict[str, _Tensor]:
    """Every name of the dense model's state_dict (tied names too) -> its dense shape, dtype and chunks."""
    tensors: Dict[str, _Tensor] = {}
    tp = index.tensor_model_parallel_size
    for key, entry in index.tensors.items():
        dtype = dtype_from_name(entry.dtype)
        chunks = _chunks(entry.spec, dtype, _rows_reader(model_files, entry.files(tp), key))
        for name in [key] + list(entry.aliases):
            tensors[name] = _Tensor(shape=tuple(entry.spec.unpadded_shape), dtype=dtype, chunks=chunks)
    return tensors


def _optimizer_state(tag_dir: str, index: CheckpointIndex, plan, handles: Dict[str, Any]) -> Dict[str, Any]:
    """The flattened optimizer state of the dense model (``state.<param>.<field>`` and
    ``param_groups.<param>.<hyperparameter>``, as torch's ``_flatten_optim_state_dict`` names them)."""
    tp = index.tensor_model_parallel_size
    rank_files = [optim_file(r) for r in range(tp)]
    state: Dict[str, Any] = {}
    for name, (key, fields) in plan:
        spec = index.tensors[key].spec
        for field, kind, shape in fields:
            tensor_key = f"{name}/{field}"
            dtype = handles[rank_files[0]].dtype(tensor_key)
            read = _rows_reader(handles, rank_files, tensor_key)
            if kind in ("shard", "replicate"):  # shaped like the parameter's piece: laid out like the parameter
                chunks = _chunks(spec, dtype, read)
                dense_shape = tuple(spec.unpadded_shape)
            else:  # 'step' and other tensors not shaped like the parameter: TP rank 0's value
                chunks = _chunks(ParamSpec(full_shape=tuple(shape)), dtype, read)
                dense_shape = tuple(shape)
            state[f"state.{name}.{field}"] = _Tensor(shape=dense_shape, dtype=dtype, chunks=chunks)
    state.update(_tuples_back(optimizer_values(tag_dir)))
    return state


def _zero1_optimizer_state(dense_state: Dict[str, Any], notes: List[str]) -> Dict[str, Any]:
    """ZeRO-1 state for DCP: a tensor shaped like its parameter is chunked like the parameter, each chunk read from
    the TP piece it lies in (that piece reassembled from its DP shards: at most one piece in memory); other tensors
    ('step') are one chunk. The fp32 master weights are not optimizer state of the dense model and are left out."""
    state: Dict[str, Any] = {}
    for key, value in dense_state.items():
        if isinstance(value, DenseOptimizerTensor):
            if key.startswith(MASTER_PREFIX):
                continue
            if value.spec is not None and value.read_piece is not None:  # one TP piece at a time, cut like the model's
                chunks = _chunks(value.spec, value.dtype, _piece_reader(value.read_piece))
            else:
                chunks = [_Chunk(offsets=(0,) * len(value.shape), sizes=value.shape, read=value.read)]
            state[key] = _Tensor(shape=value.shape, dtype=value.dtype, chunks=chunks)
        else:
            state[key] = value
    notes.append("ZeRO-1's fp32 master weights are left out (the model's tensors are the weights); a plain "
                 "nxdtp-merge writes them beside the HF model")
    return _tuples_back(state)


def torchtitan_states(trainer_state: Optional[dict], notes: List[str]) -> Dict[str, Dict[str, Any]]:
    """The LR scheduler and step where TorchTitan's checkpoints keep them: ``lr_scheduler.last_epoch`` (TorchTitan
    saves only that; its schedules are functions of it) and ``train_state.step`` / ``train_state.ntokens_seen``
    (nxdtp does not count tokens: 0, with a note). From the tag's trainer state (``save``'s ``scheduler`` and
    ``global_step``); what it lacks is left out, with a note."""
    trainer_state = trainer_state or {}
    states: Dict[str, Dict[str, Any]] = {}
    scheduler = trainer_state.get("scheduler")
    if isinstance(scheduler, dict) and isinstance(scheduler.get("last_epoch"), int):
        states[LR_SCHEDULER_KEY] = {"last_epoch": scheduler["last_epoch"]}
    else:
        notes.append("no LR scheduler state in the checkpoint: 'lr_scheduler' left out")
    step = trainer_state.get("global_step")
    if isinstance(step, int):
        states[TRAIN_STATE_KEY] = {"step": step, "ntokens_seen": int(trainer_state.get("ntokens_seen", 0))}
        if "ntokens_seen" not in trainer_state:
            notes.append("train_state.ntokens_seen is 0: nxdtp's checkpoint does not count tokens")
    else:
        notes.append("no 'global_step' in the checkpoint's trainer state: 'train_state' left out")
    return states


def _tuples_back(values: Dict[str, Any]) -> Dict[str, Any]:
    """JSON made the tuples of torch's optimizers (Adam's betas) lists: give them back."""
    return {key: tuple(value) if isinstance(value, list) else value for key, value in values.items()}


# ---- writing through torch.distributed.checkpoint --------------------------------------------------------------------

def _save(directory: str, tensors: Dict[str, _Tensor], optimizer_state: Dict[str, Any], bar,
          other_states: Optional[Dict[str, Dict[str, Any]]] = None) -> None:
    import torch.distributed.checkpoint as dcp

    def placeholder(value: Any) -> Any:
        return torch.empty(value.shape, dtype=value.dtype, device="meta") if isinstance(value, _Tensor) else value

    state_dict: Dict[str, Any] = {name: placeholder(t) for name, t in tensors.items()}
    if optimizer_state:
        if OPTIMIZER_KEY in state_dict:
            raise ValueError(f"the model has a tensor named '{OPTIMIZER_KEY}', the key the optimizer state goes under")
        state_dict[OPTIMIZER_KEY] = {key: placeholder(value) for key, value in optimizer_state.items()}
    for key, values in (other_states or {}).items():
        if key in state_dict:
            raise ValueError(f"the model has a tensor named '{key}', the key TorchTitan keeps its {key} under")
        state_dict[key] = dict(values)
    chunked = dict(tensors)
    chunked.update({f"{OPTIMIZER_KEY}.{key}": value for key, value in optimizer_state.items()
                    if isinstance(value, _Tensor)})
    writer = dcp.FileSystemWriter(directory, single_file_per_rank=False, sync_files=True, overwrite=False)
    with warnings.catch_warnings():
        # dcp.save warns that it runs without a process group: that is the point here.
        warnings.filterwarnings("ignore", message=".*(process group|no_dist|torch.distributed).*")
        dcp.save(state_dict, storage_writer=writer, planner=_ChunkedSavePlanner(chunked, bar), no_dist=True)


def _chunked_save_planner_class():
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_local_save_plan
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    class ChunkedSavePlanner(DefaultSavePlanner):
        """DCP's default save planner, except that the tensors in ``chunked`` (flattened key -> _Tensor) are planned
        as their chunks at their offsets in the dense tensor, and each chunk is read only when the writer resolves
        it. Everything else (non-tensor values, flattening, the global plan and its validation) is DCP's own."""

        def __init__(self, chunked: Dict[str, _Tensor], bar):
            super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True)
            self._chunked = chunked
            self._reads: Dict[Tuple[str, Tuple[int, ...]], _Chunk] = {}
            self._bar = bar
            self._written = CycleCollector(COLLECT_BYTES)   # the chunks the writer's torch.save leaves in cycles

        def create_local_plan(self):
            missing = sorted(set(self._chunked) - set(self.state_dict))
            if missing:
                raise AssertionError(f"chunked tensors {missing[:3]} are not in the flattened state dict")
            others = {key: value for key, value in self.state_dict.items() if key not in self._chunked}
            plan = create_default_local_save_plan(others, self.is_coordinator)
            items = []
            for key, tensor in self._chunked.items():
                properties = TensorProperties(dtype=tensor.dtype)
                for chunk in tensor.chunks:
                    offsets = torch.Size(chunk.offsets)
                    items.append(WriteItem(
                        index=MetadataIndex(fqn=key, offset=offsets), type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets,
                                                                               sizes=torch.Size(chunk.sizes)),
                                                    properties=properties, size=torch.Size(tensor.shape))))
                    self._reads[(key, tuple(chunk.offsets))] = chunk
            plan = dataclasses.replace(plan, items=items + list(plan.items), planner_data=self.mappings)
            self.plan = plan
            return plan

        def resolve_data(self, write_item):
            chunk = self._reads.get((write_item.index.fqn, tuple(write_item.index.offset or ())))
            if chunk is None:
                return super().resolve_data(write_item)
            data = chunk.read()
            self._written.passed(data)
            if tuple(data.shape) != tuple(chunk.sizes):
                raise ValueError(f"'{write_item.index.fqn}': a chunk read {list(data.shape)} rows, the plan says "
                                 f"{list(chunk.sizes)}")
            self._bar.update(1)
            return data

    return ChunkedSavePlanner


def _ChunkedSavePlanner(chunked: Dict[str, _Tensor], bar):
    return _chunked_save_planner_class()(chunked, bar)

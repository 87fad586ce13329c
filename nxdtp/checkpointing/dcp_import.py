"""Import a torch.distributed.checkpoint (DCP) directory written by a native job into a dense Hugging Face directory.

``import_dcp(dcp_dir, output_dir)`` (``nxdtp-merge DCP_DIR OUT --from-dcp``) reads what a job using DTensor TP, FSDP2
or TorchTitan's HF-named layout saves with ``dcp.save``: the model's tensors at the top level under the HF model's
``state_dict`` names, and optionally the optimizer state under ``optimizer`` in torch's flattened form
(``optimizer.state.<param>.<field>``, ``optimizer.param_groups.<param>.<hyperparameter>``), which is also what
``nxdtp-merge --to dcp`` writes. It writes

* ``model.safetensors`` with every tensor of the model (each tied tensor once), read through torch's
  ``FileSystemReader`` (``RowReader``: DCP's resharding read, whatever sharding wrote the saved chunks): small tensors
  several at a time, a tensor over ``BATCH_BYTES`` in row ranges of at most that size, streamed into the file range by
  range, so no large tensor is ever whole in memory; and the ``config.json`` the model is built from;
* the optimizer state, if there is one, beside it as ``nxdtp-merge`` writes it for a merged nxdtp checkpoint
  (``optimizer.safetensors`` / ``optimizer.json``, module ``dense_optimizer``), which
  ``nxdtp.checkpointing.load_dense_optimizer_state`` restores into a dense model's optimizer or, cut by each
  parameter's TP layout, into a model ``from_pretrained_sharded`` built at any TP size.

The model class is the config's ``architectures[0]``, built on the meta device only to learn the names, shapes and
ties the checkpoint must provide: a tensor the model needs that the checkpoint lacks, one with another shape, or a
model key the model does not have (another naming, such as TorchTitan's own Llama names) is refused naming it, before
anything is written. Output safety is the merge's: a temporary sibling renamed into place, a non-empty ``output_dir``
refused unless ``force``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from .cycles import CycleCollector
from .dense import DenseWeightsWriter
from .merge import DenseOptimizerTensor, write_dense_optimizer
from .output_dir import check_output_dir, write_atomically
from .pipeline import rows_within
from .tag_source import CONFIG_FILE, progress_bar

OPTIMIZER_PREFIX = "optimizer."
# What TorchTitan and torch's own examples keep beside the model in the same DCP checkpoint; not model tensors.
NOT_MODEL_PREFIXES = (OPTIMIZER_PREFIX, "lr_scheduler", "train_state", "dataloader", "extra_state")
EXPORT_RECORD_FILE = "nxdtp_dcp_export.json"
# Small tensors are read together, up to this many bytes per read; a tensor larger than this is read and written in
# row ranges (along dim 0) of at most this many bytes, so none is ever in memory whole (tests lower it).
BATCH_BYTES = 64 << 20
# Chunks torch.load left for the garbage collector (below) are collected once they add up to this many bytes.
COLLECT_BYTES = 16 << 20

__all__ = ["import_dcp", "ImportResult"]


@dataclasses.dataclass
class ImportResult:
    output_dir: str
    model_keys: int
    optimizer_keys: int
    notes: List[str]


@dataclasses.dataclass
class DcpCheckpoint:
    """A DCP checkpoint as the import reads it, checked against the model its config names (``read_checkpoint``):
    the model's tensors to write ``layout`` [(first name, dtype, shape)], the DCP key holding each (``sources``), the
    model's tensors as the config's class builds them (``expected``: first name -> (shape, tied names)), the
    flattened optimizer state (``optimizer_state``: tensors as ``DenseOptimizerTensor`` read when asked, other values
    read), what was left out (``notes``) and the recorded step and scheduler (``trainer_state``, None if none);
    ``rows`` reads it."""
    dcp_dir: str
    config_path: str
    metadata: Any
    rows: "RowReader"
    layout: List[Tuple[str, torch.dtype, Tuple[int, ...]]]
    sources: Dict[str, str]
    expected: Dict[str, Tuple[Tuple[int, ...], List[str]]]
    optimizer_state: Dict[str, Any]
    notes: List[str]
    trainer_state: Optional[dict]


def read_checkpoint(dcp_dir: str, config: Optional[str] = None) -> DcpCheckpoint:
    """Open the DCP checkpoint ``dcp_dir`` and check it holds every tensor of the model its config (beside it, or
    ``config``) names, with the model's shapes, and nothing else (module docstring); read nothing large yet."""
    metadata = _read_metadata(dcp_dir)
    rows = RowReader(dcp_dir, metadata)
    config_path = config if config is not None else os.path.join(dcp_dir, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config_path} is missing: the import builds the model from its config; pass "
                                "--config CONFIG_JSON (the config.json of the model the job trained)")
    expected = _model_tensors(config_path)
    saved = metadata.state_dict_metadata
    layout, sources = _check_model_keys(dcp_dir, saved, expected)
    optimizer_state, notes = _optimizer_state(dcp_dir, saved, expected, rows)
    return DcpCheckpoint(dcp_dir=dcp_dir, config_path=config_path, metadata=metadata, rows=rows, layout=layout,
                         sources=sources, expected=expected, optimizer_state=optimizer_state, notes=notes,
                         trainer_state=recorded_trainer_state(dcp_dir, saved))


def import_dcp(dcp_dir: str, output_dir: str, config: Optional[str] = None, force: bool = False,
               progress: bool = True) -> ImportResult:
    """Write the dense HF directory of the DCP checkpoint ``dcp_dir`` (module docstring); return what was written.
    ``config`` is the model's config.json when ``dcp_dir`` has none beside its files."""
    checkpoint = read_checkpoint(dcp_dir, config)
    check_output_dir(dcp_dir, output_dir, force)
    layout, sources, rows = checkpoint.layout, checkpoint.sources, checkpoint.rows

    def write(staging: str) -> None:
        bar = progress_bar(len(layout), f"import {os.path.basename(os.path.normpath(dcp_dir))}", progress)
        reader = BatchedReader(rows, [sources[key] for key, _, _ in layout])
        try:
            with DenseWeightsWriter(staging, layout, metadata={"format": "pt"}) as writer:
                for key, dtype, shape in layout:
                    if reader.in_ranges(sources[key]):
                        writer.write_parts(key, rows.ranges(sources[key]))
                    else:
                        writer.write(key, reader.read(sources[key]))
                    bar.update(1)
        finally:
            bar.close()
        shutil.copyfile(checkpoint.config_path, os.path.join(staging, CONFIG_FILE))
        if checkpoint.optimizer_state:
            write_dense_optimizer(staging, checkpoint.optimizer_state, "dcp", checkpoint.trainer_state, progress)

    write_atomically(output_dir, write)
    return ImportResult(output_dir=output_dir, model_keys=len(layout), optimizer_keys=len(checkpoint.optimizer_state),
                        notes=checkpoint.notes)


def _read_metadata(dcp_dir: str):
    import torch.distributed.checkpoint as dcp

    if not os.path.isdir(dcp_dir):
        raise FileNotFoundError(f"{dcp_dir} does not exist")
    if not os.path.isfile(os.path.join(dcp_dir, ".metadata")):
        raise ValueError(f"{dcp_dir} is not a torch.distributed.checkpoint directory: it has no .metadata file "
                         "(an nxdtp checkpoint is merged without --from-dcp; an NxD one with --from-nxd)")
    try:
        return dcp.FileSystemReader(dcp_dir).read_metadata()
    except Exception as e:  # a damaged .metadata: whatever unpickling raised
        raise ValueError(f"{os.path.join(dcp_dir, '.metadata')} cannot be read as DCP metadata: {e}") from None


def _model_tensors(config_path: str) -> Dict[str, Tuple[Tuple[int, ...], List[str]]]:
    """The model's state_dict as the config's class builds it: {first name of each tensor: (shape, its other
    (tied) names)}."""
    model_class, model_config = model_class_and_config(config_path)
    with torch.device("meta"):
        model = model_class(model_config)
    tensors: Dict[str, Tuple[Tuple[int, ...], List[str]]] = {}
    first_name: Dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first_name:
            tensors[first_name[id(tensor)]][1].append(name)
        else:
            first_name[id(tensor)] = name
            tensors[name] = (tuple(tensor.shape), [])
    return tensors


def model_class_and_config(config_path: str):
    """The transformers class the config names (``architectures[0]``) and the config object, or a ValueError saying
    what to add."""
    import transformers

    with open(config_path) as f:
        config_dict = json.load(f)
    architectures = config_dict.get("architectures") or []
    if not architectures or not hasattr(transformers, architectures[0]):
        raise ValueError(f"{config_path} names no model class transformers {transformers.__version__} has "
                         f"(architectures={architectures}); the import needs it to know the model's tensors: a config "
                         "the model's save_pretrained wrote names it, or add e.g. \"architectures\": "
                         "[\"LlamaForCausalLM\"]")
    return getattr(transformers, architectures[0]), transformers.AutoConfig.for_model(**config_dict)


def _check_model_keys(dcp_dir: str, saved: Dict[str, Any], expected):
    """The layout to write [(name, dtype, shape)] and, per name, the DCP key holding it (a tied tensor may be saved
    under any of its names); everything wrong is refused before anything is written."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    model_keys = {key for key in saved if not key.startswith(NOT_MODEL_PREFIXES)}
    known = {alias for name, (_, aliases) in expected.items() for alias in [name] + aliases}
    unknown = sorted(model_keys - known)
    if unknown:
        raise ValueError(f"{dcp_dir} holds tensors the model does not have: {unknown[:5]} ({len(unknown)} in all); "
                         "the import reads HF state_dict names (TorchTitan's own names need its converter first)")
    layout, sources, missing = [], {}, []
    for name, (shape, aliases) in expected.items():
        source = next((key for key in [name] + aliases if key in saved), None)
        if source is None:
            missing.append(name)
            continue
        meta = saved[source]
        if not isinstance(meta, TensorStorageMetadata):
            raise ValueError(f"{dcp_dir}: '{source}' is not a tensor in the checkpoint")
        if tuple(meta.size) != shape:
            raise ValueError(f"{dcp_dir}: '{source}' has shape {list(meta.size)}, but the model's is {list(shape)}")
        layout.append((name, meta.properties.dtype, shape))
        sources[name] = source
    if missing:
        raise ValueError(f"{dcp_dir} lacks tensors the model needs: {missing[:5]} ({len(missing)} in all)")
    return layout, sources


class RowReader:
    """Reads row ranges (along dim 0) of the checkpoint's tensors through torch's own ``FileSystemReader``: for each
    range, DCP's ``create_read_items_for_chunk_list`` names the saved chunks it overlaps and the part of each it needs
    (DCP's resharding read, with a range of rows as the "local shard"), and the reader copies each part into a tensor
    of just those rows. So a tensor is never in memory whole, only a range of it and the saved chunk being read:
    ``FileSystemReader`` loads each saved chunk it needs whole (with ``torch.load``), which for an nxdtp export is at
    most ``dcp_export.CHUNK_BYTES``, and for a native job's checkpoint whatever chunk it saved.

    ``reads`` counts the ``read_data`` calls made (tests check that a large tensor took several)."""

    def __init__(self, dcp_dir: str, metadata, budget_bytes: Optional[int] = None):
        from torch.distributed.checkpoint import FileSystemReader

        self.metadata = metadata.state_dict_metadata
        self.budget = BATCH_BYTES if budget_bytes is None else budget_bytes
        self.storage = FileSystemReader(dcp_dir)
        self.storage.set_up_storage_reader(metadata, is_coordinator=True)
        self.reads = 0

    def nbytes(self, key: str) -> int:
        meta = self.metadata[key]
        return meta.size.numel() * torch.empty((), dtype=meta.properties.dtype).element_size()

    def chunks_over_budget(self, key: str) -> bool:
        """Whether the job saved tensor ``key`` in a chunk larger than the budget. A DCP read loads every saved chunk
        it touches whole, once per part asked of it, so reading such a tensor in budget-sized parts would load that
        chunk again for each part without holding less: it is read a chunk (or the tensor) at a time instead."""
        meta = self.metadata[key]
        itemsize = torch.empty((), dtype=meta.properties.dtype).element_size()
        return any(chunk.sizes.numel() * itemsize > self.budget for chunk in meta.chunks)

    def read(self, ranges: Dict[str, Tuple[int, int]]) -> Dict[str, torch.Tensor]:
        """``{key: (start, stop)}`` -> ``{key: rows [start, stop) of that tensor}`` in one ``read_data`` (a 0-dim
        tensor: ``(0, 1)``, the tensor)."""
        boxes = {}
        for key, (start, stop) in ranges.items():
            sizes = list(self.metadata[key].size)
            offsets = [0] * len(sizes)
            if sizes:
                offsets[0], sizes[0] = start, stop - start
            boxes[key] = [(tuple(offsets), tuple(sizes))]
        return {key: tensors[0] for key, tensors in self._read_boxes(boxes).items()}

    def read_boxes(self, key: str, boxes: List[Tuple[Tuple[int, ...], Tuple[int, ...]]]) -> List[torch.Tensor]:
        """The boxes ``[(offsets, sizes), ...]`` of tensor ``key``, in one ``read_data``."""
        return self._read_boxes({key: boxes})[key]

    def _read_boxes(self, boxes: Dict[str, List[Tuple[Tuple[int, ...], Tuple[int, ...]]]]
                    ) -> Dict[str, List[torch.Tensor]]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        out: Dict[str, List[torch.Tensor]] = {}
        items = []
        for key, wanted in boxes.items():
            meta = self.metadata[key]
            out[key] = [torch.empty(sizes, dtype=meta.properties.dtype) for _, sizes in wanted]
            # Each box is a "local chunk": DCP's resharding read names the saved chunks it overlaps.
            items += create_read_items_for_chunk_list(key, meta, [ChunkStorageMetadata(
                offsets=torch.Size(offsets), sizes=torch.Size(sizes)) for offsets, sizes in wanted])
        plan = self.storage.prepare_global_plan([self.storage.prepare_local_plan(LoadPlan(items))])[0]
        self.storage.read_data(plan, _into_tensors_planner()(out)).wait()
        self.reads += 1
        return out

    def ranges(self, key: str) -> Iterator[torch.Tensor]:
        """Tensor ``key`` as consecutive row ranges of at most the budget's bytes, cut where its saved chunks begin
        and end along dim 0 so that each saved chunk is read once where it fits the budget; a tensor saved in chunks
        over the budget is read from one chunk edge along dim 0 to the next (``chunks_over_budget``)."""
        meta = self.metadata[key]
        rows = meta.size[0]
        step = rows_within(self.budget, tuple(meta.size), meta.properties.dtype)
        cuts = sorted({0, rows} | {edge for c in meta.chunks for edge in (c.offsets[0], c.offsets[0] + c.sizes[0])})
        whole_intervals = self.chunks_over_budget(key)  # then each read between two chunk edges is one range
        for first, last in zip(cuts, cuts[1:]):
            for start in range(first, last, max(step, last - first) if whole_intervals else step):
                yield self.read({key: (start, min(last, start + step))})[key]


def _into_tensors_planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class IntoTensors(DefaultLoadPlanner):
        """What ``FileSystemReader.read_data`` asks of a planner, for reads into ``out`` (key -> the tensors of the
        boxes asked for, in the order asked): where each read item goes, and, after each, the chunks ``torch.load``
        left in reference cycles collected once ``COLLECT_BYTES`` have been read (``nxdtp.checkpointing.cycles``)."""

        def __init__(self, out: Dict[str, List[torch.Tensor]]):
            super().__init__()
            self.out, self.loaded = out, CycleCollector(COLLECT_BYTES)

        def resolve_tensor(self, read_item):
            tensor = self.out[read_item.dest_index.fqn][read_item.dest_index.index]
            for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                tensor = tensor.narrow(dim, offset, length)
            return tensor

        def commit_tensor(self, read_item, tensor) -> None:
            self.loaded.passed(tensor)

    return IntoTensors


class BatchedReader:
    """Reads the tensors ``keys`` in that order, the next ones together up to the budget's bytes and handing each
    out once: a read per tensor costs a planning round each (most of an import's time for small tensors), and reading
    everything at once would hold the whole checkpoint. A tensor over the budget is not batched: the caller streams
    it in row ranges (``in_ranges``, ``RowReader.ranges``)."""

    def __init__(self, rows: RowReader, keys: List[str]):
        self.rows, self.keys = rows, list(keys)
        self.position = {key: i for i, key in enumerate(self.keys)}
        self.cache: Dict[str, torch.Tensor] = {}

    def in_ranges(self, key: str) -> bool:
        return self.rows.nbytes(key) > self.rows.budget and len(self.rows.metadata[key].size) > 0

    def read(self, key: str) -> torch.Tensor:
        if key not in self.cache:
            batch, total = {}, 0
            for name in self.keys[self.position[key]:]:
                nbytes = self.rows.nbytes(name)
                if batch and (total + nbytes > self.rows.budget or self.in_ranges(name)):
                    break
                shape = self.rows.metadata[name].size
                batch[name] = (0, shape[0] if len(shape) else 1)
                total += nbytes
            self.cache.update(self.rows.read(batch))
        return self.cache.pop(key)


def _load_values(dcp_dir: str, keys: List[str]) -> Dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    holder: Dict[str, Any] = dict.fromkeys(keys)
    dcp.load(holder, checkpoint_id=dcp_dir, no_dist=True)
    return holder


def _optimizer_state(dcp_dir: str, saved: Dict[str, Any], expected, rows: RowReader
                     ) -> Tuple[Dict[str, Any], List[str]]:
    """The optimizer's flattened state: tensors read when written (one over the budget in row ranges, streamed),
    other values read now. Keys must name model parameters by their first name, as torch's flattened optimizer state
    dict does."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    state: Dict[str, Any] = {}
    keys = sorted(key for key in saved if key.startswith(OPTIMIZER_PREFIX))
    if not keys:
        return state, ["the checkpoint holds no optimizer state under 'optimizer'"]
    # write_dense_optimizer reads the tensors in this order
    values: List[str] = []
    reader = BatchedReader(rows, [key for key in keys if isinstance(saved[key], TensorStorageMetadata)])
    for key in keys:
        flat = key[len(OPTIMIZER_PREFIX):]
        kind, _, rest = flat.partition(".")
        param = rest.rsplit(".", 1)[0]
        if kind not in ("state", "param_groups") or param not in expected:
            raise ValueError(f"{dcp_dir}: optimizer entry '{key}' is not torch's flattened optimizer state of a "
                             "model parameter (optimizer.state.<param>.<field> or "
                             "optimizer.param_groups.<param>.<hyperparameter>)")
        meta = saved[key]
        if isinstance(meta, TensorStorageMetadata):
            shape, dtype = tuple(meta.size), meta.properties.dtype
            parts = (lambda key=key: rows.ranges(key)) if reader.in_ranges(key) else None
            state[flat] = DenseOptimizerTensor(shape=shape, dtype=dtype, read=lambda key=key: reader.read(key),
                                               read_parts=parts)
        else:
            values.append(key)
    if values:  # small pickled values (hyperparameters, 'step' of some optimizers): all in one dcp.load
        holder = _load_values(dcp_dir, values)
        for key in values:
            value = holder[key]
            state[key[len(OPTIMIZER_PREFIX):]] = list(value) if isinstance(value, tuple) else value
    return {key: state[key] for key in sorted(state)}, []


def recorded_trainer_state(dcp_dir: str, saved: Dict[str, Any]) -> Optional[dict]:
    """The step and scheduler the DCP checkpoint ``dcp_dir`` (its metadata's ``saved`` entries) records: an nxdtp
    export's record beside its files, else TorchTitan's places; None when it records neither."""
    return _export_record_trainer_state(dcp_dir) or _torchtitan_trainer_state(dcp_dir, saved)


def _torchtitan_trainer_state(dcp_dir: str, saved: Dict[str, Any]) -> Optional[dict]:
    """The step and scheduler a native (TorchTitan-layout) job keeps under ``train_state.step`` and
    ``lr_scheduler.last_epoch``, as nxdtp's trainer state: ``{"global_step": ..., "scheduler": {"last_epoch": ...}}``
    (torch's LambdaLR.load_state_dict takes that; the optimizer's groups carry the learning rates)."""
    keys = [key for key in ("train_state.step", "lr_scheduler.last_epoch") if key in saved]
    if not keys:
        return None
    values = _load_values(dcp_dir, keys)
    state: Dict[str, Any] = {}
    if "train_state.step" in values:
        state["global_step"] = int(values["train_state.step"])
    if "lr_scheduler.last_epoch" in values:
        state["scheduler"] = {"last_epoch": int(values["lr_scheduler.last_epoch"])}
    return state


def _export_record_trainer_state(dcp_dir: str) -> Optional[dict]:
    """The trainer state an nxdtp export recorded beside its DCP files (scheduler, step), if this is one."""
    path = os.path.join(dcp_dir, EXPORT_RECORD_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get("trainer_state")

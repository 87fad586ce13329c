"""The DCP end of the checkpoint pipeline: ``DcpSource`` reads a torch.distributed.checkpoint directory by boxes of its
dense tensors, ``DcpSink`` writes one chunk by chunk, each within the boxes ``slabs.piece_boxes`` plans
(docs/checkpoints.md)."""

from __future__ import annotations

import dataclasses
import gc
import os
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..spec import ParamSpec
from .pipeline import Box, ReadBoxes, narrowed, row_cuts, rows_within, shifted
from .safetensors_stream import TensorInfo
from .slabs import piece_boxes

OPTIMIZER_KEY, LR_SCHEDULER_KEY, TRAIN_STATE_KEY = "optimizer", "lr_scheduler", "train_state"  # TorchTitan's names
EXPORT_RECORD_FILE = "nxdtp_dcp_export.json"
# torch.save / torch.load leave each chunk in a reference cycle: collected once this many bytes have passed.
COLLECT_BYTES = 16 << 20

__all__ = ["DcpSource", "DcpSink", "DcpReader", "read_metadata", "OPTIMIZER_KEY"]


class CycleCollector:
    """Runs a young-generation collection each time the tensors ``passed`` add up to ``COLLECT_BYTES``: otherwise the
    chunks torch's DCP storage leaves in cycles pile up between the collector's own runs."""

    def __init__(self):
        self.budget, self.pending = COLLECT_BYTES, 0

    def passed(self, tensor: torch.Tensor) -> None:
        self.pending += tensor.numel() * tensor.element_size()
        if self.pending >= self.budget:
            gc.collect(1)
            self.pending = 0


def write_item(fqn: str, offsets, sizes, dtype: torch.dtype, shape):
    """DCP's write item for the chunk ``(offsets, sizes)`` of the tensor ``fqn`` of ``shape``."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    return WriteItem(index=MetadataIndex(fqn=fqn, offset=torch.Size(offsets)), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                                 properties=TensorProperties(dtype=dtype), size=torch.Size(shape)))


def read_metadata(dcp_dir: str):
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


# ---- reading -----------------------------------------------------------------------------------------------------

class DcpReader:
    """Reads through torch's ``FileSystemReader`` with each wanted box as DCP's "local chunk", so only the saved chunks
    a box overlaps are loaded; ``budget`` is the most bytes read at once."""

    def __init__(self, dcp_dir: str, metadata, budget: int):
        from torch.distributed.checkpoint import FileSystemReader

        self.saved, self.budget = metadata.state_dict_metadata, budget
        self.storage = FileSystemReader(dcp_dir)
        self.storage.set_up_storage_reader(metadata, is_coordinator=True)

    def nbytes(self, key: str, sizes=None) -> int:
        meta = self.saved[key]
        return torch.Size(meta.size if sizes is None else sizes).numel() * meta.properties.dtype.itemsize

    def chunks_over_budget(self, key: str) -> bool:
        """Whether ``key`` was saved in a chunk over the budget, which a read loads whole whatever part is asked."""
        return any(self.nbytes(key, chunk.sizes) > self.budget for chunk in self.saved[key].chunks)

    def read(self, keys: List[str]) -> Dict[str, torch.Tensor]:
        """The whole tensors ``keys``, in one ``read_data``."""
        boxes = {key: [((0,) * len(self.saved[key].size), tuple(self.saved[key].size))] for key in keys}
        return {key: tensors[0] for key, tensors in self._read(boxes).items()}

    def read_boxes(self, key: str, boxes: List[Box]) -> List[torch.Tensor]:
        """The boxes of tensor ``key``, in one ``read_data``."""
        return self._read({key: boxes})[key]

    def _read(self, boxes: Dict[str, List[Box]]) -> Dict[str, List[torch.Tensor]]:
        from torch.distributed.checkpoint import DefaultLoadPlanner
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        out = {key: [torch.empty(sizes, dtype=self.saved[key].properties.dtype) for _, sizes in wanted]
               for key, wanted in boxes.items()}
        items = [item for key, wanted in boxes.items() for item in create_read_items_for_chunk_list(
            key, self.saved[key], [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in wanted])]

        class IntoTensors(DefaultLoadPlanner):  # what read_data asks of a planner: where each read item goes
            loaded = CycleCollector()

            def resolve_tensor(self, item):
                return narrowed(out[item.dest_index.fqn][item.dest_index.index], (item.dest_offsets, item.lengths))

            def commit_tensor(self, item, tensor) -> None:
                self.loaded.passed(tensor)

        plan = self.storage.prepare_global_plan([self.storage.prepare_local_plan(LoadPlan(items))])[0]
        self.storage.read_data(plan, IntoTensors()).wait()
        return out


class DcpSource:
    """A DCP directory as a ``TensorSource`` keyed by ``layout`` (key -> (DCP key, spec or None)): small tensors read
    whole in batches, larger ones by box, or by the rows between saved chunks' edges when those chunks are over the
    budget. Also the optimizer rank file of a TP=1 checkpoint as reshard reads it."""

    def __init__(self, reader: DcpReader, layout: Dict[str, Tuple[str, Optional[ParamSpec]]]):
        self.reader, self.layout, self.slab_bytes = reader, layout, reader.budget
        self.order = list(dict.fromkeys(name for name, _ in layout.values()))
        self.position = {name: i for i, name in enumerate(self.order)}
        self.ahead: Dict[str, torch.Tensor] = {}  # small tensors read with an earlier one, not yet asked for
        self.kept: Tuple[Any, Any] = (None, None)  # ((DCP key, first row, end row), rows) read for its boxes

    def spec(self, key: str) -> ParamSpec:
        name, spec = self.layout[key]
        return spec or ParamSpec(full_shape=tuple(self.reader.saved[name].size))

    def dtype(self, key: str) -> torch.dtype:
        return self.reader.saved[self.layout[key][0]].properties.dtype

    def read_boxes(self, key: str, boxes: List[Box]) -> List[torch.Tensor]:
        (name, spec), reader = self.layout[key], self.reader
        size = tuple(reader.saved[name].size)
        span = (0, size[0] if size else 0)
        if size and reader.nbytes(name) > reader.budget:
            if not reader.chunks_over_budget(name):
                return reader.read_boxes(name, boxes)
            if spec is None or not spec.is_sharded or spec.partition_dim == 0:
                # The rows between the saved chunks' edges (dim 0) around the boxes. A piece split along another
                # dim needs every row, once per piece: such a tensor is read whole, once.
                edges = {0, size[0]} | {c.offsets[0] + d for c in reader.saved[name].chunks for d in (0, c.sizes[0])}
                span = (max(e for e in edges if e <= min(b[0][0] for b in boxes)),
                        min(e for e in edges if e >= max(b[0][0] + b[1][0] for b in boxes)))
        rows = self._kept_rows(name, span, size)
        return [narrowed(rows, shifted(box, -span[0])) for box in boxes]

    def _kept_rows(self, name: str, span: Tuple[int, int], size: Tuple[int, ...]) -> torch.Tensor:
        """Rows ``span`` of ``name``, from the rows kept from the last read where they hold them: a chunk the last
        read loaded is not loaded again when the next boxes go on from it."""
        kept, rows = self.kept
        if kept is not None and kept[0] == name and kept[1] <= span[0] < kept[2]:
            if span[1] <= kept[2]:
                return rows.narrow(0, span[0] - kept[1], span[1] - span[0])
            tail = rows.narrow(0, span[0] - kept[1], kept[2] - span[0]).clone()
            self.kept = (None, None)  # the kept rows go before the new ones are read
            rows = torch.cat([tail, self._read_rows(name, (kept[2], span[1]), size)])
        else:
            self.kept = (None, None)
            rows = self._read_rows(name, span, size)
        self.kept = ((name,) + span, rows)
        return rows

    def _read_rows(self, name: str, span: Tuple[int, int], size: Tuple[int, ...]) -> torch.Tensor:
        if span != (0, size[0] if size else 0):  # rows of a large tensor
            return self.reader.read_boxes(name, [((span[0],) + (0,) * (len(size) - 1),
                                                  (span[1] - span[0],) + size[1:])])[0]
        if name not in self.ahead:
            batch, total = [], 0
            for other in self.order[self.position[name]:]:
                nbytes = self.reader.nbytes(other)
                if batch and (total + nbytes > self.reader.budget or other in self.ahead):
                    break
                batch.append(other)
                total += nbytes
            self.ahead.update(self.reader.read(batch))
        return self.ahead.pop(name)

    def keys(self):
        return self.layout.keys()

    def get_slice(self, key: str):
        return TensorInfo(tuple(self.spec(key).full_shape))

    def get_tensor(self, key: str) -> torch.Tensor:
        spec, size = self.spec(key), tuple(self.reader.saved[self.layout[key][0]].size)
        return spec.full_from_dense(self.read_boxes(key, [((0,) * len(size), size)])[0])


# ---- writing -----------------------------------------------------------------------------------------------------

class DcpSink:
    """A DCP directory as a ``TensorSink``: ``write`` plans a tensor as chunks of at most the slab bytes, each within
    one piece and read only when torch's writer asks for it; ``save`` writes them with the ``values``.
    ``names[key]``: the tensor's paths in the nested state dict."""

    def __init__(self, names: Dict[str, List[Tuple[str, ...]]], specs: Dict[str, ParamSpec]):
        self.names, self.specs = names, specs
        self.planned: Dict[Tuple[str, ...], Tuple[Tuple[int, ...], torch.dtype, List[Box], ReadBoxes]] = {}

    def write(self, key: str, shape: Tuple[int, ...], dtype: torch.dtype, read_boxes: ReadBoxes,
              slab_bytes: int) -> None:
        spec = self.specs[key]
        boxes = [cut for rank in range(spec.num_partitions if spec.is_sharded else 1)
                 for box, _ in piece_boxes(spec, rank)
                 for cut in row_cuts(box, rows_within(slab_bytes, box[1], dtype))]
        if not boxes:  # an empty tensor split over ranks: no piece holds a row, one empty chunk describes it
            boxes = [((0,) * len(shape), tuple(shape))]
        for path in self.names[key]:
            self.planned[path] = (shape, dtype, boxes, read_boxes)

    def save(self, directory: str, values: Dict[Tuple[str, ...], Any], bar) -> None:
        """Write the planned tensors and ``values`` to ``directory`` with ``dcp.save(..., no_dist=True)``, one file per
        chunk."""
        import torch.distributed.checkpoint as dcp

        state: Dict[str, Any] = {}
        placeholders = {path: torch.empty(shape, dtype=dtype, device="meta")
                        for path, (shape, dtype, _, _) in self.planned.items()}
        for path, value in list(placeholders.items()) + list(values.items()):
            holder = state
            for part in path[:-1]:
                holder = holder.setdefault(part, {})
                if not isinstance(holder, dict):
                    raise ValueError(f"the model has a tensor named '{part}', a key DCP's layout gives to other state")
            holder[path[-1]] = value
        chunks = {(".".join(path), boxes[i][0]): (boxes[i], read, dtype, shape)
                  for path, (shape, dtype, boxes, read) in self.planned.items() for i in range(len(boxes))}
        planned = {".".join(path) for path in self.planned}
        writer = dcp.FileSystemWriter(directory, single_file_per_rank=False, sync_files=True, overwrite=False)
        with warnings.catch_warnings():
            # dcp.save warns that it runs without a process group: that is the point here.
            warnings.filterwarnings("ignore", message=".*(process group|no_dist|torch.distributed).*")
            dcp.save(state, storage_writer=writer, planner=_chunked_save_planner(chunks, planned, bar), no_dist=True)

    def chunk_count(self) -> int:
        return sum(len(boxes) for _, _, boxes, _ in self.planned.values())


def _chunked_save_planner(chunks: Dict[Tuple[str, Tuple[int, ...]], Any], planned: set, bar):
    """DCP's default save planner, but the tensors ``planned`` (their fqns) are planned as their ``chunks`` ((fqn,
    offsets) -> (box, read_boxes, dtype, dense shape)), each read when the writer resolves it."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_local_save_plan

    class ChunkedSavePlanner(DefaultSavePlanner):
        written = CycleCollector()

        def create_local_plan(self):
            missing = sorted(planned - set(self.state_dict))
            if missing:
                raise RuntimeError(f"the DCP export planned {missing}, which its flattened state dict lacks")
            plan = create_default_local_save_plan({k: v for k, v in self.state_dict.items() if k not in planned},
                                                  self.is_coordinator)
            items = [write_item(fqn, offsets, box[1], dtype, shape)
                     for (fqn, offsets), (box, _, dtype, shape) in chunks.items()]
            self.plan = dataclasses.replace(plan, items=items + list(plan.items), planner_data=self.mappings)
            return self.plan

        def resolve_data(self, write_item):
            chunk = chunks.get((write_item.index.fqn, tuple(write_item.index.offset or ())))
            if chunk is None:
                return super().resolve_data(write_item)
            box, read, dtype, _ = chunk
            data = read([box])[0].to(dtype).contiguous()
            if tuple(data.shape) != tuple(box[1]):
                raise ValueError(f"'{write_item.index.fqn}': a chunk read {list(data.shape)}, the plan says "
                                 f"{list(box[1])}")
            self.written.passed(data)
            bar.update(1)
            return data

    return ChunkedSavePlanner(flatten_state_dict=True, flatten_sharded_tensors=True)

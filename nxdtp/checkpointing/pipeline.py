"""The checkpoint pipeline: ``stream`` writes the tensors of any source into any sink in bounded slabs. A source
(``TensorSource``) gives dense tensors by box (``spec``, ``dtype``, ``read_boxes``); a sink (``TensorSink``) writes
one tensor at a time, asking for at most ``slab_bytes`` at once. Each ``nxdtp-merge`` operation is one (source, sink)
pair (docs/checkpoints.md)."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Protocol, Sequence, Tuple

import torch

from ..spec import ParamSpec
from .slabs import Box, piece_parts

ReadBoxes = Callable[[List[Box]], List[torch.Tensor]]

# The most bytes a sink asks a source for at once: a larger tensor is written in slabs of rows of at most this size.
SLAB_BYTES = 64 << 20

__all__ = ["Box", "TensorSource", "TensorSink", "stream", "TagSource", "DenseSink", "RankFilesSink", "SLAB_BYTES",
           "rows_within", "row_cuts",
           "dense_slabs", "narrowed", "shifted"]


class TensorSource(Protocol):
    slab_bytes: int  # the most bytes a sink asks for at once

    def spec(self, key: str) -> ParamSpec: ...

    def dtype(self, key: str) -> torch.dtype: ...

    def read_boxes(self, key: str, boxes: List[Box]) -> List[torch.Tensor]: ...


class TensorSink(Protocol):
    def write(self, key: str, shape: Tuple[int, ...], dtype: torch.dtype, read_boxes: ReadBoxes,
              slab_bytes: int) -> None: ...


def stream(source: TensorSource, sink: TensorSink, keys: Iterable[str], *, bar: Any = None) -> None:
    """Write each tensor of ``keys`` from ``source`` into ``sink``, one after the other, in slabs of at most the
    source's ``slab_bytes``; ``bar`` (a progress bar) advances once per tensor."""
    for key in keys:
        shape = tuple(source.spec(key).unpadded_shape)
        sink.write(key, shape, source.dtype(key), lambda boxes, key=key: source.read_boxes(key, boxes),
                   source.slab_bytes)
        if bar is not None:
            bar.update(1)


def rows_within(budget: int, shape: Sequence[int], dtype: torch.dtype) -> int:
    """How many rows (along dim 0) of a tensor of ``shape`` fit ``budget`` bytes: at least one."""
    return max(1, budget // max(1, math.prod(shape[1:]) * dtype.itemsize))


def row_cuts(box: Box, rows: int) -> List[Box]:
    """``box`` cut along dim 0 into boxes of at most ``rows`` rows (a 0-dim box, or one of no rows, stays one)."""
    offsets, sizes = box
    if not sizes:
        return [box]
    return [((offsets[0] + start,) + tuple(offsets[1:]), (min(rows, sizes[0] - start),) + tuple(sizes[1:]))
            for start in range(0, sizes[0] or 1, rows)]


def dense_slabs(read_boxes: ReadBoxes, shape: Sequence[int], rows: int) -> Iterator[torch.Tensor]:
    """The dense tensor of ``shape`` as slabs of at most ``rows`` rows, each one box read."""
    return (read_boxes([cut])[0] for cut in row_cuts(((0,) * len(shape), tuple(shape)), rows))


def narrowed(tensor: torch.Tensor, box: Box, dims: Optional[Iterable[int]] = None) -> torch.Tensor:
    """The ``box`` of ``tensor`` (a view), along ``dims`` only when given."""
    offsets, sizes = box
    for d in range(len(sizes)) if dims is None else dims:
        tensor = tensor.narrow(d, offsets[d], sizes[d])
    return tensor


def shifted(box: Box, rows: int) -> Box:
    """``box`` moved ``rows`` along dim 0 (a 0-dim box stays as it is)."""
    offsets, sizes = box
    return ((offsets[0] + rows,) + tuple(offsets[1:]), sizes) if sizes else box


class TagSource:
    """The tensors of an nxdtp tag's rank files (``handles``), laid out by ``layout[key] = (spec, dtype, rank file
    names)``: a box is read from the rows of the pieces that hold it, never a whole piece of a larger tensor. With
    ``build_piece(key, rank)`` pieces are built whole instead (ZeRO-1's joined DP shards), the last one kept."""

    def __init__(self, handles: Dict[str, Any], layout: Dict[str, Tuple[ParamSpec, torch.dtype, List[Any]]],
                 slab_bytes: Optional[int] = None, build_piece: Optional[Callable[[str, int], torch.Tensor]] = None):
        self.handles, self.layout, self.build_piece = handles, layout, build_piece
        self.slab_bytes = slab_bytes or SLAB_BYTES
        self._kept: Tuple[Any, Optional[torch.Tensor]] = (None, None)  # ((key, rank), the piece built last)

    def spec(self, key: str) -> ParamSpec:
        return self.layout[key][0]

    def dtype(self, key: str) -> torch.dtype:
        return self.layout[key][1]

    def read_boxes(self, key: str, boxes: List[Box]) -> List[torch.Tensor]:
        return [self._read_box(key, box) for box in boxes]

    def piece(self, key: str, rank: int) -> torch.Tensor:
        """TP rank ``rank``'s piece of ``key`` as stored."""
        if self.build_piece is None:
            return self.handles[self.layout[key][2][rank]].get_tensor(key)
        if self._kept[0] != (key, rank):
            self._kept = (None, None)  # the kept piece goes before the next one is built
            self._kept = ((key, rank), self.build_piece(key, rank))
        return self._kept[1]

    def _rows(self, key: str, rank: int, start: int, length: int) -> torch.Tensor:
        if self.build_piece is not None:
            return self.piece(key, rank).narrow(0, start, length)
        return self.handles[self.layout[key][2][rank]].get_rows(key, start, length)

    def _read_box(self, key: str, box: Box) -> torch.Tensor:
        spec, dtype, _ = self.layout[key]
        offsets, sizes = box
        if not sizes:  # a 0-dim tensor
            return self.piece(key, 0).to(dtype)
        if not spec.is_sharded:  # rank 0's copy; its dense part is the leading block
            return narrowed(self._rows(key, 0, offsets[0], sizes[0]), box, range(1, len(sizes))).to(dtype)
        dim = spec.partition_dim
        out = torch.empty(sizes, dtype=dtype)
        low, high = offsets[dim], offsets[dim] + sizes[dim]
        others = [d for d in range(1, len(sizes)) if d != dim]
        for rank in range(spec.num_partitions):
            rows = None  # this piece's rows of the box, read once (split dim > 0)
            for piece_start, length, dense_start in spec.dense_runs_of_piece(rank):
                first, last = max(low, dense_start), min(high, dense_start + length)
                if first >= last:
                    continue
                start = piece_start + first - dense_start
                if dim == 0:
                    part = self._rows(key, rank, start, last - first)
                else:
                    rows = self._rows(key, rank, offsets[0], sizes[0]) if rows is None else rows
                    part = rows.narrow(dim, start, last - first)
                out.narrow(dim, first - low, last - first).copy_(narrowed(part, box, others))
        return out


class DenseSink:
    """A dense safetensors writer, each tensor in slabs of rows; with a ``form`` (``hf_form.SavedForm``), a tensor
    transformers saves in another form is read whole and written as its saved parts."""

    def __init__(self, writer, form=None):
        self.writer, self.form = writer, form

    def write(self, key: str, shape: Tuple[int, ...], dtype: torch.dtype, read_boxes: ReadBoxes,
              slab_bytes: int) -> None:
        if self.form is not None and self.form.converts(key):
            whole = read_boxes([((0,) * len(shape), shape)])[0].to(dtype)
            for name, part in self.form.tensors(key, whole).items():
                self.writer.write(name, part.contiguous())
            return
        slabs = dense_slabs(read_boxes, shape, rows_within(slab_bytes, shape, dtype))
        self.writer.write_parts(key, (slab.to(dtype) for slab in slabs))


class RankFilesSink:
    """The rank files of a tag at the TP size of ``specs`` (one writer per TP rank), each piece in slabs of rows; a
    replicated tensor goes to rank 0's file, or with ``every_rank`` to every file."""

    def __init__(self, writers: List[Any], specs: Dict[str, ParamSpec], every_rank: bool = False):
        self.writers, self.specs, self.every_rank = writers, specs, every_rank

    def write(self, key: str, shape: Tuple[int, ...], dtype: torch.dtype, read_boxes: ReadBoxes,
              slab_bytes: int) -> None:
        spec = self.specs[key]
        ranks = range(len(self.writers)) if spec.is_sharded or self.every_rank else [0]
        if not spec.is_sharded and tuple(spec.full_shape) != shape:  # padded but whole: laid out from the dense
            full = spec.full_from_dense(read_boxes([((0,) * len(shape), shape)])[0].to(dtype))
            for rank in ranks:
                self.writers[rank].write(key, full)
            return
        rows = rows_within(slab_bytes, spec.local_shape(), dtype)
        for rank in ranks:
            self.writers[rank].write_parts(key, piece_parts(spec, rank, read_boxes, rows, dtype))

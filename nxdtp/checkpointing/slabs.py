"""Reading a tensor in runs and slabs through its layout (a ``ParamSpec``): a TP piece from reads of the dense
tensor, and the dense tensor from reads of piece rows, never more than a slab in memory (docs/checkpoints.md)."""

from __future__ import annotations

from typing import Callable, Iterator, List, Optional, Tuple

import torch

from ..spec import ParamSpec

# A box of a dense tensor: (offsets, sizes), one of each per dimension.
Box = Tuple[Tuple[int, ...], Tuple[int, ...]]
# Where a box lies in a TP piece: (dim, start, length), or None for all of it.
Narrow = Optional[Tuple[int, int, int]]

__all__ = ["read_ranges", "read_piece", "piece_parts", "piece_boxes"]


def piece_boxes(spec: ParamSpec, rank: int, copies: bool = False) -> List[Tuple[Box, Narrow]]:
    """The boxes of the dense tensor that TP rank ``rank``'s piece holds first copies of (with ``copies``, the other
    copies), and where each lies in the piece; a replicated tensor is rank 0's one box."""
    shape = tuple(spec.unpadded_shape)
    if not spec.is_sharded:
        return [(((0,) * len(shape), shape), None)] if (rank == 0) != copies else []
    boxes = []
    for start, length, dense_start in (spec.copy_runs_of_piece if copies else spec.dense_runs_of_piece)(rank):
        offsets, sizes = [0] * len(shape), list(shape)
        offsets[spec.partition_dim], sizes[spec.partition_dim] = dense_start, length
        boxes.append(((tuple(offsets), tuple(sizes)), (spec.partition_dim, start, length)))
    return boxes


def read_ranges(spec: ParamSpec, rank: int) -> List[Tuple[int, int, Optional[int]]]:
    """``(piece_start, length, dense_start)`` runs along partition_dim that build TP rank ``rank``'s piece from the
    dense tensor, in order (``dense_start`` None: zero padding); a replicated tensor is one run over dim 0."""
    if not spec.is_sharded:
        return [(0, spec.unpadded_shape[0], 0)] if spec.unpadded_shape else []
    rows = spec.local_shape()[spec.partition_dim]
    runs: List[Tuple[int, int, Optional[int]]] = []
    position = 0
    for start, length, dense_start in sorted(spec.dense_runs_of_piece(rank) + spec.copy_runs_of_piece(rank)) + [
            (rows, 0, None)]:
        if start > position:
            runs.append((position, start - position, None))  # the rows no run holds are padding
        last = runs[-1] if runs else None
        if length and last and last[2] is not None and last[2] + last[1] == dense_start and last[0] + last[1] == start:
            runs[-1] = (last[0], last[1] + length, last[2])
        elif length:
            runs.append((start, length, dense_start))
        position = start + length
    return runs


def read_piece(spec: ParamSpec, read_rows: Callable[[int, int], torch.Tensor], rank: int,
               dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """TP rank ``rank``'s piece from ``read_rows(start, stop)`` of the dense tensor, one call per run of
    ``read_ranges``; padding is zeros."""
    runs = read_ranges(spec, rank)
    parts: List[Optional[torch.Tensor]] = [None if dense_start is None else read_rows(dense_start, dense_start + length)
                                           for _, length, dense_start in runs]
    dtype = dtype or next((p.dtype for p in parts if p is not None), torch.float32)
    dim = spec.partition_dim if spec.is_sharded else 0
    shape = list(spec.local_shape())
    for i, ((_, length, _), part) in enumerate(zip(runs, parts)):
        shape[dim] = length
        parts[i] = torch.zeros(shape, dtype=dtype) if part is None else part.to(dtype)
    return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]


def piece_parts(spec: ParamSpec, rank: int, read_boxes: Callable[[List[Box]], List[torch.Tensor]],
                rows_per_part: int, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """TP rank ``rank``'s piece as slabs of at most ``rows_per_part`` dim-0 rows, each from one ``read_boxes`` call on
    the dense tensor, zeros for padding."""
    dense = tuple(spec.unpadded_shape)
    if not dense:
        yield read_boxes([((), ())])[0].to(dtype)
        return
    dim = spec.partition_dim if spec.is_sharded else 0
    runs = read_ranges(spec, rank)  # along ``dim``, in piece order
    rows, step = spec.local_shape()[0], max(1, rows_per_part)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        segments = []  # (shape of the segment, box of the dense tensor or None for zeros), in piece order
        for piece_start, length, dense_start in runs:
            if dim == 0:  # the runs are rows: the parts of those inside [start, stop)
                first, last = max(start, piece_start), min(stop, piece_start + length)
                if first >= last:
                    continue
                offsets = [dense_start + first - piece_start if dense_start is not None else 0] + [0] * (len(dense) - 1)
                sizes = [last - first, *dense[1:]]
            else:  # the runs are columns (along dim): every run, rows [start, stop)
                offsets, sizes = [start] + [0] * (len(dense) - 1), [stop - start, *dense[1:]]
                offsets[dim], sizes[dim] = dense_start or 0, length
            segments.append((tuple(sizes), None if dense_start is None else (tuple(offsets), tuple(sizes))))
        read = iter(read_boxes([box for _, box in segments if box is not None]))
        parts = [torch.zeros(shape, dtype=dtype) if box is None else next(read).to(dtype) for shape, box in segments]
        yield torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]

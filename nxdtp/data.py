"""Batches for a tensor-parallel group: Megatron's ``broadcast_data``.

Every rank of a TP group must compute on the same batch (``nxdtp.agreement`` checks it in every forward). The simplest
way to guarantee it is to read the data on TP rank 0 only and send it to the others.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence

import torch

from . import comm
from .topology import tensor_parallel_group

# Dimensions a tensor may have (Megatron allows 5; batches with a few more axes, such as images, fit too).
MAX_DIMS = 8
# dtypes the header can name, so that every rank can word TP rank 0's error alike.
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_OK, _MISSING, _NOT_A_TENSOR, _WRONG_DTYPE, _TOO_MANY_DIMS = range(5)


def broadcast_data(keys: Sequence[str], data: Optional[Mapping[str, Any]], datatype: torch.dtype,
                   device: Optional[torch.device | str] = None) -> Dict[str, torch.Tensor]:
    """TP rank 0's ``data[key]`` for every key of ``keys``, on every rank of its TP group (Megatron's
    ``broadcast_data(keys, data, datatype)``; ``device`` is where the results are made, the CPU by default).

    ``data`` is read on TP rank 0 only; the other ranks may pass ``None``. Each tensor must have dtype ``datatype`` and
    at most 8 dimensions; a problem with TP rank 0's data raises the same error on every rank of the group
    (``KeyError``, ``TypeError`` or ``ValueError``, naming the key), never a hang. All ranks of the group must call it
    with the same ``keys`` and ``datatype``. Shapes go first on the host group, then the tensors as one flat tensor
    broadcast on ``device``: made on the host on every rank and then moved, so that on XLA every rank traces the same
    graph (give TP rank 0 host tensors, as a data loader yields them: reading device tensors back would run a graph on
    that rank alone).
    """
    keys = list(keys)
    if not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
        raise ValueError(f"broadcast_data: keys={keys!r} must be distinct strings")
    if not isinstance(datatype, torch.dtype):
        raise TypeError(f"broadcast_data: datatype={datatype!r} is not a torch.dtype (e.g. torch.int64)")
    device = torch.device("cpu" if device is None else device)
    group = tensor_parallel_group()
    source = group.rank == 0

    # The header: [status, key index, dtype code] then, per key, [ndim, dims...]. TP rank 0 fills it; the others learn
    # the shapes from it, or TP rank 0's error, which they all raise alike.
    header = torch.zeros(3 + len(keys) * (1 + MAX_DIMS), dtype=torch.int64)
    if source:
        _fill_header(header, keys, data, datatype)
    header = comm.broadcast(header, group, src_group_rank=0)
    _raise_for(header, keys, datatype, group.ranks[0])
    shapes = []
    for i in range(len(keys)):
        row = header[3 + i * (1 + MAX_DIMS):3 + (i + 1) * (1 + MAX_DIMS)].tolist()
        shapes.append(tuple(row[1:1 + row[0]]))
    sizes = [_numel(shape) for shape in shapes]
    if source:
        flat = torch.cat([data[k].detach().to("cpu").reshape(-1) for k in keys]) if keys else \
            torch.zeros(0, dtype=datatype)
    else:
        flat = torch.zeros(sum(sizes), dtype=datatype)
    flat = comm.broadcast(flat.to(device), group, src_group_rank=0)
    return {key: part.view(shape) for key, part, shape in zip(keys, flat.split(sizes), shapes)}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _fill_header(header: torch.Tensor, keys, data, datatype) -> None:
    def refuse(status, index, dtype=None):
        header[0], header[1] = status, index
        header[2] = _DTYPES.index(dtype) if dtype in _DTYPES else -1

    if data is None:
        refuse(_MISSING, 0)
        return
    for i, key in enumerate(keys):
        if key not in data:
            return refuse(_MISSING, i)
        value = data[key]
        if not isinstance(value, torch.Tensor):
            return refuse(_NOT_A_TENSOR, i)
        if value.dtype != datatype:
            return refuse(_WRONG_DTYPE, i, value.dtype)
        if value.dim() > MAX_DIMS:
            return refuse(_TOO_MANY_DIMS, i)
        row = 3 + i * (1 + MAX_DIMS)
        header[row] = value.dim()
        header[row + 1:row + 1 + value.dim()] = torch.tensor(value.shape, dtype=torch.int64)


def _raise_for(header: torch.Tensor, keys, datatype, source_rank: int) -> None:
    status, index, dtype_code = header[:3].tolist()
    if status == _OK:
        return
    key = keys[index] if keys else None
    where = f"tensor-parallel rank 0 (global rank {source_rank})"
    if status == _MISSING:
        raise KeyError(f"broadcast_data: TP rank 0's data has no {key!r} (or is None); it must hold every key asked "
                       f"for: {keys}")
    if status == _NOT_A_TENSOR:
        raise TypeError(f"broadcast_data: {key!r} on {where} is not a tensor; every value must be a torch.Tensor")
    if status == _WRONG_DTYPE:
        dtype = _DTYPES[dtype_code] if 0 <= dtype_code < len(_DTYPES) else "another dtype"
        raise TypeError(f"broadcast_data: {key!r} on tensor-parallel rank 0 is {dtype}, but datatype={datatype}: every "
                        "tensor must have the datatype passed (broadcast other dtypes in a call of their own)")
    raise ValueError(f"broadcast_data: {key!r} on {where} has more than {MAX_DIMS} dimensions")


__all__ = ["broadcast_data", "MAX_DIMS"]

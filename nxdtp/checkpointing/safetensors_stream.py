"""nxdtp's one safetensors writer and one reader. The writer writes the header first and streams each tensor after it,
so it never holds more than one tensor, and records the checksums of the header and of each tensor as it writes
(docs/checkpoints.md, "Integrity"). The reader reads tensors or ranges at their byte offsets."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import xxhash

from .durable import ChecksummedWriter, ClosesOnExit, file_record, tensor_bytes

# Tensors are written (and hashed twice: for the file and for the tensor) in chunks of this size, so the second hash
# reads bytes the first has just brought into the CPU cache.
_WRITE_CHUNK_BYTES = 1 << 20

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


class StreamingSafetensorsWriter(ClosesOnExit):
    """``layout`` is the ordered list of (name, dtype, shape) that ``write`` must follow. ``close`` ``fsync``s the file;
    ``record()`` and ``contents_record()`` then give its records."""

    def __init__(self, path: str, layout: List[Tuple[str, torch.dtype, Tuple[int, ...]]],
                 metadata: Optional[Dict[str, str]] = None):
        self.path = path
        self._expected = list(layout)
        self._position = 0
        header: Dict[str, object] = {}
        offset = 0
        for name, dtype, shape in layout:
            if dtype not in _SAFETENSORS_DTYPES:
                raise TypeError(f"tensor '{name}' has dtype {dtype}, which safetensors cannot store")
            size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset,
                                                                                                         offset + size]}
            offset += size
        if metadata:
            header["__metadata__"] = metadata
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # keep the data 8-byte aligned, as safetensors does
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._file = ChecksummedWriter(path)
        prefix = struct.pack("<Q", len(encoded)) + encoded
        self._file.write(prefix)
        self._header_record = file_record(len(prefix), xxhash.xxh3_64_hexdigest(prefix))
        self._tensor_digests: Dict[str, str] = {}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected_name, dtype, shape = self._expected[self._position]
        if name != expected_name or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{self.path}: expected '{expected_name}' {dtype} {list(shape)} next, got '{name}' "
                             f"{tensor.dtype} {list(tensor.shape)}")
        self.write_parts(name, [tensor])

    def write_parts(self, name: str, parts: Iterable[torch.Tensor]) -> None:
        """Write the next tensor from consecutive row ranges (a 0-dim tensor is one part), each let go before the next
        is taken; parts that do not add up to the tensor raise."""
        expected_name, dtype, shape = self._expected[self._position]
        if name != expected_name:
            raise ValueError(f"{self.path}: expected '{expected_name}' next, got '{name}'")
        digest, rows = xxhash.xxh3_64(), 0
        for part in parts:
            if part.dtype != dtype or tuple(part.shape[1:]) != tuple(shape[1:]) or part.dim() != len(shape) \
                    or rows + (part.shape[0] if shape else 1) > (shape[0] if shape else 1):
                raise ValueError(f"{self.path}: '{name}' is {dtype} {list(shape)}; a part of {part.dtype} "
                                 f"{list(part.shape)} after {rows} rows does not fit it")
            rows += part.shape[0] if shape else 1
            self._write_data(part.detach().to("cpu").contiguous(), digest)
            del part
        if rows != (shape[0] if shape else 1):
            raise ValueError(f"{self.path}: '{name}' is {list(shape)}; its parts gave {rows} rows")
        self._tensor_digests[name] = digest.hexdigest()
        self._position += 1

    def _write_data(self, data: torch.Tensor, digest) -> None:
        if data.numel():
            view = tensor_bytes(data)
            for start in range(0, view.nbytes, _WRITE_CHUNK_BYTES):
                chunk = view[start:start + _WRITE_CHUNK_BYTES]
                digest.update(chunk)
                self._file.write(chunk)

    def close(self) -> None:
        if self._position != len(self._expected):
            missing = [n for n, _, _ in self._expected[self._position:]]
            self._file.abandon()
            raise ValueError(f"{self.path}: {len(missing)} tensors were never written, first {missing[:3]}")
        self._file.close()

    def abandon(self) -> None:
        """Close the file without completing it (an error happened while writing it)."""
        self._file.abandon()

    def record(self) -> dict:
        """The index record (size, checksum) of the completed file."""
        return self._file.record()

    def contents_record(self) -> dict:
        """The index record of the completed file's parts: ``{"header": {"size": bytes, "xxh3_64": ...}, "tensors":
        {name: xxh3_64}}``, where the header is the length prefix and the JSON header with its padding."""
        return {"header": self._header_record, "tensors": dict(self._tensor_digests)}


# What the reader accepts: every dtype the writer writes, and the float8 and unsigned ones Hugging Face checkpoints may
# hold (which nxdtp never writes).
_DTYPES_BY_NAME = {**{name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()},
                   "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U16": torch.uint16,
                   "U32": torch.uint32, "U64": torch.uint64}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """What safetensors' ``get_slice`` answers about a tensor, without reading it: its shape and, where known, its
    safetensors dtype name."""

    shape: Tuple[int, ...]
    dtype: Optional[str] = None

    def get_dtype(self) -> Optional[str]:
        return self.dtype

    def get_shape(self) -> List[int]:
        return list(self.shape)


class SafetensorsFileReader:
    """Read tensors of a safetensors file with plain reads at their byte offsets: ``safe_open``'s memory map would keep
    every page read in RSS while the file is open. The header is checked on open."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ValueError(f"{path} is truncated: no safetensors header")
            header_size = struct.unpack("<Q", prefix)[0]
            if header_size > size - 8:
                raise ValueError(f"{path} is truncated or damaged: its header claims {header_size} bytes")
            try:
                header = json.loads(f.read(header_size))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path} has a damaged header: {e}") from None
        header.pop("__metadata__", None)
        self._data_start = 8 + header_size
        self._entries = {}
        for key, info in header.items():
            try:
                dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"{path} has a damaged header entry for '{key}'") from None
            if dtype not in _DTYPES_BY_NAME:
                raise ValueError(f"{path}: '{key}' has safetensors dtype {dtype}, which nxdtp does not handle")
            if self._data_start + end > size:
                raise ValueError(f"{path} is truncated: '{key}' ends at byte {self._data_start + end} of {size}")
            if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape) \
                    or end - begin != math.prod(shape) * _DTYPES_BY_NAME[dtype].itemsize:
                raise ValueError(f"{path} has a damaged header entry for '{key}': shape {shape} of {dtype} does not "
                                 f"fill bytes [{begin}, {end})")
            self._entries[key] = (dtype, shape, begin, end)

    def keys(self):
        return self._entries.keys()

    def get_slice(self, key: str) -> TensorInfo:
        dtype, shape, _, _ = self._entries[key]
        return TensorInfo(tuple(shape), dtype)

    def dtype(self, key: str) -> torch.dtype:
        return _DTYPES_BY_NAME[self._entries[key][0]]

    def get_tensor(self, key: str) -> torch.Tensor:
        return self._read(key, 0, None)

    def get_rows(self, key: str, start: int, length: int) -> torch.Tensor:
        """Rows ``[start, start + length)`` (along dim 0) of tensor ``key``, reading only their bytes."""
        return self.read_slice(key, 0, start, start + length)

    def read_slice(self, key: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """``[start, stop)`` along ``dim`` of tensor ``key``, reading only its bytes: one contiguous run for each
        index of the dimensions before ``dim`` (a single read for dim 0)."""
        dtype, shape, begin, _ = self._entries[key]
        if not 0 <= dim < len(shape) or not 0 <= start <= stop <= shape[dim]:
            raise ValueError(f"{self.path}: [{start}, {stop}) along dim {dim} of '{key}' (shape {shape}) does not "
                             f"exist")
        if dim == 0:
            return self._read(key, start, stop - start)
        step = math.prod(shape[dim + 1:]) * _DTYPES_BY_NAME[dtype].itemsize   # bytes of one index along dim
        run, outer = (stop - start) * step, math.prod(shape[:dim])
        buffer = torch.empty(outer * run, dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        with open(self.path, "rb") as f:
            for i in range(outer):
                f.seek(self._data_start + begin + (i * shape[dim] + start) * step)
                if f.readinto(view[i * run:(i + 1) * run]) != run:
                    raise ValueError(f"{self.path} is truncated: '{key}' could not be read whole")
        return buffer.view(_DTYPES_BY_NAME[dtype]).reshape(shape[:dim] + [stop - start] + shape[dim + 1:])

    def _read(self, key: str, start: int, length: Optional[int]) -> torch.Tensor:
        dtype, shape, begin, end = self._entries[key]
        row_bytes = (end - begin) // shape[0] if shape and shape[0] else 0
        if length is not None:
            begin, end = begin + start * row_bytes, begin + (start + length) * row_bytes
        buffer = torch.empty(end - begin, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self._data_start + begin)
            if f.readinto(memoryview(buffer.numpy())) != end - begin:
                raise ValueError(f"{self.path} is truncated: '{key}' could not be read whole")
        out_shape = shape if length is None else [length] + list(shape[1:])
        return buffer.view(_DTYPES_BY_NAME[dtype]).reshape(out_shape)

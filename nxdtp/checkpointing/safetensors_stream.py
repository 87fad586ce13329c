"""Write a safetensors file one tensor at a time, so the writer never holds more than one tensor in memory.

``safetensors.torch.save_file`` needs the whole dict at once. The format itself is simple (an 8-byte little-endian
header length, a JSON header with each tensor's dtype, shape and byte range, then the raw bytes in order), so when
every tensor's dtype and shape are known up front the header can be written first and the data streamed after it.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Dict, List, Optional, Tuple

import torch

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


class StreamingSafetensorsWriter:
    """``layout`` is the ordered list of (name, dtype, shape); ``write(name, tensor)`` must follow that order."""

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
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(encoded)))
        self._file.write(encoded)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected_name, dtype, shape = self._expected[self._position]
        if name != expected_name or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{self.path}: expected '{expected_name}' {dtype} {list(shape)} next, got '{name}' "
                             f"{tensor.dtype} {list(tensor.shape)}")
        data = tensor.detach().to("cpu").contiguous()
        # Raw little-endian bytes of the tensor, via a byte view (works for bfloat16, which numpy lacks).
        if data.numel():
            self._file.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
        self._position += 1

    def close(self) -> None:
        if self._position != len(self._expected):
            missing = [n for n, _, _ in self._expected[self._position:]]
            self._file.close()
            raise ValueError(f"{self.path}: {len(missing)} tensors were never written, first {missing[:3]}")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def __enter__(self) -> "StreamingSafetensorsWriter":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.close()
        else:
            self._file.close()

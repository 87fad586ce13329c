"""nxdtp's one safetensors reader (nxdtp.checkpointing.safetensors_stream.SafetensorsFileReader) against the
safetensors library: whole tensors and ranges along every dimension equal the library's tensors sliced, for every dtype
the reader accepts; a header whose shape does not fill its byte range is refused naming the file and the tensor."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nxdtp.checkpointing.safetensors_stream import _DTYPES_BY_NAME, SafetensorsFileReader

safetensors_torch = pytest.importorskip("safetensors.torch")


def _tensor(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (max(1, int(torch.Size(shape).numel())) * dtype.itemsize,), dtype=torch.uint8,
                        generator=generator)
    values = raw[:torch.Size(shape).numel() * dtype.itemsize].view(dtype).reshape(shape)
    return values.clone()


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: compared bytewise, NaN payloads of random bits compare equal to themselves."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


@settings(max_examples=25, deadline=None)
@given(dtype_name=st.sampled_from(sorted(_DTYPES_BY_NAME)), shape=st.lists(st.integers(0, 5), min_size=0, max_size=4),
       seed=st.integers(0, 2 ** 16), data=st.data())
def test_reads_equal_the_safetensors_library(tmp_path_factory, dtype_name, shape, seed, data):
    dtype = _DTYPES_BY_NAME[dtype_name]
    path = str(tmp_path_factory.mktemp("st") / "t.safetensors")
    tensors = {"a": _tensor(dtype, shape, seed), "b": _tensor(torch.float32, [3], seed + 1)}
    safetensors_torch.save_file(tensors, path)
    dense = safetensors_torch.load_file(path)
    reader = SafetensorsFileReader(path)
    assert sorted(reader.keys()) == ["a", "b"]
    assert reader.dtype("a") == dtype and reader.get_slice("a").get_shape() == shape
    whole = reader.get_tensor("a")
    assert whole.shape == dense["a"].shape and torch.equal(_bytes(whole), _bytes(dense["a"]))
    if shape:
        dim = data.draw(st.integers(0, len(shape) - 1))
        start = data.draw(st.integers(0, shape[dim]))
        stop = data.draw(st.integers(start, shape[dim]))
        piece = reader.read_slice("a", dim, start, stop)
        expected = dense["a"].narrow(dim, start, stop - start)
        assert piece.shape == expected.shape and piece.dtype == dtype
        assert torch.equal(_bytes(piece), _bytes(expected))


def test_a_header_whose_shape_does_not_fill_its_bytes_is_refused(tmp_path):
    path = str(tmp_path / "bad.safetensors")
    header = json.dumps({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + bytes(24))
    with pytest.raises(ValueError, match=r"bad\.safetensors has a damaged header entry for 'w'"):
        SafetensorsFileReader(path)


def test_a_range_outside_the_tensor_is_refused(tmp_path):
    path = str(tmp_path / "t.safetensors")
    safetensors_torch.save_file({"w": torch.zeros(2, 3)}, path)
    with pytest.raises(ValueError, match=r"\[1, 4\) along dim 1 of 'w' \(shape \[2, 3\]\) does not exist"):
        SafetensorsFileReader(path).read_slice("w", 1, 1, 4)

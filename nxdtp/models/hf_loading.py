"""Load Hugging Face weights into an already-sharded model, each rank reading only its own slices.

The model is built on the meta device, sharded by its plan, materialised empty, and then every parameter is filled from
the checkpoint: a sharded parameter reads only the rows or columns its spec assigns to this rank (``safetensors``
``get_slice``, or slices of a memory-mapped ``pytorch_model.bin``), so a rank's peak host memory is about its shard.

Checkpoint forms: ``model.safetensors``; sharded safetensors with ``model.safetensors.index.json``; ``pytorch_model.bin``
(loaded with ``weights_only=True``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from ..parallel_state import tensor_parallel_group
from ..spec import ParamSpec, ShardedModule
from ..utils import reattach_spec_attributes, retie_parameters, tied_parameter_names

logger = logging.getLogger(__name__)

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH_BIN = "pytorch_model.bin"
# Unmap the checkpoint after this many bytes of it were touched: bounds the mapped pages counted in RSS, at the cost of
# re-opening the file.
RELEASE_EVERY_BYTES = 16 * 2**20


class CheckpointReader:
    """Read whole tensors or slices of them from an HF model directory without loading the rest."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._files: Dict[str, str] = {}  # key -> file
        self._open: Dict[str, object] = {}
        if os.path.isfile(os.path.join(model_dir, SAFETENSORS)):
            self._add_safetensors(SAFETENSORS)
        elif os.path.isfile(os.path.join(model_dir, SAFETENSORS_INDEX)):
            with open(os.path.join(model_dir, SAFETENSORS_INDEX)) as f:
                weight_map = json.load(f)["weight_map"]
            for key, file in weight_map.items():
                if not os.path.isfile(os.path.join(model_dir, file)):
                    raise FileNotFoundError(f"{SAFETENSORS_INDEX} in {model_dir} names {file} for '{key}', "
                                            "which does not exist")
                self._files[key] = file
        elif os.path.isfile(os.path.join(model_dir, PYTORCH_BIN)):
            self._files = {key: PYTORCH_BIN for key in self._bin_state()}
        else:
            raise FileNotFoundError(f"{model_dir} has none of {SAFETENSORS}, {SAFETENSORS_INDEX}, {PYTORCH_BIN}")

    def _bin_state(self) -> Dict[str, torch.Tensor]:
        if PYTORCH_BIN not in self._open:
            path = os.path.join(self.model_dir, PYTORCH_BIN)
            self._open[PYTORCH_BIN] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return self._open[PYTORCH_BIN]

    def release(self) -> None:
        """Unmap the open files. Pages a slice touched stay in this process's RSS while the map is open (a slice
        along columns touches every page of the tensor), so long loads release every few hundred MiB."""
        self._open.clear()

    def _add_safetensors(self, file: str) -> None:
        for key in self._handle(file).keys():
            self._files[key] = file

    def _handle(self, file: str):
        if file not in self._open:
            from safetensors import safe_open

            self._open[file] = safe_open(os.path.join(self.model_dir, file), framework="pt", device="cpu")
        return self._open[file]

    def keys(self) -> List[str]:
        return list(self._files)

    def read(self, key: str, dim: Optional[int] = None, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
        """The tensor ``key``, or only ``[start, stop)`` along ``dim``."""
        file = self._files[key]
        if file == PYTORCH_BIN:
            tensor = self._bin_state()[key]
            return tensor.clone() if dim is None else tensor.narrow(dim, start, stop - start).clone()
        if dim is None:
            return self._handle(file).get_tensor(key)
        index = (slice(None),) * dim + (slice(start, stop),)
        return self._handle(file).get_slice(key)[index]

    def shape(self, key: str) -> Tuple[int, ...]:
        file = self._files[key]
        if file == PYTORCH_BIN:
            return tuple(self._bin_state()[key].shape)
        return tuple(self._handle(file).get_slice(key).get_shape())


def read_shard(reader: CheckpointReader, key: str, spec: ParamSpec, rank: int) -> torch.Tensor:
    """This rank's shard of ``key`` as ``spec`` lays it out: strided pieces, with zero rows where it is padded."""
    dim, tp, stride = spec.partition_dim, spec.num_partitions, spec.stride
    stored = reader.shape(key)
    if stored != spec.unpadded_shape:
        raise ValueError(f"checkpoint tensor '{key}' has shape {list(stored)}, but the model expects "
                         f"{list(spec.unpadded_shape)}")
    if spec.replicas > 1:
        # This rank's copies of repeated blocks (KV heads): each local block is a whole block of the dense tensor.
        block = spec.replica_block
        local_blocks = spec.full_shape[dim] // tp // block
        dense_blocks = [(rank * local_blocks + b) // spec.replicas for b in range(local_blocks)]
        return torch.cat([reader.read(key, dim, j * block, (j + 1) * block) for j in dense_blocks], dim=dim)
    piece = spec.full_shape[dim] // (tp * stride)
    parts = []
    for block in range(stride):
        start = (block * tp + rank) * piece
        for _, length, dense_start in spec.dense_segments(start, start + piece):
            if dense_start is not None:
                parts.append(reader.read(key, dim, dense_start, dense_start + length))
            else:
                shape = list(spec.full_shape)
                shape[dim] = length
                parts.append(torch.zeros(shape, dtype=parts[0].dtype if parts else torch.float32))
    return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]


def materialize_meta_model(model: nn.Module, device="cpu") -> nn.Module:
    """Give the meta tensors of a model real (uninitialised) storage on ``device``, keeping weight ties and TP
    attributes; tensors that already hold values (buffers computed at construction) are moved there unchanged."""
    tie_groups = tied_parameter_names(model)
    with torch.no_grad():
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is not None:
                    value = torch.empty_like(param, device=device) if param.is_meta else param.to(device)
                    module._parameters[name] = nn.Parameter(value, requires_grad=param.requires_grad)
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = torch.empty_like(buffer, device=device) if buffer.is_meta \
                        else buffer.to(device)
    retie_parameters(model, tie_groups)
    reattach_spec_attributes(model)
    return model


_REGISTER_PARAMETER_PATCH = threading.Lock()


@contextlib.contextmanager
def parameters_on_meta():
    """Construct modules with their parameters on the meta device and their buffers for real.

    Buffers a model computes at construction (position ids, rotary frequencies, causal masks) and does not store in
    checkpoints would be garbage if built on meta, and not every transformers release re-initialises them. Each
    parameter is moved to meta as it is registered, before any initialisation runs on it. ``register_parameter`` is
    patched process-wide for the duration: a lock keeps two such constructions apart, but another thread building
    modules meanwhile would get meta parameters too.
    """
    with _REGISTER_PARAMETER_PATCH:
        original = nn.Module.register_parameter

        def register_on_meta(module: nn.Module, name: str, param) -> None:
            if param is not None and not param.is_meta:
                param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            original(module, name, param)

        nn.Module.register_parameter = register_on_meta
        try:
            yield
        finally:
            nn.Module.register_parameter = original


def _spec_of(model: nn.Module, name: str) -> Optional[ParamSpec]:
    owner_name, _, attribute = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    return owner.param_specs().get(attribute) if isinstance(owner, ShardedModule) else None


def load_sharded_weights(model: nn.Module, reader: CheckpointReader,
                         candidate_keys: Callable[[str], Iterable[str]]) -> List[str]:
    """Fill every parameter of ``model`` from ``reader``; return the parameter names the checkpoint lacks.

    ``candidate_keys(name)`` lists the checkpoint keys that may hold parameter ``name`` (prefix and legacy-name
    variants), first match wins. Tied parameters are loaded once, through whichever of their names is present.
    """
    rank = tensor_parallel_group().rank
    available = set(reader.keys())
    read_since_release = 0
    tie_groups = {id(p): names for names in tied_parameter_names(model) for p in [model.get_parameter(names[0])]}
    missing: List[str] = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            names = tie_groups.get(id(param), [name])
            key = next((k for n in names for k in candidate_keys(n) if k in available), None)
            if key is None:
                missing.append(name)
                continue
            # The spec belongs to the module that owns the sharded copy, under any of the tied names.
            spec = next((s for s in (_spec_of(model, n) for n in names) if s is not None), None)
            if spec is not None and spec.is_sharded:
                value = read_shard(reader, key, spec, rank)
            else:
                value = reader.read(key)
                expected = tuple(spec.unpadded_shape) if spec is not None else tuple(param.shape)
                if tuple(value.shape) != expected:
                    raise ValueError(f"checkpoint tensor '{key}' has shape {list(value.shape)}, but parameter "
                                     f"'{name}' expects {list(expected)}")
            param.copy_(value.to(param.dtype))
            # A slice along any dim but the first reads a little of every row, so it touches every page of the tensor.
            touched = value.numel() * value.element_size()
            if spec is not None and spec.is_sharded and spec.partition_dim != 0:
                touched *= spec.num_partitions
            read_since_release += touched
            del value  # a slice may still view the mapped file
            if read_since_release >= RELEASE_EVERY_BYTES:
                reader.release()
                read_since_release = 0
    reader.release()
    return missing

"""Load Hugging Face weights into an already-sharded model, each rank reading only its own slices.

The model is built on the meta device, sharded by its plan, materialised empty, and then every parameter is filled from
the checkpoint: a sharded parameter reads only the rows or columns its spec assigns to this rank (``safetensors``
``get_slice``, or slices of a memory-mapped ``pytorch_model.bin``), so a rank's peak host memory is about its shard.

Checkpoint forms: ``model.safetensors``; sharded safetensors with ``model.safetensors.index.json``;
``pytorch_model.bin`` (loaded with ``weights_only=True``).

Damaged input is one :class:`PretrainedDirectoryError` naming the file and what is wrong: ``config.json`` that is not
JSON, not an object or has a value of the wrong type; a safetensors header that does not parse or does not match the
file's size; an index that names missing files; a tensor whose shape or dtype does not fit its parameter. Safetensors
records no checksum, so flipped bytes in a tensor's data cannot be detected (the format's limit).
"""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import os
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from ..checkpointing.safetensors_stream import SafetensorsFileReader
from ..checkpointing.slabs import read_piece
from ..errors import DamagedInputError
from ..spec import ParamSpec, ShardedModule
from ..topology import expert_parallel_group, tensor_parallel_group
from ..utils import reattach_spec_attributes, retie_parameters, tied_parameter_names

logger = logging.getLogger(__name__)

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH_BIN = "pytorch_model.bin"
# Unmap the checkpoint after this many bytes of it were touched: bounds the mapped pages counted in RSS, at the cost of
# re-opening the file.
RELEASE_EVERY_BYTES = 16 * 2**20
CONFIG = "config.json"


class PretrainedDirectoryError(DamagedInputError):
    """A Hugging Face model directory that cannot be loaded: the message names the file and what is wrong."""


# ---- config.json -----------------------------------------------------------------------------------------------------

def _json_kind(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _fits(value: Any, default: Any) -> bool:
    """Whether a config.json value has the type the config class's default for that key has (null is always
    allowed: configs set optional features to null, e.g. Qwen2's sliding_window)."""
    if value is None:
        return True
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, str):
        return isinstance(value, str)
    if isinstance(default, (list, tuple)):
        return isinstance(value, (list, tuple))
    if isinstance(default, dict):
        return isinstance(value, dict)
    return True  # None or an object: transformers decides


def read_config(model_dir: str, config_class=None):
    """The ``config.json`` of ``model_dir`` (a directory or the file itself) as ``config_class`` (default: the class
    its ``model_type`` names). Bad JSON, a non-object, an unknown model_type, a value whose type differs from the
    config class's default for that key, an unknown key that looks like a misspelling of a known one, or a config
    transformers refuses is a :class:`PretrainedDirectoryError` naming the file."""
    import transformers

    path = os.fspath(model_dir)
    if os.path.isdir(path):
        path = os.path.join(path, CONFIG)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: a Hugging Face model directory needs its {CONFIG}")
    try:
        with open(path, "rb") as f:
            raw = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise PretrainedDirectoryError(f"{path}: not valid JSON ({error})") from error
    if not isinstance(raw, dict):
        raise PretrainedDirectoryError(f"{path}: holds {_json_kind(raw)}, not a JSON object")
    if config_class is None:
        model_type = raw.get("model_type")
        if not isinstance(model_type, str) or model_type not in transformers.CONFIG_MAPPING:
            raise PretrainedDirectoryError(f"{path}: model_type {model_type!r} is not one transformers "
                                           f"{transformers.__version__} knows (e.g. 'bert', 'llama', 'gpt2')")
        config_class = transformers.CONFIG_MAPPING[model_type]
    architectures = raw.get("architectures")
    if isinstance(architectures, list):
        unknown = [a for a in architectures if not (isinstance(a, str) and hasattr(transformers, a))]
        if unknown:
            raise PretrainedDirectoryError(f"{path}: 'architectures' names {unknown}, which transformers "
                                           f"{transformers.__version__} does not have")
    defaults = config_class()
    known = set(vars(defaults)) | set(defaults.to_dict())  # to_dict adds class attributes such as model_type
    for key, value in raw.items():
        if key not in known:
            # The config class keeps keys it does not know as plain attributes, so a misspelt (or damaged) key would
            # silently leave the default in its place.
            close = difflib.get_close_matches(key, known, n=1, cutoff=MISSPELLING_CUTOFF)
            if close:
                raise PretrainedDirectoryError(f"{path}: '{key}' is not a {config_class.__name__} key; did you mean "
                                               f"'{close[0]}'?")
        default = getattr(defaults, key, None)
        if not _fits(value, default):
            raise PretrainedDirectoryError(f"{path}: '{key}' is {_json_kind(value)} ({value!r}); "
                                           f"{config_class.__name__} needs {_json_kind(default)} there")
        if isinstance(default, int) and not isinstance(default, bool) and key.endswith(_SIZE_KEYS) and value < 1:
            raise PretrainedDirectoryError(f"{path}: '{key}' is {value}; it must be at least 1")
        if key.endswith(_ACTIVATION_KEYS) and isinstance(value, str):
            from transformers.activations import ACT2FN

            if value not in ACT2FN:
                raise PretrainedDirectoryError(f"{path}: '{key}' is {value!r}, which is not an activation transformers "
                                               f"knows (e.g. 'gelu', 'relu', 'silu')")
    try:
        return config_class.from_dict(raw)
    except Exception as error:  # noqa: BLE001 - transformers' own checks (e.g. heads dividing the hidden size)
        raise PretrainedDirectoryError(f"{path}: {config_class.__name__} refuses it: {type(error).__name__}: "
                                       f"{error}") from error


# How alike (difflib's ratio) an unknown config key and a known one must be to call the unknown one a misspelling: one
# character changed in a key of 7 or more characters.
MISSPELLING_CUTOFF = 0.85
# String config keys that name an activation function (looked up in transformers' ACT2FN when the model is built).
_ACTIVATION_KEYS = ("_act", "_activation")
# Integer config keys that are sizes or counts: zero or negative would build an empty or broken model.
_SIZE_KEYS = ("_size", "_layers", "_heads", "_embeddings", "_positions")


# ---- weights ---------------------------------------------------------------------------------------------------------


class CheckpointReader:
    """Read whole tensors or slices of them from an HF model directory without loading the rest."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._files: Dict[str, str] = {}  # key -> file
        self._open: Dict[str, object] = {}
        if os.path.isfile(os.path.join(model_dir, SAFETENSORS)):
            self._add_safetensors(SAFETENSORS)
        elif os.path.isfile(os.path.join(model_dir, SAFETENSORS_INDEX)):
            for key, file in self._weight_map().items():
                if not os.path.isfile(os.path.join(model_dir, file)):
                    raise FileNotFoundError(f"{os.path.join(model_dir, SAFETENSORS_INDEX)} names {file} for '{key}', "
                                            "which does not exist")
                self._files[key] = file
            for file in sorted(set(self._files.values())):
                self._check_index_against(file)
        elif os.path.isfile(os.path.join(model_dir, PYTORCH_BIN)):
            self._files = {key: PYTORCH_BIN for key in self._bin_state()}
        else:
            raise FileNotFoundError(f"{model_dir} has none of {SAFETENSORS}, {SAFETENSORS_INDEX}, {PYTORCH_BIN}")

    def path(self, key: str) -> str:
        """The file holding ``key``."""
        return os.path.join(self.model_dir, self._files[key])

    def _weight_map(self) -> Dict[str, str]:
        path = os.path.join(self.model_dir, SAFETENSORS_INDEX)
        try:
            with open(path, "rb") as f:
                index = json.loads(f.read().decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as error:
            raise PretrainedDirectoryError(f"{path}: not valid JSON ({error})") from error
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise PretrainedDirectoryError(f"{path}: needs a 'weight_map' object (tensor name -> file name)")
        for key, file in weight_map.items():
            if not isinstance(file, str) or not file or os.path.basename(file) != file:
                raise PretrainedDirectoryError(f"{path}: 'weight_map' gives {file!r} for '{key}'; expected the name "
                                               "of a safetensors file in the same directory")
        return weight_map

    def _check_index_against(self, file: str) -> None:
        """The index and the file must agree on which tensors the file holds, or a damaged name would go unnoticed."""
        listed = {key for key, f in self._files.items() if f == file}
        held = set(self._handle(file).keys())
        if listed != held:
            raise PretrainedDirectoryError(
                f"{os.path.join(self.model_dir, SAFETENSORS_INDEX)} and {os.path.join(self.model_dir, file)} disagree: "
                f"listed but not in the file: {sorted(listed - held)[:4]}; in the file but not listed: "
                f"{sorted(held - listed)[:4]}")

    def _bin_state(self) -> Dict[str, torch.Tensor]:
        if PYTORCH_BIN not in self._open:
            path = os.path.join(self.model_dir, PYTORCH_BIN)
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as error:  # noqa: BLE001 - whatever torch.load trips over, name the file
                raise PretrainedDirectoryError(f"{path}: cannot be read as a torch checkpoint (truncated or "
                                               f"damaged?): {type(error).__name__}: {error}") from error
            if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                      for k, v in state.items()):
                raise PretrainedDirectoryError(f"{path}: expected a state dict (tensor name -> tensor), found "
                                               f"{type(state).__name__}")
            self._open[PYTORCH_BIN] = state
        return self._open[PYTORCH_BIN]

    def release(self) -> None:
        """Close the open files. A ``pytorch_model.bin`` is memory-mapped, and pages a slice touched stay in this
        process's RSS while the map is open (a slice along columns touches every page of the tensor), so long loads
        release every few hundred MiB; safetensors files are read with plain reads and hold no pages."""
        self._open.clear()

    def _add_safetensors(self, file: str) -> None:
        for key in self._handle(file).keys():
            self._files[key] = file

    def _handle(self, file: str):
        if file not in self._open:
            path = os.path.join(self.model_dir, file)
            try:
                self._open[file] = SafetensorsFileReader(path)
            except (OSError, ValueError) as error:
                raise PretrainedDirectoryError(f"{path}: not a readable safetensors file (truncated, or its header is "
                                               f"damaged): {error}") from error
        return self._open[file]

    def keys(self) -> List[str]:
        return list(self._files)

    def read(self, key: str, dim: Optional[int] = None, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
        """The tensor ``key``, or only ``[start, stop)`` along ``dim``."""
        file = self._files[key]
        if file == PYTORCH_BIN:
            tensor = self._bin_state()[key]
            return tensor.clone() if dim is None else tensor.narrow(dim, start, stop - start).clone()
        try:
            if dim is None:
                return self._handle(file).get_tensor(key)
            stop = self.shape(key)[dim] if stop is None else stop
            return self._handle(file).read_slice(key, dim, start, stop)
        except PretrainedDirectoryError:
            raise
        except Exception as error:  # noqa: BLE001 - e.g. a dtype this torch cannot hold
            raise PretrainedDirectoryError(f"{self.path(key)}: cannot read '{key}': {error}") from error

    def shape(self, key: str) -> Tuple[int, ...]:
        file = self._files[key]
        if file == PYTORCH_BIN:
            return tuple(self._bin_state()[key].shape)
        return tuple(self._handle(file).get_slice(key).get_shape())

    def dtype_name(self, key: str) -> str:
        """The stored dtype: a torch dtype's name, or a safetensors dtype code (F32, BF16, I64, BOOL, ...)."""
        file = self._files[key]
        if file == PYTORCH_BIN:
            return str(self._bin_state()[key].dtype).replace("torch.", "")
        return self._handle(file).get_slice(key).get_dtype()


# Stored dtypes a floating-point parameter may be loaded from (cast to the parameter's dtype, as HF does).
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "float64", "float32", "float16", "bfloat16"}


def check_stored_tensor(reader: CheckpointReader, key: str, name: str, param: torch.Tensor,
                        expected: Tuple[int, ...]) -> None:
    """The stored shape must be the dense shape ``expected``, and a floating-point parameter must come from a
    floating-point tensor (an integer or bool tensor there is damage, not a precision choice)."""
    stored = reader.shape(key)
    if stored != tuple(expected):
        raise PretrainedDirectoryError(f"{reader.path(key)}: tensor '{key}' has shape {list(stored)}, but parameter "
                                       f"'{name}' expects {list(expected)}")
    dtype = reader.dtype_name(key)
    if param.is_floating_point() and dtype not in _FLOAT_DTYPES:
        raise PretrainedDirectoryError(f"{reader.path(key)}: tensor '{key}' is {dtype}, but parameter '{name}' is "
                                       f"floating point ({str(param.dtype).replace('torch.', '')})")


def read_shard(reader: CheckpointReader, key: str, spec: ParamSpec, rank: int) -> torch.Tensor:
    """This rank's shard of ``key`` as ``spec`` lays it out (strided pieces, copies of repeated heads, zero rows where
    it is padded), read in the runs the layout algebra gives (``slabs.read_ranges``): never the whole tensor."""
    stored = reader.shape(key)
    if stored != spec.unpadded_shape:
        raise PretrainedDirectoryError(f"{reader.path(key)}: tensor '{key}' has shape {list(stored)}, but the model "
                                       f"expects {list(spec.unpadded_shape)}")
    dim = spec.partition_dim if spec.is_sharded else 0
    return read_piece(spec, lambda start, stop: reader.read(key, dim, start, stop), rank)


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


def _refuse_damaged_names(reader: CheckpointReader, wanted: Dict[str, List[str]], unused: Iterable[str]) -> None:
    """A parameter the checkpoint lacks is normally new (a fresh head) and is initialised; but if the checkpoint holds
    a key nothing loads that differs from one of its names in a byte or two, the header was damaged and loading would
    silently replace a trained tensor with a fresh one."""
    if not wanted:
        return
    for key in sorted(unused):
        for name, candidates in wanted.items():
            for candidate in candidates:
                if len(candidate) == len(key) and 0 < sum(a != b for a, b in zip(candidate, key)) <= 2:
                    raise PretrainedDirectoryError(
                        f"{reader.path(key)}: holds '{key}' where the model expects '{candidate}' (for parameter "
                        f"'{name}'): the names differ in one or two characters, so the file's header looks damaged")


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
    wanted: Dict[str, List[str]] = {}  # missing parameter -> the keys it could have been stored under
    used = set()
    for name, param in model.named_parameters():
        names = tie_groups.get(id(param), [name])
        key = next((k for n in names for k in candidate_keys(n) if k in available), None)
        if key is None:
            wanted[name] = [k for n in names for k in candidate_keys(n)]
        used.add(key)
    _refuse_damaged_names(reader, wanted, available - used)
    with torch.no_grad():
        for name, param in model.named_parameters():
            names = tie_groups.get(id(param), [name])
            key = next((k for n in names for k in candidate_keys(n) if k in available), None)
            if key is None:
                missing.append(name)
                continue
            # The spec belongs to the module that owns the sharded copy, under any of the tied names.
            spec = next((s for s in (_spec_of(model, n) for n in names) if s is not None), None)
            check_stored_tensor(reader, key, name, param,
                                tuple(spec.unpadded_shape) if spec is not None else tuple(param.shape))
            if spec is not None and spec.is_sharded:
                value = read_shard(reader, key, spec.with_all_experts(), rank)
                if spec.expert_partitions > 1:   # the TP piece holds every expert: keep this rank's
                    value = spec.experts_of_rank(value, expert_parallel_group().rank)
            else:
                value = reader.read(key)
            param.copy_(value.to(param.dtype))
            # A slice along any dim but the first reads a little of every row, so it touches every page of the tensor
            # (and the TP piece was read with every expert).
            touched = value.numel() * value.element_size()
            if spec is not None and spec.is_sharded and spec.partition_dim != 0:
                touched *= spec.num_partitions * spec.expert_partitions
            read_since_release += touched
            del value  # a slice may still view the mapped file
            if read_since_release >= RELEASE_EVERY_BYTES:
                reader.release()
                read_since_release = 0
    reader.release()
    return missing

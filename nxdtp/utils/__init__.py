"""NxD's small helpers (``neuronx_distributed.parallel_layers.utils``), plus moving a sharded model between devices
without losing its specs or weight ties.

The package is also NxD's ``neuronx_distributed.utils`` package, so that its module paths change only their prefix:
``nxdtp.utils.batch_utils`` (``get_batch_on_this_context_parallel_rank``, ``shift_labels``) and
``nxdtp.utils.adamw_fp32_optim_params`` (``AdamW_FP32OptimParams``, which lives in ``nxdtp.optimizer``). Neither is
imported here: the optimizer sits in a layer above this one."""

from __future__ import annotations

import collections.abc
import enum
import os
import random as _python_random
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .. import comm
from ..process_groups import initialize_single_process_world
from ..rounding import round_up
from ..spec import ShardedModule, split_along
from ..topology import initialize_model_parallel, model_parallel_is_initialized, tensor_parallel_group

# replica_segments: a fused parameter's copies per row segment (GQAQKVColumnParallelLinear's weight_qkv), which the
# gradient norm needs as much as num_replicas.
_SPEC_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "num_partitions",
                    "sequence_parallel_enabled", "num_replicas", "grad_allreduced_in_backward", "replica_segments")


# NxD's defaults for the attribute cache of a parameter that no parallel layer made.
_NXD_ATTRIBUTE_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1,
                           "num_partitions": 1}


class hardware(enum.Enum):
    """NxD's Neuron hardware kinds (``neuronx_distributed.utils.utils.hardware``), so that code passing
    ``hardware_type=hardware.TRN2`` (``pad.generate_padding_mask``, ``parallel_state.arrange_kv_groups``) changes only
    its import. ``hardware(name)`` takes a platform target name as NxD's does: "trn1", "trn2", "trn3", and "trn1n" or
    "inf2" (which share Trainium1's layout) as ``TRN1``; the name in ``NEURON_PLATFORM_TARGET_OVERRIDE`` gives
    ``CUSTOM``. Other names raise ``ValueError``, as any enum lookup does."""

    TRN1 = "trn1"
    TRN2 = "trn2"
    TRN3 = "trn3"
    CUSTOM = "custom"

    @classmethod
    def _missing_(cls, value):
        # Called only for names that are not a member's value: the platform aliases and a user-declared platform.
        aliases = {"trn1n": cls.TRN1, "inf2": cls.TRN1}
        if value in aliases:
            return aliases[value]
        if value is not None and value == os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE"):
            return cls.CUSTOM
        return None


def ensure_divisibility(numerator: int, denominator: int) -> None:
    if denominator <= 0 or numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")


def divide(numerator: int, denominator: int) -> int:
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


def get_padding_length(numerator: int, denominator: int) -> int:
    """How much to add to ``numerator`` to make ``denominator`` divide it."""
    if denominator <= 0:
        raise ValueError(f"get_padding_length: denominator={denominator} must be > 0")
    return round_up(numerator, denominator) - numerator


def split_tensor_along_dim(tensor: torch.Tensor, dim: int, num_partitions: int,
                           contiguous_split_chunks: bool = False) -> Sequence[torch.Tensor]:
    """``tensor`` split evenly along ``dim`` into ``num_partitions`` pieces, piece r being TP rank r's. With
    ``contiguous_split_chunks`` each piece is the layout algebra's cut (``nxdtp.spec.split_along``), a tensor of its own
    (a tuple); otherwise, as NxD's, ``torch.split``'s views of ``tensor`` (a list), which copy nothing."""
    size = tensor.shape[dim]
    if num_partitions <= 0 or size % num_partitions != 0:
        raise ValueError(f"dimension {dim} of shape {tuple(tensor.shape)} is not divisible by "
                         f"num_partitions={num_partitions}")
    if contiguous_split_chunks:
        return tuple(split_along(tensor, dim, rank, num_partitions) for rank in range(num_partitions))
    return list(torch.split(tensor, size // num_partitions, dim=dim))


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int,
                                contiguous_split_chunks: bool = False) -> Sequence[torch.Tensor]:
    return split_tensor_along_dim(tensor, tensor.dim() - 1, num_partitions, contiguous_split_chunks)


def split_tensor_along_second_dim(tensor: torch.Tensor, num_partitions: int,
                                  contiguous_split_chunks: bool = False) -> Sequence[torch.Tensor]:
    return split_tensor_along_dim(tensor, 1, num_partitions, contiguous_split_chunks)


def indices_split_along_dim(tensor: Optional[torch.Tensor], dim: int, rank: int,
                            num_partitions: int) -> Optional[torch.Tensor]:
    """The indices along ``dim`` of ``rank``'s part when ``tensor`` is split evenly into ``num_partitions``."""
    if tensor is None:
        return None
    size = divide(tensor.shape[dim], num_partitions)
    return torch.arange(rank * size, (rank + 1) * size, device=tensor.device)


class EmbeddingUtility:
    """The ``[first, last)`` vocabulary range of a rank's partition."""

    @staticmethod
    def range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int,
                                            world_size: int) -> Tuple[int, int]:
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int) -> Tuple[int, int]:
        return EmbeddingUtility.range_from_per_partition_vocab_size(divide(global_vocab_size, world_size), rank,
                                                                    world_size)


def cast_tensor(tensor: torch.Tensor, from_dtype: torch.dtype = torch.float32,
                to_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return tensor.to(dtype=to_dtype) if tensor.dtype == from_dtype else tensor


def cast_all(state: Any, from_dtype: torch.dtype = torch.float32, to_dtype: torch.dtype = torch.bfloat16) -> Any:
    """``cast_tensor`` on every tensor inside dicts, lists and tuples; anything else is returned as it is."""
    if isinstance(state, torch.Tensor):
        return cast_tensor(state, from_dtype, to_dtype)
    if isinstance(state, dict):
        return {key: cast_all(value, from_dtype, to_dtype) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(cast_all(value, from_dtype, to_dtype) for value in state)
    return state


def _autocast_dtype() -> Optional[torch.dtype]:
    # NxD asks only for the GPU's autocast; nxdtp also looks at XLA's and the CPU's, in that order.
    for device_type in ("cuda", "xla", "cpu"):
        try:
            if torch.is_autocast_enabled(device_type):
                return torch.get_autocast_dtype(device_type)
        except RuntimeError:   # a device type this torch build does not know
            continue
    return None


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype is not torch.float64 else value
    if isinstance(value, (str, bytes)):
        return value
    if isinstance(value, collections.abc.Mapping):
        return {_cast_floating(k, dtype): _cast_floating(v, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floating(v, dtype) for v in value)
    return value


def cast_if_autocast_enabled(*args: Any) -> Any:
    """``args`` with floating tensors (not float64) cast to the autocast dtype when autocast is on, else unchanged."""
    dtype = _autocast_dtype()
    return args if dtype is None else _cast_floating(args, dtype)


def verify_casted_dtype(value: Any) -> None:
    """Raise if a tensor inside ``value`` is not in the autocast dtype while autocast is on."""
    dtype = _autocast_dtype()
    if dtype is None:
        return
    if isinstance(value, torch.Tensor):
        if value.dtype != dtype:
            raise TypeError(f"a tensor is {value.dtype}, but autocast expects {dtype}")
    elif isinstance(value, collections.abc.Mapping):
        for key, item in value.items():
            verify_casted_dtype(key)
            verify_casted_dtype(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            verify_casted_dtype(item)


def move_all_tensor_to_cpu(data: Any, convert: bool = True) -> Any:
    """Every device tensor inside dicts, lists and tuples: its pending work executed (one ``comm.materialize`` for all
    of them, which runs XLA's graph once) and, with ``convert``, copied to the CPU; other values unchanged."""
    def map_tensors(value, function):
        if isinstance(value, torch.Tensor):
            return function(value)
        if isinstance(value, dict):
            return {key: map_tensors(item, function) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(map_tensors(item, function) for item in value)
        return value

    on_device = []
    map_tensors(data, lambda t: on_device.append(t) if t.device.type != "cpu" else None)
    if on_device:
        comm.materialize(on_device)
    return map_tensors(data, lambda t: t.cpu()) if convert else data


def get_local_world_size() -> int:
    """Processes on this host: torchrun's ``LOCAL_WORLD_SIZE``, else 1."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={value!r} is not a positive integer")
    return int(value)


# ---- the running stack -----------------------------------------------------------------------------------------------

def _torch_version(version: Optional[str] = None) -> Tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version if version is not None else torch.__version__)
    if match is None:
        raise ValueError(f"cannot read a major.minor version from torch.__version__={torch.__version__!r}")
    return int(match.group(1)), int(match.group(2))


def is_torch_version_greater_than_2() -> bool:
    """True from torch 2.0 on (NxD's meaning, despite the name: its test is ``__version__.startswith("2")``)."""
    return _torch_version() >= (2, 0)


def is_pjrt_device() -> bool:
    """True when ``PJRT_DEVICE`` names an XLA device for torch_xla's PJRT runtime (any device: CPU, CUDA, TPU,
    NEURON). NxD asks for ``NEURON`` only, the one device it runs on; torch_xla 2.x has no other runtime."""
    return bool(os.environ.get("PJRT_DEVICE", "").strip())


def requires_init_pg_override() -> bool:
    """True on torch 2.0.x only, where an "xla" process group had to be created with ``init_method="pjrt://"``
    (``torch_xla.experimental.pjrt_backend``); later versions need no override."""
    return _torch_version() == (2, 0)


def initialize_fallback_parallel_state(device: Optional[torch.device] = None) -> None:
    """Set up a single-process world, so that parallel layers work without torchrun (NxD's name).

    Unless torch.distributed is initialized already, a world of 1 is created in process (a ``HashStore``: no port is
    opened) with the backend for ``device``: gloo for ``None`` and CPU, torch_xla's "xla" for an XLA device, and for
    other devices their torch.distributed backend next to gloo for CPU tensors (``"cpu:gloo,cuda:nccl"``). Then
    ``initialize_model_parallel(tensor_model_parallel_size=1)``: with an existing world of N processes, that makes N
    data-parallel replicas. On an XLA device it also seeds as NxD does (Python's ``random``, numpy when installed, and
    ``model_parallel_xla_manual_seed(0)``). Raises ``RuntimeError`` if model parallel is initialized already.
    """
    if model_parallel_is_initialized():
        raise RuntimeError("initialize_fallback_parallel_state: model parallel is already initialized; call "
                           "nxdtp.parallel_state.destroy_model_parallel() first to replace it")
    backend = initialize_single_process_world(device)
    initialize_model_parallel(tensor_model_parallel_size=1)
    if backend == "xla":
        from ..random import model_parallel_xla_manual_seed

        _python_random.seed(0)
        try:
            import numpy
        except ImportError:
            pass
        else:
            numpy.random.seed(0)
        model_parallel_xla_manual_seed(0)


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int = 1,
                                         num_partitions: int = -1, rank_ordering: Optional[list] = None) -> None:
    """NxD's attribute cache, set by hand (modules built from nxdtp layers set it themselves). ``num_partitions=-1``
    means the TP size, as in NxD. ``rank_ordering`` may be None or the identity ``[0, ..., tp - 1]``: nxdtp's TP rank
    r always holds shard r."""
    if rank_ordering is not None:
        tp = tensor_parallel_group().size
        if list(rank_ordering) != list(range(tp)):
            raise ValueError(f"set_tensor_model_parallel_attributes: rank_ordering={list(rank_ordering)!r} is not "
                             f"supported by nxdtp: tensor-parallel rank r holds shard r; valid are None or "
                             f"{list(range(tp))}")
    if num_partitions == -1:
        num_partitions = tensor_parallel_group().size
    tensor.tensor_model_parallel = bool(is_parallel)
    tensor.partition_dim = dim
    tensor.partition_stride = stride
    tensor.num_partitions = num_partitions


def copy_tensor_model_parallel_attributes(destination_tensor: torch.Tensor, source_tensor: torch.Tensor) -> None:
    for attribute in _SPEC_ATTRIBUTES:
        if hasattr(source_tensor, attribute):
            setattr(destination_tensor, attribute, getattr(source_tensor, attribute))


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    for attribute, default in _NXD_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, attribute):
            setattr(tensor, attribute, default)


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, tensor_parallel_rank: Optional[int] = None) -> bool:
    """True where this rank's copy of ``param`` should count once in a TP-wide sum (sharded, or TP rank 0). NxD's
    form takes only ``param`` and reads the TP rank from the parallel state."""
    if tensor_parallel_rank is None:
        tensor_parallel_rank = tensor_parallel_group().rank
    return bool(getattr(param, "tensor_model_parallel", False)) or tensor_parallel_rank == 0


def tied_parameter_names(model: nn.Module) -> List[List[str]]:
    """Groups of parameter names that share one Parameter object (e.g. an LM head tied to the word embedding)."""
    by_identity: Dict[int, List[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_identity.setdefault(id(param), []).append(name)
    return [names for names in by_identity.values() if len(names) > 1]


def _set_parameter(model: nn.Module, dotted_name: str, param: nn.Parameter) -> None:
    owner_name, _, attribute = dotted_name.rpartition(".")
    setattr(model.get_submodule(owner_name) if owner_name else model, attribute, param)


def retie_parameters(model: nn.Module, tie_groups: List[List[str]]) -> None:
    for names in tie_groups:
        shared = model.get_parameter(names[0])
        for name in names[1:]:
            _set_parameter(model, name, shared)


def reattach_spec_attributes(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, ShardedModule):
            module.reattach_spec_attributes()


def move_model_to_device(model: nn.Module, device: Optional[torch.device | str]) -> nn.Module:
    """``model.to(device)`` that keeps weight ties and the TP attribute cache.

    Moving to an XLA device replaces every Parameter object, which unties shared weights and drops attributes set on the
    old objects. The ties are recorded before the move and restored after; the attributes are rebuilt from the specs the
    modules own.
    """
    tie_groups = tied_parameter_names(model)
    # Attributes set by hand on parameters of non-nxdtp modules are kept too; the modules' specs then take precedence.
    hand_set = {name: {a: getattr(p, a) for a in _SPEC_ATTRIBUTES if hasattr(p, a)}
                for name, p in model.named_parameters()}
    model.to(device)
    retie_parameters(model, tie_groups)
    for name, param in model.named_parameters():
        for attribute, value in hand_set.get(name, {}).items():
            setattr(param, attribute, value)
    reattach_spec_attributes(model)
    return model


__all__ = [
    "ensure_divisibility", "divide", "get_padding_length", "split_tensor_along_dim", "split_tensor_along_last_dim",
    "split_tensor_along_second_dim", "indices_split_along_dim", "EmbeddingUtility", "cast_tensor", "cast_all",
    "cast_if_autocast_enabled", "verify_casted_dtype", "move_all_tensor_to_cpu", "get_local_world_size",
    "set_defaults_if_not_set_tensor_model_parallel_attributes", "set_tensor_model_parallel_attributes",
    "copy_tensor_model_parallel_attributes", "param_is_not_tensor_parallel_duplicate", "tied_parameter_names",
    "retie_parameters", "reattach_spec_attributes", "move_model_to_device", "is_torch_version_greater_than_2",
    "is_pjrt_device", "requires_init_pg_override", "initialize_fallback_parallel_state", "hardware",
]

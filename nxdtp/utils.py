"""NxD's small helpers, plus moving a sharded model between devices without losing its specs or weight ties."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from .spec import ShardedModule

_SPEC_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "num_partitions",
                    "sequence_parallel_enabled", "num_replicas")


def divide(numerator: int, denominator: int) -> int:
    if denominator <= 0 or numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int,
                                contiguous_split_chunks: bool = False) -> Sequence[torch.Tensor]:
    last = tensor.shape[-1]
    if last % num_partitions != 0:
        raise ValueError(f"last dimension {last} of shape {tuple(tensor.shape)} is not divisible by "
                         f"num_partitions={num_partitions}")
    chunks = torch.split(tensor, last // num_partitions, dim=-1)
    return tuple(c.contiguous() for c in chunks) if contiguous_split_chunks else chunks


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int = 1,
                                         num_partitions: int = -1) -> None:
    """NxD's attribute cache, set by hand (modules built from nxdtp layers set it themselves)."""
    tensor.tensor_model_parallel = bool(is_parallel)
    tensor.partition_dim = dim
    tensor.partition_stride = stride
    tensor.num_partitions = num_partitions


def copy_tensor_model_parallel_attributes(destination_tensor: torch.Tensor, source_tensor: torch.Tensor) -> None:
    for attribute in _SPEC_ATTRIBUTES:
        if hasattr(source_tensor, attribute):
            setattr(destination_tensor, attribute, getattr(source_tensor, attribute))


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, tensor_parallel_rank: int) -> bool:
    """True where this rank's copy of ``param`` should count once in a TP-wide sum (sharded, or TP rank 0)."""
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
    "divide", "split_tensor_along_last_dim", "set_tensor_model_parallel_attributes",
    "copy_tensor_model_parallel_attributes", "param_is_not_tensor_parallel_duplicate", "tied_parameter_names",
    "retie_parameters", "reattach_spec_attributes", "move_model_to_device",
]

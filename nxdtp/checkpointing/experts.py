"""Expert tensors split over the expert-parallel group, as checkpoints take and give them: files hold every expert of a
TP piece, so a checkpoint loads at any expert-parallel size; saving gathers one tensor at a time on the host, loading
keeps this rank's experts."""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
from torch import nn

from .. import comm
from ..spec import ParamSpec, ShardedModule
from ..topology import expert_parallel_group


def gather_experts(local: torch.Tensor, spec: ParamSpec) -> Tuple[torch.Tensor, ParamSpec]:
    """Collective over the expert-parallel group when ``spec`` splits experts: this TP piece with every expert (on the
    host) and its spec; otherwise ``local`` and ``spec`` unchanged. ``local`` is any tensor indexed by this rank's
    experts along dim 0."""
    if spec.expert_partitions == 1:
        return local, spec
    group = expert_parallel_group()
    if group.size != spec.expert_partitions:
        raise ValueError(f"a tensor whose experts are split over {spec.expert_partitions} ranks, but the "
                         f"expert-parallel group has {group.size}")
    return comm.all_gather(local.detach().to("cpu"), group, dim=0), spec.with_all_experts()


def indexed_by_experts(value: Any, spec: ParamSpec, experts: int) -> bool:
    """Whether ``value`` (an entry of a parameter's state) is a tensor indexed by ``experts`` experts along dim 0, as
    the parameter of ``spec`` is: its moments, or factored statistics of the same rank."""
    return (isinstance(value, torch.Tensor) and value.dim() == len(spec.full_shape) and value.dim() > 0
            and value.shape[0] == experts)


class GatheredWhenWritten:
    """A tensor stored with every expert: ``value()`` gathers them (a collective, called by every rank of the group in
    the same order), so a save holds one gathered tensor at a time."""

    def __init__(self, local: torch.Tensor, spec: ParamSpec):
        self.local, self.spec = local, spec
        self.dtype = local.dtype
        self.shape = torch.Size((local.shape[0] * spec.expert_partitions,) + tuple(local.shape[1:]))

    def value(self) -> torch.Tensor:
        return gather_experts(self.local, self.spec)[0]


def written_value(tensor) -> torch.Tensor:
    """The tensor to write: a ``GatheredWhenWritten``'s gathered value, any other tensor itself."""
    return tensor.value() if isinstance(tensor, GatheredWhenWritten) else tensor


def gather_without_writing(tensors: Dict[str, Any]) -> None:
    """Take part, in order, in the gathers of ``tensors`` that a rank which writes none of them owes its group."""
    for tensor in tensors.values():
        if isinstance(tensor, GatheredWhenWritten):
            tensor.value()


def expert_specs(model: nn.Module) -> Dict[str, ParamSpec]:
    """The specs of ``model``'s tensors whose experts are split over ranks, by state-dict key."""
    by_identity = {}
    for module in model.modules():
        if isinstance(module, ShardedModule):
            for name, spec in module.param_specs().items():
                if spec.expert_partitions > 1:
                    by_identity[id(getattr(module, name))] = spec
    return {key: by_identity[id(value)] for key, value in model.state_dict(keep_vars=True).items()
            if id(value) in by_identity}


def keep_this_ranks_experts(state: Dict[str, torch.Tensor], specs: Dict[str, ParamSpec]) -> None:
    """Replace, in ``state``, each tensor holding every expert of a key in ``specs`` by this rank's experts of it."""
    rank = expert_parallel_group().rank
    for key, spec in specs.items():
        if key in state:
            value = state[key]
            if not indexed_by_experts(value, spec, spec.full_shape[0]):
                raise ValueError(f"'{key}' has shape {list(value.shape)}; a tensor holding every expert has "
                                 f"{spec.full_shape[0]} rows along dim 0 and {len(spec.full_shape)} dims")
            state[key] = spec.experts_of_rank(value, rank)

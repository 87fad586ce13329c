"""Expert tensors split over the expert-parallel group, as checkpoints take and give them.

Files hold every expert of a TP piece (``ParamSpec.with_all_experts``), so a checkpoint loads at any expert-parallel
size and merges, reshards and exports as a model without expert parallelism does. Saving gathers each expert tensor
over the expert-parallel group, one tensor at a time and on the host (the device never holds more experts than it
trains); loading keeps this rank's experts of what the file holds.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch import nn

from .. import comm
from ..spec import ParamSpec, ShardedModule
from ..topology import expert_parallel_group


def gather_experts(local: torch.Tensor, spec: ParamSpec) -> Tuple[torch.Tensor, ParamSpec]:
    """Collective over the expert-parallel group when ``spec`` splits experts: this TP piece with every expert (a
    host tensor) and its spec; otherwise ``local`` and ``spec`` unchanged. Every rank of the group must call it for
    the same tensor."""
    if spec.expert_partitions == 1:
        return local, spec
    group = expert_parallel_group()
    if group.size != spec.expert_partitions:
        raise ValueError(f"a tensor whose experts are split over {spec.expert_partitions} ranks, but the "
                         f"expert-parallel group has {group.size}")
    return comm.all_gather(local.detach().to("cpu"), group, dim=0), spec.with_all_experts()


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
            every = spec.with_all_experts().local_shape()
            if tuple(value.shape) != every:
                raise ValueError(f"'{key}' has shape {list(value.shape)}; a piece holding every expert has "
                                 f"{list(every)}")
            state[key] = spec.experts_of_rank(value, rank)

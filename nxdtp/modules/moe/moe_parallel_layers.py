"""NxD's expert linear layers: one 3-D weight (experts, input, output) for all of a rank's experts.

The experts are split over the expert-parallel group (a rank holds ``num_experts / ep`` consecutive experts) and each
expert's output (column layer) or input (row layer) dimension over the tensor-parallel group. The weight is laid out
as NxD's, (experts, input, output), so a layer computes ``x @ W[e]`` for every expert e at once.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from ... import mappings
from ...layers import BaseParallelLayer
from ...sharded_init import InitMethod, materialise_shard, reject_unsupported, split_size
from ...spec import ParamSpec
from ...storage import owning
from ...topology import ParallelGroup, expert_parallel_group, group_of

# The expert dimension of the weights: it is split over the expert-parallel group.
EXPERT_DIM = 0


def expert_group(expert_model_parallel_group=None) -> ParallelGroup:
    """The expert-parallel group a layer splits its experts over: the installed topology's unless one is given. The
    token all-to-all runs over the topology's group, so another group is refused."""
    group = expert_parallel_group()
    if expert_model_parallel_group is not None and group_of(expert_model_parallel_group) != group:
        raise ValueError("expert_model_parallel_group: nxdtp's MoE layers use the topology's expert-parallel group "
                         f"(ranks {list(group.ranks)}); pass None or that group, and set its size with "
                         "initialize_model_parallel(expert_model_parallel_size=...)")
    return group


def local_expert_count(where: str, num_experts: int, ep: int) -> int:
    """How many experts each expert-parallel rank holds; an expert count the group size does not divide is refused."""
    if num_experts % ep != 0:
        divisors = [size for size in range(1, num_experts + 1) if num_experts % size == 0]
        raise ValueError(f"{where}: num_experts={num_experts} is not divisible by expert_model_parallel_size={ep}; "
                         f"valid expert-parallel sizes for {num_experts} experts: {divisors}")
    return num_experts // ep


def default_expert_init(weight: torch.Tensor) -> None:
    """NxD's default: each expert's (input, output) matrix drawn as a linear layer's weight."""
    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


class _ExpertFusedLinear(BaseParallelLayer):
    """The weight and its spec; subclasses say which dimension TP splits and how forward ends."""

    tp_dim: int = 2

    def __init__(self, layer: str, num_experts: int, input_size: int, output_size: int, bias: bool, dtype, device,
                 stride: int, init_method: Optional[InitMethod], keep_master_weight: bool,
                 tensor_model_parallel_group, expert_model_parallel_group, is_prefill: bool,
                 expert_distribution: Any) -> None:
        super().__init__(device, tensor_model_parallel_group)
        reject_unsupported(layer, bias=(bias, False), keep_master_weight=(keep_master_weight, False),
                           is_prefill=(is_prefill, True), expert_distribution=(expert_distribution, None))
        tp_group, ep_group = self._group(), expert_group(expert_model_parallel_group)
        self.num_experts, self.input_size, self.output_size, self.stride = num_experts, input_size, output_size, stride
        self._n_local_experts = local_expert_count(layer, num_experts, ep_group.size)
        self.expert_parallel_size = ep_group.size
        full_shape = (num_experts, input_size, output_size)
        split_size(layer, ("input_size", "output_size")[self.tp_dim - 1], full_shape[self.tp_dim], tp_group.size,
                   stride)
        init = init_method or default_expert_init

        def init_each_expert(full: torch.Tensor) -> None:
            for e in range(num_experts):
                init(full[e])

        weight, _ = materialise_shard(full_shape, dtype, device, init_each_expert, dim=self.tp_dim, stride=stride,
                                      keep_master=False, group=tp_group)
        first = ep_group.rank * self._n_local_experts
        self.weight = nn.Parameter(owning(weight.narrow(EXPERT_DIM, first, self._n_local_experts)))
        self.register_param_spec("weight", ParamSpec(full_shape=full_shape, partition_dim=self.tp_dim, stride=stride,
                                                     num_partitions=tp_group.size,
                                                     expert_partitions=ep_group.size))
        self.reattach_spec_attributes()
        self.register_parameter("bias", None)

    def reattach_spec_attributes(self) -> None:
        # NxD's mark (DP-reduce over the expert data-parallel group only), which the spec does not carry: new
        # Parameter objects (a copy, a model materialised from meta) get it again with their spec attributes.
        super().reattach_spec_attributes()
        self.weight.expert_model_parallel = True

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, local_experts={self._n_local_experts}, input_size={self.input_size}, "
                f"output_size={self.output_size}, stride={self.stride}")


class ExpertFusedColumnParallelLinear(_ExpertFusedLinear):
    """Every local expert's ``x @ W[e]`` with W's output dimension split over TP: the output stays split.

    ``input_``: (local experts or 1, ..., input_size), the same on every TP rank. Backward sums the input gradient over
    TP, unless ``input_in_tensor_parallel_region`` (an nxdtp option): then the caller opened the region on a smaller
    tensor upstream, as ``ExpertMLPs`` does on the tokens before they are dispatched to experts.
    """

    tp_dim = 2

    def __init__(self, num_experts: int, input_size: int, output_size: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device=None, stride: int = 1,
                 init_method: Optional[InitMethod] = None, keep_master_weight: bool = False,
                 tensor_model_parallel_group=None, expert_model_parallel_group=None, is_prefill: bool = True,
                 is_fused_gate_up: bool = False, expert_distribution: Any = None,
                 input_in_tensor_parallel_region: bool = False) -> None:
        super().__init__("ExpertFusedColumnParallelLinear", num_experts, input_size, output_size, bias, dtype, device,
                         stride, init_method, keep_master_weight, tensor_model_parallel_group,
                         expert_model_parallel_group, is_prefill, expert_distribution)
        self.is_fused_gate_up = is_fused_gate_up
        self.input_in_tensor_parallel_region = input_in_tensor_parallel_region

    def forward(self, input_: torch.Tensor, expert_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self.input_in_tensor_parallel_region:
            input_ = mappings.copy_to_tensor_model_parallel_region(input_, self._explicit_group)
        return torch.einsum("e...h,ehi->e...i", input_, _selected(self.weight, expert_indices))


class ExpertFusedRowParallelLinear(_ExpertFusedLinear):
    """Every local expert's ``x @ W[e]`` with W's input dimension split over TP: each rank's output is a partial sum.

    ``reduce_output=False`` (how ``Experts`` builds it) returns the partial sums for the caller to reduce once after
    combining the experts; ``True`` all-reduces them over TP here.
    """

    tp_dim = 1

    def __init__(self, num_experts: int, input_size: int, output_size: int, reduce_output: bool = True,
                 bias: bool = False, dtype: torch.dtype = torch.float32, device=None,
                 init_method: Optional[InitMethod] = None, keep_master_weight: bool = False,
                 tensor_model_parallel_group=None, expert_model_parallel_group=None, is_prefill: bool = True,
                 expert_distribution: Any = None) -> None:
        super().__init__("ExpertFusedRowParallelLinear", num_experts, input_size, output_size, bias, dtype, device, 1,
                         init_method, keep_master_weight, tensor_model_parallel_group, expert_model_parallel_group,
                         is_prefill, expert_distribution)
        self.reduce_output = reduce_output

    def forward(self, input_: torch.Tensor, expert_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
        output = torch.einsum("e...i,eih->e...h", input_, _selected(self.weight, expert_indices))
        if self.reduce_output:
            output = mappings.reduce_from_tensor_model_parallel_region(output, self._explicit_group)
        return output


def _selected(weight: torch.Tensor, expert_indices: Optional[torch.Tensor]) -> torch.Tensor:
    return weight if expert_indices is None else weight.index_select(EXPERT_DIM, expert_indices)

"""NxD's ``Experts``: every expert's MLP on the tokens routed to it, experts split over EP and each MLP over TP."""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from ...mappings import enter_expert_parallel_region, exit_expert_parallel_region
from .model_utils import GLUType
from .moe_parallel_layers import ExpertFusedColumnParallelLinear, ExpertFusedRowParallelLinear, expert_group


class Experts(nn.Module):
    """The expert MLPs: gate and up projections fused into one column-parallel weight (``glu=True``) or an up
    projection alone, then the activation and a row-parallel down projection.

    ``forward(hidden_states)``: (E or 1, C, H), the tokens in each expert's C slots (1: the same tokens for every
    expert). With expert parallelism each rank sends the slots of every expert to the rank that holds it (an all-to-all
    over the expert-parallel group), runs its own experts on the slots of the whole group, and sends the results back.
    The output, (E, C, H), is each TP rank's partial sum over its share of the intermediate dimension; the caller
    reduces it over TP once, after combining the experts.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, glu: bool,
                 activation_fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype, device: Any,
                 bias: bool = False, glu_type: Union[GLUType, str, None] = GLUType.GLU,
                 hidden_act_scaling_factor: float = 1.0, hidden_act_bias: float = 0.0,
                 gate_clamp_upper_limit: Optional[float] = None, gate_clamp_lower_limit: Optional[float] = None,
                 up_clamp_upper_limit: Optional[float] = None, up_clamp_lower_limit: Optional[float] = None,
                 input_layer_init_method=None, output_layer_init_method=None, is_prefill: bool = True,
                 tensor_model_parallel_group=None, expert_model_parallel_group=None,
                 expert_distribution: Any = None) -> None:
        super().__init__()
        self._glu = glu
        self._glu_type = GLUType.validate(glu_type) if glu else glu_type
        self._activation_fn = activation_fn
        self.num_experts = num_experts
        self.hidden_act_scaling_factor, self.hidden_act_bias = hidden_act_scaling_factor, hidden_act_bias
        self.gate_clamp = (gate_clamp_lower_limit, gate_clamp_upper_limit)
        self.up_clamp = (up_clamp_lower_limit, up_clamp_upper_limit)
        self.expert_parallel_size = expert_group(expert_model_parallel_group).size
        common = dict(num_experts=num_experts, bias=bias, dtype=dtype, device=device, is_prefill=is_prefill,
                      tensor_model_parallel_group=tensor_model_parallel_group,
                      expert_model_parallel_group=expert_model_parallel_group, expert_distribution=expert_distribution)
        # The tokens enter the TP region once, before they are dispatched (ExpertMLPs): the all-reduce of their
        # gradient then runs on T tokens, not on the E * C slots.
        if glu:
            self.gate_up_proj = ExpertFusedColumnParallelLinear(
                input_size=hidden_size, output_size=2 * intermediate_size, stride=2, is_fused_gate_up=True,
                init_method=input_layer_init_method, input_in_tensor_parallel_region=True, **common)
        else:
            self.up_proj = ExpertFusedColumnParallelLinear(
                input_size=hidden_size, output_size=intermediate_size, init_method=input_layer_init_method,
                input_in_tensor_parallel_region=True, **common)
        self.down_proj = ExpertFusedRowParallelLinear(
            input_size=intermediate_size, output_size=hidden_size, reduce_output=False,
            init_method=output_layer_init_method, **common)

    def forward(self, hidden_states: torch.Tensor, expert_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
        if hidden_states.dim() != 3 or hidden_states.shape[0] not in (1, self.num_experts):
            raise ValueError(f"Experts: hidden_states has shape {tuple(hidden_states.shape)}; expected (experts, "
                             f"capacity, hidden) with {self.num_experts} experts, or 1 to send the same tokens to all")
        if expert_indices is not None and self.expert_parallel_size > 1:
            raise ValueError("Experts: expert_indices (selective expert loading) is not supported with expert "
                             f"parallelism (expert_model_parallel_size={self.expert_parallel_size})")
        if self.expert_parallel_size > 1:
            experts = hidden_states.expand(self.num_experts, -1, -1)
            dispatched = enter_expert_parallel_region(experts, scatter_gather=False)   # (E/ep, ep, C, H)
        else:
            dispatched = hidden_states.unsqueeze(1)                                     # (E or 1, 1, C, H)
        up = self.gate_up_proj if self._glu else self.up_proj
        intermediate = self._activation(up(dispatched, expert_indices=expert_indices))
        projected = self.down_proj(intermediate, expert_indices=expert_indices)
        if self.expert_parallel_size > 1:
            return exit_expert_parallel_region(projected, scatter_gather=False)
        return projected.squeeze(1)

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        if not self._glu:
            return self._activation_fn(x)
        gate, up = torch.chunk(x, chunks=2, dim=-1)
        if self.gate_clamp != (None, None):
            gate = gate.clamp(min=self.gate_clamp[0], max=self.gate_clamp[1])
        if self.up_clamp != (None, None):
            up = up.clamp(min=self.up_clamp[0], max=self.up_clamp[1])
        up = up + self.hidden_act_bias if self.hidden_act_bias else up
        activated = self._activation_fn(self.hidden_act_scaling_factor * gate)
        if self._glu_type == GLUType.SWIGLU:
            activated = gate * activated
        return activated * up

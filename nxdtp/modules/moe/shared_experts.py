"""NxD's ``SharedExperts``: a gated MLP every token goes through, beside the routed experts, split over TP."""
from __future__ import annotations

import torch
from torch import nn

from ...layers import ColumnParallelLinear, RowParallelLinear
from ...sharded_init import reject_unsupported
from .model_utils import activation


class SharedExperts(nn.Module):
    """``num_shared_experts`` gated MLPs of ``intermediate_size`` each, run as one of ``num_shared_experts *
    intermediate_size`` (column-parallel gate and up projections, fused with ``fused_gate_up_projection``, and a
    row-parallel down projection). ``forward(x, seq_len)`` takes the full tokens (the same on every TP rank) and returns
    this rank's partial sum, which ``MoE`` reduces over TP together with the routed experts' output.

    NxD's inference layouts (``sequence_parallel_enabled``: weights replicated on every core; ``transpose_weights``)
    are not provided.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_shared_experts: int, hidden_act: str,
                 dtype: torch.dtype = torch.float32, tensor_model_parallel_group=None,
                 reduce_dtype: torch.dtype = torch.float32, fused_gate_up_projection: bool = False,
                 sequence_parallel_enabled: bool = False, transpose_weights: bool = False) -> None:
        super().__init__()
        reject_unsupported("SharedExperts", sequence_parallel_enabled=(sequence_parallel_enabled, False),
                           transpose_weights=(transpose_weights, False))
        if num_shared_experts < 1:
            raise ValueError(f"num_shared_experts={num_shared_experts} must be >= 1")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_shared_experts, self.act_fn = num_shared_experts, activation(hidden_act)
        self.fused_gate_up_projection, self.sequence_parallel_enabled = fused_gate_up_projection, False
        width = intermediate_size * num_shared_experts
        common = dict(bias=False, dtype=dtype, tensor_model_parallel_group=tensor_model_parallel_group,
                      reduce_dtype=reduce_dtype)
        if fused_gate_up_projection:
            self.gate_up_proj = ColumnParallelLinear(hidden_size, 2 * width, gather_output=False, stride=2, **common)
        else:
            self.gate_proj = ColumnParallelLinear(hidden_size, width, gather_output=False, **common)
            self.up_proj = ColumnParallelLinear(hidden_size, width, gather_output=False, **common)
        self.down_proj = RowParallelLinear(width, hidden_size, input_is_parallel=True, reduce_output=False, **common)

    def forward(self, x: torch.Tensor, seq_len: int = 0) -> torch.Tensor:
        if self.fused_gate_up_projection:
            gate, up = torch.chunk(self.gate_up_proj(x), chunks=2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act_fn(gate) * up)

"""NxD's ``ExpertMLPs``: the tokens through their chosen experts, combined with their affinities.

Every expert has C slots per rank, filled with the tokens routed to it in token order. Dropless routing
(``capacity_factor=None``, or NxD's blockwise setting ``capacity_factor <= 0``) gives every expert all T slots, so no
token is dropped; a capacity factor f gives ``C = min(T, ceil(T * top_k * f / E))`` as NxD does, and a token beyond
its expert's C slots is dropped for that expert (its affinity for it becomes 0, before top-k normalisation). The
slot layout is computed from the routing alone, the same operations on every rank: one XLA graph for all.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ... import comm, mappings
from ...sharded_init import reject_unsupported
from ...topology import expert_parallel_group
from .experts import Experts
from .model_utils import GLUType, activation


@dataclasses.dataclass
class RoutedExpertsMLPOpsConfig:
    """The routed experts' settings, under NxD's attribute name ``ExpertMLPs.routed_experts_mlp_config``."""

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    hidden_act: str
    glu_mlp: bool
    capacity_factor: Optional[float]
    normalize_top_k_affinities: bool
    early_expert_affinity_modulation: bool


def tokens_in_largest_batch(tokens: torch.Tensor) -> int:
    """The most tokens (rows of ``tokens``) any rank of the expert-parallel group routes in this layer: every rank's
    all-to-all must move slots of one shape, so ranks with fewer tokens (a shorter last batch, per-batch padding,
    generation) leave slots empty. One small host all-reduce per layer (``comm.host_max``; on XLA the ranks' counts
    must be equal)."""
    return comm.host_max(tokens.shape[0], expert_parallel_group(), tokens)


def expert_capacity(total_tokens: int, top_k: int, num_experts: int, capacity_factor: Optional[float]) -> int:
    """The slots per expert on a rank with ``total_tokens`` tokens: all of them when dropless."""
    if capacity_factor is None or capacity_factor <= 0:
        return total_tokens
    return min(total_tokens, math.ceil(total_tokens * top_k * capacity_factor / num_experts))


def _check_routing(num_experts: int, top_k: int, hidden_act: str, normalize_top_k_affinities: bool,
                   early_expert_affinity_modulation: bool) -> None:
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
    activation(hidden_act)
    if normalize_top_k_affinities and top_k == 1:
        raise ValueError("normalize_top_k_affinities=True needs top_k > 1 (with one expert per token the normalised "
                         "affinity is always 1)")
    if early_expert_affinity_modulation and top_k > 1:
        raise ValueError(f"early_expert_affinity_modulation=True needs top_k=1, got top_k={top_k}")


class ExpertMLPs(nn.Module):
    """The routed experts of an MoE layer (NxD's signature; the kernel options of NxD's Neuron blockwise and
    token-generation paths are accepted and have no effect on the result).

    ``forward(hidden_states, expert_affinities, expert_index)``: hidden_states (T, H), the same on every TP rank;
    expert_affinities (T, E); expert_index (T, top_k). Returns (T, H): each TP rank's partial sum, which the caller
    (``MoE``) reduces over TP. The token gradient is summed over TP here.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, hidden_act: str,
                 glu_mlp: bool, capacity_factor: Optional[float], sequence_parallel_enabled: bool = False,
                 block_size: Optional[int] = None, normalize_top_k_affinities: bool = False, bias: bool = False,
                 glu_type: Any = GLUType.GLU, hidden_act_scaling_factor: float = 1.0, hidden_act_bias: float = 0.0,
                 gate_clamp_upper_limit: Optional[float] = None, gate_clamp_lower_limit: Optional[float] = None,
                 up_clamp_upper_limit: Optional[float] = None, up_clamp_lower_limit: Optional[float] = None,
                 return_bias: bool = False, init_method=None, output_layer_init_method=None,
                 dtype: torch.dtype = torch.float32, device: Any = None, tensor_model_parallel_group=None,
                 expert_model_parallel_group=None, enable_spmd_rank: bool = False,
                 early_expert_affinity_modulation: bool = False, is_prefill: bool = True,
                 enabled_hybrid_sharding: bool = False, expert_distribution: Any = None, **neuron_kernel_options):
        super().__init__()
        _check_routing(num_experts, top_k, hidden_act, normalize_top_k_affinities, early_expert_affinity_modulation)
        reject_unsupported("ExpertMLPs", bias=(bias, False), return_bias=(return_bias, False),
                           enable_spmd_rank=(enable_spmd_rank, False), is_prefill=(is_prefill, True),
                           enabled_hybrid_sharding=(enabled_hybrid_sharding, False),
                           expert_distribution=(expert_distribution, None))
        _check_kernel_options(neuron_kernel_options)
        if capacity_factor is not None and capacity_factor >= num_experts / top_k:
            capacity_factor = None  # NxD's rule: every expert can hold every token, which is dropless
        self.routed_experts_mlp_config = RoutedExpertsMLPOpsConfig(
            num_experts, top_k, hidden_size, intermediate_size, hidden_act, glu_mlp, capacity_factor,
            normalize_top_k_affinities, early_expert_affinity_modulation)
        self.sequence_parallel_enabled, self.block_size, self.return_bias = sequence_parallel_enabled, block_size, False
        self.tensor_parallel_group = tensor_model_parallel_group
        self.mlp_op = Experts(
            num_experts, hidden_size, intermediate_size, glu_mlp, activation(hidden_act), dtype, device,
            glu_type=glu_type, hidden_act_scaling_factor=hidden_act_scaling_factor, hidden_act_bias=hidden_act_bias,
            gate_clamp_upper_limit=gate_clamp_upper_limit, gate_clamp_lower_limit=gate_clamp_lower_limit,
            up_clamp_upper_limit=up_clamp_upper_limit, up_clamp_lower_limit=up_clamp_lower_limit,
            input_layer_init_method=init_method, output_layer_init_method=output_layer_init_method,
            tensor_model_parallel_group=tensor_model_parallel_group,
            expert_model_parallel_group=expert_model_parallel_group)

    def get_mlp_op(self) -> Experts:
        return self.mlp_op

    def forward(self, hidden_states: torch.Tensor, expert_affinities: torch.Tensor, expert_index: torch.Tensor,
                seq_len: Optional[int] = None, padding_mask: Optional[torch.Tensor] = None,
                expert_affinities_masked_full: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``padding_mask`` (B, S) or (T,), 1 for real tokens: padded tokens take no slot and get no routed output."""
        config = self.routed_experts_mlp_config
        total_tokens = hidden_states.shape[0]
        if expert_affinities.shape != (total_tokens, config.num_experts) or expert_index.shape != (
                total_tokens, config.top_k):
            raise ValueError(f"ExpertMLPs: hidden_states {tuple(hidden_states.shape)}, expert_affinities "
                             f"{tuple(expert_affinities.shape)} and expert_index {tuple(expert_index.shape)} must be "
                             f"(T, H), (T, {config.num_experts}) and (T, {config.top_k})")
        if expert_affinities_masked_full is not None:
            raise ValueError("ExpertMLPs: expert_affinities_masked_full (the input of NxD's Neuron blockwise kernel) "
                             "is not supported by nxdtp; pass None")
        capacity = expert_capacity(tokens_in_largest_batch(hidden_states), config.top_k,
                                   config.num_experts, config.capacity_factor)
        slot_token, affinities = routed_slots(expert_affinities, expert_index, padding_mask, capacity,
                                              config.normalize_top_k_affinities)
        tokens = mappings.copy_to_tensor_model_parallel_region(hidden_states, self.tensor_parallel_group)
        return run_experts_on_slots(tokens, slot_token, affinities, self.mlp_op,
                                    config.early_expert_affinity_modulation)


def routed_slots(expert_affinities: torch.Tensor, expert_index: torch.Tensor, padding_mask: Optional[torch.Tensor],
                 capacity: int, normalize: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the token in each expert's slot, (E, C), T for an empty slot; the affinities (T, E) of the kept choices,
    normalised over them when ``normalize``). Tokens fill an expert's ``capacity`` slots in token order."""
    total_tokens, num_experts = expert_affinities.shape
    device = expert_index.device
    chosen = (expert_index.unsqueeze(-1) == torch.arange(num_experts, device=device)).sum(1)   # (T, E)
    if padding_mask is not None:
        chosen = chosen * padding_mask.reshape(total_tokens, 1).to(chosen.dtype)
    position = torch.cumsum(chosen, dim=0)          # 1-based slot of each token in each expert
    kept = (chosen > 0) & (position <= capacity)
    affinities = expert_affinities.masked_fill(~kept, 0)
    if normalize:
        affinities = F.normalize(affinities, p=1.0, dim=1)
    first_slot = torch.arange(num_experts, device=device) * capacity
    unused = num_experts * capacity
    flat_slot = torch.where(kept, first_slot + position - 1, torch.full_like(position, unused))
    token = torch.arange(total_tokens, device=device).unsqueeze(1).expand(total_tokens, num_experts)
    # Every dropped or unchosen (token, expert) writes to one extra slot, which is then cut off.
    slot_token = torch.full((unused + 1,), total_tokens, dtype=torch.long, device=device)
    slot_token = slot_token.scatter(0, flat_slot.flatten(), token.flatten())[:unused]
    return slot_token.view(num_experts, capacity), affinities


def run_experts_on_slots(tokens: torch.Tensor, slot_token: torch.Tensor, affinities: torch.Tensor,
                         experts: Callable[[torch.Tensor], torch.Tensor], scale_inputs: bool = False) -> torch.Tensor:
    """Each token (T, H) through the experts of its slots, ``experts`` mapping (E, C, H) to (E, C, H), the outputs
    weighted by the token's affinity for each expert and summed per token. ``scale_inputs``: weight the inputs
    instead (NxD's early affinity modulation)."""
    total_tokens, num_experts = affinities.shape
    padded = F.pad(tokens, (0, 0, 0, 1))            # row T: the zero token of an empty slot
    slots = padded[slot_token]                     # (E, C, H)
    expert = torch.arange(num_experts, device=slot_token.device).unsqueeze(1)
    weights = F.pad(affinities, (0, 0, 0, 1))[slot_token, expert].unsqueeze(-1)   # (E, C, 1)
    if scale_inputs:
        slots, weights = slots * weights, (slot_token != total_tokens).to(slots.dtype).unsqueeze(-1)
    outputs = experts(slots) * weights
    combined = torch.zeros_like(padded).index_add(0, slot_token.flatten(), outputs.flatten(0, 1))
    return combined[:total_tokens]


_KERNEL_OPTIONS = {"blockwise_nki_autograd_cls", "use_torch_block_wise", "logical_nc_config",
                   "parallelize_token_to_block_mapping", "optimized_block_to_token_mapping", "use_block_parallel",
                   "always_augment_inputs_for_blockwise_matmul", "block_sharding_strategy", "skip_dma_token",
                   "skip_dma_weight", "tkg_tensor_model_parallel_group", "tkg_expert_model_parallel_group",
                   "cte_tensor_model_parallel_group", "cte_expert_model_parallel_group",
                   "use_shard_on_intermediate_dynamic_while", "use_shard_on_block_dynamic_while",
                   "use_index_calc_kernel"}


def _check_kernel_options(options: dict) -> None:
    unknown = sorted(set(options) - _KERNEL_OPTIONS)
    if unknown:
        raise TypeError(f"ExpertMLPs got unexpected keyword arguments {unknown}")
    groups = sorted(name for name in options if name.endswith("_group") and options[name] is not None)
    if groups:
        raise ValueError(f"ExpertMLPs: {groups} (NxD's separate context-encoding and token-generation groups) are "
                         "not supported by nxdtp; its MoE layers use the topology's tensor- and expert-parallel groups")

"""NxD's ``MoE`` layer: route, run the experts (with shared experts beside them), reduce over TP once."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from ... import mappings
from ...sharded_init import reject_unsupported
from .expert_mlps import ExpertMLPs
from .routing import RouterBase
from .shared_experts import SharedExperts


class MoE(nn.Module):
    """A mixture-of-experts layer, NxD's signature and training semantics.

    Input: (B, S, H), or with ``sequence_parallel_enabled`` this rank's sequence shard (S/tp, B, H) along
    ``sequence_dimension``. The sequence shards are all-gathered over TP; the router scores the tokens (on its shard
    when it runs sequence-parallel); ``ExpertMLPs`` runs each token through its chosen experts, on the ranks that hold
    them (an all-to-all over the expert-parallel group); the TP ranks' partial sums are all-reduced, or
    reduce-scattered back to sequence shards. Every rank routes only its own data-parallel rank's tokens, so the
    result, the router logits and every gradient are the dense layer's on that rank's batch.

    Returns ``(output,)`` followed by the router logits (T, E) with ``return_router_logits`` and the expert index
    (T, top_k) with ``return_expert_index``. NxD's token shuffling and fused token-generation kernel are not provided.
    """

    def __init__(self, router: RouterBase, expert_mlps: ExpertMLPs, shared_experts: Optional[SharedExperts] = None,
                 rmsnorm: Optional[nn.Module] = None, sequence_parallel_enabled: bool = False,
                 sequence_dimension: Optional[int] = None, return_router_logits: bool = False,
                 return_expert_index: bool = False, token_shuffle_group_size: int = 1, token_shuffle_seed=None,
                 tensor_model_parallel_group=None, init_tkg_module: bool = False, tkg_config=None) -> None:
        super().__init__()
        reject_unsupported("MoE", token_shuffle_group_size=(token_shuffle_group_size, 1),
                           token_shuffle_seed=(token_shuffle_seed, None), init_tkg_module=(init_tkg_module, False),
                           tkg_config=(tkg_config, None))
        config = expert_mlps.routed_experts_mlp_config
        for attr in ("num_experts", "top_k", "hidden_size"):
            if getattr(router, attr) != getattr(config, attr):
                raise ValueError(f"MoE: the router has {attr}={getattr(router, attr)} but expert_mlps has "
                                 f"{attr}={getattr(config, attr)}")
        sequence_dimension = 0 if sequence_dimension is None else sequence_dimension
        if router.sequence_parallel_enabled and not sequence_parallel_enabled:
            raise ValueError("MoE: the router runs sequence-parallel, so the layer must too "
                             "(sequence_parallel_enabled=True)")
        if router.sequence_parallel_enabled and router.sequence_dimension != sequence_dimension:
            raise ValueError(f"MoE: sequence_dimension={sequence_dimension} but the router's is "
                             f"{router.sequence_dimension}")
        self.router, self.expert_mlps, self.shared_experts, self.rmsnorm = router, expert_mlps, shared_experts, rmsnorm
        self.sequence_parallel_enabled, self.sequence_dimension = sequence_parallel_enabled, sequence_dimension
        self.return_router_logits, self.return_expert_index = return_router_logits, return_expert_index
        self.tensor_parallel_group = tensor_model_parallel_group

    def forward(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None,
                is_speculative_decoding: bool = False, residual: Optional[torch.Tensor] = None) -> Tuple:
        """``padding_mask`` (B, S), 1 for real tokens (an nxdtp addition to NxD's training path): padded tokens take
        no expert capacity and get no routed output (shared experts still run on them). ``residual``: added to the
        input first, and returned last."""
        if residual is not None:
            hidden_states = residual = hidden_states + residual
        if self.rmsnorm is not None:
            hidden_states = self.rmsnorm(hidden_states)
        full = hidden_states
        if self.sequence_parallel_enabled:
            # Every consumer of the gathered tokens returns the whole gradient on every TP rank (the routed and shared
            # experts sum theirs over TP, the router's is replicated), so backward keeps this rank's slice.
            full = mappings.gather_from_sequence_parallel_region(
                hidden_states, self.sequence_dimension, to_model_parallel=False,
                process_group=self.tensor_parallel_group)
        router_logits, expert_affinities, expert_index = self.router(
            hidden_states if self.router.sequence_parallel_enabled else full)
        # Each TP rank's experts see the affinities through their share of the output: sum those gradients over TP.
        expert_affinities = mappings.copy_to_tensor_model_parallel_region(expert_affinities,
                                                                          self.tensor_parallel_group)
        tokens = full.reshape(-1, full.shape[-1])
        sequence_major = self.sequence_parallel_enabled and self.sequence_dimension == 0
        output = self.expert_mlps(tokens, expert_affinities, expert_index, full.shape[self.sequence_dimension],
                                  padding_mask=_token_order(padding_mask, sequence_major))
        if self.shared_experts is not None:
            output = output + self.shared_experts(tokens, full.shape[self.sequence_dimension])
        output = output.view(full.shape)
        if self.sequence_parallel_enabled:
            output = mappings.reduce_scatter_to_sequence_parallel_region(
                output, self.sequence_dimension, process_group=self.tensor_parallel_group)
        else:
            output = mappings.reduce_from_tensor_model_parallel_region(output, self.tensor_parallel_group)
        result = (output,)
        if self.return_router_logits:
            result += (router_logits,)
        if self.return_expert_index:
            result += (expert_index,)
        if residual is not None:
            result += (residual,)
        return result


def _token_order(padding_mask: Optional[torch.Tensor], sequence_major: bool) -> Optional[torch.Tensor]:
    """The (B, S) padding mask in the order the layer flattens tokens: (S, B) when the input is sequence-major."""
    if padding_mask is None:
        return None
    return (padding_mask.transpose(0, 1) if sequence_major else padding_mask).reshape(-1)

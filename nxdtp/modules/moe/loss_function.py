"""NxD's load-balancing loss (Switch Transformer's auxiliary loss, scaled by num_experts / top_k)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import comm
from ...topology import data_parallel_group


def load_balancing_loss_func(router_logits: torch.Tensor, num_experts: int, top_k: int, *,
                             over_data_parallel_batch: bool = False) -> torch.Tensor:
    """``num_experts / top_k * sum_e f_e * P_e``: f_e the share of (token, choice) pairs routed to expert e, P_e the
    mean router probability of e, over the rows of ``router_logits`` (tokens, every layer's concatenated), as NxD.

    ``over_data_parallel_batch=True`` (an nxdtp option) counts f over the whole data-parallel batch (the counts are
    all-reduced over the DP group; they carry no gradient): the DP ranks' mean of the loss, and the DP average of its
    gradient, are then the dense model's on the global batch, which NxD's per-rank form is not (a product of means is
    not the mean of the products). Every DP rank must call it with the same number of tokens.
    """
    if router_logits.dim() != 2 or router_logits.shape[1] != num_experts:
        raise ValueError(f"router_logits has shape {tuple(router_logits.shape)}; expected (tokens, "
                         f"num_experts={num_experts})")
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
    probabilities = F.softmax(router_logits, dim=-1, dtype=torch.float64)
    _, chosen = torch.topk(probabilities, top_k)
    experts = torch.arange(num_experts, device=chosen.device)
    # (T, top_k, E) one-hot of each choice, averaged over tokens: the share of choice k going to each expert
    tokens_per_expert = (chosen.unsqueeze(-1) == experts).to(torch.float32).mean(dim=0)
    if over_data_parallel_batch:
        group = data_parallel_group()
        tokens_per_expert = comm.all_reduce(tokens_per_expert, group) / group.size
    router_prob_per_expert = probabilities.to(torch.float32).mean(dim=0)
    return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * (num_experts / top_k)

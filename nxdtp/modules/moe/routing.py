"""NxD's routers: a replicated linear layer scores every token for every expert; top-k (or Sinkhorn-balanced top-1)
picks the experts."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ... import mappings
from ...sharded_init import reject_unsupported


class RouterBase(nn.Module):
    """The router's linear layer and NxD's conventions: ``forward(hidden_states)`` returns (router_logits (T, E),
    expert_affinities (T, E) in the hidden states' dtype, expert_index (T, top_k)), T every token of the full
    sequence.

    With ``sequence_parallel_enabled`` the input is this rank's sequence shard: the logits are computed on it and
    all-gathered over the tensor-parallel group (less work than scoring the gathered sequence), and the weight is
    marked ``sequence_parallel_enabled`` so that ``allreduce_sequence_parallel_gradients`` sums its gradient over TP,
    as for NxD. Affinities are computed in float64, as NxD does, then cast.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, act_fn: str, sequence_parallel_enabled: bool,
                 sequence_dimension: Optional[int], dtype: torch.dtype, device: Any, bias: bool = False,
                 tensor_model_parallel_group=None, jitter_eps: float = 0.0, store_transposed_weights: bool = False,
                 apply_act_fn_over_topk: bool = False) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        if act_fn not in ("sigmoid", "softmax"):
            raise ValueError(f"act_fn={act_fn!r} is not supported; valid: 'sigmoid', 'softmax'")
        reject_unsupported(type(self).__name__, store_transposed_weights=(store_transposed_weights, False))
        self.num_experts, self.top_k, self.hidden_size, self.act_fn = num_experts, top_k, hidden_size, act_fn
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.sequence_dimension = 0 if sequence_dimension is None else sequence_dimension
        self.jitter_eps, self.apply_act_fn_over_topk = jitter_eps, apply_act_fn_over_topk
        self.tensor_parallel_group = tensor_model_parallel_group
        self.linear_router = nn.Linear(hidden_size, num_experts, bias=bias, dtype=dtype, device=device)
        for param in self.linear_router.parameters():
            param.sequence_parallel_enabled = sequence_parallel_enabled

    def get_router_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(T, E) logits of the full sequence, whether the input is the full sequence or this rank's shard."""
        hidden_states = hidden_states.to(self.linear_router.weight.dtype)
        if self.jitter_eps and self.training:
            noise = torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_eps, 1.0 + self.jitter_eps)
            hidden_states = hidden_states * noise
        logits = self.linear_router(hidden_states)
        if self.sequence_parallel_enabled:
            # The logits' consumers are replicated over TP, so their gradient agrees on every rank: keep the slice.
            logits = mappings.gather_from_sequence_parallel_region(
                logits, self.sequence_dimension, to_model_parallel=False, process_group=self.tensor_parallel_group)
        return logits.reshape(-1, self.num_experts)

    def apply_activation_fn(self, logits: torch.Tensor) -> torch.Tensor:
        if self.act_fn == "sigmoid":
            return torch.sigmoid(logits.to(torch.float64))
        return F.softmax(logits, dim=1, dtype=torch.float64)

    def forward(self, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} is a base class: use RouterTopK or RouterSinkhorn")


class RouterTopK(RouterBase):
    """Each token's ``top_k`` experts by logit. ``apply_act_fn_over_topk=True`` applies the activation to the chosen
    logits only (the others' affinity is 0). Pair it with ``load_balancing_loss_func`` when training."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, sequence_parallel_enabled: bool = False,
                 sequence_dimension: Optional[int] = None, dtype: torch.dtype = torch.float32, device: Any = None,
                 bias: bool = False, tensor_model_parallel_group=None, act_fn: str = "softmax",
                 apply_act_fn_over_topk: bool = False, jitter_eps: float = 0.0,
                 store_transposed_weights: bool = False) -> None:
        super().__init__(num_experts, top_k, hidden_size, act_fn, sequence_parallel_enabled, sequence_dimension,
                         dtype, device, bias=bias, tensor_model_parallel_group=tensor_model_parallel_group,
                         jitter_eps=jitter_eps, store_transposed_weights=store_transposed_weights,
                         apply_act_fn_over_topk=apply_act_fn_over_topk)

    def forward(self, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.get_router_logits(hidden_states)
        if self.apply_act_fn_over_topk:
            top_logits, expert_index = torch.topk(logits.to(torch.float64), self.top_k, dim=1)
            affinities = torch.zeros_like(logits, dtype=torch.float64).scatter(
                1, expert_index, self.apply_activation_fn(top_logits))
        else:
            affinities = self.apply_activation_fn(logits)
            _, expert_index = torch.topk(logits, self.top_k, dim=1)
        return logits, affinities.to(hidden_states.dtype), expert_index.detach().to(torch.long)


class RouterSinkhorn(RouterBase):
    """Top-1 routing; in training the choice is made on Sinkhorn-balanced scores (a fixed number of iterations, so the
    graph is static), in evaluation on the logits. The affinities are the activation of the unbalanced logits."""

    DEFAULT_SINKHORN_ITERS = 30

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, act_fn: str = "sigmoid",
                 sequence_parallel_enabled: bool = False, sequence_dimension: Optional[int] = None,
                 dtype: torch.dtype = torch.float32, device: Any = None, sinkhorn_iterations: Optional[int] = None,
                 sinkhorn_tol: Optional[float] = None) -> None:
        if top_k != 1:
            raise ValueError(f"RouterSinkhorn routes each token to one expert: top_k={top_k} is not supported, use 1 "
                             "(or RouterTopK)")
        super().__init__(num_experts, top_k, hidden_size, act_fn, sequence_parallel_enabled, sequence_dimension,
                         dtype, device)
        self.sinkhorn_iterations = self.DEFAULT_SINKHORN_ITERS if sinkhorn_iterations is None else sinkhorn_iterations
        self.sinkhorn_tol = sinkhorn_tol

    def forward(self, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.get_router_logits(hidden_states)
        affinities = self.apply_activation_fn(logits).to(hidden_states.dtype)
        with torch.no_grad():
            scores = logits.detach()
            if self.training:
                scores = sinkhorn(scores.to(torch.float32), self.sinkhorn_iterations, self.sinkhorn_tol)
            expert_index = torch.argmax(scores, dim=1, keepdim=True)
        return logits, affinities, expert_index.to(torch.long)


def sinkhorn(cost: torch.Tensor, num_iters: int, tol: Optional[float] = None) -> torch.Tensor:
    """``num_iters`` rounds of Sinkhorn scaling of exp(cost) towards equal row and column sums (tokens and experts);
    with ``tol`` the last round's change in the column scales must be below it."""
    if num_iters == 0:
        return cost
    cost = torch.exp(cost)
    eps = 1e-8
    rows = torch.ones(cost.shape[0], dtype=cost.dtype, device=cost.device)
    cols = torch.ones(cost.shape[1], dtype=cost.dtype, device=cost.device)
    change = None
    for _ in range(num_iters):
        rows = 1.0 / (rows.shape[0] * (torch.sum(cols * cost, 1) + eps))
        new_cols = 1.0 / (cols.shape[0] * (torch.sum(rows.unsqueeze(1) * cost, 0) + eps))
        change, cols = torch.mean(torch.abs(new_cols - cols)), new_cols
    if tol is not None and float(change) >= tol:
        raise RuntimeError(f"Sinkhorn did not converge: the last change {float(change):.3g} is not below "
                           f"sinkhorn_tol={tol} after {num_iters} iterations (raise sinkhorn_iterations)")
    return cols * cost * rows.unsqueeze(1)

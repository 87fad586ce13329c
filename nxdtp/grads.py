"""Gradient norm and clipping over tensor-parallel shards, and the data- and sequence-parallel gradient all-reduces.

Scale rules (docs/index.md, "Gradient scale is exact"):

* ``get_grad_norm`` / ``clip_grad_norm`` give the norm of the *dense* model's gradient. A TP-sharded parameter holds a
  different slice on every TP rank, so every rank counts its slice; a replicated parameter holds the same gradient on
  every TP rank, so it is counted once. One all-reduce over the TP group combines them.
* ``bucket_allreduce_gradients`` averages over the data-parallel group only: sum over the DP ranks, divide by the DP
  size. Never by the world size, and never over TP ranks (their gradients are different shards, or already equal).
* ``allreduce_sequence_parallel_gradients`` sums, over the TP group, the gradients of replicated parameters used inside
  a sequence-parallel region (each TP rank saw only its part of the sequence), except those a plan's model already sums
  inside backward (``nxdtp.plan.sum_sequence_parallel_gradients_in_backward``).

Everything is written to trace one graph on every rank under XLA: no branch depends on tensor values or on the rank;
per-rank differences enter as data (a weight tensor), not as graph structure.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch import nn

from . import comm
from .topology import (
    ParallelGroup,
    data_parallel_group,
    expert_data_parallel_group,
    expert_parallel_group,
    get_topology,
    rank_tensor,
    tensor_parallel_group,
    zero1_groups,
)

# Same epsilon as torch.nn.utils.clip_grad_norm_, so clipping equals the dense reference. The one epsilon of every
# gradient clip in nxdtp (clip_grad_norm, clip_grads_with_norm, Lamb's max_grad_norm), through clip_coefficient.
CLIP_EPS = 1e-6
# Default size of one flattened gradient bucket (as in NxD).
DEFAULT_BUCKET_CAP_MB = 512

ParamsArg = Union[torch.Tensor, Iterable[Any]]


# ---- collecting parameters -------------------------------------------------------------------------------------------

def _unique_params(parameters: ParamsArg) -> List[torch.Tensor]:
    """Flatten a tensor, an iterable of tensors, a module, or optimizer-style param-group dicts; drop repeats by
    identity.

    A tied weight listed twice (an embedding and an LM head) is one parameter with one gradient: it counts once.
    """
    if isinstance(parameters, torch.Tensor):
        items: Iterable[Any] = [parameters]
    elif isinstance(parameters, nn.Module):
        items = parameters.parameters()
    elif isinstance(parameters, dict):
        items = [parameters]
    else:
        items = parameters
    out: List[torch.Tensor] = []
    seen = set()

    def add(p: Any) -> None:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"expected parameters (tensors), got an item of type {type(p).__name__}")
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)

    for item in items:
        if isinstance(item, dict):
            if "params" not in item:
                raise TypeError(f"a parameter-group dict needs a 'params' entry; got keys {sorted(item)}")
            group_params = item["params"]
            for p in ([group_params] if isinstance(group_params, torch.Tensor) else group_params):
                add(p)
        else:
            add(item)
    return out


def _is_tp_sharded(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def _counted_pieces(param: torch.Tensor, p: float) -> List[Tuple[torch.Tensor, float]]:
    """A TP-sharded parameter's gradient as (piece, copies) pairs, copies being how many times the TP group holds each
    piece (KV heads repeated across ranks), so that each counts once in the p-norm. One piece with ``num_replicas``; or,
    for a fused parameter whose rows hold different numbers of copies (``replica_segments``, (rows, copies) along dim
    0: GQAQKVColumnParallelLinear's Q|K|V), one per segment. A ZeRO-1 shard of such a parameter carries
    ``replica_weights`` instead, 1 / copies per element: they scale its elements' |g|^p, folded in as
    ``g * weights ** (1 / p)`` (the max norm needs none: a copy does not change a max)."""
    grad = param.grad.detach()
    weights = getattr(param, "replica_weights", None)
    if weights is not None:
        return [(grad if math.isinf(p) else grad * weights.pow(1.0 / p), 1.0)]
    segments = getattr(param, "replica_segments", None)
    if segments is None:
        return [(grad, float(getattr(param, "num_replicas", 1)))]
    pieces = grad.split([rows for rows, _ in segments])
    return [(piece, float(count)) for piece, (_, count) in zip(pieces, segments)]


def zero1_sharding_group(sharding_groups: Any = None) -> ParallelGroup:
    """The ParallelGroup of NxD's ZeRO-1 ``sharding_groups`` / ``zero1_optimizer_groups`` argument.

    None means the data-parallel group (NxD's data x context group, with context parallelism of size 1), and so do
    ``get_data_parallel_group(as_list=True)`` and ``get_zero1_sharding_groups()``. Any other DP-aligned sharding (lists
    of global ranks that cut every DP group into groups of one size, ``parallel_state.dp_aligned_rank_lists``) gives
    its own group, made collectively the first time (``parallel_state.zero1_groups``); anything else is refused,
    naming the groups and what would be valid.
    """
    return zero1_groups(sharding_groups)[0]


def _check_nxd_defaults(zero1_optimizer: bool, zero1_optimizer_groups: Any) -> Any:
    """None without ZeRO-1; with it, the sharding group the norm is also summed over."""
    if not zero1_optimizer:
        if zero1_optimizer_groups is not None:
            raise ValueError(f"zero1_optimizer_groups={zero1_optimizer_groups!r} is given but zero1_optimizer=False; "
                             "pass zero1_optimizer=True with the groups, or no groups")
        return None
    return zero1_sharding_group(zero1_optimizer_groups)


def checked_norm_type(norm_type: Union[float, int, str]) -> float:
    """``norm_type`` as the float p of a p-norm (``float('inf')`` included); ValueError naming it unless p > 0."""
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        raise ValueError(f"norm_type={norm_type!r} is not a number; use a float p > 0 or float('inf')") from None
    if math.isnan(p) or p <= 0:
        raise ValueError(f"norm_type={norm_type!r} is not supported: the gradient norm needs p > 0 (or inf)")
    return p


# ---- norm and clipping -----------------------------------------------------------------------------------------------

def get_grad_norm(parameters: ParamsArg, norm_type: Union[float, int, str] = 2, zero1_optimizer: bool = False,
                  zero1_optimizer_groups: Any = None, force_spmd: bool = True) -> torch.Tensor:
    """The p-norm of the gradients of ``parameters`` as the dense (unsharded) model would compute it.

    ``parameters``: a tensor, an iterable of tensors, a module, or optimizer param groups. Parameters without a gradient
    are skipped; one listed twice counts once. Computed in fp32 whatever the gradient dtype. Returns a 0-dim fp32 tensor
    on the gradients' device, equal on every rank of the TP group.

    Every rank of the TP group must call this (it all-reduces over the group), with the same parameter structure.
    ``force_spmd`` is accepted for NxD compatibility: nxdtp always uses the SPMD form (the same graph on every rank).
    Parameters marked ``shared`` (NxD's attribute for a parameter another pipeline stage also holds) are skipped, as
    NxD skips them.

    ``zero1_optimizer=True`` (NxD's ZeRO-1 form): ``parameters`` are this rank's ZeRO-1 shards (their ``.grad`` the
    shards of the averaged gradients), which carry their full parameter's TP attributes. The TP rule applies to each
    shard as to its parameter, and the result is also summed (max for inf) over the sharding group
    ``zero1_optimizer_groups`` (None: the data-parallel group; see ``zero1_sharding_group``): the dense model's norm
    over TP x DP. With a sharding group smaller than the DP group (hybrid sharding) the shards of one sharding group
    make the whole parameter once, and every replica of them computes the same norm: the norm is never summed over
    the replicas. Every rank of the world must then call it.
    """
    extra_group = _check_nxd_defaults(zero1_optimizer, zero1_optimizer_groups)
    p = checked_norm_type(norm_type)
    params = _unique_params(parameters)
    experts = [param for param in params if getattr(param, "expert_model_parallel", False)]
    ep_group = expert_parallel_group()
    # ZeRO-1 shards expert parameters over the expert data-parallel group: summed over the DP group (expert DP x EP),
    # every shard of every expert counts once, so their share needs no sum over EP of its own.
    if ep_group.size == 1 or not experts or zero1_optimizer:
        return _dense_norm(params, p, [], None, extra_group)
    others = [param for param in params if not getattr(param, "expert_model_parallel", False)]
    return _dense_norm(others, p, experts, ep_group, extra_group)


def _dense_norm(params: List[torch.Tensor], p: float, experts: List[torch.Tensor],
                ep_group: Optional[ParallelGroup], extra_group: Optional[ParallelGroup]) -> torch.Tensor:
    """The norm of get_grad_norm. ``experts``: parameters whose gradients differ over the expert-parallel group
    ``ep_group`` (each rank holds other experts), so their share is summed (max for inf) over it first."""
    grads_sharded, copies, grads_replicated = _gradients_by_kind(params, p)
    expert_kinds = _gradients_by_kind(experts, p)
    all_grads = grads_sharded + grads_replicated + expert_kinds[0] + expert_kinds[2]
    device = all_grads[0].device if all_grads else torch.device("cpu")
    group = tensor_parallel_group()
    if math.isinf(p):
        local = _per_tensor_norms(grads_sharded + grads_replicated, p, device).max()
        if ep_group is not None:
            expert_max = _max_norm(_per_tensor_norms(expert_kinds[0] + expert_kinds[2], p, device).max(), ep_group,
                                   None)
            local = torch.maximum(local, expert_max)
        return _max_norm(local, group, extra_group)
    total = _tp_share(grads_sharded, copies, grads_replicated, p, group, device)
    if ep_group is not None:
        total = total + comm.all_reduce(_tp_share(*expert_kinds, p, group, device), ep_group, op="sum")
    total = comm.all_reduce(total, group, op="sum")
    if extra_group is not None:
        total = comm.all_reduce(total, extra_group, op="sum")
    return total.pow(1.0 / p)


def _by_device_and_dtype(tensors: List[torch.Tensor]) -> Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]]:
    groups: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def _per_tensor_norms(grads: List[torch.Tensor], p: float, device) -> torch.Tensor:
    """The fp32 p-norm of each gradient, on ``device`` (in an order of their own). Off XLA, one foreach call per device
    and dtype, as torch.nn.utils.clip_grad_norm_ does: on a GPU a kernel per tensor would leave the step waiting on
    launches. XLA traces the norms into its graph either way, so there each is an op of its own."""
    if not grads:
        return torch.zeros(1, dtype=torch.float32, device=device)
    if comm.is_xla(device):
        return torch.stack([torch.linalg.vector_norm(g, p, dtype=torch.float32).to(device) for g in grads])
    return torch.stack([n.to(device) for group in _by_device_and_dtype(grads).values()
                        for n in torch._foreach_norm(group, p, dtype=torch.float32)])


def _tp_share(grads_sharded: List[torch.Tensor], copies: List[float], grads_replicated: List[torch.Tensor], p: float,
              group: ParallelGroup, device) -> torch.Tensor:
    """This rank's share of the sum of |g|^p over the TP group: shards count on every rank, replicas only on TP rank
    0. Which rank this is comes from the rank as data (rank_tensor), not a Python branch or constant, so every rank
    traces the same graph."""
    zero = torch.zeros((), dtype=torch.float32, device=device)
    counts_replicas = (rank_tensor(group, device) == 0).reshape(())
    by_copies: Dict[float, List[torch.Tensor]] = {}
    for grad, count in zip(grads_sharded, copies):
        by_copies.setdefault(count, []).append(grad)
    # Divided by Python numbers: a tensor of the counts would be a copy to the device, and a wait for it, every step.
    sharded = sum((_per_tensor_norms(grads, p, device).pow(p).sum() / count for count, grads in by_copies.items()),
                  zero)
    replicated = _per_tensor_norms(grads_replicated, p, device).pow(p).sum()
    # Selected, not multiplied by the weight: inf * 0 would be NaN. A non-finite replicated sum counts on every rank,
    # so that an inf or NaN in any rank's copy makes the norm non-finite everywhere (inf + inf = inf; NaN wins).
    replicated = torch.where(counts_replicas | ~torch.isfinite(replicated), replicated, zero)
    return sharded + replicated


def _gradients_by_kind(parameters: ParamsArg, p: float
                       ) -> Tuple[List[torch.Tensor], List[float], List[torch.Tensor]]:
    """(the TP-sharded gradient pieces, how many copies of each the full tensor holds, the replicated gradients) of
    ``parameters`` that have a gradient and are not ``shared``, each parameter once."""
    grads_sharded: List[torch.Tensor] = []
    grads_replicated: List[torch.Tensor] = []
    # A shard of a tensor whose blocks the full tensor holds several times (replicated KV heads) counts once per copy.
    copies: List[float] = []
    for param in _unique_params(parameters):
        if param.grad is not None and param_is_not_shared(param):
            if _is_tp_sharded(param):
                for piece, count in _counted_pieces(param, p):
                    grads_sharded.append(piece)
                    copies.append(count)
            else:
                grads_replicated.append(param.grad.detach())
    return grads_sharded, copies, grads_replicated


def _max_norm(local: torch.Tensor, group: ParallelGroup, extra_group: Optional[ParallelGroup]) -> torch.Tensor:
    """The inf-norm over ``group`` (then ``extra_group``) from this rank's largest gradient norm ``local``."""
    # max is idempotent: replicated gradients may appear on every rank, the TP-wide max is unchanged. A NaN must win as
    # it does in torch, but a MAX all-reduce need not propagate it (gloo's drops it): the NaN travels as a flag in the
    # same all-reduce, [max of the non-NaN norms, 1 if any NaN], and is put back after.
    is_nan = torch.isnan(local)
    flagged = torch.stack([torch.where(is_nan, torch.zeros_like(local), local), is_nan.to(torch.float32)])
    reduced = comm.all_reduce(flagged, group, op="max")
    if extra_group is not None:
        reduced = comm.all_reduce(reduced, extra_group, op="max")
    return torch.where(reduced[1] > 0, torch.full_like(reduced[0], math.nan), reduced[0])


def clip_grad_norm(parameters: ParamsArg, max_norm: float, norm_type: Union[float, int, str] = 2,
                   zero1_optimizer: bool = False, zero1_optimizer_groups: Any = None,
                   force_spmd: bool = True) -> torch.Tensor:
    """Scale the gradients in place so that their dense-model norm is at most ``max_norm``; return the pre-clip norm.

    The scale is ``min(1, max_norm / (norm + 1e-6))`` as in ``torch.nn.utils.clip_grad_norm_``, always applied as a
    multiply (no branch on the norm's value, so XLA traces one graph).
    """
    max_norm = float(max_norm)
    if not max_norm > 0:
        raise ValueError(f"max_norm={max_norm!r} must be > 0")
    params = _unique_params(parameters)
    total_norm = get_grad_norm(params, norm_type, zero1_optimizer=zero1_optimizer,
                               zero1_optimizer_groups=zero1_optimizer_groups, force_spmd=force_spmd)
    _scale_gradients(params, total_norm, max_norm)
    return total_norm


def clip_grads_with_norm(parameters: ParamsArg, total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale the gradients in place by ``min(1, max_norm / (total_norm + 1e-6))`` for a norm computed already (NxD's
    name; ``clip_grad_norm`` is ``get_grad_norm`` and then this). Returns ``total_norm``."""
    if not float(max_norm) > 0:
        raise ValueError(f"max_norm={max_norm!r} must be > 0")
    params = _unique_params(parameters)
    if not params:
        raise ValueError("clip_grads_with_norm needs at least one parameter")
    norm = torch.as_tensor(total_norm, dtype=torch.float32)
    if norm.numel() != 1:
        raise ValueError(f"total_norm of shape {tuple(norm.shape)} must hold one number (a 0-dim or 1-element tensor)")
    _scale_gradients(params, norm.reshape(()), float(max_norm))
    return total_norm


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (total_norm + CLIP_EPS))``, torch.nn.utils.clip_grad_norm_'s coefficient, as a tensor.

    Every gradient clip in nxdtp uses it. A non-finite norm gives what torch gives: 0 for an inf norm (so finite
    gradients become 0 and an inf element becomes NaN), NaN for a NaN norm. Always a tensor op (no branch on the
    norm's value), so XLA traces one graph.
    """
    return torch.clamp(max_norm / (total_norm + CLIP_EPS), max=1.0)


def _scale_gradients(params: List[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    coefficient = clip_coefficient(total_norm, max_norm)
    grads = [param.grad.detach() for param in params if param.grad is not None]
    for (device, _), group in _by_device_and_dtype(grads).items():
        if comm.is_xla(device):
            for grad in group:
                grad.mul_(coefficient.to(device))
        else:
            # The fp32 coefficient, not one rounded to a bf16 gradient's dtype: the multiply of a low-precision
            # gradient by it happens in fp32 (what Lamb's own clip and torch's give, bit for bit), at the cost of CUDA
            # not fusing the multiplies of such gradients.
            torch._foreach_mul_(group, coefficient.to(device))


def param_is_not_shared(param: torch.Tensor) -> bool:
    """NxD's filter: False for a parameter marked ``shared`` (for example an embedding shared across pipeline
    stages), True otherwise."""
    return not getattr(param, "shared", False)


# ---- bucketed all-reduce ---------------------------------------------------------------------------------------------

def buckets_by(items: List[Any], nbytes: Callable[[Any], int], key: Callable[[Any], Any],
               cap_bytes: float) -> List[List[Any]]:
    """Consecutive items of one ``key`` (dtype and device, say) in buckets of at most ``cap_bytes`` (a larger item is
    a bucket by itself), in order: the bucketing of every coalesced collective (this all-reduce, ZeRO-1's
    reduce-scatter and all-gather)."""
    by_key: Dict[Any, List[List[Any]]] = {}
    sizes: Dict[Any, int] = {}
    for item in items:
        k, n = key(item), nbytes(item)
        buckets = by_key.setdefault(k, [[]])
        if buckets[-1] and sizes[k] + n > cap_bytes:
            buckets.append([])
            sizes[k] = 0
        buckets[-1].append(item)
        sizes[k] = sizes.get(k, 0) + n
    return [bucket for buckets in by_key.values() for bucket in buckets if bucket]


def _buckets(grads: List[torch.Tensor], cap_bytes: int) -> List[List[torch.Tensor]]:
    """Gradients of one dtype and device, in order, in buckets of at most ``cap_bytes``."""
    return buckets_by(grads, lambda g: g.numel() * g.element_size(), lambda g: (g.dtype, g.device), cap_bytes)


def _bucketed_all_reduce(grads: List[torch.Tensor], group: ParallelGroup, divisor: int, bucket_cap_mb: float) -> None:
    """Sum ``grads`` over ``group`` (one collective per bucket), divide by ``divisor``, and write back in place."""
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} must be > 0")
    if group.size == 1 and divisor == 1:
        return
    unique: List[torch.Tensor] = []
    seen = set()
    for g in grads:
        if g is not None and id(g) not in seen:
            seen.add(id(g))
            unique.append(g)
    for bucket in _buckets(unique, int(bucket_cap_mb * 1024 * 1024)):
        flat = torch.cat([g.detach().reshape(-1) for g in bucket])
        reduced = comm.all_reduce(flat, group, op="sum")
        if divisor != 1:
            reduced = reduced / divisor
        offset = 0
        for g in bucket:
            n = g.numel()
            g.detach().copy_(reduced[offset:offset + n].view_as(g))
            offset += n


def bucket_allreduce_gradients(grads_list: Iterable[torch.Tensor], reduce_over_ep_group: bool = False,
                               bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> None:
    """Average gradients over the data-parallel group, in place: sum over the DP ranks, divide by the DP size.

    Never divides by the world size or reduces over TP ranks (docs/index.md, "Gradient scale is exact"). Gradients of
    one dtype are flattened into buckets of at most ``bucket_cap_mb`` MiB, one all-reduce per bucket. ``None`` entries
    and repeats are skipped. Every rank of a group must pass gradients of the same shapes in the same order. No-op
    when the DP size is 1.

    With expert parallelism (NxD's two passes): the first pass sums over the expert data-parallel group and divides
    by the whole DP size, which is the average for an expert's gradient (its tokens came from its whole EP group);
    ``reduce_over_ep_group=True`` then sums the non-expert gradients over the expert-parallel group, without division,
    which completes their DP average. Without expert parallelism the first pass is the DP average and the second has
    nothing to reduce.
    """
    if not isinstance(reduce_over_ep_group, bool):
        raise TypeError(f"reduce_over_ep_group={reduce_over_ep_group!r} must be True or False (it is NxD's second "
                        "parameter; pass bucket_cap_mb= by keyword)")
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} must be > 0")
    if reduce_over_ep_group:
        _bucketed_all_reduce(list(grads_list), expert_parallel_group(), 1, bucket_cap_mb)
        return
    _bucketed_all_reduce(list(grads_list), expert_data_parallel_group(), data_parallel_group().size, bucket_cap_mb)


def allreduce_sequence_parallel_gradients(optimizer: Any,
                                          bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> None:
    """Sum over the TP group, in place, the gradients of parameters marked ``sequence_parallel_enabled``.

    Those are replicated parameters (LayerNorm weights, biases) applied to sequence-parallel activations: each TP rank's
    gradient covers only its part of the sequence. Takes an optimizer (its ``param_groups``), a module, or parameters.
    A parameter without ``.grad`` has its ``main_grad`` (fp32 accumulation, ZeRO-1's ``use_grad_acc_hook``) summed,
    as in NxD. Call it after backward and before the DP all-reduce, clipping and the optimizer step. No-op at TP
    size 1.

    Models sharded by a plan (``nxdtp.models.parallelize_model``, ``nxdtp.parallelize``) sum these gradients inside
    backward already; their parameters are marked ``grad_allreduced_in_backward`` and skipped here, so the call NxD
    training scripts make is harmless on them. It is needed for sequence-parallel layers a model builds itself.
    """
    source = optimizer.param_groups if hasattr(optimizer, "param_groups") else optimizer
    grads = [p.grad if p.grad is not None else p.main_grad for p in _unique_params(source)
             if getattr(p, "sequence_parallel_enabled", False) and not getattr(p, "grad_allreduced_in_backward", False)
             and (p.grad is not None or getattr(p, "main_grad", None) is not None)]
    _bucketed_all_reduce(grads, tensor_parallel_group(), 1, bucket_cap_mb)


def allreduce_context_parallel_gradients(optimizer: Any) -> None:
    """NxD's all-reduce of every gradient over the context-parallel group (averaged), after backward.

    nxdtp has no context parallelism: its context-parallel size is 1, and, as in NxD at size 1, there is nothing to
    reduce and the gradients are left as they are. Needs an installed topology, as NxD does.
    """
    get_topology()  # raises before initialize_model_parallel, as NxD's does


def allreduce_gradients(model_or_params: ParamsArg, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> None:
    """Average over the DP group the gradients of every parameter of a module (or parameter list) that has one.

    With expert parallelism, NxD's two passes of ``bucket_allreduce_gradients``: expert gradients (parameters marked
    ``expert_model_parallel``) are averaged over the expert data-parallel group only, the others over the whole DP
    group. Every rank of a DP group must have gradients for the same parameters (the same model and the same used
    layers).
    """
    params = [p for p in _unique_params(model_or_params) if p.grad is not None]
    bucket_allreduce_gradients([p.grad for p in params], bucket_cap_mb=bucket_cap_mb)
    if expert_parallel_group().size > 1:
        others = [p.grad for p in params if not getattr(p, "expert_model_parallel", False)]
        bucket_allreduce_gradients(others, reduce_over_ep_group=True, bucket_cap_mb=bucket_cap_mb)


__all__ = [
    "get_grad_norm", "clip_grad_norm", "clip_grads_with_norm", "param_is_not_shared", "bucket_allreduce_gradients",
    "allreduce_sequence_parallel_gradients", "allreduce_context_parallel_gradients",
    "allreduce_gradients", "DEFAULT_BUCKET_CAP_MB", "CLIP_EPS", "clip_coefficient", "zero1_sharding_group",
]

"""Autograd regions at the borders of tensor-parallel computation.

Each region is a pair of collectives, one in forward and its mirror in backward:

    copy_to_tensor_model_parallel_region         identity          | all-reduce
    reduce_from_tensor_model_parallel_region     all-reduce        | identity
    scatter_to_tensor_model_parallel_region      split last dim    | all-gather last dim
    gather_from_tensor_model_parallel_region     all-gather last   | split last dim
    scatter_to_sequence_parallel_region          split seq dim     | all-gather seq dim
    gather_from_sequence_parallel_region         all-gather seq    | reduce-scatter seq (to_model_parallel=True)
                                                                     or split
    reduce_scatter_to_sequence_parallel_region   reduce-scatter    | all-gather seq

All collectives go through nxdtp.comm over the tensor-parallel group, so the same code serves XLA, NCCL and gloo.
Sequence-parallel tensors are sequence-first by default ([seq, batch, hidden], as in Megatron and NxD); pass
``sequence_dimension=1`` for batch-first tensors. Positional arguments follow NxD's order.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, Optional

import torch

from . import comm
from .topology import ParallelGroup, expert_parallel_group, group_of, rank_tensor, tensor_parallel_group


def _group(process_group) -> ParallelGroup:
    return group_of(process_group)


_TILE_CC_NOTED = set()


def note_tile_cc(where: str, tile_cc: bool) -> None:
    """NxD's ``tile_cc=True`` asks the Neuron compiler to split a collective into tiles; the result is the same, so
    nxdtp accepts it and says once per call site that collectives run whole."""
    if tile_cc and where not in _TILE_CC_NOTED:
        _TILE_CC_NOTED.add(where)
        warnings.warn(f"{where}: tile_cc=True is accepted but has no effect in nxdtp: collectives are issued whole "
                      "(the result is the same; tiling is a Neuron scheduling choice)", stacklevel=3)


def _in_dtype(collective, tensor: torch.Tensor, reduce_dtype):
    """Run a summing collective in ``reduce_dtype`` or the input's dtype, whichever is wider (bf16 partial sums are
    added in fp32; fp64 ones stay fp64), and return the input's dtype."""
    wider = tensor.dtype if reduce_dtype is None else torch.promote_types(tensor.dtype, reduce_dtype)
    if wider == tensor.dtype:
        return collective(tensor)
    return collective(tensor.to(wider)).to(tensor.dtype)


def split_along_dim(tensor: torch.Tensor, group: ParallelGroup, dim: int) -> torch.Tensor:
    """This rank's 1/size slice of ``tensor`` along ``dim`` (contiguous, so collectives and views downstream are safe).

    The slice is picked by the rank as data (``rank_tensor``), not by Python bounds, so every rank traces one graph.
    """
    if group.size == 1:
        return tensor
    dim = dim % tensor.dim() if tensor.dim() else dim
    size = tensor.shape[dim]
    if size % group.size != 0:
        raise ValueError(
            f"cannot split dimension {dim} of shape {tuple(tensor.shape)} (size {size}) evenly over the "
            f"{group.kind}-parallel group of size {group.size}"
        )
    blocks = tensor.unflatten(dim, (group.size, size // group.size))
    return blocks.index_select(dim, rank_tensor(group, tensor.device)).squeeze(dim)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, reduce_dtype=None):
        ctx.group, ctx.reduce_dtype = group, reduce_dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _in_dtype(lambda g: comm.all_reduce(g, ctx.group), grad, ctx.reduce_dtype), None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, reduce_dtype=None):
        return _in_dtype(lambda t: comm.all_reduce(t, group), x, reduce_dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _Split(torch.autograd.Function):
    """Forward: keep this rank's slice along ``dim``. Backward: all-gather along ``dim``."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return split_along_dim(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.group, ctx.dim), None, None


class _Gather(torch.autograd.Function):
    """Forward: all-gather along ``dim``. Backward: reduce-scatter (the grads differ per rank) or split (they agree)."""

    @staticmethod
    def forward(ctx, x, group, dim, reduce_in_backward, reduce_dtype=None):
        ctx.group, ctx.dim, ctx.reduce_in_backward, ctx.reduce_dtype = group, dim, reduce_in_backward, reduce_dtype
        return comm.all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_in_backward:
            grad_in = _in_dtype(lambda g: comm.reduce_scatter(g, ctx.group, ctx.dim), grad, ctx.reduce_dtype)
        else:
            grad_in = split_along_dim(grad, ctx.group, ctx.dim)
        return grad_in, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    """Forward: sum over the group and keep this rank's slice along ``dim``. Backward: all-gather, in
    ``grad_dtype`` when given (NxD's ``dtype``: the gradient travels in the layer's dtype, not the reduction's)."""

    @staticmethod
    def forward(ctx, x, group, dim, reduce_dtype=None, grad_dtype=None):
        ctx.group, ctx.dim, ctx.grad_dtype = group, dim, grad_dtype
        return _in_dtype(lambda t: comm.reduce_scatter(t, group, dim), x, reduce_dtype)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_dtype is not None:
            grad = grad.to(ctx.grad_dtype)
        return comm.all_gather(grad, ctx.group, ctx.dim), None, None, None, None


class _SumOverReplicas(torch.autograd.Function):
    """Forward: identity on this rank's shard of a tensor whose full form repeats each block of rows ``replicas``
    times (along dim 0). Backward: every copy of a block gets the sum of all copies' gradients, wherever they live."""

    @staticmethod
    def forward(ctx, x, group, replicas, block):
        ctx.group, ctx.replicas, ctx.block = group, replicas, block
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        full = comm.all_gather(grad, ctx.group, 0)
        rest = tuple(full.shape[1:])
        grouped = full.reshape((-1, ctx.replicas, ctx.block) + rest)
        summed = grouped.sum(dim=1, keepdim=True).expand_as(grouped).reshape(full.shape)
        return split_along_dim(summed, ctx.group, 0), None, None, None


def sum_gradients_over_replicas(input_: torch.Tensor, replicas: int, block: int) -> torch.Tensor:
    """For a TP shard (split along dim 0) of a tensor that holds each ``block`` rows ``replicas`` times (KV heads
    replicated because TP exceeds them): the copies' gradients are summed, so the copies, wherever they are, get the
    dense gradient of their block and stay equal under any optimizer."""
    return _SumOverReplicas.apply(input_, tensor_parallel_group(), replicas, block)


class _SumGradientsOverTensorParallel(torch.autograd.Function):
    """Forward: identity on several tensors. Backward: their gradients summed over the group with one all-reduce."""

    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        present = [g for g in grads if g is not None]
        if not present:
            return (None,) + grads
        if len({g.dtype for g in present}) == 1:
            # One collective for all of them: its latency, not its few bytes, is the cost (norm weights and biases).
            flat = comm.all_reduce(torch.cat([g.reshape(-1) for g in present]), ctx.group)
            summed = iter(flat.split([g.numel() for g in present]))
            present = [next(summed).view_as(g) for g in present]
        else:
            present = [comm.all_reduce(g, ctx.group) for g in present]
        reduced = iter(present)
        return (None,) + tuple(None if g is None else next(reduced) for g in grads)


def sum_gradients_over_tensor_parallel(*tensors: torch.Tensor):
    """Identity on ``tensors`` (a tuple of views); in backward their gradients are summed over the TP group, all with
    one all-reduce. For replicated parameters applied to this rank's share of the data (sequence-parallel norms and
    row-parallel biases): each rank's gradient is a partial sum, and the sum inside backward makes it whole before it
    is accumulated into ``.grad``."""
    return _SumGradientsOverTensorParallel.apply(tensor_parallel_group(), *tensors)


def copy_to_tensor_model_parallel_region(input_: torch.Tensor, process_group=None, *,
                                         reduce_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Enter a TP region with a replicated input: identity forward, gradient summed over TP ranks in backward (in
    ``reduce_dtype`` when given, an nxdtp option)."""
    return _CopyToRegion.apply(input_, _group(process_group), reduce_dtype)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, process_group=None, *,
                                             reduce_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Leave a TP region whose ranks hold partial sums: all-reduce forward (in ``reduce_dtype`` when given, an nxdtp
    option), identity backward.

    A tensor outside autograd (``requires_grad=False``, such as a ``.grad``) is summed in place and returned, as NxD's
    region does for every tensor: NxD code reduces gradient buffers this way and drops the result (its sequence-parallel
    guide). A tensor that requires grad gets a new result and is left as it was, so autograd's saved tensors stay valid.
    """
    group = _group(process_group)
    if not input_.requires_grad:
        reduced = _in_dtype(lambda t: comm.all_reduce(t, group), input_, reduce_dtype)
        return input_ if reduced is input_ else input_.copy_(reduced)
    return _ReduceFromRegion.apply(input_, group, reduce_dtype)


def reduce_from_context_model_parallel_region(input_: torch.Tensor, process_group=None) -> torch.Tensor:
    """NxD's context-parallel exit. nxdtp has no context parallelism: each rank's context group is itself, so with
    ``process_group=None`` this is the identity; a group given explicitly is all-reduced over."""
    if process_group is None:
        return input_
    return _ReduceFromRegion.apply(input_, _group(process_group), None)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, process_group=None,
                                            partition_dim: int = -1) -> torch.Tensor:
    return _Split.apply(input_, _group(process_group), partition_dim)


def scatter_input_channels_to_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Keep this rank's block of channels (dim 1 of an NCHW tensor): the entry of an input-channel-parallel convolution.
    Backward all-gathers the channel gradients."""
    return _Split.apply(input_, tensor_parallel_group(), 1)


def gather_from_tensor_model_parallel_region(input_: torch.Tensor, process_group=None,
                                             partition_dim: int = -1) -> torch.Tensor:
    # The consumer of a gathered tensor is replicated, so every rank holds the same full gradient: split it.
    return _Gather.apply(input_, _group(process_group), partition_dim, False)


def gather_from_tensor_model_parallel_region_with_dim(input_: torch.Tensor, gather_dim: int,
                                                      process_group=None) -> torch.Tensor:
    """All-gather along ``gather_dim``; backward keeps this rank's slice (the consumer is replicated)."""
    return _Gather.apply(input_, _group(process_group), gather_dim, False)


def reduce_scatter_to_tensor_model_parallel_region_with_dim(input_: torch.Tensor, partition_dim: int,
                                                            process_group=None) -> torch.Tensor:
    """Sum over the group and keep this rank's slice along ``partition_dim``; backward all-gathers."""
    return _ReduceScatter.apply(input_, _group(process_group), partition_dim)


def scatter_to_sequence_parallel_region(input_: torch.Tensor, sequence_dimension: int = 0,
                                        process_group=None) -> torch.Tensor:
    group = _group(process_group)
    length = input_.shape[sequence_dimension]
    if length % group.size != 0:
        # The generic split error would not say what to change: here it is the batch's sequence length.
        raise ValueError(f"sequence parallelism splits the sequence over the {group.size} tensor-parallel ranks, but "
                         f"this batch's sequence length is {length} (dimension {sequence_dimension} of shape "
                         f"{tuple(input_.shape)}): pad sequences to a multiple of {group.size} (a tokenizer's or "
                         f"collator's pad_to_multiple_of={group.size}, with an attention mask) or turn "
                         "sequence_parallel off")
    return _Split.apply(input_, group, sequence_dimension)


def gather_from_sequence_parallel_region(input_: torch.Tensor, sequence_dimension: int = 0,
                                         to_model_parallel: bool = True, process_group=None, tile_cc: bool = False, *,
                                         reduce_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """All-gather the sequence shards.

    ``to_model_parallel=True``: the gathered tensor feeds a TP region (a column-parallel layer), whose ranks produce
    different partial input gradients, so backward reduce-scatters them (in ``reduce_dtype`` when given, an nxdtp
    option). ``False``: it feeds replicated computation (a pooler, a loss on full logits), whose gradient is the same on
    every rank, so backward only keeps this rank's slice.
    """
    note_tile_cc("gather_from_sequence_parallel_region", tile_cc)
    return _Gather.apply(input_, _group(process_group), sequence_dimension, bool(to_model_parallel), reduce_dtype)


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor, sequence_dimension: int = 0,
                                               process_group=None, dtype: Optional[torch.dtype] = None, *,
                                               reduce_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Reduce-scatter along the sequence; backward all-gathers, in ``dtype`` when given (NxD's meaning). The forward
    sum runs in ``reduce_dtype`` when given (an nxdtp option)."""
    return _ReduceScatter.apply(input_, _group(process_group), sequence_dimension, reduce_dtype, dtype)


def _check_dims(x: torch.Tensor, dims: int, where: str, layout: str) -> None:
    if x.dim() != dims:
        raise ValueError(f"{where}: x has shape {tuple(x.shape)}; expected {dims} dimensions {layout}")


class _AllToAll(torch.autograd.Function):
    """All-to-all over ``group``; backward sends each gradient chunk back where its value came from (the all-to-all
    with the two dims swapped)."""

    @staticmethod
    def forward(ctx, input_, group, split_dim, concat_dim):
        ctx.group, ctx.split_dim, ctx.concat_dim = group, split_dim, concat_dim
        return comm.all_to_all(input_, group, split_dim, concat_dim)

    @staticmethod
    def backward(ctx, grad_output):
        return comm.all_to_all(grad_output, ctx.group, ctx.concat_dim, ctx.split_dim), None, None, None


def _expert_all_to_all(x: torch.Tensor, scatter_gather: bool, split_dim: int, concat_dim: int) -> torch.Tensor:
    # NxD drops the tokens duplicated over TP (dim 2) before the all-to-all over the expert-parallel group and
    # regathers them after it, so each token crosses the EP group once instead of once per TP rank.
    tp_group = tensor_parallel_group()
    if scatter_gather:
        x = _Split.apply(x, tp_group, 2)
    x = _AllToAll.apply(x, expert_parallel_group(), split_dim, concat_dim)
    return _Gather.apply(x, tp_group, 2, False) if scatter_gather else x


def enter_expert_parallel_region(x: torch.Tensor, scatter_gather: bool) -> torch.Tensor:
    """NxD's expert-parallel entry: (e, c, h), this rank's tokens routed to each of the e experts, becomes
    (e/ep, ep, c, h), the tokens of every rank of the expert-parallel group for this rank's e/ep experts."""
    _check_dims(x, 3, "enter_expert_parallel_region", "(experts, capacity, hidden)")
    ep = expert_parallel_group().size
    if x.shape[0] % ep != 0:
        raise ValueError(f"enter_expert_parallel_region: x has shape {tuple(x.shape)}; its {x.shape[0]} experts "
                         f"must be a multiple of expert_model_parallel_size={ep}")
    return _expert_all_to_all(x.unsqueeze(1), scatter_gather, 0, 1)


def exit_expert_parallel_region(x: torch.Tensor, scatter_gather: bool) -> torch.Tensor:
    """NxD's expert-parallel exit, the inverse of the entry: (e/ep, ep, c, h) -> (e, c, h)."""
    _check_dims(x, 4, "exit_expert_parallel_region", "(experts per rank, ep, capacity, hidden)")
    ep = expert_parallel_group().size
    if x.shape[1] != ep:
        raise ValueError(f"exit_expert_parallel_region: x has shape {tuple(x.shape)}; dimension 1 must be the "
                         f"expert-parallel size {ep}")
    return _expert_all_to_all(x, scatter_gather, 1, 0).squeeze(1)


def _rank_indices(rank: torch.Tensor, size: int, partition: int, round_robin: bool, device) -> torch.Tensor:
    """The positions this rank keeps, computed from the rank as data, so every rank traces one graph."""
    steps = torch.arange(partition, device=device)
    rank = rank.to(device).reshape(-1)[:1]
    return steps * size + rank if round_robin else steps + rank * partition


class _ScatterByRankTensor(torch.autograd.Function):
    """Forward: this rank's part along ``dim``, chosen by a rank tensor. Backward: the parts are all-gathered and put
    back in place, so the input gradient is the full one on every rank (NxD raises in backward)."""

    @staticmethod
    def forward(ctx, x, dim, rank, group, round_robin):
        size = x.shape[dim]
        if size % group.size != 0:
            raise ValueError(f"dimension {dim} of shape {tuple(x.shape)} (size {size}) does not split over the "
                             f"{group.kind} group of size {group.size}")
        ctx.dim, ctx.group, ctx.round_robin = dim, group, round_robin
        index = _rank_indices(rank, group.size, size // group.size, round_robin, x.device)
        return x.index_select(dim, index)

    @staticmethod
    def backward(ctx, grad):
        full = comm.all_gather(grad, ctx.group, ctx.dim)
        if ctx.round_robin and ctx.group.size > 1:
            # gathered order is [rank 0's rows, rank 1's rows, ...]; rank r's j-th row belongs at j * size + r
            moved = full.movedim(ctx.dim, 0)
            moved = moved.reshape(ctx.group.size, -1, *moved.shape[1:]).transpose(0, 1).reshape(moved.shape)
            full = moved.movedim(0, ctx.dim).contiguous()
        return full, None, None, None, None


def scatter_to_process_group_spmd(input_: torch.Tensor, partition_dim: int, rank: torch.Tensor,
                                  process_group=None) -> torch.Tensor:
    """This rank's contiguous 1/size block along ``partition_dim``, picked by the rank tensor ``rank``."""
    return _ScatterByRankTensor.apply(input_, partition_dim, rank, _group(process_group), False)


def round_robin_scatter_to_process_group_spmd(input_: torch.Tensor, partition_dim: int, rank: torch.Tensor,
                                              process_group=None) -> torch.Tensor:
    """Every size-th position along ``partition_dim`` starting at ``rank`` (rank 0 of 2: 0, 2, 4, ...)."""
    return _ScatterByRankTensor.apply(input_, partition_dim, rank, _group(process_group), True)


def nonzero_partition_dim_swap(func: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Decorator: ``func(x, 0, ...)`` works on dim 0; the wrapped ``f(x, partition_dim, ...)`` moves ``partition_dim``
    to the front for the call and back after it."""

    @functools.wraps(func)
    def wrapped(x: torch.Tensor, partition_dim: int, *args, **kwargs) -> torch.Tensor:
        if partition_dim == 0:
            return func(x, 0, *args, **kwargs)
        return func(x.transpose(0, partition_dim), 0, *args, **kwargs).transpose(0, partition_dim)

    return wrapped


__all__ = [
    "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "reduce_from_context_model_parallel_region",
    "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "scatter_input_channels_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region_with_dim", "reduce_scatter_to_tensor_model_parallel_region_with_dim",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "enter_expert_parallel_region", "exit_expert_parallel_region",
    "scatter_to_process_group_spmd", "round_robin_scatter_to_process_group_spmd", "nonzero_partition_dim_swap",
    "split_along_dim", "sum_gradients_over_replicas", "sum_gradients_over_tensor_parallel",
]

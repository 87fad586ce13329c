"""Autograd regions at the borders of tensor-parallel computation.

Each region is a pair of collectives, one in forward and its mirror in backward:

    copy_to_tensor_model_parallel_region         identity          | all-reduce
    reduce_from_tensor_model_parallel_region     all-reduce        | identity
    scatter_to_tensor_model_parallel_region      split last dim    | all-gather last dim
    gather_from_tensor_model_parallel_region     all-gather last   | split last dim
    scatter_to_sequence_parallel_region          split seq dim     | all-gather seq dim
    gather_from_sequence_parallel_region         all-gather seq    | reduce-scatter seq (to_model_parallel=True) or split
    reduce_scatter_to_sequence_parallel_region   reduce-scatter    | all-gather seq

All collectives go through nxdtp.comm over the tensor-parallel group, so the same code serves XLA, NCCL and gloo.
Sequence-parallel tensors are sequence-first by default ([seq, batch, hidden], as in Megatron and NxD); pass
``sequence_dimension=1`` for batch-first tensors. Positional arguments follow NxD's order.
"""

from __future__ import annotations

import torch

from . import comm
from .parallel_state import ParallelGroup, tensor_parallel_group


def _group(process_group) -> ParallelGroup:
    if process_group is not None:
        raise ValueError(
            f"process_group={process_group!r} is not supported: nxdtp regions always use the tensor-parallel group from "
            "nxdtp.parallel_state; pass process_group=None"
        )
    return tensor_parallel_group()


def split_along_dim(tensor: torch.Tensor, group: ParallelGroup, dim: int) -> torch.Tensor:
    """This rank's 1/size slice of ``tensor`` along ``dim`` (contiguous, so collectives and views downstream are safe)."""
    if group.size == 1:
        return tensor
    size = tensor.shape[dim]
    if size % group.size != 0:
        raise ValueError(
            f"cannot split dimension {dim} of shape {tuple(tensor.shape)} (size {size}) evenly over the "
            f"{group.kind}-parallel group of size {group.size}"
        )
    chunk = size // group.size
    return tensor.narrow(dim, group.rank * chunk, chunk).contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return comm.all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


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
    def forward(ctx, x, group, dim, reduce_in_backward):
        ctx.group, ctx.dim, ctx.reduce_in_backward = group, dim, reduce_in_backward
        return comm.all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_in_backward:
            return comm.reduce_scatter(grad, ctx.group, ctx.dim), None, None, None
        return split_along_dim(grad, ctx.group, ctx.dim), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return comm.reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.group, ctx.dim), None, None


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


def copy_to_tensor_model_parallel_region(input_: torch.Tensor, process_group=None) -> torch.Tensor:
    """Enter a TP region with a replicated input: identity forward, gradient summed over TP ranks in backward."""
    return _CopyToRegion.apply(input_, _group(process_group))


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, process_group=None) -> torch.Tensor:
    """Leave a TP region whose ranks hold partial sums: all-reduce forward, identity backward."""
    return _ReduceFromRegion.apply(input_, _group(process_group))


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


def scatter_to_sequence_parallel_region(input_: torch.Tensor, sequence_dimension: int = 0,
                                        process_group=None) -> torch.Tensor:
    return _Split.apply(input_, _group(process_group), sequence_dimension)


def gather_from_sequence_parallel_region(input_: torch.Tensor, sequence_dimension: int = 0,
                                         to_model_parallel: bool = True, process_group=None) -> torch.Tensor:
    """All-gather the sequence shards.

    ``to_model_parallel=True``: the gathered tensor feeds a TP region (a column-parallel layer), whose ranks produce
    different partial input gradients, so backward reduce-scatters them. ``False``: it feeds replicated computation (a
    pooler, a loss on full logits), whose gradient is the same on every rank, so backward only keeps this rank's slice.
    """
    return _Gather.apply(input_, _group(process_group), sequence_dimension, bool(to_model_parallel))


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor, sequence_dimension: int = 0,
                                               process_group=None) -> torch.Tensor:
    return _ReduceScatter.apply(input_, _group(process_group), sequence_dimension)


__all__ = [
    "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "scatter_input_channels_to_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "split_along_dim",
]

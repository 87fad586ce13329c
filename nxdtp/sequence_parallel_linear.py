"""Linear layers on a sequence-parallel input that keep only the sequence shard for backward.

Under sequence parallelism a column-parallel layer reads the all-gather of its input's sequence shards. A plain matmul
on the gathered tensor makes autograd keep the full sequence, tensor-parallel size times the shard, until backward,
which undoes most of what sequence parallelism saves. As in Megatron-LM, the layers here keep the shard instead and
all-gather it again in backward for the weight gradient: one all-gather more in backward, traded for activation memory.

``gather_keeping_shard`` is the sequence-parallel entry region (all-gather forward, reduce-scatter of the input gradient
backward) whose result remembers the shard it was gathered from. ``linear`` on such a tensor saves that shard, not the
tensor. Several layers reading one gathered tensor (Q, K and V; gate and up) share its re-gather: the first backward
that needs the full input gathers it, and it is dropped once every reader has used it. Any other tensor goes through a
plain ``F.linear``.

The note follows the tensor's value, not its autograd history: a tensor that equals the gathered one (an identity
region such as ``copy_to_tensor_model_parallel_region``, a cast) may carry the note on (``carry_note``); the gradient
still flows through whatever produced the tensor.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import torch
import torch.nn.functional as F

from . import comm, mappings
from .record import note_of, read_note
from .topology import ParallelGroup, group_of


class _Regather:
    """Backward's all-gather of one sequence shard, shared by the layers that read the same gathered tensor."""

    def __init__(self, group: ParallelGroup, dim: int):
        self.group, self.dim = group, dim
        self.readers = 0
        self._unread = 0
        self._full: Dict[torch.dtype, torch.Tensor] = {}

    def add_reader(self) -> None:
        self.readers += 1
        self._unread += 1

    def full(self, shard: torch.Tensor) -> torch.Tensor:
        full = self._full.get(shard.dtype)
        if full is None:
            full = self._full[shard.dtype] = comm.all_gather(shard, self.group, self.dim)
        self._unread -= 1
        if self._unread <= 0:
            # Every reader has its weight gradient: free the full input now, and be ready for another backward over a
            # retained graph.
            self._full.clear()
            self._unread = self.readers
        return full


class _ShardNote:
    """What a gathered tensor was gathered from: the shard (per dtype, for readers under autocast) and its re-gather."""

    def __init__(self, shard: torch.Tensor, regather: _Regather):
        self._shards = {shard.dtype: shard}
        self.regather = regather

    def shard(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._shards:
            # Cast once for all readers, so Q, K and V keep one copy between them.
            self._shards[dtype] = next(iter(self._shards.values())).to(dtype)
        return self._shards[dtype]


@dataclasses.dataclass
class SequenceShardNote:
    """On an activation gathered along the sequence: the shard it was gathered from and how to gather it again, so a
    column-parallel layer may keep only the shard for backward."""
    shard: Optional[_ShardNote] = None


def remember_shard(full: torch.Tensor, shard: torch.Tensor, sequence_dimension: int = 0,
                   process_group=None) -> torch.Tensor:
    """Note on ``full``, the all-gather of ``shard`` along ``sequence_dimension`` over the group, that ``linear`` may
    keep ``shard`` for backward instead of it. Returns ``full``."""
    group = group_of(process_group)
    if group.size > 1:
        note_of(full, SequenceShardNote).shard = _ShardNote(shard, _Regather(group, sequence_dimension))
    return full


def gather_keeping_shard(shard: torch.Tensor, sequence_dimension: int = 0, process_group=None,
                         reduce_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """All-gather the sequence shards for column-parallel consumers (their input gradients are reduce-scattered in
    backward, in ``reduce_dtype`` when given); ``linear`` on the result keeps only ``shard`` for backward."""
    group = group_of(process_group)
    full = mappings.gather_from_sequence_parallel_region(shard, sequence_dimension, True, group,
                                                         reduce_dtype=reduce_dtype)
    return remember_shard(full, shard, sequence_dimension, group)


def _note_of(tensor: torch.Tensor) -> Optional[_ShardNote]:
    note = read_note(tensor, SequenceShardNote).shard
    base = tensor._base
    if note is None and base is not None:
        # A view that covers its whole base the same way (HF's ``hidden_states[:, slice(0, None), :]`` before an LM
        # head) has the base's value.
        same = (tensor.shape == base.shape and tensor.stride() == base.stride()
                and tensor.storage_offset() == base.storage_offset() and tensor.dtype == base.dtype)
        note = read_note(base, SequenceShardNote).shard if same else None
    return note


def carry_note(source: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """Let ``result``, which has the value of ``source`` (possibly cast), keep ``source``'s shard note."""
    note = _note_of(source)
    if note is not None and result is not source:
        if result.shape != source.shape:
            raise ValueError(f"carry_note: result of shape {tuple(result.shape)} cannot stand for a gathered tensor of "
                             f"shape {tuple(source.shape)}; only a tensor of equal value may carry the note")
        note_of(result, SequenceShardNote).shard = note
    return result


def has_shard_note(tensor: torch.Tensor) -> bool:
    return _note_of(tensor) is not None


class _LinearSavingShard(torch.autograd.Function):
    """``F.linear(full, weight, bias)`` that saves ``shard`` (when the weight needs a gradient) and the weight.

    Backward: the gradient of ``full`` (its producer, the entry region, reduce-scatters it) and, from the re-gathered
    shard, the weight gradient."""

    @staticmethod
    def forward(ctx, full, shard, weight, bias, regather):
        ctx.regather = regather
        ctx.save_for_backward(shard if weight.requires_grad else None, weight)
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        shard, weight = ctx.saved_tensors
        grad_full = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_full = grad_output.matmul(weight)
        rows = grad_output.reshape(-1, grad_output.shape[-1])
        if ctx.needs_input_grad[2]:
            full = ctx.regather.full(shard)
            grad_weight = rows.t().matmul(full.reshape(-1, full.shape[-1]))
        if ctx.needs_input_grad[3]:
            grad_bias = rows.sum(0)
        return grad_full, None, grad_weight, grad_bias, None


def linear(input_: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear``; on a tensor from ``gather_keeping_shard`` only its sequence shard is kept for backward."""
    note = _note_of(input_)
    if note is None:
        return F.linear(input_, weight, bias)
    if input_.dtype != weight.dtype:
        raise TypeError(f"linear: input is {input_.dtype} but weight is {weight.dtype}; cast them to one dtype first "
                        "(as F.linear requires)")
    records = torch.is_grad_enabled() and weight.requires_grad
    if records:
        note.regather.add_reader()
    return _LinearSavingShard.apply(input_, note.shard(input_.dtype), weight, bias, note.regather)


__all__ = ["gather_keeping_shard", "remember_shard", "carry_note", "has_shard_note", "linear"]

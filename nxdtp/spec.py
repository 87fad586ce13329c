"""The layout algebra: how a full tensor maps to tensor-parallel rank pieces, known here and nowhere else.

The layout model (one ``ParamSpec`` per tensor; all of it along one ``partition_dim``, the other dims are whole):

* **dense** tensor: the model's tensor as a dense (single-device) model holds it, of ``unpadded_shape``.
* **full** tensor: the dense one laid out for ``num_partitions`` ranks, of ``full_shape``. Along the split dim it is the
  dense rows with
  - *replicas*: every block of ``replica_block`` dense rows repeated ``replicas`` times in a row (KV heads when the TP
    degree exceeds them, so every rank holds whole copies; copies of one block sit on adjacent ranks);
  - *padding*: zero rows. With ``pad_groups`` g, the dense rows are g equal groups and each group is followed by the
    same number of zero rows (g = 1: zeros after all dense rows). Zero heads use ``pad_block`` (the head size) and one
    group per KV head (or per fused part); ``nxdtp.pad.pad_model`` puts one group on every rank (``pad_block`` 1).
* **pieces**: with ``stride`` s, the full dim is cut into ``s * num_partitions`` equal blocks and rank r's piece is
  blocks ``r, r + num_partitions, ..., r + (s - 1) * num_partitions`` in that order (a fused Q|K|V or gate|up weight:
  every rank holds its part of each fused block). Ranks are TP ranks in group order; a replicated tensor
  (``partition_dim`` None) is whole on every rank.
* **experts**: with ``expert_partitions`` k > 1, dim 0 holds experts and is cut a second time, into k consecutive
  blocks over the expert-parallel group (expert-parallel rank e holds experts ``e*E/k .. (e+1)*E/k - 1`` of its TP
  piece: ``experts_of_rank``, and ``expert_runs`` finds rows of a TP piece in them); every method above works on TP
  pieces holding every expert. Files hold every expert (``with_all_experts``), so a checkpoint loads at any
  expert-parallel size.
* **padding record**: ``pad_to_multiple_of`` m says the split dim is zero-padded at its end to a multiple of
  ``m * num_partitions`` (``round_up``), so the spec at any other degree is known (``at_degree``); ``vocabulary`` says
  m is the model's ``make_vocab_size_divisible_by``, which a reshard may change. Zero heads and replicas are recorded
  by their fields above and are likewise redone per degree. Padding is recorded per tensor, never inferred.

The operations: ``shard(dense, rank)``, ``unshard(pieces)``, ``at_degree(tp)`` and ``reshard(pieces, tp)``, with the
full-tensor steps they are made of (``full_from_dense``, ``dense_from_full``, ``piece_of_full``, ``full_from_pieces``,
``place_piece``) and the runs a chunked format writes (``dense_runs_of_piece``, ``copy_runs_of_piece``); reading in runs
and slabs is ``nxdtp.checkpointing.slabs``. ZeRO-1's flat cut of a TP piece over a DP group is ``FlatShardLayout``.

A spec says too whether the tensor's gradient must be summed over the tensor-parallel group (parameters replicated
inside sequence-parallel regions).

The module is the source of truth. The NxD attributes on Parameter objects (``tensor_model_parallel``,
``partition_dim``, ``partition_stride``, ``num_partitions``, ``sequence_parallel_enabled``) are a cache for code that
only sees parameters (grad clipping, optimizers). ``.to(xla)`` and ``to_empty()`` replace Parameter objects and
drop them, and ``nxdtp.utils.move_model_to_device`` puts them back from the module; ``copy.deepcopy`` (torch's
``Parameter.__deepcopy__`` copies the data, not the attributes) and unpickling rebuild a module through
``__setstate__``, where ``ShardedModule`` puts them back itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .heads import kv_replicas, padded_rows
from .rounding import round_up
from .storage import owning

SPEC_FORMAT_VERSION = 1


def split_along(full: torch.Tensor, dim: int, rank: int, num_partitions: int, stride: int = 1, *,
                own: bool = True) -> torch.Tensor:
    """Rank ``rank``'s piece of ``full`` cut along ``dim`` into ``num_partitions`` pieces of ``stride`` blocks each
    (see the module docstring); a tensor of its own (not a view of ``full``, whose storage it would keep alive).
    ``own=False`` lets it be a view where the cut allows one, for a piece that is written out or copied and dropped
    while ``full`` is held anyway (a merge, a load): no copy."""
    size = full.shape[dim]
    if stride < 1 or size % (num_partitions * stride) != 0:
        raise ValueError(f"dimension {dim} of size {size} cannot be split into {num_partitions} partitions with "
                         f"stride {stride}")
    if not 0 <= rank < num_partitions:
        raise ValueError(f"rank={rank} is outside the {num_partitions} partitions; use 0 to {num_partitions - 1}")
    block = size // (num_partitions * stride)
    if stride == 1:
        piece = full.narrow(dim, rank * block, block)
        return owning(piece) if own else piece.contiguous()
    return torch.cat([full.narrow(dim, (chunk * num_partitions + rank) * block, block) for chunk in range(stride)],
                     dim=dim)


def to_rank_order(full: torch.Tensor, dim: int, num_partitions: int, stride: int) -> torch.Tensor:
    """``full`` with ``dim`` reordered so that the rank pieces (``split_along``) follow each other in rank order: what
    a scatter of contiguous blocks along ``dim`` hands out as pieces. A reshape and a transpose, the same graph for
    every rank (traced code uses it on activations)."""
    if stride == 1 or num_partitions == 1:
        return full
    dim = dim % full.dim()
    shape = tuple(full.shape)
    blocks = full.reshape(shape[:dim] + (stride, num_partitions, shape[dim] // (stride * num_partitions)) +
                          shape[dim + 1:])
    return blocks.transpose(dim, dim + 1).reshape(shape)


def from_rank_order(gathered: torch.Tensor, dim: int, num_partitions: int, stride: int) -> torch.Tensor:
    """The inverse of ``to_rank_order``: the rank pieces concatenated in rank order along ``dim`` (an all-gather of
    them) back in the full tensor's order."""
    if stride == 1 or num_partitions == 1:
        return gathered
    dim = dim % gathered.dim()
    shape = tuple(gathered.shape)
    blocks = gathered.reshape(shape[:dim] + (num_partitions, stride, shape[dim] // (stride * num_partitions)) +
                              shape[dim + 1:])
    return blocks.transpose(dim, dim + 1).reshape(shape)


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    full_shape: Tuple[int, ...]
    partition_dim: Optional[int] = None  # None: the parameter is replicated on every TP rank
    stride: int = 1
    num_partitions: int = 1
    real_shape: Optional[Tuple[int, ...]] = None  # the unpadded full shape; None means equal to full_shape
    sequence_parallel: bool = False
    # Replicated blocks (KV heads when tp exceeds them): along partition_dim the full tensor holds every block of
    # ``replica_block`` rows of the dense tensor ``replicas`` times in a row; real_shape is then the dense shape.
    replicas: int = 1
    replica_block: int = 1
    # Zero-padded heads (head counts TP does not divide): along partition_dim the real rows are ``pad_groups`` equal
    # groups of whole heads of ``pad_block`` rows, and each group is followed by the same number of zero heads (one
    # group: the zero heads come after all real rows; grouped-query attention: a group per KV head).
    pad_block: int = 1
    pad_groups: int = 1
    # A sequence-parallel parameter whose module sums its gradient over TP inside backward (the plans install this,
    # nxdtp.plan.parallelize): allreduce_sequence_parallel_gradients then leaves it alone, so calling it as well cannot
    # double the gradient. How the model is wired, not how the tensor is laid out: checkpoints do not record it.
    grad_allreduced_in_backward: bool = False
    # The padding record (module docstring): the split dim is zero-padded to a multiple of pad_to_multiple_of *
    # num_partitions; None where the dim is not padded that way. ``vocabulary``: the multiple is the model's
    # make_vocab_size_divisible_by, which a reshard may replace.
    pad_to_multiple_of: Optional[int] = None
    vocabulary: bool = False
    # Experts (module docstring): dim 0 is the expert dimension, cut into this many consecutive blocks over the
    # expert-parallel group; 1 where the tensor holds every expert or is no expert tensor.
    expert_partitions: int = 1

    @property
    def is_sharded(self) -> bool:
        return self.partition_dim is not None

    @property
    def unpadded_shape(self) -> Tuple[int, ...]:
        return self.real_shape if self.real_shape is not None else self.full_shape

    def collapse_replicas(self, full: torch.Tensor) -> torch.Tensor:
        """The dense tensor from the full (replicated) one: the first copy of every block."""
        if self.replicas == 1:
            return full
        dim, block = self.partition_dim, self.replica_block
        shape = tuple(full.shape)
        grouped = full.reshape(shape[:dim] + (-1, self.replicas, block) + shape[dim + 1:])
        return grouped.select(dim + 1, 0).reshape(shape[:dim] + (-1,) + shape[dim + 1:])

    def expand_replicas(self, dense: torch.Tensor) -> torch.Tensor:
        """The full (replicated) tensor from the dense one: every block ``replicas`` times in a row."""
        if self.replicas == 1:
            return dense
        dim, block = self.partition_dim, self.replica_block
        shape = tuple(dense.shape)
        grouped = dense.reshape(shape[:dim] + (-1, 1, block) + shape[dim + 1:])
        expanded = grouped.expand(shape[:dim] + (grouped.shape[dim], self.replicas, block) + shape[dim + 1:])
        return expanded.reshape(shape[:dim] + (-1,) + shape[dim + 1:])

    def dense_from_full(self, full: torch.Tensor) -> torch.Tensor:
        """The dense tensor (a view where possible) from the full one: its copies and its padding dropped."""
        real = self.collapse_replicas(full)
        if self.pad_groups > 1:
            dim = self.partition_dim
            real = real.unflatten(dim, (self.pad_groups, -1)).narrow(dim + 1, 0, self._real_per_group())
            real = real.flatten(dim, dim + 1)
        return _leading_block(real, self.unpadded_shape)

    def full_from_dense(self, dense: torch.Tensor) -> torch.Tensor:
        """The full tensor from the dense one: its blocks repeated, or zero padding added, as this spec lays it out."""
        if self.replicas > 1:
            return self.expand_replicas(dense).contiguous()
        if tuple(dense.shape) == tuple(self.full_shape):
            return dense
        full = torch.zeros(self.full_shape, dtype=dense.dtype, device=dense.device)
        if self.pad_groups > 1:
            dim = self.partition_dim
            grouped = full.unflatten(dim, (self.pad_groups, -1)).narrow(dim + 1, 0, self._real_per_group())
            grouped.copy_(dense.unflatten(dim, (self.pad_groups, -1)))
        else:
            _leading_block(full, dense.shape).copy_(dense)
        return full

    def place_piece(self, full: torch.Tensor, piece: torch.Tensor, rank: int) -> None:
        """Copy TP rank ``rank``'s piece into its places in ``full`` (the full tensor, padded and with its copies):
        the inverse of ``shard_of`` with this spec's partition dim and stride. The piece holds ``stride`` chunks, and
        chunk j is block ``j * num_partitions + rank`` of the full dimension."""
        dim, stride, parts = self.partition_dim, self.stride, self.num_partitions
        block = self.full_shape[dim] // (parts * stride)
        for chunk in range(stride):
            full.narrow(dim, (chunk * parts + rank) * block, block).copy_(piece.narrow(dim, chunk * block, block))

    def full_from_pieces(self, read_piece: Callable[[int], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The full (padded, copies kept) tensor from its TP pieces. ``read_piece(rank)`` is called once per rank, in
        rank order 0, 1, ..., and each piece is copied in and dropped before the next is read, so the peak is the full
        tensor plus one piece. A replicated tensor, or one split into one partition, is rank 0's piece. The full
        tensor is made on the pieces' device."""
        if not self.is_sharded or self.num_partitions == 1:
            piece = read_piece(0)  # the one piece is the full tensor
            if self.is_sharded and tuple(piece.shape) != tuple(self.full_shape):
                raise ValueError(f"a piece of shape {list(piece.shape)} given for a tensor whose full shape is "
                                 f"{list(self.full_shape)}")
            return piece.to(dtype)
        full = None
        for rank in range(self.num_partitions):
            piece = read_piece(rank)
            if full is None:
                full = torch.empty(self.full_shape, dtype=dtype, device=piece.device)
            self.place_piece(full, piece, rank)
            del piece
        return full

    def piece_of_full(self, full: torch.Tensor, rank: int, *, own: bool = True) -> torch.Tensor:
        """TP rank ``rank``'s piece of the full (padded, copies kept) tensor; the whole tensor when replicated. The
        piece owns its storage unless ``own=False`` (``split_along``)."""
        if not self.is_sharded:
            return full
        return split_along(full, self.partition_dim, rank, self.num_partitions, self.stride, own=own)

    def shard(self, dense: torch.Tensor, rank: int) -> torch.Tensor:
        """TP rank ``rank``'s piece of the dense tensor: laid out (copies, zero padding) and cut as this spec says."""
        self._check_dense(dense)
        return self.piece_of_full(self.full_from_dense(dense), rank)

    def unshard(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """The dense tensor from every rank's piece in rank order (a replicated tensor: rank 0's), padding and copies
        dropped."""
        if self.is_sharded and len(pieces) != self.num_partitions:
            raise ValueError(f"unshard: {len(pieces)} pieces given for a tensor split into {self.num_partitions}")
        for rank, piece in enumerate(pieces):
            if tuple(piece.shape) != self.local_shape():
                raise ValueError(f"unshard: the piece of rank {rank} has shape {list(piece.shape)}, the spec's local "
                                 f"shape is {list(self.local_shape())}")
        full = self.full_from_pieces(lambda rank: pieces[rank], pieces[0].dtype)
        return self.dense_from_full(full).contiguous()

    def at_degree(self, num_partitions: int) -> "ParamSpec":
        """This tensor's spec at TP degree ``num_partitions``: its copies and zero padding redone as a model built at
        that degree lays them out (the padding record, zero heads, repeated KV heads). Raises where the layout at
        another degree is not known: ``pad_model``'s per-rank zero rows, a padded dim without a padding record, or a
        dim the degree does not divide."""
        if isinstance(num_partitions, bool) or not isinstance(num_partitions, int) or num_partitions < 1:
            raise ValueError(f"tensor parallel degree {num_partitions!r} must be an integer >= 1")
        if not self.is_sharded:
            return dataclasses.replace(self, num_partitions=num_partitions)
        dim, stride = self.partition_dim, self.stride
        real = self.unpadded_shape[dim]
        full = list(self.full_shape)
        if self.replica_block > 1:
            # Heads (KV projections) are repeated until the new degree divides them, as the model will shard them.
            heads = real // self.replica_block
            replicas = kv_replicas(heads, num_partitions)
            full[dim] = heads * replicas * self.replica_block
            return dataclasses.replace(self, full_shape=tuple(full), num_partitions=num_partitions, replicas=replicas)
        if self.pad_groups > 1 and self.pad_block == 1:
            raise ValueError("a tensor with zero rows at the end of every rank's piece (nxdtp.pad.pad_model) depends "
                             f"on the degree it was padded for ({self.num_partitions}), so resharding it to degree "
                             f"{num_partitions} is not supported: merge the checkpoint, and pad the model again at "
                             "the new degree")
        if self.pad_block > 1:
            # Zero heads are added until the new degree divides the heads, as the model will pad them.
            full[dim] = padded_rows(real, self.pad_block, self.pad_groups, num_partitions, stride)
        elif self.pad_to_multiple_of is not None:
            if stride != 1:
                raise ValueError(f"a tensor padded to a multiple along dim {dim} has stride {stride}; padding a "
                                 "strided tensor is not supported")
            full[dim] = round_up(real, self.pad_to_multiple_of * num_partitions)
        elif real != full[dim]:
            raise ValueError(f"dim {dim} is padded from {real} to {full[dim]} without a padding record "
                             "(pad_to_multiple_of); its size at another degree is not known")
        if full[dim] % (num_partitions * stride) != 0:
            raise ValueError(f"dimension {dim} of size {full[dim]} cannot be split into {num_partitions} partitions"
                             + (f" with stride {stride}" if stride > 1 else ""))
        return dataclasses.replace(self, full_shape=tuple(full), num_partitions=num_partitions)

    def reshard(self, pieces: Sequence[torch.Tensor], num_partitions: int) -> Tuple["ParamSpec", List[torch.Tensor]]:
        """The spec at degree ``num_partitions`` and its pieces from this spec's ``pieces``: unshard, then shard."""
        new = self.at_degree(num_partitions)
        dense = self.unshard(pieces)
        full = new.full_from_dense(dense)
        return new, [new.piece_of_full(full, rank) for rank in range(num_partitions if new.is_sharded else 1)]

    def _check_dense(self, dense: torch.Tensor) -> None:
        if tuple(dense.shape) != tuple(self.unpadded_shape):
            raise ValueError(f"a dense tensor of shape {list(dense.shape)} given to a spec whose dense shape is "
                             f"{list(self.unpadded_shape)}")

    def _real_per_group(self) -> int:
        return self.unpadded_shape[self.partition_dim] // self.pad_groups

    def dense_segments(self, start: int, stop: int):
        """``(start, length, dense_start)`` runs covering rows ``[start, stop)`` of the full tensor along
        partition_dim: ``dense_start`` is where the run's rows lie in the dense tensor, or None for padding rows.
        Copies of replicated blocks are not described here (see collapse_replicas)."""
        return self._runs_past_padding(self.full_shape[self.partition_dim], start, stop)

    def _runs_past_padding(self, rows: int, start: int, stop: int):
        """``dense_segments`` over a tensor of ``rows`` rows along partition_dim, padded in ``pad_groups`` groups."""
        real = self.unpadded_shape[self.partition_dim]
        group_full, group_real = rows // self.pad_groups, real // self.pad_groups
        position = start
        while position < stop:
            group, offset = divmod(position, group_full)
            if offset < group_real:
                length = min(stop, group * group_full + group_real) - position
                yield position, length, group * group_real + offset
            else:
                length = min(stop, (group + 1) * group_full) - position
                yield position, length, None
            position += length

    def dense_runs_of_piece(self, rank: int):
        """Where TP rank ``rank``'s piece lies in the dense tensor: ``(piece_start, length, dense_start)`` runs along
        partition_dim, in piece order, so that rows ``[piece_start, piece_start + length)`` of the piece are rows
        ``[dense_start, dense_start + length)`` of ``dense_from_full(full)``. Rows that are no dense row (vocabulary or
        head padding, every copy of a repeated block but the first) are in no run, so the runs of all ranks cover each
        dense row exactly once: the chunks a chunked format (torch.distributed.checkpoint) writes without a full
        tensor. A replicated tensor is one run of rank 0 (none for other ranks)."""
        if not self.is_sharded:
            return [(0, self.unpadded_shape[0], 0)] if rank == 0 and self.unpadded_shape else []
        return _merged(self._classified_runs(rank), (_FIRST,))

    def copy_runs_of_piece(self, rank: int):
        """The rows of TP rank ``rank``'s piece that ``dense_runs_of_piece`` leaves out because they are a later copy
        of a repeated block (a repeated KV head), as ``(piece_start, length, dense_start)`` runs to the dense rows they
        copy; for a replicated tensor, the whole tensor on every rank but 0. With ``dense_runs_of_piece`` these are
        every row of the piece that holds a dense value: the rows a rank fills when it loads a dense tensor
        (padding rows hold none). A rank never holds two copies of one dense row, so no two of its runs overlap."""
        if not self.is_sharded:
            return [(0, self.unpadded_shape[0], 0)] if rank != 0 and self.unpadded_shape else []
        return _merged(self._classified_runs(rank), (_COPY,))

    def _classified_runs(self, rank: int) -> List[Tuple[int, int, Optional[int], str]]:
        """Every row of TP rank ``rank``'s piece once, in piece order, as ``(piece_start, length, dense_start, kind)``
        runs along partition_dim: ``kind`` is ``_FIRST`` (the dense rows, or the first copy of a repeated block),
        ``_COPY`` (a later copy, at the dense rows it copies) or ``_PADDING`` (``dense_start`` None). The one walk
        ``dense_runs_of_piece`` and ``copy_runs_of_piece`` select from."""
        if not 0 <= rank < self.num_partitions:
            raise ValueError(f"rank={rank} is outside the {self.num_partitions} partitions of this spec")
        dim, parts, stride = self.partition_dim, self.num_partitions, self.stride
        block = self.full_shape[dim] // (parts * stride)
        runs = []
        for chunk in range(stride):
            first = (chunk * parts + rank) * block
            for start, length, dense_start, kind in self._classified_runs_of_full(first, first + block):
                runs.append((chunk * block + start - first, length, dense_start, kind))
        return runs

    def _classified_runs_of_full(self, start: int, stop: int):
        """``_classified_runs`` for rows ``[start, stop)`` of the full tensor, as ``(full_start, length, dense_start,
        kind)``: each copy of a repeated block at the rows of the replica-free tensor it holds, then past its
        padding."""
        if self.replicas == 1:  # no copies: one pass over the padding, not one step per block
            for run_start, length, dense_start in self._padding_runs(start, stop):
                yield run_start, length, dense_start, _PADDING if dense_start is None else _FIRST
            return
        copy = self.replica_block * self.replicas
        position = start
        while position < stop:
            head, offset = divmod(position, copy)
            which, inside = divmod(offset, self.replica_block)
            end = min(stop, head * copy + (which + 1) * self.replica_block)
            collapsed = head * self.replica_block + inside
            for run_start, length, dense_start in self._padding_runs(collapsed, collapsed + end - position):
                kind = _PADDING if dense_start is None else _COPY if which > 0 else _FIRST
                yield position + run_start - collapsed, length, dense_start, kind
            position = end

    def _padding_runs(self, start: int, stop: int):
        """``dense_segments`` over the rows of the replica-free tensor (``full_shape[dim] / replicas`` rows)."""
        return self._runs_past_padding(self.full_shape[self.partition_dim] // self.replicas, start, stop)

    def local_shape(self) -> Tuple[int, ...]:
        """The shape a rank holds: its TP piece, and of that its expert-parallel rank's experts."""
        shape = list(self.full_shape)
        if self.is_sharded:
            shape[self.partition_dim] //= self.num_partitions
        if self.expert_partitions > 1:
            shape[0] //= self.expert_partitions
        return tuple(shape)

    def experts_of_rank(self, piece: torch.Tensor, expert_rank: int) -> torch.Tensor:
        """Expert-parallel rank ``expert_rank``'s experts (a view) of a TP piece that holds every expert."""
        if not 0 <= expert_rank < self.expert_partitions:
            raise ValueError(f"expert_rank={expert_rank} is outside the {self.expert_partitions} expert partitions; "
                             f"use 0 to {self.expert_partitions - 1}")
        local = self.full_shape[0] // self.expert_partitions
        return piece.narrow(0, expert_rank * local, local)

    def expert_runs(self, start: int, length: int) -> List[Tuple[int, int, int]]:
        """Rows ``start .. start + length - 1`` (dim 0) of a TP piece that holds every expert, as runs
        ``(expert-parallel rank, its first row, rows)`` over the expert-parallel ranks' pieces (``experts_of_rank``)."""
        local, stop, runs = self.full_shape[0] // self.expert_partitions, start + length, []
        for expert_rank in range(self.expert_partitions):
            first, last = max(start, expert_rank * local), min(stop, (expert_rank + 1) * local)
            if first < last:
                runs.append((expert_rank, first - expert_rank * local, last - first))
        return runs

    def local_of_full(self, full: torch.Tensor, rank: int, expert_rank: int) -> torch.Tensor:
        """What the rank at TP rank ``rank`` and expert-parallel rank ``expert_rank`` holds of the full tensor: its TP
        piece, and of that its experts."""
        piece = self.piece_of_full(full, rank)
        return self.experts_of_rank(piece, expert_rank).clone() if self.expert_partitions > 1 else piece

    def with_all_experts(self) -> "ParamSpec":
        """The spec of a TP piece that holds every expert: what checkpoint files store."""
        return dataclasses.replace(self, expert_partitions=1)

    def __post_init__(self) -> None:
        if self.expert_partitions < 1 or (self.full_shape and self.full_shape[0] % self.expert_partitions):
            raise ValueError(f"expert_partitions={self.expert_partitions} does not divide the {self.full_shape[0]} "
                             "experts of dim 0" if self.full_shape else
                             f"expert_partitions={self.expert_partitions} given for a 0-dim tensor")

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["full_shape"] = list(self.full_shape)
        d["real_shape"] = list(self.unpadded_shape)
        del d["grad_allreduced_in_backward"]
        # Written only where they say something, so specs without repeated blocks read as before.
        for name in ("replicas", "replica_block", "pad_block", "pad_groups"):
            if d[name] == 1:
                del d[name]
        if d["pad_to_multiple_of"] is None:
            del d["pad_to_multiple_of"]
        if not d["vocabulary"]:
            del d["vocabulary"]
        if d["expert_partitions"] == 1:
            del d["expert_partitions"]
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "ParamSpec":
        return cls(full_shape=tuple(d["full_shape"]), partition_dim=d["partition_dim"], stride=d["stride"],
                   num_partitions=d["num_partitions"], real_shape=tuple(d["real_shape"]),
                   sequence_parallel=d["sequence_parallel"], replicas=d.get("replicas", 1),
                   replica_block=d.get("replica_block", 1), pad_block=d.get("pad_block", 1),
                   pad_groups=d.get("pad_groups", 1), pad_to_multiple_of=d.get("pad_to_multiple_of"),
                   vocabulary=bool(d.get("vocabulary", False)), expert_partitions=d.get("expert_partitions", 1))


# The kinds of rows of a TP piece (ParamSpec._classified_runs).
_FIRST, _COPY, _PADDING = "first", "copy", "padding"


def _merged(runs, kinds) -> List[Tuple[int, int, Optional[int]]]:
    """The ``(piece_start, length, dense_start)`` runs of ``runs`` whose kind is in ``kinds``, adjacent ones merged
    where both the piece rows and the dense rows continue."""
    merged: List[Tuple[int, int, Optional[int]]] = []
    for piece_start, length, dense_start, kind in runs:
        if kind not in kinds:
            continue
        last = merged[-1] if merged else None
        if last is not None and last[0] + last[1] == piece_start and last[2] + last[1] == dense_start:
            merged[-1] = (last[0], last[1] + length, last[2])
        else:
            merged.append((piece_start, length, dense_start))
    return merged


@dataclasses.dataclass(frozen=True)
class FlatShardLayout:
    """How one (TP-local) tensor is cut over a ZeRO-1 sharding group: flattened, zero-padded at its end to a multiple
    of the group size, and cut into ``group_size`` equal contiguous chunks; group rank ``r`` holds chunk ``r``.

    The padding is at most ``group_size - 1`` elements per tensor, whatever the tensor's shape (a dim-0 cut pads a
    ``(1, hidden)`` tensor to ``(group_size, hidden)``). The padded tensor seen as ``rows`` (``group_size`` rows of
    ``shard_numel``) is what the collectives move: row ``r`` is rank ``r``'s shard, so a reduce-scatter / all-gather
    along dim 0 of several tensors' rows concatenated along dim 1 moves them all at once, and every rank slices the
    result at the same (rank-independent) offsets.
    """

    shape: Tuple[int, ...]
    group_size: int

    def __post_init__(self):
        if self.group_size < 1:
            raise ValueError(f"FlatShardLayout: group_size={self.group_size} must be >= 1")

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def shard_numel(self) -> int:
        return max(1, round_up(self.numel, self.group_size) // self.group_size)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.group_size

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (of ``shape``) as the ``[group_size, shard_numel]`` rows of its padded flat form."""
        if tuple(tensor.shape) != tuple(self.shape):
            raise ValueError(f"FlatShardLayout: tensor of shape {tuple(tensor.shape)} does not have the layout's shape "
                             f"{tuple(self.shape)}")
        flat = tensor.reshape(-1)
        if self.padding:
            flat = torch.cat([flat, flat.new_zeros(self.padding)])
        return flat.reshape(self.group_size, self.shard_numel)

    def full_from_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The tensor (of ``shape``) from its ``[group_size, shard_numel]`` rows: the padding dropped."""
        if tuple(rows.shape) != (self.group_size, self.shard_numel):
            raise ValueError(f"FlatShardLayout: rows of shape {tuple(rows.shape)}, expected "
                             f"{(self.group_size, self.shard_numel)}")
        return rows.reshape(-1)[:self.numel].reshape(self.shape)

    def full_from_shards(self, shards) -> torch.Tensor:
        """The tensor from every rank's shard, in group-rank order (host side: checkpoints, tests)."""
        return self.full_from_rows(torch.stack([s.reshape(-1) for s in shards]))

    def shard_of(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """Group rank ``rank``'s shard (a 1-D tensor of ``shard_numel``) of ``tensor`` (host side: checkpoints,
        tests; traced code selects with a rank tensor instead, so every rank traces one graph)."""
        if not 0 <= rank < self.group_size:
            raise ValueError(f"FlatShardLayout: rank={rank} is outside a sharding group of size {self.group_size}")
        return self.rows(tensor)[rank].clone()

    def shard_from(self, source: "FlatShardLayout", read_shard: Callable[[int], torch.Tensor], rank: int,
                   dtype: torch.dtype) -> torch.Tensor:
        """Group rank ``rank``'s shard of this layout from the shards of the same tensor cut by ``source`` (another
        group size): ``read_shard(k)`` gives ``source``'s shard ``k`` and is called only for the shards that overlap
        this one (``source_ranks``), in order. The padding is zeros. Host side: checkpoints."""
        if tuple(source.shape) != tuple(self.shape):
            raise ValueError(f"FlatShardLayout: cannot re-cut a tensor of shape {tuple(source.shape)} into the layout "
                             f"of shape {tuple(self.shape)}")
        if not 0 <= rank < self.group_size:
            raise ValueError(f"FlatShardLayout: rank={rank} is outside a sharding group of size {self.group_size}")
        start = rank * self.shard_numel
        stop = min(start + self.shard_numel, self.numel)
        pieces = []
        for k in self.source_ranks(source, rank):
            shard = read_shard(k).reshape(-1)
            if shard.numel() != source.shard_numel:
                raise ValueError(f"FlatShardLayout: shard {k} has {shard.numel()} elements, the layout of shape "
                                 f"{tuple(self.shape)} over {source.group_size} ranks has {source.shard_numel}")
            lo, hi = max(start, k * source.shard_numel), min(stop, (k + 1) * source.shard_numel)
            pieces.append(shard[lo - k * source.shard_numel:hi - k * source.shard_numel].to(dtype))
        real = max(0, stop - start)
        out = torch.zeros(self.shard_numel, dtype=dtype)
        if real:
            out[:real] = torch.cat(pieces)
        return out

    def boxes_of_shard(self, rank: int):
        """Where group rank ``rank``'s shard lies in the tensor: ``(shard_start, offsets, sizes)`` boxes of ``shape``,
        in shard order, covering its real elements (the padding is in none): box elements in row-major order are
        ``shard[shard_start:shard_start + numel(sizes)]``. A flat range is a partial row, whole rows, a partial row
        (recursively over the dims), so a shard is at most ``2 * ndim - 1`` boxes."""
        if not 0 <= rank < self.group_size:
            raise ValueError(f"FlatShardLayout: rank={rank} is outside a sharding group of size {self.group_size}")
        start = rank * self.shard_numel
        stop = min(start + self.shard_numel, self.numel)
        boxes = []
        position = start
        for offsets, sizes in _flat_range_boxes(tuple(self.shape), start, stop):
            boxes.append((position - start, offsets, sizes))
            numel = 1
            for size in sizes:
                numel *= size
            position += numel
        return boxes

    def source_ranks(self, source: "FlatShardLayout", rank: int) -> range:
        """The ranks of ``source`` whose shards hold real elements of this layout's shard ``rank``."""
        start = rank * self.shard_numel
        stop = min(start + self.shard_numel, self.numel)
        if stop <= start:
            return range(0)
        return range(start // source.shard_numel, -(-stop // source.shard_numel))

    def to_dict(self) -> Dict[str, Any]:
        return {"layout": "flat", "shape": list(self.shape), "group_size": self.group_size}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "FlatShardLayout":
        if d.get("layout") != "flat":
            raise ValueError(f"unknown ZeRO-1 shard layout {d.get('layout')!r}; this nxdtp knows 'flat'")
        return cls(shape=tuple(d["shape"]), group_size=int(d["group_size"]))


def _flat_range_boxes(shape: Tuple[int, ...], start: int, stop: int):
    """Boxes ``(offsets, sizes)`` of a tensor of ``shape`` covering its row-major elements ``[start, stop)`` in order,
    each contiguous in that order."""
    if start >= stop:
        return
    if not shape:
        yield (), ()
        return
    inner = 1
    for size in shape[1:]:
        inner *= size
    first, first_rest = divmod(start, inner)
    last, last_rest = divmod(stop, inner)
    if first == last:  # inside one row
        for offsets, sizes in _flat_range_boxes(shape[1:], first_rest, last_rest):
            yield (first,) + offsets, (1,) + sizes
        return
    if first_rest:
        for offsets, sizes in _flat_range_boxes(shape[1:], first_rest, inner):
            yield (first,) + offsets, (1,) + sizes
        first += 1
    if last > first:
        yield (first,) + (0,) * (len(shape) - 1), (last - first,) + tuple(shape[1:])
    if last_rest:
        for offsets, sizes in _flat_range_boxes(shape[1:], 0, last_rest):
            yield (last,) + offsets, (1,) + sizes


def dense_chunks_of_flat_shard(spec: ParamSpec, layout: FlatShardLayout, tp_rank: int, shard_rank: int,
                               copies: bool = False):
    """Where ZeRO-1 shard ``shard_rank`` (``layout``, over the TP-local piece) of TP rank ``tp_rank``'s piece of
    ``spec`` lies in the dense tensor: ``(shard_start, box_sizes, (dim, start, length), dense_offsets, dense_sizes)``
    per chunk, where the chunk is ``shard[shard_start:][:numel(box_sizes)].view(box_sizes).narrow(dim, start,
    length)`` (narrow None: the whole box). The rows are those of ``dense_runs_of_piece`` (with ``copies``:
    ``copy_runs_of_piece``), so over every TP and shard rank the chunks without copies cover each dense element once."""
    runs = spec.copy_runs_of_piece(tp_rank) if copies else spec.dense_runs_of_piece(tp_rank)
    if spec.is_sharded and tuple(layout.shape) != tuple(spec.local_shape()):
        raise ValueError(f"a ZeRO-1 layout of shape {list(layout.shape)} is not over a piece of this spec (local shape "
                         f"{list(spec.local_shape())})")
    chunks = []
    for shard_start, offsets, sizes in layout.boxes_of_shard(shard_rank):
        if not spec.is_sharded:  # the same on every TP rank: TP rank 0's is the kept one
            if (tp_rank == 0) != copies:
                chunks.append((shard_start, sizes, None, offsets, sizes))
            continue
        dim = spec.partition_dim
        for piece_start, length, dense_start in runs:
            lo, hi = max(offsets[dim], piece_start), min(offsets[dim] + sizes[dim], piece_start + length)
            if lo >= hi:
                continue
            dense_offsets, dense_sizes = list(offsets), list(sizes)
            dense_offsets[dim], dense_sizes[dim] = dense_start + lo - piece_start, hi - lo
            chunks.append((shard_start, sizes, (dim, lo - offsets[dim], hi - lo), tuple(dense_offsets),
                           tuple(dense_sizes)))
    return chunks


def _leading_block(tensor: torch.Tensor, shape) -> torch.Tensor:
    """The leading ``shape`` block of ``tensor`` (a view): the tensor without padding at the end of its dims."""
    for dim, size in enumerate(shape):
        if tensor.shape[dim] != size:
            tensor = tensor.narrow(dim, 0, size)
    return tensor


def attach_spec_attributes(param: torch.Tensor, spec: ParamSpec) -> None:
    """Write the NxD attribute cache of ``spec`` onto a parameter."""
    param.tensor_model_parallel = spec.is_sharded
    param.partition_dim = spec.partition_dim if spec.is_sharded else -1
    param.partition_stride = spec.stride
    param.num_partitions = spec.num_partitions
    param.sequence_parallel_enabled = spec.sequence_parallel
    param.num_replicas = spec.replicas
    param.grad_allreduced_in_backward = spec.grad_allreduced_in_backward


def _saved_layout(spec: ParamSpec):
    """What a state dict's spec must share with the module's to load: a replicated tensor is the same at every TP
    degree; only a sharded one depends on the partition count."""
    return (spec.partition_dim, spec.full_shape, spec.stride, spec.num_partitions if spec.is_sharded else None,
            spec.expert_partitions)


class ShardedModule(nn.Module):
    """Mixin for modules whose parameters carry a ParamSpec.

    The specs travel with ``state_dict()`` as the module's extra state (key ``<prefix>_extra_state``), so a checkpoint
    saved from a plain state dict still records how every tensor was split; loading a state dict made at another TP
    degree fails with a message naming both, instead of copying mismatched slices.
    """

    def register_param_spec(self, name: str, spec: ParamSpec) -> None:
        if "_nxdtp_specs" not in self.__dict__:
            self._nxdtp_specs: Dict[str, ParamSpec] = {}
        param = getattr(self, name)
        if tuple(param.shape) != spec.local_shape():
            raise ValueError(f"{type(self).__name__}.{name} has shape {tuple(param.shape)} but its spec "
                             f"expects the local shape {spec.local_shape()}")
        self._nxdtp_specs[name] = spec
        attach_spec_attributes(param, spec)

    def param_specs(self) -> Dict[str, ParamSpec]:
        return dict(self.__dict__.get("_nxdtp_specs", {}))

    def fused_parameters(self) -> Dict[str, Tuple[Tuple[str, int], ...]]:
        """The parameters this module trains as row blocks of tensors its state dict holds under their own keys and
        specs: {parameter name: ((part name, rows), ...)}, the parts in order along dim 0 (GQAQKVColumnParallelLinear's
        ``weight_qkv``: Q's rows, then K's, then V's). Their optimizer state is saved as the parts' (split along dim 0)
        so that it merges and reshards as they do. Empty for a module whose parameters have specs of their own."""
        return {}

    def reattach_spec_attributes(self) -> None:
        for name, spec in self.param_specs().items():
            param = getattr(self, name, None)
            if param is not None:
                attach_spec_attributes(param, spec)

    def __setstate__(self, state) -> None:
        # copy.deepcopy and unpickling end here with new Parameter objects; torch's Parameter.__deepcopy__ keeps only
        # the data, so without this a copied model's sharded parameters would read as replicated (clip_grad_norm
        # would count them on TP rank 0 only).
        super().__setstate__(state)
        self.reattach_spec_attributes()

    def get_extra_state(self) -> Dict[str, Any]:
        return {"nxdtp_spec_version": SPEC_FORMAT_VERSION,
                "params": {name: spec.to_dict() for name, spec in self.param_specs().items()}}

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # Check the saved spec before torch copies any parameter: a refused load must leave the weights untouched.
        # A state dict without the spec (NxD's per-rank checkpoints, hand-made dicts) loads on shapes alone.
        spec_key = prefix + "_extra_state"
        if spec_key in state_dict:
            self.set_extra_state(state_dict[spec_key])
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if spec_key in missing_keys:
            missing_keys.remove(spec_key)

    def set_extra_state(self, state: Any) -> None:
        if not isinstance(state, dict) or "params" not in state:
            raise ValueError(f"{type(self).__name__}: extra state {state!r} is not an nxdtp sharding spec")
        ours = self.param_specs()
        for name, theirs in state["params"].items():
            theirs = ParamSpec.from_dict(theirs)
            mine = ours.get(name)
            if mine is None:
                raise ValueError(f"{type(self).__name__}: the state dict has a spec for '{name}', which this module "
                                 "lacks")
            if mine.expert_partitions != theirs.expert_partitions:
                raise ValueError(
                    f"{type(self).__name__}.{name}: the state dict holds the experts of one of "
                    f"{theirs.expert_partitions} expert-parallel ranks, but this module holds those of one of "
                    f"{mine.expert_partitions}: a state dict loads at the expert-parallel size it was taken at "
                    "(nxdtp checkpoints, which store every expert, load at any)")
            if _saved_layout(mine) != _saved_layout(theirs):
                raise ValueError(
                    f"{type(self).__name__}.{name}: the state dict was saved with "
                    f"partition_dim={theirs.partition_dim}, {theirs.num_partitions} partitions, "
                    f"stride {theirs.stride}, full shape {list(theirs.full_shape)}, "
                    f"but this module has partition_dim={mine.partition_dim}, {mine.num_partitions} partitions, stride "
                    f"{mine.stride}, full shape {list(mine.full_shape)}. Reshard the checkpoint to tensor parallel "
                    f"size {mine.num_partitions} first."
                )

"""Property tests of the layout algebra (nxdtp.spec.ParamSpec): random shapes, strides, paddings, replicas and TP
degrees. Every spec is drawn at degree 1 (the dense tensor's own layout plus its padding rule) and taken to a degree
with ``at_degree``, as a layer built at that degree lays it out; the references are plain torch on the dense tensor."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nxdtp.checkpointing.pipeline import TagSource, dense_slabs
from nxdtp.checkpointing.slabs import piece_parts, read_piece, read_ranges
from nxdtp.heads import kv_replicas
from nxdtp.rounding import round_up
from nxdtp.spec import ParamSpec, split_along

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def layouts(draw):
    """A spec at degree 1 with one kind of layout: plain (strided), padded to a multiple, zero heads (grouped or
    fused), or repeated KV heads; and a dense tensor of its shape."""
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(0, ndim - 1))
    other = [draw(st.integers(1, 3)) for _ in range(ndim)]
    kind = draw(st.sampled_from(["plain", "multiple", "heads", "fused_heads", "replicas"]))
    fields = {}
    stride = 1
    if kind == "plain":
        stride = draw(st.integers(1, 3))
        rows = stride * draw(st.integers(1, 4)) * 12  # 12: every degree drawn below divides it
    elif kind == "multiple":
        rows = draw(st.integers(1, 13))
        fields = dict(pad_to_multiple_of=draw(st.integers(1, 3)), vocabulary=draw(st.booleans()))
    elif kind == "heads":
        head_dim, groups = draw(st.integers(2, 3)), draw(st.integers(1, 3))  # a head of 1 row reads as no heads
        # Groups are the query heads of grouped KV heads, so a group of one head is no grouping (heads == KV heads).
        rows = groups * draw(st.integers(2 if groups > 1 else 1, 3)) * head_dim
        fields = dict(pad_block=head_dim, pad_groups=groups)
    elif kind == "fused_heads":
        stride, head_dim = draw(st.integers(2, 3)), draw(st.integers(2, 3))
        rows = stride * draw(st.integers(1, 3)) * head_dim
        fields = dict(pad_block=head_dim, pad_groups=stride)
    else:
        block = draw(st.integers(2, 3))  # a block of 1 row reads as not repeated
        rows = draw(st.integers(1, 4)) * block
        fields = dict(replica_block=block)
    shape = list(other)
    shape[dim] = rows
    spec = ParamSpec(full_shape=tuple(shape), partition_dim=dim, stride=stride, num_partitions=1,
                     real_shape=tuple(shape), **fields)
    dense = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
    return kind, spec, dense


degrees = st.integers(1, 4)


def _reference_full(kind: str, spec: ParamSpec, dense: torch.Tensor) -> torch.Tensor:
    """The full tensor at ``spec``'s degree written out from the layout rules with plain torch."""
    dim, tp = spec.partition_dim, spec.num_partitions
    rows = dense.shape[dim]

    def zeros(n):
        shape = list(dense.shape)
        shape[dim] = n
        return torch.zeros(shape, dtype=dense.dtype)

    if kind == "plain":
        return dense
    if kind == "multiple":
        return torch.cat([dense, zeros(round_up(rows, spec.pad_to_multiple_of * tp) - rows)], dim)
    if kind == "replicas":
        blocks = dense.split(spec.replica_block, dim)
        copies = kv_replicas(len(blocks), tp)
        return torch.cat([b for b in blocks for _ in range(copies)], dim)
    groups = dense.chunk(spec.pad_groups, dim)
    per_group = spec.full_shape[dim] // spec.pad_groups
    return torch.cat([torch.cat([g, zeros(per_group - g.shape[dim])], dim) for g in groups], dim)


def _reference_piece(full: torch.Tensor, dim: int, rank: int, tp: int, stride: int) -> torch.Tensor:
    blocks = full.chunk(tp * stride, dim)
    return torch.cat([blocks[chunk * tp + rank] for chunk in range(stride)], dim)


@SETTINGS
@given(layouts(), degrees)
def test_shard_places_each_rank_piece_as_the_layout_rules_say_and_unshard_inverts_it(layout, tp):
    kind, base, dense = layout
    spec = base.at_degree(tp)
    full = _reference_full(kind, spec, dense)
    assert tuple(full.shape) == spec.full_shape
    pieces = [spec.shard(dense, rank) for rank in range(tp)]
    for rank, piece in enumerate(pieces):
        assert tuple(piece.shape) == spec.local_shape()
        assert torch.equal(piece, _reference_piece(full, spec.partition_dim, rank, tp, spec.stride)), rank
    assert torch.equal(spec.unshard(pieces), dense)


@SETTINGS
@given(layouts(), degrees, degrees)
def test_reshard_equals_unshard_then_shard_at_the_new_degree(layout, tp, new_tp):
    _, base, dense = layout
    spec = base.at_degree(tp)
    new_spec, pieces = spec.reshard([spec.shard(dense, rank) for rank in range(tp)], new_tp)
    assert new_spec == base.at_degree(new_tp)  # the layout at a degree does not depend on the degree it came from
    assert [tuple(p.shape) for p in pieces] == [new_spec.local_shape()] * new_tp
    for rank, piece in enumerate(pieces):
        assert torch.equal(piece, new_spec.shard(dense, rank)), rank
    assert torch.equal(new_spec.unshard(pieces), dense)


@SETTINGS
@given(layouts(), degrees)
def test_read_ranges_build_the_shard_from_dense_reads(layout, tp):
    _, base, dense = layout
    spec = base.at_degree(tp)
    dim = spec.partition_dim
    for rank in range(tp):
        runs = read_ranges(spec, rank)
        assert sum(length for _, length, _ in runs) == spec.local_shape()[dim]
        assert [start for start, _, _ in runs] == [sum(r[1] for r in runs[:i]) for i in range(len(runs))]
        reads = []
        piece = read_piece(spec, lambda a, b: reads.append((a, b)) or dense.narrow(dim, a, b - a), rank)
        assert torch.equal(piece, spec.shard(dense, rank)), rank
        assert len(reads) == sum(1 for _, _, d in runs if d is not None)  # one read per run: chunked, not per row


@SETTINGS
@given(layouts(), degrees, st.integers(1, 5), st.booleans())
def test_piece_parts_build_the_shard_from_box_reads_in_slabs(layout, tp, rows_per_part, replicated):
    """Each rank's piece in slabs of at most ``rows_per_part`` rows along dim 0, each from one call of box reads of the
    dense tensor, concatenate to ``shard``; no read reaches outside the slab's rows (so no slab holds more)."""
    _, base, dense = layout
    spec = base.at_degree(tp)
    if replicated:
        spec = ParamSpec(full_shape=tuple(dense.shape), num_partitions=tp)
    calls = []

    def read_boxes(boxes):
        calls.append(boxes)
        out = []
        for offsets, sizes in boxes:
            box = dense
            for d, (o, n) in enumerate(zip(offsets, sizes)):
                box = box.narrow(d, o, n)
            out.append(box.clone())
        return out

    for rank in range(tp):
        calls.clear()
        parts = list(piece_parts(spec, rank, read_boxes, rows_per_part, torch.float32))
        assert len(parts) == len(calls) == -(-spec.local_shape()[0] // rows_per_part), rank
        assert all(p.shape[0] <= rows_per_part and p.dtype == torch.float32 for p in parts)
        assert torch.equal(torch.cat(parts), spec.shard(dense, rank).float()), rank
        for boxes, part in zip(calls, parts):
            assert sum(torch.Size(sizes).numel() for _, sizes in boxes) <= part.numel()


@SETTINGS
@given(layouts(), degrees, st.integers(1, 5), st.booleans())
def test_dense_slabs_rebuild_the_dense_tensor_from_piece_rows_in_slabs(layout, tp, rows_per_part, replicated):
    """The dense tensor in slabs of at most ``rows_per_part`` rows, each from reads of rows of the pieces
    (``TagSource``), equals ``unshard``; a slab reads only the piece rows it needs (rows of its own range along dim 0
    when the split is along another dim)."""
    _, base, dense = layout
    spec = base.at_degree(tp)
    if replicated:
        spec = ParamSpec(full_shape=tuple(dense.shape), num_partitions=tp)
    pieces = [spec.shard(dense, rank) for rank in range(tp if spec.is_sharded else 1)]
    reads = []

    class Piece:
        def __init__(self, rank):
            self.rank = rank

        def get_rows(self, key, start, length):
            reads.append((self.rank, start, start + length))
            return pieces[self.rank][start:start + length].clone()

    names = [str(rank) for rank in range(len(pieces))]
    source = TagSource({name: Piece(rank) for rank, name in enumerate(names)}, {"t": (spec, torch.float32, names)})
    parts = list(dense_slabs(lambda boxes: source.read_boxes("t", boxes), tuple(dense.shape), rows_per_part))
    assert len(parts) == -(-dense.shape[0] // rows_per_part)
    assert all(p.shape[0] <= rows_per_part and p.dtype == torch.float32 for p in parts)
    assert torch.equal(torch.cat(parts), dense.float())
    assert all(stop - start <= rows_per_part for _, start, stop in reads)


def test_piece_parts_of_a_0_dim_tensor_is_one_read():
    spec = ParamSpec(full_shape=(), num_partitions=2)
    parts = list(piece_parts(spec, 1, lambda boxes: [torch.tensor(3.0, dtype=torch.float64)] * len(boxes), 4,
                             torch.float32))
    assert len(parts) == 1 and parts[0].dtype == torch.float32 and parts[0].item() == 3.0


@SETTINGS
@given(layouts(), degrees)
def test_dense_runs_of_all_ranks_cover_every_dense_row_once(layout, tp):
    _, base, dense = layout
    spec = base.at_degree(tp)
    covered = []
    for rank in range(tp):
        for _, length, dense_start in spec.dense_runs_of_piece(rank):
            covered.extend(range(dense_start, dense_start + length))
    assert sorted(covered) == list(range(dense.shape[spec.partition_dim]))


@SETTINGS
@given(layouts(), degrees)
def test_kept_and_copy_runs_are_the_rows_read_ranges_fills_from_dense(layout, tp):
    _, base, dense = layout
    spec = base.at_degree(tp)

    def rows(runs):   # piece row -> dense row, for every row the runs name
        return {start + i: dense_start + i for start, length, dense_start in runs if dense_start is not None
                for i in range(length)}

    for rank in range(tp):
        kept, copies = rows(spec.dense_runs_of_piece(rank)), rows(spec.copy_runs_of_piece(rank))
        assert not kept.keys() & copies.keys(), rank
        assert {**kept, **copies} == rows(read_ranges(spec, rank)), rank


@SETTINGS
@given(layouts())
def test_the_padding_record_survives_the_index_round_trip(layout):
    _, base, _ = layout
    spec = base.at_degree(3)
    assert ParamSpec.from_dict(spec.to_dict()) == spec


def test_a_spec_without_a_padding_record_keeps_its_old_index_form():
    spec = ParamSpec(full_shape=(8, 4), partition_dim=0, num_partitions=2, real_shape=(8, 4))
    assert "pad_to_multiple_of" not in spec.to_dict() and "vocabulary" not in spec.to_dict()
    old = {"full_shape": [8, 4], "partition_dim": 0, "stride": 1, "num_partitions": 2, "real_shape": [7, 4],
           "sequence_parallel": False}
    assert ParamSpec.from_dict(old).pad_to_multiple_of is None


def test_layouts_that_no_other_degree_has_are_refused_with_the_values():
    import pytest

    unrecorded = ParamSpec(full_shape=(8, 4), partition_dim=0, num_partitions=2, real_shape=(7, 4))
    with pytest.raises(ValueError, match="padded from 7 to 8 without a padding record"):
        unrecorded.at_degree(4)
    indivisible = ParamSpec(full_shape=(6, 4), partition_dim=0, num_partitions=2)
    with pytest.raises(ValueError, match="dimension 0 of size 6 cannot be split into 4 partitions"):
        indivisible.at_degree(4)
    per_rank = ParamSpec(full_shape=(8, 4), partition_dim=0, num_partitions=2, real_shape=(6, 4), pad_groups=2)
    with pytest.raises(ValueError, match="pad_model"):
        per_rank.at_degree(4)
    with pytest.raises(ValueError, match="piece of rank 1 has shape"):
        unrecorded.unshard([torch.zeros(4, 4), torch.zeros(3, 4)])


@SETTINGS
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), st.integers(0, 2))
def test_rank_order_is_the_pieces_in_rank_order_and_back(tp, stride, block, dim):
    from nxdtp.spec import from_rank_order, split_along, to_rank_order

    shape = [2, 3, 2]
    shape[dim] = tp * stride * block
    full = torch.randn(shape, dtype=torch.float64)
    pieces = torch.cat([split_along(full, dim, rank, tp, stride) for rank in range(tp)], dim)
    assert torch.equal(to_rank_order(full, dim, tp, stride), pieces)
    assert torch.equal(from_rank_order(pieces, dim, tp, stride), full)


@SETTINGS
@given(experts=st.sampled_from([1, 2, 4, 8]), ep=st.sampled_from([1, 2, 4]), tp=st.sampled_from([1, 2]),
       stride=st.integers(1, 2), dim=st.integers(1, 2))
def test_experts_split_over_ranks_are_consecutive_blocks_of_every_tp_piece(experts, ep, tp, stride, dim):
    if experts % ep:
        with pytest.raises(ValueError, match=f"expert_partitions={ep} does not divide the {experts} experts"):
            ParamSpec(full_shape=(experts, 4, 4), partition_dim=dim, expert_partitions=ep)
        return
    spec = ParamSpec(full_shape=(experts, 4, 4), partition_dim=dim, stride=stride, num_partitions=tp,
                     real_shape=(experts, 4, 4), expert_partitions=ep)
    dense = torch.randn(experts, 4, 4)
    for tp_rank in range(tp):
        piece = spec.piece_of_full(dense, tp_rank)
        assert tuple(piece.shape) == spec.with_all_experts().local_shape()
        for expert_rank in range(ep):
            # The reference: this rank's experts of the dense tensor first, then its TP piece.
            mine = dense[expert_rank * experts // ep:(expert_rank + 1) * experts // ep]
            expected = split_along(mine, dim, tp_rank, tp, stride)
            assert torch.equal(spec.experts_of_rank(piece, expert_rank), expected)
            assert torch.equal(spec.local_of_full(dense, tp_rank, expert_rank), expected)
            assert tuple(expected.shape) == spec.local_shape()
    assert ParamSpec.from_dict(spec.to_dict()) == spec
    assert ("expert_partitions" in spec.to_dict()) == (ep > 1)

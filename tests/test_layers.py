"""Parallel layers against dense torch: construction, forward, and every gradient, on real gloo ranks.

Multi-rank cases (``case_*``) run on every rank of a shared gloo pool at tp=2 (world 2), tp=4 (world 4) and tp=2 x dp=2
(world 4). Each builds the dense torch module, randomises all of its parameters (biases and LayerNorm included: fresh
modules have zero biases that would hide bias bugs), loads the matching slices into the parallel layer and compares the
forward output, the input gradient and every parameter gradient with a random upstream gradient. TP ranks of one group
draw the same inputs; DP ranks draw different ones (seeded by their DP rank) and must still match dense on their own
data.

Expected shards are cut by ``_slice`` below, written independently of ``nxdtp.layers.shard_of`` (which only loads the
randomised weights), so a wrong ``shard_of`` shows up as a forward mismatch.

Single-process tests cover specs, state dicts, device moves, meta construction and argument checking under
``simulated_topology``. Tolerance: fp32 1e-5 absolute and relative everywhere (sizes are small; sums have <= 32 terms).
"""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nxdtp import parallel_state as ps
from nxdtp.layers import (
    ColumnParallelLinear,
    LayerNorm,
    LinearWithAsyncCommunication,
    ParallelEmbedding,
    RowParallelLinear,
    SPMDRank,
    create_local_weight,
    shard_of,
)
from nxdtp.spec import ShardedModule
from nxdtp.utils import move_model_to_device

TOL = dict(atol=1e-5, rtol=1e-5)

# (world size, tensor_model_parallel_size): tp=2, tp=4, tp=2 x dp=2.
WORLDS = [pytest.param(2, 2, id="tp2"), pytest.param(4, 4, id="tp4"), pytest.param(4, 2, id="tp2xdp2")]


# ---- helpers (run inside the workers as well) ------------------------------------------------------------------------

def _tp():
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_size()


def _slice(full: torch.Tensor, dim: int, rank: int, tp: int, stride: int = 1) -> torch.Tensor:
    """Reference shard: cut ``dim`` into ``stride`` blocks (Q, K, V for stride 3), take the rank's 1/tp of each
    block."""
    blocks = full.chunk(stride, dim=dim) if stride > 1 else (full,)
    return torch.cat([block.chunk(tp, dim=dim)[rank] for block in blocks], dim=dim)


def _close(actual, expected, what: str) -> None:
    assert actual is not None, f"{what}: got None (no gradient?)"
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


def _equal(actual, expected, what: str) -> None:
    assert actual.shape == expected.shape and torch.equal(actual, expected), (
        f"{what}: not bit-identical\nactual={actual}\nexpected={expected}")


def _data_seed(seed: int) -> int:
    """Inputs and upstream gradients: the same on the ranks of a TP group, different across DP ranks."""
    return seed + 1000 * ps.get_data_parallel_rank()


def _randn(shape, seed: int) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed))


def _randomise_(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _load_(param: torch.Tensor, full: torch.Tensor, dim, stride: int = 1) -> None:
    """Put this rank's slice of ``full`` (a dense parameter) into ``param``; ``dim=None`` copies it whole."""
    rank, tp = _tp()
    with torch.no_grad():
        param.copy_(full if dim is None else shard_of(full.detach(), dim, rank, tp, stride))


def _tp_sum(t: torch.Tensor) -> torch.Tensor:
    out = t.detach().clone()
    dist.all_reduce(out, group=ps.tensor_parallel_group().process_group_for(out.device.type))
    return out


def _tp_gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(ps.get_tensor_model_parallel_size())]
    dist.all_gather(parts, t.detach().contiguous(), group=ps.tensor_parallel_group().process_group_for(t.device.type))
    return torch.cat(parts, dim=dim)


def _identity():
    """What the parent checks: this rank's (TP rank, DP rank)."""
    return ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()


def _check_identities(results, world, tp):
    assert [r[0] for r in results] == [(rank % tp, rank // tp) for rank in range(world)]


def _check_data_differs_across_dp(results, world, tp):
    """Inputs (checksum per rank, second element) agree inside a TP group and differ between DP ranks."""
    sums = [r[1] for r in results]
    for rank in range(world):
        assert sums[rank] == sums[rank - rank % tp], f"rank {rank} drew other inputs than its TP group: {sums}"
    groups = {sums[dp * tp] for dp in range(world // tp)}
    assert len(groups) == world // tp, f"DP ranks drew the same inputs: {sums}"


# ---- 1. same-seed construction ---------------------------------------------------------------------------------------

def case_construction():
    rank, tp = _tp()
    for bias in (True, False):
        for stride in (1, 3):
            what = f"Column(bias={bias}, stride={stride})"
            torch.manual_seed(11)
            dense = nn.Linear(8, 24, bias=bias)
            torch.manual_seed(11)
            col = ColumnParallelLinear(8, 24, bias=bias, stride=stride, keep_master_weight=True)
            assert tuple(col.weight.shape) == (24 // tp, 8), what
            _equal(col.weight.detach(), _slice(dense.weight.detach(), 0, rank, tp, stride), f"{what} weight")
            _equal(col.master_weight, dense.weight.detach(), f"{what} master_weight")
            if bias:
                _equal(col.bias.detach(), _slice(dense.bias.detach(), 0, rank, tp, stride), f"{what} bias")
            else:
                assert col.bias is None, what
            if stride == 3:
                # Fused QKV: the local rows are [Q_r; K_r; V_r], each the rank's 1/tp of Q, K and V.
                q, k, v = dense.weight.detach().chunk(3, dim=0)
                expected = torch.cat([q.chunk(tp)[rank], k.chunk(tp)[rank], v.chunk(tp)[rank]])
                _equal(col.weight.detach(), expected, f"{what} QKV layout")

            what = f"Row(bias={bias}, stride={stride})"
            torch.manual_seed(12)
            dense = nn.Linear(24, 8, bias=bias)
            torch.manual_seed(12)
            row = RowParallelLinear(24, 8, bias=bias, stride=stride, keep_master_weight=True)
            assert tuple(row.weight.shape) == (8, 24 // tp), what
            _equal(row.weight.detach(), _slice(dense.weight.detach(), 1, rank, tp, stride), f"{what} weight")
            _equal(row.master_weight, dense.weight.detach(), f"{what} master_weight")
            if bias:
                _equal(row.bias.detach(), dense.bias.detach(), f"{what} bias (replicated)")
            else:
                assert row.bias is None, what
    assert getattr(ColumnParallelLinear(8, 8 * tp), "master_weight", None) is None

    for num, padding_idx, pad in ((16, None, False), (16, 13, False), (16, 2, False), (16, -1, False),
                                  (11, None, True), (11, 9, True)):
        what = f"Embedding({num}, padding_idx={padding_idx}, pad={pad})"
        torch.manual_seed(13)
        dense = nn.Embedding(num, 8, padding_idx=padding_idx)
        torch.manual_seed(13)
        emb = ParallelEmbedding(num, 8, padding_idx=padding_idx, pad=pad)
        padded = -(-num // tp) * tp
        assert emb.padded_num_embeddings == padded, what
        full = torch.cat([dense.weight.detach(), torch.zeros(padded - num, 8)])
        _equal(emb.weight.detach(), _slice(full, 0, rank, tp), f"{what} weight")
        if padding_idx is not None:
            lo, row_id = rank * padded // tp, padding_idx % num  # -1 means the last row, as in nn.Embedding
            if lo <= row_id < lo + padded // tp:
                assert torch.all(emb.weight[row_id - lo] == 0), f"{what}: padding row not zero"
            # A user init_method still gets the padding row zeroed, as nn.Embedding does.
            custom = ParallelEmbedding(num, 8, padding_idx=padding_idx, pad=pad, init_method=nn.init.ones_)
            expected = torch.ones(padded, 8)
            expected[row_id] = 0
            expected[num:] = 0
            _equal(custom.weight.detach(), _slice(expected, 0, rank, tp), f"{what} custom init_method")
        # shard_across_embedding: the same full table, split by columns.
        torch.manual_seed(13)
        dense = nn.Embedding(num, 8, padding_idx=padding_idx)
        torch.manual_seed(13)
        emb = ParallelEmbedding(num, 8, padding_idx=padding_idx, shard_across_embedding=True)
        _equal(emb.weight.detach(), _slice(dense.weight.detach(), 1, rank, tp), f"{what} shard_across_embedding")
    return _identity(), 0


@pytest.mark.parametrize("world,tp", WORLDS)
def test_same_seed_construction_equals_dense_slice(worlds, world, tp):
    results = worlds(world).run(case_construction, tensor_model_parallel_size=tp)
    _check_identities(results, world, tp)


# ---- 2-4. Column, Row, Column -> GELU -> Row -------------------------------------------------------------------------

def _check_column(seed, gather_output, bias, skip_bias_add, stride):
    rank, tp = _tp()
    what = f"Column(gather_output={gather_output}, bias={bias}, skip_bias_add={skip_bias_add}, stride={stride})"
    dense = nn.Linear(8, 24, bias=bias)
    _randomise_(dense, seed)
    col = ColumnParallelLinear(8, 24, bias=bias, gather_output=gather_output, skip_bias_add=skip_bias_add,
                               stride=stride)
    _load_(col.weight, dense.weight, 0, stride)
    if bias:
        _load_(col.bias, dense.bias, 0, stride)

    x = _randn((2, 3, 8), _data_seed(seed + 1))
    xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    yd = dense(xd)
    g = _randn(yd.shape, _data_seed(seed + 2))
    yd.backward(g)

    out = col(xp)
    if skip_bias_add:
        assert isinstance(out, tuple) and len(out) == 2, what
        out, returned_bias = out
        if not bias:
            assert returned_bias is None, what
        elif gather_output:
            # The full output comes with the full (gathered, dense-ordered) bias.
            _close(returned_bias, dense.bias.detach(), f"{what} returned full bias")
            _close(out, yd.detach() - dense.bias.detach(), f"{what} gathered output without bias")
            out = out + returned_bias
        else:
            assert returned_bias is col.bias, f"{what}: skip_bias_add must return the layer's bias"
            out = out + returned_bias  # local output and local bias shard line up
    if gather_output:
        _close(out, yd.detach(), f"{what} gathered output")
        out.backward(g)
    else:
        assert out.shape[-1] == 24 // tp, what
        _close(out, _slice(yd.detach(), -1, rank, tp, stride), f"{what} local output")
        out.backward(_slice(g, -1, rank, tp, stride))
    _close(xp.grad, xd.grad, f"{what} input grad")
    _close(col.weight.grad, _slice(dense.weight.grad, 0, rank, tp, stride), f"{what} weight grad")
    if bias:
        _close(col.bias.grad, _slice(dense.bias.grad, 0, rank, tp, stride), f"{what} bias grad")
    return x.sum().item()


def _check_row(seed, input_is_parallel, bias, skip_bias_add, stride, reduce_output=True):
    rank, tp = _tp()
    what = (f"Row(input_is_parallel={input_is_parallel}, bias={bias}, skip_bias_add={skip_bias_add}, stride={stride}, "
            f"reduce_output={reduce_output})")
    dense = nn.Linear(24, 8, bias=bias)
    _randomise_(dense, seed)
    row = RowParallelLinear(24, 8, bias=bias, input_is_parallel=input_is_parallel, skip_bias_add=skip_bias_add,
                            stride=stride, reduce_output=reduce_output)
    _load_(row.weight, dense.weight, 1, stride)
    if bias:
        _load_(row.bias, dense.bias, None)

    x = _randn((2, 3, 24), _data_seed(seed + 1))
    xd = x.clone().requires_grad_()
    xp = (_slice(x, -1, rank, tp, stride) if input_is_parallel else x.clone()).requires_grad_()
    yd = dense(xd)
    g = _randn(yd.shape, _data_seed(seed + 2))
    yd.backward(g)
    dense_no_bias = yd.detach() - dense.bias.detach() if bias else yd.detach()

    out = row(xp)
    if skip_bias_add:
        assert isinstance(out, tuple) and len(out) == 2, what
        out, returned_bias = out
        assert returned_bias is row.bias, f"{what}: skip_bias_add must return the layer's bias"
    if not reduce_output:
        # A partial sum per rank: the TP sum is the dense output without the bias, and one rank alone is not.
        _close(_tp_sum(out), dense_no_bias, f"{what} sum of partial outputs")
        if tp > 1:
            assert not torch.allclose(out, dense_no_bias, **TOL), f"{what}: the output was reduced anyway"
        out.backward(g)
    else:
        if skip_bias_add:
            _close(out, dense_no_bias, f"{what} output without bias")
            if bias:
                out = out + returned_bias
        _close(out, yd.detach(), f"{what} output")
        out.backward(g)
    expected_x_grad = _slice(xd.grad, -1, rank, tp, stride) if input_is_parallel else xd.grad
    _close(xp.grad, expected_x_grad, f"{what} input grad")
    _close(row.weight.grad, _slice(dense.weight.grad, 1, rank, tp, stride), f"{what} weight grad")
    if bias and reduce_output:
        _close(row.bias.grad, dense.bias.grad, f"{what} bias grad")
    return x.sum().item()


def _check_mlp(seed, stride, bias):
    """Column(gather_output=False) -> GELU -> Row(input_is_parallel=True): one all-reduce forward, one backward."""
    rank, tp = _tp()
    what = f"MLP(stride={stride}, bias={bias})"
    fc1, fc2 = nn.Linear(8, 24, bias=bias), nn.Linear(24, 8, bias=bias)
    _randomise_(fc1, seed)
    _randomise_(fc2, seed + 1)
    col = ColumnParallelLinear(8, 24, bias=bias, gather_output=False, stride=stride)
    row = RowParallelLinear(24, 8, bias=bias, input_is_parallel=True, stride=stride)
    _load_(col.weight, fc1.weight, 0, stride)
    _load_(row.weight, fc2.weight, 1, stride)
    if bias:
        _load_(col.bias, fc1.bias, 0, stride)
        _load_(row.bias, fc2.bias, None)

    x = _randn((2, 3, 8), _data_seed(seed + 2))
    xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    yd = fc2(F.gelu(fc1(xd)))
    g = _randn(yd.shape, _data_seed(seed + 3))
    yd.backward(g)
    yp = row(F.gelu(col(xp)))
    _close(yp, yd.detach(), f"{what} output")
    yp.backward(g)
    _close(xp.grad, xd.grad, f"{what} input grad")
    _close(col.weight.grad, _slice(fc1.weight.grad, 0, rank, tp, stride), f"{what} column weight grad")
    _close(row.weight.grad, _slice(fc2.weight.grad, 1, rank, tp, stride), f"{what} row weight grad")
    if bias:
        _close(col.bias.grad, _slice(fc1.bias.grad, 0, rank, tp, stride), f"{what} column bias grad")
        _close(row.bias.grad, fc2.bias.grad, f"{what} row bias grad")
    return x.sum().item()


def case_linear():
    seed, checksum = 100, None
    for gather_output in (True, False):
        for bias in (True, False):
            for skip_bias_add in (False, True):
                for stride in (1, 3):
                    seed += 10
                    s = _check_column(seed, gather_output, bias, skip_bias_add, stride)
                    checksum = s if checksum is None else checksum
    for input_is_parallel in (False, True):
        for bias in (True, False):
            for skip_bias_add in (False, True):
                for stride in (1, 3):
                    seed += 10
                    _check_row(seed, input_is_parallel, bias, skip_bias_add, stride)
        for bias, skip_bias_add in ((True, True), (False, False)):
            seed += 10
            _check_row(seed, input_is_parallel, bias, skip_bias_add, 1, reduce_output=False)
    for stride in (1, 3):
        for bias in (True, False):
            seed += 10
            _check_mlp(seed, stride, bias)
    return _identity(), checksum


@pytest.mark.parametrize("world,tp", WORLDS)
def test_linear_layers_equal_dense(worlds, world, tp):
    results = worlds(world).run(case_linear, tensor_model_parallel_size=tp)
    _check_identities(results, world, tp)
    _check_data_differs_across_dp(results, world, tp)


# ---- 5. ParallelEmbedding --------------------------------------------------------------------------------------------

def _ids(num: int, shape, seed: int) -> torch.Tensor:
    """Every id of the vocabulary (so every shard and the padding id) once, then random ids; shuffled."""
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.tensor(shape).prod())
    assert n >= num
    ids = torch.cat([torch.arange(num), torch.randint(num, (n - num,), generator=gen)])
    return ids[torch.randperm(n, generator=gen)].reshape(shape)


def _check_embedding(seed, num, padding_idx, pad, shard_across_embedding):
    rank, tp = _tp()
    what = (f"Embedding({num}, padding_idx={padding_idx}, pad={pad}, "
            f"shard_across_embedding={shard_across_embedding})")
    dense = nn.Embedding(num, 8, padding_idx=padding_idx)
    _randomise_(dense, seed)  # the padding row too: only its gradient is special
    emb = ParallelEmbedding(num, 8, padding_idx=padding_idx, pad=pad, shard_across_embedding=shard_across_embedding)
    if shard_across_embedding:
        _load_(emb.weight, dense.weight, 1)
    else:
        padded = emb.padded_num_embeddings
        assert padded == -(-num // tp) * tp, what
        _load_(emb.weight, torch.cat([dense.weight.detach(), torch.zeros(padded - num, 8)]), 0)

    ids = _ids(num, (4, 6), _data_seed(seed + 1))
    yd = dense(ids)
    g = _randn(yd.shape, _data_seed(seed + 2))
    yd.backward(g)
    yp = emb(ids)
    _close(yp, yd.detach(), f"{what} output")
    yp.backward(g)
    if shard_across_embedding:
        expected = _slice(dense.weight.grad, 1, rank, tp)
    else:
        full = torch.cat([dense.weight.grad, torch.zeros(emb.padded_num_embeddings - num, 8)])
        expected = _slice(full, 0, rank, tp)
    _close(emb.weight.grad, expected, f"{what} weight grad")
    if padding_idx is not None:
        assert torch.all(dense.weight.grad[padding_idx] == 0)  # the reference really has a frozen padding row
    return ids.sum().item()


def case_embedding():
    _, tp = _tp()
    checksum = None
    configs = [
        # num, padding_idx, pad, shard_across_embedding
        (16, None, False, False),
        (16, 13, False, False),  # padding id in the last (non-zero) shard
        (16, 0, False, False),
        (11, None, True, False),  # 11 rows padded to 12: tp=2 -> 6 + 6, tp=4 -> 3 + 3 + 3 + 3 (one padded row)
        (11, 7, True, False),
        (16, None, False, True),
        (16, 5, False, True),
    ]
    for i, (num, padding_idx, pad, across) in enumerate(configs):
        s = _check_embedding(300 + 10 * i, num, padding_idx, pad, across)
        checksum = s if checksum is None else checksum
    return _identity(), checksum


@pytest.mark.parametrize("world,tp", WORLDS)
def test_parallel_embedding_equals_dense(worlds, world, tp):
    results = worlds(world).run(case_embedding, tensor_model_parallel_size=tp)
    _check_identities(results, world, tp)
    _check_data_differs_across_dp(results, world, tp)


# ---- 6. sequence parallelism -----------------------------------------------------------------------------------------

def _check_sequence_parallel_block(seed, seq_dim):
    """LayerNorm -> Column(SP) -> GELU -> Row(SP), input and output sharded along the sequence."""
    rank, tp = _tp()
    what = f"SP block (sequence_dimension={seq_dim})"
    seq, batch, hidden, ffn = 8, 2, 8, 16
    ln_d, fc1, fc2 = nn.LayerNorm(hidden), nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
    for i, m in enumerate((ln_d, fc1, fc2)):
        _randomise_(m, seed + i)
    kw = {} if seq_dim == 0 else {"sequence_dimension": seq_dim}  # seq-first relies on the default
    ln = LayerNorm(hidden, sequence_parallel_enabled=True)
    col = ColumnParallelLinear(hidden, ffn, gather_output=False, sequence_parallel_enabled=True, **kw)
    row = RowParallelLinear(ffn, hidden, input_is_parallel=True, sequence_parallel_enabled=True, **kw)
    _load_(ln.weight, ln_d.weight, None)
    _load_(ln.bias, ln_d.bias, None)
    _load_(col.weight, fc1.weight, 0)
    _load_(col.bias, fc1.bias, 0)
    _load_(row.weight, fc2.weight, 1)
    _load_(row.bias, fc2.bias, None)
    for p in (ln.weight, ln.bias, row.bias):
        assert p.sequence_parallel_enabled is True, what
    for p in (col.weight, col.bias, row.weight):
        assert p.sequence_parallel_enabled is False, what

    shape = (seq, batch, hidden) if seq_dim == 0 else (batch, seq, hidden)
    x = _randn(shape, _data_seed(seed + 10))
    xd = x.clone().requires_grad_()
    xp = _slice(x, seq_dim, rank, tp).requires_grad_()
    yd = fc2(F.gelu(fc1(ln_d(xd))))
    g = _randn(yd.shape, _data_seed(seed + 11))
    yd.backward(g)

    yp = row(F.gelu(col(ln(xp))))
    assert yp.shape[seq_dim] == seq // tp, f"{what}: output {tuple(yp.shape)} is not a sequence shard"
    _close(_tp_gather(yp, seq_dim), yd.detach(), f"{what} gathered output")
    yp.backward(_slice(g, seq_dim, rank, tp))
    _close(xp.grad, _slice(xd.grad, seq_dim, rank, tp), f"{what} input grad")
    _close(col.weight.grad, _slice(fc1.weight.grad, 0, rank, tp), f"{what} column weight grad")
    _close(col.bias.grad, _slice(fc1.bias.grad, 0, rank, tp), f"{what} column bias grad")
    _close(row.weight.grad, _slice(fc2.weight.grad, 1, rank, tp), f"{what} row weight grad")
    # Replicated params inside the SP region hold partial grads: their sum over TP is the dense grad.
    for name, local, full in (("row bias", row.bias, fc2.bias), ("LayerNorm weight", ln.weight, ln_d.weight),
                              ("LayerNorm bias", ln.bias, ln_d.bias)):
        _close(_tp_sum(local.grad), full.grad, f"{what} {name} grad summed over TP")
        if tp > 1:
            assert not torch.allclose(local.grad, full.grad, **TOL), f"{what} {name}: grad was not partial"
    return x.sum().item()


def _check_sequence_parallel_embedding(seed, seq_dim, shard_across_embedding):
    """``seq_dim=None`` is NxD's default: batch-first ids give a sequence-first output [seq/tp, batch, hidden]. An
    explicit ``sequence_dimension`` names the ids' sequence dimension, which is split where it is."""
    rank, tp = _tp()
    what = f"SP Embedding(sequence_dimension={seq_dim}, shard_across_embedding={shard_across_embedding})"
    num, seq, batch = 16, 8, 3
    dense = nn.Embedding(num, 8, padding_idx=9)
    _randomise_(dense, seed)
    emb = ParallelEmbedding(num, 8, padding_idx=9, shard_across_embedding=shard_across_embedding,
                            sequence_parallel_enabled=True, sequence_dimension=seq_dim)
    _load_(emb.weight, dense.weight, 1 if shard_across_embedding else 0)
    ids = _ids(num, (seq, batch) if seq_dim == 0 else (batch, seq), _data_seed(seed + 1))
    yd = dense(ids)
    if seq_dim is None:
        yd = yd.transpose(0, 1)
    out_seq_dim = 1 if seq_dim == 1 else 0
    g = _randn(yd.shape, _data_seed(seed + 2))
    yd.backward(g)
    yp = emb(ids)
    assert yp.shape[out_seq_dim] == seq // tp, f"{what}: output {tuple(yp.shape)} is not a sequence shard"
    _close(_tp_gather(yp, out_seq_dim), yd.detach(), f"{what} gathered output")
    yp.backward(_slice(g, out_seq_dim, rank, tp))
    _close(emb.weight.grad, _slice(dense.weight.grad, 1 if shard_across_embedding else 0, rank, tp),
           f"{what} weight grad")


def case_sequence_parallel():
    checksum = None
    for seq_dim in (0, 1):
        s = _check_sequence_parallel_block(500 + 50 * seq_dim, seq_dim)
        checksum = s if checksum is None else checksum
    for seq_dim in (None, 0, 1):
        for across in (False, True):
            _check_sequence_parallel_embedding(600 + 50 * (seq_dim or 2) + 10 * across, seq_dim, across)
    return _identity(), checksum


@pytest.mark.parametrize("world,tp", WORLDS)
def test_sequence_parallel_equals_dense(worlds, world, tp):
    results = worlds(world).run(case_sequence_parallel, tensor_model_parallel_size=tp)
    _check_identities(results, world, tp)
    _check_data_differs_across_dp(results, world, tp)


# ---- single process: the reference slicer, specs, state dicts, device moves, meta, bad input -------------------------

def test_shard_of_matches_reference_slices():
    full = torch.arange(24 * 2).reshape(24, 2)
    for tp in (1, 2, 4):
        for stride in (1, 2, 3):
            for rank in range(tp):
                assert torch.equal(shard_of(full, 0, rank, tp, stride), _slice(full, 0, rank, tp, stride))
                assert torch.equal(shard_of(full.T, 1, rank, tp, stride), _slice(full.T, 1, rank, tp, stride))
    # The QKV layout spelled out: tp=2, rank 1 holds rows Q[4:8], K[12:16], V[20:24].
    assert shard_of(full, 0, 1, 2, 3)[:, 0].tolist() == [2 * r for r in (*range(4, 8), *range(12, 16), *range(20, 24))]


def _assert_attributes_match_specs(model: nn.Module) -> int:
    checked = 0
    for module in model.modules():
        if not isinstance(module, ShardedModule):
            continue
        for name, spec in module.param_specs().items():
            p = getattr(module, name)
            assert p.tensor_model_parallel == spec.is_sharded, (module, name)
            assert p.partition_dim == (spec.partition_dim if spec.is_sharded else -1), (module, name)
            assert p.partition_stride == spec.stride, (module, name)
            assert p.num_partitions == spec.num_partitions, (module, name)
            assert p.sequence_parallel_enabled == spec.sequence_parallel, (module, name)
            checked += 1
    return checked


def test_param_specs_and_nxd_attributes():
    with ps.simulated_topology(world_size=8, rank=5, tensor_model_parallel_size=4):
        col = ColumnParallelLinear(8, 24, stride=3, gather_output=False)
        row = RowParallelLinear(16, 8, input_is_parallel=True, sequence_parallel_enabled=True)
        emb = ParallelEmbedding(11, 8, pad=True)
        across = ParallelEmbedding(11, 8, shard_across_embedding=True)
        ln = LayerNorm(8, sequence_parallel_enabled=True)

    specs = {k: (s.full_shape, s.partition_dim, s.stride, s.num_partitions, s.unpadded_shape, s.sequence_parallel)
             for k, s in col.param_specs().items()}
    assert specs == {"weight": ((24, 8), 0, 3, 4, (24, 8), False), "bias": ((24,), 0, 3, 4, (24,), False)}
    assert (col.weight.tensor_model_parallel, col.weight.partition_dim, col.weight.partition_stride) == (True, 0, 3)
    assert (col.bias.tensor_model_parallel, col.bias.partition_dim, col.bias.partition_stride) == (True, 0, 3)

    w, b = row.param_specs()["weight"], row.param_specs()["bias"]
    assert (w.full_shape, w.partition_dim, w.num_partitions, w.sequence_parallel) == ((8, 16), 1, 4, False)
    assert (b.full_shape, b.is_sharded, b.sequence_parallel) == ((8,), False, True)
    assert (row.weight.tensor_model_parallel, row.weight.partition_dim, row.weight.partition_stride) == (True, 1, 1)
    assert row.bias.tensor_model_parallel is False and row.bias.sequence_parallel_enabled is True

    e = emb.param_specs()["weight"]
    assert (e.full_shape, e.unpadded_shape, e.partition_dim, e.num_partitions) == ((12, 8), (11, 8), 0, 4)
    assert tuple(emb.weight.shape) == (3, 8) and (emb.vocab_start_index, emb.vocab_end_index) == (3, 6)
    assert (emb.weight.tensor_model_parallel, emb.weight.partition_dim) == (True, 0)
    a = across.param_specs()["weight"]
    assert (a.full_shape, a.partition_dim, tuple(across.weight.shape)) == ((11, 8), 1, (11, 2))
    assert (across.weight.tensor_model_parallel, across.weight.partition_dim) == (True, 1)

    assert set(ln.param_specs()) == {"weight", "bias"}
    for p in (ln.weight, ln.bias):
        assert p.tensor_model_parallel is False and p.sequence_parallel_enabled is True
    for m in (col, row, emb, across, ln):
        assert _assert_attributes_match_specs(m) == len(m.param_specs()) > 0


def test_state_dict_carries_spec_and_refuses_other_degree():
    with ps.simulated_topology(world_size=2, rank=1, tensor_model_parallel_size=2):
        torch.manual_seed(0)
        model = nn.Sequential(ColumnParallelLinear(8, 16, gather_output=False),
                              RowParallelLinear(16, 8, input_is_parallel=True))
        sd = model.state_dict()
        assert {"0._extra_state", "1._extra_state"} <= set(sd)
        assert sd["0._extra_state"]["params"]["weight"] == {
            "full_shape": [16, 8], "partition_dim": 0, "stride": 1, "num_partitions": 2, "real_shape": [16, 8],
            "sequence_parallel": False}
        assert sd["1._extra_state"]["params"] == {name: spec.to_dict() for name, spec in model[1].param_specs().items()}
        # A plain torch.save of the state dict keeps the spec and loads back with weights_only=True.
        buffer = io.BytesIO()
        torch.save(sd, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)
        torch.manual_seed(1)
        same = nn.Sequential(ColumnParallelLinear(8, 16, gather_output=False),
                             RowParallelLinear(16, 8, input_is_parallel=True))
        assert not torch.equal(same[0].weight, model[0].weight)
        same.load_state_dict(loaded)
        for key in ("0.weight", "0.bias", "1.weight", "1.bias"):
            assert torch.equal(same.state_dict()[key], sd[key]), key

    # The same full shape at tp=4: shards would silently be the wrong rows; the spec says why it cannot load.
    with ps.simulated_topology(world_size=4, rank=1, tensor_model_parallel_size=4):
        other = ColumnParallelLinear(8, 16, gather_output=False)
        message = (re.escape("saved with partition_dim=0, 2 partitions") + ".*"
                   + re.escape("has partition_dim=0, 4 partitions"))
        with pytest.raises(ValueError, match=message):
            other.load_state_dict({k[2:]: v for k, v in sd.items() if k.startswith("0.")})

    # A refused load leaves the weights untouched, even where the local shapes happen to match (tp=2 Column(8, 16) and
    # tp=4 Column(8, 32) both hold [8, 8]).
    with ps.simulated_topology(world_size=4, rank=1, tensor_model_parallel_size=4):
        wider = ColumnParallelLinear(8, 32, gather_output=False)
        before = {k: v.clone() for k, v in wider.state_dict().items() if k != "_extra_state"}
        tp2_column = {k[2:]: v for k, v in sd.items() if k.startswith("0.")}
        assert tp2_column["weight"].shape == wider.weight.shape
        with pytest.raises(ValueError, match="Reshard the checkpoint"):
            wider.load_state_dict(tp2_column)
        for key, value in before.items():
            assert torch.equal(wider.state_dict()[key], value), key
        # A plain per-rank state dict with no spec (NxD's checkpoint form) loads strictly on shapes.
        plain = {k: torch.randn_like(v) for k, v in before.items()}
        wider.load_state_dict(plain, strict=True)
        assert torch.equal(wider.weight, plain["weight"])


class _TiedModel(nn.Module):
    """A ParallelEmbedding whose (local) weight is tied to a plain linear head, plus an SP LayerNorm."""

    def __init__(self):
        super().__init__()
        self.emb = ParallelEmbedding(16, 8)
        self.ln = LayerNorm(8, sequence_parallel_enabled=True)
        self.head = nn.Linear(8, 8, bias=False)  # 16 vocab rows / tp=2
        self.head.weight = self.emb.weight


def _assert_tied_and_attributed(model: _TiedModel, device: str, what: str):
    assert model.head.weight is model.emb.weight, f"{what}: tie lost"
    assert model.emb.weight.device.type == device, what
    assert _assert_attributes_match_specs(model) == 3, what
    assert model.emb.weight.partition_dim == 0 and model.head.weight.tensor_model_parallel is True, what
    assert model.ln.weight.sequence_parallel_enabled is True, what


def test_move_model_to_device_reties_and_reattaches():
    with ps.simulated_topology(world_size=2, rank=1, tensor_model_parallel_size=2):
        torch.manual_seed(0)
        model = _TiedModel()
        with torch.no_grad():
            model.ln.weight.normal_()
        _assert_tied_and_attributed(model, "cpu", "fresh")

        copied = copy.deepcopy(model)
        assert copied.head.weight is copied.emb.weight  # deepcopy keeps the tie ...
        move_model_to_device(copied, "cpu")  # ... and move_model_to_device restores the attributes it may drop
        _assert_tied_and_attributed(copied, "cpu", "deepcopy + move_model_to_device")
        assert torch.equal(copied.emb.weight, model.emb.weight) and copied.emb.weight is not model.emb.weight

        previous = torch.__future__.get_overwrite_module_params_on_conversion()
        torch.__future__.set_overwrite_module_params_on_conversion(True)  # new Parameter objects, as .to(xla) makes
        try:
            plain = copy.deepcopy(model).to("cpu")
            assert plain.head.weight is not plain.emb.weight, "setup: a plain .to() was expected to untie here"
            moved = copy.deepcopy(model)
            old_weight = moved.emb.weight
            assert move_model_to_device(moved, "cpu") is moved
            assert moved.emb.weight is not old_weight
            _assert_tied_and_attributed(moved, "cpu", "move_model_to_device with new Parameters")
            assert torch.equal(moved.emb.weight, model.emb.weight) and torch.equal(moved.ln.weight, model.ln.weight)
        finally:
            torch.__future__.set_overwrite_module_params_on_conversion(previous)

        meta = move_model_to_device(copy.deepcopy(model), "meta")
        _assert_tied_and_attributed(meta, "meta", "move_model_to_device(meta)")
        assert "emb._extra_state" in meta.state_dict()


def test_meta_construction_gives_local_shapes_without_allocating():
    with ps.simulated_topology(world_size=4, rank=1, tensor_model_parallel_size=4):
        big = 1 << 20  # a dense 2^20 x 2^20 fp32 master would be 4 TiB
        state = torch.get_rng_state()
        col = ColumnParallelLinear(big, big, device="meta", stride=2, keep_master_weight=True)
        row = RowParallelLinear(big, big, device="meta")
        emb = ParallelEmbedding(big + 1, 64, pad=True, device="meta")
        ln = LayerNorm(64, device="meta")
        assert torch.equal(torch.get_rng_state(), state), "meta construction drew random numbers"
    assert tuple(col.weight.shape) == (big // 4, big) and tuple(col.bias.shape) == (big // 4,)
    assert tuple(row.weight.shape) == (big, big // 4) and tuple(row.bias.shape) == (big,)
    assert tuple(emb.weight.shape) == ((big + 4) // 4, 64)
    for p in (col.weight, col.bias, row.weight, row.bias, emb.weight, ln.weight):
        assert p.device.type == "meta"
    assert _assert_attributes_match_specs(nn.ModuleList([col, row, emb, ln])) == 7


def _esc(s: str) -> str:
    return re.escape(s)


@pytest.mark.parametrize("build,error,message", [
    (lambda: ColumnParallelLinear(8, 10), ValueError,
     _esc("output_size=10 is not divisible by tensor_model_parallel_size=4")),
    (lambda: RowParallelLinear(10, 8), ValueError,
     _esc("input_size=10 is not divisible by tensor_model_parallel_size=4")),
    (lambda: ColumnParallelLinear(8, 16, stride=3), ValueError,
     _esc("output_size=16 is not divisible by tensor_model_parallel_size * stride = 4 * 3")),
    (lambda: RowParallelLinear(16, 8, stride=3), ValueError,
     _esc("input_size=16 is not divisible by tensor_model_parallel_size * stride = 4 * 3")),
    (lambda: RowParallelLinear(16, 8, stride=3, device="meta"), ValueError, _esc("input_size=16")),
    (lambda: ColumnParallelLinear(8, 16, stride=0), ValueError, _esc("stride=0 must be >= 1")),
    (lambda: ParallelEmbedding(10, 8), ValueError,
     _esc("num_embeddings=10 is not divisible by tensor_model_parallel_size=4; pass pad=True to pad the vocabulary "
          "to 12")),
    (lambda: ParallelEmbedding(16, 6, shard_across_embedding=True), ValueError,
     _esc("embedding_dim=6 is not divisible by tensor_model_parallel_size=4; pass pad=True to pad it to 8")),
    (lambda: ParallelEmbedding(16, 8, padding_idx=16), ValueError, _esc("padding_idx=16 must be in [-16, 16)")),
    (lambda: ColumnParallelLinear(8, 12, pad=True, stride=3), ValueError,
     _esc("pad=True with stride=3 is not supported")),
    (lambda: ColumnParallelLinear(8, 16, pad=True, pad_alignment_size_per_rank=0), ValueError,
     _esc("pad_alignment_size_per_rank=0 must be >= 1")),
    (lambda: ColumnParallelLinear(8, 16, tensor_model_parallel_group=object()), TypeError,
     "tensor_model_parallel_group|is not a torch.distributed ProcessGroup"),
    (lambda: RowParallelLinear(16, 8, tensor_model_parallel_group="tp"), TypeError,
     "is not a torch.distributed ProcessGroup"),
    (lambda: ParallelEmbedding(16, 8, tensor_model_parallel_group=3), TypeError,
     "is not a torch.distributed ProcessGroup"),
    (lambda: ColumnParallelLinear(8, 16, rank_ordering=[1, 0, 3, 2]), ValueError,
     _esc("rank_ordering=[1, 0, 3, 2] is not supported by nxdtp") + ".*" + _esc("None or [0, 1, 2, 3]")),
    (lambda: RowParallelLinear(16, 8, rank_ordering=[0, 1]), ValueError, _esc("rank_ordering=[0, 1] is not supported")),
    (lambda: ParallelEmbedding(16, 8, rank_ordering=[3, 2, 1, 0]), ValueError, _esc("rank_ordering=[3, 2, 1, 0]")),
    (lambda: ParallelEmbedding(16, 8, use_spmd_rank=True, shard_across_embedding=True), ValueError,
     _esc("use_spmd_rank=True only applies to the vocabulary split")),
    (lambda: SPMDRank(3), ValueError, _esc("SPMDRank: world_size=3 is neither the tensor-parallel size 4 nor")),
    (lambda: LinearWithAsyncCommunication.apply(torch.ones(2, 4), torch.ones(4, 4), None, True, False,
                                                save_for_backward=False), ValueError,
     _esc("save_for_backward=False is not supported by nxdtp")),
    (lambda: create_local_weight(torch.ones(10, 2), 0, 2, 1), ValueError,
     _esc("dimension 0 of shape (10, 2) is not per_partition_size=2 * tensor_model_parallel_size=4")),
    (lambda: ParallelEmbedding(16, 8, max_norm=1.0), ValueError, _esc("max_norm=1.0 is not supported")),
    (lambda: ParallelEmbedding(16, 8, sparse=True), ValueError, _esc("sparse=True is not supported")),
    (lambda: ParallelEmbedding(16, 8, scale_grad_by_freq=True), ValueError, _esc("scale_grad_by_freq=True is not")),
    (lambda: ColumnParallelLinear(8, 16, bogus=1), TypeError, _esc("unexpected keyword arguments ['bogus']")),
    (lambda: RowParallelLinear(16, 8, bogus=1), TypeError, _esc("unexpected keyword arguments ['bogus']")),
    (lambda: ParallelEmbedding(16, 8, bogus=1), TypeError, _esc("unexpected keyword arguments ['bogus']")),
    (lambda: ColumnParallelLinear(8, 16, sequence_parallel_enabled=True), ValueError,
     _esc("sequence_parallel_enabled=True needs gather_output=False")),
    (lambda: RowParallelLinear(16, 8, sequence_parallel_enabled=True), ValueError,
     _esc("sequence_parallel_enabled=True needs input_is_parallel=True")),
    (lambda: RowParallelLinear(16, 8, input_is_parallel=True, sequence_parallel_enabled=True, reduce_output=False),
     ValueError, _esc("reduce_output=False cannot be combined")),
    (lambda: RowParallelLinear(16, 8, reduce_output=False), ValueError,
     _esc("reduce_output=False with bias=True needs skip_bias_add=True")),
])
def test_bad_arguments_are_rejected_with_a_message(build, error, message):
    with ps.simulated_topology(world_size=4, rank=1, tensor_model_parallel_size=4):
        with pytest.raises(error, match=message):
            build()


def test_nxd_defaults_are_accepted():
    with ps.simulated_topology(world_size=4, rank=1, tensor_model_parallel_size=4):
        ColumnParallelLinear(8, 16, pad=False, tensor_model_parallel_group=None, reduce_dtype=torch.float32)
        RowParallelLinear(16, 8, pad=False, tensor_model_parallel_group=None, reduce_output=False, bias=False)
        ParallelEmbedding(16, 8, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False, pad=False,
                          tensor_model_parallel_group=None)

"""NxD's layer keywords and semantics beyond the basics, each against dense torch on gloo ranks.

ParallelEmbedding's ``collect_output=False``, ``use_spmd_rank`` and ``pad`` across the embedding; Column/Row ``pad``
with ``keep_padded_output``; ``reduce_dtype`` (bf16 layers summed in fp32); ``tensor_model_parallel_group`` as nxdtp's
groups or a subgroup made by ``dist.new_group``; ``linear_with_async_allreduce``; ``create_local_weight``; ``tile_cc``;
and a walk over every keyword of NxD 2.29's layer signatures at a non-default value.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from nxdtp import layers
from nxdtp import parallel_state as ps
from nxdtp.checkpointing.index import split_state_dict
from nxdtp.layers import (
    ColumnParallelLinear,
    LinearWithAsyncCommunication,
    ParallelEmbedding,
    RowParallelLinear,
    SPMDRank,
    create_local_weight,
    linear_with_async_allreduce,
    shard_of,
)
from tests.test_layers import _close, _data_seed, _ids, _load_, _randn, _randomise_, _slice, _tp, _tp_sum

WORLDS = [pytest.param(2, 2, id="tp2"), pytest.param(4, 4, id="tp4"), pytest.param(4, 2, id="tp2xdp2")]


def _dense_and_parallel_embedding(seed, num, dim, **kwargs):
    dense = nn.Embedding(num, dim, padding_idx=kwargs.get("padding_idx"))
    _randomise_(dense, seed)
    emb = ParallelEmbedding(num, dim, **kwargs)
    across = kwargs.get("shard_across_embedding", False)
    full = dense.weight.detach()
    padded = emb.param_specs()["weight"].full_from_dense(full)
    _load_(emb.weight, padded, 1 if across else 0)
    return dense, emb


def case_embedding_options(seed):
    rank, tp = _tp()
    ids = _ids(20, (4, 5), _data_seed(seed))
    done = []
    # collect_output=False: vocabulary shards give partial sums whose TP sum is the dense lookup; embedding-dim shards
    # give this rank's columns.
    for across in (False, True):
        dense, emb = _dense_and_parallel_embedding(seed + across, 20, 8, padding_idx=3, pad=True,
                                                   shard_across_embedding=across, collect_output=False)
        yd = dense(ids)
        g = _randn(yd.shape, _data_seed(seed + 7))
        yd.backward(g)
        yp = emb(ids)
        if across:
            _close(yp, _slice(yd.detach(), -1, rank, tp), "collect_output=False across: this rank's columns")
            yp.backward(_slice(g, -1, rank, tp))
        else:
            assert tp == 1 or not torch.allclose(yp, yd.detach()), "collect_output=False: output was reduced"
            _close(_tp_sum(yp), yd.detach(), "collect_output=False: partials sum to the dense lookup")
            yp.backward(g)
        dim = 1 if across else 0
        expected = _slice(emb.param_specs()["weight"].full_from_dense(dense.weight.grad), dim, rank, tp)
        _close(emb.weight.grad, expected, f"collect_output=False across={across} weight grad")
    done.append("collect_output")

    # pad=True across the embedding: the padded columns are zero and cut from the output; training is exact.
    dense, emb = _dense_and_parallel_embedding(seed + 2, 20, 6, shard_across_embedding=True, pad=True)
    yd, yp = dense(ids), emb(ids)
    _close(yp, yd.detach(), "pad across embedding forward")
    g = _randn(yd.shape, _data_seed(seed + 8))
    yd.backward(g)
    yp.backward(g)
    full_grad = emb.param_specs()["weight"].full_from_dense(dense.weight.grad)
    _close(emb.weight.grad, _slice(full_grad, 1, rank, tp), "pad across embedding weight grad")
    done.append("pad_across")

    # use_spmd_rank=True: the vocabulary offset comes from a rank tensor; same numbers as the Python rank.
    dense, emb = _dense_and_parallel_embedding(seed + 3, 20, 8, pad=True, use_spmd_rank=True)
    assert emb.rank_util.get_rank().tolist() == [rank]
    yd, yp = dense(ids), emb(ids)
    _close(yp, yd.detach(), "use_spmd_rank forward")
    g = _randn(yd.shape, _data_seed(seed + 9))
    yd.backward(g)
    yp.backward(g)
    _close(emb.weight.grad, _slice(emb.param_specs()["weight"].full_from_dense(dense.weight.grad), 0, rank, tp),
           "use_spmd_rank weight grad")
    done.append("spmd_rank")

    # tile_cc=True: accepted with a warning, the numbers are those of the default.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layers.mappings._TILE_CC_NOTED.discard("ParallelEmbedding")
        dense, emb = _dense_and_parallel_embedding(seed + 4, 20, 8, pad=True, tile_cc=True)
    assert any("tile_cc=True is accepted but has no effect" in str(w.message) for w in caught)
    _close(emb(ids), dense(ids).detach(), "tile_cc forward")
    done.append("tile_cc")
    return done


@pytest.mark.parametrize("world,tp", WORLDS)
def test_embedding_options_equal_dense(worlds, world, tp):
    results = worlds(world).run(case_embedding_options, tensor_model_parallel_size=tp, seed=70)
    assert all(done == ["collect_output", "pad_across", "spmd_rank", "tile_cc"] for done in results)


def case_linear_padding(seed):
    """pad=True (inference): a Column -> Row pair whose sizes TP does not divide equals the dense pair."""
    rank, tp = _tp()
    dense1, dense2 = nn.Linear(6, 10), nn.Linear(10, 7)
    _randomise_(dense1, seed)
    _randomise_(dense2, seed + 1)
    col = ColumnParallelLinear(6, 10, gather_output=False, pad=True)
    row = RowParallelLinear(10, 7, input_is_parallel=True, pad=True)
    gathered = ColumnParallelLinear(6, 10, gather_output=True, pad=True)
    kept = ColumnParallelLinear(6, 10, gather_output=True, pad=True, keep_padded_output=True,
                                pad_alignment_size_per_rank=2)
    full_row = RowParallelLinear(10, 7, input_is_parallel=False, pad=True)
    for layer, source in ((col, dense1), (row, dense2), (gathered, dense1), (kept, dense1), (full_row, dense2)):
        specs = layer.param_specs()
        dim = specs["weight"].partition_dim
        _load_(layer.weight, specs["weight"].full_from_dense(source.weight.detach()), dim)
        _load_(layer.bias, specs["bias"].full_from_dense(source.bias.detach()), specs["bias"].partition_dim)
        layer.eval()
    assert kept.output_size_per_partition == -(-10 // (2 * tp)) * 2, "pad_alignment_size_per_rank ignored"
    x = _randn((2, 3, 6), _data_seed(seed + 2))
    hidden = dense1(x)
    expected = dense2(torch.relu(hidden)).detach()
    _close(row(torch.relu(col(x))), expected, "padded column -> row")
    _close(gathered(x), hidden.detach(), "padded column, gathered and cut")
    padded_out = kept(x)
    assert padded_out.shape[-1] == 10 + kept.pad_size
    _close(padded_out[..., :10], hidden.detach(), "keep_padded_output: real part")
    assert torch.count_nonzero(padded_out[..., 10:]) == 0, "keep_padded_output: padding is not zero"
    _close(full_row(torch.relu(hidden.detach())), expected, "padded row with a full input")
    col.train()
    try:
        col(x)
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.parametrize("world,tp", [pytest.param(4, 4, id="tp4"), pytest.param(4, 2, id="tp2xdp2")])
def test_linear_padding_equals_dense(worlds, world, tp):
    for message in worlds(world).run(case_linear_padding, tensor_model_parallel_size=tp, seed=80):
        assert message is not None and "pad=True is for inference only" in message and "model.eval()" in message


def case_reduce_dtype(seed):
    """A bf16 Column -> Row pair: with reduce_dtype=float32 (NxD's default) the Row output and the Column input
    gradient are closer to the fp32 dense result than with reduce_dtype=bfloat16."""
    torch.manual_seed(seed)
    dense1, dense2 = nn.Linear(64, 256), nn.Linear(256, 64)
    _randomise_(dense1, seed)
    _randomise_(dense2, seed + 1)
    x = _randn((4, 8, 64), _data_seed(seed + 2)) * 3
    g = _randn((4, 8, 64), _data_seed(seed + 3))
    xd = x.clone().requires_grad_(True)
    yd = dense2(torch.tanh(dense1(xd)))
    yd.backward(g)
    errors = {}
    for reduce_dtype in (torch.float32, torch.bfloat16):
        col = ColumnParallelLinear(64, 256, gather_output=False, dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        row = RowParallelLinear(256, 64, input_is_parallel=True, dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        _load_(col.weight, dense1.weight.to(torch.bfloat16), 0)
        _load_(col.bias, dense1.bias.to(torch.bfloat16), 0)
        _load_(row.weight, dense2.weight.to(torch.bfloat16), 1)
        _load_(row.bias, dense2.bias.to(torch.bfloat16), None)
        xp = x.to(torch.bfloat16).requires_grad_(True)
        yp = row(torch.tanh(col(xp)))
        yp.backward(g.to(torch.bfloat16))
        assert yp.dtype == torch.bfloat16 and xp.grad.dtype == torch.bfloat16
        errors[str(reduce_dtype)] = ((yp.double() - yd.double()).abs().sum().item(),
                                     (xp.grad.double() - xd.grad.double()).abs().sum().item())
    return errors


@pytest.mark.parametrize("world,tp", [pytest.param(4, 4, id="tp4")])
def test_reduce_dtype_fp32_beats_bf16(worlds, world, tp):
    for errors in worlds(world).run(case_reduce_dtype, tensor_model_parallel_size=tp, seed=90):
        (out32, grad32), (out16, grad16) = errors["torch.float32"], errors["torch.bfloat16"]
        assert out32 < out16, errors
        assert grad32 < grad16, errors


def case_custom_groups(seed):
    """tensor_model_parallel_group= as the DP group, a gloo subgroup from dist.new_group, or nxdtp's TP process group:
    a Column -> Row pair split over that group equals dense, and its weights are that group's slices."""
    topo = ps.get_topology()
    world, rank = topo.world_size, topo.rank
    pairs = [list(range(r, r + 2)) for r in range(0, world, 2)]
    subgroups = [dist.new_group(p, backend="gloo") for p in pairs]
    mine = subgroups[rank // 2]
    results = []
    for what, group, members in (("dp", ps.get_data_parallel_group(), topo.data_parallel.ranks),
                                 ("subgroup", mine, pairs[rank // 2]),
                                 ("tp", ps.get_tensor_model_parallel_group(), topo.tensor_parallel.ranks)):
        n, position = len(members), members.index(rank)
        torch.manual_seed(seed)
        dense1, dense2 = nn.Linear(8, 16), nn.Linear(16, 8)
        torch.manual_seed(seed)
        col = ColumnParallelLinear(8, 16, gather_output=False, tensor_model_parallel_group=group)
        row = RowParallelLinear(16, 8, input_is_parallel=True, tensor_model_parallel_group=group)
        assert torch.equal(col.weight.detach(), _slice(dense1.weight.detach(), 0, position, n)), what
        _randomise_(dense1, seed + 1)
        _randomise_(dense2, seed + 2)
        with torch.no_grad():
            col.weight.copy_(shard_of(dense1.weight, 0, position, n))
            col.bias.copy_(shard_of(dense1.bias, 0, position, n))
            row.weight.copy_(shard_of(dense2.weight, 1, position, n))
            row.bias.copy_(dense2.bias)
        x = _randn((3, 8), seed + 3)  # the same on every rank of the group (a replicated input)
        xd = x.clone().requires_grad_(True)
        xp = x.clone().requires_grad_(True)
        yd = dense2(torch.relu(dense1(xd)))
        yp = row(torch.relu(col(xp)))
        yd.sum().backward()
        yp.sum().backward()
        _close(yp, yd.detach(), f"{what} forward")
        _close(xp.grad, xd.grad, f"{what} input grad (summed over the group)")
        _close(col.weight.grad, shard_of(dense1.weight.grad, 0, position, n), f"{what} column weight grad")
        _close(row.weight.grad, shard_of(dense2.weight.grad, 1, position, n), f"{what} row weight grad")
        # A checkpoint stores tensor-parallel shards: a layer split over another group is refused by name.
        state = nn.ModuleDict({"col": col, "row": row}).state_dict()
        try:
            split_state_dict(state, topo.tensor_model_parallel_size)
            refused = None
        except ValueError as error:
            refused = str(error)
        assert (refused is None) == (what == "tp"), (what, refused)
        assert what == "tp" or f"'col' is split over the process group of ranks {list(members)}" in refused, refused
        results.append(what)
    for g in subgroups:
        if g != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(g)
    return results


def test_layers_over_custom_groups(worlds):
    assert all(r == ["dp", "subgroup", "tp"] for r in worlds(4).run(case_custom_groups, tensor_model_parallel_size=2,
                                                                    seed=100))


def case_linear_function_and_local_weight(seed):
    rank, tp = _tp()
    w, b = _randn((2 * tp, 4), seed), _randn((2 * tp,), seed + 1)
    x = _randn((2, 3, 4), _data_seed(seed + 2))
    g = _randn((2, 3, 2 * tp), _data_seed(seed + 3))
    w_local = create_local_weight(w, 0, 2, 1)
    assert torch.equal(w_local, shard_of(w, 0, rank, tp))
    out = torch.empty_like(w_local)
    assert create_local_weight(w, 0, 2, 1, out_weight=out) is out and torch.equal(out, w_local)
    # async_grad_allreduce: the input gradient is the sum of every rank's column contribution, i.e. the dense one.
    xp = x.clone().requires_grad_(True)
    yp = linear_with_async_allreduce(xp, w_local, shard_of(b, 0, rank, tp), True, False)
    xd = x.clone().requires_grad_(True)
    yd = torch.nn.functional.linear(xd, w, b)
    _close(yp, _slice(yd.detach(), -1, rank, tp), "linear_with_async_allreduce forward")
    yp.backward(_slice(g, -1, rank, tp))
    yd.backward(g)
    _close(xp.grad, xd.grad, "linear_with_async_allreduce input grad")
    # sequence parallel: the [seq/tp, batch, h] input is gathered; its gradient reduce-scattered.
    x_seq = _randn((2 * tp, 3, 4), _data_seed(seed + 4))
    xs = _slice(x_seq, 0, rank, tp).clone().requires_grad_(True)
    ys = LinearWithAsyncCommunication.apply(xs, w_local, None, False, True, 0)
    xsd = x_seq.clone().requires_grad_(True)
    ysd = torch.nn.functional.linear(xsd, w)
    gs = _randn(ysd.shape, _data_seed(seed + 5))
    _close(ys, _slice(ysd.detach(), -1, rank, tp), "sequence-parallel linear forward")
    ys.backward(_slice(gs, -1, rank, tp))
    ysd.backward(gs)
    _close(xs.grad, _slice(xsd.grad, 0, rank, tp), "sequence-parallel linear input grad")
    ranks = SPMDRank(tp)
    ranks.initialize_expert_indices(3)
    return (ranks.get_rank().tolist(), ranks.get_local_expert_indices().tolist(),
            SPMDRank(ps.get_world_size()).rank.item())


@pytest.mark.parametrize("world,tp", WORLDS)
def test_linear_function_local_weight_and_spmd_rank(worlds, world, tp):
    results = worlds(world).run(case_linear_function_and_local_weight, tensor_model_parallel_size=tp, seed=110)
    assert [r[0] for r in results] == [[rank % tp] for rank in range(world)]
    assert all(r[1] == [[0, 1, 2]] for r in results)
    assert [r[2] for r in results] == list(range(world))


# NxD 2.29's keyword arguments of the layers (neuronx_distributed/parallel_layers/layers.py), each at a value other than
# its default. nxdtp must either work at that value (numerically tested above or in test_layers.py / test_conv.py) or
# refuse it with an error naming the keyword and the value.
_NXD_KEYWORDS = {
    "ColumnParallelLinear": (["input_size", "output_size", "bias", "gather_output", "dtype", "device", "stride",
                              "init_method", "sequence_parallel_enabled", "sequence_dimension", "keep_master_weight",
                              "skip_bias_add", "pad", "pad_alignment_size_per_rank", "keep_padded_output",
                              "tensor_model_parallel_group", "reduce_dtype", "rank_ordering"],
                             dict(bias=False, gather_output=False, dtype=torch.bfloat16, device="cpu", stride=2,
                                  init_method=nn.init.ones_, sequence_parallel_enabled=True, sequence_dimension=1,
                                  keep_master_weight=True, skip_bias_add=True, pad=True, pad_alignment_size_per_rank=2,
                                  keep_padded_output=True, reduce_dtype=torch.bfloat16, rank_ordering=[1, 0])),
    "RowParallelLinear": (["input_size", "output_size", "bias", "input_is_parallel", "dtype", "device", "stride",
                           "init_method", "sequence_parallel_enabled", "sequence_dimension", "keep_master_weight",
                           "skip_bias_add", "pad", "reduce_output", "tensor_model_parallel_group", "reduce_dtype",
                           "tile_cc", "rank_ordering"],
                          dict(bias=False, input_is_parallel=True, dtype=torch.bfloat16, device="cpu", stride=2,
                               init_method=nn.init.ones_, sequence_parallel_enabled=True, sequence_dimension=1,
                               keep_master_weight=True, skip_bias_add=True, pad=True, reduce_output=False,
                               reduce_dtype=torch.bfloat16, tile_cc=True, rank_ordering=[1, 0])),
    "ParallelEmbedding": (["num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
                           "scale_grad_by_freq", "sparse", "init_method", "device", "dtype", "shard_across_embedding",
                           "pad", "sequence_parallel_enabled", "tensor_model_parallel_group", "use_spmd_rank",
                           "sequence_dimension", "tile_cc", "rank_ordering", "collect_output"],
                          dict(padding_idx=1, max_norm=1.0, norm_type=1.0, scale_grad_by_freq=True, sparse=True,
                               init_method=nn.init.ones_, device="cpu", dtype=torch.bfloat16,
                               shard_across_embedding=True, pad=True, sequence_parallel_enabled=True,
                               use_spmd_rank=True, sequence_dimension=1, tile_cc=True, rank_ordering=[1, 0],
                               collect_output=False)),
}
_POSITIONAL = {"ColumnParallelLinear": (8, 16), "RowParallelLinear": (16, 8), "ParallelEmbedding": (16, 8)}


@pytest.mark.parametrize("layer_name", sorted(_NXD_KEYWORDS))
def test_every_nxd_keyword_works_or_is_refused_by_name(layer_name):
    names, values = _NXD_KEYWORDS[layer_name]
    layer = getattr(layers, layer_name)
    parameters = list(inspect.signature(layer.__init__).parameters)[1:]
    assert parameters[:len(names)] == names, f"{layer_name}: NxD's positional order is {names}, nxdtp has {parameters}"
    with ps.simulated_topology(world_size=2, rank=1, tensor_model_parallel_size=2), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, value in values.items():
            needs = {"sequence_parallel_enabled": {"gather_output": False, "input_is_parallel": True},
                     "skip_bias_add": {}, "reduce_output": {"skip_bias_add": True}}.get(name, {})
            kwargs = {k: v for k, v in needs.items() if k in names}
            try:
                built = layer(*_POSITIONAL[layer_name], **kwargs, **{name: value})
            except (ValueError, TypeError) as error:
                assert f"{name}={value!r}" in str(error) or f"{name}={list(value)!r}" in str(error), (
                    f"{layer_name}({name}={value!r}) was refused without naming the keyword and value: {error}")
                continue
            assert isinstance(built, layer)

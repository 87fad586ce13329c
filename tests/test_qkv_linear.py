"""NxD's GQAQKVColumnParallelLinear (nxdtp.modules.qkv_linear) against dense Q, K, V projections.

A grouped-query attention block built from the layer and a RowParallelLinear output projection, as NxD's Llama model
builds it, computes the dense block's output; every gradient (K and V summed over their copies), the input gradient and
the TP-aware grad norm equal dense. The test states the layout itself: rank r holds query rows
``[r * q_local, (r + 1) * q_local)`` and, for each of its KV slots, a whole copy of dense KV head
``(r * slots + slot) // kv_size_multiplier``. With ``keep_master_weight`` the layer keeps, under NxD's names, the dense
weights the test drew and the shards were cut from.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from nxdtp import parallel_state as ps
from nxdtp.grads import allreduce_sequence_parallel_gradients, get_grad_norm
from nxdtp.layers import RowParallelLinear
from nxdtp.modules.qkv_linear import GQAQKVColumnParallelLinear

TOL = dict(atol=1e-5, rtol=1e-5)
HIDDEN, SEQ, BATCH = 32, 8, 2


def _dense(heads, kv_heads, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (heads * head_dim, HIDDEN), "k": (kv_heads * head_dim, HIDDEN), "v": (kv_heads * head_dim, HIDDEN),
              "o": (HIDDEN, heads * head_dim)}
    weights = {name: torch.randn(shape, generator=g) * 0.2 for name, shape in shapes.items()}
    biases = {name: torch.randn(shape[0], generator=g) * 0.2 for name, shape in shapes.items()}
    return weights, biases


def _attention(q, k, v, head_dim, groups):
    """[batch, seq, heads * head_dim] in; grouped-query causal attention; [batch, seq, heads * head_dim] out."""
    batch, seq = q.shape[:2]
    q, k, v = (t.reshape(batch, seq, -1, head_dim).transpose(1, 2) for t in (q, k, v))
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) / head_dim ** 0.5
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, -1)


def _kv_heads_of_rank(rank, tp, kv_heads, multiplier):
    slots = kv_heads * multiplier // tp
    return [(rank * slots + slot) // multiplier for slot in range(slots)]


def case_gqa_block_equals_dense(heads, kv_heads, head_dim, multiplier, fuse_qkv, sequence_parallel,
                                tell_head_dim=False):
    rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_size()
    what = f"heads={heads} kv={kv_heads} tp={tp} m={multiplier} fuse={fuse_qkv} sp={sequence_parallel}"
    weights, biases = _dense(heads, kv_heads, head_dim)
    dense_params = {f"{kind}_{n}": nn.Parameter(t.clone()) for kind, d in (("w", weights), ("b", biases))
                    for n, t in d.items()}
    qkv = GQAQKVColumnParallelLinear(HIDDEN, [heads * head_dim, kv_heads * head_dim], bias=True, gather_output=False,
                                     kv_size_multiplier=multiplier, fuse_qkv=fuse_qkv,
                                     sequence_parallel_enabled=sequence_parallel,
                                     **(dict(head_dim=head_dim) if tell_head_dim else {}))
    o_proj = RowParallelLinear(heads * head_dim, HIDDEN, input_is_parallel=True,
                               sequence_parallel_enabled=sequence_parallel)
    q_local = heads * head_dim // tp
    kv_rows = lambda t: torch.cat([t[h * head_dim:(h + 1) * head_dim]  # noqa: E731
                                   for h in _kv_heads_of_rank(rank, tp, kv_heads, multiplier)])
    local = {"q": weights["q"][rank * q_local:(rank + 1) * q_local], "k": kv_rows(weights["k"]),
             "v": kv_rows(weights["v"])}
    local_bias = {"q": biases["q"][rank * q_local:(rank + 1) * q_local], "k": kv_rows(biases["k"]),
                  "v": kv_rows(biases["v"])}
    if fuse_qkv:   # NxD's fused state dict keys
        state = {"weight_qkv": torch.cat([local[p] for p in "qkv"]),
                 "bias_qkv": torch.cat([local_bias[p] for p in "qkv"])}
    else:
        state = {**{f"weight_{p}": local[p] for p in "qkv"}, **{f"bias_{p}": local_bias[p] for p in "qkv"}}
    qkv.load_state_dict(state)
    o_proj.load_state_dict({"weight": weights["o"][:, rank * q_local:(rank + 1) * q_local], "bias": biases["o"]})
    torch.testing.assert_close(qkv.weight_qkv, torch.cat([local[p] for p in "qkv"]), atol=0, rtol=0)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=g)
    upstream = torch.randn(BATCH, SEQ, HIDDEN, generator=g)
    dense_x = x.clone().requires_grad_()
    dense_q, dense_k, dense_v = (dense_x @ dense_params[f"w_{p}"].t() + dense_params[f"b_{p}"] for p in "qkv")
    dense_out = _attention(dense_q, dense_k, dense_v, head_dim, heads // kv_heads) @ dense_params["w_o"].t() \
        + dense_params["b_o"]
    (dense_out * upstream).sum().backward()

    groups = (heads // tp) // (kv_heads * multiplier // tp)
    if sequence_parallel:   # NxD's layout: [seq, batch, hidden], this rank's sequence chunk
        x_local = x.transpose(0, 1).chunk(tp)[rank].clone().requires_grad_()
        q, k, v = (t.transpose(0, 1) for t in qkv(x_local))
        out = o_proj(_attention(q, k, v, head_dim, groups).transpose(0, 1))
        expected = dense_out.detach().transpose(0, 1).chunk(tp)[rank]
        (out * upstream.transpose(0, 1).chunk(tp)[rank]).sum().backward()
        torch.testing.assert_close(x_local.grad, dense_x.grad.transpose(0, 1).chunk(tp)[rank], **TOL,
                                   msg=lambda m: f"{what} input grad: {m}")
        allreduce_sequence_parallel_gradients(o_proj.parameters())
    else:
        x_local = x.clone().requires_grad_()
        q, k, v = qkv(x_local)
        out = o_proj(_attention(q, k, v, head_dim, groups))
        expected = dense_out.detach()
        (out * upstream).sum().backward()
        torch.testing.assert_close(x_local.grad, dense_x.grad, **TOL, msg=lambda m: f"{what} input grad: {m}")
    torch.testing.assert_close(out, expected, **TOL, msg=lambda m: f"{what} output: {m}")
    grads = {"q": dense_params["w_q"].grad[rank * q_local:(rank + 1) * q_local], "k": kv_rows(dense_params["w_k"].grad),
             "v": kv_rows(dense_params["w_v"].grad)}
    bias_grads = {"q": dense_params["b_q"].grad[rank * q_local:(rank + 1) * q_local],
                  "k": kv_rows(dense_params["b_k"].grad), "v": kv_rows(dense_params["b_v"].grad)}
    if not fuse_qkv:
        for p in "qkv":
            torch.testing.assert_close(getattr(qkv, "weight_" + p).grad, grads[p], **TOL,
                                       msg=lambda m: f"{what} weight_{p} grad: {m}")
            torch.testing.assert_close(getattr(qkv, "bias_" + p).grad, bias_grads[p], **TOL,
                                       msg=lambda m: f"{what} bias_{p} grad: {m}")
    dense_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in dense_params.values()))
    norm = get_grad_norm(list(qkv.parameters()) + list(o_proj.parameters()))
    torch.testing.assert_close(norm, dense_norm, **TOL, msg=lambda m: f"{what} grad norm: {m}")
    if fuse_qkv:
        _check_fused_parameters_are_trained(qkv, local, local_bias, grads, bias_grads, what)
    return what


def _check_fused_parameters_are_trained(qkv, local, local_bias, grads, bias_grads, what):
    """NxD's fused layer: weight_qkv and bias_qkv are the parameters, in storage of their own (not views of a dense
    tensor); backward leaves the dense gradient's rows of this rank's Q, K and V in their .grad (NxD's test reads
    weight_qkv.grad); an optimizer step on them moves weight_q/_k/_v (their row blocks) by those gradients."""
    assert [name for name, _ in qkv.named_parameters()] == ["weight_qkv", "bias_qkv"], what
    for name, parts in (("weight_qkv", grads), ("bias_qkv", bias_grads)):
        param = getattr(qkv, name)
        assert param.untyped_storage().nbytes() == param.numel() * param.element_size(), f"{what}: {name} is a view"
        torch.testing.assert_close(param.grad, torch.cat([parts[p] for p in "qkv"]), **TOL,
                                   msg=lambda m: f"{what} {name}.grad: {m}")
    torch.optim.SGD(qkv.parameters(), lr=0.5).step()
    for p in "qkv":
        torch.testing.assert_close(getattr(qkv, "weight_" + p), local[p] - 0.5 * grads[p], **TOL,
                                   msg=lambda m: f"{what} weight_{p} after a step: {m}")
        torch.testing.assert_close(getattr(qkv, "bias_" + p), local_bias[p] - 0.5 * bias_grads[p], **TOL,
                                   msg=lambda m: f"{what} bias_{p} after a step: {m}")


@pytest.mark.parametrize("multiplier,fuse,sp", [pytest.param(2, True, False, id="m2-fused"),
                                                pytest.param(2, False, True, id="m2-separate-sp"),
                                                pytest.param(1, True, False, id="m1-fused")])
def test_gqa_block_equals_dense_at_tp4(worlds, multiplier, fuse, sp):
    # 8 query heads over 2 KV heads (m=2: one KV copy per rank) or 4 KV heads (m=1: one KV head per rank).
    kv_heads = 2 if multiplier == 2 else 4
    assert len(worlds(4).run(case_gqa_block_equals_dense, tensor_model_parallel_size=4, heads=8, kv_heads=kv_heads,
                             head_dim=4, multiplier=multiplier, fuse_qkv=fuse, sequence_parallel=sp)) == 4


@pytest.mark.parametrize("tp,sp", [pytest.param(1, False, id="tp1"), pytest.param(2, True, id="tp2-sp")])
def test_fused_weight_qkv_is_the_trained_parameter_at_tp1_and_tp2(worlds, tp, sp):
    # NxD's test_qkv_linear_with_kv_multipler_1[fuse] at the sizes above and below tp=4 (whose fused cases are above):
    # 8 query heads over 2 KV heads, no copies, weight_qkv.grad against the dense Q|K|V gradients.
    assert len(worlds(tp).run(case_gqa_block_equals_dense, tensor_model_parallel_size=tp, heads=8, kv_heads=2,
                              head_dim=4, multiplier=1, fuse_qkv=True, sequence_parallel=sp)) == tp


def test_two_kv_copies_per_rank_need_head_dim(worlds):
    # 4 KV heads x m=2 at tp=4: two copies per rank, so the layer is told the head size.
    assert len(worlds(4).run(case_gqa_block_equals_dense, tensor_model_parallel_size=4, heads=8, kv_heads=4,
                             head_dim=4, multiplier=2, fuse_qkv=False, sequence_parallel=False,
                             tell_head_dim=True)) == 4


def case_initialised_copies_are_equal_and_dense():
    """Under one seed every rank's KV copies are whole dense heads: copies of a head are equal across ranks."""
    from nxdtp import comm

    torch.manual_seed(5)
    layer = GQAQKVColumnParallelLinear(HIDDEN, [8 * 4, 2 * 4], gather_output=False, kv_size_multiplier=2)
    gathered = comm.all_gather(layer.weight_k.detach(), ps.tensor_parallel_group(), dim=0)
    copies = gathered.reshape(2, 2, 4, HIDDEN)  # [KV head, copy, head_dim, hidden]
    assert torch.equal(copies[:, 0], copies[:, 1])
    torch.manual_seed(5)
    dense = torch.empty(8 * 4, HIDDEN)
    nn.init.kaiming_uniform_(dense, a=5 ** 0.5)
    rank = ps.get_tensor_model_parallel_rank()
    assert torch.equal(layer.weight_q, dense[rank * 8:(rank + 1) * 8])
    return True


def test_initialised_copies_are_equal(worlds):
    assert worlds(4).run(case_initialised_copies_are_equal_and_dense, tensor_model_parallel_size=4) == [True] * 4


def case_master_weights_are_the_dense_weights(heads, kv_heads, head_dim, multiplier, fuse_qkv, dtype, seed):
    """NxD's names for the dense weights a layer was cut from: ``master_weight_q/_k/_v`` and ``master_bias_q/_k/_v``,
    or with ``fuse_qkv`` their concatenations ``master_weight_qkv`` / ``master_bias_qkv`` (NxD's tests split these to
    build dense references). The KV masters hold each KV head once, however many copies the ranks hold."""
    rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_size()
    torch.manual_seed(seed)   # the biases are drawn from the default generator: one seed gives every rank the same
    g = torch.Generator().manual_seed(seed)
    sizes = {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim}
    dense = {p: torch.randn(sizes[p], HIDDEN, generator=g) for p in "qkv"}
    drawn = iter(dense[p] for p in "qkv")

    def init_method(master):   # called with each dense weight in turn, Q then K then V, as NxD calls it
        with torch.no_grad():
            master.copy_(next(drawn))

    layer = GQAQKVColumnParallelLinear(HIDDEN, [sizes["q"], sizes["k"]], bias=True, gather_output=False, dtype=dtype,
                                       init_method=init_method, keep_master_weight=True,
                                       kv_size_multiplier=multiplier, fuse_qkv=fuse_qkv)
    masters = {p: getattr(layer, "master_weight_" + p) for p in "qkv"}
    if fuse_qkv:
        fused = layer.master_weight_qkv
        assert tuple(fused.shape) == (sizes["q"] + 2 * sizes["k"], HIDDEN) and fused.dtype == torch.float32
        assert torch.equal(fused, torch.cat([dense[p] for p in "qkv"]))
    master_biases = {p: getattr(layer, "master_bias_" + p) for p in "qkv"}
    if fuse_qkv:
        fused_bias = layer.master_bias_qkv
        # NxD's tests take the parts back by splitting at the dense sizes.
        for p, part, bias_part in zip("qkv", fused.split(list(sizes.values())), fused_bias.split(list(sizes.values()))):
            assert torch.equal(part, masters[p]) and torch.equal(bias_part, master_biases[p]), p
    else:
        assert not hasattr(layer, "master_weight_qkv") and not hasattr(layer, "master_bias_qkv")
    kv_rows = lambda t: torch.cat([t[h * head_dim:(h + 1) * head_dim]  # noqa: E731
                                   for h in _kv_heads_of_rank(rank, tp, kv_heads, multiplier)])
    q_local = sizes["q"] // tp
    for p in "qkv":
        # NxD keeps the master weights in fp32 and the master biases in the layer's dtype.
        assert masters[p].dtype == torch.float32 and master_biases[p].dtype == dtype, p
        assert torch.equal(masters[p], dense[p]), p
        assert tuple(master_biases[p].shape) == (sizes[p],), p
        cut = (lambda t: t[rank * q_local:(rank + 1) * q_local]) if p == "q" else kv_rows  # noqa: E731
        assert torch.equal(getattr(layer, "weight_" + p).detach(), cut(dense[p]).to(dtype)), p
        assert torch.equal(getattr(layer, "bias_" + p).detach(), cut(master_biases[p])), p
    return {p: master_biases[p] for p in "qkv"}


@pytest.mark.parametrize("multiplier,fuse,dtype", [pytest.param(2, True, torch.float32, id="m2-fused"),
                                                   pytest.param(2, False, torch.bfloat16, id="m2-separate-bf16"),
                                                   pytest.param(1, True, torch.bfloat16, id="m1-fused-bf16"),
                                                   pytest.param(1, False, torch.float32, id="m1-separate")])
def test_master_weights_are_the_dense_weights(worlds, multiplier, fuse, dtype):
    # m=2: 2 KV heads, each on two of the 4 ranks; m=1: 4 KV heads, one per rank. Every rank keeps the same masters.
    kv_heads = 2 if multiplier == 2 else 4
    seed = int(torch.randint(0, 2 ** 31, (1,)))
    biases = worlds(4).run(case_master_weights_are_the_dense_weights, tensor_model_parallel_size=4, heads=8,
                           kv_heads=kv_heads, head_dim=4, multiplier=multiplier, fuse_qkv=fuse, dtype=dtype, seed=seed)
    for rank_biases in biases[1:]:
        for p in "qkv":
            assert torch.equal(rank_biases[p], biases[0][p]), p


def test_master_weights_on_meta_and_without_keep_master_weight():
    # On the meta device nothing is drawn, so the masters are None, as NxD's are; without keep_master_weight nxdtp's
    # layers keep no master attributes at all (docs/nxd_migration.md).
    with ps.simulated_topology(world_size=4, rank=1, tensor_model_parallel_size=4):
        meta = GQAQKVColumnParallelLinear(HIDDEN, [32, 8], gather_output=False, device="meta", keep_master_weight=True)
        assert meta.master_weight_qkv is None and meta.master_bias_qkv is None
        assert all(getattr(meta, f"master_{kind}_{p}") is None for kind in ("weight", "bias") for p in "qkv")
        plain = GQAQKVColumnParallelLinear(HIDDEN, [32, 8], gather_output=False, bias=False, fuse_qkv=False)
        assert not [name for name in vars(plain) if name.startswith("master_")]


def test_fused_parameters_and_their_parts_in_state_dicts():
    """Fused: the parameters are weight_qkv / bias_qkv, the state dict holds the parts (the objects weight_q, ... are,
    views of the fused storage, as code pairing specs with state dicts by identity needs), and either layout loads
    into either form, a partial dict reporting the parts it lacks and a wrong shape naming the key."""
    import copy

    with ps.simulated_topology(world_size=4, rank=1, tensor_model_parallel_size=4):
        torch.manual_seed(2)
        fused = GQAQKVColumnParallelLinear(HIDDEN, [32, 8], gather_output=False, kv_size_multiplier=2)
        torch.manual_seed(3)
        separate = GQAQKVColumnParallelLinear(HIDDEN, [32, 8], gather_output=False, kv_size_multiplier=2,
                                              fuse_qkv=False)
    parts = ["weight_q", "bias_q", "weight_k", "bias_k", "weight_v", "bias_v"]
    assert [name for name, _ in fused.named_parameters()] == ["weight_qkv", "bias_qkv"]
    assert list(fused.state_dict()) == list(separate.state_dict()) == parts + ["_extra_state"]
    kept = fused.state_dict(keep_vars=True)
    assert all(kept[name] is getattr(fused, name) for name in parts)
    assert fused.weight_k.untyped_storage().data_ptr() == fused.weight_qkv.untyped_storage().data_ptr()
    assert (fused.weight_qkv.replica_segments, fused.weight_qkv.fused_parts) == \
        (((8, 1), (4, 2), (4, 2)), ("weight_q", "weight_k", "weight_v"))
    separate.load_state_dict(fused.state_dict())
    assert torch.equal(separate.weight_qkv, fused.weight_qkv) and torch.equal(separate.bias_qkv, fused.bias_qkv)
    before = fused.weight_qkv.detach().clone()
    result = fused.load_state_dict({"weight_k": torch.ones(4, HIDDEN)}, strict=False)
    assert sorted(result.missing_keys) == sorted(set(parts) - {"weight_k"}), result
    assert torch.equal(fused.weight_qkv, torch.cat([before[:8], torch.ones(4, HIDDEN), before[12:]]))
    with pytest.raises(RuntimeError, match=r"weight_k has shape \[3, 32\], but this rank's part has shape \[4, 32\]"):
        fused.load_state_dict({"weight_k": torch.ones(3, HIDDEN)}, strict=False)
    copied = copy.deepcopy(fused).double()   # new fused parameters: the views follow them
    assert copied.weight_v.dtype == torch.float64 and torch.equal(copied.weight_v, fused.weight_v.double())
    assert copied.weight_v.untyped_storage().data_ptr() == copied.weight_qkv.untyped_storage().data_ptr()
    assert copied.weight_qkv.replica_segments == fused.weight_qkv.replica_segments


class _Block(nn.Module):
    def __init__(self, multiplier):
        super().__init__()
        self.qkv_proj = GQAQKVColumnParallelLinear(HIDDEN, [8 * 4, 2 * 4], gather_output=False,
                                                   kv_size_multiplier=multiplier)


def case_save(directory):
    from nxdtp import checkpointing

    torch.manual_seed(9)
    block = _Block(multiplier=2)   # tp=4: each of the 2 KV heads twice
    checkpointing.save({"model": block, "global_step": 1}, directory)
    return _parts(block)


def case_load(directory):
    from nxdtp import checkpointing

    torch.manual_seed(10)
    block = _Block(multiplier=1)   # tp=2: the KV heads split evenly
    checkpointing.load(directory, model=block)
    return _parts(block)


def _parts(block):
    """Q, K and V's weights and biases as the state dict (and so the checkpoint) holds them; the parameters are the
    fused weight_qkv / bias_qkv."""
    assert sorted(name for name, _ in block.named_parameters()) == ["qkv_proj.bias_qkv", "qkv_proj.weight_qkv"]
    return {key: value.clone() for key, value in block.state_dict().items() if isinstance(value, torch.Tensor)}


def test_checkpoint_merges_to_dense_and_reshards(worlds, tmp_path):
    from safetensors.torch import load_file

    from nxdtp.checkpointing.merge import merge, reshard

    saved = worlds(4).run(case_save, tensor_model_parallel_size=4, directory=str(tmp_path / "tp4"))
    merge(str(tmp_path / "tp4"), str(tmp_path / "merged"), progress=False)
    dense = load_file(os.path.join(str(tmp_path / "merged"), "model.safetensors"))
    assert tuple(dense["qkv_proj.weight_k"].shape) == (2 * 4, HIDDEN)   # one copy of each KV head
    for kv_head, ranks in enumerate(((0, 1), (2, 3))):
        for rank in ranks:
            assert torch.equal(saved[rank]["qkv_proj.weight_k"],
                               dense["qkv_proj.weight_k"][kv_head * 4:(kv_head + 1) * 4])
    assert torch.equal(torch.cat([s["qkv_proj.weight_q"] for s in saved]), dense["qkv_proj.weight_q"])
    reshard(str(tmp_path / "tp4"), str(tmp_path / "tp2"), 2, progress=False)
    loaded = worlds(2).run(case_load, tensor_model_parallel_size=2, directory=str(tmp_path / "tp2"))
    for part in ("weight_q", "weight_k", "weight_v", "bias_k"):
        key = "qkv_proj." + part
        assert torch.equal(torch.cat([r[part] if part in r else r[key] for r in loaded]), dense[key]), key


def test_bad_arguments_are_named():
    with ps.simulated_topology(world_size=4, rank=0, tensor_model_parallel_size=4):
        with pytest.raises(ValueError, match=r"kv_size_multiplier=3 does not divide tensor_model_parallel_size=4"):
            GQAQKVColumnParallelLinear(HIDDEN, [32, 8], kv_size_multiplier=3)
        with pytest.raises(ValueError, match=r"output_sizes\[1\] \* kv_size_multiplier = 3 \* 2 is not divisible"):
            GQAQKVColumnParallelLinear(HIDDEN, [32, 3], gather_output=False, kv_size_multiplier=2)
        with pytest.raises(ValueError, match=r"head_dim=3 does not divide output_sizes=\[32, 8\]"):
            GQAQKVColumnParallelLinear(HIDDEN, [32, 8], gather_output=False, kv_size_multiplier=2, head_dim=3)
        with pytest.raises(ValueError, match=r"gather_output=True with kv_size_multiplier=2"):
            GQAQKVColumnParallelLinear(HIDDEN, [32, 8], kv_size_multiplier=2)
        with pytest.raises(ValueError, match=r"output_sizes=\[32\] must be \[q_size, kv_size\]"):
            GQAQKVColumnParallelLinear(HIDDEN, [32])
        with pytest.raises(ValueError, match=r"reduce_dtype=torch.bfloat16 is not supported"):
            GQAQKVColumnParallelLinear(HIDDEN, [32, 8], reduce_dtype=torch.bfloat16)
        layer = GQAQKVColumnParallelLinear(HIDDEN, [32, 8], gather_output=False)
        with pytest.raises(RuntimeError, match=r"weight_qkv has 9 rows, but this rank's Q, K and V have \[8, 2, 2\]"):
            layer.load_state_dict({"weight_qkv": torch.zeros(9, HIDDEN)}, strict=False)


# ---- the fused parameters under ZeRO-1 and in checkpoints ---------------------------------------------------------

class _Attention(nn.Module):
    """NxD's Llama attention in small: the fused Q|K|V layer, grouped-query causal attention, the output projection."""

    def __init__(self, heads, kv_heads, head_dim, multiplier, fuse_qkv=True):
        super().__init__()
        self.head_dim = head_dim
        self.qkv_proj = GQAQKVColumnParallelLinear(HIDDEN, [heads * head_dim, kv_heads * head_dim], gather_output=False,
                                                   kv_size_multiplier=multiplier, fuse_qkv=fuse_qkv)
        self.o_proj = RowParallelLinear(heads * head_dim, HIDDEN, input_is_parallel=True)

    def forward(self, x):
        q, k, v = self.qkv_proj(x)
        return self.o_proj(_attention(q, k, v, self.head_dim, q.shape[-1] // k.shape[-1]))   # this rank's groups


def _dense_attention_loss(params, batches, head_dim, groups):
    """The dense model's loss: the mean over the data-parallel ranks' batches of (output * upstream).sum()."""
    total = 0
    for x, upstream in batches:
        q, k, v = (x @ params[f"w_{p}"].t() + params[f"b_{p}"] for p in "qkv")
        out = _attention(q, k, v, head_dim, groups) @ params["w_o"].t() + params["b_o"]
        total = total + (out * upstream).sum()
    return total / len(batches)


def case_zero1_trains_the_fused_parameters(directory):
    """ZeRO-1 (SGD with momentum) over weight_qkv with KV copies (6 query heads over 1 KV head at tp=2: m=2), each DP
    rank on its own batch. Its pre-clip norm counts each KV copy once and its step equals the dense model's; a
    checkpoint of model and optimizer resumes bit-exactly; DCP's live state refuses the fused parameter by name."""
    from nxdtp import checkpointing
    from nxdtp.checkpointing.dcp_state import get_state_dict
    from nxdtp.optimizer import NeuronZero1Optimizer

    rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_size()
    dp, dp_rank = ps.get_data_parallel_size(), ps.get_data_parallel_rank()
    heads, kv_heads, head_dim, lr = 6, 1, 4, 0.1
    weights, biases = _dense(heads, kv_heads, head_dim, seed=7)
    dense = {f"{kind}_{n}": nn.Parameter(t.clone()) for kind, d in (("w", weights), ("b", biases))
             for n, t in d.items()}
    g = torch.Generator().manual_seed(8)
    batches = [(torch.randn(BATCH, SEQ, HIDDEN, generator=g), torch.randn(BATCH, SEQ, HIDDEN, generator=g))
               for _ in range(dp)]
    q_local = heads * head_dim // tp
    cut = {"q": lambda t: t[rank * q_local:(rank + 1) * q_local], "k": lambda t: t[:head_dim],
           "v": lambda t: t[:head_dim]}   # the one KV head, copied on every rank

    def build():
        block = _Attention(heads, kv_heads, head_dim, multiplier=tp)
        # nxdtp's per-part keys load into the fused parameters.
        block.qkv_proj.load_state_dict({**{f"weight_{p}": cut[p](weights[p]) for p in "qkv"},
                                        **{f"bias_{p}": cut[p](biases[p]) for p in "qkv"}})
        block.o_proj.load_state_dict({"weight": weights["o"][:, rank * q_local:(rank + 1) * q_local],
                                      "bias": biases["o"]})
        return block, NeuronZero1Optimizer(block.parameters(), torch.optim.SGD, lr=lr, momentum=0.9, max_norm=1e9)

    def step(block, zero):
        x, upstream = batches[dp_rank]
        zero.zero_grad()
        (block(x) * upstream).sum().backward()
        zero.step()

    block, zero = build()
    step(block, zero)
    _dense_attention_loss(dense, batches, head_dim, heads // kv_heads).backward()
    dense_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in dense.values()))
    torch.testing.assert_close(zero.grad_norm, dense_norm, **TOL, msg=lambda m: f"ZeRO-1 grad norm: {m}")
    for p in "qkv":   # SGD's first step with momentum moves by lr * gradient
        for kind, name in (("w", "weight"), ("b", "bias")):
            expected = cut[p](dense[f"{kind}_{p}"] - lr * dense[f"{kind}_{p}"].grad).detach()
            torch.testing.assert_close(getattr(block.qkv_proj, f"{name}_{p}"), expected, **TOL,
                                       msg=lambda m: f"{name}_{p} after the ZeRO-1 step: {m}")
    with pytest.raises(ValueError, match=r"ZeRO-1 optimizer holds 'qkv_proj.weight_qkv', a fused parameter whose "
                                         r"parts \['qkv_proj.weight_q'"):
        get_state_dict(block, zero)
    checkpointing.save({"model": block, "optimizer": zero, "global_step": 1}, directory)
    resumed, resumed_zero = build()
    checkpointing.load(directory, model=resumed, optimizer=resumed_zero)
    step(block, zero)
    step(resumed, resumed_zero)   # the momentum buffers must have come back for this step to match
    return {name: torch.equal(a, b) for (name, a), (_, b) in zip(block.named_parameters(), resumed.named_parameters())}


def test_zero1_trains_and_checkpoints_the_fused_parameters(worlds, tmp_path):
    from nxdtp.checkpointing.merge import merge, reshard

    directory = str(tmp_path / "ckpt")
    results = worlds(4).run(case_zero1_trains_the_fused_parameters, tensor_model_parallel_size=2, directory=directory)
    assert results == [dict.fromkeys(["qkv_proj.weight_qkv", "qkv_proj.bias_qkv", "o_proj.weight", "o_proj.bias"],
                                     True)] * 4, results
    # ZeRO-1's flat shards of the fused parameter mix Q's, K's and V's rows: merge and reshard refuse them by name
    # (never a merge without them); the model alone merges.
    for move in (lambda: merge(directory, str(tmp_path / "merged"), progress=False),
                 lambda: reshard(directory, str(tmp_path / "tp1"), 1, progress=False)):
        with pytest.raises(ValueError, match=r"ZeRO-1 optimizer state of the fused parameter 'qkv_proj.weight_qkv' "
                                             r"\(parts \['qkv_proj.weight_q', 'qkv_proj.weight_k', 'qkv_proj.weight_v"):
            move()
    merge(directory, str(tmp_path / "merged"), progress=False, optimizer=False)


# ---- a plain optimizer's state of the fused parameters merges, reshards and goes through DCP as the parts' ----------

_ADAM_HEADS, _ADAM_KV_HEADS, _ADAM_HEAD_DIM = 4, 2, 4


def _adam_block(fuse_qkv, multiplier, weights, biases):
    """The attention block at this TP size, every weight and bias from the dense ones, and its AdamW."""
    def shard_of(spec, dense, rank):
        return spec.piece_of_full(spec.full_from_dense(dense), rank)

    block = _Attention(_ADAM_HEADS, _ADAM_KV_HEADS, _ADAM_HEAD_DIM, multiplier, fuse_qkv=fuse_qkv)
    specs = {**block.qkv_proj.param_specs(), **{"o_" + k: v for k, v in block.o_proj.param_specs().items()}}
    rank = ps.get_tensor_model_parallel_rank()
    state = {}
    for p in "qkv":
        state[f"qkv_proj.weight_{p}"] = shard_of(specs[f"weight_{p}"], weights[p], rank)
        state[f"qkv_proj.bias_{p}"] = shard_of(specs[f"bias_{p}"], biases[p], rank)
    state["o_proj.weight"] = shard_of(specs["o_weight"], weights["o"], rank)
    state["o_proj.bias"] = biases["o"]
    block.load_state_dict(state, strict=False)
    return block, torch.optim.AdamW(block.parameters(), lr=0.01, weight_decay=0.1)


def _adam_batches(steps):
    g = torch.Generator().manual_seed(12)
    return [(torch.randn(BATCH, SEQ, HIDDEN, generator=g), torch.randn(BATCH, SEQ, HIDDEN, generator=g))
            for _ in range(steps)]


def _part_state(block, optimizer):
    """The optimizer's exp_avg / exp_avg_sq of Q, K and V's weights and biases, by part name, fused or not."""
    out = {}
    layer = block.qkv_proj
    for kind in ("weight", "bias"):
        if layer.fuse_qkv:
            fused = optimizer.state[getattr(layer, kind + "_qkv")]
            rows = [layer.q_output_size_per_partition] + [layer.kv_output_size_per_partition] * 2
            for field in ("exp_avg", "exp_avg_sq"):
                for p, piece in zip("qkv", fused[field].split(rows)):
                    out[f"{kind}_{p}.{field}"] = piece.clone()
        else:
            for p in "qkv":
                for field in ("exp_avg", "exp_avg_sq"):
                    out[f"{kind}_{p}.{field}"] = optimizer.state[getattr(layer, f"{kind}_{p}")][field].clone()
    return out


def case_adamw_fused_and_not(directory, fuse_qkv, multiplier, steps=2):
    """Two AdamW steps of the block (fused or not), saved with nxdtp.checkpointing.save; its state by part name."""
    from nxdtp import checkpointing

    weights, biases = _dense(_ADAM_HEADS, _ADAM_KV_HEADS, _ADAM_HEAD_DIM, seed=11)
    block, adam = _adam_block(fuse_qkv, multiplier, weights, biases)
    for x, upstream in _adam_batches(steps):
        adam.zero_grad()
        (block(x) * upstream).sum().backward()
        adam.step()
    checkpointing.save({"model": block, "optimizer": adam, "global_step": steps}, directory)
    return _part_state(block, adam)


def case_adamw_load(directory, fuse_qkv, multiplier):
    """A fresh block (fused or not) at this TP size loads a checkpoint: its optimizer state by part name."""
    from nxdtp import checkpointing

    weights, biases = _dense(_ADAM_HEADS, _ADAM_KV_HEADS, _ADAM_HEAD_DIM, seed=13)   # other values: all are loaded
    block, adam = _adam_block(fuse_qkv, multiplier, weights, biases)
    checkpointing.load(directory, model=block, optimizer=adam)
    return _part_state(block, adam)


def case_adamw_load_dense(directory, fuse_qkv, multiplier):
    """A fresh block (fused or not) at this TP size restores the dense optimizer state a merge wrote beside the model
    (load_dense_optimizer_state): its optimizer state by part name."""
    from nxdtp.checkpointing import load_dense_optimizer_state

    weights, biases = _dense(_ADAM_HEADS, _ADAM_KV_HEADS, _ADAM_HEAD_DIM, seed=13)
    block, adam = _adam_block(fuse_qkv, multiplier, weights, biases)
    load_dense_optimizer_state(directory, block, adam)
    return _part_state(block, adam)


def _dense_adamw_state(steps=2):
    """Dense AdamW's moments of Q, K and V's weights and biases after the same steps on the same batches."""
    weights, biases = _dense(_ADAM_HEADS, _ADAM_KV_HEADS, _ADAM_HEAD_DIM, seed=11)
    params = {f"{kind}_{n}": nn.Parameter(t.clone()) for kind, d in (("w", weights), ("b", biases))
              for n, t in d.items()}
    adam = torch.optim.AdamW(params.values(), lr=0.01, weight_decay=0.1)
    for batch in _adam_batches(steps):
        adam.zero_grad()
        _dense_attention_loss(params, [batch], _ADAM_HEAD_DIM, _ADAM_HEADS // _ADAM_KV_HEADS).backward()
        adam.step()
    return {f"qkv_proj.{'weight' if kind == 'w' else 'bias'}_{p}.{field}": adam.state[params[f"{kind}_{p}"]][field]
            for kind in "wb" for p in "qkv" for field in ("exp_avg", "exp_avg_sq")}


def test_fused_adamw_state_merges_and_reshards_as_the_unfused_layers(worlds, tmp_path):
    """AdamW over the fused weight_qkv / bias_qkv at tp=2: the checkpoint's optimizer state is Q's, K's and V's, so
    the merge writes the dense AdamW's moments (equal to the unfused layer's merge), and a reshard to tp=4 (each KV
    head on two ranks) loads into a fused layer there with the moments the unfused layer's reshard gives."""
    from safetensors.torch import load_file

    from nxdtp.checkpointing.merge import merge, reshard

    saved = {}
    for fuse in (True, False):
        saved[fuse] = worlds(2).run(case_adamw_fused_and_not, tensor_model_parallel_size=2,
                                    directory=str(tmp_path / f"fused{fuse}"), fuse_qkv=fuse, multiplier=1)
        merge(str(tmp_path / f"fused{fuse}"), str(tmp_path / f"merged{fuse}"), progress=False)
    for a, b in zip(saved[True], saved[False]):
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-6, msg=lambda m: f"{key} live: {m}")
    merged = {fuse: load_file(str(tmp_path / f"merged{fuse}" / "optimizer.safetensors")) for fuse in (True, False)}
    assert merged[True].keys() == merged[False].keys()
    for key in merged[False]:
        torch.testing.assert_close(merged[True][key], merged[False][key], atol=1e-6, rtol=1e-6,
                                   msg=lambda m: f"merged {key}: {m}")
    for key, expected in _dense_adamw_state().items():
        torch.testing.assert_close(merged[True]["state." + key], expected, **TOL, msg=lambda m: f"dense {key}: {m}")
    models = {fuse: load_file(str(tmp_path / f"merged{fuse}" / "model.safetensors")) for fuse in (True, False)}
    assert all(torch.equal(models[True][k], models[False][k]) for k in models[False]) and \
        models[True].keys() == models[False].keys()
    loaded = {}
    for fuse in (True, False):
        reshard(str(tmp_path / f"fused{fuse}"), str(tmp_path / f"tp4{fuse}"), 4, progress=False)
        loaded[fuse] = worlds(4).run(case_adamw_load, tensor_model_parallel_size=4,
                                     directory=str(tmp_path / f"tp4{fuse}"), fuse_qkv=fuse, multiplier=2)
    # The fused checkpoint, resharded, into an unfused layer too: one layout.
    across = worlds(4).run(case_adamw_load, tensor_model_parallel_size=4, directory=str(tmp_path / "tp4True"),
                           fuse_qkv=False, multiplier=2)
    for fused_rank, unfused_rank, across_rank in zip(loaded[True], loaded[False], across):
        for key in unfused_rank:
            assert torch.equal(fused_rank[key], unfused_rank[key]), key
            assert torch.equal(across_rank[key], unfused_rank[key]), key
    # The merged dense optimizer state restores into a fused layer at tp=4 as the reshard does.
    dense_loaded = worlds(4).run(case_adamw_load_dense, tensor_model_parallel_size=4,
                                 directory=str(tmp_path / "mergedTrue"), fuse_qkv=True, multiplier=2)
    for got, want in zip(dense_loaded, loaded[False]):
        assert all(torch.equal(got[key], want[key]) for key in want)
    # At the saved size, the unfused layer's checkpoint loads into the fused layer: its moments, bit for bit.
    back = worlds(2).run(case_adamw_load, tensor_model_parallel_size=2, directory=str(tmp_path / "fusedFalse"),
                         fuse_qkv=True, multiplier=1)
    for got, want in zip(back, saved[False]):
        assert all(torch.equal(got[key], want[key]) for key in want)


def test_fused_adamw_state_with_kv_copies_merges_to_the_dense_moments(worlds, tmp_path):
    """At tp=4 with each KV head on two ranks (m=2), the merged state of the fused layer's AdamW is the dense one's."""
    from safetensors.torch import load_file

    from nxdtp.checkpointing.merge import merge

    worlds(4).run(case_adamw_fused_and_not, tensor_model_parallel_size=4, directory=str(tmp_path / "tp4"),
                  fuse_qkv=True, multiplier=2)
    merge(str(tmp_path / "tp4"), str(tmp_path / "merged"), progress=False)
    merged = load_file(str(tmp_path / "merged" / "optimizer.safetensors"))
    for key, expected in _dense_adamw_state().items():
        torch.testing.assert_close(merged["state." + key], expected, **TOL, msg=lambda m: f"dense {key}: {m}")


def case_adamw_dcp_round_trip(checkpoint):
    """Live DCP of the fused block's AdamW state: dcp.save(get_state_dict) from the fused layer, dcp.load into a fresh
    fused layer and a fresh unfused one; each one's moments by part name."""
    import torch.distributed.checkpoint as dcp

    from nxdtp.checkpointing.dcp_state import dcp_process_group, get_state_dict, set_state_dict

    weights, biases = _dense(_ADAM_HEADS, _ADAM_KV_HEADS, _ADAM_HEAD_DIM, seed=11)
    block, adam = _adam_block(True, 1, weights, biases)
    for x, upstream in _adam_batches(2):
        adam.zero_grad()
        (block(x) * upstream).sum().backward()
        adam.step()
    state = get_state_dict(block, adam)
    assert "state.qkv_proj.weight_k.exp_avg" in state["optimizer"]
    dcp.save(state, checkpoint_id=checkpoint, process_group=dcp_process_group())
    results = {"saved": _part_state(block, adam)}
    for fuse in (True, False):
        other_weights, other_biases = _dense(_ADAM_HEADS, _ADAM_KV_HEADS, _ADAM_HEAD_DIM, seed=14)
        fresh, fresh_adam = _adam_block(fuse, 1, other_weights, other_biases)
        state = get_state_dict(fresh, fresh_adam)
        dcp.load(state, checkpoint_id=checkpoint, process_group=dcp_process_group())
        set_state_dict(fresh, fresh_adam, state)
        results[fuse] = _part_state(fresh, fresh_adam)
        results[f"step{fuse}"] = [float(s["step"]) for s in fresh_adam.state.values()]
    return results


def test_fused_adamw_state_round_trips_through_live_dcp(worlds, tmp_path):
    results = worlds(2).run(case_adamw_dcp_round_trip, tensor_model_parallel_size=2,
                            checkpoint=str(tmp_path / "dcp"))
    for rank in results:
        for fuse in (True, False):
            assert rank[fuse].keys() == rank["saved"].keys()
            assert all(torch.equal(rank[fuse][key], rank["saved"][key]) for key in rank["saved"]), fuse
            assert set(rank[f"step{fuse}"]) == {2.0}

"""Sequence parallelism keeps shards: what autograd saves for a sequence-parallel column layer, the QKV module, a BERT
model and a decoder, and that their gradients still equal dense (gloo ranks, tp=2 and tp=4).

What autograd saves is recorded with ``torch.autograd.graph.saved_tensors_hooks`` around the forward. A
sequence-parallel column layer must save its sequence shard of the input (the very tensor it was given) and its weight,
nothing of the gathered full sequence; with a frozen weight only the weight. Collectives are counted by wrapping
``nxdtp.comm``: backward re-gathers the input once per gathered tensor, however many layers read it (Q, K and V share
one re-gather). For a whole BERT model with SP, the bytes saved are compared with the same model whose entry regions
are plain all-gathers (nxdtp before this change): the difference is exactly the gathered inputs of the QKV and MLP
column layers minus their shards; for a Llama decoder also the vocab-parallel LM head's input after the final gather.
Every parameter is randomised; fp32 tolerance 1e-5 (sums of at most 32 terms), bf16 2e-2 (8 significant bits).
"""

from __future__ import annotations

import contextlib
import copy
from unittest import mock

import pytest
import torch
from torch import nn

from nxdtp import comm, mappings, sequence_parallel_linear
from nxdtp.grads import allreduce_sequence_parallel_gradients
from nxdtp.layers import ColumnParallelLinear, LinearWithAsyncCommunication
from nxdtp.modules.qkv_linear import GQAQKVColumnParallelLinear
from nxdtp.record import note_of
from nxdtp.sharded_init import shard_of
from tests.test_layers import _close, _data_seed, _randn, _randomise_, _slice, _tp

WORLDS = [pytest.param(2, 2, id="tp2"), pytest.param(4, 4, id="tp4")]


# ---- helpers (run inside the workers) --------------------------------------------------------------------------------

class _Saved:
    """Every tensor autograd packs for backward while active."""

    def __init__(self):
        self.tensors = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor):
        self.tensors.append(tensor)
        return tensor

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    def storages(self):
        """One saved tensor per distinct storage (Q, K and V save one shard three times)."""
        seen = {}
        for t in self.tensors:
            seen.setdefault(t.untyped_storage().data_ptr(), t)
        return list(seen.values())

    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.storages())


@contextlib.contextmanager
def _counting_collectives():
    """Count nxdtp.comm's collectives: {"all_gather": n, "reduce_scatter": n, "all_reduce": n}."""
    counts = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    patches = []
    for name in counts:
        real = getattr(comm, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        patches.append(mock.patch.object(comm, name, counted))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield counts


def _check_saved_is_shard(saved: _Saved, shard: torch.Tensor, weights, seq_dim: int, seq: int, what: str,
                          keeps_shard: bool = True) -> None:
    weight_storages = {w.untyped_storage().data_ptr() for w in weights}
    for t in saved.tensors:
        if t.untyped_storage().data_ptr() in weight_storages:
            continue
        assert t.shape[seq_dim] != seq, (
            f"{what}: a saved tensor of shape {tuple(t.shape)} has the full sequence ({seq}) along dim {seq_dim}")
    expected = ([shard] if keeps_shard else []) + list(weights)
    got = {t.untyped_storage().data_ptr() for t in saved.storages()}
    want = {t.untyped_storage().data_ptr() for t in expected}
    assert got == want, (f"{what}: saved {[tuple(t.shape) for t in saved.storages()]}, expected "
                         f"{[tuple(t.shape) for t in expected]} (the input shard and the weight)")
    assert saved.nbytes() == sum(t.untyped_storage().nbytes() for t in expected), what


# ---- 1. a sequence-parallel ColumnParallelLinear ---------------------------------------------------------------------

def _check_column(seed, seq_dim, bias=True, skip_bias_add=False, stride=1, pad=False, reduce_dtype=torch.float32,
                  frozen=False, input_grad=True, dtype=torch.float32):
    rank, tp = _tp()
    what = (f"Column(SP, sequence_dimension={seq_dim}, bias={bias}, skip_bias_add={skip_bias_add}, stride={stride}, "
            f"pad={pad}, reduce_dtype={reduce_dtype}, frozen={frozen}, input_grad={input_grad}, {dtype}, tp={tp})")
    seq, batch, hidden = 4 * tp, 3, 5
    padded = 6 * tp * stride
    out = padded - 1 if pad else padded
    # The dense reference holds the padded rows as zeros, so its output is the layer's padded output.
    dense = nn.Linear(hidden, padded, bias=bias)
    _randomise_(dense, seed)
    with torch.no_grad():
        dense.weight[out:].zero_()
        if bias:
            dense.bias[out:].zero_()
    col = ColumnParallelLinear(hidden, out, bias=bias, gather_output=False, sequence_parallel_enabled=True,
                               sequence_dimension=seq_dim, stride=stride, skip_bias_add=skip_bias_add, pad=pad,
                               reduce_dtype=reduce_dtype)
    with torch.no_grad():
        col.weight.copy_(shard_of(dense.weight.detach(), 0, rank, tp, stride))
        if bias:
            col.bias.copy_(shard_of(dense.bias.detach(), 0, rank, tp, stride))
    dense, col = dense.to(dtype), col.to(dtype)
    if pad:
        col.eval()  # pad=True is for inference; its gradients still flow
    if frozen:
        dense.weight.requires_grad_(False)
        col.weight.requires_grad_(False)

    shape = (seq, batch, hidden) if seq_dim == 0 else (batch, seq, hidden)
    x = _randn(shape, _data_seed(seed + 10)).to(dtype)
    xd = x.clone().requires_grad_(input_grad)
    shard = _slice(x, seq_dim, rank, tp).clone().requires_grad_(input_grad)
    yd = dense(xd)
    with _Saved() as saved, _counting_collectives() as forward_counts:
        result = col(shard)
    y, returned_bias = result if skip_bias_add else (result, None)
    if skip_bias_add and bias:
        assert returned_bias is col.bias, what
        y = y + returned_bias
    _check_saved_is_shard(saved, shard, [col.weight], seq_dim, seq, what, keeps_shard=not frozen)
    assert forward_counts == {"all_gather": 1, "reduce_scatter": 0, "all_reduce": 0}, f"{what}: {forward_counts}"

    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    assert y.shape[seq_dim] == seq, f"{what}: output {tuple(y.shape)} is not the full sequence"
    torch.testing.assert_close(y.detach(), _slice(yd.detach(), -1, rank, tp, stride), **tol,
                               msg=lambda m: f"{what} output: {m}")
    g = _randn(yd.shape, _data_seed(seed + 11)).to(dtype)
    yd.backward(g)
    with _counting_collectives() as backward_counts:
        y.backward(_slice(g, -1, rank, tp, stride))
    # Backward: the input is re-gathered for the weight gradient, and the input gradient is reduce-scattered.
    expected = {"all_gather": 0 if frozen else 1, "reduce_scatter": 1 if input_grad else 0, "all_reduce": 0}
    assert backward_counts == expected, f"{what}: backward collectives {backward_counts}, expected {expected}"

    def close(actual, reference, name):
        assert actual is not None, f"{what} {name}: no gradient"
        torch.testing.assert_close(actual, reference, **tol, msg=lambda m: f"{what} {name}: {m}")

    if input_grad:
        close(shard.grad, _slice(xd.grad, seq_dim, rank, tp), "input grad")
    if frozen:
        assert col.weight.grad is None, what
    else:
        close(col.weight.grad, _slice(dense.weight.grad, 0, rank, tp, stride), "weight grad")
    if bias:
        close(col.bias.grad, _slice(dense.bias.grad, 0, rank, tp, stride), "bias grad")


def case_column_layer():
    seed = 100
    for seq_dim in (0, 1):
        for kwargs in (dict(), dict(bias=False), dict(skip_bias_add=True), dict(stride=3), dict(pad=True),
                       dict(reduce_dtype=torch.float64), dict(frozen=True), dict(input_grad=False),
                       dict(dtype=torch.bfloat16), dict(dtype=torch.bfloat16, reduce_dtype=torch.float32)):
            seed += 10
            _check_column(seed, seq_dim, **kwargs)
    return True


@pytest.mark.parametrize("world,tp", WORLDS)
def test_sequence_parallel_column_saves_its_shard_and_equals_dense(worlds, world, tp):
    assert worlds(world).run(case_column_layer, tensor_model_parallel_size=tp) == [True] * world


def case_functional_and_autocast():
    """NxD's functional entry and autocast: the cast shard is saved, not a cast of the gathered sequence."""
    rank, tp = _tp()
    seq, batch, hidden, out = 4 * tp, 2, 6, 4 * tp
    weight = _randn((out, hidden), 7).requires_grad_()
    x = _randn((seq, batch, hidden), _data_seed(8))
    shard = _slice(x, 0, rank, tp).clone().requires_grad_()
    local_weight = _slice(weight.detach(), 0, rank, tp).clone().requires_grad_()
    with _Saved() as saved:
        y = LinearWithAsyncCommunication.apply(shard, local_weight, None, False, True, 0)
    _check_saved_is_shard(saved, shard, [local_weight], 0, seq, "LinearWithAsyncCommunication")
    with _Saved() as saved, torch.autocast("cpu", dtype=torch.bfloat16):
        from nxdtp.layers import linear_with_async_allreduce
        yb = linear_with_async_allreduce(shard, local_weight, None, False, True, 0)
    assert yb.dtype == torch.bfloat16
    shapes = sorted(tuple(t.shape) for t in saved.storages())
    assert shapes == sorted([tuple(shard.shape), tuple(local_weight.shape)]), f"autocast saved {shapes}"
    assert all(t.dtype == torch.bfloat16 for t in saved.storages()), [t.dtype for t in saved.storages()]
    yd = x @ weight.detach().t()
    _close(y.detach(), _slice(yd, -1, rank, tp), "functional output")
    y.backward(torch.ones_like(y))
    _close(shard.grad, _slice(torch.ones(seq, batch, out) @ weight.detach(), 0, rank, tp), "functional input grad")
    return True


def test_functional_entry_and_autocast_save_the_shard(worlds):
    assert worlds(2).run(case_functional_and_autocast, tensor_model_parallel_size=2) == [True, True]


# ---- 2. the QKV module -----------------------------------------------------------------------------------------------

def case_qkv(seq_dim):
    rank, tp = _tp()
    what = f"GQAQKVColumnParallelLinear(SP, sequence_dimension={seq_dim}, tp={tp})"
    seq, batch, hidden, head_dim = 4 * tp, 2, 12, 3
    heads, kv_heads = 2 * tp, tp
    dense = {p: nn.Linear(hidden, (heads if p == "q" else kv_heads) * head_dim) for p in "qkv"}
    for i, layer in enumerate(dense.values()):
        _randomise_(layer, 40 + i)
    qkv = GQAQKVColumnParallelLinear(hidden, [heads * head_dim, kv_heads * head_dim], gather_output=False,
                                     sequence_parallel_enabled=True, sequence_dimension=seq_dim)
    with torch.no_grad():
        for p, layer in dense.items():
            getattr(qkv, "weight_" + p).copy_(_slice(layer.weight, 0, rank, tp))
            getattr(qkv, "bias_" + p).copy_(_slice(layer.bias, 0, rank, tp))
    shape = (seq, batch, hidden) if seq_dim == 0 else (batch, seq, hidden)
    x = _randn(shape, _data_seed(50))
    xd = x.clone().requires_grad_()
    shard = _slice(x, seq_dim, rank, tp).clone().requires_grad_()
    with _Saved() as saved:
        outputs = qkv(shard)
    # Fused (the default): Q, K and V's weights are row blocks of the one parameter weight_qkv, saved once.
    _check_saved_is_shard(saved, shard, [qkv.weight_qkv], seq_dim, seq, what)
    dense_outputs = [dense[p](xd) for p in "qkv"]
    grads = [_randn(o.shape, _data_seed(60 + i)) for i, o in enumerate(dense_outputs)]
    torch.autograd.backward(dense_outputs, grads)
    for p, out, ref in zip("qkv", outputs, dense_outputs):
        _close(out.detach(), _slice(ref.detach(), -1, rank, tp), f"{what} {p} output")
    with _counting_collectives() as counts:
        torch.autograd.backward(list(outputs), [_slice(g, -1, rank, tp) for g in grads])
    # One re-gather for the three weight gradients, one reduce-scatter of the summed input gradient.
    assert counts == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 0}, f"{what}: {counts}"
    _close(shard.grad, _slice(xd.grad, seq_dim, rank, tp), f"{what} input grad")
    rows = [heads * head_dim // tp] + [kv_heads * head_dim // tp] * 2
    for p, layer, grad, bias_grad in zip("qkv", dense.values(), qkv.weight_qkv.grad.split(rows),
                                         qkv.bias_qkv.grad.split(rows)):
        _close(grad, _slice(layer.weight.grad, 0, rank, tp), f"{what} {p} weight grad")
        _close(bias_grad, _slice(layer.bias.grad, 0, rank, tp), f"{what} {p} bias grad")
    return True


@pytest.mark.parametrize("world,tp", WORLDS)
@pytest.mark.parametrize("seq_dim", [0, 1])
def test_qkv_module_saves_its_shard_and_equals_dense(worlds, world, tp, seq_dim):
    assert worlds(world).run(case_qkv, tensor_model_parallel_size=tp, seq_dim=seq_dim) == [True] * world


# ---- 3. a BERT model with sequence parallelism -----------------------------------------------------------------------

def _plain_gather(shard, sequence_dimension=0, process_group=None, reduce_dtype=None):
    """nxdtp's entry region before shards were kept: the gathered tensor itself is what the layers save."""
    return mappings.gather_from_sequence_parallel_region(shard, sequence_dimension, True, process_group,
                                                         reduce_dtype=reduce_dtype)


def _bert_forward_saved(model, batch):
    with _Saved() as saved:
        out = model(**batch)
    return out, saved


def case_bert_layer():
    from transformers import BertModel

    from tests.test_models_bert import BATCH, SEQ, _batch, _check_grads, _config, _pair
    from tests.test_models_bert import _close as close

    rank, tp = _tp()
    what = f"BertModel(SP, tp={tp})"
    config = _config(num_hidden_layers=2, intermediate_size=96)  # MLP shards differ from the hidden size in shape
    dense, model = _pair(BertModel, config, seed=5, sequence_parallel=True)
    batch = {k: v for k, v in _batch(config, seed=6).items() if k in ("input_ids", "token_type_ids", "attention_mask")}
    out, saved = _bert_forward_saved(model, batch)
    dense_out = dense(**batch)
    close(out.last_hidden_state, dense_out.last_hidden_state, f"{what} last_hidden_state")
    close(out.pooler_output, dense_out.pooler_output, f"{what} pooler_output")
    g, g_pooled = _randn(dense_out.last_hidden_state.shape, 7), _randn(dense_out.pooler_output.shape, 8)
    torch.autograd.backward([dense_out.last_hidden_state, dense_out.pooler_output], [g, g_pooled])
    torch.autograd.backward([out.last_hidden_state, out.pooler_output], [g, g_pooled])
    allreduce_sequence_parallel_gradients(model.parameters())
    _check_grads(model, dense, what)

    # What the layers used to keep: the same model with plain all-gathers at the entry regions.
    with mock.patch.object(sequence_parallel_linear, "gather_keeping_shard", _plain_gather):
        _, saved_before = _bert_forward_saved(model, batch)
    # Activations of the full hidden state's size (F.linear saves its input as a [batch * seq, hidden] view).
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    full_hidden = BATCH * SEQ * config.hidden_size

    def full_size(record):
        return [tuple(t.shape) for t in record.storages()
                if t.untyped_storage().data_ptr() not in params and t.numel() == full_hidden]

    kept_full, kept_full_before = full_size(saved), full_size(saved_before)
    # Per layer, the QKV input and the MLP input were kept whole (each read by several linears, saved once); now their
    # shards are. What is left at full size is outside the layers (embeddings, the encoder output).
    layers = config.num_hidden_layers
    assert len(kept_full_before) - len(kept_full) == 2 * layers, (kept_full_before, kept_full)
    element = 4
    gathered, shard = BATCH * SEQ * config.hidden_size * element, BATCH * (SEQ // tp) * config.hidden_size * element
    # The shards (a LayerNorm's output, or the encoder's scattered input) were saved by nothing before.
    assert saved_before.nbytes() - saved.nbytes() == 2 * layers * (gathered - shard), (
        f"{what}: saved {saved.nbytes()} bytes, {saved_before.nbytes()} with plain gathers; expected "
        f"{2 * layers} x ({gathered} - {shard}) less")
    return saved_before.nbytes(), saved.nbytes()


@pytest.mark.parametrize("world,tp", WORLDS)
def test_bert_with_sequence_parallelism_saves_shards_and_equals_dense(worlds, world, tp):
    results = worlds(world).run(case_bert_layer, tensor_model_parallel_size=tp)
    before, after = results[0]
    assert after < before


def test_carry_note_refuses_a_tensor_of_another_shape():
    full = torch.zeros(4, 2)
    note_of(full, sequence_parallel_linear.SequenceShardNote).shard = object()
    with pytest.raises(ValueError, match=r"result of shape \(2, 2\) cannot stand for a gathered tensor of shape "
                                         r"\(4, 2\)"):
        sequence_parallel_linear.carry_note(full, torch.zeros(2, 2))


# ---- 4. a decoder with sequence parallelism: the layers and the vocab-parallel LM head -------------------------------

def case_decoder():
    from nxdtp.models import parallelize_model
    from tests.test_models_bert import _check_grads
    from tests.test_models_bert import _close as close
    from tests.test_models_decoders import BATCH, SEQ, _batch, _config, _dense

    rank, tp = _tp()
    what = f"LlamaForCausalLM(SP, tp={tp})"
    config = _config("llama", tp)
    dense = _dense("llama", config, seed=3)
    model = parallelize_model(copy.deepcopy(dense), sequence_parallel=True)
    batch = _batch(seed=4)
    with _Saved() as saved:
        out = model(**batch)
    dense_out = dense(**batch)
    close(out.loss, dense_out.loss, f"{what} loss")
    dense_out.loss.backward()
    out.loss.backward()
    allreduce_sequence_parallel_gradients(model.parameters())
    _check_grads(model, dense, what)

    # The same model as nxdtp kept it before: plain all-gathers into the layers and (no note) into the LM head.
    no_note = lambda full, *args, **kwargs: full  # noqa: E731
    with mock.patch.object(sequence_parallel_linear, "gather_keeping_shard", _plain_gather), \
            mock.patch.object(sequence_parallel_linear, "remember_shard", no_note), _Saved() as before:
        model(**batch)
    element = 4
    gathered = BATCH * SEQ * config.hidden_size * element
    shard = gathered // tp
    # Per layer the attention's and the MLP's gathered inputs, and once the LM head's input, are kept as shards.
    expected = (2 * config.num_hidden_layers + 1) * (gathered - shard)
    assert before.nbytes() - saved.nbytes() == expected, (
        f"{what}: saved {saved.nbytes()} bytes, {before.nbytes()} with plain gathers; expected {expected} less")
    return before.nbytes(), saved.nbytes()


@pytest.mark.parametrize("world,tp", WORLDS)
def test_decoder_with_sequence_parallelism_saves_shards_and_equals_dense(worlds, world, tp):
    before, after = worlds(world).run(case_decoder, tensor_model_parallel_size=tp)[0]
    assert after < before

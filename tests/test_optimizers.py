"""nxdtp.optimizer.Lamb against a float64 reference, and a TP model against the dense model on gloo ranks.

Single process (under a simulated TP-size-1 topology): three steps of ``Lamb`` equal a plain float64 reference written
below (per tensor, Python branches, no torch.where), for decay / no-decay / always-adapt groups, trust_clip on and off,
bias_correction on and off, and an active global gradient clip. A state_dict round trip (through torch.save) continues
exactly as an uninterrupted run. Bad hyper-parameters are rejected with the value named.

Multi-rank: ParallelEmbedding (vocabulary 11, padded to 12 at tp=2) -> replicated LayerNorm -> ColumnParallelLinear ->
GELU -> RowParallelLinear, loaded with slices of a dense model whose parameters are all random (biases and LayerNorm
included). Each parameter is also scaled by a ramp along every dimension, so that the shards of one tensor have
different norms: the trust ratio of a local shard then differs from the dense tensor's, which is what makes a missing
TP reduction visible (the case checks that it would be visible, by at least 1e-3, before trusting the comparison). Both
models take 3 LAMB steps on the same data; every parameter slice and every per-tensor trust ratio
(``Lamb.last_trust_ratios``) must equal the dense one, padded vocabulary rows stay zero, and the TP step makes exactly
one all-reduce of a [2 * n_sharded] vector (plus the gradient-norm one when max_grad_norm is set). With dp=2 each DP
rank takes half of the global batch and the gradients are DP-averaged first. Finally a save / load through
nxdtp.checkpointing after step 2 resumes bit-exactly.

Tolerance: fp32 1e-5 absolute and relative everywhere. The TP and dense gradients differ only by summation order
(~1e-9 absolute here). m / (sqrt(v) + eps) amplifies such a difference by up to ~1 / max(|g|, eps) for an element
whose gradient is tiny, and small random batches can produce elements with |g| ~ 1e-6 (an earlier version of this
model did, and reached 1.5e-6 of error); so the multi-rank runs use ``eps=1e-4`` (gradients here are ~1e-2 typically)
as a guard that keeps the margin for any seed. Observed with these seeds: parameters within 3e-7 and trust ratios
within 4e-7 of dense, with eps=1e-4 and with eps=1e-6 alike. The single-process comparison with the float64 reference
uses eps=1e-6.
"""

from __future__ import annotations

import io
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nxdtp import comm
from nxdtp import grads as nxg
from nxdtp import parallel_state as ps
from nxdtp.layers import ColumnParallelLinear, LayerNorm, ParallelEmbedding, RowParallelLinear, shard_of
from nxdtp.optimizer import Lamb
from nxdtp.utils import move_model_to_device

TOL = dict(rtol=1e-5, atol=1e-5)


# ---- a plain float64 reference --------------------------------------------------------------------------------------

def _reference_lamb(weights, grads_per_step, groups, lr, betas, eps, bias_correction, trust_clip, max_grad_norm):
    """``weights``: float64 tensors; ``groups[i]`` = (weight_decay, always_adapt) of weight i. Returns the weights
    after every step and the trust ratios of every step."""
    beta1, beta2 = betas
    w = [x.clone().double() for x in weights]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    history, ratios = [], []
    for t, step_grads in enumerate(grads_per_step, start=1):
        g = [x.double() for x in step_grads]
        if max_grad_norm is not None:
            total = math.sqrt(sum(float((x * x).sum()) for x in g))
            coefficient = min(1.0, max_grad_norm / (total + 1e-6))  # torch's clip_grad_norm_ epsilon
            g = [x * coefficient for x in g]
        step_ratios = []
        for i in range(len(w)):
            weight_decay, always_adapt = groups[i]
            m[i] = beta1 * m[i] + (1 - beta1) * g[i]
            v[i] = beta2 * v[i] + (1 - beta2) * g[i] * g[i]
            if bias_correction:
                m_hat, v_hat = m[i] / (1 - beta1 ** t), v[i] / (1 - beta2 ** t)
            else:
                m_hat, v_hat = m[i], v[i]
            u = m_hat / (v_hat.sqrt() + eps) + weight_decay * w[i]
            r = 1.0
            if weight_decay != 0 or always_adapt:
                w_norm, u_norm = float(w[i].norm()), float(u.norm())
                if w_norm > 0 and u_norm > 0:
                    r = w_norm / u_norm
                if trust_clip:
                    r = min(r, 1.0)
            w[i] = w[i] - lr * r * u
            step_ratios.append(r)
        history.append([x.clone() for x in w])
        ratios.append(step_ratios)
    return history, ratios


@pytest.fixture
def single_rank():
    with ps.simulated_topology(world_size=1, rank=0, tensor_model_parallel_size=1):
        yield


def _random_params(seed):
    """Weights of mixed magnitude (some trust ratios above 1, some below) and one all-zero weight (ratio 1)."""
    g = torch.Generator().manual_seed(seed)
    shapes_scales = [((6, 5), 0.5), ((4, 2), 0.0), ((5, 3), 8.0), ((7,), 1.0), ((6,), 0.3), ((3,), 2.0), ((2, 3), 0.4)]
    return [nn.Parameter(torch.randn(s, generator=g) * scale) for s, scale in shapes_scales]


def _random_grads(params, seed, steps=3):
    g = torch.Generator().manual_seed(seed + 1)
    return [[torch.randn(p.shape, generator=g) * 0.1 for p in params] for _ in range(steps)]


# Groups: params 0-2 decay (param 1 is all zero), 3-4 no decay, 5-6 no decay but always_adapt.
_GROUP_OF = [(0.1, False)] * 3 + [(0.0, False)] * 2 + [(0.0, True)] * 2


def _groups(params):
    return [{"params": params[:3], "weight_decay": 0.1}, {"params": params[3:5], "weight_decay": 0.0},
            {"params": params[5:], "weight_decay": 0.0, "always_adapt": True}]


@pytest.mark.parametrize("trust_clip", [False, True], ids=["noclip", "trust_clip"])
@pytest.mark.parametrize("bias_correction", [True, False], ids=["bc", "nobc"])
@pytest.mark.parametrize("max_grad_norm", [None, 0.3], ids=["nogradclip", "gradclip"])
def test_lamb_equals_float64_reference(single_rank, trust_clip, bias_correction, max_grad_norm):
    params = _random_params(1)
    initial = [p.detach().clone() for p in params]
    all_grads = _random_grads(params, 1)
    settings = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-6, bias_correction=bias_correction, trust_clip=trust_clip)
    opt = Lamb(_groups(params), max_grad_norm=max_grad_norm, **settings)
    expected, expected_ratios = _reference_lamb(initial, all_grads, _GROUP_OF, max_grad_norm=max_grad_norm,
                                                **settings)
    for step, step_grads in enumerate(all_grads):
        for p, grad in zip(params, step_grads):
            p.grad = grad.clone()
        opt.step()
        for k, (p, want) in enumerate(zip(params, expected[step])):
            torch.testing.assert_close(p.detach().double(), want, **TOL, msg=lambda m: f"step {step} param {k}: {m}")
            got_ratio = opt.last_trust_ratios[p]
            assert got_ratio.dtype == torch.float32 and got_ratio.dim() == 0
            assert math.isclose(got_ratio.item(), expected_ratios[step][k], rel_tol=1e-5), \
                (step, k, got_ratio.item(), expected_ratios[step][k])
            # The .grad tensors are not modified (the clip applies inside the step only).
            assert torch.equal(p.grad, step_grads[k])
        if max_grad_norm is not None:
            dense_norm = torch.nn.utils.get_total_norm(step_grads)
            torch.testing.assert_close(opt.last_grad_norm, dense_norm, **TOL)
            assert opt.last_grad_norm.item() > max_grad_norm  # the clip is active
        else:
            assert opt.last_grad_norm is None
    # The reference is not degenerate: ratios above and below 1 (before clipping), the zero weight at 1, no-decay at 1.
    _, raw = _reference_lamb(initial, all_grads, _GROUP_OF, max_grad_norm=max_grad_norm,
                             **{**settings, "trust_clip": False})
    adapted = [raw[0][k] for k in (0, 2, 5, 6)]
    assert max(adapted) > 1.5 and min(adapted) < 0.9, raw[0]
    assert expected_ratios[0][1] == 1.0  # ||w|| = 0 at step 1: ratio 1
    assert all(r[3] == r[4] == 1.0 for r in expected_ratios)  # no decay, no always_adapt: plain Adam


def test_state_dict_round_trip_continues_like_uninterrupted(single_rank):
    params = _random_params(2)
    all_grads = _random_grads(params, 2, steps=4)
    copy_params = [nn.Parameter(p.detach().clone()) for p in params]
    uninterrupted = Lamb(_groups(params), lr=0.02, trust_clip=True, max_grad_norm=1.0)
    interrupted = Lamb(_groups(copy_params), lr=0.02, trust_clip=True, max_grad_norm=1.0)

    def run(opt, ps_, grads):
        for p, grad in zip(ps_, grads):
            p.grad = grad.clone()
        opt.step()

    for step in range(2):
        run(uninterrupted, params, all_grads[step])
        run(interrupted, copy_params, all_grads[step])
    buffer = io.BytesIO()
    torch.save(interrupted.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert set(saved["state"]) == set(range(len(params)))
    for fields in saved["state"].values():
        assert set(fields) == {"step", "exp_avg", "exp_avg_sq"}, fields
        assert fields["step"].item() == 2.0
    assert saved["param_groups"][2]["always_adapt"] is True and saved["param_groups"][1]["weight_decay"] == 0.0

    # A fresh optimizer over the same (restored) weights continues from the loaded state.
    restored_params = [nn.Parameter(p.detach().clone()) for p in copy_params]
    restored = Lamb(_groups(restored_params), lr=0.02, trust_clip=True, max_grad_norm=1.0)
    restored.load_state_dict(saved)
    for step in range(2, 4):
        run(uninterrupted, params, all_grads[step])
        run(restored, restored_params, all_grads[step])
    for k, (a, b) in enumerate(zip(params, restored_params)):
        assert torch.equal(a, b), f"param {k} differs after resuming"
    for a, b in zip(params, restored_params):
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(uninterrupted.state[a][field], restored.state[b][field]), field
    # Without the loaded state the continuation differs (the round trip is what makes them equal).
    fresh_params = [nn.Parameter(p.detach().clone()) for p in copy_params]
    fresh = Lamb(_groups(fresh_params), lr=0.02, trust_clip=True, max_grad_norm=1.0)
    for step in range(2, 4):
        run(fresh, fresh_params, all_grads[step])
    assert any(not torch.equal(a, b) for a, b in zip(params, fresh_params))


def test_parameters_without_grad_are_skipped(single_rank):
    a, b = nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(4))
    opt = Lamb([a, b], lr=0.1)
    a.grad = torch.randn(3, 2)
    before = b.detach().clone()
    opt.step()
    assert torch.equal(b, before) and len(opt.state[b]) == 0 and b not in opt.last_trust_ratios
    assert opt.state[a]["step"].item() == 1.0
    opt.zero_grad()
    opt.step()  # nothing has a gradient: a no-op
    assert opt.state[a]["step"].item() == 1.0 and opt.last_trust_ratios == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")], ids=["finite", "inf", "nan"])
def test_lamb_clip_is_clip_grad_norms_to_the_bit(single_rank, dtype, bad):
    """With beta1 = 0 the first moment after one step is the clipped gradient itself, exactly (0 * 0 + 1 * g): it must
    equal what clip_grad_norm leaves in .grad, bit for bit (the same epsilon, coefficient and multiply), also for a
    non-finite norm (torch's 0 or NaN coefficient)."""
    assert nxg.CLIP_EPS == 1e-6  # torch.nn.utils.clip_grad_norm_'s
    g = torch.Generator().manual_seed(3)
    # A norm near 1 and max_norm 0.5: the epsilon moves max_norm / (norm + eps) by ~1e-6 relative, many fp32 ulps.
    grads = [(torch.randn(s, generator=g) * 0.3).to(dtype) for s in ((3, 4), (5,), (2, 2))]
    if bad is not None:
        grads[1][2] = bad
    params = [nn.Parameter(torch.zeros(x.shape, dtype=dtype)) for x in grads]
    clipped = [nn.Parameter(torch.zeros(x.shape, dtype=dtype)) for x in grads]
    for p, q, x in zip(params, clipped, grads):
        p.grad, q.grad = x.clone(), x.clone()
    opt = Lamb(params, lr=0.1, betas=(0.0, 0.999), max_grad_norm=0.5)
    opt.step()
    norm = nxg.clip_grad_norm(clipped, 0.5)
    torch.testing.assert_close(opt.last_grad_norm, norm, rtol=0, atol=0, equal_nan=True)
    if bad is None:
        assert 0.5 < norm.item() < 2, norm  # the clip is active and the epsilon is visible
    for p, q in zip(params, clipped):
        torch.testing.assert_close(opt.state[p]["exp_avg"], q.grad, rtol=0, atol=0, equal_nan=True)
    for p, x in zip(params, grads):
        torch.testing.assert_close(p.grad, x, rtol=0, atol=0, equal_nan=True)  # .grad itself is left as it was


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=-1e-3), r"lr=-0\.001"),
    (dict(lr=float("nan")), r"lr=nan"),
    (dict(eps=0.0), r"eps=0\.0"),
    (dict(eps=-1e-8), r"eps=-1e-08"),
    (dict(betas=(1.0, 0.999)), r"beta1=1\.0"),
    (dict(betas=(0.9, -0.1)), r"beta2=-0\.1"),
    (dict(betas=(0.9,)), r"betas=\(0\.9,\) must be a pair"),
    (dict(weight_decay=-0.01), r"weight_decay=-0\.01"),
    (dict(max_grad_norm=0.0), r"max_grad_norm=0\.0"),
    (dict(max_grad_norm=-1), r"max_grad_norm=-1"),
])
def test_bad_hyper_parameters_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Lamb([nn.Parameter(torch.ones(2))], **kwargs)


def test_bad_hyper_parameters_in_a_group_are_rejected():
    good, bad = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match=r"parameter group 1.*lr=-0\.5"):
        Lamb([{"params": [good]}, {"params": [bad], "lr": -0.5}])
    opt = Lamb([good])
    with pytest.raises(ValueError, match=r"weight_decay=-1"):
        opt.add_param_group({"params": [bad], "weight_decay": -1})


def test_a_parameter_listed_twice_is_rejected_before_any_change(single_rank):
    p = nn.Parameter(torch.randn(3))
    p.grad = torch.randn(3)
    with pytest.warns(UserWarning, match="duplicate parameters"):  # torch's own warning at construction
        opt = Lamb([p, p])
    before = p.detach().clone()
    with pytest.raises(ValueError, match=r"shape \(3,\) is listed more than once"):
        opt.step()
    assert torch.equal(p, before) and len(opt.state[p]) == 0


def test_exported():
    import importlib
    import sys

    import nxdtp
    from nxdtp.optimizer import Lamb as lamb

    assert nxdtp.Lamb is lamb and "Lamb" in nxdtp.optimizer.__all__
    # The old module path works one more release, with a DeprecationWarning naming the new one, both as an attribute
    # and as an import (forgotten first: an earlier import in this process would have made it a plain attribute).
    sys.modules.pop("nxdtp.optimizers", None)
    vars(nxdtp).pop("optimizers", None)
    with pytest.warns(DeprecationWarning, match="use nxdtp.optimizer"):
        assert nxdtp.optimizers.Lamb is lamb
    with pytest.warns(DeprecationWarning, match="import Lamb from nxdtp.optimizer"):
        assert importlib.import_module("nxdtp.optimizers").Lamb is lamb


# ---- multi-rank: TP model vs dense model ----------------------------------------------------------------------------

VOCAB, HIDDEN, FFN, SEQ, GLOBAL_BATCH = 11, 8, 16, 3, 4


class _Net(nn.Module):
    def __init__(self, emb, ln, fc1, fc2):
        super().__init__()
        self.emb, self.ln, self.fc1, self.fc2 = emb, ln, fc1, fc2

    def forward(self, ids):
        return self.fc2(F.gelu(self.fc1(self.ln(self.emb(ids)))))

    def param_groups(self, decay):
        weights = [self.emb.weight, self.fc1.weight, self.fc2.weight]
        others = [self.fc1.bias, self.ln.weight, self.ln.bias, self.fc2.bias]
        return [{"params": weights, "weight_decay": decay}, {"params": others, "weight_decay": 0.0}]


def _dense_net(seed):
    net = _Net(nn.Embedding(VOCAB, HIDDEN), nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            # Random, times a ramp along every dim: the shards of a tensor (whichever dim it is split on) get different
            # norms (see the module docstring).
            value = torch.randn(p.shape, generator=g) * 0.5
            for dim, size in enumerate(p.shape):
                value = value * torch.linspace(0.3, 1.7, size).reshape((-1,) + (1,) * (p.dim() - 1 - dim))
            p.copy_(value)
    return net


def _pairs(tp_net, dense):
    """(TP param, dense param, split dim or None) in the order of ``_Net.param_groups``."""
    return [(tp_net.emb.weight, dense.emb.weight, 0), (tp_net.fc1.weight, dense.fc1.weight, 0),
            (tp_net.fc2.weight, dense.fc2.weight, 1), (tp_net.fc1.bias, dense.fc1.bias, 0),
            (tp_net.ln.weight, dense.ln.weight, None), (tp_net.ln.bias, dense.ln.bias, None),
            (tp_net.fc2.bias, dense.fc2.bias, None)]


def _slice_of_dense(dense_param, dim, padded_rows=0):
    """This rank's slice of a dense parameter; ``padded_rows`` zero rows are appended first (the padded vocabulary)."""
    rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_size()
    full = dense_param.detach()
    if padded_rows:
        full = torch.cat([full, torch.zeros(padded_rows, full.shape[1])])
    return full if dim is None else shard_of(full, dim, rank, tp)


def _tp_net(dense):
    net = _Net(ParallelEmbedding(VOCAB, HIDDEN, pad=True), LayerNorm(HIDDEN),
               ColumnParallelLinear(HIDDEN, FFN, gather_output=False),
               RowParallelLinear(FFN, HIDDEN, input_is_parallel=True))
    padded_rows = net.emb.padded_num_embeddings - VOCAB
    assert padded_rows > 0, "the test needs a padded vocabulary"
    with torch.no_grad():
        for p, d, dim in _pairs(net, dense):
            p.copy_(_slice_of_dense(d, dim, padded_rows if p is net.emb.weight else 0))
    return net


def _batch(seed, step):
    g = torch.Generator().manual_seed(seed * 100 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    return ids, torch.randn(GLOBAL_BATCH, SEQ, HIDDEN, generator=g)


def _counting_all_reduce(calls):
    original = comm.all_reduce

    def counted(tensor, group, op="sum"):
        calls.append((tuple(tensor.shape), group.kind, op))
        return original(tensor, group, op)

    return original, counted


CONFIGS = {
    "decay": dict(lr=0.05, weight_decay=0.1),
    "trust_clip+always_adapt+no_bc": dict(lr=0.05, weight_decay=0.1, trust_clip=True, always_adapt=True,
                                          bias_correction=False),
    "grad_clip": dict(lr=0.05, weight_decay=0.1, max_grad_norm=0.05),
}


def case_lamb_tp_equals_dense(seed, config):
    kwargs = dict(CONFIGS[config])
    decay = kwargs.pop("weight_decay")
    always_adapt = kwargs.get("always_adapt", False)
    kwargs["eps"] = 1e-4  # see the module docstring (tolerance)
    rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_size()
    dp, dp_rank = ps.get_data_parallel_size(), ps.get_data_parallel_rank()
    dense = _dense_net(seed)
    tp_net = _tp_net(dense)
    padded_rows = tp_net.emb.padded_num_embeddings - VOCAB
    pairs = _pairs(tp_net, dense)
    tp_params = [p for g in tp_net.param_groups(decay) for p in g["params"]]
    dense_params = [p for g in dense.param_groups(decay) for p in g["params"]]
    assert [id(p) for p, _, _ in pairs] == [id(p) for p in tp_params]
    assert [id(d) for _, d, _ in pairs] == [id(d) for d in dense_params]
    sharded = [bool(getattr(p, "tensor_model_parallel", False)) for p in tp_params]
    assert sharded == [True, True, True, True, False, False, False]
    adapting = [True] * 3 + [always_adapt] * 4
    tp_opt, dense_opt = Lamb(tp_net.param_groups(decay), **kwargs), Lamb(dense.param_groups(decay), **kwargs)

    calls = []
    original, counted = _counting_all_reduce(calls)
    for step in range(3):
        ids, target = _batch(seed, step)
        # Dense: the whole global batch.
        dense_opt.zero_grad()
        F.mse_loss(dense(ids), target).backward()
        # TP: this DP rank's part of the batch; the DP average gives the full-batch gradient.
        rows = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
        tp_opt.zero_grad()
        F.mse_loss(tp_net(ids[rows]), target[rows]).backward()
        nxg.allreduce_gradients(tp_net)
        before = [p.detach().clone() for p in tp_params]

        dense_opt.step()
        calls.clear()
        comm.all_reduce = counted  # nxdtp.optimizer and nxdtp.grads both call comm.all_reduce
        try:
            tp_opt.step()
        finally:
            comm.all_reduce = original
        for k, (p, d, dim) in enumerate(pairs):
            want = _slice_of_dense(d, dim, padded_rows if p is tp_net.emb.weight else 0)
            torch.testing.assert_close(p.detach(), want, **TOL, msg=lambda m: f"{config} step {step} param {k}: {m}")
            r_tp, r_dense = tp_opt.last_trust_ratios[p], dense_opt.last_trust_ratios[d]
            torch.testing.assert_close(r_tp, r_dense, **TOL,
                                       msg=lambda m: f"{config} step {step} trust ratio of param {k}: {m}")
        if "max_grad_norm" in kwargs:
            torch.testing.assert_close(tp_opt.last_grad_norm, dense_opt.last_grad_norm, **TOL)
            assert dense_opt.last_grad_norm.item() > kwargs["max_grad_norm"], "the gradient clip is not active"
        # One all-reduce for the trust-ratio norms of all sharded adapting params (a [2 * n] vector), plus one for the
        # gradient norm when clipping. Checked after the values, so that a skipped reduction shows up as wrong values.
        n_norms = sum(s and a for s, a in zip(sharded, adapting))
        expected_calls = [((2 * n_norms,), "tensor", "sum")]
        if "max_grad_norm" in kwargs:
            expected_calls = [((), "tensor", "sum")] + expected_calls
        assert calls == expected_calls, calls

        # The comparison has power: for every sharded adapting param, the ratio of the local shard alone
        # (||w_local|| / ||u_local||, u recovered from the step taken) differs from the dense ratio.
        for k, (p, old) in enumerate(zip(tp_params, before)):
            if not (sharded[k] and adapting[k]):
                continue
            r = tp_opt.last_trust_ratios[p]
            u_local = (old - p.detach()) / (kwargs["lr"] * r)
            local_ratio = old.norm() / u_local.norm()
            if kwargs.get("trust_clip"):
                local_ratio = torch.clamp(local_ratio, max=1.0)
            if step == 0:
                assert abs(float(local_ratio) - float(r)) > 1e-3, (config, k, float(local_ratio), float(r))

    # Padded vocabulary rows (owned by the last TP rank) stay exactly zero, and so does their optimizer state.
    rows_per_rank = tp_net.emb.padded_num_embeddings // tp
    local_pad = [i for i in range(rows_per_rank) if rank * rows_per_rank + i >= VOCAB]
    assert bool(local_pad) == (rank == tp - 1)
    for i in local_pad:
        assert torch.all(tp_net.emb.weight[i] == 0)
        assert torch.all(tp_opt.state[tp_net.emb.weight]["exp_avg"][i] == 0)
        assert torch.all(tp_opt.state[tp_net.emb.weight]["exp_avg_sq"][i] == 0)
    return [float(tp_opt.last_trust_ratios[p]) for p in tp_params]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("world,tp", [(2, 2), (4, 2)], ids=["tp2", "tp2xdp2"])
def test_lamb_tp_equals_dense(worlds, world, tp, config):
    results = worlds(world).run(case_lamb_tp_equals_dense, tensor_model_parallel_size=tp, seed=7 + world, config=config)
    # Every rank applies the same trust ratio to its shard of a tensor (they are the dense tensor's).
    assert all(r == results[0] for r in results), results


def case_lamb_checkpoint_resume(root, seed):
    """nxdtp.checkpointing.save / load with a Lamb optimizer: resuming after step 2 equals the uninterrupted run."""
    import os

    from nxdtp.checkpointing import load, save

    kwargs = dict(lr=0.05, eps=1e-4, trust_clip=True, always_adapt=True, max_grad_norm=0.05)

    def build(model_seed):
        net = _tp_net(_dense_net(model_seed))
        return net, Lamb(net.param_groups(0.1), **kwargs)

    def train(net, opt, steps):
        for step in steps:
            ids, target = _batch(seed, step)
            opt.zero_grad()
            F.mse_loss(net(ids), target).backward()
            opt.step()

    reference, reference_opt = build(seed)
    train(reference, reference_opt, range(4))

    first, first_opt = build(seed)
    train(first, first_opt, range(2))
    save({"model": first, "optimizer": first_opt, "global_step": 2}, root)

    resumed, resumed_opt = build(seed + 1)  # another seed: whatever load() does not restore differs
    assert all(not torch.equal(a, b) for a, b in zip(first.parameters(), resumed.parameters()))
    load(root, model=resumed, optimizer=resumed_opt)
    for p in resumed.parameters():
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert resumed_opt.state[p][field].dtype == torch.float32, field
        assert resumed_opt.state[p]["step"].item() == 2.0
    assert resumed_opt.param_groups[0]["betas"] == (0.9, 0.999)
    train(resumed, resumed_opt, range(2, 4))
    for (name, a), b in zip(reference.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), f"{name} differs after resuming"
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(reference_opt.state[a][field], resumed_opt.state[b][field]), (name, field)
    return sorted(os.listdir(root))


def test_lamb_checkpoint_resume_is_exact(worlds, tmp_path):
    results = worlds(2).run(case_lamb_checkpoint_resume, tensor_model_parallel_size=2, root=str(tmp_path), seed=3)
    assert results[0] == results[1] and results[0], results


# ---- XLA:CPU: the step lowers to one all-reduce, and runs as one cached graph per step -------------------------------

def _xla_params(device):
    """Column/Row-parallel weights and biases and a LayerNorm, with random gradients, on ``device``."""
    torch.manual_seed(0)
    col = ColumnParallelLinear(8, 16, gather_output=False)
    row = RowParallelLinear(16, 8, input_is_parallel=True)
    ln = LayerNorm(8)
    # move_model_to_device keeps the TP attributes (Module.to would drop them on XLA, making every param replicated).
    col, row, ln = (move_model_to_device(m, device) for m in (col, row, ln))
    params = [col.weight, row.weight, col.bias, row.bias, ln.weight, ln.bias]
    assert [bool(getattr(p, "tensor_model_parallel", False)) for p in params] == [True, True, True, False, False, False]
    for p in params:
        p.grad = torch.randn(p.shape).to(device)
    return params


def case_lamb_lowering(max_grad_norm):
    """A rank of a simulated world (8 ranks, tp=4): the HLO of the updated parameters and their trust ratios."""
    import torch_xla

    from tests.test_xla import _collective_counts, _hlo, _replica_groups, _reset_collective_token, _simulated_rank

    device = torch_xla.device()
    with _simulated_rank():
        params = _xla_params(device)
        opt = Lamb([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0, "always_adapt": True}],
                   lr=0.1, max_grad_norm=max_grad_norm)
        _reset_collective_token()
        opt.step()
        hlo = _hlo(params + list(opt.last_trust_ratios.values()))
        _reset_collective_token()
    return {"counts": _collective_counts(hlo), "groups": sorted(_replica_groups(hlo)),
            # Operand shapes of each all-reduce (torch_xla adds a scalar token operand).
            "operands": sorted(set(re.findall(r" all-reduce\(f32\[(\d*)\]", hlo)))}


@pytest.mark.xla
@pytest.mark.parametrize("max_grad_norm", [None, 1.0], ids=["noclip", "gradclip"])
def test_lamb_lowers_to_one_all_reduce(worlds, max_grad_norm):
    pytest.importorskip("torch_xla")
    result, = worlds(1, "xla-hlo").run(case_lamb_lowering, tensor_model_parallel_size=None,
                                       max_grad_norm=max_grad_norm)
    # 3 sharded params (both weights, the column bias) adapt: one all-reduce of a [6] vector. The grad norm adds one.
    expected = 1 if max_grad_norm is None else 2
    assert result["counts"] == {"all-reduce": expected, "all-gather": 0, "reduce-scatter": 0}, result
    assert result["groups"] == ["{{0,1,2,3},{4,5,6,7}}"], result
    assert result["operands"] == (["6"] if max_grad_norm is None else ["", "6"]), result


def case_lamb_xla_graphs(steps):
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    device = torch_xla.device()
    eager = _xla_params("cpu")
    params = _xla_params(device)
    settings = dict(lr=0.05, trust_clip=True, max_grad_norm=2.0)
    groups = lambda ps_: [{"params": ps_[:2]}, {"params": ps_[2:], "weight_decay": 0.0, "always_adapt": True}]  # noqa
    opt_eager, opt_xla = Lamb(groups(eager), **settings), Lamb(groups(params), **settings)
    g = torch.Generator().manual_seed(5)
    torch_xla.sync()
    xm.wait_device_ops()
    met.clear_all()
    per_step = []
    for _ in range(steps):
        step_grads = [torch.randn(p.shape, generator=g) for p in eager]
        for p, q, grad in zip(params, eager, step_grads):
            q.grad = grad.clone()
            p.grad = grad.to(device)
        before = {k: met.counter_value(k) or 0 for k in ("UncachedCompile", "CachedCompile", "ExecuteComputation")}
        opt_xla.step()
        torch_xla.sync()
        xm.wait_device_ops()
        per_step.append({k: (met.counter_value(k) or 0) - v for k, v in before.items()})
        opt_eager.step()
    for k, (p, q) in enumerate(zip(params, eager)):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), **TOL, msg=lambda m: f"param {k}: {m}")
        torch.testing.assert_close(opt_xla.last_trust_ratios[p].cpu(), opt_eager.last_trust_ratios[q], **TOL)
    return per_step


@pytest.mark.xla
def test_lamb_on_xla_equals_eager_with_one_graph_per_step(worlds):
    pytest.importorskip("torch_xla")
    per_step, = worlds(1, "xla-exec").run(case_lamb_xla_graphs, tensor_model_parallel_size=1, steps=5)
    # Step 1 creates the state; from step 2 on, the same graph runs again: no recompiles (the step counter is data).
    for step in per_step[2:]:
        assert step == {"UncachedCompile": 0, "CachedCompile": 1, "ExecuteComputation": 1}, per_step


# ---- NxD's AdamW_FP32OptimParams (HF's former AdamW) -----------------------------------------------------------------

def _hf_adamw_by_torch_adam(params, groups_kwargs, grads_per_step, betas, eps, correct_bias):
    """The reference: torch's own Adam (no decay), with the step's eps chosen so that its update is HF AdamW's, and the
    decoupled decay applied after it. torch's step divides by ``sqrt(v / bc2) + eps_t``; HF's multiplies the step by
    ``sqrt(bc2) / bc1`` and divides by ``sqrt(v) + eps``: equal when ``eps_t = eps / sqrt(bc2)``. Without bias
    correction, lr is scaled by ``bc1 / sqrt(bc2)`` instead so that torch's own correction cancels."""
    reference = torch.optim.Adam([{"params": [p], "lr": kw["lr"]} for p, kw in zip(params, groups_kwargs)],
                                 betas=betas, eps=eps)
    for t, grads in enumerate(grads_per_step, start=1):
        bc1, bc2 = 1 - betas[0] ** t, 1 - betas[1] ** t
        for group, kw in zip(reference.param_groups, groups_kwargs):
            group["eps"] = eps / math.sqrt(bc2)
            group["lr"] = kw["lr"] if correct_bias else kw["lr"] * bc1 / math.sqrt(bc2)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        reference.step()
        with torch.no_grad():
            for p, kw in zip(params, groups_kwargs):
                p.mul_(1 - kw["lr"] * kw["weight_decay"])


@pytest.mark.parametrize("correct_bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adamw_fp32_optim_params_is_hf_adamw(correct_bias, dtype):
    """NxD's AdamW_FP32OptimParams against torch.optim.Adam rewritten to HF AdamW's step (eps on sqrt(v), decay after
    the update), two param groups with their own lr and weight decay, 5 steps of random gradients; 1e-6 relative in
    fp32 (the two compute the same quantities in a different order), 1e-12 in float64."""
    from nxdtp.optimizer import AdamW_FP32OptimParams

    g = torch.Generator().manual_seed(7)
    start = [torch.randn(5, 3, generator=g, dtype=dtype), torch.randn(4, generator=g, dtype=dtype)]
    kwargs = [dict(lr=1e-2, weight_decay=0.1), dict(lr=3e-3, weight_decay=0.0)]
    grads = [[torch.randn(t.shape, generator=g, dtype=dtype) for t in start] for _ in range(5)]
    betas, eps = (0.9, 0.98), 1e-6
    ours = [nn.Parameter(t.clone()) for t in start]
    optimizer = AdamW_FP32OptimParams([{"params": [p], **kw} for p, kw in zip(ours, kwargs)], betas=betas, eps=eps,
                                      correct_bias=correct_bias)
    for step_grads in grads:
        for p, grad in zip(ours, step_grads):
            p.grad = grad.clone()
        optimizer.step()
    reference = [nn.Parameter(t.clone()) for t in start]
    _hf_adamw_by_torch_adam(reference, kwargs, grads, betas, eps, correct_bias)
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-13)
    for p, r in zip(ours, reference):
        assert p.dtype == dtype
        torch.testing.assert_close(p.detach(), r.detach(), **tol)
    state = optimizer.state[ours[0]]
    assert state["step"] == 5 and state["exp_avg"].dtype == dtype


def test_adamw_fp32_optim_params_keeps_fp32_moments_for_bf16_parameters():
    """bf16 parameters: the moments are fp32 and the update is computed in fp32 from them, then rounded once into the
    parameter (equal to the fp32 optimizer's update on the fp32 copy, rounded to bf16)."""
    from nxdtp.optimizer import AdamW_FP32OptimParams

    g = torch.Generator().manual_seed(3)
    start = torch.randn(6, 4, generator=g)
    grad = torch.randn(6, 4, generator=g)
    bf16 = nn.Parameter(start.to(torch.bfloat16))
    fp32 = nn.Parameter(start.to(torch.bfloat16).float())
    for p in (bf16, fp32):
        optimizer = AdamW_FP32OptimParams([p], lr=1e-2, weight_decay=0.01)
        p.grad = grad.to(p.dtype)
        optimizer.step()
        if p is bf16:
            assert optimizer.state[p]["exp_avg"].dtype == torch.float32
    assert torch.equal(bf16.detach(), fp32.detach().to(torch.bfloat16))


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=-1.0), r"lr=-1.0 must be >= 0.0"),
    (dict(betas=(0.9, 1.0)), r"betas\[1\]=1.0 must be in \[0.0, 1.0\)"),
    (dict(eps=-1e-8), r"eps=-1e-08 must be >= 0.0"),
    (dict(weight_decay=-0.1), r"weight_decay=-0.1 must be >= 0.0"),
])
def test_adamw_fp32_optim_params_refuses_bad_hyper_parameters(kwargs, match):
    from nxdtp.optimizer import AdamW_FP32OptimParams

    with pytest.raises(ValueError, match=match):
        AdamW_FP32OptimParams([nn.Parameter(torch.zeros(2))], **kwargs)

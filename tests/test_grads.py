"""nxdtp.grads on gloo ranks against a dense single-process reference.

The model is LayerNorm -> Linear -> GELU -> Linear with every parameter random (LayerNorm and biases included). The TP
version is sharded by hand from the dense weights: the first Linear by output rows (column-parallel), the second by
input columns (row-parallel); the LayerNorm and the second bias are replicated. Its forward goes through nxdtp.mappings,
so the gradients are the real ones a TP model produces. With data parallelism each DP rank takes its part of the global
batch and a mean loss over its local batch; after the DP all-reduce every gradient must equal the dense full-batch
gradient.
"""

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nxdtp import grads as nxg
from nxdtp import mappings
from nxdtp import parallel_state as ps
from nxdtp.spec import ParamSpec, attach_spec_attributes
from nxdtp.utils import set_tensor_model_parallel_attributes

# torch's own clip_grad_norm_. Importing torch_xla (transformers does when it is installed) replaces
# torch.nn.utils.clip_grad_norm_ with torch_xla's version, which leaves gradients unscaled when the norm is NaN
# (its ``where(coef < 1, coef, 1)`` picks 1), so a worker that imported transformers earlier had another reference.
torch_clip_grad_norm_ = torch.nn.utils.clip_grad.clip_grad_norm_

HIDDEN, FFN, GLOBAL_BATCH = 8, 16, 8
TOL = dict(rtol=1e-5, atol=1e-5)


def _dense_model(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN))
    with torch.no_grad():
        for p in model.parameters():  # fresh LayerNorms are ones/zeros: randomise them like everything else
            p.copy_(torch.randn_like(p) * 0.7)
    return model


def _batch(seed):
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(GLOBAL_BATCH, HIDDEN, generator=g), torch.randn(GLOBAL_BATCH, HIDDEN, generator=g)


class _TPModel:
    """This rank's shards of the dense model, with the NxD attribute cache set as a parallel layer would."""

    def __init__(self, dense):
        tp, rank = ps.get_tensor_model_parallel_size(), ps.get_tensor_model_parallel_rank()
        ln, fc1, fc2 = dense[0], dense[1], dense[3]
        cols = slice(rank * FFN // tp, (rank + 1) * FFN // tp)

        def param(t):
            return nn.Parameter(t.detach().clone())

        self.ln_w, self.ln_b = param(ln.weight), param(ln.bias)
        self.w1, self.b1 = param(fc1.weight[cols]), param(fc1.bias[cols])
        self.w2, self.b2 = param(fc2.weight[:, cols]), param(fc2.bias)
        # Sharded: one through the utils helper, the others through a spec (both write the same cache).
        set_tensor_model_parallel_attributes(self.w1, True, 0, 1, tp)
        attach_spec_attributes(self.b1, ParamSpec(full_shape=(FFN,), partition_dim=0, num_partitions=tp))
        attach_spec_attributes(self.w2, ParamSpec(full_shape=(HIDDEN, FFN), partition_dim=1, num_partitions=tp))
        for p in (self.ln_w, self.ln_b, self.b2):
            attach_spec_attributes(p, ParamSpec(full_shape=tuple(p.shape)))
        # The matching dense parameter and the slice of it this rank holds.
        self.pairs = [(self.ln_w, ln.weight, ...), (self.ln_b, ln.bias, ...), (self.w1, fc1.weight, cols),
                      (self.b1, fc1.bias, cols), (self.w2, fc2.weight, (slice(None), cols)), (self.b2, fc2.bias, ...)]

    def parameters(self):
        return [p for p, _, _ in self.pairs]

    def forward(self, x):
        h = F.layer_norm(x, (HIDDEN,), self.ln_w, self.ln_b)
        h = mappings.copy_to_tensor_model_parallel_region(h)
        h = F.gelu(F.linear(h, self.w1, self.b1))
        out = mappings.reduce_from_tensor_model_parallel_region(F.linear(h, self.w2))
        return out + self.b2


def _loss(out, target):
    return (out - target).pow(2).mean()  # mean over the (local) batch


def _dense_grads(seed):
    dense = _dense_model(seed)
    x, target = _batch(seed)
    _loss(dense(x), target).backward()
    return dense


def _check_local_grads(tp_model, scale=1.0, what=""):
    for local, full, index in tp_model.pairs:
        torch.testing.assert_close(local.grad, full.grad[index] * scale, **TOL,
                                   msg=lambda m: f"{what} grad of shape {tuple(local.shape)}: {m}")


def case_grads(seed):
    tp, dp = ps.get_tensor_model_parallel_size(), ps.get_data_parallel_size()
    world = ps.get_world_size()
    dense = _dense_grads(seed)
    dense_params = list(dense.parameters())
    tp_model = _TPModel(dense)  # slices of the dense weights; pairs point at the dense grads
    params = tp_model.parameters()

    # ---- DP: each DP rank the mean loss over its part of the global batch; the DP average is the full-batch grad.
    x, target = _batch(seed)
    dp_rank = ps.get_data_parallel_rank()
    rows = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
    _loss(tp_model.forward(x[rows]), target[rows]).backward()
    local_grads = [p.grad.clone() for p in params]
    # A tiny bucket cap forces several buckets (one all-reduce each); None entries are skipped.
    nxg.bucket_allreduce_gradients([p.grad for p in params] + [None], bucket_cap_mb=1e-4)
    _check_local_grads(tp_model, what=f"after DP all-reduce (tp={tp}, dp={dp})")
    if dp > 1:
        # Dividing by the world size (tp*dp) instead of dp would give grad * dp / world: rule it out explicitly.
        w1, w1_dense = tp_model.w1.grad, dense[1].weight.grad[tp_model.pairs[2][2]]
        if world != dp:
            assert not torch.allclose(w1, w1_dense * dp / world, **TOL), "DP all-reduce divided by the world size"
        assert not torch.allclose(w1, w1_dense * dp, **TOL), "DP all-reduce summed without averaging"
        assert any(not torch.allclose(a, p.grad) for a, p in zip(local_grads, params)), "DP all-reduce did nothing"
    # allreduce_gradients (whole-model convenience) on the same local grads gives the same result.
    for p, g in zip(params, local_grads):
        p.grad = g.clone()
    nxg.allreduce_gradients(params + params[:2])
    _check_local_grads(tp_model, what="after allreduce_gradients")
    reduced = [p.grad.clone() for p in params]

    def restore():
        for p, g in zip(params, reduced):
            p.grad = g.clone()

    # ---- norms: equal to the dense model's, on every rank, for every input form.
    norms = {}
    for p in (2, 1.5, 1, float("inf"), "inf"):
        expected = torch.nn.utils.get_total_norm([q.grad for q in dense_params], norm_type=p)
        forms = {"list": params, "generator": (q for q in params), "param groups": [{"params": params[:3]},
                 {"params": params[3:]}], "tied/duplicated": params + params[::2], "module-style dict":
                 {"params": params}}
        for form, arg in forms.items():
            got = nxg.get_grad_norm(arg, norm_type=p)
            assert got.dim() == 0 and got.dtype == torch.float32, (form, got)
            torch.testing.assert_close(got, expected, **TOL, msg=lambda m: f"norm_type={p} ({form}): {m}")
        norms[str(p)] = got.item()
    # A parameter without a gradient is skipped.
    unused = nn.Parameter(torch.randn(3))
    torch.testing.assert_close(nxg.get_grad_norm(params + [unused]), torch.tensor(norms["2"]), **TOL)
    # A single tensor.
    torch.testing.assert_close(nxg.get_grad_norm(tp_model.b2), tp_model.b2.grad.norm(), **TOL)
    # No gradients at all: zero, and every rank still takes part in the all-reduce.
    assert nxg.get_grad_norm([unused]).item() == 0.0
    # bf16 gradients: the norm is computed in fp32 (a bf16 accumulation would be off by ~1e-2 relative).
    bf16_params = []
    for q in params:
        b = q.detach().to(torch.bfloat16).requires_grad_(True)
        b.grad = q.grad.to(torch.bfloat16)
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride", "num_partitions"):
            setattr(b, attr, getattr(q, attr))
        bf16_params.append(b)
    got = nxg.get_grad_norm(bf16_params)
    expected = torch.nn.utils.get_total_norm([q.grad.to(torch.bfloat16).float() for q in dense_params])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, **TOL)
    # Per parameter as well: errors of bf16 rounding could cancel in the total.
    for b, (_, full, _) in zip(bf16_params, tp_model.pairs):
        torch.testing.assert_close(nxg.get_grad_norm([b], norm_type=1.5),
                                   torch.linalg.vector_norm(full.grad.to(torch.bfloat16).float(), 1.5), **TOL)

    # ---- clipping: clipped grads equal the dense clipped grads slice by slice; the pre-clip norm is returned.
    for p in (2, 1.5, float("inf")):
        for factor in (0.3, 3.0):  # clipping, and a max_norm above the norm (coefficient clamped at 1)
            restore()
            max_norm = norms[str(p)] * factor
            dense_copy = copy.deepcopy(dense)
            for q, q_copy in zip(dense_params, dense_copy.parameters()):
                q_copy.grad = q.grad.clone()
            dense_norm = torch_clip_grad_norm_(dense_copy.parameters(), max_norm, norm_type=p)
            # The tied parameter is passed twice and must be scaled once.
            total = nxg.clip_grad_norm(params + [tp_model.w1], max_norm, norm_type=p)
            torch.testing.assert_close(total, dense_norm, **TOL)
            for (local, _, index), full in zip(tp_model.pairs, dense_copy.parameters()):
                torch.testing.assert_close(local.grad, full.grad[index], **TOL,
                                           msg=lambda m: f"clip p={p} x{factor}, shape {tuple(local.shape)}: {m}")
            if factor < 1:
                post = nxg.get_grad_norm(params, norm_type=p)
                assert math.isclose(post.item(), max_norm, rel_tol=1e-4), (post, max_norm)
    restore()
    return norms


@pytest.mark.parametrize("world,tp", [(2, 2), (4, 4), (4, 2), (4, 1)])
def test_grad_norm_clip_and_dp_allreduce_equal_dense(worlds, world, tp):
    seed = 97 + 31 * world + tp
    norms = worlds(world).run(case_grads, tensor_model_parallel_size=tp, seed=seed)
    assert all(n == norms[0] for n in norms), f"ranks disagree on the norm: {norms}"
    # The reference itself is not degenerate: the norms differ per norm type.
    assert len({round(v, 6) for k, v in norms[0].items() if k != "inf"} - {norms[0]["inf"]}) >= 3


def case_dp_bucketing(seed):
    """bucket_allreduce_gradients on mixed dtypes, shapes and strides: the mean over this rank's DP group only."""
    dp_group = ps.data_parallel_group()
    gen = torch.Generator().manual_seed(seed)
    specs = []
    for _ in range(7):
        dtype = [torch.float32, torch.float64, torch.bfloat16][int(torch.randint(0, 3, (1,), generator=gen))]
        shape = tuple(int(s) for s in torch.randint(1, 6, (int(torch.randint(1, 4, (1,), generator=gen)),),
                                                    generator=gen))
        specs.append((dtype, shape))

    def tensors_of(global_rank):
        g = torch.Generator().manual_seed(seed * 31 + global_rank)
        return [torch.randn(shape, generator=g, dtype=torch.float32).to(dtype) for dtype, shape in specs]

    mine = tensors_of(ps.get_rank())
    # A non-contiguous gradient (a transposed view of a bigger buffer) is written back in place through its strides.
    buffer = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed * 31 + ps.get_rank()))
    peers_buffers = [torch.randn(4, 6, generator=torch.Generator().manual_seed(seed * 31 + r)).t()
                     for r in dp_group.ranks]
    ids = [id(t) for t in mine]
    for cap in (1e-5, 512):
        grads = [t.clone() for t in mine]
        view = buffer.clone().t()
        nxg.bucket_allreduce_gradients(grads + [view, grads[0]], bucket_cap_mb=cap)  # grads[0] repeated: once
        for k, (dtype, _) in enumerate(specs):
            peers = [tensors_of(r)[k].double() for r in dp_group.ranks]
            expected = (torch.stack(peers).sum(0) / dp_group.size).to(dtype)
            tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else TOL
            torch.testing.assert_close(grads[k], expected, **tol, msg=lambda m: f"bucket cap {cap}, tensor {k}: {m}")
        torch.testing.assert_close(view, torch.stack(peers_buffers).mean(0), **TOL)
    assert ids == [id(t) for t in mine]
    return dp_group.size


def case_sequence_parallel_grads(seed):
    tp_group = ps.tensor_parallel_group()
    gen = torch.Generator().manual_seed(seed)
    shapes = [tuple(int(s) for s in torch.randint(1, 5, (2,), generator=gen)) for _ in range(5)]
    marked = [True, False, True, False, True]

    def grads_of(global_rank):
        g = torch.Generator().manual_seed(seed * 13 + global_rank)
        return [torch.randn(s, generator=g) for s in shapes]

    params = []
    for shape, sp, grad in zip(shapes, marked, grads_of(ps.get_rank())):
        p = nn.Parameter(torch.randn(shape))
        attach_spec_attributes(p, ParamSpec(full_shape=shape, sequence_parallel=sp))
        p.grad = grad.clone()
        params.append(p)
    no_grad = nn.Parameter(torch.randn(2))
    no_grad.sequence_parallel_enabled = True
    optimizer = torch.optim.SGD([{"params": params[:2] + [no_grad]}, {"params": params[2:], "lr": 0.1}], lr=1.0)
    nxg.allreduce_sequence_parallel_gradients(optimizer, bucket_cap_mb=1e-5)
    peers = [grads_of(r) for r in tp_group.ranks]  # TP peers only; DP peers hold other values
    for k, (p, sp) in enumerate(zip(params, marked)):
        expected = sum(peer[k] for peer in peers) if sp else peers[tp_group.rank][k]
        torch.testing.assert_close(p.grad, expected, **TOL, msg=lambda m: f"param {k} (sp={sp}): {m}")
    assert no_grad.grad is None
    return tp_group.size


@pytest.mark.parametrize("world,tp", [(4, 2), (4, 1), (2, 2)])
def test_dp_bucketing_and_sequence_parallel_grads(worlds, world, tp):
    # One run per case; each case covers its own configuration loop.
    assert worlds(world).run(case_dp_bucketing, tensor_model_parallel_size=tp, seed=11 + world + tp) == \
        [world // tp] * world
    assert worlds(world).run(case_sequence_parallel_grads, tensor_model_parallel_size=tp, seed=5 + world + tp) == \
        [tp] * world


def case_context_and_expert_passes(seed):
    """NxD's passes for parallelism nxdtp does not have, at their size 1: allreduce_context_parallel_gradients and
    bucket_allreduce_gradients(reduce_over_ep_group=True) leave every gradient as it is, i.e. equal to the dense
    full-batch gradient after the DP average (given by NxD's positional form)."""
    tp, dp = ps.get_tensor_model_parallel_size(), ps.get_data_parallel_size()
    dense = _dense_grads(seed)
    tp_model = _TPModel(dense)
    params = tp_model.parameters()
    x, target = _batch(seed)
    dp_rank = ps.get_data_parallel_rank()
    rows = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
    _loss(tp_model.forward(x[rows]), target[rows]).backward()
    nxg.bucket_allreduce_gradients([p.grad for p in params], False)        # NxD's positional form: the DP average
    _check_local_grads(tp_model, what=f"after the DP average (tp={tp}, dp={dp})")
    before = [p.grad.clone() for p in params]
    optimizer = torch.optim.AdamW([{"params": params[:3]}, {"params": params[3:], "lr": 0.5}], lr=0.1)
    nxg.allreduce_context_parallel_gradients(optimizer)
    nxg.bucket_allreduce_gradients([p.grad for p in params], True)         # NxD's expert-parallel pass
    nxg.bucket_allreduce_gradients([p.grad for p in params], reduce_over_ep_group=True, bucket_cap_mb=1e-5)
    changed = [k for k, (p, b) in enumerate(zip(params, before)) if not torch.equal(p.grad, b)]
    assert changed == [], f"gradients {changed} changed"
    _check_local_grads(tp_model, what="after the context- and expert-parallel passes")
    # Without a topology NxD's functions fail too: they read the parallel state.
    return tp * dp


@pytest.mark.parametrize("world,tp", [(2, 2), (4, 2)])
def test_context_and_expert_parallel_passes_leave_gradients_dense(worlds, world, tp):
    assert worlds(world).run(case_context_and_expert_passes, tensor_model_parallel_size=tp, seed=71 + world) == \
        [world] * world


# ---- argument checks (before any communication) ----------------------------------------------------------------------

@pytest.mark.parametrize("norm_type", [0, -1, -2.5, float("nan"), "two"])
def test_bad_norm_type_is_rejected(norm_type):
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match="norm_type="):
        nxg.get_grad_norm([p], norm_type=norm_type)
    with pytest.raises(ValueError, match="norm_type="):
        nxg.clip_grad_norm([p], 1.0, norm_type=norm_type)


@pytest.mark.parametrize("max_norm", [0, -1.0, float("nan")])
def test_bad_max_norm_is_rejected(max_norm):
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match="max_norm=.* must be > 0"):
        nxg.clip_grad_norm([p], max_norm)
    assert torch.equal(p.grad, torch.ones(2))


def test_bad_zero1_options_are_rejected():
    """ZeRO-1's form of the norm (tests/test_zero1.py) sums over the sharding groups: the data-parallel groups or
    another DP-aligned sharding (tests/test_zero1_groups.py); other groups, and groups without zero1_optimizer=True
    (NxD's error too), are refused with the valid values named."""
    with ps.simulated_topology(world_size=4, rank=0, tensor_model_parallel_size=2):
        with pytest.raises(ValueError, match=r"zero1_optimizer_groups=\[\[0, 2\], \[1, 3\]\] is given but "
                                             "zero1_optimizer=False"):
            nxg.get_grad_norm([], zero1_optimizer_groups=[[0, 2], [1, 3]])
        with pytest.raises(ValueError, match=r"sharding groups \[\[0, 1\], \[2, 3\]\] are not DP-aligned: .* "
                                             r"data-parallel group of \[\[0, 2\], \[1, 3\]\]"):
            nxg.clip_grad_norm([], 1.0, zero1_optimizer=True, zero1_optimizer_groups=[[0, 1], [2, 3]])
        assert nxg.zero1_sharding_group([[2, 0], [1, 3]]) is ps.data_parallel_group()
        assert nxg.zero1_sharding_group(None) is ps.data_parallel_group()
        assert nxg.zero1_sharding_group([[0], [1], [2], [3]]) is ps.get_topology().singleton


def test_shared_parameters_are_skipped_as_nxd_does():
    with ps.simulated_topology(world_size=1, rank=0, tensor_model_parallel_size=1):
        a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
        a.grad, b.grad = torch.full((2,), 3.0), torch.full((3,), 4.0)
        b.shared = True
        torch.testing.assert_close(nxg.get_grad_norm([a, b]), torch.tensor(18.0).sqrt())


def test_bad_bucket_cap_is_rejected():
    with ps.simulated_topology(world_size=4, rank=0, tensor_model_parallel_size=2):
        with pytest.raises(ValueError, match="bucket_cap_mb=0 must be > 0"):
            nxg.bucket_allreduce_gradients([torch.ones(2)], bucket_cap_mb=0)
        with pytest.raises(ValueError, match="bucket_cap_mb=0 must be > 0"):
            nxg.bucket_allreduce_gradients([torch.ones(2)], True, bucket_cap_mb=0)
        # nxdtp's old second parameter was the bucket cap: a number there now names NxD's parameter.
        with pytest.raises(TypeError, match=r"reduce_over_ep_group=256 must be True or False \(it is NxD's second "
                                            r"parameter; pass bucket_cap_mb= by keyword\)"):
            nxg.bucket_allreduce_gradients([torch.ones(2)], 256)


def test_context_and_expert_passes_need_a_topology():
    with pytest.raises(RuntimeError, match="model parallel is not initialized"):
        nxg.allreduce_context_parallel_gradients(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0))
    with pytest.raises(RuntimeError, match="model parallel is not initialized"):
        nxg.bucket_allreduce_gradients([torch.ones(1)], True)


def test_signatures_are_nxds():
    from tests.test_utils import REQUIRED, check_nxd_signature

    norm = [("norm_type", 2), ("zero1_optimizer", False), ("zero1_optimizer_groups", None), ("force_spmd", True)]
    for function, parameters in (
            (nxg.param_is_not_shared, [("param", REQUIRED)]),
            (nxg.get_grad_norm, [("parameters", REQUIRED)] + norm),
            (nxg.clip_grad_norm, [("parameters", REQUIRED), ("max_norm", REQUIRED)] + norm),
            (nxg.clip_grads_with_norm, [("parameters", REQUIRED), ("total_norm", REQUIRED), ("max_norm", REQUIRED)]),
            (nxg.bucket_allreduce_gradients, [("grads_list", REQUIRED), ("reduce_over_ep_group", False)]),
            (nxg.allreduce_sequence_parallel_gradients, [("optimizer", REQUIRED)]),
            (nxg.allreduce_context_parallel_gradients, [("optimizer", REQUIRED)])):
        check_nxd_signature(function, parameters)


# ---- non-finite gradients --------------------------------------------------------------------------------------------

def case_nonfinite_norm_and_clip(seed):
    """An inf / -inf / NaN in one gradient element, injected before the DP all-reduce on some ranks only: the norm is
    torch's dense norm (inf, or NaN if any NaN) on every rank, for every norm type, and clipping gives exactly torch's
    dense clipped gradients (finite ones scaled by max_norm / (inf + eps) = 0, the bad element inf * 0 = NaN; all NaN
    for a NaN norm)."""
    tp, dp, world, rank = (ps.get_tensor_model_parallel_size(), ps.get_data_parallel_size(), ps.get_world_size(),
                           ps.get_rank())
    dense = _dense_grads(seed)
    dense_params = list(dense.parameters())
    tp_model = _TPModel(dense)
    params = tp_model.parameters()
    last_tp_rank_cols = FFN // tp * (tp - 1)
    replica0 = list(range(tp))  # TP groups are contiguous ranks: DP replica 0 is ranks 0 .. tp-1
    # (name, index into tp_model.pairs, local element, dense element, ranks holding the bad value, dense reference?)
    scenarios = [
        ("sharded w1, last rank only", 2, (0, 1), (last_tp_rank_cols, 1), [world - 1], True),
        ("sharded b1, rank 0 only", 3, (2,), (2,), [0], True),
        ("replicated b2, every TP rank of one DP replica", 5, (3,), (3,), replica0, True),
        ("replicated ln_w, last rank only", 0, (4,), (4,), [world - 1], False),
    ]
    results = []
    for name, k, local_at, dense_at, bad_ranks, clip_is_dense in scenarios:
        for bad in (float("inf"), float("-inf"), float("nan")):
            for p in (2, 1.5, 1, float("inf")):
                what = f"{name}, grad {bad}, norm_type={p} (tp={tp}, dp={dp}, rank {rank})"
                for local, full, index in tp_model.pairs:
                    local.grad = full.grad[index].clone()
                if rank in bad_ranks:
                    params[k].grad[local_at] = bad
                nxg.bucket_allreduce_gradients([q.grad for q in params])  # the DP average spreads the bad value
                dense_grads = [q.grad.clone() for q in dense_params]
                dense_grads[k][dense_at] = bad
                expected = torch.nn.utils.get_total_norm(dense_grads, norm_type=p)
                assert not math.isfinite(expected.item()), what
                got = nxg.get_grad_norm(params, norm_type=p)
                torch.testing.assert_close(got, expected, equal_nan=True, rtol=0, atol=0,
                                           msg=lambda m: f"norm, {what}: {m}")
                # clip_grad_norm: the same pre-clip norm and torch's dense clipped gradients, element for element.
                dense_copy = copy.deepcopy(dense)
                for q, g in zip(dense_copy.parameters(), dense_grads):
                    q.grad = g.clone()
                dense_norm = torch_clip_grad_norm_(dense_copy.parameters(), 1.0, norm_type=p)
                total = nxg.clip_grad_norm(params, 1.0, norm_type=p)
                torch.testing.assert_close(total, dense_norm, equal_nan=True, rtol=0, atol=0,
                                           msg=lambda m: f"clip norm, {what}: {m}")
                if clip_is_dense:
                    for (local, _, index), full in zip(tp_model.pairs, dense_copy.parameters()):
                        torch.testing.assert_close(local.grad, full.grad[index], equal_nan=True, rtol=0, atol=0,
                                                   msg=lambda m: f"clipped grad {tuple(local.shape)}, {what}: {m}")
                results.append((name, str(bad), str(p), str(got.item())))
    # Finite gradients are unchanged by this: a finite case right after still equals dense.
    for local, full, index in tp_model.pairs:
        local.grad = full.grad[index].clone()
    torch.testing.assert_close(nxg.get_grad_norm(params), torch.nn.utils.get_total_norm(
        [q.grad for q in dense_params]), **TOL)
    return results


@pytest.mark.parametrize("world,tp", [(2, 2), (4, 2)])
def test_nonfinite_gradients_give_torchs_norm_and_clip_on_every_rank(worlds, world, tp):
    results = worlds(world).run(case_nonfinite_norm_and_clip, tensor_model_parallel_size=tp, seed=13 + world)
    assert all(r == results[0] for r in results), "ranks disagree on a non-finite norm"
    assert {r[3] for r in results[0]} == {"inf", "nan"}, results[0]


def case_expert_parallel_gradient_passes(tp, ep):
    """NxD's two passes with expert parallelism: the first sums over the expert data-parallel group and divides by the
    DP size (an expert gradient's average: its tokens came from the whole EP group), the second sums over the EP group
    without division, which makes a non-expert gradient the DP average."""
    ps.initialize_model_parallel(tp, expert_model_parallel_size=ep)
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        shapes = [(3, 5), (7,), (2, 2, 3)]

        def grads_of(r):
            generator = torch.Generator().manual_seed(100 + r)
            return [torch.randn(shape, generator=generator) for shape in shapes]

        every = [grads_of(r) for r in range(world)]
        mine = grads_of(rank)
        dp = ps.get_data_parallel_size()
        expert_data = next(g for g in ps.get_expert_data_parallel_replica_groups() if rank in g)
        expert = next(g for g in ps.get_expert_model_parallel_replica_groups() if rank in g)
        nxg.bucket_allreduce_gradients(mine, bucket_cap_mb=1e-4)
        for k, got in enumerate(mine):
            want = sum(every[r][k] for r in expert_data) / dp
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"expert pass, tensor {k}")
        nxg.bucket_allreduce_gradients(mine, reduce_over_ep_group=True)
        data = next(g for g in ps.get_data_parallel_replica_groups() if rank in g)
        assert sorted(r for m in expert for g in ps.get_expert_data_parallel_replica_groups() if m in g
                      for r in g) == sorted(data)
        for k, got in enumerate(mine):
            torch.testing.assert_close(got, sum(every[r][k] for r in data) / dp, rtol=1e-6, atol=1e-6,
                                       msg=f"non-expert pass, tensor {k}")
        return len(expert_data), len(expert)
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 2), (1, 4), (1, 1)])
def test_expert_parallel_gradient_passes_are_nxds(worlds, tp, ep):
    sizes = worlds(4).run(case_expert_parallel_gradient_passes, tensor_model_parallel_size=None, tp=tp, ep=ep)
    assert sizes == [(4 // (tp * ep), ep)] * 4

"""nxdtp.modules.moe against a dense mixture of experts written here token by token.

Every rank of a world of 4 gloo ranks holds the batch of its data-parallel rank (drawn from the seed and that DP rank),
so every rank can compute the dense layer on the global batch. The objective is the dense one on the global batch:
L = mean over DP ranks d of (<dy_d, out_d> + c * aux), aux the load-balancing loss over every token. Each rank's loss
is <dy_d, out_d> + c * aux_d with aux_d counted over the DP batch (``over_data_parallel_batch``), whose DP mean is L.
After backward and NxD's gradient reduction (sequence-parallel sum, then the two DP passes), every rank's gradients
must equal its slices of the dense gradients of L; its input gradient, the dense gradient of D * L.
"""
import math
import os

import pytest
import torch
import torch.nn.functional as F

from nxdtp import comm, grads
from nxdtp import parallel_state as ps
from nxdtp.modules.moe import ExpertMLPs, MoE, RouterSinkhorn, RouterTopK, SharedExperts, load_balancing_loss_func
from nxdtp.optimizer import Lamb
from nxdtp.spec import split_along

E, K, H, INTER, SHARED_INTER, B, S = 4, 2, 8, 6, 4, 2, 4
AUX_COEF = 0.3
# eps=1e-4, as tests/test_zero1.py explains: Adam's first step is lr * g / (|g| + eps), which turns last-bit noise in a
# near-zero gradient into an lr-sized difference when eps is tiny.
ADAMW = dict(lr=0.05, eps=1e-4, weight_decay=0.1)
LAMB = dict(lr=0.05, eps=1e-4, weight_decay=0.1)


def _draw(seed, shape, salt, scale=0.5):
    g = torch.Generator().manual_seed(seed * 7919 + salt)
    return torch.randn(shape, generator=g) * scale


def dense_parameters(seed, glu, shared):
    inter = 2 * INTER if glu else INTER
    p = {"router.weight": _draw(seed, (E, H), 1), "router.bias": _draw(seed, (E,), 2),
         "up": _draw(seed, (E, H, inter), 3), "down": _draw(seed, (E, INTER, H), 4)}
    if shared:
        p.update({"shared.gate": _draw(seed, (SHARED_INTER, H), 5), "shared.up": _draw(seed, (SHARED_INTER, H), 6),
                  "shared.down": _draw(seed, (H, SHARED_INTER), 7)})
    return p


def dense_capacity(tokens, capacity_factor):
    if capacity_factor is None or capacity_factor >= E / K:
        return tokens
    return min(tokens, math.ceil(tokens * K * capacity_factor / E))


def dense_moe(x, p, glu, capacity_factor, normalize, padding=None):
    """(output, router logits) of one DP rank's tokens x (T, H), token by token; ``padding``: the tokens (T,) that
    take no expert."""
    logits = x @ p["router.weight"].T + p["router.bias"]
    probs = F.softmax(logits.double(), dim=1).to(x.dtype)
    chosen = torch.topk(logits, K, dim=1).indices
    capacity, taken = dense_capacity(x.shape[0], capacity_factor), [0] * E
    keep = torch.zeros(x.shape[0], E, dtype=torch.bool)
    for t in range(x.shape[0]):
        if padding is not None and padding[t]:
            continue
        for e in chosen[t].tolist():
            taken[e] += 1
            keep[t, e] = taken[e] <= capacity
    weights = probs * keep
    if normalize:
        weights = weights / weights.sum(1, keepdim=True).clamp_min(1e-12)
    out = torch.zeros_like(x)
    for e in range(E):
        h = x @ p["up"][e]
        h = F.silu(h[:, :INTER]) * h[:, INTER:] if glu else F.silu(h)
        out = out + weights[:, e:e + 1] * (h @ p["down"][e])
    if "shared.gate" in p:
        out = out + (F.silu(x @ p["shared.gate"].T) * (x @ p["shared.up"].T)) @ p["shared.down"].T
    return out, logits


def dense_aux(logits):
    probs = F.softmax(logits.double(), dim=1)
    chosen = torch.topk(probs, K, dim=1).indices
    f = (chosen.unsqueeze(-1) == torch.arange(E)).float().mean(0)
    return (f * probs.float().mean(0)).sum() * (E / K)


def _batch(seed, dp_rank):
    return _draw(seed, (B, S, H), 100 + dp_rank, 1.0), _draw(seed, (B, S, H), 200 + dp_rank, 1.0)


def dense_reference(seed, dp_size, glu, shared, capacity_factor, normalize, sequence_major):
    """Every DP rank's (output, logits, input gradient of D * L) and the gradients of L, all (S, B, ...) when
    ``sequence_major``: the order in which a capacity fills matters, and the sequence-parallel layout is (S, B, H)."""
    p = {k: v.clone().requires_grad_(True) for k, v in dense_parameters(seed, glu, shared).items()}
    batches = [_batch(seed, d) for d in range(dp_size)]
    if sequence_major:
        batches = [(x.transpose(0, 1).contiguous(), dy.transpose(0, 1).contiguous()) for x, dy in batches]
    xs = [x.requires_grad_(True) for x, _ in batches]
    outs, logits, total = [], [], 0.0
    for x, (_, dy) in zip(xs, batches):
        out, lg = dense_moe(x.reshape(-1, H), p, glu, capacity_factor, normalize)
        outs.append(out.reshape(x.shape))
        logits.append(lg)
        total = total + (outs[-1] * dy).sum()
    objective = (total + dp_size * AUX_COEF * dense_aux(torch.cat(logits))) / dp_size
    objective.backward()
    return ([o.detach() for o in outs], [lg.detach() for lg in logits], [dp_size * x.grad for x in xs],
            {k: v.grad for k, v in p.items()}, objective.detach())


def _build(glu, shared, capacity_factor, normalize, sequence_parallel):
    router = RouterTopK(E, K, H, sequence_parallel_enabled=sequence_parallel, bias=True)
    experts = ExpertMLPs(E, K, H, INTER, "silu", glu_mlp=glu, capacity_factor=capacity_factor,
                         normalize_top_k_affinities=normalize)
    shared_experts = SharedExperts(H, SHARED_INTER, 1, "silu") if shared else None
    return MoE(router, experts, shared_experts, sequence_parallel_enabled=sequence_parallel, return_router_logits=True)


def _expert_slice(full, dim, stride):
    """This rank's experts of ``full`` (experts, ...), then its TP piece along ``dim``."""
    ep, tp = ps.get_expert_model_parallel_group(), ps.get_tensor_model_parallel_group()
    per_rank = full.shape[0] // ep.size()
    mine = full.narrow(0, ep.rank() * per_rank, per_rank)
    return split_along(mine, dim, tp.rank(), tp.size(), stride)


def _tp_slice(full, dim, stride=1):
    tp = ps.get_tensor_model_parallel_group()
    return split_along(full, dim, tp.rank(), tp.size(), stride)


def _local_views(moe, glu):
    """(parameter, how to cut the dense tensor named by the key to this rank's piece)."""
    views = {"router.weight": (moe.router.linear_router.weight, lambda t: t),
             "router.bias": (moe.router.linear_router.bias, lambda t: t)}
    up = moe.expert_mlps.mlp_op.gate_up_proj if glu else moe.expert_mlps.mlp_op.up_proj
    views["up"] = (up.weight, lambda t: _expert_slice(t, 2, 2 if glu else 1))
    views["down"] = (moe.expert_mlps.mlp_op.down_proj.weight, lambda t: _expert_slice(t, 1, 1))
    if moe.shared_experts is not None:
        views["shared.gate"] = (moe.shared_experts.gate_proj.weight, lambda t: _tp_slice(t, 0))
        views["shared.up"] = (moe.shared_experts.up_proj.weight, lambda t: _tp_slice(t, 0))
        views["shared.down"] = (moe.shared_experts.down_proj.weight, lambda t: _tp_slice(t, 1))
    return views


def _close(actual, expected, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def _reduce_gradients(moe, sequence_parallel):
    """NxD's order: the sequence-parallel sum over TP, the expert data-parallel pass, the expert-parallel pass."""
    params = list(moe.parameters())
    if sequence_parallel:
        grads.allreduce_sequence_parallel_gradients(params)
    grads.bucket_allreduce_gradients([p.grad for p in params])
    grads.bucket_allreduce_gradients([p.grad for p in params if not getattr(p, "expert_model_parallel", False)],
                                     reduce_over_ep_group=True)


def _dense_after_one_step(dense_params, dense_grads, optimizer=torch.optim.AdamW, **hyper):
    dense = {k: v.clone().requires_grad_(True) for k, v in dense_params.items()}
    for key, tensor in dense.items():
        tensor.grad = dense_grads[key].clone()
    optimizer(dense.values(), **(hyper or ADAMW)).step()
    return {k: v.detach() for k, v in dense.items()}


def _check_one_step(moe, views, expected, what):
    """One AdamW step (weight decay included) on every rank's pieces equals the step on the dense parameters."""
    for key, (param, cut) in views.items():
        _close(param.detach(), cut(expected[key]), f"{key} after one {what} step")


def _forward_backward(moe, seed, sequence_parallel):
    """This rank's output and router logits, and backward of its loss (the load-balancing loss over the DP batch)."""
    x, dy = _batch(seed, ps.get_data_parallel_rank())
    if sequence_parallel:   # NxD's sequence-parallel layout: (S / tp, B, H), this rank's sequence shard
        x, dy = (_tp_slice(t.transpose(0, 1).contiguous(), 0) for t in (x, dy))
    x.requires_grad_(True)
    out, router_logits = moe(x)
    aux = load_balancing_loss_func(router_logits, E, K, over_data_parallel_batch=True)
    ((out * dy).sum() + AUX_COEF * aux).backward()
    if sequence_parallel:
        grads.allreduce_sequence_parallel_gradients(list(moe.parameters()))
    return x, dy, out, router_logits, aux


def _loaded_moe(seed, glu, shared, capacity_factor, normalize, sequence_parallel):
    moe = _build(glu, shared, capacity_factor, normalize, sequence_parallel)
    views = _local_views(moe, glu)
    with torch.no_grad():
        for key, full in dense_parameters(seed, glu, shared).items():
            param, cut = views[key]
            param.copy_(cut(full))
    return moe, views


def case_moe_equals_dense(seed, tp, ep, glu, shared, capacity_factor, normalize, sequence_parallel):
    from nxdtp.optimizer import NeuronZero1Optimizer

    ps.initialize_model_parallel(tp, expert_model_parallel_size=ep)
    try:
        dp, dp_rank = ps.get_data_parallel_size(), ps.get_data_parallel_rank()
        outs, logits, dxs, dense_grads, objective = dense_reference(seed, dp, glu, shared, capacity_factor, normalize,
                                                                    sequence_parallel)
        setting = (seed, glu, shared, capacity_factor, normalize, sequence_parallel)
        moe, views = _loaded_moe(*setting)
        x, dy, out, router_logits, aux = _forward_backward(moe, seed, sequence_parallel)
        _close(out, _tp_slice(outs[dp_rank], 0) if sequence_parallel else outs[dp_rank], "output")
        _close(router_logits, logits[dp_rank], "router logits")
        grads.bucket_allreduce_gradients([p.grad for p in moe.parameters()])   # NxD's two passes
        grads.bucket_allreduce_gradients([p.grad for p in moe.parameters()
                                          if not getattr(p, "expert_model_parallel", False)], reduce_over_ep_group=True)
        _close(x.grad, _tp_slice(dxs[dp_rank], 0) if sequence_parallel else dxs[dp_rank], "input gradient")
        for key, (param, cut) in views.items():
            _close(param.grad, cut(dense_grads[key]), f"gradient of {key}")
        # The DP mean of the rank losses is the dense objective (a sequence-parallel rank's <dy, out> covers its
        # shard: sum those over TP); the norm counts every expert once.
        rank_loss = (out * dy).sum().detach()
        if sequence_parallel:
            rank_loss = comm.all_reduce(rank_loss, ps.tensor_parallel_group())
        rank_loss = rank_loss + AUX_COEF * aux.detach()
        _close(comm.all_reduce(rank_loss, ps.data_parallel_group()) / dp, objective, "loss")
        dense_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in dense_grads.values()]))
        _close(grads.get_grad_norm(moe), dense_norm, "gradient norm")
        expected = _dense_after_one_step(dense_parameters(seed, glu, shared), dense_grads)
        torch.optim.AdamW(moe.parameters(), **ADAMW).step()
        _check_one_step(moe, views, expected, "AdamW")
        # ZeRO-1: expert state sharded over the expert data-parallel group, the rest over DP; it averages itself.
        moe, views = _loaded_moe(*setting)
        _forward_backward(moe, seed, sequence_parallel)
        zero1 = NeuronZero1Optimizer(moe.parameters(), torch.optim.AdamW, max_norm=1e9, **ADAMW)
        zero1.step()
        _close(zero1.grad_norm, dense_norm, "ZeRO-1 gradient norm")
        _check_one_step(moe, views, expected, "ZeRO-1 AdamW")
        # Lamb: each expert tensor's trust ratio is the dense tensor's (its norms summed over TP and EP).
        moe, views = _loaded_moe(*setting)
        _forward_backward(moe, seed, sequence_parallel)
        grads.allreduce_gradients(moe)
        Lamb(moe.parameters(), **LAMB).step()
        _check_one_step(moe, views, _dense_after_one_step(dense_parameters(seed, glu, shared), dense_grads, Lamb,
                                                          **LAMB), "Lamb")
        return tuple(out.shape)
    finally:
        ps.destroy_model_parallel()


MOE_CASES = [
    # tp, ep, glu, shared, capacity_factor, normalize, sequence_parallel
    (1, 1, True, False, None, True, False),
    (2, 1, True, True, None, True, False),
    (2, 1, True, False, 1.0, True, True),
    (1, 2, True, True, None, False, False),
    (1, 4, False, False, 1.0, True, False),
    (2, 2, True, True, 1.0, True, False),
    (2, 2, False, True, None, False, True),
]


@pytest.mark.parametrize("tp,ep,glu,shared,capacity_factor,normalize,sequence_parallel", MOE_CASES)
def test_moe_equals_dense_on_the_global_batch(worlds, tp, ep, glu, shared, capacity_factor, normalize,
                                              sequence_parallel):
    _run_case(worlds, "gloo", tp, ep, glu, shared, capacity_factor, normalize, sequence_parallel)


@pytest.mark.slow
@pytest.mark.parametrize("world_name", ["cpu_refusing", "xla"])
def test_moe_equals_dense_on_worlds_whose_default_backend_is_not_gloo(worlds, world_name):
    # The TP x EP case, with a default backend that refuses CPU tensors (NCCL's stand-in) or is torch_xla's.
    _run_case(worlds, world_name, 2, 2, True, True, 1.0, True, True)


def _run_case(worlds, world_name, tp, ep, glu, shared, capacity_factor, normalize, sequence_parallel):
    shapes = worlds(4, world_name).run(case_moe_equals_dense, tensor_model_parallel_size=None, seed=5 + tp + 3 * ep,
                                       tp=tp, ep=ep, glu=glu, shared=shared, capacity_factor=capacity_factor,
                                       normalize=normalize, sequence_parallel=sequence_parallel)
    assert len(set(shapes)) == 1


# ---- the pieces against their definitions ----------------------------------------------------------------------------

def test_load_balancing_loss_is_hf_mixtrals_over_top_k():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func as hf_loss

    logits = [_draw(1, (12, E), layer) for layer in range(3)]
    ours = load_balancing_loss_func(torch.cat(logits), E, K)
    torch.testing.assert_close(ours * K, hf_loss(tuple(logits), E, K).float(), rtol=1e-6, atol=1e-6)


def _hf_mixtral_block(seed):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E, num_experts_per_tok=K,
                           hidden_act="silu")
    block = MixtralSparseMoeBlock(config)
    torch.manual_seed(seed)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.5)
    return block


def _hf_expert_weights(block):
    """(up (E, H, 2I) gate then up, down (E, I, H)) from either layout of transformers' Mixtral experts."""
    experts = block.experts
    if hasattr(experts, "gate_up_proj"):   # transformers 5: fused (E, 2I, H) and (E, H, I)
        return experts.gate_up_proj.transpose(1, 2), experts.down_proj.transpose(1, 2)
    up = torch.stack([torch.cat([x.w1.weight, x.w3.weight]).T for x in experts])
    return up, torch.stack([x.w2.weight.T for x in experts])


def test_moe_equals_hf_mixtral_block():
    """At one rank, MoE with Mixtral's settings (NxD's Mixtral example) equals transformers' MixtralSparseMoeBlock:
    output and router logits, and the input and weight gradients."""
    with ps.simulated_topology(world_size=1, rank=0, tensor_model_parallel_size=1):
        block = _hf_mixtral_block(3)
        moe = _build(glu=True, shared=False, capacity_factor=None, normalize=True, sequence_parallel=False)
        moe.router.linear_router.bias = None
        up, down = _hf_expert_weights(block)
        gate = block.gate.weight
        with torch.no_grad():
            moe.router.linear_router.weight.copy_(gate)
            moe.expert_mlps.mlp_op.gate_up_proj.weight.copy_(up)
            moe.expert_mlps.mlp_op.down_proj.weight.copy_(down)
        x = _draw(4, (B, S, H), 0, 1.0)
        x_hf, x_ours = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        expected = block(x_hf)
        expected_out = expected[0] if isinstance(expected, tuple) else expected
        out, logits = moe(x_ours)
        _close(out, expected_out, "output")
        _close(logits, x.reshape(-1, H) @ gate.T, "router logits")
        dy = _draw(5, (B, S, H), 0, 1.0)
        expected_out.backward(dy)
        out.backward(dy)
        _close(x_ours.grad, x_hf.grad, "input gradient")
        hf_up_grad, hf_down_grad = _hf_expert_weights(_GradView(block))
        _close(moe.expert_mlps.mlp_op.gate_up_proj.weight.grad, hf_up_grad, "gate_up gradient")
        _close(moe.expert_mlps.mlp_op.down_proj.weight.grad, hf_down_grad, "down gradient")
        _close(moe.router.linear_router.weight.grad, block.gate.weight.grad, "router gradient")


class _GradView:
    """The block with every parameter replaced by its gradient, for _hf_expert_weights."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        value = getattr(self._module, name)
        if isinstance(value, torch.nn.Parameter):
            return value.grad
        if isinstance(value, torch.nn.ModuleList):
            return [_GradView(m) for m in value]
        return _GradView(value) if isinstance(value, torch.nn.Module) else value


def test_sinkhorn_router_routes_on_balanced_scores_in_training():
    with ps.simulated_topology(world_size=1, rank=0, tensor_model_parallel_size=1):
        router = RouterSinkhorn(E, 1, H, sinkhorn_iterations=5)
        x = _draw(6, (3, 5, H), 0, 2.0)
        logits, affinities, index = router(x)
        cost = torch.exp(logits.detach())
        rows, cols = torch.ones(cost.shape[0]), torch.ones(E)
        for _ in range(5):   # Sinkhorn's scaling, written out: rows then columns towards equal sums
            rows = 1 / (cost.shape[0] * ((cols * cost).sum(1) + 1e-8))
            cols = 1 / (E * ((rows[:, None] * cost).sum(0) + 1e-8))
        _close(index, torch.argmax(cols * cost * rows[:, None], dim=1, keepdim=True), "balanced choice")
        _close(affinities, torch.sigmoid(logits.double()).float(), "affinities")
        router.eval()
        _close(router(x)[2], torch.argmax(logits, dim=1, keepdim=True), "evaluation choice")


def test_padded_tokens_take_no_capacity_and_no_expert():
    """``padding_mask`` (B, S): a padded token gets no routed output and leaves its slots to the real tokens after it,
    in the layer's token order."""
    with ps.simulated_topology(world_size=1, rank=0, tensor_model_parallel_size=1):
        moe = _build(glu=True, shared=False, capacity_factor=1.0, normalize=True, sequence_parallel=False)
        p = dense_parameters(9, glu=True, shared=False)
        views = _local_views(moe, glu=True)
        with torch.no_grad():
            for key, full in p.items():
                views[key][0].copy_(full)
        x = _draw(10, (B, S, H), 0, 1.0)
        mask = torch.ones(B, S, dtype=torch.long)
        mask[0, :2] = 0   # padded at the front: without the mask they would take the first slots
        out, _ = moe(x, padding_mask=mask)
        expected, _ = dense_moe(x.reshape(-1, H), p, True, 1.0, True, padding=mask.reshape(-1) == 0)
        _close(out, expected.reshape(B, S, H), "output with padding")
        assert torch.equal(out[0, :2], torch.zeros(2, H))


def case_ranks_with_different_token_counts(seed, tp, ep):
    """Each DP rank routes a different number of tokens (a shorter last batch, per-batch padding): the expert-parallel
    ranks agree on the slots' shape, and every rank's output is the dense layer's on its tokens."""
    ps.initialize_model_parallel(tp, expert_model_parallel_size=ep)
    try:
        moe, _ = _loaded_moe(seed, True, False, None, True, False)
        dp_rank = ps.get_data_parallel_rank()
        x = _draw(seed, (1 + dp_rank, S, H), 300 + dp_rank, 1.0)
        out, _ = moe(x)
        expected, _ = dense_moe(x.reshape(-1, H), dense_parameters(seed, True, False), True, None, True)
        _close(out, expected.reshape(x.shape), f"output of DP rank {dp_rank}")
        out.sum().backward()
        return tuple(x.shape)
    finally:
        ps.destroy_model_parallel()


def test_ranks_with_different_token_counts(worlds):
    shapes = worlds(4).run(case_ranks_with_different_token_counts, tensor_model_parallel_size=None, seed=21, tp=1,
                           ep=2)
    assert shapes == [(1, S, H), (2, S, H), (3, S, H), (4, S, H)]


# ---- refusals --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make,error,match", [
    (lambda: ExpertMLPs(6, 2, H, INTER, "silu", True, None), ValueError,
     r"num_experts=6 is not divisible by expert_model_parallel_size=4; valid expert-parallel sizes for 6 experts: "
     r"\[1, 2, 3, 6\]"),
    (lambda: ExpertMLPs(E, 5, H, INTER, "silu", True, None), ValueError,
     r"top_k=5 must be between 1 and num_experts=4"),
    (lambda: ExpertMLPs(E, 1, H, INTER, "silu", True, None, normalize_top_k_affinities=True), ValueError,
     r"normalize_top_k_affinities=True needs top_k > 1"),
    (lambda: ExpertMLPs(E, K, H, INTER, "swish", True, None), ValueError, r"hidden_act='swish' is not supported"),
    (lambda: ExpertMLPs(E, K, H, INTER, "silu", True, None, early_expert_affinity_modulation=True), ValueError,
     r"early_expert_affinity_modulation=True needs top_k=1, got top_k=2"),
    (lambda: ExpertMLPs(E, K, H, INTER, "silu", True, None, bias=True), ValueError,
     r"bias=True is not supported by nxdtp"),
    (lambda: ExpertMLPs(E, K, H, INTER, "silu", True, None, block_sizes=4), TypeError,
     r"unexpected keyword arguments \['block_sizes'\]"),
    (lambda: RouterSinkhorn(E, 2, H), ValueError, r"top_k=2 is not supported, use 1"),
    (lambda: RouterTopK(E, K, H, act_fn="relu"), ValueError, r"act_fn='relu' is not supported"),
    (lambda: MoE(RouterTopK(E, 1, H), ExpertMLPs(E, K, H, INTER, "silu", True, None)), ValueError,
     r"the router has top_k=1 but expert_mlps has top_k=2"),
    (lambda: MoE(RouterTopK(E, K, H, sequence_parallel_enabled=True), ExpertMLPs(E, K, H, INTER, "silu", True, None)),
     ValueError, r"the router runs sequence-parallel, so the layer must too"),
    (lambda: MoE(RouterTopK(E, K, H), ExpertMLPs(E, K, H, INTER, "silu", True, None), token_shuffle_group_size=2),
     ValueError, r"token_shuffle_group_size=2 is not supported by nxdtp"),
])
def test_bad_settings_are_refused_by_name(make, error, match):
    with ps.simulated_topology(world_size=4, rank=1, tensor_model_parallel_size=1, expert_model_parallel_size=4):
        with pytest.raises(error, match=match):
            make()


def test_expert_parallel_state_is_refused_where_it_would_be_lost():
    """DCP's live state (dcp_state) would file one rank's experts as all of them; ZeRO-1's expert shards are cut
    over another group."""
    from nxdtp.checkpointing.dcp_state import get_state_dict
    from nxdtp.optimizer import NeuronZero1Optimizer

    with ps.simulated_topology(world_size=4, rank=1, tensor_model_parallel_size=1, expert_model_parallel_size=2):
        experts = ExpertMLPs(E, K, H, INTER, "silu", True, None)
        zero1 = NeuronZero1Optimizer(experts.parameters(), torch.optim.AdamW)
        with pytest.raises(NotImplementedError, match=r"state_dict\(\): the state of expert parameters sharded over "
                                                      r"the expert data-parallel group is not saved yet"):
            zero1.state_dict()
        with pytest.raises(NotImplementedError, match=r"sharding_groups=\[\[0\], \[1\], \[2\], \[3\]\] with "
                                                      r"expert parallelism"):
            NeuronZero1Optimizer(experts.parameters(), torch.optim.AdamW, sharding_groups=[[0], [1], [2], [3]])
        with pytest.raises(NotImplementedError, match=r"'mlp_op.gate_up_proj.weight' holds this rank's share of "
                                                      r"experts split over expert_model_parallel_size=2 ranks: DCP "
                                                      r"state of expert-parallel models is not supported yet"):
            get_state_dict(experts)


# ---- checkpoints -----------------------------------------------------------------------------------------------------

def _full_state(p):
    """The dense parameters under the state-dict keys of ``_build``'s MoE (NxD's full checkpoint)."""
    return {"router.linear_router.weight": p["router.weight"], "router.linear_router.bias": p["router.bias"],
            "expert_mlps.mlp_op.gate_up_proj.weight": p["up"], "expert_mlps.mlp_op.down_proj.weight": p["down"],
            "shared_experts.gate_proj.weight": p["shared.gate"], "shared_experts.up_proj.weight": p["shared.up"],
            "shared_experts.down_proj.weight": p["shared.down"]}


def case_expert_checkpoint(directory, tp, ep, save):
    """At tp x ep: NxD's full state dict cut by ``get_sharded_model_dict`` and saved (``save``), or the checkpoint
    loaded; either way every parameter must be this rank's slice of the dense one (its experts, its TP piece)."""
    from nxdtp import checkpointing

    ps.initialize_model_parallel(tp, expert_model_parallel_size=ep)
    try:
        moe = _build(glu=True, shared=True, capacity_factor=None, normalize=True, sequence_parallel=False)
        dense = dense_parameters(5, glu=True, shared=True)
        if save:
            moe.load_state_dict(checkpointing.get_sharded_model_dict(moe, _full_state(dense)))
            checkpointing.save({"model": moe}, directory)
        else:
            checkpointing.load(directory, model=moe)
        for key, (param, cut) in _local_views(moe, glu=True).items():
            assert torch.equal(param.detach(), cut(dense[key])), (tp, ep, key)
        return (tp, ep)
    finally:
        ps.destroy_model_parallel()


def test_nxd_experts_saved_at_tp2_ep2_load_at_other_sizes(worlds, tmp_path):
    """The experts' checkpoint layout: files hold every expert, so after a reshard over TP alone the checkpoint loads
    at any expert-parallel size."""
    from nxdtp.checkpointing.merge import reshard

    saved = str(tmp_path / "tp2")
    assert worlds(4).run(case_expert_checkpoint, tensor_model_parallel_size=None, directory=saved, tp=2, ep=2,
                         save=True) == [(2, 2)] * 4
    for tp, ep in [(2, 2), (2, 1), (1, 4), (1, 2)]:   # INTER=6: tp=4 does not divide gate|up
        directory = saved if tp == 2 else str(tmp_path / f"tp{tp}")
        if not os.path.isdir(directory):
            reshard(saved, directory, tp, progress=False)
        assert worlds(4).run(case_expert_checkpoint, tensor_model_parallel_size=None, directory=directory, tp=tp,
                             ep=ep, save=False) == [(tp, ep)] * 4


def _expert_state(optimizer, moe):
    """The Adafactor state of the expert weights (factored row and column statistics), by parameter name."""
    names = {id(p): n for n, p in moe.named_parameters()}
    return {names[id(p)]: {field: value.clone() for field, value in optimizer.state[p].items() if value.dim() > 0}
            for p in optimizer.state if getattr(p, "expert_model_parallel", False)}


def case_adafactor_state(directory, ep, save):
    """One Adafactor step at tp=1 x ep (every rank the same batch), saved; or the checkpoint loaded at this ep. Returns
    this rank's experts' factored statistics and its expert rank."""
    from nxdtp import checkpointing

    ps.initialize_model_parallel(1, expert_model_parallel_size=ep)
    try:
        moe = _build(glu=True, shared=False, capacity_factor=None, normalize=True, sequence_parallel=False)
        moe.load_state_dict(checkpointing.get_sharded_model_dict(moe, {
            k: v for k, v in _full_state(dense_parameters(5, glu=True, shared=True)).items() if "shared" not in k}))
        optimizer = torch.optim.Adafactor(moe.parameters(), lr=0.01)
        if save:
            x = _batch(5, 0)[0].transpose(0, 1).contiguous()
            moe(x)[0].square().sum().backward()
            grads.allreduce_gradients(moe)
            optimizer.step()
            checkpointing.save({"model": moe, "optimizer": optimizer}, directory)
        else:
            checkpointing.load(directory, model=moe, optimizer=optimizer)
        return ps.get_expert_model_parallel_rank(), _expert_state(optimizer, moe)
    finally:
        ps.destroy_model_parallel()


def test_expert_optimizer_state_of_other_shapes_is_stored_with_every_expert(worlds, tmp_path):
    """Adafactor's factored statistics are indexed by the experts but are not parameter-shaped: saved at ep=2 they
    hold every expert, and load at ep=4 and ep=1 as each rank's experts of them."""
    saved = worlds(4).run(case_adafactor_state, tensor_model_parallel_size=None, directory=str(tmp_path), ep=2,
                          save=True)
    every = {name: {field: torch.cat([s[1][name][field] for s in saved[:2]]) for field in fields}
             for name, fields in saved[0][1].items()}     # ranks 0 and 1 are expert ranks 0 and 1 of one group
    assert [s[0] for s in saved[:2]] == [0, 1] and every and all(f["row_var"].abs().sum() > 0 for f in every.values())
    for ep in (4, 1):
        for expert_rank, state in worlds(4).run(case_adafactor_state, tensor_model_parallel_size=None,
                                                directory=str(tmp_path), ep=ep, save=False):
            for name, fields in every.items():
                for field, value in fields.items():
                    mine = value.narrow(0, expert_rank * (E // ep), E // ep)
                    assert torch.equal(state[name][field], mine), (ep, expert_rank, name, field)


@pytest.mark.slow
@pytest.mark.parametrize("world", ["cpu_refusing", "xla"])
def test_expert_checkpoints_on_worlds_whose_default_backend_is_not_gloo(worlds, tmp_path, world):
    """The experts are gathered on the host when saved: on an NCCL-like world and an XLA world that is the gloo twin
    of the expert-parallel group, and the checkpoint loads at another expert-parallel size."""
    saved = str(tmp_path / "tp2")
    assert worlds(4, world).run(case_expert_checkpoint, tensor_model_parallel_size=None, directory=saved, tp=2, ep=2,
                                save=True) == [(2, 2)] * 4
    assert worlds(4, world).run(case_expert_checkpoint, tensor_model_parallel_size=None, directory=saved, tp=2, ep=1,
                                save=False) == [(2, 1)] * 4

"""nxdtp.optimizer.NeuronZero1Optimizer (ZeRO-1 over DP) against the dense model on gloo ranks.

Every multi-rank case builds the dense HF model on every rank from one seed with every parameter randomised (biases and
norms included), parallelizes a copy with the model's plan, and trains both for 3 steps on a new global batch each step:
the dense model on the whole batch with the torch optimizer, ``torch.nn.utils.clip_grad_norm_`` at a ``max_norm`` that
clips (the test checks that it does) and an LR scheduler; the parallel model with each DP rank on its own rows of the
batch (its loss normalised by the global target count, times dp, so the DP average is the global mean), through
``NeuronZero1Optimizer`` with the same param groups (two, with their own lr and weight decay) and the same scheduler on
the wrapper. After every step ``grad_norm`` equals the dense pre-clip norm; after the last, every parameter equals the
matching slice of the dense one. Worlds: tp2 x dp2 and tp1 x dp4 (so the shards of one tensor live on 2 and 4 ranks,
with padding: the Llama's tensors are not all multiples of 4); models: a tiny Llama (odd vocabulary padded for TP,
grouped-query attention, attention and MLP biases) and the BERT plan (BertForPreTraining, MLM + NSP); norm types 2 and
inf; gradient accumulation over 2 micro-steps, in ``.grad`` and in fp32 ``main_grad`` (``use_grad_acc_hook``); inner
optimizers AdamW, SGD with momentum, nxdtp's Lamb (whose per-tensor trust ratio needs the shards' norms summed over
the sharding group) and NxD's AdamW_FP32OptimParams.

Tolerance: fp32 1e-5 (absolute and relative). Adam and Lamb use ``eps=1e-4``: an element whose gradient is 0 in exact
arithmetic (the attention key bias: softmax ignores a shift shared by all keys) has a ~1e-10 rounding residue whose
sign decides an Adam step of +-lr when eps is tiny; with eps=1e-4 that residue moves the weight by ~1e-9.

Also: fp32 master shards of bf16 parameters keep updates below bf16 resolution (an SGD step of 1e-3 on weights of 1.0,
whose bf16 neighbours are 2^-8 apart; the control with ``optimizer_dtype=torch.bfloat16`` shows that such a step is lost
without the master); per-rank optimizer-state bytes are 1/dp of plain AdamW's plus the padding; a state dict round trip
(optimizer loaded *before* the model) continues as the uninterrupted run; a plain optimizer's state dict is refused;
bad arguments are refused with the value named.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from nxdtp import parallel_state as ps
from nxdtp.optimizer import AdamW_FP32OptimParams, Lamb, NeuronZero1Optimizer, optimizer_state_bytes
from nxdtp.spec import FlatShardLayout

transformers = pytest.importorskip("transformers")

# torch's own clip_grad_norm_ (torch_xla replaces torch.nn.utils.clip_grad_norm_ when it is imported; see test_grads).
torch_clip_grad_norm_ = torch.nn.utils.clip_grad.clip_grad_norm_
TOL = dict(rtol=1e-5, atol=1e-5)
STEPS = 3

INNER = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-4, weight_decay=0.01)),
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    "lamb": (Lamb, dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-4, weight_decay=0.01)),
    "adamw_fp32": (AdamW_FP32OptimParams, dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-4, weight_decay=0.01)),
}


def _groups(named_params):
    """Two groups with their own hyper-parameters: no decay and a higher lr for biases and norms."""
    named = list(named_params)
    plain = [p for n, p in named if "bias" in n or "norm" in n.lower()]
    decay = [p for n, p in named if not ("bias" in n or "norm" in n.lower())]
    return [{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0, "lr_scale": 2.0}]


def _apply_lr_scale(groups, lr):
    for g in groups:
        g["lr"] = lr * g.pop("lr_scale", 1.0)
    return groups


# ---- models and batches ----------------------------------------------------------------------------------------------

def _llama():
    from tests.test_models_decoders import _config, _dense

    return _dense("llama", _config("llama", kv_heads=2), seed=5)


def _llama_batches(step, dp, micro_steps):
    """The dense call on the global batch of 8 sequences, and this DP rank's micro-batch calls."""
    from tests.test_models_decoders import SEQ, VOCAB

    g = torch.Generator().manual_seed(100 + step)
    input_ids = torch.randint(0, VOCAB, (8, SEQ), generator=g)
    labels = input_ids.clone()
    labels[0, :5] = -100          # uneven target counts over the DP ranks
    labels[5, 2] = -100
    items = (labels[:, 1:] != -100).sum()
    rows = 8 // dp
    start = ps.get_data_parallel_rank() * rows
    per_micro = rows // micro_steps
    micro = [dict(input_ids=input_ids[s:s + per_micro], labels=labels[s:s + per_micro], num_items_in_batch=items)
             for s in range(start, start + rows, per_micro)]
    return dict(input_ids=input_ids, labels=labels), micro, dp   # parallel losses are scaled by dp


def _bert():
    from transformers import BertForPreTraining

    from tests.test_models_bert import _config, _dense

    return _dense(BertForPreTraining, _config(101), seed=7)


def _bert_batches(step, dp, micro_steps):
    from tests.test_models_bert import _batch, _config

    assert micro_steps == 1, "the BERT case takes one micro-step"
    full = _batch(_config(101), batch=4, seed=11 + step, masked_per_sequence=[1, 2, 5, 7])
    rows = 4 // dp
    start = ps.get_data_parallel_rank() * rows
    local = {k: v[start:start + rows] for k, v in full.items()}
    local.update(mlm_denominator=int((full["labels"] != -100).sum()), nsp_denominator=4)
    return full, [local], 1   # the BERT plan's loss with denominators is already the rank's share times dp


MODELS = {"llama": (_llama, _llama_batches), "bert": (_bert, _bert_batches)}


def _parallelize(kind, dense):
    from nxdtp.models import parallelize_model

    return parallelize_model(copy.deepcopy(dense))


# ---- ZeRO-1 equals dense ---------------------------------------------------------------------------------------------

def case_zero1_equals_dense(model: str, inner: str, norm_type: float, accumulate: str, max_norm: float,
                            device: str = "cpu"):
    """``device``: where both models train (tests/test_cuda.py runs this case on a GPU)."""
    from nxdtp import move_model_to_device
    from tests.test_models_bert import _check_weights

    dp = ps.get_data_parallel_size()
    build, batches = MODELS[model]
    dense = build()
    parallel = move_model_to_device(_parallelize(model, dense), device)
    dense.to(device)
    on_device = lambda batch: {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}  # noqa: E731
    optimizer_class, kwargs = INNER[inner]
    micro_steps = 1 if accumulate == "none" else 2

    dense_opt = optimizer_class(_apply_lr_scale(_groups(dense.named_parameters()), kwargs["lr"]), **kwargs)
    zero = NeuronZero1Optimizer(_apply_lr_scale(_groups(parallel.named_parameters()), kwargs["lr"]), optimizer_class,
                                max_norm=max_norm, norm_type=norm_type, use_grad_acc_hook=accumulate == "hook",
                                **kwargs)
    schedule = lambda step: 1.0 / (1.0 + step)  # noqa: E731
    dense_sched = torch.optim.lr_scheduler.LambdaLR(dense_opt, schedule)
    zero_sched = torch.optim.lr_scheduler.LambdaLR(zero, schedule)
    what = f"{model} tp={ps.get_tensor_model_parallel_size()} dp={dp} {inner} norm={norm_type} accumulate={accumulate}"
    norms = []
    for step in range(STEPS):
        full, micro, scale = batches(step, dp, micro_steps)
        full, micro = on_device(full), [on_device(batch) for batch in micro]
        dense_opt.zero_grad()
        dense(**full).loss.backward()
        dense_norm = torch_clip_grad_norm_(dense.parameters(), max_norm, norm_type=norm_type)
        assert dense_norm > 1.5 * max_norm, f"{what} step {step}: max_norm={max_norm} does not clip ({dense_norm})"
        dense_opt.step()
        dense_sched.step()

        zero.zero_grad(set_to_none=True)
        for batch in micro:
            (parallel(**batch).loss * scale).backward()
        if accumulate == "hook":
            assert all(p.grad is None for p in parallel.parameters()), f"{what}: the hook left .grad set"
        zero.step()
        zero_sched.step()
        torch.testing.assert_close(zero.grad_norm, dense_norm.to(torch.float32), **TOL,
                                   msg=lambda m: f"{what} step {step} grad_norm: {m}")
        assert [g["lr"] for g in zero.param_groups] == [g["lr"] for g in dense_opt.param_groups]
        norms.append(float(zero.grad_norm))
    _check_weights(parallel, dense, what)
    return norms


CONFIGS = [
    # (world, tp, model, inner, norm_type, accumulate, max_norm)
    (4, 2, "llama", "adamw", 2.0, "none", 0.5),
    (4, 1, "llama", "adamw", 2.0, "hook", 0.5),
    (4, 2, "llama", "adamw", math.inf, "grad", 0.02),
    (4, 1, "llama", "adamw", math.inf, "none", 0.02),
    (4, 2, "bert", "adamw", 2.0, "none", 0.5),
    (4, 1, "bert", "adamw", math.inf, "none", 0.02),
    (4, 2, "llama", "sgd", 2.0, "none", 0.5),
    (4, 2, "llama", "lamb", 2.0, "hook", 0.5),
    (4, 1, "bert", "lamb", 2.0, "none", 0.5),
    (4, 2, "llama", "adamw_fp32", 2.0, "hook", 0.5),
]


@pytest.mark.parametrize("world,tp,model,inner,norm_type,accumulate,max_norm", CONFIGS,
                         ids=[f"tp{c[1]}xdp{c[0] // c[1]}-{c[2]}-{c[3]}-norm{c[4]}-acc_{c[5]}" for c in CONFIGS])
def test_zero1_equals_dense(worlds, world, tp, model, inner, norm_type, accumulate, max_norm):
    results = worlds(world).run(case_zero1_equals_dense, tensor_model_parallel_size=tp, model=model, inner=inner,
                                norm_type=norm_type, accumulate=accumulate, max_norm=max_norm)
    assert all(r == results[0] for r in results), f"ranks disagree on grad_norm: {results}"


# ---- fp32 master shards of bf16 parameters ---------------------------------------------------------------------------

def case_bf16_master(optimizer_dtype):
    weight = torch.nn.Parameter(torch.ones(7, 3, dtype=torch.bfloat16))   # 21 elements: padded on dp=2 and dp=4
    zero = NeuronZero1Optimizer([weight], torch.optim.SGD, optimizer_dtype=optimizer_dtype, grad_clipping=False,
                                lr=1e-3, momentum=0.0)
    for _ in range(20):
        weight.grad = torch.ones_like(weight)   # the same on every rank: the DP average is 1
        zero.step()
    shard = zero.base_optimizer.param_groups[0]["params"][0]
    return weight.detach().float().unique().tolist(), str(shard.dtype), str(weight.dtype)


@pytest.mark.parametrize("tp", [2, 1])
def test_bf16_parameters_keep_sub_resolution_updates_in_fp32_master_shards(worlds, tp):
    # 20 steps of 1e-3 each: 0.98 in the fp32 master, 0.98046875 in bf16 (neighbours 2^-8 apart below 1.0).
    for values, shard_dtype, param_dtype in worlds(4).run(case_bf16_master, tensor_model_parallel_size=tp,
                                                          optimizer_dtype=None):
        assert (shard_dtype, param_dtype) == ("torch.float32", "torch.bfloat16")
        assert values == [float(torch.tensor(0.98).to(torch.bfloat16))], values
    # Control: without an fp32 master each step rounds back to 1.0, so the assertion above can fail.
    for values, shard_dtype, _ in worlds(4).run(case_bf16_master, tensor_model_parallel_size=tp,
                                                optimizer_dtype=torch.bfloat16):
        assert shard_dtype == "torch.bfloat16"
        assert values == [1.0], values


# ---- memory ----------------------------------------------------------------------------------------------------------

def case_state_bytes():
    dp = ps.get_data_parallel_size()
    dense = _llama()
    model = _parallelize("llama", dense)
    plain_model = copy.deepcopy(model)
    zero = NeuronZero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-3)
    _, micro, scale = _llama_batches(0, dp, 1)
    for m, opt in ((model, zero), (plain_model, plain)):
        (m(**micro[0]).loss * scale).backward()
        if opt is plain:
            from nxdtp.grads import allreduce_gradients

            allreduce_gradients(plain_model)
        opt.step()
    params = list(model.parameters())
    layouts = [FlatShardLayout(tuple(p.shape), dp) for p in params]
    padding = sum(lay.padding for lay in layouts)
    measured = zero.state_bytes()
    plain_bytes = optimizer_state_bytes(plain)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    return dict(dp=dp, n_params=len(params), padding=padding, zero=measured["state"], master=measured["master"],
                plain=plain_bytes, param_bytes=param_bytes, numel=sum(p.numel() for p in params))


@pytest.mark.parametrize("tp", [2, 1])
def test_optimizer_state_is_one_dp_th_of_plain_adamw(worlds, tp):
    for r in worlds(4).run(case_state_bytes, tensor_model_parallel_size=tp):
        dp, n = r["dp"], r["n_params"]
        # Per parameter: exp_avg + exp_avg_sq (8 bytes per element) over the shard, and a 4-byte step counter, which
        # every rank keeps whole (plain/dp counts 4/dp of it).
        allowance = 8 * r["padding"] + 4 * n * (1 - 1 / dp)
        assert r["zero"] <= r["plain"] / dp + allowance, r
        assert r["padding"] < dp * n, r
        assert r["plain"] == 8 * r["numel"] + 4 * n, r   # the reference is what it should be
        assert r["master"] == 4 * (r["numel"] + r["padding"]) // dp, r


# ---- state dict ------------------------------------------------------------------------------------------------------

def case_state_dict_round_trip():
    dp = ps.get_data_parallel_size()

    def build():
        model = _parallelize("llama", _llama())
        opt = NeuronZero1Optimizer(_apply_lr_scale(_groups(model.named_parameters()), 1e-3), torch.optim.AdamW,
                                   max_norm=0.5, lr=1e-3, eps=1e-4)
        return model, opt

    def train(model, opt, steps):
        for step in steps:
            _, micro, scale = _llama_batches(step, dp, 1)
            opt.zero_grad(set_to_none=True)
            (model(**micro[0]).loss * scale).backward()
            opt.step()

    model, opt = build()
    train(model, opt, range(2))
    saved = copy.deepcopy(opt.state_dict())
    assert set(saved) >= {"base_state", "shape_info", "sharded_master_weights", "param_groups", "zero1"}
    train(model, opt, [2])
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}

    # A fresh job: the optimizer is loaded first, while the model still holds its initial weights; the master
    # shards in the state dict put the trained weights back into the model.
    resumed, resumed_opt = build()
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)
    resumed_opt.load_state_dict(saved)
    train(resumed, resumed_opt, [2])
    worst = max((p.detach() - expected[n]).abs().max().item() for n, p in resumed.named_parameters())
    assert worst == 0.0, f"resumed run differs from the uninterrupted one by {worst}"

    plain = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        resumed_opt.load_state_dict(plain.state_dict())
    except ValueError as e:
        assert "non-ZeRO optimizer" in str(e), e
    else:
        raise AssertionError("a plain AdamW state dict was accepted by NeuronZero1Optimizer")
    return worst


def test_state_dict_round_trip_does_not_depend_on_load_order(worlds):
    assert worlds(4).run(case_state_dict_round_trip, tensor_model_parallel_size=2) == [0.0] * 4


# ---- arguments -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,error,match", [
    (dict(optimizer_class=dict), TypeError, r"optimizer_class=<class 'dict'> must be a torch.optim.Optimizer subclass"),
    (dict(optimizer_dtype=torch.int32), ValueError, r"optimizer_dtype=torch.int32 must be a floating torch dtype"),
    (dict(max_norm=0.0), ValueError, r"max_norm=0.0 must be > 0"),
    (dict(norm_type=-1), ValueError, r"norm_type=-1 is not supported"),
    (dict(sharding_groups=[[0, 1], [2, 3]]), ValueError,
     r"sharding groups \[\[0, 1\], \[2, 3\]\] are not DP-aligned: .*data-parallel group of \[\[0, 2\], \[1, 3\]\]"),
    (dict(grad_norm_groups=[[0, 2], [1, 3]]), ValueError,
     r"grad_norm_groups=\[\[0, 2\], \[1, 3\]\] is not supported; .*tensor-parallel groups \[\[0, 1\], \[2, 3\]\]"),
    (dict(bucket_cap_mb_reduce_scatter=-1), ValueError, r"bucket_cap_mb_reduce_scatter=-1 must be a number of MiB"),
    (dict(use_grad_acc_hook="yes"), TypeError, r"use_grad_acc_hook='yes' must be True or False"),
])
def test_bad_arguments_are_refused(kwargs, error, match):
    with ps.simulated_topology(world_size=4, rank=0, tensor_model_parallel_size=2):
        rest = dict(kwargs)
        optimizer_class = rest.pop("optimizer_class", torch.optim.AdamW)
        with pytest.raises(error, match=match):
            NeuronZero1Optimizer([torch.nn.Parameter(torch.ones(3))], optimizer_class, lr=1e-3, **rest)


def test_needs_a_topology():
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        NeuronZero1Optimizer([torch.nn.Parameter(torch.ones(3))], torch.optim.AdamW)


def test_accepted_sharding_groups_and_lazy_init():
    with ps.simulated_topology(world_size=4, rank=0, tensor_model_parallel_size=2):
        for groups in (None, ps.get_data_parallel_group(as_list=True), ps.get_zero1_sharding_groups()):
            opt = NeuronZero1Optimizer([torch.nn.Parameter(torch.ones(3))], torch.optim.AdamW, lazy_init=True,
                                       sharding_groups=groups, grad_norm_groups=None, lr=1e-3)
            assert opt.sharding_groups == [[0, 2], [1, 3]] and opt.grad_norm is None and not opt.inited
            with pytest.raises(RuntimeError, match=r"lazy_init=True: call init_zero\(\)"):
                opt.step()


def test_flat_shard_layout():
    layout = FlatShardLayout((7, 3), 4)
    assert (layout.numel, layout.shard_numel, layout.padded_numel, layout.padding) == (21, 6, 24, 3)
    full = torch.arange(21.0).reshape(7, 3)
    shards = [layout.shard_of(full, r) for r in range(4)]
    assert shards[3].tolist() == [18.0, 19.0, 20.0, 0.0, 0.0, 0.0]
    assert torch.equal(layout.full_from_shards(shards), full)
    assert FlatShardLayout.from_dict(layout.to_dict()) == layout
    with pytest.raises(ValueError, match=r"rank=4 is outside a sharding group of size 4"):
        layout.shard_of(full, 4)


def test_checkpointing_refuses_zero1_state_under_another_key_instead_of_dropping_shards(tmp_path):
    from nxdtp import checkpointing

    with ps.simulated_topology(world_size=4, rank=0, tensor_model_parallel_size=2):
        model = torch.nn.Linear(3, 2)
        zero = NeuronZero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        for optimizer in (zero, zero.state_dict()):
            with pytest.raises(ValueError, match=r"checkpoint\['optimizer_state_dict'\] is a ZeRO-1 optimizer .*"
                                                 r"Pass it as checkpoint\['optimizer'\]"):
                checkpointing.save({"model": model, "optimizer_state_dict": optimizer}, str(tmp_path), tag="t")
        assert not any(tmp_path.iterdir())

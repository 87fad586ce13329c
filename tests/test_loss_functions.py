"""parallel_cross_entropy and from_parallel_logits_to_logprobs against dense torch on the full logits.

Every rank of a TP group builds the same full logits and targets from one seed, keeps its contiguous vocab shard, and
compares the per-token loss and its logits-gradient shard with ``F.cross_entropy`` on the full tensor. Each DP group
gets different data (the seed includes the DP rank), so a reduction over the wrong group would show up as wrong numbers.
"""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from nxdtp import comm
from nxdtp import parallel_state as ps
from nxdtp.loss_functions import (
    DistributedLogprob,
    from_parallel_logits_to_logprobs,
    parallel_cross_entropy,
    vocab_parallel_token_statistics,
)

TOL = dict(rtol=1e-5, atol=1e-5)


def _configs(tp):
    """(name, kwargs) pairs; ``local`` is the vocab columns per rank, ``pad`` the padded columns at the end."""
    base = dict(batch=(13,), local=8, pad=0, smoothing=0.0, reduction="none", dtype=torch.float32, ignore_frac=0.3,
                scale=3.0, offset=0.0)
    variants = [
        ("plain", {}),
        ("smoothing", dict(smoothing=0.1)),
        ("3d-mean", dict(batch=(3, 5), reduction="mean")),
        ("3d-mean-smoothing", dict(batch=(3, 5), reduction="mean", smoothing=0.1)),
        ("sum-smoothing", dict(batch=(2, 7), reduction="sum", smoothing=0.1)),
        ("large-logits", dict(scale=30.0, offset=100.0, smoothing=0.1)),  # exp overflows without the max shift
        ("no-ignored", dict(ignore_frac=0.0, smoothing=0.1)),
        ("padded-last-shard", dict(local=6, pad=tp - 1)),
        ("padded-last-shard-smoothing", dict(batch=(3, 4), local=6, pad=tp - 1, smoothing=0.1, reduction="mean")),
        ("bf16", dict(dtype=torch.bfloat16, smoothing=0.1)),
        ("bf16-mean", dict(dtype=torch.bfloat16, batch=(3, 5), reduction="mean")),
    ]
    if tp > 2:  # 3 padded columns of a 4x2 vocab span two shards: shard 2 is half padding, shard 3 all padding
        variants.append(("padding-spans-shards", dict(local=2, pad=3, smoothing=0.1)))
    return [(name, {**base, **v}) for name, v in variants]


def _make(seed, batch, local, pad, dtype, ignore_frac, scale, offset, tp):
    """Full logits (padded vocab), targets among the real ids with some ignored, and a random upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    full_vocab = local * tp
    vocab = full_vocab - pad
    logits = (torch.randn(*batch, full_vocab, generator=g) * scale + offset).to(dtype)
    target = torch.randint(0, vocab, batch, generator=g)
    ignored = torch.rand(batch, generator=g) < ignore_frac
    target = torch.where(ignored, torch.full_like(target, -100), target)
    upstream = torch.randn(batch, generator=g)
    return logits, target, upstream, vocab


def _dense(logits, target, smoothing, reduction, vocab):
    """F.cross_entropy on the real (unpadded) columns in fp32, with the padded columns' gradient as zeros."""
    full = logits.detach().float().requires_grad_(True)
    real = full[..., :vocab]
    loss = F.cross_entropy(real.reshape(-1, vocab), target.reshape(-1), label_smoothing=smoothing, reduction=reduction)
    return full, (loss.reshape(target.shape) if reduction == "none" else loss)


def _grad_tolerance(dtype):
    # The bf16 gradient is the fp32 gradient rounded to bf16, so it may differ from the rounded dense one by one bf16
    # ulp (relative 2**-8 of the value; 2**-7 leaves room for values on a rounding boundary).
    return TOL if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-6)


@contextlib.contextmanager
def _counting_all_reduces():
    """Record the op of every comm.all_reduce (the loss reaches the backend only through it)."""
    calls, original = [], comm.all_reduce

    def counting(tensor, group, op="sum"):
        calls.append(op)
        return original(tensor, group, op=op)

    comm.all_reduce = counting
    try:
        yield calls
    finally:
        comm.all_reduce = original


def case_cross_entropy_matches_dense(seed):
    tp, tp_rank = ps.get_tensor_model_parallel_size(), ps.get_tensor_model_parallel_rank()
    checked, failures = [], []
    for i, (name, c) in enumerate(_configs(tp)):
        logits, target, upstream, vocab = _make(seed * 1000 + 17 * ps.get_data_parallel_rank() + i, c["batch"],
                                                c["local"], c["pad"], c["dtype"], c["ignore_frac"], c["scale"],
                                                c["offset"], tp)
        lo, hi = tp_rank * c["local"], (tp_rank + 1) * c["local"]
        shard = logits[..., lo:hi].clone().requires_grad_(True)
        vocab_size = vocab if c["pad"] else None
        with _counting_all_reduces() as calls:
            loss = parallel_cross_entropy(shard, target, label_smoothing=c["smoothing"], reduction=c["reduction"],
                                          vocab_size=vocab_size)
            forward_calls = list(calls)
            grad_out = upstream if c["reduction"] == "none" else upstream.flatten()[0]
            loss.backward(grad_out)
        full, dense = _dense(logits, target, c["smoothing"], c["reduction"], vocab)
        dense.backward(grad_out)
        # Check after every collective of this config has run, and fail only at the end, so that one rank's mismatch
        # does not leave the other ranks waiting in a collective.
        try:
            # One MAX for stability, one stacked SUM; the backward needs no communication at all.
            assert forward_calls == ["max", "sum"] and calls == forward_calls, f"all-reduces: {calls}"
            assert loss.dtype == torch.float32, loss.dtype
            torch.testing.assert_close(loss, dense.detach(), **TOL, msg=lambda m: f"loss\n{m}")
            if c["reduction"] == "none":
                assert torch.all(loss[target == -100] == 0), "ignored targets must give exactly 0"
            assert shard.grad.dtype == c["dtype"], shard.grad.dtype
            torch.testing.assert_close(shard.grad, full.grad[..., lo:hi].to(c["dtype"]), **_grad_tolerance(c["dtype"]),
                                       msg=lambda m: f"logits grad\n{m}")
            padded = torch.arange(lo, hi) >= vocab
            assert torch.all(shard.grad[..., padded] == 0), "padded columns must get no gradient"
            assert padded.all() or shard.grad.abs().sum() > 0, "zero gradient"
            checked.append(name)
        except AssertionError as e:
            failures.append(f"{name} (tp={tp}, tp_rank={tp_rank}): {e}")

    # Every target ignored: the mean is 0/0 = NaN as in torch, and no gradient flows.
    logits, target, upstream, _ = _make(seed, (6,), 4, 0, torch.float32, 1.0, 1.0, 0.0, tp)
    shard = logits[..., tp_rank * 4:(tp_rank + 1) * 4].clone().requires_grad_(True)
    loss = parallel_cross_entropy(shard, target, reduction="mean")
    parallel_cross_entropy(shard, target).backward(upstream)
    if not (math.isnan(loss.item()) and math.isnan(F.cross_entropy(logits, target).item())):
        failures.append(f"all-ignored: mean is {loss.item()}, torch gives NaN")
    if not torch.all(shard.grad == 0):
        failures.append("all-ignored: nonzero gradient")
    checked.append("all-ignored")
    assert not failures, "\n".join(failures)
    return checked


def case_logprobs_match_dense(seed):
    tp, tp_rank = ps.get_tensor_model_parallel_size(), ps.get_tensor_model_parallel_rank()
    checked = []
    for i, (batch, local, pad) in enumerate([((2, 9), 5, 0), ((11,), 6, tp - 1)]):
        logits, target, upstream, vocab = _make(seed + 31 * ps.get_data_parallel_rank() + i, batch, local, pad,
                                                torch.float32, 0.0, 4.0, 0.0, tp)
        shard = logits[..., tp_rank * local:(tp_rank + 1) * local].clone().requires_grad_(True)
        logprobs = from_parallel_logits_to_logprobs(shard, target, inference=False, vocab_size=vocab if pad else None)
        # NxD's contract: position s is scored against target s + 1, and the last position is dropped.
        full = logits.clone().requires_grad_(True)
        next_tokens = target.roll(-1, dims=-1)
        dense = full[..., :vocab].log_softmax(-1).gather(-1, next_tokens.unsqueeze(-1)).squeeze(-1)[..., :-1]
        logprobs.backward(upstream[..., :-1])
        dense.backward(upstream[..., :-1])
        inference = from_parallel_logits_to_logprobs(shard, target, vocab_size=vocab if pad else None)
        if inference.requires_grad or not torch.equal(inference, logprobs.detach()):
            checked.append(f"{(batch, local, pad)}: inference=True must give the same values without a graph")
        try:  # fail after the loop, so every rank runs every collective (see case_cross_entropy_matches_dense)
            torch.testing.assert_close(logprobs, dense.detach(), **TOL)
            torch.testing.assert_close(shard.grad, full.grad[..., tp_rank * local:(tp_rank + 1) * local], **TOL)
            checked.append((batch, local, pad))
        except AssertionError as e:
            checked.append(f"{(batch, local, pad)}: {e}")
    assert all(isinstance(c, tuple) for c in checked), checked
    return checked


def _dense_logprob(logits, target, vocab):
    """log_softmax over the real columns, gathered at the target; 0 (and no gradient) where the target is no real id."""
    full = logits.detach().float().requires_grad_(True)
    valid = (target >= 0) & (target < vocab)
    log_probs = full[..., :vocab].log_softmax(-1)
    picked = log_probs.gather(-1, torch.where(valid, target, 0).unsqueeze(-1)).squeeze(-1)
    return full, torch.where(valid, picked, torch.zeros_like(picked))


def case_distributed_logprob_matches_dense(seed):
    """DistributedLogprob.apply(logits, target, inference): same-position targets (no shift), NxD's 0 for a target no
    rank holds, forward and backward against log_softmax + gather on the full logits."""
    tp, tp_rank = ps.get_tensor_model_parallel_size(), ps.get_tensor_model_parallel_rank()
    g = torch.Generator().manual_seed(seed * 7919 + 101 * ps.get_data_parallel_rank())
    failures, checked = [], []
    configs = [("2d", (3, 7), 5, 0, torch.float32), ("1d", (9,), 4, 0, torch.float32),
               ("3d-padded", (2, 3, 4), 6, tp - 1, torch.float32), ("bf16", (4, 6), 8, 0, torch.bfloat16)]
    for name, batch, local, pad, dtype in configs:
        full_vocab = local * tp
        vocab = full_vocab - pad
        scale = float(torch.empty(()).uniform_(1.0, 8.0, generator=g))
        logits = (torch.randn(*batch, full_vocab, generator=g) * scale
                  + torch.randn((), generator=g) * 10).to(dtype)
        target = torch.randint(0, vocab, batch, generator=g)
        # Some targets no rank holds: negative (an ignore id), past the padded vocab, and (padded) a padding column.
        odd = torch.rand(batch, generator=g) < 0.25
        outside = torch.tensor([-100, -1, full_vocab, full_vocab + 3, full_vocab - 1 if pad else -7])
        target = torch.where(odd, outside[torch.randint(0, len(outside), batch, generator=g)], target)
        upstream = torch.randn(batch, generator=g)
        shard = logits[..., tp_rank * local:(tp_rank + 1) * local].clone().requires_grad_(True)
        with _counting_all_reduces() as calls:
            logprob = DistributedLogprob.apply(shard, target, False, vocab if pad else None)
            logprob.backward(upstream)
            inference = DistributedLogprob.apply(shard, target, True, vocab if pad else None)
        full, dense = _dense_logprob(logits, target, vocab)
        dense.backward(upstream)
        try:
            assert calls == ["max", "sum", "max", "sum"], f"all-reduces: {calls}"
            assert logprob.shape == target.shape and logprob.dtype == torch.float32, (logprob.shape, logprob.dtype)
            torch.testing.assert_close(logprob, dense.detach(), **TOL, msg=lambda m: f"logprob\n{m}")
            assert torch.all(logprob[odd & ((target < 0) | (target >= vocab))] == 0), "unheld targets must give 0"
            torch.testing.assert_close(shard.grad, full.grad[..., tp_rank * local:(tp_rank + 1) * local].to(dtype),
                                       **_grad_tolerance(dtype), msg=lambda m: f"logits grad\n{m}")
            assert shard.grad.abs().sum() > 0 or pad, "zero gradient"
            assert not inference.requires_grad and torch.equal(inference, logprob.detach()), "inference=True"
            checked.append(name)
        except AssertionError as e:
            failures.append(f"{name} (tp={tp}, tp_rank={tp_rank}): {e}")
    assert not failures, "\n".join(failures)
    return checked


def _dense_statistics(logits, target, vocab):
    """What vocab_parallel_token_statistics computes, from the full logits' real columns."""
    full = logits.detach().float().requires_grad_(True)
    real = full[..., :vocab]
    log_p = real.log_softmax(-1)
    target_logit = real.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return full, {"log_probs": log_p.gather(-1, target.unsqueeze(-1)).squeeze(-1),
                  "entropy": -(log_p.exp() * log_p).sum(-1),
                  "log_sum_sq_probs": (2 * log_p).exp().sum(-1).log(),
                  "mean_logits": real.mean(-1),
                  "is_top1": real.argmax(-1) == target, "target_logit": target_logit}


def case_token_statistics_match_dense(seed):
    """Every statistic against the full logits, and the gradients of log p(target) and the entropy (two upstream
    gradients at once), with padded columns and ties at the largest logit (the first one is argmax's)."""
    tp, tp_rank = ps.get_tensor_model_parallel_size(), ps.get_tensor_model_parallel_rank()
    g = torch.Generator().manual_seed(seed * 31 + 7 * ps.get_data_parallel_rank())
    checked, tie_outcomes = [], set()
    for name, batch, local, pad in (("2d", (3, 5), 6, 0), ("padded", (2, 4, 3), 5, tp - 1)):
        vocab = local * tp - pad
        logits = torch.randn(*batch, local * tp, generator=g) * 4 + torch.randn((), generator=g) * 10
        target = torch.randint(0, vocab, batch, generator=g)
        # Some targets tie at the maximum with another column, before or after them: argmax picks the first.
        ties = torch.rand(batch, generator=g) < 0.4
        other = (target + torch.randint(1, vocab, batch, generator=g)) % vocab
        columns = torch.arange(local * tp)
        top = logits.amax(-1, keepdim=True) + 1
        at_top = ties.unsqueeze(-1) & ((columns == target.unsqueeze(-1)) | (columns == other.unsqueeze(-1)))
        logits = torch.where(at_top, top, logits)
        tie_outcomes.update((target < other)[ties].tolist())
        up_log_p, up_entropy = torch.randn(batch, generator=g), torch.randn(batch, generator=g)
        shard = logits[..., tp_rank * local:(tp_rank + 1) * local].clone().requires_grad_(True)
        got = vocab_parallel_token_statistics(shard, target, vocab if pad else None)
        (got["log_probs"] * up_log_p + got["entropy"] * up_entropy).sum().backward()
        full, dense = _dense_statistics(logits, target, vocab)
        (dense["log_probs"] * up_log_p + dense["entropy"] * up_entropy).sum().backward()
        for key in ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits"):
            torch.testing.assert_close(got[key], dense[key].detach(), **TOL, msg=lambda m: f"{name} {key}: {m}")
        assert torch.equal(got["is_top1"], dense["is_top1"]), (name, got["is_top1"], dense["is_top1"])
        torch.testing.assert_close(shard.grad, full.grad[..., tp_rank * local:(tp_rank + 1) * local], **TOL,
                                   msg=lambda m: f"{name} logits grad: {m}")
        checked.append(name)
    assert tie_outcomes == {True, False}, "ties must put the target both first and second"
    return checked


@pytest.mark.parametrize("world,tp", [(2, 2), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_token_statistics_match_dense(worlds, world, tp):
    results = worlds(world).run(case_token_statistics_match_dense, tensor_model_parallel_size=tp, seed=world)
    assert all(r == ["2d", "padded"] for r in results), results


@pytest.mark.parametrize("world,tp", [(2, 2), (4, 2), (4, 4)])
def test_distributed_logprob_matches_dense(worlds, world, tp):
    results = worlds(world).run(case_distributed_logprob_matches_dense, tensor_model_parallel_size=tp, seed=5 + world)
    assert all(r == ["2d", "1d", "3d-padded", "bf16"] for r in results), results


def test_distributed_logprob_single_rank_and_arguments():
    torch.manual_seed(11)
    logits = torch.randn(3, 5, 10, requires_grad=True)
    target = torch.randint(0, 10, (3, 5))
    with ps.simulated_topology(world_size=1, rank=0, tensor_model_parallel_size=1):
        logprob = DistributedLogprob.apply(logits, target, False)
        with pytest.raises(TypeError, match="inference='no' must be True"):
            DistributedLogprob.apply(logits, target, "no")
        with pytest.raises(ValueError, match=r"needs a target of shape \(3, 5\)"):
            DistributedLogprob.apply(logits, target[0], True)
    full, dense = _dense_logprob(logits, target, 10)
    torch.testing.assert_close(logprob, dense, **TOL)
    upstream = torch.randn(3, 5)
    logprob.backward(upstream)
    dense.backward(upstream)
    torch.testing.assert_close(logits.grad, full.grad, **TOL)


@pytest.mark.parametrize("world,tp", [(2, 2), (4, 2), (4, 4)])
def test_parallel_cross_entropy_matches_dense(worlds, world, tp):
    results = worlds(world).run(case_cross_entropy_matches_dense, tensor_model_parallel_size=tp, seed=7 + tp)
    assert all(len(r) == len(_configs(tp)) + 1 for r in results)


@pytest.mark.parametrize("world,tp", [(4, 2), (4, 4)])
def test_logprobs_match_dense(worlds, world, tp):
    results = worlds(world).run(case_logprobs_match_dense, tensor_model_parallel_size=tp, seed=3)
    assert all(len(r) == 2 for r in results)


def test_single_rank_equals_dense():
    """tp=1 needs no communication; it still has to be the same function as torch's."""
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 10, requires_grad=True)
    target = torch.randint(0, 10, (4, 6))
    target[0, :3] = -100
    with ps.simulated_topology(world_size=1, rank=0, tensor_model_parallel_size=1):
        loss = parallel_cross_entropy(logits, target, label_smoothing=0.2, reduction="mean")
    dense_logits = logits.detach().clone().requires_grad_(True)
    dense = F.cross_entropy(dense_logits.reshape(-1, 10), target.reshape(-1), label_smoothing=0.2)
    torch.testing.assert_close(loss, dense, **TOL)
    loss.backward()
    dense.backward()
    torch.testing.assert_close(logits.grad, dense_logits.grad, **TOL)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(reduction="avg"), ValueError, "reduction='avg' is not supported; valid values are ['none', 'mean', 'sum']"),
    (dict(label_smoothing=1.0), ValueError, "label_smoothing=1.0 must be a number in [0, 1)"),
    (dict(label_smoothing=-0.1), ValueError, "label_smoothing=-0.1 must be a number in [0, 1)"),
    (dict(target=torch.zeros(3, 5)), TypeError, "target must be an integer tensor of vocabulary ids"),
    (dict(target=torch.zeros(3, dtype=torch.long)), ValueError,
     "vocab_parallel_logits of shape (3, 5, 8) needs a target of shape (3, 5) (its shape without the vocab dim), "
     "got (3,)"),
    (dict(logits=torch.zeros(3, 5, 8, dtype=torch.long)), TypeError,
     "vocab_parallel_logits must be a floating-point tensor, got torch.int64"),
    (dict(vocab_size=17), ValueError, "vocab_size=17 must be an int in [1, 16]"),
    (dict(vocab_size=0), ValueError, "vocab_size=0 must be an int in [1, 16]"),
])
def test_invalid_arguments_name_the_value(kwargs, error, message):
    _check_refused(parallel_cross_entropy, kwargs, error, message)


def _check_refused(function, kwargs, error, message):
    """``function`` on a tp=2 rank's (3, 5, 8) logits shard and (3, 5) targets, ``kwargs`` replacing any of them."""
    logits = kwargs.pop("logits", torch.zeros(3, 5, 8))
    target = kwargs.pop("target", torch.zeros(3, 5, dtype=torch.long))
    with ps.simulated_topology(world_size=2, rank=1, tensor_model_parallel_size=2):
        with pytest.raises(error) as info:
            function(logits, target, **kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(target=torch.zeros(3, 5)), TypeError, "target must be an integer tensor of vocabulary ids"),
    (dict(target=torch.zeros(3, dtype=torch.long)), ValueError, "needs a target of shape (3, 5)"),
    (dict(logits=torch.zeros(3, 5, 8, dtype=torch.long)), TypeError, "must be a floating-point tensor, got torch.int"),
    (dict(vocab_size=17), ValueError, "vocab_size=17 must be an int in [1, 16]"),
])
def test_token_statistics_name_bad_arguments(kwargs, error, message):
    _check_refused(vocab_parallel_token_statistics, kwargs, error, message)


def test_signatures_are_nxds():
    from tests.test_utils import REQUIRED, check_nxd_signature

    check_nxd_signature(parallel_cross_entropy, [("vocab_parallel_logits", REQUIRED), ("target", REQUIRED),
                                                 ("label_smoothing", 0.0)])
    check_nxd_signature(from_parallel_logits_to_logprobs, [("vocab_parallel_logits", REQUIRED), ("target", REQUIRED),
                                                           ("inference", True)])
    # DistributedLogprob.apply takes forward's parameters after ctx, by position.
    check_nxd_signature(DistributedLogprob.forward, [("ctx", REQUIRED), ("vocab_parallel_logits", REQUIRED),
                                                     ("target", REQUIRED), ("inference", True)])

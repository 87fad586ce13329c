"""RNG tracker and tracker-aware checkpointing.

Dropout masks are compared as whole tensors of 256 Bernoulli(0.5) draws, so two independent masks coincide with
probability 2**-256: "differs" is as strict a check as "equals".
"""

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

from nxdtp import parallel_state as ps
from nxdtp.random import (
    XLARNGStatesTracker,
    checkpoint,
    get_rng_state,
    get_xla_rng_tracker,
    model_parallel_xla_manual_seed,
    set_rng_state,
)

N = 256


def _mask(device="cpu"):
    return F.dropout(torch.ones(N, device=device), p=0.5).ne(0).cpu()


@pytest.fixture
def rank1_of_tp2():
    """A simulated topology is enough for the tracker, which is per process: this process plays TP rank 1."""
    with ps.simulated_topology(world_size=2, rank=1, tensor_model_parallel_size=2):
        saved = get_rng_state()
        yield
        set_rng_state(saved)
        get_xla_rng_tracker().reset()


def case_dropout_masks():
    model_parallel_xla_manual_seed(1234)
    tracker = get_xla_rng_tracker()
    outside_1 = _mask()
    with tracker.fork():
        inside_1 = _mask()
    outside_2 = _mask()
    with tracker.fork():
        inside_2 = _mask()
    # The fork left the default stream where it was: it continues as if the fork had not happened.
    torch.manual_seed(1234)
    plain = [_mask(), _mask()]
    return dict(outside=[outside_1, outside_2], inside=[inside_1, inside_2], plain=plain)


def test_replicated_masks_agree_and_sharded_masks_differ(worlds):
    """World 4, tp 2: ranks 0,1 form a TP group, ranks 2,3 the other; ranks 0,2 have tp_rank 0."""
    out = worlds(4).run(case_dropout_masks, tensor_model_parallel_size=2)
    for r in range(4):
        assert torch.equal(out[r]["outside"][0], out[0]["outside"][0])
        assert torch.equal(out[r]["outside"][1], out[0]["outside"][1])
        assert all(torch.equal(a, b) for a, b in zip(out[r]["outside"], out[r]["plain"]))
        assert not torch.equal(out[r]["inside"][0], out[r]["inside"][1]), "the forked state did not advance"
        assert not torch.equal(out[r]["inside"][0], out[r]["outside"][0])
    assert not torch.equal(out[0]["outside"][0], out[0]["outside"][1])
    for first, second in ((0, 1), (2, 3)):  # TP ranks of one TP group draw different sharded masks
        for k in range(2):
            assert not torch.equal(out[first]["inside"][k], out[second]["inside"][k])
    for a, b in ((0, 2), (1, 3)):  # the same tp_rank in different DP groups holds the same shard: same mask
        for k in range(2):
            assert torch.equal(out[a]["inside"][k], out[b]["inside"][k])


def test_get_and_set_states_replay_draws(rank1_of_tp2):
    model_parallel_xla_manual_seed(99)
    tracker = get_xla_rng_tracker()
    snapshot = tracker.get_states()
    with tracker.fork():
        first = _mask()
    with tracker.fork():
        second = _mask()
    assert not torch.equal(first, second)
    live = tracker.get_states()["model-parallel-rng"]["cpu"]
    assert not torch.equal(snapshot["model-parallel-rng"]["cpu"], live), "get_states() must be a snapshot, not a view"
    tracker.set_states(snapshot)
    with tracker.fork():
        assert torch.equal(_mask(), first)
    with tracker.fork():
        assert torch.equal(_mask(), second)


def test_seed_formula_and_reset(rank1_of_tp2):
    model_parallel_xla_manual_seed(5)
    with get_xla_rng_tracker().fork():
        sharded = _mask()
    torch.manual_seed(5 + 2718 + 1)  # tp_rank 1
    assert torch.equal(sharded, _mask())
    model_parallel_xla_manual_seed(5)  # resets the tracker: no duplicate-name error, the same stream again
    with get_xla_rng_tracker().fork():
        assert torch.equal(_mask(), sharded)


def test_tracker_errors_name_the_problem():
    tracker = XLARNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="RNG state 'a' is already registered"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="seed 1 is already used by RNG state 'a'"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match=r"RNG state 'nope' is not registered; registered names are \['a'\]"):
        with tracker.fork("nope"):
            pass
    tracker.reset()
    tracker.add("a", 1)  # reset forgets names and seeds


class _Block(torch.nn.Module):
    """Replicated dropout, then "sharded" dropout inside the tracker's fork, as a TP layer would do."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(16, 32)
        self.second = torch.nn.Linear(32, 16)
        for p in self.parameters():
            torch.nn.init.normal_(p)

    def forward(self, x, p, scale=None, return_tuple=False):
        h = F.dropout(self.first(x), p=p)
        with get_xla_rng_tracker().fork():
            h = F.dropout(torch.tanh(h), p=p)
        out = self.second(h) * scale
        return (out, h.sum(-1)) if return_tuple else out


def _grads(block, x, scale, run, check_states=True, x_and_scale=True):
    """Loss gradients wrt x, scale and every parameter, with other random work between forward and backward."""
    leaves = [x, scale, *block.parameters()] if x_and_scale else list(block.parameters())
    for t in leaves:
        t.grad = None
    out, aux = run()
    F.dropout(torch.ones(N), 0.5)  # later layers draw from both streams before this backward runs
    with get_xla_rng_tracker().fork():
        F.dropout(torch.ones(N), 0.5)
    g = torch.Generator().manual_seed(3)
    loss = (out * torch.randn(out.shape, generator=g)).sum() + (aux * torch.randn(aux.shape, generator=g)).sum()
    after_forward = (get_rng_state(), get_xla_rng_tracker().get_states())
    loss.backward()
    after_backward = (get_rng_state(), get_xla_rng_tracker().get_states())
    # Recomputing must not leave its replayed states behind: the streams continue from where the forward left them.
    if check_states:
        assert torch.equal(after_forward[0]["cpu"], after_backward[0]["cpu"])
        assert torch.equal(after_forward[1]["model-parallel-rng"]["cpu"],
                           after_backward[1]["model-parallel-rng"]["cpu"])
    return out.detach(), [t.grad.clone() for t in leaves]


def test_checkpoint_grads_equal_plain_grads(rank1_of_tp2):
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(8, 16, requires_grad=True)
    scale = torch.randn(16, requires_grad=True)

    def run_with(runner, check_states=True, x_and_scale=True):
        model_parallel_xla_manual_seed(42)
        return _grads(block, x, scale, runner, check_states, x_and_scale)

    plain_out, plain = run_with(lambda: block(x, 0.5, scale=scale, return_tuple=True))
    ckpt_out, ckpt = run_with(lambda: checkpoint(block, x, 0.5, scale=scale, return_tuple=True))
    torch.testing.assert_close(ckpt_out, plain_out, rtol=0, atol=0)
    for a, b in zip(ckpt, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert all(g.abs().sum() > 0 for g in plain)

    # Inputs that need no gradient (the first layer's input): the parameters still get theirs.
    frozen = x.detach()
    _, plain_frozen = run_with(lambda: block(frozen, 0.5, scale=scale.detach(), return_tuple=True), x_and_scale=False)
    _, ckpt_frozen = run_with(lambda: checkpoint(block, frozen, 0.5, scale=scale.detach(), return_tuple=True),
                              x_and_scale=False)
    for a, b in zip(ckpt_frozen, plain_frozen):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    # A single tensor output works too (and a positional non-tensor argument passes through).
    model_parallel_xla_manual_seed(42)
    single = checkpoint(block, x, 0.5, scale=scale)
    model_parallel_xla_manual_seed(42)
    torch.testing.assert_close(single, block(x, 0.5, scale=scale), rtol=0, atol=0)

    # Restoring the states matters: torch's checkpoint replays the default generator but not the tracker, and a
    # recompute that replays nothing draws new masks in both places. Both give the wrong gradients here.
    for name, runner in [
        ("torch checkpoint (no tracker)", lambda: torch_checkpoint.checkpoint(
            block, x, 0.5, scale, True, use_reentrant=False, preserve_rng_state=True)),
        ("no state restore", lambda: torch_checkpoint.checkpoint(
            block, x, 0.5, scale, True, use_reentrant=False, preserve_rng_state=False)),
    ]:
        _, wrong = run_with(runner, check_states=False)
        assert not torch.allclose(wrong[0], plain[0], rtol=1e-5, atol=1e-5), name


def case_checkpoint_on_xla():
    """tp=1 on XLA:CPU: the tracker swaps XLA's seed and checkpoint replays it (through the optimization barrier)."""
    import torch_xla

    device = torch_xla.device()
    model_parallel_xla_manual_seed(7)
    tracker = get_xla_rng_tracker()
    with tracker.fork():
        inside = _mask(device)
    outside = _mask(device)
    import torch_xla.core.xla_model as xm

    xm.set_rng_state(7 + 2718)
    assert torch.equal(inside, _mask(device)), "fork did not use the tracker's XLA seed"
    xm.set_rng_state(7)
    assert torch.equal(outside, _mask(device)), "fork disturbed the default XLA seed"

    torch.manual_seed(0)
    block = _Block().to(device)
    x = torch.randn(8, 16).to(device).requires_grad_(True)
    scale = torch.randn(16).to(device).requires_grad_(True)
    grads = []
    for use_checkpoint in (False, True):
        model_parallel_xla_manual_seed(42)
        for t in [x, scale, *block.parameters()]:
            t.grad = None
        out = (checkpoint if use_checkpoint else (lambda f, *a, **k: f(*a, **k)))(block, x, 0.5, scale=scale)
        F.dropout(torch.ones(N, device=device), 0.5)
        with tracker.fork():
            F.dropout(torch.ones(N, device=device), 0.5)
        out.sum().backward()
        params = [x, scale, *block.parameters()]
        # The barrier is what keeps XLA from merging the recompute into the forward (same numbers, lost memory savings).
        has_barrier = "opt-barrier" in torch_xla._XLAC._get_xla_tensors_hlo([t.grad for t in params])
        assert has_barrier == use_checkpoint, f"optimization barrier present={has_barrier}, checkpoint={use_checkpoint}"
        torch_xla.sync()
        grads.append([t.grad.cpu() for t in params])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    return len(grads[0])


def test_tracker_and_checkpoint_on_xla(worlds):
    pytest.importorskip("torch_xla")
    assert worlds(1, "xla-exec").run(case_checkpoint_on_xla, tensor_model_parallel_size=1) == [6]

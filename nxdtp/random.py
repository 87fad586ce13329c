"""Dropout randomness under tensor parallelism, and activation checkpointing that replays it.

Two kinds of region need different masks. Replicated activations (after a row-parallel all-reduce, LayerNorm inputs)
must draw the *same* dropout mask on every TP rank, or the replicas drift apart. TP-sharded activations (attention
probabilities of this rank's heads, column-parallel outputs) must draw *different* masks per TP rank, or the shards of
one dense tensor would reuse one mask. So the default generators get one seed on all ranks, and a named RNG state in a
tracker gets a per-TP-rank seed; ``with get_xla_rng_tracker().fork():`` swaps it in around sharded dropout.

The generators swapped are the ones dropout draws from: always the CPU one, CUDA's once CUDA is in use, and XLA's once
torch_xla is loaded (this module never imports it; a program using XLA tensors already has).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Dict, Iterator, List, Tuple

import torch

from .topology import tensor_parallel_group

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Added to the seed for the per-TP-rank state, so it never equals the replicated seed of any rank.
_TP_SEED_OFFSET = 2718

RngState = Dict[str, Any]  # backend name -> that backend's state (a ByteTensor, or XLA's int seed)


# ---- the one place that knows the backends ---------------------------------------------------------------------------

def _xla_model():
    # Only called once torch_xla is loaded (an "xla" backend is active, or a tensor lives on XLA).
    import torch_xla.core.xla_model as xm

    return xm


def _active_backends() -> tuple:
    backends = ["cpu"]
    if torch.cuda.is_initialized():
        backends.append("cuda")
    if "torch_xla" in sys.modules:  # loaded by the program: XLA dropout may run; never load it ourselves
        backends.append("xla")
    return tuple(backends)


def _get_state(backend: str):
    if backend == "cpu":
        return torch.get_rng_state()
    if backend == "cuda":
        return torch.cuda.get_rng_state()
    return _xla_model().get_rng_state()


def _set_state(backend: str, state) -> None:
    if backend == "cpu":
        torch.set_rng_state(state)
    elif backend == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        _xla_model().set_rng_state(state)


def _seed(backend: str, seed: int) -> None:
    if backend == "cpu":
        torch.default_generator.manual_seed(seed)
    elif backend == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        _xla_model().set_rng_state(seed)


def get_rng_state() -> RngState:
    """The states of every generator dropout may draw from now."""
    return {backend: _get_state(backend) for backend in _active_backends()}


def set_rng_state(state: RngState) -> None:
    for backend, value in state.items():
        _set_state(backend, value)


def _seeded_state(seed: int, backends) -> RngState:
    """The states ``backends`` would have right after seeding with ``seed``, leaving the live generators untouched."""
    saved = {backend: _get_state(backend) for backend in backends}
    try:
        for backend in backends:
            _seed(backend, seed)
        return {backend: _get_state(backend) for backend in backends}
    finally:
        set_rng_state(saved)


# ---- the tracker -----------------------------------------------------------------------------------------------------

class XLARNGStatesTracker:
    """Named RNG states, each seeded once and advanced only inside ``fork(name)``.

    Seeds must be distinct across names: two names with one seed would draw identical masks, which is exactly the
    correlation the tracker exists to avoid.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._states: Dict[str, RngState] = {}
        self._seeds: Dict[str, int] = {}
        # The forks now open, innermost last: (name, the generators' state outside it). Not part of get_states(): it
        # only exists while a forward runs inside fork(), and a recompute rebuilds it by running the same code.
        self._open: List[Tuple[str, RngState]] = []

    def get_states(self) -> Dict[str, RngState]:
        """A snapshot (copied, so later forks do not change it) to save in a checkpoint or replay a recompute."""
        return {name: dict(state) for name, state in self._states.items()}

    def set_states(self, states: Dict[str, RngState]) -> None:
        self._states = {name: dict(state) for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG state {name!r} is already registered (seed {self._seeds.get(name)}); names must be "
                             "unique (call reset() first to re-seed)")
        owner = next((n for n, s in self._seeds.items() if s == seed), None)
        if owner is not None:
            raise ValueError(f"seed {seed} is already used by RNG state {owner!r}; each name needs its own seed")
        self._seeds[name] = seed
        self._states[name] = _seeded_state(seed, _active_backends())

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from the named state inside the block; keep its advanced state for the next fork.

        Inside a fork of the same name (a sharded layer's dropout inside attention that already forked) the block goes
        on drawing from the open fork: swapping the named state in again would replay the draws the open fork made
        since it began, and the two dropouts would share their masks."""
        if self._open and self._open[-1][0] == name:
            yield
            return
        if name not in self._states:
            raise ValueError(f"RNG state {name!r} is not registered; registered names are {sorted(self._states)}. "
                             "Call model_parallel_xla_manual_seed(seed) or get_xla_rng_tracker().add(name, seed) first")
        state = self._states[name]
        missing = [b for b in _active_backends() if b not in state]
        if missing:
            # A backend came into use after add() (CUDA initialised late): seed it the way add() would have.
            if name not in self._seeds:
                raise RuntimeError(f"RNG state {name!r} has no state for {missing} and no seed to make one; re-add it")
            state = {**state, **_seeded_state(self._seeds[name], missing)}
        self._open.append((name, get_rng_state()))
        set_rng_state(state)
        try:
            yield
        finally:
            self._states[name] = {backend: _get_state(backend) for backend in state}
            # The state outside, as replicated() may have advanced it meanwhile.
            set_rng_state(self._open.pop()[1])

    @contextlib.contextmanager
    def replicated(self) -> Iterator[None]:
        """Draw from the default generators (seeded alike on every TP rank) inside the block, even inside ``fork()``:
        for dropout on a replicated activation that a sharded region's code applies (a LoRA adapter's dropout on the
        input of a column-parallel layer inside attention that forked). The draws advance the state outside the fork,
        as if they had been made there."""
        if not self._open:
            yield
            return
        name, outside = self._open[-1]
        inside = get_rng_state()
        set_rng_state(outside)
        try:
            yield
        finally:
            self._open[-1] = (name, get_rng_state())
            set_rng_state(inside)


_TRACKER = XLARNGStatesTracker()


def get_xla_rng_tracker() -> XLARNGStatesTracker:
    """The process-wide tracker that parallel layers and ``checkpoint`` use."""
    return _TRACKER


def model_parallel_xla_manual_seed(seed: int) -> None:
    """Seed replicated regions with ``seed`` (same on all ranks) and TP-sharded ones with ``seed + 2718 + tp_rank``.

    Call it on every rank with the same ``seed``, after ``initialize_model_parallel``.
    """
    tp_rank = tensor_parallel_group().rank
    torch.manual_seed(seed)
    if "torch_xla" in sys.modules:
        _seed("xla", seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + tp_rank)


# ---- activation checkpointing ----------------------------------------------------------------------------------------

class _CheckpointFunction(torch.autograd.Function):
    """Forward without keeping activations; backward recomputes them under the forward's RNG states.

    Restoring both the default generators and the tracker's states makes the recompute draw the very masks the forward
    drew, inside and outside ``fork()``; without that the gradient would belong to different masks than the loss.
    """

    @staticmethod
    def forward(ctx, function, keyword_names, _always_requires_grad, *args):
        ctx.function, ctx.keyword_names = function, keyword_names
        ctx.rng_state, ctx.tracker_states = get_rng_state(), _TRACKER.get_states()
        ctx.autocast_states = _autocast_states(args)
        tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.tensor_positions = tensor_positions
        ctx.other_args = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in tensor_positions))
        outputs = _call(function, keyword_names, args)
        ctx.returned_tuple = isinstance(outputs, tuple)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        args = list(ctx.other_args)
        saved = ctx.saved_tensors
        for i, tensor in zip(ctx.tensor_positions, saved):
            args[i] = tensor.detach().requires_grad_(tensor.requires_grad)
        _fence_on_xla(args)
        with _rng_states_as(ctx.rng_state, ctx.tracker_states), torch.enable_grad(), \
                _autocast_as(ctx.autocast_states):
            outputs = _call(ctx.function, ctx.keyword_names, args)

        outputs = outputs if ctx.returned_tuple else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(a.grad if isinstance(a, torch.Tensor) else None for a in args)
        return (None, None, None) + input_grads


def xla_tensors(values) -> list:
    """The tensors among ``values`` that live on an XLA device (where checkpointing must fence its recompute)."""
    return [v for v in values if isinstance(v, torch.Tensor) and v.device.type == "xla"]


def _fence_on_xla(values) -> None:
    """Put an optimization barrier on the XLA tensors among ``values`` (a recompute's inputs): without it XLA sees the
    recompute as a copy of the forward, merges the two, and keeps the activations alive after all."""
    on_xla = xla_tensors(values)
    if on_xla:
        _xla_model().optimization_barrier_(on_xla)


@contextlib.contextmanager
def _rng_states_as(rng_state: RngState, tracker_states: Dict[str, RngState]) -> Iterator[None]:
    """Run the block under the given default-generator and tracker states, then put back the states of now."""
    now, tracker_now = get_rng_state(), _TRACKER.get_states()
    set_rng_state(rng_state)
    _TRACKER.set_states(tracker_states)
    try:
        yield
    finally:
        set_rng_state(now)
        _TRACKER.set_states(tracker_now)


class ReplayedOnRecompute:
    """``function``, whose first call runs as it is and whose later calls (the recomputes of an activation checkpoint)
    run under the default generators' and the RNG tracker's states of the moment this object was made.

    For checkpoint implementations other than ``checkpoint`` below (``torch.utils.checkpoint``, which Hugging Face's
    ``gradient_checkpointing_enable`` installs): they restore the default generators before recomputing but know
    nothing of the tracker, so dropout inside ``fork()`` would draw new masks and the gradient would belong to other
    masks than the loss. Make one per checkpointed call, just before handing it to the checkpoint function.
    """

    def __init__(self, function):
        self.function = function
        self.rng_state, self.tracker_states = get_rng_state(), _TRACKER.get_states()
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 1:
            return self.function(*args, **kwargs)
        with _rng_states_as(self.rng_state, self.tracker_states):
            return self.function(*args, **kwargs)


def _autocast_states(args) -> list:
    """Autocast as it is now for the devices of ``args`` (and the CPU): (device type, enabled, dtype) each."""
    device_types = {"cpu"} | {a.device.type for a in args if isinstance(a, torch.Tensor)}
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in sorted(device_types)]


@contextlib.contextmanager
def _autocast_as(states):
    """Recompute in the forward's autocast state, whatever autocast says at backward time. The cache stays off: the
    forward ran without grad, so casts cached then have no path to the weights, which would get no gradient."""
    with contextlib.ExitStack() as stack:
        for device_type, enabled, dtype in states:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=False))
        yield


def _call(function, keyword_names, args):
    split = len(args) - len(keyword_names)
    return function(*args[:split], **dict(zip(keyword_names, args[split:])))


def checkpoint(function, *args, **kwargs):
    """``function(*args, **kwargs)`` without storing its activations; backward recomputes them with the same dropout.

    Unlike ``torch.utils.checkpoint``, the recompute also replays the tracker's named states, so dropout inside
    ``get_xla_rng_tracker().fork()`` matches the forward, and runs in the forward's autocast state. Tensor arguments
    (positional or keyword) receive gradients;
    other arguments are passed through. ``function`` returns a tensor or a tuple of tensors.
    """
    if torch.is_grad_enabled():
        _refuse_nested_tensors_requiring_grad(args, kwargs)
    keyword_names = tuple(kwargs)
    # Parameters used inside `function` are not inputs of the autograd Function; if no input required grad either,
    # the output would not require grad and the parameters would silently get none. This input makes it always do.
    anchor = torch.empty(0, requires_grad=torch.is_grad_enabled())
    return _CheckpointFunction.apply(function, keyword_names, anchor, *args, *kwargs.values())


def _refuse_nested_tensors_requiring_grad(args, kwargs) -> None:
    """Only tensors passed directly are inputs of the checkpoint; one inside a tuple, list or dict is passed through as
    an object, and a gradient it should receive would be lost without a word. Refuse that instead."""
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + [(f"argument {k!r}", a) for k, a in kwargs.items()]
    for where, value in named:
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
        if any(isinstance(item, torch.Tensor) and item.requires_grad for item in items):
            raise TypeError(f"checkpoint: {where} is a {type(value).__name__} holding a tensor that requires grad; "
                            "checkpoint passes containers through without their gradients, so pass each such tensor "
                            "as an argument of its own")


__all__ = [
    "XLARNGStatesTracker", "get_xla_rng_tracker", "model_parallel_xla_manual_seed", "checkpoint",
    "get_rng_state", "set_rng_state", "MODEL_PARALLEL_RNG", "ReplayedOnRecompute",
]

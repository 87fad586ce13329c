"""Checks that what must be equal on every rank of a tensor-parallel group is: the inputs of every forward of a
parallelized model, and the replicated parameters a checkpoint stores once.

The ranks of a TP group compute one model together. Given different batches, or replicated parameters that drifted
apart, they still produce a loss that looks right, and nothing fails: the numbers are silently wrong. Both checks
compare a *fingerprint* of each tensor across the group and raise ``DivergenceError`` naming the tensor and the TP
ranks whose copy differs from TP rank 0's.

A fingerprint (``fingerprint``) is computed from the tensor's bits, not its values: two integer sums over the
elements' bit patterns, one plain and one with a weight per position. Integer arithmetic wraps identically in any
order, so equal tensors give equal fingerprints on every rank, and one changed bit changes them.

Inputs (``set_input_check``): the model's forward fingerprints every tensor argument into a table of fixed size (64
slots of 3 int64, chosen by the argument's name, so ranks passing different arguments still run the same collective)
and all-gathers it over the TP group: one collective of 1.5 KiB per forward. On CPU and on other eager devices the
result is read at once and a mismatch raises before the forward runs (on a GPU, that read waits for the gather). On
XLA the gather is part of the forward's graph, the same on every rank, and nothing is read in the forward: the result
is read after the step's graph has run and one more step has been launched, so a mismatch raises at the forward two
steps after the one that received it, on every rank at the same call. ``set_input_check(model, every=N)`` checks the
first forward and every N-th after it, and ``every=0`` turns the check off; the environment variable
``NXDTP_INPUT_CHECK_EVERY`` sets the default for models parallelized afterwards.

Replicated parameters (``check_replicated_agree``): ``nxdtp.checkpointing.save`` calls it before writing anything, since
it writes replicated tensors from TP rank 0 only and would silently keep rank 0's copy.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import zlib
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from . import comm
from .forward_wrappers import wrap_forward
from .record import note_of, read_note
from .topology import ParallelGroup, tensor_parallel_group

# Input slots: a fixed size, so every rank gathers the same shape whatever arguments it was given (ranks that passed
# different arguments must meet in the collective, then be told, rather than hang). Names are hashed to slots; two
# names sharing one are both named when it differs.
INPUT_SLOTS = 64
EVERY_ENVIRONMENT_VARIABLE = "NXDTP_INPUT_CHECK_EVERY"
_BIT_VIEWS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


@dataclasses.dataclass
class InputCheckNote:
    """On a model: the input check ``install_input_check`` gave it."""
    check: Optional["_InputCheck"] = None


@dataclasses.dataclass
class RankLocalBuffers:
    """On a module: the names of its buffers that differ by TP rank on purpose (masks of real heads or channels), so
    ``nxdtp.plan.broadcast_replicated_state`` leaves them alone. Written by ``HeadPadded`` and the parallel Conv2d
    layers."""
    names: Tuple[str, ...] = ()


class DivergenceError(ValueError):
    """Tensors that must be equal across a tensor-parallel group are not (the message names them and the ranks)."""


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """An int64 ``[2]`` tensor on the tensor's device: the sum of its elements' bit patterns and their sum weighted by
    a function of the position (so reordered elements differ too). Equal tensors give equal fingerprints on every rank
    (compare fingerprints made on one kind of device); ``-0.0`` and ``0.0`` differ, as their bits do."""
    t = tensor.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point():
        t = t.contiguous().view(_BIT_VIEWS[t.element_size()])
    # 32-bit arithmetic unless the bits need 64: the weighted products wrap (alike on every rank), the sums are
    # accumulated in int64; half the memory traffic of widening everything.
    bits = t.reshape(-1)
    if bits.dtype not in (torch.int32, torch.int64):
        bits = bits.to(torch.int32)
    weights = _position_weights(bits.numel(), bits.device, bits.dtype)
    return torch.stack([bits.sum(dtype=torch.int64), (bits * weights).sum(dtype=torch.int64)])


_HOST_WEIGHTS = {}


def _position_weights(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Weights in [1, 65521]: a multiplicative hash of the position. On the host they are kept and sliced (save
    fingerprints millions of elements); elsewhere computed where the tensor is (on XLA an iota in the graph, not a
    transfer)."""
    if device.type != "cpu":
        return torch.arange(n, dtype=torch.int64, device=device).mul_(40503).remainder_(65521).add_(1).to(dtype)
    cached = _HOST_WEIGHTS.get(dtype)
    if cached is None or cached.numel() < n:
        size = max(n, 2 * (0 if cached is None else cached.numel()))
        cached = _HOST_WEIGHTS[dtype] = torch.arange(size, dtype=torch.int64).mul_(40503).remainder_(65521).add_(1) \
            .to(dtype)
    return cached[:n]


# ---- inputs of every forward -----------------------------------------------------------------------------------------

def _every_from_environment() -> int:
    value = os.environ.get(EVERY_ENVIRONMENT_VARIABLE, "1").strip()
    if not value.isdigit():
        raise ValueError(f"{EVERY_ENVIRONMENT_VARIABLE}={value!r} is not valid: give 0 (no input check) or N >= 1 "
                         "(check the first forward and every N-th after it)")
    return int(value)


def _check_every(every) -> int:
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(f"every={every!r} is not valid: give 0 (no input check) or an int N >= 1 (check the first "
                         "forward and every N-th after it)")
    return every


def install_input_check(model: nn.Module, every: Optional[int] = None) -> nn.Module:
    """Make ``model``'s forward check that every rank of the TP group received the same tensor inputs (module
    docstring). ``every`` defaults to ``NXDTP_INPUT_CHECK_EVERY`` (1: every forward). Every plan in
    ``nxdtp.models`` installs it; call it (or ``set_input_check``) for a model of your own. Returns the model."""
    every = _every_from_environment() if every is None else _check_every(every)
    if read_note(model, InputCheckNote).check is not None:   # installed already: a second wrapper would gather twice
        set_input_check(model, every)
        return model
    note_of(model, InputCheckNote).check = _InputCheck(every)
    wrap_forward(model, "nxdtp_input_check", _forward_checking_inputs)
    return model


def set_input_check(model: nn.Module, every: int) -> None:
    """Check the inputs of the first forward of ``model`` from now on and of every ``every``-th after it; ``every=0``
    turns the check off. Installs the check on a model that has none (``install_input_check``)."""
    every = _check_every(every)
    check = read_note(model, InputCheckNote).check
    if check is None:
        install_input_check(model, every)
    else:
        check.every, check.calls = every, 0


def pending_input_checks(model: nn.Module) -> List[torch.Tensor]:
    """The gathered fingerprint tables of ``model``'s checked forwards not yet read (XLA only: elsewhere they are read
    at once). For tracing: they are outputs of the forward's graph (``tests/test_rank_independent_graphs.py``)."""
    check = read_note(model, InputCheckNote).check
    return [] if check is None else [entry.gathered for entry in check.pending]


def _forward_checking_inputs(forward, *args, **kwargs):
    module = forward.__self__
    check = read_note(module, InputCheckNote).check
    if check is not None:
        check(module, args, kwargs)
    return forward(*args, **kwargs)


class _Pending:
    """One checked forward on XLA whose gathered table is not read yet."""

    def __init__(self, gathered: torch.Tensor, names: Dict[int, List[str]], index: int):
        self.gathered, self.names, self.index = gathered, names, index
        self.synced_at: Optional[int] = None   # the sync that computed it (the check's own count)


class _InputCheck:
    """The per-model state of the input check: its schedule, and on XLA the results waiting to be read. Copies and
    pickles keep the schedule only (pending results belong to the original's steps)."""

    def __init__(self, every: int):
        self.every = every
        self.calls = 0        # forwards since the schedule was set (set_input_check starts it again)
        self.forwards = 0     # forwards of this model, for messages
        self.pending: List[_Pending] = []
        self.syncs = 0
        self.sync_watched = False

    def __getstate__(self):
        return {"every": self.every}

    def __setstate__(self, state):
        self.__init__(state["every"])

    def __deepcopy__(self, memo):
        return _InputCheck(self.every)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        group = tensor_parallel_group()
        if group.size == 1:
            return
        self._read_finished(group)
        index, self.forwards = self.forwards, self.forwards + 1
        scheduled, self.calls = self.calls, self.calls + 1
        if self.every == 0 or scheduled % self.every:
            return
        named = _tensor_inputs(module, args, kwargs)
        # The device of the model, not of the inputs: a rank given no tensor must still join the same collective.
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        with torch.no_grad():
            table = torch.zeros(INPUT_SLOTS, 3, dtype=torch.int64, device=device)
            names: Dict[int, List[str]] = {}
            for name, tensor in named:
                slot = zlib.crc32(name.encode()) % INPUT_SLOTS
                names.setdefault(slot, []).append(name)
                # The first column says "present, with this dtype and shape" (never 0), so an argument passed on some
                # ranks only differs even when it is all zeros.
                layout = zlib.crc32(f"{tensor.dtype}{tuple(tensor.shape)}".encode()) + 1
                row = fingerprint(tensor).to(device)
                table[slot] += torch.cat([row.new_full((1,), layout), row])
            gathered = comm.all_gather(table, group, dim=0)
        if device.type == "xla":
            self.pending.append(_Pending(gathered, names, index))
            self._watch_next_sync()
        else:
            _report(gathered.cpu(), names, group, None)

    # XLA: a result is read once the sync that computed it has passed and one more sync has been launched; by then
    # its graph has finished on the device (steps run in order), so the read only copies 1.5 KiB, and the forward that
    # reads it is traced while the previous step still runs. Every rank reads at the same call, so all raise together.
    def _watch_next_sync(self) -> None:
        if self.sync_watched:
            return
        import torch_xla.core.xla_model as xm

        self.sync_watched = True
        xm.add_step_closure(self._synced)

    def _synced(self) -> None:
        # A step closure: runs on the main thread right after torch_xla.sync() launched the step's graph; it reads
        # no tensor.
        self.syncs += 1
        self.sync_watched = False
        for entry in self.pending:
            if entry.synced_at is None:
                entry.synced_at = self.syncs
        if any(entry.synced_at is None for entry in self.pending):
            self._watch_next_sync()

    def _read_finished(self, group: ParallelGroup) -> None:
        due = [e for e in self.pending if e.synced_at is not None and e.synced_at < self.syncs]
        if not due:
            return
        self.pending = [e for e in self.pending if e not in due]
        for entry in due:
            _report(entry.gathered.cpu(), entry.names, group, (entry.index, self.forwards))


def _report(gathered: torch.Tensor, names: Dict[int, List[str]], group: ParallelGroup,
            deferred: Optional[Tuple[int, int]]) -> None:
    tables = gathered.reshape(group.size, INPUT_SLOTS, 3)
    differs = (tables != tables[0]).any(dim=-1)                 # [tp rank, slot]: differs from TP rank 0's
    bad = differs.any(dim=0).nonzero().flatten().tolist()
    if not bad:
        return
    # Only now, on the error path and on every rank of this group alike: which names each rank passed, so every rank
    # can name an argument even if it did not receive it itself.
    everyone = comm.all_gather_object(names, group=group)
    parts = []
    for slot in bad:
        passed = [sorted(n for n in per_rank.get(slot, ())) for per_rank in everyone]
        slot_names = sorted({n for per_rank in passed for n in per_rank})
        ranks = [r for r in range(group.size) if differs[r, slot]]
        part = (f"{' or '.join(repr(n) for n in slot_names)} differs on TP rank(s) {ranks} (global rank(s) "
                f"{[group.ranks[r] for r in ranks]}) from TP rank 0's")
        missing = [r for r in range(group.size) if set(slot_names) - set(passed[r])]
        if missing:
            part += f", and is not passed as a tensor on TP rank(s) {missing}"
        parts.append(part)
    when = ""
    if deferred is not None:
        index, calls = deferred
        when = (f" (on XLA the check reads its result after the step's graph has run, so this is forward #{index} "
                f"of this model, found at forward #{calls}, {calls - index} step(s) later)")
    raise DivergenceError(
        f"the ranks of tensor-parallel group {list(group.ranks)} received different inputs{when}: {'; '.join(parts)}. "
        "Every rank of a TP group computes one model together and needs the same batch: give every TP rank the same "
        "data (nxdtp.data.broadcast_data sends TP rank 0's batch to the others), or turn this check off with "
        "nxdtp.agreement.set_input_check(model, every=0)")


_SIGNATURES: Dict[type, Optional[inspect.Signature]] = {}


def _signature(cls: type) -> Optional[inspect.Signature]:
    """The signature of the forward the model's own class defines (forward wrappers take ``*args, **kwargs``)."""
    root = getattr(cls, "_nxdtp_recipe", (cls,))[0]
    if root not in _SIGNATURES:
        try:
            _SIGNATURES[root] = inspect.signature(root.forward)
        except (TypeError, ValueError):
            _SIGNATURES[root] = None
    return _SIGNATURES[root]


def _tensor_inputs(module: nn.Module, args: tuple, kwargs: dict) -> List[Tuple[str, torch.Tensor]]:
    """The tensor arguments of a forward call, by the forward's parameter names (positional ones too)."""
    signature = _signature(type(module))
    named: List[Tuple[str, object]] = []
    try:
        bound = signature.bind(module, *args, **kwargs) if signature is not None else None
    except TypeError:
        bound = None   # the forward will say what is wrong with the call
    if bound is None:
        named = [(f"argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    else:
        for position, (name, value) in enumerate(bound.arguments.items()):
            kind = signature.parameters[name].kind
            if position == 0:
                continue   # self
            if kind == inspect.Parameter.VAR_POSITIONAL:
                named += [(f"{name}[{i}]", v) for i, v in enumerate(value)]
            elif kind == inspect.Parameter.VAR_KEYWORD:
                named += list(value.items())
            else:
                named.append((name, value))
    return [(name, value) for name, value in named if isinstance(value, torch.Tensor)]


# ---- replicated parameters -------------------------------------------------------------------------------------------

def check_replicated_agree(tensors: Dict[str, torch.Tensor], group: Optional[ParallelGroup] = None,
                           what: str = "save()") -> None:
    """Collective over the TP group (every rank calls it, with its own copies of the same names): raise
    ``DivergenceError`` on every rank if any of ``tensors`` (replicated tensors, by name) differs between the ranks,
    naming it and the TP ranks whose copy differs from TP rank 0's. Fingerprints are computed on the host (one copy of
    each tensor from a device) and exchanged on the host group: no device graph, no device collective."""
    group = tensor_parallel_group() if group is None else group
    if group.size == 1:
        return
    mine = {name: fingerprint(tensor.detach().cpu()).tolist() for name, tensor in tensors.items()}
    everyone = comm.all_gather_object(mine, group=group)
    differing: Dict[str, List[int]] = {}
    for name in sorted({n for per_rank in everyone for n in per_rank}, key=_order_of(everyone[0])):
        ranks = [r for r, per_rank in enumerate(everyone) if per_rank.get(name) != everyone[0].get(name)]
        if ranks:
            differing[name] = ranks
    if not differing:
        return
    shown = list(differing.items())[:10]
    listed = "; ".join(f"'{name}' (TP rank(s) {ranks}, global rank(s) {[group.ranks[r] for r in ranks]})"
                       for name, ranks in shown)
    more = f"; and {len(differing) - len(shown)} more" if len(differing) > len(shown) else ""
    raise DivergenceError(
        f"{what} refused: {len(differing)} replicated tensor(s) differ across tensor-parallel group "
        f"{list(group.ranks)}, each copy compared with TP rank 0's: {listed}{more}. A checkpoint stores replicated "
        "tensors once, from TP rank 0, and would silently drop the other copies. Copies drift apart when their "
        "gradients differ (different inputs on the TP ranks, sequence-parallel gradients not summed, different seeds "
        "for dropout outside TP regions). If TP rank 0's copy is right, make the others equal to it with "
        "nxdtp.plan.broadcast_replicated_state(model) before saving; to save anyway (TP rank 0's copy), pass "
        "check_replicated=False")


def _order_of(first: Dict[str, object]):
    order = {name: i for i, name in enumerate(first)}
    return lambda name: (order.get(name, len(order)), name)


__all__ = ["DivergenceError", "fingerprint", "install_input_check", "set_input_check", "pending_input_checks",
           "check_replicated_agree", "INPUT_SLOTS", "EVERY_ENVIRONMENT_VARIABLE"]

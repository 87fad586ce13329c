"""The verification itself, collective over an initialized world of ``tp * dp`` ranks: the dense model and its
parallelized copy take the same steps on the same global batch (each DP rank its rows of it), and after every step each
rank compares, parameter by parameter, the dense tensors gathered from the TP pieces (``gather_dense``, as checkpoints
assemble them) with the dense model's, and the replicated parameters' copies across its TP group (``fingerprint``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import comm
from ..agreement import fingerprint
from ..checkpointing.dense import gather_dense
from ..grads import allreduce_gradients, allreduce_sequence_parallel_gradients
from ..models import parallelize_model
from ..spec import ParamSpec, ShardedModule
from ..topology import data_parallel_group, get_topology, tensor_parallel_group
from .models import Job, build_dense, dp_slice, global_batch, loss_of, plan_of


@dataclasses.dataclass
class Worst:
    """The largest difference of one kind at one step: ``ratio`` is |TP - dense| over the tolerance
    (atol + rtol * |dense|) at its worst element (above 1: out of tolerance), ``diff`` the largest |TP - dense|."""

    name: str = ""
    diff: float = 0.0
    ratio: float = 0.0

    def worse(self, other: "Worst") -> "Worst":
        return other if other.ratio > self.ratio else self


@dataclasses.dataclass
class StepRow:
    step: int
    loss_dense: float
    loss_tp: float
    norm_dense: float
    norm_tp: float
    param: Worst
    grad: Worst
    drift: Dict[str, float]  # replicated parameters whose TP copies differ after the step: largest difference


def run_in_world(job: Job) -> List[StepRow]:
    """Collective over the installed topology (tp from it; every rank calls this with the same job): ``job.steps``
    steps of the dense model and of its parallelized copy; the rows, the same on every rank."""
    topology = get_topology()
    if topology.tensor_model_parallel_size != job.tp or topology.data_parallel_size != job.dp:
        raise ValueError(f"the job is for tp={job.tp} x dp={job.dp}, the world is "
                         f"tp={topology.tensor_model_parallel_size} x dp={topology.data_parallel_size}")
    dense = build_dense(job)
    model = parallelize_model(copy.deepcopy(dense), plan_of(job))
    dense_optimizer, optimizer = _optimizer(job, dense), _optimizer(job, model)
    specs = _specs_by_parameter(model)
    rows: List[StepRow] = []
    for step in range(job.steps):
        try:
            rows.append(_step(job, step, dense, model, dense_optimizer, optimizer, specs))
        except Exception as e:  # noqa: BLE001 - a plan that builds but cannot run fails the verification
            raise StepFailed(f"step {step}: {type(e).__name__}: {e}") from e
    return rows


class StepFailed(RuntimeError):
    """A step of the dense or the parallelized model raised (a plan that builds but whose layers do not fit)."""


def _step(job: Job, step: int, dense: nn.Module, model: nn.Module, dense_optimizer, optimizer,
          specs: Dict[int, ParamSpec]) -> StepRow:
    batch = global_batch(job, dense, step)
    loss_dense = loss_of(dense(**batch), "dense")
    loss_dense.backward()
    loss_tp = loss_of(model(**dp_slice(batch, job, data_parallel_group().rank)), "parallelized")
    loss_tp.backward()
    allreduce_sequence_parallel_gradients(model)   # a plan's sequence-parallel norms; nothing for the others
    allreduce_gradients(model)
    loss_tp = comm.all_reduce(loss_tp.detach().clone(), data_parallel_group()) / job.dp
    norm_dense = _norm([p.grad for p in dense.parameters()])
    grad, norm_tp = _worst(model, dense, specs, job, gradients=True)
    dense_optimizer.step()
    optimizer.step()
    dense_optimizer.zero_grad()
    optimizer.zero_grad()
    return StepRow(step, float(loss_dense), float(loss_tp), norm_dense, norm_tp,
                   _worst(model, dense, specs, job, gradients=False)[0], grad, _drift(model, specs))


def _optimizer(job: Job, model: nn.Module) -> torch.optim.Optimizer:
    if job.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=job.lr)
    return torch.optim.AdamW(model.parameters(), lr=job.lr, eps=1e-4)


def _specs_by_parameter(model: nn.Module) -> Dict[int, ParamSpec]:
    """Each sharded parameter's spec by the parameter's identity (ties share one object); the others are replicated."""
    specs = {}
    for module in model.modules():
        if isinstance(module, ShardedModule):
            for name, spec in module.param_specs().items():
                param = getattr(module, name, None)
                if isinstance(param, torch.Tensor):
                    specs[id(param)] = spec
    return specs


def _norm(grads: List[Optional[torch.Tensor]]) -> float:
    """The 2-norm of ``grads`` summed in float64: fp32 sums over tensors of millions of elements drift by 1e-4 of the
    norm with the order of summation, which would hide or fake a difference between TP and dense."""
    return math.sqrt(sum(float(g.double().square().sum()) for g in grads if g is not None))


def _worst(model: nn.Module, dense: nn.Module, specs: Dict[int, ParamSpec], job: Job, gradients: bool
           ) -> Tuple[Worst, float]:
    """Collective: the worst parameter (or gradient) over every rank, each TP piece gathered to the dense tensor, and
    the norm of the gathered tensors on global rank 0."""
    group = tensor_parallel_group()
    reference = dict(dense.named_parameters(remove_duplicate=False))
    worst, gathered = Worst(), []
    for name, param in model.named_parameters():
        if name not in reference:
            raise ValueError(f"the parallelized model has a parameter {name!r} the dense model does not have; a plan "
                             "must keep the model's parameter names")
        spec = specs.get(id(param)) or ParamSpec(full_shape=tuple(param.shape))
        mine = param.grad if gradients else param
        if mine is None:
            mine = torch.zeros_like(param)
        full = gather_dense(mine, spec, group)
        gathered.append(full)
        expected = reference[name].grad if gradients else reference[name]
        expected = torch.zeros_like(reference[name]) if expected is None else expected.detach()
        worst = worst.worse(_difference(name, full, expected, job))
    everyone = comm.all_gather_object((dataclasses.astuple(worst), _norm(gathered)))
    return max((Worst(*values) for values, _ in everyone), key=lambda w: w.ratio), everyone[0][1]


def _difference(name: str, got: torch.Tensor, expected: torch.Tensor, job: Job) -> Worst:
    if tuple(got.shape) != tuple(expected.shape):
        return Worst(name, math.inf, math.inf)
    error = (got.float() - expected.float()).abs()
    if error.numel() == 0:
        return Worst(name)
    ratio = error / (job.atol + job.rtol * expected.float().abs())
    return Worst(name, float(error.max()), float(ratio.max()))


def _drift(model: nn.Module, specs: Dict[int, ParamSpec]) -> Dict[str, float]:
    """Collective over the TP group: the replicated parameters whose copies differ between its ranks (bitwise, by
    fingerprint), each with the largest difference from TP rank 0's copy over the world."""
    group = tensor_parallel_group()
    replicated = [(name, p) for name, p in model.named_parameters() if id(p) not in specs]
    drifting: List[Tuple[str, torch.Tensor]] = []
    if group.size > 1:
        prints = comm.all_gather_object([fingerprint(p.detach().cpu()).tolist() for _, p in replicated], group=group)
        drifting = [(name, p) for i, (name, p) in enumerate(replicated)
                    if any(per_rank[i] != prints[0][i] for per_rank in prints)]
    mine: Dict[str, float] = {}
    for name, p in drifting:
        first = comm.broadcast(p.detach().cpu().clone(), group, src_group_rank=0)
        mine[name] = float((p.detach().cpu() - first).abs().max())
    merged: Dict[str, float] = {}
    for per_rank in comm.all_gather_object(mine):
        for name, diff in per_rank.items():
            merged[name] = max(diff, merged.get(name, 0.0))
    return merged


def failures(rows: List[StepRow], job: Job) -> List[str]:
    """What is out of tolerance, worst first within each step: the loss, the gradient norm, the worst parameter and
    gradient, and drifting replicated parameters."""
    out = []
    for row in rows:
        for what, dense, tp in (("loss", row.loss_dense, row.loss_tp), ("gradient norm", row.norm_dense, row.norm_tp)):
            if not abs(dense - tp) <= job.atol + job.rtol * abs(dense):
                out.append(f"step {row.step}: {what} {tp:.8g} (TP) vs {dense:.8g} (dense)")
        for what, worst in (("gradient", row.grad), ("parameter after the step", row.param)):
            if not worst.ratio <= 1:
                out.append(f"step {row.step}: {what} '{worst.name}' differs from dense by {worst.diff:.3g}")
        for name, diff in row.drift.items():
            if not diff <= job.atol:
                out.append(f"step {row.step}: replicated parameter '{name}' differs across TP ranks by {diff:.3g}")
    return out


def worst_parameter(rows: List[StepRow], job: Job) -> Optional[str]:
    """The name of the parameter to blame: the first step's out-of-tolerance gradient, else parameter, else drift."""
    for row in rows:
        for worst in (row.grad, row.param):
            if not worst.ratio <= 1:
                return worst.name
        drifting = [name for name, diff in row.drift.items() if not diff <= job.atol]
        if drifting:
            return drifting[0]
    return None

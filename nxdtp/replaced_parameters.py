"""Parameters that parallelizing took out of a model, so that an optimizer built before ``parallelize`` is refused at
its first step instead of training only the parameters that were kept.

Sharding replaces a module's parameters with new ones (this rank's pieces). An optimizer built on the dense model still
holds the old ones, which no longer get gradients: its steps would silently leave every sharded weight unchanged.
torch's global optimizer step pre-hook sees every optimizer's first step; each optimizer is checked once.
"""

from __future__ import annotations

import weakref
from typing import Iterable, List

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

# By id: a tensor's == is elementwise, so tensors cannot be members of a WeakSet. An entry goes when its tensor does,
# so a live id is never a dead tensor's.
_REPLACED: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
_CHECKED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_HOOK = []  # the handle of the registered hook, once


def weak_parameters(model: torch.nn.Module) -> List["weakref.ref[torch.Tensor]"]:
    """``model``'s parameters, held weakly: a dense weight that only the model held is freed as soon as its module is
    replaced, and then no optimizer can hold it."""
    return [weakref.ref(p) for p in model.parameters()]


def record_replaced(before: List["weakref.ref[torch.Tensor]"], after: Iterable[torch.Tensor]) -> None:
    """Remember the parameters of ``before`` (``weak_parameters`` of the model before it was parallelized) that are
    still alive but no longer the model's (``after``), and make sure optimizers are checked against them."""
    kept = {id(p) for p in after}
    for reference in before:
        parameter = reference()
        if parameter is not None and id(parameter) not in kept:
            _REPLACED[id(parameter)] = parameter
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_refuse_replaced_parameters))


def _refuse_replaced_parameters(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if optimizer in _CHECKED or not len(_REPLACED):
        return
    stale = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) in _REPLACED)
    if stale:
        raise RuntimeError(f"{type(optimizer).__name__} holds {stale} parameters that parallelizing replaced (the "
                           "dense modules' weights, which no longer get gradients): build the optimizer after "
                           "parallelize_model / parallelize, from the parallelized model's parameters")
    _CHECKED.add(optimizer)

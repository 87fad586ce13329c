"""What a checkpoint saves of a wrapped model or optimizer: the object that owns the state, found by duck typing so
other libraries' wrappers (``DistributedDataParallel``, NxD's ``NxDModel`` and ``NxDOptimizer``, accelerate's
``AcceleratedOptimizer``) need no import. A wrapper is unwrapped only while it owns no state of its own; a ZeRO-1
optimizer's ``.optimizer`` is not a wrapper's target."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["is_zero1", "unwrap_model", "unwrap_optimizer"]


def is_zero1(optimizer: Any) -> bool:
    """A ZeRO-1 optimizer (it declares ``shards_state_over_data_parallel``, as NeuronZero1Optimizer does) or its state
    dict."""
    if isinstance(optimizer, dict):
        return "base_state" in optimizer
    return getattr(type(optimizer), "shards_state_over_data_parallel", False) is True


def _tensor_ids(module: nn.Module) -> set:
    return {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}


def unwrap_model(model: Any) -> Any:
    """The module a wrapper such as ``NxDModel`` holds as ``.module`` (repeatedly), when the wrapper owns no
    parameter or buffer of its own; anything else is returned as it is."""
    while isinstance(model, nn.Module):
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module) or inner is model or _tensor_ids(model) != _tensor_ids(inner):
            break
        model = inner
    return model


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer a delegating wrapper such as ``NxDOptimizer`` holds as ``.optimizer`` (repeatedly); a ZeRO-1
    optimizer, and an optimizer with param groups of its own, are returned as they are."""
    while optimizer is not None and not is_zero1(optimizer):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            break
        if isinstance(optimizer, torch.optim.Optimizer) and optimizer.param_groups is not inner.param_groups:
            break
        optimizer = inner
    return optimizer

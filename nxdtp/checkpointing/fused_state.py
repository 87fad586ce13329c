"""The optimizer state of fused parameters (``ShardedModule.fused_parameters``) in the form a checkpoint describes:
saved as its parts' (each field shaped like the parameter cut into the parts' rows, others copied to every part), so
it merges, reshards and exports as separate parameters would, and is joined again on loading."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..spec import ShardedModule

# A fused parameter: its name in the model, and its parts' names in the model with their rows, in order along dim 0.
Parts = Tuple[Tuple[str, int], ...]
Fused = Tuple[str, Parts]


def fused_parameters_of(model: nn.Module) -> Dict[int, Fused]:
    """Every fused parameter of ``model`` by identity: its name and its parts' (names as ``model.state_dict()``
    has them) with their rows, as the modules declare them (``ShardedModule.fused_parameters``)."""
    fused: Dict[int, Fused] = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, ShardedModule):
            continue
        dot = prefix + "." if prefix else ""
        for name, parts in module.fused_parameters().items():
            param = getattr(module, name, None)
            if param is not None:
                fused[id(param)] = (dot + name, tuple((dot + part, int(rows)) for part, rows in parts))
    return fused


def fused_by_position(optimizer: torch.optim.Optimizer, model: nn.Module) -> Dict[int, Fused]:
    """The fused parameters among the optimizer's, by their position in its flattened parameter list."""
    fused = fused_parameters_of(model)
    flat = [p for group in optimizer.param_groups for p in group["params"]]
    return {i: fused[id(p)] for i, p in enumerate(flat) if id(p) in fused}


def split_state(fields: Dict[str, Any], shape: Tuple[int, ...], parts: Parts) -> List[Tuple[str, Dict[str, Any]]]:
    """A fused parameter's optimizer state as its parts': (part name, fields) per part, tensors shaped like the
    parameter cut to the part's rows (views), anything else the same in every part."""
    rows = [n for _, n in parts]
    if sum(rows) != shape[0]:
        raise ValueError(f"the fused parameter's parts {[name for name, _ in parts]} have {rows} rows, but the "
                         f"parameter has shape {list(shape)}")
    split = {field: value.split(rows) for field, value in fields.items()
             if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(shape)}
    return [(name, {field: split[field][k] if field in split else value for field, value in fields.items()})
            for k, (name, _) in enumerate(parts)]


def fuse_state(where: str, fused: Fused, given: Dict[str, Dict[str, Any]], shape: Tuple[int, ...]) -> Dict[str, Any]:
    """The inverse of ``split_state``. Every part must be there with the same fields: a part left at fresh state beside
    trained ones would be a silently wrong resume."""
    name, parts = fused
    missing = [part for part, _ in parts if part not in given]
    if missing:
        raise ValueError(f"{where}: the checkpoint has optimizer state for {sorted(given)} but not for {missing}, "
                         f"the other parts of the fused parameter '{name}'")
    first = given[parts[0][0]]
    for part, _ in parts[1:]:
        if set(given[part]) != set(first):
            raise ValueError(f"{where}: the optimizer state of '{part}' has the fields {sorted(given[part])}, that of "
                             f"'{parts[0][0]}' {sorted(first)}: they are parts of one fused parameter, '{name}'")
    fields: Dict[str, Any] = {}
    for field, value in first.items():
        pieces = [given[part][field] for part, _ in parts]
        if all(isinstance(p, torch.Tensor) and tuple(p.shape) == (rows,) + tuple(shape[1:])
               for p, (_, rows) in zip(pieces, parts)):
            fields[field] = torch.cat(pieces)
        elif isinstance(value, torch.Tensor) and not all(isinstance(p, torch.Tensor) and p.shape == value.shape
                                                         and torch.equal(p, value) for p in pieces[1:]):
            # Neither the parts' rows nor one value they share (Adam's step): another layout's state.
            raise ValueError(f"{where}: the optimizer state '{field}' of the parts of '{name}' has the shapes "
                             f"{[list(p.shape) if isinstance(p, torch.Tensor) else None for p in pieces]}, neither "
                             f"the parts' rows {[rows for _, rows in parts]} nor one shared value")
        else:
            fields[field] = value
    return fields


def with_fused_tensors(model_state: Optional[Dict[str, torch.Tensor]], fused: Dict[int, Fused]
                       ) -> Optional[Dict[str, torch.Tensor]]:
    """A model state (keyed as the checkpoint, by the parts' names) with each fused parameter's tensor added under its
    own name, its parts concatenated, where all of them are there (a ZeRO-1 master weight is cut from it)."""
    if model_state is None or not fused:
        return model_state
    state = dict(model_state)
    for name, parts in fused.values():
        if all(part in model_state for part, _ in parts):
            state[name] = torch.cat([model_state[part] for part, _ in parts])
    return state

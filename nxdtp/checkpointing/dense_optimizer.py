"""The dense model's optimizer state that ``nxdtp-merge`` writes beside the Hugging Face model
(``optimizer.safetensors`` and ``optimizer.json``), and its loader (docs/checkpoints.md, "Merging and resharding")."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

from .durable import read_json
from .safetensors_stream import SafetensorsFileReader

DENSE_OPTIMIZER_TENSORS = "optimizer.safetensors"
DENSE_OPTIMIZER_VALUES = "optimizer.json"
DENSE_OPTIMIZER_FORMAT = "nxdtp-dense-optimizer-v1"
MASTER_PREFIX = "master."

__all__ = ["load_dense_optimizer_state", "DENSE_OPTIMIZER_TENSORS", "DENSE_OPTIMIZER_VALUES"]


def load_dense_optimizer_state(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                               load_master_weights: bool = False) -> Dict[str, Any]:
    """Restore the optimizer state ``nxdtp-merge`` wrote to ``directory`` into ``optimizer``, one of the same kind
    over the dense (or TP-sharded) ``model``, through torch's ``set_optimizer_state_dict``; return the checkpoint's
    trainer state (empty if none). Build an LR scheduler before loading: torch restores only the group keys the
    optimizer has. ``load_master_weights=True`` (ZeRO-1 only) copies the fp32 masters into the parameters too."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    tensors_path = os.path.join(directory, DENSE_OPTIMIZER_TENSORS)
    record, flat, masters = _read_dense_optimizer_files(directory)
    if hasattr(optimizer, "sharding_group"):
        raise TypeError(f"load_dense_optimizer_state restores a plain optimizer; {type(optimizer).__name__} shards its "
                        "state over data parallelism: load this state into the plain optimizer, save an nxdtp "
                        "checkpoint, and load that into ZeRO-1 (nxdtp.checkpointing.load converts)")
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    names = [name for name, p in model.named_parameters() if id(p) in held]
    if len(names) != len(held):
        raise ValueError(f"the optimizer holds {len(held) - len(names)} parameters that are not parameters of the "
                         "model passed: pass the model the optimizer was built on")
    tp, piece = _this_rank_piece(model)
    _fuse_parts(model, flat, masters, piece)
    saved = {key.split(".", 1)[1].rsplit(".", 1)[0] for key in flat if key.startswith("param_groups.")}
    missing = [name for name in names if name not in saved]
    if missing:
        raise ValueError(f"{directory}'s optimizer state has no entry for parameters {missing[:5]} of the model "
                         f"({len(missing)} in all); it holds {sorted(saved)[:5]}...: build the dense model from that "
                         "directory's config (parameter names must match)")
    if load_master_weights and not masters:
        raise ValueError(f"{tensors_path} holds no master weights: it was merged from a "
                         f"{record.get('source_kind', 'plain')} optimizer, not ZeRO-1")
    if tp > 1:
        _cut_for_tensor_parallelism(names, flat, masters, piece)
    set_optimizer_state_dict(model, optimizer, flat, options=StateDictOptions(flatten_optimizer_state_dict=True))
    if load_master_weights:
        parameters = dict(model.named_parameters())
        with torch.no_grad():
            for name in names:
                parameters[name].copy_(masters[name].view_as(parameters[name]))
    return record.get("trainer_state") or {}


def _read_dense_optimizer_files(directory: str) -> Tuple[Dict[str, Any], Dict[str, Any], Dict[str, torch.Tensor]]:
    """(the values file's record, the flat optimizer state by key, the master weights by parameter name)."""
    values_path = os.path.join(directory, DENSE_OPTIMIZER_VALUES)
    tensors_path = os.path.join(directory, DENSE_OPTIMIZER_TENSORS)
    for path in (values_path, tensors_path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: {directory} holds no optimizer state (nxdtp-merge writes it "
                                    "only for checkpoints saved with a live optimizer and model; it says so when not)")
    record = read_json(values_path)
    if record.get("format") != DENSE_OPTIMIZER_FORMAT:
        raise ValueError(f"{values_path} has format {record.get('format')!r}; this nxdtp reads "
                         f"{DENSE_OPTIMIZER_FORMAT!r}")
    flat: Dict[str, Any] = {}
    masters: Dict[str, torch.Tensor] = {}
    tensors = SafetensorsFileReader(tensors_path)
    for key in tensors.keys():
        if key.startswith(MASTER_PREFIX):
            masters[key[len(MASTER_PREFIX):]] = tensors.get_tensor(key)
        else:
            flat[key] = tensors.get_tensor(key)
    for key, value in record["values"].items():
        # JSON made the tuples of torch's optimizers (Adam's betas) lists: give them back.
        flat[key] = tuple(value) if isinstance(value, list) else value

    return record, flat, masters


def _this_rank_piece(model: nn.Module) -> Tuple[int, Callable[[str, Any], Any]]:
    """The TP size, and ``piece(name, value)``: this TP rank's piece of a dense tensor shaped like model tensor
    ``name``'s, laid out as the model's is; any other value as it is."""
    from .. import parallel_state as ps
    from .save_load import sharding_specs

    initialized = ps.model_parallel_is_initialized()
    tp = ps.get_tensor_model_parallel_size() if initialized else 1
    rank = ps.get_tensor_model_parallel_rank() if initialized else 0
    # State-dict keys (a fused parameter's parts) and parameter names (a tied parameter's first name).
    specs, live = sharding_specs(model, tp), {**model.state_dict(keep_vars=True), **dict(model.named_parameters())}

    def piece(name: str, value: Any) -> Any:
        spec = specs.get(id(live[name])) if name in live else None
        if not isinstance(value, torch.Tensor) or spec is None or tuple(value.shape) != tuple(spec.unpadded_shape):
            return value
        return spec.shard(value, rank)

    return tp, piece


def _fuse_parts(model: nn.Module, flat: Dict[str, Any], masters: Dict[str, torch.Tensor],
                piece: Callable[[str, Any], Any]) -> None:
    """A fused parameter's dense state is under its parts' names: each part's is cut to this rank's piece and the pieces
    joined under the fused name, which the optimizer holds."""
    from .fused_state import fused_parameters_of

    for name, parts in fused_parameters_of(model).values():
        names = [part for part, _ in parts]
        if not all(any(key.startswith(f"param_groups.{part}.") for key in flat) for part in names):
            continue   # not all of its parts are in the state: the missing-parameter check names the fused one
        for prefix in ("state", "param_groups"):
            fields = {key[len(f"{prefix}.{names[0]}."):] for key in flat if key.startswith(f"{prefix}.{names[0]}.")}
            for field in fields:
                values = [piece(part, flat.pop(f"{prefix}.{part}.{field}", None)) if prefix == "state"
                          else flat.pop(f"{prefix}.{part}.{field}", None) for part in names]
                rows_of = [tuple(v.shape[:1]) == (rows,) and v.dim() > 0 if isinstance(v, torch.Tensor) else False
                           for v, (_, rows) in zip(values, parts)]
                flat[f"{prefix}.{name}.{field}"] = torch.cat(values) if all(rows_of) else values[0]
        if all(part in masters for part in names):
            masters[name] = torch.cat([piece(part, masters.pop(part)) for part in names])


def _cut_for_tensor_parallelism(names: List[str], flat: Dict[str, Any], masters: Dict[str, torch.Tensor],
                                piece: Callable[[str, Any], Any]) -> None:
    """For a TP-sharded model, replace each dense state tensor (and master weight) shaped like its parameter's dense
    tensor by this TP rank's piece (``piece``)."""
    for name in names:
        prefix = f"state.{name}."
        for key in [key for key in flat if key.startswith(prefix) and "." not in key[len(prefix):]]:
            flat[key] = piece(name, flat[key])
        if name in masters:
            masters[name] = piece(name, masters[name])

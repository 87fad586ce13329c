"""torch.distributed.checkpoint (DCP) inside a running nxdtp job: ``get_state_dict`` gives the state in the layout
``nxdtp-merge --to dcp`` writes, every tensor a ``DenseView`` that torch's own planners save from and load into;
``set_state_dict`` applies what ``dcp.load`` hands back (docs/checkpoints.md, "DCP in a running job")."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import comm
from ..spec import FlatShardLayout, ParamSpec, ShardedModule, dense_chunks_of_flat_shard
from ..topology import data_parallel_group, expert_parallel_group, model_parallel_is_initialized, tensor_parallel_group
from .dcp_io import LR_SCHEDULER_KEY, OPTIMIZER_KEY, TRAIN_STATE_KEY, write_item
from .fused_state import fused_by_position, fused_parameters_of, split_state
from .save_load import sharding_specs
from .slabs import piece_boxes
from .unwrap import is_zero1, unwrap_optimizer

__all__ = ["get_state_dict", "set_state_dict", "dcp_process_group", "DenseView", "OPTIMIZER_KEY", "LR_SCHEDULER_KEY",
           "TRAIN_STATE_KEY"]

_STATE, _GROUPS = "state", "param_groups"

# A chunk: (offsets, sizes) in the dense tensor, and (flat_start, box, narrow): the local tensor's elements from
# flat_start seen as box (None: as it is), narrowed by (dim, start, length) (None: all of it).
_Run = Tuple[torch.Size, torch.Size, Tuple[int, Optional[Tuple[int, ...]], Optional[Tuple[int, int, int]]]]


def dcp_process_group():
    """The ``process_group=`` for ``dcp.save`` / ``dcp.load`` in an nxdtp job: a gloo group of every rank where the
    default backend refuses CPU objects, None on a gloo world."""
    return comm.host_process_group()


class DenseView(torch.Tensor):
    """A tensor of the dense global shape standing for this rank's part of it, the live ``local`` tensor laid out by
    ``spec`` (with ``flat``, a ZeRO-1 flat shard); ``writes``: whether this rank writes its chunks. It supports no
    tensor operations."""

    _local: torch.Tensor
    _key: str
    _write_runs: List[_Run]
    _read_runs: List[_Run]

    @staticmethod
    def __new__(cls, local: torch.Tensor, spec: ParamSpec, key: str, tp_rank: int, writes: bool,
                flat: Optional[Tuple[FlatShardLayout, int]] = None):
        dense_shape = torch.Size(spec.unpadded_shape)
        view = torch.Tensor._make_wrapper_subclass(cls, dense_shape, dtype=local.dtype, device=local.device,
                                                   requires_grad=False)
        view._local = local
        view._key = key
        expected = spec.local_shape() if flat is None else (flat[0].shard_numel,)
        if tuple(local.shape) != tuple(expected):
            raise ValueError(f"'{key}': the local tensor has shape {list(local.shape)}, its layout says "
                             f"{list(expected)}")
        if flat is not None:
            layout, shard_rank = flat
            kept, copies = ([(torch.Size(offsets), torch.Size(sizes), (start, box, narrow))
                             for start, box, narrow, offsets, sizes
                             in dense_chunks_of_flat_shard(spec, layout, tp_rank, shard_rank, copies)]
                            for copies in (False, True))
        else:  # a replicated tensor is TP rank 0's chunk, which the other ranks read as a copy
            kept, copies = ([(torch.Size(offsets), torch.Size(sizes), (0, None, narrow)) for (offsets, sizes), narrow
                             in piece_boxes(spec, tp_rank, copies)] for copies in (False, True))
        view._write_runs = kept if writes else []
        view._read_runs = kept + copies
        offsets = [run[0] for run in view._read_runs]
        if len(set(offsets)) != len(offsets):
            raise ValueError(f"'{key}': TP rank {tp_rank} holds two copies of one dense element; DCP cannot load them")
        return view

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} on a DenseView: nxdtp's DCP state dict is only for torch.distributed."
                                  "checkpoint save/load and nxdtp.checkpointing.dcp_state.set_state_dict")

    def __repr__(self) -> str:
        return f"DenseView('{self._key}', dense shape {list(self.shape)}, local shape {list(self._local.shape)})"

    def local_view(self, offsets: torch.Size) -> torch.Tensor:
        """The elements of the local tensor that are the dense chunk at ``offsets`` (a view, detached)."""
        for chunk_offsets, _, (flat_start, box, narrow) in self._write_runs + self._read_runs:
            if chunk_offsets == offsets:
                local = self._local.detach()
                if box is not None:
                    local = local.reshape(-1)[flat_start:flat_start + math.prod(box)].view(box)
                return local if narrow is None else local.narrow(*narrow)
        raise KeyError(f"'{self._key}': this rank holds no chunk of the dense tensor at offsets {list(offsets)}")

    # ---- torch.distributed.checkpoint's _Checkpointable hooks ----

    def __create_write_items__(self, fqn: str, obj: Any):
        return [write_item(fqn, offsets, sizes, self._local.dtype, self.shape)
                for offsets, sizes, _ in self._write_runs]

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=offsets, sizes=sizes) for offsets, sizes, _ in self._read_runs]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        return self.local_view(torch.Size(index.offset))


# ---- get_state_dict --------------------------------------------------------------------------------------------------

def _check(model: nn.Module, optimizer: Any, what: str) -> None:
    if not model_parallel_is_initialized():
        raise RuntimeError("nxdtp.checkpointing.dcp_state needs nxdtp's model parallelism to be initialized "
                           "(nxdtp.parallel_state.initialize_model_parallel)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"{what}: model must be an nn.Module, got {type(model).__name__}")
    from torch.distributed.tensor import DTensor

    dtensors = [name for name, p in model.named_parameters() if isinstance(p, DTensor)]
    if dtensors:
        raise ValueError(f"{what}: '{dtensors[0]}' is a DTensor: the model is parallelized with torch's DTensor, not "
                         "nxdtp; use torch.distributed.checkpoint.state_dict.get_state_dict for it")
    experts = [name for name, p in model.named_parameters() if getattr(p, "expert_model_parallel", False)]
    if experts and expert_parallel_group().size > 1:
        raise NotImplementedError(f"{what}: '{experts[0]}' holds this rank's share of experts split over "
                                  f"expert_model_parallel_size={expert_parallel_group().size} ranks: DCP state of "
                                  "expert-parallel models is not supported yet; save with nxdtp.checkpointing.save "
                                  "(any expert-parallel size) and export it with nxdtp-merge --to dcp")
    tp = tensor_parallel_group().size
    if tp > 1 and not any(isinstance(m, ShardedModule) and any(s.is_sharded for s in m.param_specs().values())
                          for m in model.modules()):
        raise ValueError(f"{what}: the model ({type(model).__name__}) has no nxdtp-sharded parameter, but tensor "
                         f"parallelism is {tp}: it is not parallelized by nxdtp (nxdtp.models.parallelize_model or "
                         "nxdtp.parallelize); its tensors would be saved as if each rank held the whole model")
    if optimizer is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{what}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if is_zero1(optimizer) and not optimizer.inited:
        raise ValueError(f"{what}: the ZeRO-1 optimizer was made with lazy_init=True and has no shards yet; call its "
                         "init_zero() first")
    mine = {id(p) for p in model.parameters()}
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if id(p) not in mine:
                raise ValueError(f"{what}: parameter {i} of the optimizer's param group {g} (shape {list(p.shape)}) is "
                                 f"not a parameter of the model ({type(model).__name__}): the optimizer belongs to "
                                 "another model")
    fused = list(fused_by_position(optimizer, model).values())
    if fused and is_zero1(optimizer):
        # A plain optimizer's state of a fused parameter is offered as its parts' (row blocks, each with its spec);
        # a ZeRO-1 flat shard of it mixes the parts' rows, which no one spec lays out as a dense tensor.
        name, parts = fused[0]
        raise ValueError(f"{what}: the ZeRO-1 optimizer holds '{name}', a fused parameter whose parts "
                         f"{[part for part, _ in parts]} have the specs: its flat shards have no dense layout for DCP. "
                         "Use a plain optimizer (its state is offered as the parts'), build the layer with "
                         "fuse_qkv=False, or save with nxdtp.checkpointing.save (resumable at the same "
                         "tensor-parallel size)")


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Make the state of parameters that have none yet, to load into, as torch does: one step of zero gradients at
    learning rate 0 for those parameters only (gradients put back after); for ZeRO-1, the inner optimizer's."""
    if is_zero1(optimizer):
        pairs = [(shard, p.requires_grad) for p, shard, _ in optimizer.shards()]
        optimizer = optimizer.base_optimizer
    else:
        pairs = [(p, p.requires_grad) for group in optimizer.param_groups for p in group["params"]]
    missing = [p for p, trainable in pairs if trainable and not optimizer.state.get(p)]
    if not missing:
        return
    stashed = [(p, p.grad) for p, _ in pairs]
    for p, _ in pairs:
        p.grad = None
    for p in missing:
        p.grad = torch.zeros_like(p)
    lrs = [group.get("lr") for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr
        for p, grad in stashed:
            p.grad = grad


def _replicated(tensor: torch.Tensor) -> ParamSpec:
    return ParamSpec(full_shape=tuple(tensor.shape))


class _Entry:
    """One parameter of the optimizer: name, groups (for ZeRO-1 also the inner optimizer's), state, for ZeRO-1 its
    ``(layout, shard rank)`` and whether this rank writes the shard (the first of its replica group)."""

    def __init__(self, name, param, groups, state, flat=None, writes_flat=False, owner=None):
        self.name, self.param, self.groups, self.state, self.flat = name, param, groups, state, flat
        self.writes_flat = writes_flat
        self.owner = state if owner is None else owner   # the optimizer's dict that non-tensor values are set in


def _entries(model: nn.Module, optimizer: torch.optim.Optimizer) -> List[_Entry]:
    names = _first_names(model)
    if not is_zero1(optimizer):
        fused = fused_parameters_of(model)
        live = model.state_dict(keep_vars=True) if fused else {}
        entries = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                if id(p) not in fused:
                    entries.append(_Entry(names[id(p)], p, [group], state))
                    continue
                # A fused parameter's state as its parts' (row blocks of its tensors, each with the part's spec):
                # the keys and layout a layer of separate parameters has.
                for part, fields in split_state(state, tuple(p.shape), fused[id(p)][1]):
                    entries.append(_Entry(part, live[part], [group], fields, owner=state))
        return entries
    shards = iter(optimizer.shards())
    shard_rank = optimizer.sharding_group.rank
    writes = optimizer.replica_group.rank == 0
    entries = []
    for group, base_group in zip(optimizer.param_groups, optimizer.base_optimizer.param_groups):
        for p in group["params"]:
            param, shard, layout = next(shards)
            assert param is p
            entries.append(_Entry(names[id(p)], p, [group, base_group], optimizer.base_optimizer.state.get(shard, {}),
                                  (layout, shard_rank), writes))
    return entries


def get_state_dict(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *, lr_scheduler: Any = None,
                   step: Optional[int] = None, ntokens_seen: int = 0) -> Dict[str, Any]:
    """The DCP-ready state of an nxdtp model and optimizer (flattened, under ``optimizer``; ZeRO-1's without masters),
    with ``lr_scheduler`` and ``train_state`` where TorchTitan keeps them. Call on every rank, then ``dcp.save(state,
    ..., process_group=dcp_process_group())``; a fresh optimizer's state is made first."""
    optimizer = unwrap_optimizer(optimizer)
    _check(model, optimizer, "get_state_dict")
    tp, dp_rank = tensor_parallel_group(), data_parallel_group().rank
    specs = sharding_specs(model, tp.size)
    state: Dict[str, Any] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if key.endswith("_extra_state") or not isinstance(tensor, torch.Tensor):
            continue
        spec = specs.get(id(tensor)) or _replicated(tensor)
        state[key] = DenseView(tensor, spec, key, tp.rank, dp_rank == 0)
    for taken in (OPTIMIZER_KEY, LR_SCHEDULER_KEY, TRAIN_STATE_KEY):
        if taken in state:
            raise ValueError(f"get_state_dict: the model has a tensor named '{taken}', a key DCP's layout gives to "
                             "other state")
    if lr_scheduler is not None:
        state[LR_SCHEDULER_KEY] = {"last_epoch": int(lr_scheduler.last_epoch)}
    if step is not None:
        state[TRAIN_STATE_KEY] = {"step": int(step), "ntokens_seen": int(ntokens_seen)}
    if optimizer is None:
        return state
    _init_optimizer_state(optimizer)
    flat: Dict[str, Any] = {}
    for entry in _entries(model, optimizer):
        p = entry.param
        spec = specs.get(id(p)) or _replicated(p)
        for field, value in entry.state.items():
            key = f"{_STATE}.{entry.name}.{field}"
            if not isinstance(value, torch.Tensor):
                flat[key] = value
            elif _laid_out_like_param(value, p, entry.flat):
                # Each ZeRO-1 shard is written once (by its first replica); DP replicas of a whole piece by DP rank 0.
                flat[key] = DenseView(value, spec, f"{OPTIMIZER_KEY}.{key}", tp.rank,
                                      entry.writes_flat if entry.flat is not None else dp_rank == 0, entry.flat)
            else:  # not shaped like the parameter (Adam's 'step'): the same on every rank
                flat[key] = DenseView(value, _replicated(value), f"{OPTIMIZER_KEY}.{key}", tp.rank, dp_rank == 0)
        for hyperparameter, value in entry.groups[0].items():
            if hyperparameter != "params":
                flat[f"{_GROUPS}.{entry.name}.{hyperparameter}"] = value
    state[OPTIMIZER_KEY] = flat
    return state


def _laid_out_like_param(value: torch.Tensor, param: torch.Tensor, flat) -> bool:
    if flat is not None:
        return value.dim() == 1 and value.numel() == flat[0].shard_numel  # not Adam's 0-d 'step'
    return tuple(value.shape) == tuple(param.shape)


def _first_names(model: nn.Module) -> Dict[int, str]:
    """Each parameter's first name in ``named_parameters()`` (torch's name for a tied parameter too)."""
    names: Dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


# ---- set_state_dict --------------------------------------------------------------------------------------------------

def set_state_dict(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], state_dict: Dict[str, Any], *,
                   lr_scheduler: Any = None) -> Dict[str, Any]:
    """Restore ``get_state_dict``'s state after ``dcp.load`` into the model, optimizer and ``lr_scheduler``; return its
    ``train_state`` (or ``{}``). Strict: a missing or unknown key, or another model's DenseView, raises before
    anything changes."""
    optimizer = unwrap_optimizer(optimizer)
    _check(model, optimizer, "set_state_dict")
    tp = tensor_parallel_group()
    specs = sharding_specs(model, tp.size)
    copies: List[Tuple[torch.Tensor, Any, Optional[ParamSpec], str]] = []
    live = {k: v for k, v in model.state_dict(keep_vars=True).items()
            if not k.endswith("_extra_state") and isinstance(v, torch.Tensor)}
    model_keys = {k for k in state_dict if k not in (OPTIMIZER_KEY, LR_SCHEDULER_KEY, TRAIN_STATE_KEY)}
    if model_keys != set(live):
        raise KeyError(f"set_state_dict: the state dict's model keys differ from the model's: missing "
                       f"{sorted(set(live) - model_keys)[:5]}, unexpected {sorted(model_keys - set(live))[:5]}")
    for key, tensor in live.items():
        copies.append((tensor, state_dict[key], specs.get(id(tensor)), key))
    settings: List[Tuple[Dict[str, Any], str, Any]] = []
    if optimizer is not None:
        _plan_optimizer_restore(model, optimizer, state_dict, specs, copies, settings)
    if lr_scheduler is not None:
        scheduler_state = state_dict.get(LR_SCHEDULER_KEY)
        if not isinstance(scheduler_state, dict) or "last_epoch" not in scheduler_state:
            raise KeyError(f"set_state_dict: lr_scheduler given, but the state dict has no '{LR_SCHEDULER_KEY}."
                           "last_epoch' (pass lr_scheduler to get_state_dict too)")
    pending = [(tensor, _local_value(value, tensor, spec, tp.rank, key)) for tensor, value, spec, key in copies]
    with torch.no_grad():
        for tensor, value in pending:
            if value is not None:
                tensor.copy_(value)
    for target, field, value in settings:
        target[field] = value
    if optimizer is not None and is_zero1(optimizer):
        optimizer.masters_from_parameters()
    if lr_scheduler is not None:
        lr_scheduler.last_epoch = int(scheduler_state["last_epoch"])
        # The groups' learning rates came with the optimizer state: they are the schedule's at last_epoch.
        lr_scheduler._last_lr = [group["lr"] for group in lr_scheduler.optimizer.param_groups]
    return dict(state_dict.get(TRAIN_STATE_KEY) or {})


def _plan_optimizer_restore(model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any],
                            specs: Dict[int, ParamSpec], copies: list, settings: list) -> None:
    """Add to ``copies`` the optimizer's tensors to fill from ``state_dict`` (with the spec that cuts a dense value)
    and to ``settings`` its non-tensor state and hyperparameters; raise before anything changes if the keys differ."""
    flat = state_dict.get(OPTIMIZER_KEY)
    if not isinstance(flat, dict):
        raise KeyError(f"set_state_dict: the state dict has no '{OPTIMIZER_KEY}' entry (get_state_dict(model, "
                       "optimizer) makes it)")
    _init_optimizer_state(optimizer)
    expected = set()
    for entry in _entries(model, optimizer):
        for field, current in entry.state.items():
            key = f"{_STATE}.{entry.name}.{field}"
            expected.add(key)
            if key not in flat:
                continue
            if isinstance(current, torch.Tensor):
                spec = None if entry.flat is not None else specs.get(id(entry.param))
                if spec is not None and tuple(current.shape) != tuple(entry.param.shape):
                    spec = None
                copies.append((current, flat[key], spec, f"{OPTIMIZER_KEY}.{key}"))
            else:
                settings.append((entry.owner, field, flat[key]))
        for hyperparameter in entry.groups[0]:
            if hyperparameter != "params":
                key = f"{_GROUPS}.{entry.name}.{hyperparameter}"
                expected.add(key)
                if key in flat:
                    settings.extend((group, hyperparameter, flat[key]) for group in entry.groups)
    if set(flat) != expected:
        raise KeyError(f"set_state_dict: the optimizer state's keys differ from the optimizer's: missing "
                       f"{sorted(expected - set(flat))[:5]}, unexpected {sorted(set(flat) - expected)[:5]}")


def _local_value(value: Any, tensor: torch.Tensor, spec: Optional[ParamSpec], tp_rank: int, key: str
                 ) -> Optional[torch.Tensor]:
    """What to copy into the live ``tensor`` for ``value``: nothing for a DenseView of it (DCP loaded it in place),
    this rank's cut of a dense tensor."""
    if isinstance(value, DenseView):
        if not _same_tensor(value._local, tensor):
            raise ValueError(f"set_state_dict: '{key}' is a DenseView of another tensor than this model's (a state "
                             "dict of another model or optimizer?); call get_state_dict(model, optimizer) on these")
        return None
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"set_state_dict: '{key}' is a {type(value).__name__}, expected a tensor")
    if spec is None or not spec.is_sharded:
        if tuple(value.shape) != tuple(tensor.shape):
            raise ValueError(f"set_state_dict: '{key}' has shape {list(value.shape)}, expected {list(tensor.shape)}")
        return value
    if tuple(value.shape) != tuple(spec.unpadded_shape):
        raise ValueError(f"set_state_dict: '{key}' has shape {list(value.shape)}, expected the dense shape "
                         f"{list(spec.unpadded_shape)}")
    full = spec.full_from_dense(value.to(tensor.device))
    return spec.piece_of_full(full, tp_rank)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` is ``b``, or a view of the same elements (a fused parameter's state is offered as row blocks, made anew
    by each call)."""
    return a is b or (a.device == b.device and a.dtype == b.dtype and a.data_ptr() == b.data_ptr()
                      and a.shape == b.shape and a.stride() == b.stride())

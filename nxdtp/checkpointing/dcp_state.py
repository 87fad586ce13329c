"""torch.distributed.checkpoint (DCP) inside a running nxdtp job: the model's and the optimizer's state as a DCP-ready
state dict, so torch's own ``dcp.save`` / ``dcp.load`` work on it directly.

``get_state_dict(model, optimizer=None)`` returns what a native job hands to ``dcp.save``, in TorchTitan's layout (the
one ``nxdtp-merge --to dcp`` writes): the model's tensors at the top level under the dense Hugging Face names, the
optimizer state under ``optimizer`` keyed as torch's ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=
True)`` keys it (``state.<param>.<field>``, ``param_groups.<param>.<hyperparameter>``). Every tensor is a
``DenseView``: a tensor of the dense (real, unpadded) global shape that holds no data of its own, only this rank's
live local tensor and where its elements lie in the dense tensor. It implements the hooks DCP asks every tensor for
(``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``: torch's ``_Checkpointable``
protocol, which DTensor and torch's ``LocalShardsWrapper`` implement too), so torch's default planners, storage
writers and readers need nothing from nxdtp:

* saving, a rank plans one chunk per run of rows its piece contributes to the dense tensor
  (``ParamSpec.dense_runs_of_piece``: a fused stride-3 weight is three chunks per rank, vocabulary padding and zero
  heads are left out, a repeated KV head is written by its first owner only). Only DP rank 0 plans any (its DP replicas
  hold the same values), and a tensor replicated over TP is written by TP rank 0. A ZeRO-1 optimizer's state is each
  rank's flat shard of its TP piece, cut into boxes of the dense tensor (``dense_chunks_of_flat_shard``), written once
  per shard (by the first rank of its replica group, under hybrid sharding). The checkpoint is the one ``nxdtp-merge
  --to dcp`` writes from an nxdtp checkpoint (same keys, global shapes and dtypes), so a dense model, a DTensor TP model
  at any size or nxdtp at any TP size loads it;
* loading, every rank asks for every dense element its piece (or shard) holds, the copies of repeated blocks
  included (``ParamSpec.copy_runs_of_piece``), and DCP reads them straight into the live parameters and optimizer
  state (views of them). ``set_state_dict`` then applies what DCP hands back as values (the hyperparameters,
  non-tensor state) and cuts a ZeRO-1 optimizer's master weights afresh from the loaded model.

DCP's own collectives (gathering the plans) run on host objects: on an NCCL or XLA world pass
``process_group=dcp_process_group()`` (nxdtp's gloo group of every rank) to ``dcp.save`` / ``dcp.load``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import comm
from ..parallel_state import data_parallel_group, model_parallel_is_initialized, tensor_parallel_group
from ..spec import FlatShardLayout, ParamSpec, ShardedModule, dense_chunks_of_flat_shard
from .dcp_export import LR_SCHEDULER_KEY, OPTIMIZER_KEY, TRAIN_STATE_KEY, piece_chunks
from .fused_state import fused_by_position, fused_parameters_of, split_state
from .save_load import sharding_specs
from .unwrap import is_zero1, unwrap_optimizer

__all__ = ["get_state_dict", "set_state_dict", "dcp_process_group", "DenseView", "OPTIMIZER_KEY", "LR_SCHEDULER_KEY",
           "TRAIN_STATE_KEY"]

_STATE, _GROUPS = "state", "param_groups"

# One chunk: (offsets, sizes) in the dense tensor, and where it is in the local tensor: (flat_start, box_sizes, narrow):
# the local tensor's elements [flat_start, ...) seen as box_sizes (box_sizes None: the local tensor as it is), then
# narrowed by (dim, start, length) (None: all of it).
_How = Tuple[int, Optional[Tuple[int, ...]], Optional[Tuple[int, int, int]]]
_Run = Tuple[torch.Size, torch.Size, _How]


def dcp_process_group():
    """The process group to pass as ``process_group=`` to ``dcp.save`` / ``dcp.load`` in an nxdtp job: a gloo group of
    every rank where the world's default backend refuses CPU objects (NCCL, XLA), None (the default group) on a gloo
    world. DCP gathers its plans and metadata as pickled host objects over it."""
    return comm.host_process_group()


class DenseView(torch.Tensor):
    """A tensor of the dense global shape standing for this rank's part of it in DCP (module docstring). It holds a
    reference to the live local tensor (a parameter, an optimizer state tensor, a ZeRO-1 flat shard of one), so a save
    reads the values current at ``dcp.save`` and a load writes into it. It supports no tensor operations: it is only
    for ``dcp.save`` / ``dcp.load`` and ``set_state_dict``."""

    _local: torch.Tensor
    _key: str
    _write_runs: List[_Run]
    _read_runs: List[_Run]

    @staticmethod
    def __new__(cls, local: torch.Tensor, spec: ParamSpec, key: str, tp_rank: int, writes: bool,
                flat: Optional[Tuple[FlatShardLayout, int]] = None):
        """``spec``: how the TP-local tensor (``local``, or with ``flat = (layout, shard_rank)`` the tensor whose
        flat shard ``local`` is) lies in the dense one; ``writes``: whether this rank writes its kept chunks."""
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
            kept, copies = ([_run(chunk) for chunk in piece_chunks(spec, tp_rank, copies)] for copies in (False, True))
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
                    numel = 1
                    for size in box:
                        numel *= size
                    local = local.reshape(-1)[flat_start:flat_start + numel].view(box)
                return local if narrow is None else local.narrow(*narrow)
        raise KeyError(f"'{self._key}': this rank holds no chunk of the dense tensor at offsets {list(offsets)}")

    # ---- torch.distributed.checkpoint's _Checkpointable hooks ----

    def __create_write_items__(self, fqn: str, obj: Any):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        properties = TensorProperties(dtype=self._local.dtype)
        return [WriteItem(index=MetadataIndex(fqn=fqn, offset=offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                                      properties=properties, size=self.shape))
                for offsets, sizes, _ in self._write_runs]

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=offsets, sizes=sizes) for offsets, sizes, _ in self._read_runs]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        return self.local_view(torch.Size(index.offset))


def _run(chunk) -> _Run:
    """A chunk of ``piece_chunks`` as DenseView keeps it: where it lies in the dense tensor and in the local one."""
    offsets, sizes, box = chunk
    narrow = next(((dim, start, length) for dim, (start, length) in box.items()), None)
    return torch.Size(offsets), torch.Size(sizes), (0, None, narrow)


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
    """Parameters that have no optimizer state yet (a fresh optimizer) have nothing to load into: make it, as torch's
    get_optimizer_state_dict does, with a step of zero gradients at learning rate 0 (the parameters do not change; the
    state is overwritten by the load). Only those parameters get a gradient in that step, so existing state is left
    alone, and the gradients are put back afterwards. For ZeRO-1, the inner optimizer over the shards (no
    collectives)."""
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
    """One parameter of the optimizer: its name, its groups (the optimizer's, and for ZeRO-1 the inner optimizer's,
    which both carry the hyperparameters), the dict of its state, for ZeRO-1 its shard layout and this rank's shard,
    and whether this rank writes its flat state (ZeRO-1: the first rank of its replica group, which holds the same
    shard under hybrid sharding)."""

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
    """The DCP-ready state of an nxdtp model and its optimizer (module docstring): the model's ``state_dict()`` names at
    the top level (each tied name, as the dense model has them) and, with an optimizer, its flattened state under
    ``"optimizer"``. Where TorchTitan (and ``--to dcp``) keep them: with ``lr_scheduler``, its ``last_epoch`` under
    ``lr_scheduler``; with ``step``, ``train_state`` = ``{"step": step, "ntokens_seen": ntokens_seen}``. Call it on
    every rank, then ``dcp.save(state, checkpoint_id=..., process_group=dcp_process_group())``; to load, ``dcp.load``
    the same dict, then ``set_state_dict``. A fresh optimizer's state is made first (one step of zero gradients at
    learning rate 0, as torch does). A ZeRO-1 optimizer's state is offered as the dense optimizer's (each rank's flat
    shards as their chunks of the dense tensors); its fp32 master weights are not (they are the model's weights:
    ``set_state_dict`` cuts them afresh from the loaded model)."""
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
    """Restore ``state_dict`` into the model and optimizer (and ``lr_scheduler``'s ``last_epoch``, from the state dict's
    ``lr_scheduler``); return its ``train_state`` (``{"step": ..., "ntokens_seen": ...}``, or ``{}``). It is normally
    the dict ``get_state_dict(model, optimizer, ...)`` gave, after ``dcp.load`` filled it: its DenseViews were loaded in
    place, and this applies the rest (hyperparameters, non-tensor optimizer state, which DCP hands back as values; a
    ZeRO-1 optimizer's master weights, cut afresh from the loaded model). A plain tensor of the dense shape under a
    model key (or a non-ZeRO optimizer key) is cut as the layout algebra lays that tensor out and copied in. Strict: a
    missing or unknown key, or a DenseView of another model's tensor, raises before anything is changed."""
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

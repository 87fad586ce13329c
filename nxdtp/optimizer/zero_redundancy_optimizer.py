"""ZeRO-1: optimizer state and fp32 master weights sharded over data parallelism (NxD's ``NeuronZero1Optimizer``).

Every rank of a data-parallel group holds the whole TP-local model, as in plain DP, but only 1/d of the optimizer:
the master weights (in ``optimizer_dtype``, fp32 by default, also for bf16 parameters) and the inner optimizer's state
for its shard of every parameter, where d is the size of its sharding group. The sharding group is the DP group by
default (d = dp); any DP-aligned sharding (``sharding_groups`` cutting every DP group into groups of one size k) shards
over k ranks and keeps dp / k replicas of each shard, one in each k-group of a DP group (hybrid sharding, as HSDP):
the replica group of a rank is the ranks of its DP group that hold the same shard. One step, the same code for every
shape (the DP sharding is k = dp with replica groups of one rank, which communicate nothing):

1. the gradients are reduce-scattered over the sharding group, the shards all-reduced over the replica group (the
   two sum over the whole DP group) and divided by the DP size (the DP average; in ``optimizer_dtype`` when
   ``higher_cc_precision``): each rank gets the averaged gradient of its shards;
2. the pre-clip norm of the whole model over TP x DP, with ``nxdtp.grads.get_grad_norm``'s rules (TP-sharded shards
   counted on every TP rank, TP-replicated ones once, ``shared`` ones skipped), summed over the sharding group only
   (its shards make every parameter once; each replica computes the same norm); it is kept in ``grad_norm``; the
   shard gradients are scaled by ``min(1, max_norm / (norm + 1e-6))`` (as ``clip_grad_norm_``);
3. the inner optimizer (any ``torch.optim.Optimizer`` class: AdamW, SGD, nxdtp's Lamb, ...) steps the master shards;
4. the shards are all-gathered (in the parameters' dtype, or ``optimizer_dtype`` when ``higher_cc_precision``) and
   copied into the parameters.

With expert parallelism, the parameters of the experts (marked ``expert_model_parallel``) are sharded over the expert
data-parallel group instead, the ranks that hold the same experts (an expert's gradient, made from the tokens of its
whole expert-parallel group, exists only there), with no replicas; their gradients are still divided by the DP size.
Summed over the DP group, the norm then counts every shard of every expert once. Only the default sharding (the DP
groups) is supported there, and the state of expert shards is not checkpointed yet (``state_dict`` refuses it).

The shard layout (``nxdtp.spec.FlatShardLayout``) is per parameter, flattened: each TP-local parameter is flattened,
zero-padded at its end to a multiple of the group size d and cut into d contiguous chunks; rank r holds chunk r.
Why this one rather than NxD's dim-0 cut or Megatron's flat buckets:

* padding is below d elements per parameter whatever its shape (a dim-0 cut pads a ``[1, h]`` or ``[h]``-by-few tensor
  up to d rows, and is impossible to balance for dim 0 < d), so the state is 1/d of plain AdamW's to within a few bytes;
* the inner optimizer still sees one tensor per parameter, with the parameter's group and hyper-parameters and TP
  attributes: per-tensor optimizers (Lamb's trust ratio, which sums the shards' norms over the group) work, and the
  checkpoint state of a parameter is the concatenation of its shards (resharding over DP is a cut of one flat vector);
* the collectives are still bucketed as Megatron's: the shards of several parameters are the rows
  ``[d, shard_numel]`` of each, concatenated along dim 1, so one reduce-scatter (and one all-gather) along dim 0 moves a
  whole bucket, the same bytes on the wire as plain DP's one all-reduce, and every rank slices the result at the same
  offsets (no rank-dependent slice: one XLA graph for every rank). Flat buckets would put different parameters'
  pieces on different ranks, so per-parameter views of a shard would be rank-dependent slices.

The only rank-dependent operation is taking this rank's shard of a parameter when the master weights are made, which
selects with the rank as data (``parallel_state.rank_tensor``), so that too traces one graph on every rank. All
communication goes through ``nxdtp.comm``: XLA replica groups, NCCL (or another device backend), gloo for CPU tensors.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import comm
from ..grads import buckets_by, checked_norm_type, clip_grads_with_norm, get_grad_norm
from ..spec import FlatShardLayout
from ..topology import (
    ParallelGroup,
    expert_data_parallel_group,
    expert_parallel_group,
    get_topology,
    model_parallel_is_initialized,
    rank_tensor,
    tensor_parallel_group,
    zero1_groups,
)

# Attributes of a parameter that its shard carries, so the norm rules (and Lamb) treat the shard as the parameter.
_COPIED_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "num_partitions", "num_replicas",
                      "shared", "sequence_parallel_enabled", "expert_model_parallel")
# Bucket size (MiB) of the coalesced reduce-scatter and all-gather when NxD's bucket_cap_mb_* is 0 (its default).
DEFAULT_BUCKET_CAP_MB = 512
ZERO1_STATE_FORMAT = 1


def _replica_weights(param: torch.Tensor, layout: FlatShardLayout, segments, rank: torch.Tensor) -> torch.Tensor:
    """For a parameter whose row segments the TP group holds different numbers of times (``replica_segments``: a
    fused Q|K|V with repeated KV heads), 1 / copies for each element of this rank's shard, cut as the shard is with
    the rank as data (one graph for every rank); 0 on the padding. The norm rules weigh the shard's elements by it,
    since a flat shard has no rows to segment."""
    per_row = torch.cat([torch.full((rows,), 1.0 / copies, dtype=torch.float32, device=param.device)
                         for rows, copies in segments])
    per_element = per_row[:, None].expand(param.shape[0], param[0].numel()).reshape(param.shape)
    return layout.rows(per_element).index_select(0, rank).reshape(-1)


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"NeuronZero1Optimizer: {name}={value!r} must be True or False")
    return value


def _check_cap(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"NeuronZero1Optimizer: {name}={value!r} must be a number of MiB >= 0 (0: nxdtp's default "
                         f"bucket of {DEFAULT_BUCKET_CAP_MB} MiB)")
    return float(value) if value > 0 else float(DEFAULT_BUCKET_CAP_MB)


def _check_shardable(params) -> None:
    for p in params:
        if p.is_sparse:
            raise ValueError(f"NeuronZero1Optimizer: a sparse parameter of shape {tuple(p.shape)} cannot be sharded")


def _is_expert(param: torch.Tensor) -> bool:
    return getattr(param, "expert_model_parallel", False) and expert_parallel_group().size > 1


class NeuronZero1Optimizer(torch.optim.Optimizer):
    """ZeRO-1 over ``optimizer_class`` (NxD 2.29's signature plus torch_xla's keywords; see the module docstring).

    ``params``: parameters or parameter groups (each group keeps its own hyper-parameters; ``**defaults`` go to
    ``optimizer_class``). ``optimizer_dtype``: the dtype of the master shards and the optimizer state (fp32 when None).
    ``grad_clipping`` / ``max_norm``: clip at ``max_norm`` (1.0 when None) by the global pre-clip norm of type
    ``norm_type`` (an nxdtp keyword: 2 as NxD, or any p > 0 and inf); ``grad_norm`` holds that norm after each step
    (None without clipping, as in NxD). ``sharding_groups``: None (the data-parallel groups, NxD's default) or any
    DP-aligned groups as lists of global ranks (``parallel_state.dp_aligned_rank_lists``: they cut every DP group into
    groups of one size k; the state is sharded over k ranks and replicated over the dp / k groups of a DP group).
    Other groups are refused, naming them and what would be valid. ``grad_norm_groups``: None or the tensor-parallel
    groups (the norm is always taken over TP x DP).
    ``lazy_init``: make the shards at ``init_zero()`` instead of now. ``bucket_cap_mb_reduce_scatter`` /
    ``bucket_cap_mb_all_gather``: bucket sizes of the coalesced collectives (0: 512 MiB). ``use_grad_acc_hook``:
    gradients accumulate over micro-steps into an fp32 (``optimizer_dtype``) ``main_grad`` of every parameter, and
    ``.grad`` stays None. ``higher_cc_precision``: reduce-scatter and all-gather in ``optimizer_dtype``.
    ``save_master_weights``: accepted; nxdtp always puts the master shards in ``state_dict()``, so that a resume never
    depends on whether the model or the optimizer was loaded first. ``pin_layout`` and ``coalesce_cc`` are accepted for
    NxD compatibility and change nothing (nxdtp's collectives are native and always coalesced).

    Every rank of the world must call ``step()`` with the same parameters having gradients (it communicates over the
    sharding and TP groups).
    """

    # Read by nxdtp.checkpointing, which sits below the optimizers and so tells this state's kind by it, not by class.
    shards_state_over_data_parallel = True

    def __init__(self, params, optimizer_class, optimizer_dtype: Optional[torch.dtype] = None,
                 grad_clipping: bool = True, max_norm: Optional[float] = None, pin_layout: bool = True,
                 sharding_groups: Any = None, grad_norm_groups: Any = None, lazy_init: bool = False,
                 bucket_cap_mb_all_gather: float = 0, bucket_cap_mb_reduce_scatter: float = 0,
                 use_grad_acc_hook: bool = False, save_master_weights: bool = False,
                 higher_cc_precision: bool = False, coalesce_cc: bool = False, norm_type: float = 2.0, **defaults):
        if not model_parallel_is_initialized():
            raise RuntimeError("NeuronZero1Optimizer needs an installed topology: call "
                               "nxdtp.parallel_state.initialize_model_parallel(...) first")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"NeuronZero1Optimizer: optimizer_class={optimizer_class!r} must be a "
                            "torch.optim.Optimizer subclass (torch.optim.AdamW, torch.optim.SGD, "
                            "nxdtp.optimizer.Lamb, ...)")
        if optimizer_dtype is None:
            optimizer_dtype = torch.float32
        if not isinstance(optimizer_dtype, torch.dtype) or not optimizer_dtype.is_floating_point:
            raise ValueError(f"NeuronZero1Optimizer: optimizer_dtype={optimizer_dtype!r} must be a floating "
                             "torch dtype (torch.float32, the default, for fp32 master weights)")
        self.grad_clipping = _check_bool("grad_clipping", grad_clipping)
        self.max_norm = 1.0 if max_norm is None else float(max_norm)
        if self.grad_clipping and not self.max_norm > 0:
            raise ValueError(f"NeuronZero1Optimizer: max_norm={max_norm!r} must be > 0 (or None for 1.0)")
        self.norm_type = checked_norm_type(norm_type)
        self.pin_layout = _check_bool("pin_layout", pin_layout)
        self.lazy_init = _check_bool("lazy_init", lazy_init)
        self.use_grad_acc_hook = _check_bool("use_grad_acc_hook", use_grad_acc_hook)
        self.save_master_weights = _check_bool("save_master_weights", save_master_weights)
        self.higher_cc_precision = _check_bool("higher_cc_precision", higher_cc_precision)
        self.coalesce_cc = _check_bool("coalesce_cc", coalesce_cc)
        self.bucket_cap_mb_all_gather = _check_cap("bucket_cap_mb_all_gather", bucket_cap_mb_all_gather)
        self.bucket_cap_mb_reduce_scatter = _check_cap("bucket_cap_mb_reduce_scatter", bucket_cap_mb_reduce_scatter)
        # Made collectively (every rank builds its optimizer at the same point) the first time a sharding is asked for.
        self._group, self._replicas = zero1_groups(sharding_groups)
        if grad_norm_groups is not None:
            tp = tensor_parallel_group()
            try:
                ok = sorted(sorted(g) for g in grad_norm_groups) == sorted(tp.replica_groups_as_lists())
            except TypeError:
                ok = False
            if not ok:
                raise ValueError(f"NeuronZero1Optimizer: grad_norm_groups={grad_norm_groups!r} is not supported; the "
                                 "norm is always taken over TP x DP: pass None or the tensor-parallel groups "
                                 f"{tp.replica_groups_as_lists()}")
        self.optimizer_class = optimizer_class
        self.optimizer_dtype = optimizer_dtype
        self._sharding_groups = self._group.replica_groups_as_lists()
        self._grad_norm_groups = grad_norm_groups
        self._grad_norm: Optional[torch.Tensor] = None
        self.inited = False
        self.base_optimizer: Optional[torch.optim.Optimizer] = None
        self._layouts: Dict[int, FlatShardLayout] = {}
        self._hooks: List[Any] = []
        super().__init__(params, defaults)
        _check_shardable(p for group in self.param_groups for p in group["params"])
        self._expert_groups = self._expert_sharding()
        if not self.lazy_init:
            self.init_zero()

    # ---- NxD's attributes ----------------------------------------------------------------------------------------

    @property
    def grad_norm(self) -> Optional[torch.Tensor]:
        """The global pre-clip gradient norm of the last step (a 0-dim fp32 tensor), None before it or without
        clipping."""
        return self._grad_norm

    @property
    def sharding_groups(self) -> List[List[int]]:
        return self._sharding_groups

    @property
    def sharding_group(self) -> ParallelGroup:
        return self._group

    @property
    def replica_group(self) -> ParallelGroup:
        """The ranks of this rank's DP group that hold the same shards (this rank alone when sharding over DP)."""
        return self._replicas

    # ---- shards --------------------------------------------------------------------------------------------------

    def _expert_sharding(self) -> Optional[Tuple[ParallelGroup, ParallelGroup]]:
        """With expert parallelism, the (sharding, replica) groups of expert parameters: the expert data-parallel group
        and this rank alone. An expert's gradient comes from its whole expert-parallel group's tokens but lives only on
        the ranks holding that expert, so it is summed over them (and divided by the DP size, as every gradient)."""
        if not any(_is_expert(p) for p in self._params()):
            return None
        topology = get_topology()
        if self._group != topology.data_parallel:
            raise NotImplementedError(
                f"NeuronZero1Optimizer: sharding_groups={self._sharding_groups!r} with expert parallelism "
                f"(expert_model_parallel_size={expert_parallel_group().size}): only the default sharding over the "
                "data-parallel groups is supported there")
        return expert_data_parallel_group(), topology.singleton

    def _groups_of(self, param: torch.Tensor) -> Tuple[ParallelGroup, ParallelGroup]:
        """(sharding group, replica group) of ``param``'s master shard."""
        if self._expert_groups is not None and _is_expert(param):
            return self._expert_groups
        return self._group, self._replicas

    def _refuse_expert_state(self, what: str) -> None:
        if self._expert_groups is not None:
            raise NotImplementedError(
                f"NeuronZero1Optimizer.{what}: the state of expert parameters sharded over the expert data-parallel "
                "group is not saved yet (nxdtp checkpoints store the model's experts at any expert-parallel size, "
                "ZeRO-1's expert shards not); save the model alone (save({'model': model})), or train at "
                "expert_model_parallel_size=1 to checkpoint ZeRO-1 state")

    def _make_shard(self, param: torch.Tensor) -> torch.Tensor:
        group = self._groups_of(param)[0]
        layout = FlatShardLayout(tuple(param.shape), group.size)
        self._layouts[id(param)] = layout
        with torch.no_grad():
            rows = layout.rows(param.detach())
            # This rank's row, chosen with the rank as data: the same graph on every rank.
            shard = rows.index_select(0, rank_tensor(group, param.device)).reshape(-1)
            shard = shard.to(self.optimizer_dtype).clone()
        for name in _COPIED_ATTRIBUTES:
            if hasattr(param, name):
                setattr(shard, name, getattr(param, name))
        segments = getattr(param, "replica_segments", None)
        if segments is not None:
            shard.replica_weights = _replica_weights(param, layout, segments, rank_tensor(group, param.device))
        shard.zero1_sharding_group = group
        return shard

    def init_zero(self) -> None:
        """Make the master shards and the inner optimizer (called by the constructor unless ``lazy_init``)."""
        self._remove_hooks()
        self._layouts = {}
        base_groups = []
        for group in self.param_groups:
            base_group = {k: v for k, v in group.items() if k != "params"}
            base_group["params"] = [self._make_shard(p) for p in group["params"]]
            base_groups.append(base_group)
        self.base_optimizer = self.optimizer_class(base_groups, **self.defaults)
        # The wrapper shows the inner optimizer's full hyper-parameters (its defaults filled in).
        for group, base_group in zip(self.param_groups, self.base_optimizer.param_groups):
            for key, value in base_group.items():
                if key != "params":
                    group.setdefault(key, value)
        if self.use_grad_acc_hook:
            for p in self._params():
                if p.requires_grad:
                    p.main_grad = torch.zeros(p.shape, dtype=self.optimizer_dtype, device=p.device)
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulate))
        self.inited = True

    @staticmethod
    @torch.no_grad()
    def _accumulate(param: torch.Tensor) -> None:
        param.main_grad.add_(param.grad)
        param.grad = None

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _params(self) -> List[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _pairs(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        return [(p, s) for group, base_group in zip(self.param_groups, self.base_optimizer.param_groups)
                for p, s in zip(group["params"], base_group["params"])]

    def _gradient(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        if self.use_grad_acc_hook:
            return getattr(param, "main_grad", None)
        return param.grad

    def _sync_hyper_parameters(self, source, destination) -> None:
        for src, dst in zip(source, destination):
            for key, value in src.items():
                if key != "params":
                    dst[key] = value

    # ---- the step ------------------------------------------------------------------------------------------------

    def _reduce_scatter_gradients(self, pairs) -> None:
        """Average the gradients over the DP group, each rank keeping the shard of its master weights: a reduce-scatter
        over the sharding group, then an all-reduce of the shards over the replica group (nothing when it is this rank
        alone)."""
        size = self._group.size * self._replicas.size

        def cc_dtype(pair):
            return self.optimizer_dtype if self.higher_cc_precision else self._gradient(pair[0]).dtype

        def nbytes(pair):
            return self._layouts[id(pair[0])].padded_numel * torch.empty((), dtype=cc_dtype(pair)).element_size()

        cap = self.bucket_cap_mb_reduce_scatter * 1024 * 1024
        key = lambda pair: (self._gradient(pair[0]).device, cc_dtype(pair), _is_expert(pair[0]))  # noqa: E731
        for bucket in buckets_by(pairs, nbytes, key, cap):
            dtype = cc_dtype(bucket[0])
            group, replicas = self._groups_of(bucket[0][0])
            rows = torch.cat([self._layouts[id(p)].rows(self._gradient(p).detach().to(dtype)) for p, _ in bucket],
                             dim=1)
            reduced = comm.reduce_scatter(rows, group, dim=0).reshape(-1)
            reduced = comm.all_reduce(reduced, replicas).to(self.optimizer_dtype)
            if size != 1:
                reduced = reduced / size
            offset = 0
            for _, shard in bucket:
                n = shard.numel()
                shard.grad = reduced[offset:offset + n]
                offset += n

    def _all_gather_parameters(self, pairs) -> None:
        """Copy the master shards, gathered over the sharding group, into the parameters."""

        def ag_dtype(pair):
            return self.optimizer_dtype if self.higher_cc_precision else pair[0].dtype

        def nbytes(pair):
            return self._layouts[id(pair[0])].padded_numel * torch.empty((), dtype=ag_dtype(pair)).element_size()

        cap = self.bucket_cap_mb_all_gather * 1024 * 1024
        for bucket in buckets_by(pairs, nbytes, lambda pair: (pair[0].device, ag_dtype(pair), _is_expert(pair[0])),
                                 cap):
            dtype = ag_dtype(bucket[0])
            packed = torch.cat([s.detach().to(dtype).reshape(1, -1) for _, s in bucket], dim=1)
            gathered = comm.all_gather(packed, self._groups_of(bucket[0][0])[0], dim=0)
            offset = 0
            for p, s in bucket:
                n = s.numel()
                full = self._layouts[id(p)].full_from_rows(gathered[:, offset:offset + n])
                p.detach().copy_(full)
                offset += n

    @torch.no_grad()
    def step(self, closure=None):
        if not self.inited:
            raise RuntimeError("NeuronZero1Optimizer was made with lazy_init=True: call init_zero() before step()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # An LR scheduler (or the user) changes the wrapper's groups: the inner optimizer follows.
        self._sync_hyper_parameters(self.param_groups, self.base_optimizer.param_groups)
        pairs = [(p, s) for p, s in self._pairs() if self._gradient(p) is not None]
        for p, _ in pairs:
            if self._gradient(p).is_sparse:
                raise RuntimeError("NeuronZero1Optimizer does not support sparse gradients")
        self._reduce_scatter_gradients(pairs)
        shards = [s for _, s in pairs]
        if self.grad_clipping and shards:
            self._grad_norm = get_grad_norm(shards, self.norm_type, zero1_optimizer=True,
                                            zero1_optimizer_groups=self._group)
            clip_grads_with_norm(shards, self._grad_norm, self.max_norm)
        self.base_optimizer.step()
        self.base_optimizer.zero_grad(set_to_none=True)
        self._all_gather_parameters(pairs)
        self._sync_hyper_parameters(self.base_optimizer.param_groups, self.param_groups)
        return loss

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Reset the parameters' gradients (kept as zeros unless ``set_to_none``, NxD's default) and ``main_grad``."""
        super().zero_grad(set_to_none=set_to_none)
        if self.use_grad_acc_hook:
            for p in self._params():
                if hasattr(p, "main_grad"):
                    p.main_grad.zero_()

    # ---- memory accounting ---------------------------------------------------------------------------------------

    def state_bytes(self) -> Dict[str, int]:
        """This rank's bytes held by the optimizer: ``"state"`` (the inner optimizer's state over the shards),
        ``"master"`` (the master shards) and ``"main_grad"`` (the fp32 accumulators of ``use_grad_acc_hook``)."""
        state = sum(v.numel() * v.element_size() for st in self.base_optimizer.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor))
        master = sum(s.numel() * s.element_size() for _, s in self._pairs())
        main = sum(p.main_grad.numel() * p.main_grad.element_size() for p in self._params()
                   if hasattr(p, "main_grad"))
        return {"state": state, "master": master, "main_grad": main}

    # ---- what checkpoint converters need ---------------------------------------------------------------------------

    def shards(self) -> List[Tuple[torch.Tensor, torch.Tensor, FlatShardLayout]]:
        """``(parameter, its master shard, its FlatShardLayout)`` for every parameter, in param-group order. The inner
        optimizer (``base_optimizer``) keys its state by the shards."""
        if not self.inited:
            raise RuntimeError("NeuronZero1Optimizer.shards(): call init_zero() first (lazy_init=True)")
        self._refuse_expert_state("shards()")
        return [(p, s, self._layouts[id(p)]) for p, s in self._pairs()]

    def masters_from_parameters(self) -> None:
        """Cut the master shards afresh from the parameters as they are now: after the model's weights were loaded
        by something else than ``load_state_dict`` (a DCP load), which the masters would otherwise overwrite at the
        next step."""
        with torch.no_grad():
            for p, s in self._pairs():
                s.copy_(self._make_shard(p))

    # ---- state dict ----------------------------------------------------------------------------------------------

    def _layout_info(self) -> Dict[str, Any]:
        return {"format": ZERO1_STATE_FORMAT, "sharding_group_size": self._group.size,
                "sharding_rank": self._group.rank, "replica_group_size": self._replicas.size,
                "replica_rank": self._replicas.rank, "optimizer_dtype": str(self.optimizer_dtype).replace("torch.", ""),
                "layouts": [self._layouts[id(p)].to_dict() for p in self._params()]}

    def state_dict(self) -> Dict[str, Any]:
        """NxD's form: ``state`` (empty), ``param_groups`` (indices and hyper-parameters), ``base_state`` (the inner
        optimizer's state of this rank's shards, by parameter index), ``shape_info`` (full shapes), and
        ``sharded_master_weights`` (always, see the class docstring); plus ``zero1``: the layout (sharding group size,
        this rank's place in it, the replica group's size and this rank's place in it, one ``FlatShardLayout`` per
        parameter). Every replica of a shard returns the same state."""
        if not self.inited:
            raise RuntimeError("NeuronZero1Optimizer.state_dict(): call init_zero() first (lazy_init=True)")
        self._refuse_expert_state("state_dict()")
        state_dict = super().state_dict()
        state_dict["base_state"] = self.base_optimizer.state_dict()["state"]
        state_dict["shape_info"] = {i: tuple(p.shape) for i, p in enumerate(self._params())}
        state_dict["sharded_master_weights"] = {i: s.detach() for i, (_, s) in enumerate(self._pairs())}
        state_dict["zero1"] = self._layout_info()
        return state_dict

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict of ``state_dict()``'s form made at the same layout (sharding group size, shapes, rank).
        The master shards are restored and gathered into the parameters, so the order of model and optimizer loading
        does not matter. A plain optimizer's state dict is refused (it is not sharded)."""
        if not self.inited:
            raise RuntimeError("NeuronZero1Optimizer.load_state_dict(): call init_zero() first (lazy_init=True)")
        self._refuse_expert_state("load_state_dict()")
        if "base_state" not in state_dict:
            raise ValueError("NeuronZero1Optimizer.load_state_dict: this is the state dict of a non-ZeRO optimizer (no "
                             "'base_state'), holding whole-tensor state; a ZeRO-1 optimizer needs its own sharded "
                             "state (save it from a NeuronZero1Optimizer, or start this optimizer fresh)")
        mine = self._layout_info()
        theirs = state_dict.get("zero1")
        if theirs is not None:
            for key in ("sharding_group_size", "sharding_rank", "layouts"):
                if theirs.get(key) != mine[key]:
                    raise ValueError(f"NeuronZero1Optimizer.load_state_dict: the state dict was saved with {key}="
                                     f"{theirs.get(key)!r}, this optimizer has {key}={mine[key]!r}; load it at the "
                                     "layout it was saved at")
        shapes = {int(i): tuple(s) for i, s in state_dict.get("shape_info", {}).items()}
        expected = {i: tuple(p.shape) for i, p in enumerate(self._params())}
        if shapes and shapes != expected:
            raise ValueError(f"NeuronZero1Optimizer.load_state_dict: parameter shapes {shapes} differ from this "
                             f"optimizer's {expected}")
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        base = self.base_optimizer.state_dict()
        base["state"] = state_dict["base_state"]
        base["param_groups"] = [{**bg, **{k: v for k, v in g.items() if k != "params"}}
                                for bg, g in zip(base["param_groups"], state_dict["param_groups"])]
        self.base_optimizer.load_state_dict(base)
        masters = state_dict.get("sharded_master_weights")
        pairs = self._pairs()
        with torch.no_grad():
            if masters is None:
                warnings.warn("NeuronZero1Optimizer.load_state_dict: the state dict has no master weights; the master "
                              "shards are rebuilt from the parameters as they are now (load the model first)")
                for p, s in pairs:
                    s.copy_(self._make_shard(p))
            else:
                for i, (p, s) in enumerate(pairs):
                    master = masters[i] if i in masters else masters[str(i)]
                    if tuple(master.shape) != tuple(s.shape):
                        raise ValueError(f"NeuronZero1Optimizer.load_state_dict: master shard {i} has shape "
                                         f"{tuple(master.shape)}, this rank's shard has {tuple(s.shape)}")
                    s.copy_(master)
        self._all_gather_parameters(pairs)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensors in a plain optimizer's ``state`` (for comparing with ``NeuronZero1Optimizer.state_bytes``)."""
    return sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))


__all__ = ["NeuronZero1Optimizer", "optimizer_state_bytes", "DEFAULT_BUCKET_CAP_MB"]

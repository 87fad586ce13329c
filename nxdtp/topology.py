"""Topology of a tensor-parallel x data-parallel (x expert-parallel) world: the core every other module reads.

The topology is one immutable value. Tensor-parallel (TP) groups are blocks of contiguous ranks, so TP traffic stays
inside a node; data-parallel (DP) groups take one rank from each TP group (strided); expert parallelism (EP) splits
each DP group into EP groups and expert data-parallel groups, in NxD's layout. The rank lists are
nxdtp.rank_lists', and the torch.distributed groups behind them nxdtp.process_groups'. NxD's names (its getters,
setters and size-1 groups) are a facade above this module, nxdtp.parallel_state, which this module never imports.

A topology can be built for a world this process is not part of (``simulated_topology(world_size=8, rank=5, ...)``):
it has the same groups and replica-group lists but no process groups, which is what XLA lowering tests need to trace
one rank's program in a single process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from nxdtp.process_groups import (
    mesh_options,
    needs_cpu_twins,
    new_groups_of_kind,
    new_owned_group,
    release_owned_groups,
    wait_for_every_rank,
)
from nxdtp.rank_lists import (
    data_parallel_rank_lists,
    dp_aligned_examples,
    dp_aligned_sharding,
    expert_data_parallel_rank_lists,
    expert_parallel_rank_lists,
    singleton_rank_lists,
    tensor_parallel_rank_lists,
)


@dataclasses.dataclass(frozen=True)
class ParallelGroup:
    """One communication group as seen from this rank.

    ``replica_groups`` lists every group of this kind in the world (the form XLA collectives take); ``ranks`` is the
    one this rank (``global_rank``) belongs to, ``rank`` its position there. ``process_group`` is the torch.distributed
    group of the world's default backend (what NxD's getters return; on an "xla" world it carries the full mesh), and
    ``cpu_process_group`` a gloo group over the same ranks for CPU tensors, which the default backend of an XLA, NCCL or
    other device world refuses. On a gloo world the two are the same group. Both are None in a simulated topology.
    """

    kind: str
    ranks: tuple
    replica_groups: tuple
    process_group: Optional[object] = dataclasses.field(default=None, compare=False)
    global_rank: int = -1
    cpu_process_group: Optional[object] = dataclasses.field(default=None, compare=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        return self.ranks.index(self.global_rank)

    @property
    def src_rank(self) -> int:
        return self.ranks[0]

    def process_group_for(self, device_type: str):
        """The torch.distributed group for tensors of ``device_type`` ("cpu", "cuda", ...): gloo for CPU tensors, the
        world's default backend for every other device. XLA tensors use ``replica_groups`` instead (see nxdtp.comm)."""
        return self.cpu_process_group if device_type == "cpu" else self.process_group

    def replica_groups_as_lists(self) -> List[List[int]]:
        return [list(g) for g in self.replica_groups]

    def __deepcopy__(self, memo) -> "ParallelGroup":
        # Immutable, and process groups cannot be copied: a deep copy of a module that holds a group shares it.
        return self

    def __reduce__(self):
        # Process groups cannot be pickled: a pickled group (on a module saved with torch.save(model)) is looked up
        # again, by kind and ranks, in the topology installed where it is loaded.
        return (_installed_group, (self.kind, self.ranks, self.replica_groups, self.global_rank))


def _installed_group(kind: str, ranks: tuple, replica_groups: tuple, global_rank: int) -> ParallelGroup:
    what = f"the {kind} group over ranks {list(ranks)} of rank {global_rank}"
    if _TOPOLOGY is None:
        raise RuntimeError(f"unpickling {what} needs the same parallel state: call initialize_model_parallel(...) "
                           "in a world of the same size before loading")
    group = _TOPOLOGY.find_group(kind=kind, ranks=tuple(ranks), replica_groups=tuple(replica_groups),
                                 global_rank=global_rank)
    if group is not None:
        return group
    installed = {g.kind: list(g.ranks) for g in (_TOPOLOGY.tensor_parallel, _TOPOLOGY.data_parallel) if g is not None}
    raise RuntimeError(f"unpickling {what}: the installed topology (rank {_TOPOLOGY.rank}, world "
                       f"{_TOPOLOGY.world_size}, tensor_model_parallel_size={_TOPOLOGY.tensor_model_parallel_size}, "
                       f"groups {installed}) has no such group; load on the rank and topology it was saved from"
                       + (" (groups made by dist.new_group cannot be restored)" if kind == "custom" else ""))


@dataclasses.dataclass(frozen=True)
class Topology:
    world_size: int
    rank: int
    tensor_model_parallel_size: int
    tensor_parallel: ParallelGroup
    data_parallel: ParallelGroup
    # Host-side group (gloo) for barriers and object exchange; None when simulated or when the world has no process
    # group.
    host_process_group: Optional[object] = dataclasses.field(default=None, compare=False)
    simulated: bool = False
    # The whole world as one group (NxD's get_world_group): a copy of the default group, and the host group as its twin.
    world: Optional[ParallelGroup] = None
    # This rank alone (one group per rank: replica groups [[0], [1], ...]). It is NxD's pipeline and context
    # model-parallel group, and its token-shuffle, kv-shared and speculative-draft groups, when each has size 1.
    singleton: Optional[ParallelGroup] = None
    # The expert-parallel group (tokens go to the experts of its ranks) and the expert data-parallel group (expert
    # gradients are averaged over it). A kind whose groups are the data-parallel or the singleton groups is that group:
    # with expert_model_parallel_size 1, EP is the singleton group and expert DP the data-parallel group.
    expert_parallel: Optional[ParallelGroup] = None
    expert_data_parallel: Optional[ParallelGroup] = None
    # The optional NxD groups whose initialize_* function has been called on this topology (each of size 1).
    optional_groups: frozenset = frozenset()
    # ZeRO-1 groups made on request (zero1_groups): ((sharding rank lists), sharding group, replica group) per
    # DP-aligned sharding other than the data-parallel groups and the singleton groups, which need no new groups.
    zero1_groups: tuple = dataclasses.field(default=(), compare=False)

    def groups(self) -> List[ParallelGroup]:
        """Every group of this topology (this rank's view of each kind): TP, DP, world, singleton, ZeRO-1 groups."""
        own = [self.tensor_parallel, self.data_parallel, self.world, self.singleton, self.expert_parallel,
               self.expert_data_parallel]
        own += [g for _, sharding, replica in self.zero1_groups for g in (sharding, replica)]
        return [g for i, g in enumerate(own) if g is not None and g not in own[:i]]

    def find_group(self, process_group=None, **fields) -> Optional[ParallelGroup]:
        """The group of this topology whose process group (of either backend) is ``process_group``, and whose
        ``fields`` (kind=, ranks=, ...) have the given values; None if there is none. The one search over the groups
        (group_of, unpickling, the NxD facade)."""
        if process_group is None and not fields:
            raise TypeError("find_group() needs a process_group or a field to match (kind=, ranks=, ...)")
        for group in self.groups():
            if process_group is not None and process_group is not group.process_group \
                    and process_group is not group.cpu_process_group:
                continue
            if all(getattr(group, name) == value for name, value in fields.items()):
                return group
        return None

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.tensor_model_parallel_size

    @property
    def expert_model_parallel_size(self) -> int:
        return 1 if self.expert_parallel is None else self.expert_parallel.size


def _validate(world_size: int, rank: int, tensor_model_parallel_size: int, pipeline_model_parallel_size: int,
              expert_model_parallel_size: int = 1) -> None:
    for name, value in (("tensor_model_parallel_size", tensor_model_parallel_size),
                        ("pipeline_model_parallel_size", pipeline_model_parallel_size),
                        ("expert_model_parallel_size", expert_model_parallel_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
    if pipeline_model_parallel_size != 1:
        raise ValueError(
            f"pipeline_model_parallel_size={pipeline_model_parallel_size} is not supported: nxdtp does tensor and data "
            "parallelism only; use pipeline_model_parallel_size=1"
        )
    if tensor_model_parallel_size < 1:
        raise ValueError(f"tensor_model_parallel_size={tensor_model_parallel_size} must be >= 1")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if world_size % tensor_model_parallel_size != 0:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"tensor_model_parallel_size={tensor_model_parallel_size} does not divide world size {world_size}; "
            f"valid sizes are {divisors}"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside the world of size {world_size} (valid: 0..{world_size - 1})")
    data_parallel_size = world_size // tensor_model_parallel_size
    if expert_model_parallel_size < 1 or data_parallel_size % expert_model_parallel_size != 0:
        divisors = [d for d in range(1, data_parallel_size + 1) if data_parallel_size % d == 0]
        raise ValueError(
            f"expert_model_parallel_size={expert_model_parallel_size} does not divide the data-parallel size "
            f"{data_parallel_size} (world size {world_size} / tensor_model_parallel_size {tensor_model_parallel_size}):"
            f" expert-parallel groups are carved from the data-parallel groups; valid sizes are {divisors}"
        )


def build_topology(world_size: int, rank: int, tensor_model_parallel_size: int,
                   pipeline_model_parallel_size: int = 1, expert_model_parallel_size: int = 1) -> Topology:
    """Compute the groups of a world without touching torch.distributed (the value behind `simulated_topology`)."""
    _validate(world_size, rank, tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size)
    return _make_topology(world_size, rank, tensor_model_parallel_size, {}, None, simulated=True,
                          expert_model_parallel_size=expert_model_parallel_size)


def _group_kinds(world_size: int, tp: int, ep: int) -> Dict[str, Tuple[str, List[List[int]]]]:
    """Topology field -> (kind, rank lists) of each group kind. An expert kind whose groups are the data-parallel or
    the singleton groups is that kind, so no group is made twice."""
    kinds = {"tensor_parallel": ("tensor", tensor_parallel_rank_lists(world_size, tp)),
             "data_parallel": ("data", data_parallel_rank_lists(world_size, tp)),
             "singleton": ("singleton", singleton_rank_lists(world_size))}
    for field, kind, lists in (("expert_parallel", "expert", expert_parallel_rank_lists(world_size, tp, ep)),
                               ("expert_data_parallel", "expert_data",
                                expert_data_parallel_rank_lists(world_size, tp, ep))):
        reused = (kinds["data_parallel"], kinds["singleton"])
        kinds[field] = next(((k, existing) for k, existing in reused if existing == lists), (kind, lists))
    return kinds


def _rank_group(kind: str, lists: List[List[int]], rank: int, process_groups: dict,
                cpu_process_groups: dict) -> ParallelGroup:
    """``rank``'s group among the groups ``lists`` of one kind, with its process groups (if made) from the dicts that
    process_groups.new_groups_of_kind filled."""
    mine = tuple(next(g for g in lists if rank in g))
    return ParallelGroup(kind=kind, ranks=mine, replica_groups=tuple(tuple(g) for g in lists),
                         process_group=process_groups.get((kind, mine)), global_rank=rank,
                         cpu_process_group=cpu_process_groups.get((kind, mine)))


def _make_topology(world_size, rank, tp, process_groups, host_group, simulated, cpu_process_groups=None,
                   expert_model_parallel_size: int = 1) -> Topology:
    cpu_process_groups = process_groups if cpu_process_groups is None else cpu_process_groups
    groups = {field: _rank_group(kind, lists, rank, process_groups, cpu_process_groups)
              for field, (kind, lists) in _group_kinds(world_size, tp, expert_model_parallel_size).items()}
    return Topology(world_size=world_size, rank=rank, tensor_model_parallel_size=tp, host_process_group=host_group,
                    simulated=simulated, world=_rank_group("world", [list(range(world_size))], rank, process_groups,
                                                           cpu_process_groups), **groups)


_TOPOLOGY: Optional[Topology] = None
# initialize_model_parallel's timeout, which groups made later (zero1_groups) take too.
_GROUP_TIMEOUT: Optional[datetime.timedelta] = None


# NxD options of initialize_model_parallel that nxdtp does not implement, with the only value it accepts.
_NXD_DEFAULTS = {"context_parallel_size": 1, "skip_collective_init": False,
                 "lnc_size": 1, "mesh_only": False}


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              context_parallel_size: int = 1, expert_model_parallel_size: int = 1,
                              skip_collective_init: bool = False, lnc_size: int = 1, mesh_only: bool = False, *,
                              timeout: Optional[datetime.timedelta] = None) -> None:
    """Split the initialized torch.distributed world into TP groups of contiguous ranks and strided DP groups, and
    with ``expert_model_parallel_size`` E > 1 each DP group into expert-parallel groups of E ranks (NxD's layout).

    Every rank must call this (group creation is collective), and it returns on a rank only once every rank has made
    every group, so a rank that goes on to destroy its groups or to exit cannot break a peer still connecting them.
    Each TP/DP group gets a process group of the world's default backend (on an "xla" world with the full mesh, as
    NxD's) and, when that backend is not gloo, a gloo group over the same ranks for CPU tensors; nxdtp.comm picks one
    from the tensor's device (XLA tensors use replica groups).
    So does each rank alone (the singleton groups): NxD's pipeline and context model-parallel groups of size 1, and
    each expert group that is not a TP, DP or singleton group.
    ``timeout`` bounds every collective on these groups (torch.distributed's default otherwise: 30 minutes for gloo), so
    a rank that died is reported instead of waited for. NxD's other options take NxD's positions and are accepted at
    their defaults only (``timeout`` is keyword-only, after them).
    """
    global _TOPOLOGY, _GROUP_TIMEOUT
    _refuse_other_nxd_options(context_parallel_size=context_parallel_size, skip_collective_init=skip_collective_init,
                              lnc_size=lnc_size, mesh_only=mesh_only)
    if _TOPOLOGY is not None:
        fallback = (" (if not by you: a parallel layer built before initialize_model_parallel installs this "
                    "fallback, so call initialize_model_parallel first)" if _TOPOLOGY.tensor_model_parallel_size == 1
                    else "")
        raise RuntimeError(
            "model parallel is already initialized (tensor_model_parallel_size="
            f"{_TOPOLOGY.tensor_model_parallel_size}, world size {_TOPOLOGY.world_size}){fallback}; "
            "call destroy_model_parallel() first to re-initialize"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group(...) before "
            f"initialize_model_parallel(tensor_model_parallel_size={tensor_model_parallel_size}), or use "
            "nxdtp.parallel_state.simulated_topology(...) to trace a rank without a process group"
        )
    world_size, rank = dist.get_world_size(), dist.get_rank()
    _validate(world_size, rank, tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size)
    process_groups, cpu_process_groups, host_group = _new_topology_groups(world_size, tensor_model_parallel_size,
                                                                         expert_model_parallel_size, timeout)
    _TOPOLOGY = _make_topology(world_size, rank, tensor_model_parallel_size, process_groups, host_group,
                               simulated=False, cpu_process_groups=cpu_process_groups,
                               expert_model_parallel_size=expert_model_parallel_size)
    _GROUP_TIMEOUT = timeout


def _refuse_other_nxd_options(**nxd_options) -> None:
    for name, value in nxd_options.items():
        if value != _NXD_DEFAULTS[name]:
            raise ValueError(f"{name}={value!r} is not supported by nxdtp; only the default {name}="
                             f"{_NXD_DEFAULTS[name]!r} is")


def _new_topology_groups(world_size: int, tensor_model_parallel_size: int, expert_model_parallel_size: int,
                         timeout: Optional[datetime.timedelta]) -> Tuple[dict, dict, Optional[object]]:
    """Make every group of the topology, collectively, and wait until every rank has made them all: (process groups,
    their CPU twins, both keyed by (kind, ranks); the host group, None on a gloo world)."""
    default_backend = dist.get_backend()
    separate_cpu_groups = needs_cpu_twins()
    process_groups, cpu_process_groups = {}, {}

    # The singleton groups (one per rank) stand for NxD's pipeline and context model-parallel groups of size 1.
    # Every rank creates all of them, like the other kinds; a non-member's call only advances the group count (no
    # backend is built and, unless TORCH_DIST_INIT_BARRIER=1, no barrier), so this costs world_size cheap calls.
    made = set()
    for kind, lists in _group_kinds(world_size, tensor_model_parallel_size, expert_model_parallel_size).values():
        if kind not in made:
            made.add(kind)
            new_groups_of_kind(kind, lists, timeout, process_groups, cpu_process_groups)
    # Barriers and object exchange (checkpoint coordination) go over the whole world on the host.
    host_group = new_owned_group(backend="gloo", timeout=timeout) if separate_cpu_groups else None
    # NxD's world group: a copy of the default group (on an "xla" world with the mesh [[0, ..., world - 1]]), whose gloo
    # twin is the host group.
    everyone = list(range(world_size))
    world_key = ("world", tuple(everyone))
    process_groups[world_key] = new_owned_group(everyone, timeout=timeout, **mesh_options(default_backend, [everyone]))
    cpu_process_groups[world_key] = host_group if separate_cpu_groups else process_groups[world_key]
    wait_for_every_rank(cpu_process_groups[world_key])
    return process_groups, cpu_process_groups, host_group


def destroy_model_parallel() -> None:
    """Forget the topology and release the process groups initialize_model_parallel created."""
    global _TOPOLOGY, _GROUP_TIMEOUT
    _TOPOLOGY = None
    _GROUP_TIMEOUT = None
    release_owned_groups()


def model_parallel_is_initialized() -> bool:
    return _TOPOLOGY is not None


@contextlib.contextmanager
def simulated_topology(world_size: int, rank: int, tensor_model_parallel_size: int,
                       expert_model_parallel_size: int = 1) -> Iterator[Topology]:
    """Install the topology of a world this process is not part of, for tracing; restores the previous one on exit."""
    global _TOPOLOGY
    previous = _TOPOLOGY
    _TOPOLOGY = build_topology(world_size, rank, tensor_model_parallel_size,
                               expert_model_parallel_size=expert_model_parallel_size)
    try:
        yield _TOPOLOGY
    finally:
        _TOPOLOGY = previous


def get_topology() -> Topology:
    if _TOPOLOGY is None:
        raise RuntimeError(
            "model parallel is not initialized: call nxdtp.parallel_state.initialize_model_parallel("
            "tensor_model_parallel_size=...) after torch.distributed.init_process_group(...)"
        )
    return _TOPOLOGY


def replace_installed_topology(**changes) -> Topology:
    """Install a copy of the installed topology with ``changes`` (dataclass fields), and return it: the topology is a
    value, so recording something on it (an optional group asked for, ZeRO-1 groups made) replaces it."""
    global _TOPOLOGY
    _TOPOLOGY = dataclasses.replace(get_topology(), **changes)
    return _TOPOLOGY


def tensor_parallel_group() -> ParallelGroup:
    return get_topology().tensor_parallel


def data_parallel_group() -> ParallelGroup:
    return get_topology().data_parallel


def expert_parallel_group() -> ParallelGroup:
    return get_topology().expert_parallel


def expert_data_parallel_group() -> ParallelGroup:
    return get_topology().expert_data_parallel


_RANK_TENSORS: dict = {}


def rank_tensor(group: ParallelGroup, device) -> torch.Tensor:
    """This rank's position in ``group`` as data: a 1-element int64 tensor on ``device``, made once per (group, device).

    Traced code that computes offsets or picks slices from it, instead of from the Python int ``group.rank``, traces
    the same graph on every rank: torch_xla turns Python scalars into graph constants (0 and 1) or inputs, and slice
    bounds into static shapes. One element, not 0-dim: torch_xla folds a 0-dim host tensor holding 0 or 1 into a
    constant when it is moved. Reshape it to ``()`` on the device where a scalar is needed.
    """
    device = torch.device(device)
    key = (group, device)
    cached = _RANK_TENSORS.get(key)
    if cached is None:
        cached = torch.tensor([group.rank], dtype=torch.long).to(device)
        _RANK_TENSORS[key] = cached
    return cached


def group_of(process_group=None) -> ParallelGroup:
    """The ParallelGroup behind an NxD ``process_group=`` / ``tensor_model_parallel_group=`` argument.

    None means the tensor-parallel group. nxdtp's own groups (either process group of the TP, DP, world or singleton
    group: what the getters return) map to their ParallelGroup, and a ParallelGroup passes through. Any other
    torch.distributed group (one made by ``dist.new_group``) becomes a group of kind "custom" over its ranks: its
    process group serves CPU tensors only when it is a gloo group, and XLA tensors only when it carries the full
    replica-group mesh (torch_xla's ``pg_options={"xla_pg_options": {"mesh": ...}}``), which nxdtp.comm checks.
    """
    if process_group is None:
        return tensor_parallel_group()
    if isinstance(process_group, ParallelGroup):
        return process_group
    topology = get_topology()
    own = topology.find_group(process_group)
    if own is not None:
        return own
    if process_group is dist.GroupMember.NON_GROUP_MEMBER:
        # what dist.new_group returns on the ranks it leaves out
        raise ValueError(f"rank {topology.rank} is not a member of process_group={process_group!r} "
                         "(torch.distributed's NON_GROUP_MEMBER); pass a group this rank belongs to")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group={process_group!r} is not a torch.distributed ProcessGroup; pass None (the "
                        "tensor-parallel group), a group from nxdtp.parallel_state, or one made by dist.new_group")
    ranks = tuple(dist.get_process_group_ranks(process_group))
    if topology.rank not in ranks:
        raise ValueError(f"rank {topology.rank} is not in process_group ranks {list(ranks)}")
    mesh = getattr(process_group, "_mesh", None)
    replica_groups = tuple(tuple(g) for g in mesh) if mesh else (ranks,)
    return ParallelGroup(kind="custom", ranks=ranks, replica_groups=replica_groups, process_group=process_group,
                         global_rank=topology.rank,
                         cpu_process_group=process_group if dist.get_backend(process_group) == "gloo" else None)


# ---- ZeRO-1 sharding groups: any DP-aligned partition ----------------------------------------------------------------

def dp_aligned_sharding_examples(topology: Topology) -> Dict[int, List[List[int]]]:
    """For each valid sharding group size k (the divisors of the DP size), one DP-aligned sharding: each DP group cut
    into blocks of k consecutive members."""
    return dp_aligned_examples(topology.data_parallel.replica_groups_as_lists())


def dp_aligned_rank_lists(sharding_groups: Any, topology: Optional[Topology] = None
                          ) -> Tuple[List[List[int]], List[List[int]]]:
    """The ZeRO-1 sharding rank lists that ``sharding_groups`` (a list of global-rank lists, NxD's form) names, and
    their replica rank lists; ``ValueError`` naming them and what would be valid unless they are DP-aligned.

    DP-aligned: every rank of the world is in exactly one group, every group lies inside one data-parallel group, and
    all groups have the same size k (so each DP group is cut into dp / k groups of k). Each group's ranks are taken in
    ascending order (a group's shard r is held by its r-th smallest rank, as torch.distributed orders a new group), and
    the groups sorted by their first rank. The replica groups are the ranks that hold the same shard: within each DP
    group, the r-th ranks of its k-groups (dp / k ranks each).
    """
    topology = get_topology() if topology is None else topology
    return dp_aligned_sharding(sharding_groups, topology.data_parallel.replica_groups_as_lists())


def zero1_groups(sharding_groups: Any = None) -> Tuple[ParallelGroup, ParallelGroup]:
    """This rank's ZeRO-1 sharding group and replica group for NxD's ``sharding_groups`` argument.

    ``sharding_groups``: None (the data-parallel groups), a ParallelGroup, a process group of this topology, or a list
    of global-rank lists (``get_data_parallel_group(as_list=True)``); it must be DP-aligned (``dp_aligned_rank_lists``).
    The replica group holds the ranks of this rank's DP group that hold the same shard; gradients summed over the
    sharding group and then over the replica group are summed over the DP group. The data-parallel groups (k = dp)
    have the singleton groups as replicas, and the singleton groups (k = 1) the data-parallel groups: both exist
    already. Any other sharding makes its groups the first time it is asked for: collectively, so every rank of the
    world must ask at the same point with the same groups (as every rank builds its ZeRO-1 optimizer), with a gloo twin
    on device worlds and the full mesh on XLA worlds, as initialize_model_parallel makes its own; later calls return
    them, and destroy_model_parallel releases them. A simulated topology gets the groups without process groups.
    """
    topology = get_topology()
    if sharding_groups is None:
        return topology.data_parallel, topology.singleton
    if isinstance(sharding_groups, dist.ProcessGroup):
        # One of this topology's groups, or a torch_xla group with its mesh (otherwise only its own ranks: refused).
        sharding_groups = group_of(sharding_groups)
    if isinstance(sharding_groups, ParallelGroup):
        sharding_groups = sharding_groups.replica_groups_as_lists()
    shard_lists, replica_lists = dp_aligned_rank_lists(sharding_groups, topology)
    if shard_lists == sorted(topology.data_parallel.replica_groups_as_lists()):
        return topology.data_parallel, topology.singleton
    if shard_lists == sorted(topology.singleton.replica_groups_as_lists()):
        return topology.singleton, topology.data_parallel
    key = tuple(tuple(g) for g in shard_lists)
    for made, sharding, replica in topology.zero1_groups:
        if made == key:
            return sharding, replica
    process_groups: dict = {}
    cpu_process_groups: dict = {}
    if not topology.simulated:
        for kind, lists in (("zero1_sharding", shard_lists), ("zero1_replica", replica_lists)):
            new_groups_of_kind(kind, lists, _GROUP_TIMEOUT, process_groups, cpu_process_groups)
        wait_for_every_rank(topology.world.cpu_process_group)

    sharding = _rank_group("zero1_sharding", shard_lists, topology.rank, process_groups, cpu_process_groups)
    replica = _rank_group("zero1_replica", replica_lists, topology.rank, process_groups, cpu_process_groups)
    if _TOPOLOGY is topology:
        replace_installed_topology(zero1_groups=topology.zero1_groups + ((key, sharding, replica),))
    return sharding, replica


__all__: Sequence[str] = [
    "ParallelGroup", "Topology", "build_topology", "simulated_topology", "get_topology", "replace_installed_topology",
    "initialize_model_parallel", "destroy_model_parallel", "model_parallel_is_initialized",
    "tensor_parallel_group", "data_parallel_group", "expert_parallel_group", "expert_data_parallel_group",
    "rank_tensor", "group_of", "zero1_groups", "dp_aligned_rank_lists",
    "dp_aligned_sharding_examples",
]

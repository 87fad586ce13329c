"""Topology of a tensor-parallel x data-parallel world.

The topology is one immutable value. Tensor-parallel (TP) groups are blocks of contiguous ranks, so TP traffic stays inside
a node; data-parallel (DP) groups take one rank from each TP group (strided). The module keeps NxD's function names, all of
which read from the installed topology.

A topology can be built for a world this process is not part of (``simulated_topology(world_size=8, rank=5, ...)``): it has
the same groups and replica-group lists but no process groups, which is what XLA lowering tests need to trace one rank's
program in a single process.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import enum
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class ParallelGroup:
    """One communication group as seen from this rank.

    ``replica_groups`` lists every group of this kind in the world (the form XLA collectives take); ``ranks`` is the one this
    rank (``global_rank``) belongs to, ``rank`` its position there. ``process_group`` is the torch.distributed group of
    the world's default backend (what NxD's getters return; on an "xla" world it carries the full mesh), and
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
    for group in _TOPOLOGY.groups():
        if group.kind == kind and group.ranks == tuple(ranks) \
                and group.replica_groups == tuple(replica_groups) and group.global_rank == global_rank:
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
    # Host-side group (gloo) for barriers and object exchange; None when simulated or when the world has no process group.
    host_process_group: Optional[object] = dataclasses.field(default=None, compare=False)
    simulated: bool = False
    # The whole world as one group (NxD's get_world_group): a copy of the default group, and the host group as its twin.
    world: Optional[ParallelGroup] = None
    # This rank alone (one group per rank: replica groups [[0], [1], ...]). It is NxD's pipeline, context and expert
    # model-parallel group, and its token-shuffle, kv-shared and speculative-draft groups, when each has size 1.
    singleton: Optional[ParallelGroup] = None
    # The optional NxD groups whose initialize_* function has been called on this topology (each of size 1).
    optional_groups: frozenset = frozenset()
    # ZeRO-1 groups made on request (zero1_groups): ((sharding rank lists), sharding group, replica group) per
    # DP-aligned sharding other than the data-parallel groups and the singleton groups, which need no new groups.
    zero1_groups: tuple = dataclasses.field(default=(), compare=False)

    def groups(self) -> List[ParallelGroup]:
        """Every group of this topology (this rank's view of each kind): TP, DP, world, singleton, ZeRO-1 groups."""
        own = [self.tensor_parallel, self.data_parallel, self.world, self.singleton]
        own += [g for _, sharding, replica in self.zero1_groups for g in (sharding, replica)]
        return [g for g in own if g is not None]

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.tensor_model_parallel_size


def tensor_parallel_rank_lists(world_size: int, tensor_model_parallel_size: int) -> List[List[int]]:
    tp = tensor_model_parallel_size
    return [list(range(start, start + tp)) for start in range(0, world_size, tp)]


def data_parallel_rank_lists(world_size: int, tensor_model_parallel_size: int) -> List[List[int]]:
    tp = tensor_model_parallel_size
    return [list(range(offset, world_size, tp)) for offset in range(tp)]


def _validate(world_size: int, rank: int, tensor_model_parallel_size: int, pipeline_model_parallel_size: int) -> None:
    for name, value in (("tensor_model_parallel_size", tensor_model_parallel_size),
                        ("pipeline_model_parallel_size", pipeline_model_parallel_size)):
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


def build_topology(world_size: int, rank: int, tensor_model_parallel_size: int,
                   pipeline_model_parallel_size: int = 1) -> Topology:
    """Compute the groups of a world without touching torch.distributed (the value behind `simulated_topology`)."""
    _validate(world_size, rank, tensor_model_parallel_size, pipeline_model_parallel_size)
    return _make_topology(world_size, rank, tensor_model_parallel_size, {}, None, simulated=True)


def singleton_rank_lists(world_size: int) -> List[List[int]]:
    """One group per rank, each holding only that rank: the groups of a kind of parallelism of size 1."""
    return [[r] for r in range(world_size)]


def _make_topology(world_size, rank, tp, process_groups, host_group, simulated, cpu_process_groups=None) -> Topology:
    cpu_process_groups = process_groups if cpu_process_groups is None else cpu_process_groups

    def group(kind, lists):
        mine = next(g for g in lists if rank in g)
        return ParallelGroup(kind=kind, ranks=tuple(mine), replica_groups=tuple(tuple(g) for g in lists),
                             process_group=process_groups.get((kind, tuple(mine))), global_rank=rank,
                             cpu_process_group=cpu_process_groups.get((kind, tuple(mine))))

    return Topology(
        world_size=world_size,
        rank=rank,
        tensor_model_parallel_size=tp,
        tensor_parallel=group("tensor", tensor_parallel_rank_lists(world_size, tp)),
        data_parallel=group("data", data_parallel_rank_lists(world_size, tp)),
        host_process_group=host_group,
        simulated=simulated,
        world=group("world", [list(range(world_size))]),
        singleton=group("singleton", singleton_rank_lists(world_size)),
    )


_TOPOLOGY: Optional[Topology] = None
# Every process group initialize_model_parallel (or zero1_groups) created, this rank's or not, so destroy_model_parallel
# can release them.
_OWNED_PROCESS_GROUPS: List[object] = []
# initialize_model_parallel's timeout, which groups made later (zero1_groups) take too.
_GROUP_TIMEOUT: Optional[datetime.timedelta] = None


# NxD options of initialize_model_parallel that nxdtp does not implement, with the only value it accepts.
_NXD_DEFAULTS = {"context_parallel_size": 1, "expert_model_parallel_size": 1, "skip_collective_init": False,
                 "lnc_size": 1, "mesh_only": False}


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              context_parallel_size: int = 1, expert_model_parallel_size: int = 1,
                              skip_collective_init: bool = False, lnc_size: int = 1, mesh_only: bool = False, *,
                              timeout: Optional[datetime.timedelta] = None) -> None:
    """Split the initialized torch.distributed world into TP groups of contiguous ranks and strided DP groups.

    Every rank must call this (group creation is collective), and it returns on a rank only once every rank has made
    every group, so a rank that goes on to destroy its groups or to exit cannot break a peer still connecting them.
    Each TP/DP group gets a process group of the world's default backend (on an "xla" world with the full mesh, as
    NxD's) and, when that backend is not gloo, a gloo group over the same ranks for CPU tensors; nxdtp.comm picks one
    from the tensor's device (XLA tensors use replica groups).
    So does each rank alone (the singleton groups): NxD's pipeline, context and expert model-parallel groups of size 1.
    ``timeout`` bounds every collective on these groups (torch.distributed's default otherwise: 30 minutes for gloo), so
    a rank that died is reported instead of waited for. NxD's other options take NxD's positions and are accepted at
    their defaults only (``timeout`` is keyword-only, after them).
    """
    global _TOPOLOGY, _GROUP_TIMEOUT
    nxd_options = dict(context_parallel_size=context_parallel_size, expert_model_parallel_size=expert_model_parallel_size,
                       skip_collective_init=skip_collective_init, lnc_size=lnc_size, mesh_only=mesh_only)
    for name, value in nxd_options.items():
        if value != _NXD_DEFAULTS[name]:
            raise ValueError(f"{name}={value!r} is not supported by nxdtp; only the default {name}="
                             f"{_NXD_DEFAULTS[name]!r} is")
    if _TOPOLOGY is not None:
        raise RuntimeError(
            "model parallel is already initialized (tensor_model_parallel_size="
            f"{_TOPOLOGY.tensor_model_parallel_size}, world size {_TOPOLOGY.world_size}); "
            "call destroy_model_parallel() first to re-initialize"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group(...) before "
            f"initialize_model_parallel(tensor_model_parallel_size={tensor_model_parallel_size}), or use "
            "nxdtp.parallel_state.simulated_topology(...) to trace a rank without a process group"
        )
    world_size, rank = dist.get_world_size(), dist.get_rank()
    _validate(world_size, rank, tensor_model_parallel_size, pipeline_model_parallel_size)

    default_backend = dist.get_backend()
    separate_cpu_groups = _separate_cpu_groups()
    process_groups, cpu_process_groups = {}, {}
    new_group = _owned_new_group

    # The singleton groups (one per rank) stand for NxD's pipeline, context and expert model-parallel groups of size 1.
    # Every rank creates all of them, like the other kinds; a non-member's call only advances the group count (no
    # backend is built and, unless TORCH_DIST_INIT_BARRIER=1, no barrier), so this costs world_size cheap calls.
    for kind, lists in (("tensor", tensor_parallel_rank_lists(world_size, tensor_model_parallel_size)),
                        ("data", data_parallel_rank_lists(world_size, tensor_model_parallel_size)),
                        ("singleton", singleton_rank_lists(world_size))):
        _new_groups_of_kind(kind, lists, timeout, process_groups, cpu_process_groups)
    # Barriers and object exchange (checkpoint coordination) go over the whole world on the host.
    host_group = new_group(backend="gloo", timeout=timeout) if separate_cpu_groups else None
    # NxD's world group: a copy of the default group (on an "xla" world with the mesh [[0, ..., world - 1]]), whose gloo
    # twin is the host group.
    everyone = list(range(world_size))
    world_key = ("world", tuple(everyone))
    process_groups[world_key] = new_group(everyone, timeout=timeout, **_group_options(default_backend, [everyone]))
    cpu_process_groups[world_key] = host_group if separate_cpu_groups else process_groups[world_key]
    # new_group is not a barrier: with gloo, a rank's call returns once its own connections are up, while a peer may
    # still be connecting to it. A rank that returned and then destroyed its groups (destroy_model_parallel, or its
    # process ending) closed those connections under the peer, whose new_group then failed ("Connection closed by
    # peer"), which a loaded machine made likely. So no rank leaves before every rank has made every group. A CPU tensor
    # over the world's gloo group: the backend for CPU tensors in every world, whatever its default backend.
    dist.all_reduce(torch.zeros(1), group=cpu_process_groups[world_key])
    _TOPOLOGY = _make_topology(world_size, rank, tensor_model_parallel_size, process_groups, host_group,
                               simulated=False, cpu_process_groups=cpu_process_groups)
    _GROUP_TIMEOUT = timeout


def _separate_cpu_groups() -> bool:
    """Whether this world needs gloo twins of its groups. CPU tensors are everywhere (model build before the device
    move, pretrained loading, host-side metrics), and the default backend of an XLA, NCCL or other device world refuses
    them: such worlds get a gloo twin of every group. A world whose default already maps CPU tensors to gloo
    ("cpu:gloo,cuda:nccl") needs none."""
    return "cpu:gloo" not in dist.get_backend_config().split(",")


def _owned_new_group(*args, **kwargs):
    group = dist.new_group(*args, **kwargs)
    # Owned from the moment it exists, so destroy_model_parallel releases it even if a later group fails to form.
    _OWNED_PROCESS_GROUPS.append(group)
    return group


def _new_groups_of_kind(kind: str, lists: List[List[int]], timeout, process_groups: dict,
                        cpu_process_groups: dict) -> None:
    """Collective over the whole world: every rank creates every group of ``lists``, in the same order; each gets a
    process group of the default backend (with the full mesh on an "xla" world) and, where the world needs one, a
    gloo twin. Recorded under ``(kind, tuple(ranks))``."""
    default_backend = dist.get_backend()
    separate = _separate_cpu_groups()
    for ranks in lists:
        key = (kind, tuple(ranks))
        process_groups[key] = _owned_new_group(ranks, timeout=timeout, **_group_options(default_backend, lists))
        cpu_process_groups[key] = (_owned_new_group(ranks, backend="gloo", timeout=timeout) if separate
                                   else process_groups[key])


def _group_options(default_backend: str, all_groups: List[List[int]]) -> dict:
    """torch_xla's new_group records only the caller's ranks as the group's mesh, so plain torch.distributed
    collectives on it would name incomplete replica groups; NxD passes every group of the kind, and so does nxdtp."""
    if default_backend == "xla":
        return {"pg_options": {"xla_pg_options": {"mesh": [list(g) for g in all_groups]}}}
    return {}


def single_process_backend(device: Optional[torch.device]) -> str:
    """The torch.distributed backend of a world of 1 for ``device``, with gloo for CPU tensors in every case."""
    if device is None or device.type in ("cpu", "meta"):
        return "gloo"
    if device.type == "xla":
        return "xla"
    known = dist.Backend.default_device_backend_map
    backend = known.get(device.type)
    if backend is None:
        raise ValueError(f"initialize_fallback_parallel_state: no torch.distributed backend is known for device "
                         f"{str(device)!r}; valid device types are {sorted({'xla', 'meta', *known})}, or None (CPU)")
    return "gloo" if backend == "gloo" else f"cpu:gloo,{device.type}:{backend}"


def initialize_single_process_world(device: Optional[torch.device] = None) -> str:
    """Unless torch.distributed is initialized already, make a world of 1 in process (a ``HashStore``: no port is
    opened) on ``single_process_backend(device)``; return that backend. The world behind NxD's
    ``initialize_fallback_parallel_state`` (nxdtp.utils)."""
    backend = single_process_backend(torch.device(device) if device is not None else None)
    if not dist.is_initialized():
        if backend == "xla":
            import torch_xla.distributed.xla_backend  # noqa: F401 - registers the "xla" backend
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return backend


def destroy_model_parallel() -> None:
    """Forget the topology and release the process groups initialize_model_parallel created."""
    global _TOPOLOGY, _GROUP_TIMEOUT
    _TOPOLOGY = None
    _GROUP_TIMEOUT = None
    while _OWNED_PROCESS_GROUPS:
        group = _OWNED_PROCESS_GROUPS.pop()
        if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER and dist.is_initialized():
            dist.destroy_process_group(group)


def model_parallel_is_initialized() -> bool:
    return _TOPOLOGY is not None


@contextlib.contextmanager
def simulated_topology(world_size: int, rank: int, tensor_model_parallel_size: int) -> Iterator[Topology]:
    """Install the topology of a world this process is not part of, for tracing; restores the previous one on exit."""
    global _TOPOLOGY
    previous = _TOPOLOGY
    _TOPOLOGY = build_topology(world_size, rank, tensor_model_parallel_size)
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


def tensor_parallel_group() -> ParallelGroup:
    return get_topology().tensor_parallel


def data_parallel_group() -> ParallelGroup:
    return get_topology().data_parallel


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
    group: what the getters return) map to their ParallelGroup, and a ParallelGroup passes through. Any other torch.distributed group (one made by
    ``dist.new_group``) becomes a group of kind "custom" over its ranks: its process group serves CPU tensors only when
    it is a gloo group, and XLA tensors only when it carries the full replica-group mesh (torch_xla's
    ``pg_options={"xla_pg_options": {"mesh": ...}}``), which nxdtp.comm checks.
    """
    if process_group is None:
        return tensor_parallel_group()
    if isinstance(process_group, ParallelGroup):
        return process_group
    topology = get_topology()
    for own in topology.groups():
        if process_group is own.process_group or process_group is own.cpu_process_group:
            return own
    if process_group is dist.GroupMember.NON_GROUP_MEMBER:
        # what dist.new_group returns on the ranks it leaves out
        raise ValueError(f"rank {topology.rank} is not a member of process_group={process_group!r} (torch.distributed's "
                         "NON_GROUP_MEMBER); pass a group this rank belongs to")
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


# ---- NxD-compatible getters -------------------------------------------------------------------------------------------

def get_tensor_model_parallel_group(as_list: bool = False):
    """The torch.distributed group of this rank's TP group; with ``as_list=True`` the list of all TP groups' ranks."""
    g = tensor_parallel_group()
    return g.replica_groups_as_lists() if as_list else g.process_group


def get_data_parallel_group(as_list: bool = False):
    g = data_parallel_group()
    return g.replica_groups_as_lists() if as_list else g.process_group


def get_tensor_model_parallel_size() -> int:
    return tensor_parallel_group().size


def get_tensor_model_parallel_rank() -> int:
    return tensor_parallel_group().rank


def get_tensor_model_parallel_src_rank() -> int:
    return tensor_parallel_group().src_rank


def get_tensor_model_parallel_replica_groups() -> List[List[int]]:
    return tensor_parallel_group().replica_groups_as_lists()


def get_data_parallel_size() -> int:
    return data_parallel_group().size


def get_data_parallel_rank() -> int:
    return data_parallel_group().rank


def get_data_parallel_src_rank() -> int:
    return data_parallel_group().src_rank


def get_data_parallel_replica_groups() -> List[List[int]]:
    return data_parallel_group().replica_groups_as_lists()


# Parallelism nxdtp does not do (pipeline, context, expert): NxD's values for size 1. Each rank's group of such a kind is
# the rank alone (the topology's singleton group); the expert data-parallel group of a world without expert parallelism
# is the data-parallel group.

def _group_or_list(g: ParallelGroup, as_list: bool):
    return g.replica_groups_as_lists() if as_list else g.process_group


def _singleton() -> ParallelGroup:
    return get_topology().singleton


def get_world_group(as_list: bool = False):
    """The whole world as one group (a copy of the default group), or with ``as_list=True`` ``[[0, 1, ..., world - 1]]``."""
    return _group_or_list(get_topology().world, as_list)


def get_pipeline_model_parallel_group(as_list: bool = False):
    """Pipeline parallelism of size 1: this rank's group is the rank alone; ``as_list=True`` gives ``[[0], [1], ...]``."""
    return _group_or_list(_singleton(), as_list)


def get_pipeline_model_parallel_replica_groups() -> List[List[int]]:
    return _singleton().replica_groups_as_lists()


def get_pipeline_model_parallel_size() -> int:
    return _singleton().size


def get_pipeline_model_parallel_rank() -> int:
    return _singleton().rank


def get_pipeline_model_parallel_next_rank() -> int:
    """The global rank of the next pipeline stage: in a pipeline of one stage, this rank."""
    g = _singleton()
    return g.ranks[(g.rank + 1) % g.size]


def get_pipeline_model_parallel_prev_rank() -> int:
    """The global rank of the previous pipeline stage: in a pipeline of one stage, this rank."""
    g = _singleton()
    return g.ranks[(g.rank - 1) % g.size]


def get_pipeline_model_parallel_sr_group(parity: Optional[bool] = None) -> List[List[int]]:
    """Send/receive pairs ``[stage i, stage i + 1 (mod size)]`` of every pipeline group: ``[[0, 0], [1, 1], ...]`` for
    one stage. ``parity`` keeps the pairs whose first stage is even (False) or odd (True): none for True here."""
    if parity is not None and parity not in (0, 1):
        raise ValueError(f"parity={parity!r} must be None, False or True")
    g = _singleton()
    stages = range(g.size) if parity is None else range(int(parity), g.size, 2)
    return [[ranks[i], ranks[(i + 1) % len(ranks)]] for ranks in g.replica_groups for i in stages]


def _no_pipeline_send_recv_group(name: str):
    get_topology()
    raise RuntimeError(
        f"{name}(): NxD creates the pipeline send/receive (next and previous rank) groups only when "
        "pipeline_model_parallel_size > 1, and nxdtp's pipeline has size 1, so there is no such group; the next and "
        "previous pipeline rank is this rank (get_pipeline_model_parallel_next_rank/prev_rank)"
    )


def get_next_rank_group(as_list: bool = False):
    _no_pipeline_send_recv_group("get_next_rank_group")


def get_next_rank_replica_groups() -> List[List[int]]:
    _no_pipeline_send_recv_group("get_next_rank_replica_groups")


def get_prev_rank_group(as_list: bool = False):
    _no_pipeline_send_recv_group("get_prev_rank_group")


def get_prev_rank_replica_groups() -> List[List[int]]:
    _no_pipeline_send_recv_group("get_prev_rank_replica_groups")


def create_pg_with_ranks(ranks: List[int]):
    """This rank's group among the groups made of pipeline stages ``ranks`` of every pipeline group. With one stage the
    only valid ``ranks`` is ``[0]``, and the group is this rank alone (the pipeline group)."""
    g = _singleton()
    if not isinstance(ranks, (list, tuple, range)) or list(ranks) != list(range(g.size)):
        raise ValueError(
            f"create_pg_with_ranks(ranks={ranks!r}): ranks are pipeline-parallel ranks (stages), and nxdtp's pipeline "
            f"has size {g.size} (no pipeline parallelism), so the only valid value is [0]"
        )
    return g.process_group


def get_context_model_parallel_group(as_list: bool = False):
    """Context parallelism of size 1: this rank's group is the rank alone; ``as_list=True`` gives ``[[0], [1], ...]``."""
    return _group_or_list(_singleton(), as_list)


def get_context_model_parallel_replica_groups() -> List[List[int]]:
    return _singleton().replica_groups_as_lists()


def get_context_model_parallel_size() -> int:
    return _singleton().size


def get_context_model_parallel_rank() -> int:
    return _singleton().rank


def get_context_model_parallel_src_tgt_pairs() -> List[tuple]:
    """The (source, target) pairs of the ring through this rank's context-parallel group, sorted: ``[(rank, rank)]``
    for a group of one rank."""
    g = _singleton()
    return sorted((r, g.ranks[(i + 1) % g.size]) for i, r in enumerate(g.ranks))


def get_expert_model_parallel_group(as_list: bool = False):
    """Expert parallelism of size 1: this rank's group is the rank alone; ``as_list=True`` gives ``[[0], [1], ...]``."""
    return _group_or_list(_singleton(), as_list)


def get_expert_model_parallel_replica_groups() -> List[List[int]]:
    return _singleton().replica_groups_as_lists()


def get_expert_model_parallel_size() -> int:
    return _singleton().size


def get_expert_model_parallel_rank() -> int:
    return _singleton().rank


def get_expert_data_parallel_size() -> int:
    return get_data_parallel_size()


def get_expert_data_parallel_rank() -> int:
    return get_data_parallel_rank()


def get_expert_data_parallel_group(as_list: bool = False):
    return get_data_parallel_group(as_list)


def get_expert_data_parallel_replica_groups() -> List[List[int]]:
    return get_data_parallel_replica_groups()


def _mesh_of(group, argument: str) -> List[List[int]]:
    """The replica groups of a group given as a ParallelGroup, as one of this topology's process groups, as a list of
    rank lists, or as a torch_xla process group (its ``_mesh``)."""
    if isinstance(group, ParallelGroup):
        return group.replica_groups_as_lists()
    if isinstance(group, (list, tuple)) and all(isinstance(g, (list, tuple)) for g in group):
        return [list(g) for g in group]
    topology = get_topology()
    for known in topology.groups():
        if group is not None and (group is known.process_group or group is known.cpu_process_group):
            return known.replica_groups_as_lists()
    mesh = getattr(group, "_mesh", None)
    if mesh:
        return [list(g) for g in mesh]
    raise ValueError(
        f"{argument}={group!r} is not a group of the installed topology: pass get_expert_model_parallel_group() (or "
        "another parallel_state group, a ParallelGroup, or its replica groups as lists)"
    )


def get_expert_parallel_rank_from_global_rank(rank: int, expert_parallel_group) -> int:
    """The position of global ``rank`` in its group of ``expert_parallel_group``: 0 for every rank when expert
    parallelism has size 1."""
    mesh = _mesh_of(expert_parallel_group, "expert_parallel_group")
    for ranks in mesh:
        if rank in ranks:
            return ranks.index(rank)
    raise ValueError(f"rank={rank!r} is not in any group of {mesh} (valid: the ranks listed there)")


def get_experts_for_expert_parallel_rank(expert_parallel_rank: int, total_number_of_experts: int,
                                         expert_model_parallel_size: int,
                                         expert_distribution: Optional[List[List[int]]] = None) -> List[int]:
    """The expert indices held by ``expert_parallel_rank``: its contiguous block of ``total_number_of_experts /
    expert_model_parallel_size`` experts, or ``expert_distribution[expert_parallel_rank]`` when a distribution is given
    (it must list every expert, one list per rank). With expert parallelism of size 1, rank 0 holds every expert."""
    if not isinstance(expert_model_parallel_size, int) or expert_model_parallel_size < 1:
        raise ValueError(f"expert_model_parallel_size={expert_model_parallel_size!r} must be an int >= 1")
    if total_number_of_experts % expert_model_parallel_size != 0:
        raise ValueError(
            f"total_number_of_experts={total_number_of_experts} is not a multiple of "
            f"expert_model_parallel_size={expert_model_parallel_size}"
        )
    if not 0 <= expert_parallel_rank < expert_model_parallel_size:
        raise ValueError(
            f"expert_parallel_rank={expert_parallel_rank} is outside 0..{expert_model_parallel_size - 1} "
            f"(expert_model_parallel_size={expert_model_parallel_size})"
        )
    if expert_distribution:
        if len(expert_distribution) != expert_model_parallel_size:
            raise ValueError(
                f"expert_distribution has {len(expert_distribution)} entries ({expert_distribution}); it needs one per "
                f"expert-parallel rank: expert_model_parallel_size={expert_model_parallel_size}"
            )
        listed = sorted(e for experts in expert_distribution for e in experts)
        if set(listed) != set(range(total_number_of_experts)):
            raise ValueError(
                f"expert_distribution={expert_distribution} does not list exactly the experts "
                f"0..{total_number_of_experts - 1} (total_number_of_experts={total_number_of_experts})"
            )
        return list(expert_distribution[expert_parallel_rank])
    per_rank = total_number_of_experts // expert_model_parallel_size
    return list(range(expert_parallel_rank * per_rank, (expert_parallel_rank + 1) * per_rank))


# ---- NxD's set_* functions: nxdtp's topology is fixed, so only the value it already has is accepted -------------------

def _accept_only_current(call: str, value, current: int, why: str, hint: str = "") -> None:
    """Accept ``value`` if it is what the topology already has; otherwise raise naming ``call``, the current value and
    why it is fixed."""
    topology = _TOPOLOGY
    if topology is None:
        raise RuntimeError(
            f"{call}: nxdtp's topology is fixed by initialize_model_parallel, which has not been called; call "
            "initialize_model_parallel(tensor_model_parallel_size=...) instead of setting sizes and ranks"
        )
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{call}: expected an int, got {value!r} of type {type(value).__name__}")
    if value != current:
        raise ValueError(
            f"{call}: nxdtp's topology is fixed by initialize_model_parallel (tensor_model_parallel_size="
            f"{topology.tensor_model_parallel_size}) and {why}; only the current value {current} is accepted{hint}"
        )


def set_tensor_model_parallel_size(world_size: int) -> None:
    call = f"set_tensor_model_parallel_size({world_size!r})"
    current = get_tensor_model_parallel_size() if _TOPOLOGY is not None else None
    _accept_only_current(call, world_size, current, "cannot be changed afterwards",
                         f". To use another size, call destroy_model_parallel() and then "
                         f"initialize_model_parallel(tensor_model_parallel_size={world_size!r})")


def set_tensor_model_parallel_rank(rank: int) -> None:
    current = get_tensor_model_parallel_rank() if _TOPOLOGY is not None else None
    _accept_only_current(f"set_tensor_model_parallel_rank({rank!r})", rank, current,
                         f"global rank {_global_rank_or_minus_one()} has tensor-parallel rank {current}")


def set_expert_model_parallel_size(world_size: int) -> None:
    current = get_expert_model_parallel_size() if _TOPOLOGY is not None else None
    _accept_only_current(f"set_expert_model_parallel_size({world_size!r})", world_size, current,
                         "nxdtp has no expert parallelism (its expert model parallel size is 1)")


def set_expert_model_parallel_rank(rank: int) -> None:
    current = get_expert_model_parallel_rank() if _TOPOLOGY is not None else None
    _accept_only_current(f"set_expert_model_parallel_rank({rank!r})", rank, current,
                         "nxdtp has no expert parallelism (every rank has expert model parallel rank 0)")


def set_context_model_parallel_size(world_size: int) -> None:
    current = get_context_model_parallel_size() if _TOPOLOGY is not None else None
    _accept_only_current(f"set_context_model_parallel_size({world_size!r})", world_size, current,
                         "nxdtp has no context parallelism (its context model parallel size is 1)")


# ---- NxD's optional groups (token shuffle, kv-shared, speculative draft, pipeline gloo): the size-1 case ---------------
# NxD builds each after initialize_model_parallel, on request. nxdtp accepts size 1, whose groups are the singleton
# groups, and records the request in the topology (destroy_model_parallel forgets it with the topology).

_OPTIONAL_GROUP_INIT = {
    "token_shuffle": "initialize_token_shuffle_group(token_shuffle_group_size=1)",
    "kv_shared": "initialize_kv_group(kv_shared_group_size=1)",
    "speculative_draft": "initialize_speculative_draft_group(group_size=1)",
    "pp_gloo": "initialize_pp_gloo_groups()",
}


def _initialize_optional_group(kind: str, call: str, argument: str, value, why: str) -> None:
    global _TOPOLOGY
    topology = get_topology()
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{call}: {argument} must be an int, got {value!r} of type {type(value).__name__}")
    if value != 1:
        raise ValueError(f"{call}: {argument}={value} is not supported: {why}; only {argument}=1 is")
    _TOPOLOGY = dataclasses.replace(topology, optional_groups=topology.optional_groups | {kind})


def _optional_group(kind: str) -> ParallelGroup:
    topology = get_topology()
    if kind not in topology.optional_groups:
        raise RuntimeError(f"the {kind.replace('_', '-')} group is not initialized: call "
                           f"parallel_state.{_OPTIONAL_GROUP_INIT[kind]} first (after initialize_model_parallel)")
    return topology.singleton


def _forget_optional_group(kind: str) -> None:
    global _TOPOLOGY
    if _TOPOLOGY is not None:
        _TOPOLOGY = dataclasses.replace(_TOPOLOGY, optional_groups=_TOPOLOGY.optional_groups - {kind})


def initialize_token_shuffle_group(token_shuffle_group_size: int = 1) -> None:
    """Token shuffling (an MoE feature) of size 1, that is no shuffling: each rank's token-shuffle group is the rank."""
    _initialize_optional_group(
        "token_shuffle", f"initialize_token_shuffle_group({token_shuffle_group_size!r})", "token_shuffle_group_size",
        token_shuffle_group_size, "nxdtp does not shuffle tokens across data-parallel ranks (an MoE feature) and "
        "builds no token-shuffle groups")


def get_token_shuffle_group(as_list: bool = False):
    return _group_or_list(_optional_group("token_shuffle"), as_list)


def get_token_shuffle_replica_groups() -> List[List[int]]:
    return _optional_group("token_shuffle").replica_groups_as_lists()


def get_token_shuffle_group_size() -> int:
    return _optional_group("token_shuffle").size


def destroy_token_shuffle_group() -> None:
    _forget_optional_group("token_shuffle")


def initialize_kv_group(kv_shared_group_size: int = 1, sequential_ranks_in_group: bool = False) -> None:
    """KV-shared groups of size 1 (no KV head shared across ranks): each rank's group is the rank alone, whatever
    ``sequential_ranks_in_group`` says (see arrange_kv_groups)."""
    _initialize_optional_group(
        "kv_shared", f"initialize_kv_group({kv_shared_group_size!r})", "kv_shared_group_size", kv_shared_group_size,
        "nxdtp builds no kv-shared groups (NxD's grouping of tensor-parallel ranks that hold the same KV heads)")


def get_kv_shared_group(as_list: bool = False):
    return _group_or_list(_optional_group("kv_shared"), as_list)


def get_kv_shared_replica_groups() -> List[List[int]]:
    return _optional_group("kv_shared").replica_groups_as_lists()


def get_kv_shared_group_size() -> int:
    return _optional_group("kv_shared").size


def destroy_kv_group() -> None:
    _forget_optional_group("kv_shared")


def initialize_speculative_draft_group(group_size: int = 1) -> None:
    """Speculative-decoding draft groups of size 1: each rank's group is the rank alone."""
    _initialize_optional_group(
        "speculative_draft", f"initialize_speculative_draft_group({group_size!r})", "group_size", group_size,
        "nxdtp does no speculative decoding and builds no draft-model groups")


def get_speculative_draft_group(as_list: bool = False):
    return _group_or_list(_optional_group("speculative_draft"), as_list)


def get_speculative_draft_replica_groups() -> List[List[int]]:
    return _optional_group("speculative_draft").replica_groups_as_lists()


def initialize_pp_gloo_groups() -> None:
    """The gloo group of each rank's pipeline group, for pipeline metadata on the host: the rank alone. Idempotent."""
    # Always the size-1 case: the pipeline has one stage, so the call has nothing to refuse.
    _initialize_optional_group("pp_gloo", "initialize_pp_gloo_groups()", "pipeline_model_parallel_size",
                               get_pipeline_model_parallel_size(), "nxdtp has no pipeline parallelism")


def get_pp_gloo_group():
    """The gloo process group of this rank's pipeline group (this rank alone), after initialize_pp_gloo_groups()."""
    return _optional_group("pp_gloo").cpu_process_group


_HARDWARE_NAMES = ("trn1", "trn2", "trn3")


def arrange_kv_groups(num_tensor_model_parallel_groups: int = 1, tensor_model_parallel_size: int = 1,
                      kv_shared_group_size: int = 1, sequential_ranks_in_group: bool = False,
                      hardware_type="trn1") -> List[List[int]]:
    """Rank lists of the kv-shared groups inside each TP group of ``tensor_model_parallel_size`` contiguous ranks.

    Sequential (or ``hardware_type`` "trn2", which keeps each KV head on adjacent ranks): blocks of
    ``kv_shared_group_size`` contiguous ranks. Otherwise interleaved: ranks ``tp / kv_shared_group_size`` apart, so
    neighbouring ranks hold different KV heads. ``hardware_type`` is a name ("trn1", "trn2", "trn3") or NxD's
    ``hardware`` enum. For TP groups [0, 1, 2, 3] and size 2: sequential [[0, 1], [2, 3]], interleaved [[0, 2], [1, 3]].
    """
    for name, value in (("num_tensor_model_parallel_groups", num_tensor_model_parallel_groups),
                        ("tensor_model_parallel_size", tensor_model_parallel_size),
                        ("kv_shared_group_size", kv_shared_group_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    if tensor_model_parallel_size % kv_shared_group_size != 0:
        raise ValueError(f"kv_shared_group_size={kv_shared_group_size} does not divide "
                         f"tensor_model_parallel_size={tensor_model_parallel_size}")
    hardware_name = getattr(hardware_type, "value", hardware_type)
    if isinstance(hardware_name, str):
        hardware_name = hardware_name.lower()
    if hardware_name not in _HARDWARE_NAMES and not isinstance(hardware_type, enum.Enum):
        raise ValueError(f"hardware_type={hardware_type!r} is not one of {list(_HARDWARE_NAMES)} (or NxD's hardware enum)")
    tp, kv = tensor_model_parallel_size, kv_shared_group_size
    groups = []
    for first in range(0, num_tensor_model_parallel_groups * tp, tp):
        if sequential_ranks_in_group or hardware_name == "trn2":
            groups += [list(range(start, start + kv)) for start in range(first, first + tp, kv)]
        else:
            groups += [list(range(first + offset, first + tp, tp // kv)) for offset in range(tp // kv)]
    return groups


def get_zero1_sharding_groups() -> List[List[int]]:
    """The groups over which a ZeRO-1 optimizer shards its state by default: NxD's data x context parallel groups,
    which with context and pipeline parallelism of size 1 are the data-parallel groups."""
    return get_data_parallel_replica_groups()


# ---- ZeRO-1 sharding groups: any DP-aligned partition ----------------------------------------------------------------

def dp_aligned_sharding_examples(topology: Topology) -> Dict[int, List[List[int]]]:
    """For each valid sharding group size k (the divisors of the DP size), one DP-aligned sharding: each DP group cut
    into blocks of k consecutive members."""
    dp_lists = topology.data_parallel.replica_groups_as_lists()
    dp = topology.data_parallel_size
    return {k: [g[i:i + k] for g in dp_lists for i in range(0, dp, k)] for k in range(1, dp + 1) if dp % k == 0}


def _parse_rank_lists(sharding_groups: Any) -> Optional[List[List[int]]]:
    if isinstance(sharding_groups, (str, bytes)):
        return None
    try:
        lists = [list(g) for g in sharding_groups]
    except TypeError:
        return None
    for g in lists:
        for r in g:
            if isinstance(r, bool) or not isinstance(r, int):
                return None
    return lists


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
    dp_lists = topology.data_parallel.replica_groups_as_lists()
    lists = _parse_rank_lists(sharding_groups)
    reason = None
    if lists is None:
        reason = "it is not a list of lists of global ranks (ints)"
    else:
        lists = sorted(sorted(g) for g in lists)
        flat = [r for g in lists for r in g]
        dp_of = {r: i for i, g in enumerate(dp_lists) for r in g}
        outside = sorted({r for r in flat if r not in dp_of})
        repeated = sorted(r for r, n in collections.Counter(flat).items() if n > 1)
        missing = sorted(set(dp_of) - set(flat))
        sizes = sorted({len(g) for g in lists})
        if outside:
            reason = f"ranks {outside} are not in the world of {topology.world_size}"
        elif repeated:
            reason = f"ranks {repeated} are in more than one group"
        elif missing:
            reason = f"ranks {missing} are in no group (the groups must cover every rank of the world)"
        elif sizes != [len(lists[0])]:
            reason = f"the groups have different sizes {sizes}"
        else:
            crossing = [g for g in lists if len({dp_of[r] for r in g}) > 1]
            if crossing:
                reason = f"groups {crossing} span several data-parallel groups"
    if reason is not None:
        examples = "; ".join(f"size {k}: {v}" for k, v in dp_aligned_sharding_examples(topology).items())
        raise ValueError(
            f"ZeRO-1 sharding groups {sharding_groups!r} are not DP-aligned: {reason}. Valid sharding groups cut each "
            f"data-parallel group of {dp_lists} into groups of one size k dividing the DP size "
            f"{topology.data_parallel_size} (every rank in exactly one group), for example {examples}; None means the "
            f"data-parallel groups")
    position = {r: i for g in lists for i, r in enumerate(g)}
    replicas = [[r for r in d if position[r] == i] for d in dp_lists for i in range(len(lists[0]))]
    return lists, sorted(replicas)


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
    global _TOPOLOGY
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
            _new_groups_of_kind(kind, lists, _GROUP_TIMEOUT, process_groups, cpu_process_groups)
        # No rank leaves before every rank has made every group (see initialize_model_parallel).
        dist.all_reduce(torch.zeros(1), group=topology.world.cpu_process_group)

    def group(kind, lists):
        mine = next(g for g in lists if topology.rank in g)
        return ParallelGroup(kind=kind, ranks=tuple(mine), replica_groups=tuple(tuple(g) for g in lists),
                             process_group=process_groups.get((kind, tuple(mine))), global_rank=topology.rank,
                             cpu_process_group=cpu_process_groups.get((kind, tuple(mine))))

    sharding, replica = group("zero1_sharding", shard_lists), group("zero1_replica", replica_lists)
    if _TOPOLOGY is topology:
        _TOPOLOGY = dataclasses.replace(topology, zero1_groups=topology.zero1_groups + ((key, sharding, replica),))
    return sharding, replica


# ---- misc NxD helpers --------------------------------------------------------------------------------------------------

def is_tcp_store_available() -> bool:
    """Whether torch.distributed exposes the default process group's store (NxD's TCP store)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store  # noqa: F401
    except ImportError:
        return False
    return True


def get_tcp_store():
    """The key-value store of the default process group (the rendezvous store, a TCPStore under env:// and torchrun)."""
    if not is_tcp_store_available():
        raise RuntimeError("this torch has no torch.distributed.distributed_c10d._get_default_store; no store to return")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("get_tcp_store(): torch.distributed is not initialized: call "
                           "torch.distributed.init_process_group(...) first")
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


_AOT_MODE = False


def set_aot_mode(mode: bool) -> None:
    """NxD's ahead-of-time (shape-only) tracing mode makes its layers skip weight initialization. nxdtp's layers always
    initialise their weights, so only a false ``mode`` is accepted."""
    if mode:
        raise ValueError(
            f"set_aot_mode({mode!r}): nxdtp has no ahead-of-time (shape-only) tracing mode: its parallel layers always "
            "initialise their weights; only set_aot_mode(False) is accepted"
        )


def get_aot_mode() -> bool:
    """Always False: see set_aot_mode."""
    return _AOT_MODE


def _global_rank_or_minus_one() -> int:
    if _TOPOLOGY is not None:
        return _TOPOLOGY.rank
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return -1


def rmsg(msg: str) -> str:
    """``msg`` prefixed with this rank's global, pipeline, tensor, data and context parallel ranks (-1 when model
    parallel is not initialized; global rank -1 when torch.distributed is not initialized either)."""
    if _TOPOLOGY is not None:
        pp, tp, dp, cp = (get_pipeline_model_parallel_rank(), get_tensor_model_parallel_rank(),
                          get_data_parallel_rank(), get_context_model_parallel_rank())
    else:
        pp = tp = dp = cp = -1
    return f"[rank_{_global_rank_or_minus_one()}_pp{pp}_tp{tp}_dp{dp}_cp{cp}] {msg}"


def rmsg_ep(msg: str) -> str:
    """``msg`` prefixed with this rank's pipeline, expert, tensor and data parallel ranks (requires initialization)."""
    return (f"[pp{get_pipeline_model_parallel_rank()}|ep{get_expert_model_parallel_rank()}|"
            f"tp{get_tensor_model_parallel_rank()}|dp{get_data_parallel_rank()}] {msg}")


def get_rank_info_str() -> str:
    """``"DP_<dp rank>_TP_<tp rank>_PP_<pp rank>"``, or ``"model_parallel_uninitialized"``."""
    if not model_parallel_is_initialized():
        return "model_parallel_uninitialized"
    return (f"DP_{get_data_parallel_rank()}_TP_{get_tensor_model_parallel_rank()}_"
            f"PP_{get_pipeline_model_parallel_rank()}")


def is_global_rank_zero() -> bool:
    return get_rank() == 0


def get_world_size() -> int:
    return get_topology().world_size


def get_rank() -> int:
    return get_topology().rank


__all__: Sequence[str] = [
    "ParallelGroup", "Topology", "build_topology", "simulated_topology", "get_topology",
    "initialize_model_parallel", "destroy_model_parallel", "model_parallel_is_initialized",
    "tensor_parallel_group", "data_parallel_group", "rank_tensor",
    "get_tensor_model_parallel_group", "get_tensor_model_parallel_size", "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank", "get_tensor_model_parallel_replica_groups",
    "get_data_parallel_group", "get_data_parallel_size", "get_data_parallel_rank", "get_data_parallel_src_rank",
    "get_data_parallel_replica_groups", "get_world_group",
    "get_pipeline_model_parallel_group", "get_pipeline_model_parallel_replica_groups",
    "get_pipeline_model_parallel_size", "get_pipeline_model_parallel_rank", "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank", "get_pipeline_model_parallel_sr_group", "get_next_rank_group",
    "get_next_rank_replica_groups", "get_prev_rank_group", "get_prev_rank_replica_groups", "create_pg_with_ranks",
    "get_context_model_parallel_group", "get_context_model_parallel_replica_groups", "get_context_model_parallel_size",
    "get_context_model_parallel_rank", "get_context_model_parallel_src_tgt_pairs",
    "get_expert_model_parallel_group", "get_expert_model_parallel_replica_groups", "get_expert_model_parallel_size",
    "get_expert_model_parallel_rank", "get_expert_data_parallel_size", "get_expert_data_parallel_rank",
    "get_expert_data_parallel_group", "get_expert_data_parallel_replica_groups",
    "get_expert_parallel_rank_from_global_rank", "get_experts_for_expert_parallel_rank",
    "set_tensor_model_parallel_size", "set_tensor_model_parallel_rank", "set_expert_model_parallel_size",
    "set_expert_model_parallel_rank", "set_context_model_parallel_size",
    "initialize_token_shuffle_group", "get_token_shuffle_group", "get_token_shuffle_replica_groups",
    "get_token_shuffle_group_size", "destroy_token_shuffle_group",
    "initialize_kv_group", "get_kv_shared_group", "get_kv_shared_replica_groups", "get_kv_shared_group_size",
    "destroy_kv_group", "arrange_kv_groups",
    "initialize_speculative_draft_group", "get_speculative_draft_group", "get_speculative_draft_replica_groups",
    "initialize_pp_gloo_groups", "get_pp_gloo_group", "get_zero1_sharding_groups", "zero1_groups",
    "dp_aligned_rank_lists", "dp_aligned_sharding_examples",
    "is_tcp_store_available", "get_tcp_store", "set_aot_mode", "get_aot_mode", "rmsg", "rmsg_ep", "get_rank_info_str",
    "is_global_rank_zero", "get_world_size", "get_rank",
]

"""Topology of a tensor-parallel x data-parallel world.

The topology is one immutable value. Tensor-parallel (TP) groups are blocks of contiguous ranks, so TP traffic stays inside
a node; data-parallel (DP) groups take one rank from each TP group (strided). The module keeps NxD's function names, all of
which read from the installed topology.

A topology can be built for a world this process is not part of (``simulated_topology(world_size=8, rank=5, ...)``): it has
the same groups and replica-group lists but no process groups, which is what XLA lowering tests need to trace one rank's
program in a single process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
from typing import Iterator, List, Optional, Sequence

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
    )


_TOPOLOGY: Optional[Topology] = None
# Every process group initialize_model_parallel created, this rank's or not, so destroy_model_parallel can release them.
_OWNED_PROCESS_GROUPS: List[object] = []


# NxD options of initialize_model_parallel that nxdtp does not implement, with the only value it accepts.
_NXD_DEFAULTS = {"context_parallel_size": 1, "expert_model_parallel_size": 1, "skip_collective_init": False,
                 "lnc_size": 1, "mesh_only": False}


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              timeout: Optional[datetime.timedelta] = None, **nxd_options) -> None:
    """Split the initialized torch.distributed world into TP groups of contiguous ranks and strided DP groups.

    Every rank must call this (group creation is collective). Each TP/DP group gets a process group of the world's
    default backend (on an "xla" world with the full mesh, as NxD's) and, when that backend is not gloo, a gloo group
    over the same ranks for CPU tensors; nxdtp.comm picks one from the tensor's device (XLA tensors use replica groups).
    ``timeout`` bounds every collective on these groups (torch.distributed's default otherwise: 30 minutes for gloo), so
    a rank that died is reported instead of waited for.
    """
    global _TOPOLOGY
    for name, value in nxd_options.items():
        if name not in _NXD_DEFAULTS:
            raise TypeError(f"initialize_model_parallel() got an unexpected keyword argument {name!r}")
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
    # CPU tensors are everywhere (model build before the device move, pretrained loading, host-side metrics), and the
    # default backend of an XLA, NCCL or other device world refuses them: such worlds get a gloo twin of every group.
    # A world whose default already maps CPU tensors to gloo ("cpu:gloo,cuda:nccl") needs none.
    separate_cpu_groups = "cpu:gloo" not in dist.get_backend_config().split(",")
    process_groups, cpu_process_groups = {}, {}
    for kind, lists in (("tensor", tensor_parallel_rank_lists(world_size, tensor_model_parallel_size)),
                        ("data", data_parallel_rank_lists(world_size, tensor_model_parallel_size))):
        for ranks in lists:
            key = (kind, tuple(ranks))
            # new_group is collective over the whole world: every rank creates every group, in the same order.
            process_groups[key] = dist.new_group(ranks, timeout=timeout, **_group_options(default_backend, lists))
            cpu_process_groups[key] = (dist.new_group(ranks, backend="gloo", timeout=timeout) if separate_cpu_groups
                                       else process_groups[key])
    # Barriers and object exchange (checkpoint coordination) go over the whole world on the host.
    host_group = dist.new_group(backend="gloo", timeout=timeout) if separate_cpu_groups else None
    _OWNED_PROCESS_GROUPS.extend(list(process_groups.values()) + [host_group]
                                 + (list(cpu_process_groups.values()) if separate_cpu_groups else []))
    _TOPOLOGY = _make_topology(world_size, rank, tensor_model_parallel_size, process_groups, host_group,
                               simulated=False, cpu_process_groups=cpu_process_groups)


def _group_options(default_backend: str, all_groups: List[List[int]]) -> dict:
    """torch_xla's new_group records only the caller's ranks as the group's mesh, so plain torch.distributed
    collectives on it would name incomplete replica groups; NxD passes every group of the kind, and so does nxdtp."""
    if default_backend == "xla":
        return {"pg_options": {"xla_pg_options": {"mesh": [list(g) for g in all_groups]}}}
    return {}


def destroy_model_parallel() -> None:
    """Forget the topology and release the process groups initialize_model_parallel created."""
    global _TOPOLOGY
    _TOPOLOGY = None
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


def group_of(process_group=None) -> ParallelGroup:
    """The ParallelGroup behind an NxD ``process_group=`` / ``tensor_model_parallel_group=`` argument.

    None means the tensor-parallel group. nxdtp's own groups (either process group of the TP or DP group) map to their
    ParallelGroup, and a ParallelGroup passes through. Any other torch.distributed group (one made by
    ``dist.new_group``) becomes a group of kind "custom" over its ranks: its process group serves CPU tensors only when
    it is a gloo group, and XLA tensors only when it carries the full replica-group mesh (torch_xla's
    ``pg_options={"xla_pg_options": {"mesh": ...}}``), which nxdtp.comm checks.
    """
    if process_group is None:
        return tensor_parallel_group()
    if isinstance(process_group, ParallelGroup):
        return process_group
    topology = get_topology()
    for own in (topology.tensor_parallel, topology.data_parallel):
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


def get_pipeline_model_parallel_size() -> int:
    get_topology()
    return 1


def get_pipeline_model_parallel_rank() -> int:
    get_topology()
    return 0


# Parallelism nxdtp does not do (context, expert): NxD's values for size 1. The expert data-parallel group of a
# world without expert parallelism is the data-parallel group.

def get_context_model_parallel_size() -> int:
    get_topology()
    return 1


def get_context_model_parallel_rank() -> int:
    get_topology()
    return 0


def get_expert_model_parallel_size() -> int:
    get_topology()
    return 1


def get_expert_model_parallel_rank() -> int:
    get_topology()
    return 0


def get_expert_data_parallel_size() -> int:
    return get_data_parallel_size()


def get_expert_data_parallel_rank() -> int:
    return get_data_parallel_rank()


def get_expert_data_parallel_group(as_list: bool = False):
    return get_data_parallel_group(as_list)


def is_global_rank_zero() -> bool:
    return get_rank() == 0


def get_world_size() -> int:
    return get_topology().world_size


def get_rank() -> int:
    return get_topology().rank


__all__: Sequence[str] = [
    "ParallelGroup", "Topology", "build_topology", "simulated_topology", "get_topology",
    "initialize_model_parallel", "destroy_model_parallel", "model_parallel_is_initialized",
    "tensor_parallel_group", "data_parallel_group",
    "get_tensor_model_parallel_group", "get_tensor_model_parallel_size", "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank", "get_tensor_model_parallel_replica_groups",
    "get_data_parallel_group", "get_data_parallel_size", "get_data_parallel_rank", "get_data_parallel_src_rank",
    "get_data_parallel_replica_groups", "get_pipeline_model_parallel_size", "get_pipeline_model_parallel_rank",
    "get_context_model_parallel_size", "get_context_model_parallel_rank", "get_expert_model_parallel_size",
    "get_expert_model_parallel_rank", "get_expert_data_parallel_size", "get_expert_data_parallel_rank",
    "get_expert_data_parallel_group", "is_global_rank_zero", "get_world_size", "get_rank",
]

"""The one module that talks to a collective backend.

The backend follows the tensor: a tensor on an XLA device goes to ``torch_xla.core.xla_model`` collectives with the
group's replica-group list; a CPU tensor goes to ``torch.distributed`` over the group's gloo group; any other device's
tensor (CUDA, a PrivateUse1 device, ...) over the group's process group of the world's default backend (NCCL, or
whatever backend the world was started with). Nothing else in nxdtp chooses a backend.

All functions are functional: they return a new tensor and never modify their input, so autograd Functions can call
them. A group of size 1 needs no communication and returns the input unchanged (as a result, not a copy).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterable, Iterator, List, Optional

import torch
import torch.distributed as dist

from .topology import ParallelGroup, get_topology, rank_tensor

_REDUCE_OPS = ("sum", "max", "min")


def is_xla(device: torch.device) -> bool:
    """Whether ``device`` is an XLA device: torch_xla traces its ops into a graph rather than launching each one."""
    return device.type == "xla"


def _is_xla(tensor: torch.Tensor) -> bool:
    return is_xla(tensor.device)


def _xla_model():
    import torch_xla.core.xla_model as xm

    return xm


def _check_xla_world(group: ParallelGroup) -> None:
    """XLA collectives run over the runtime's replicas; refuse to run when those are not the topology's world.

    Under torchrun with PJRT_DEVICE=CPU every process is a runtime world of 1, and xm.all_reduce silently returns its
    input: that would train with wrong numbers instead of failing.
    """
    import torch_xla.runtime as xr

    topology = get_topology()
    covered = sorted(rank for ranks in group.replica_groups for rank in ranks)
    if covered != list(range(topology.world_size)):
        raise RuntimeError(
            f"the {group.kind} group {list(group.ranks)} has replica groups {group.replica_groups_as_lists()}, which "
            f"do not partition the world of {topology.world_size} ranks; XLA collectives need every group of the kind: "
            "make the group with pg_options={'xla_pg_options': {'mesh': [...all groups...]}}, or use nxdtp's groups"
        )
    runtime_world, runtime_ordinal = xr.world_size(), xr.global_ordinal()
    if runtime_world != topology.world_size or runtime_ordinal != topology.rank:
        raise RuntimeError(
            f"XLA runtime world size {runtime_world} (ordinal {runtime_ordinal}) differs from the nxdtp topology "
            f"(world size {topology.world_size}, rank {topology.rank}) for a {group.kind}-parallel collective over "
            f"replica groups {group.replica_groups_as_lists()}. XLA collectives would not reach the other ranks. "
            "Launch with an XLA runtime that spans all ranks (e.g. torch_xla.launch on Neuron/TPU), or keep tensors "
            "off the XLA device to use torch.distributed (gloo/nccl)."
        )


def _process_group(group: ParallelGroup, tensor: torch.Tensor):
    process_group = group.process_group_for(tensor.device.type)
    if process_group is None and group.process_group is not None:
        raise RuntimeError(
            f"the {group.kind} group {list(group.ranks)} is a {dist.get_backend(group.process_group)!r} group, which "
            f"cannot carry a {tensor.device} tensor; make the group with dist.new_group(ranks, backend='gloo') for CPU "
            "tensors, or move the tensor to the group's device"
        )
    if process_group is None:
        # group=None would silently mean "the whole world" to torch.distributed.
        raise RuntimeError(
            f"the {group.kind}-parallel group {list(group.ranks)} has no torch.distributed process group (the topology "
            f"is simulated); only XLA tensors can be traced under a simulated topology, got a {tensor.device} tensor"
        )
    return process_group


def _check_op(op: str) -> None:
    if op not in _REDUCE_OPS:
        raise ValueError(f"reduce op {op!r} is not supported; valid ops are {list(_REDUCE_OPS)}")


def _check_dim(tensor: torch.Tensor, dim: int) -> int:
    if not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(tensor.shape)}")
    return dim % tensor.dim()


def _check_divisible(tensor: torch.Tensor, dim: int, group: ParallelGroup, what: str) -> int:
    """``dim`` made non-negative, once the group's size is known to divide it."""
    dim = _check_dim(tensor, dim)
    if tensor.shape[dim] % group.size != 0:
        raise ValueError(
            f"{what}: dimension {dim} of shape {tuple(tensor.shape)} has size {tensor.shape[dim]}, "
            f"which the {group.kind}-parallel group size {group.size} does not divide"
        )
    return dim


def all_reduce(tensor: torch.Tensor, group: ParallelGroup, op: str = "sum") -> torch.Tensor:
    _check_op(op)
    if group.size == 1:
        return tensor
    if _is_xla(tensor):
        _check_xla_world(group)
        xm = _xla_model()
        reduce_type = {"sum": xm.REDUCE_SUM, "max": xm.REDUCE_MAX, "min": xm.REDUCE_MIN}[op]
        return xm.all_reduce(reduce_type, tensor, groups=group.replica_groups_as_lists())
    out = tensor.contiguous().clone()
    dist_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    dist.all_reduce(out, op=dist_op, group=_process_group(group, out))
    return out


def host_max(value: int, group: ParallelGroup, like: torch.Tensor) -> int:
    """The largest of the ranks' ``value`` over ``group``, on the host, for a step that works on ``like``'s device. On
    XLA, whose graphs fix shapes when traced, every rank's value must already agree: this rank's is returned, with no
    host round trip inside the step."""
    if group.size == 1 or _is_xla(like):
        return value
    return int(all_reduce(torch.tensor([value]), group, op="max").item())


def all_gather(tensor: torch.Tensor, group: ParallelGroup, dim: int = -1) -> torch.Tensor:
    """Concatenate the group's tensors along ``dim`` in group-rank order."""
    dim = _check_dim(tensor, dim)
    if group.size == 1:
        return tensor
    if _is_xla(tensor):
        _check_xla_world(group)
        # pin_layout=False lowers to a native all-gather; the pinned form is emulated with pad + all-reduce.
        return _xla_model().all_gather(tensor, dim=dim, groups=group.replica_groups_as_lists(), pin_layout=False)
    # all_gather_into_tensor stacks along dim 0 of contiguous memory: gather with `dim` moved to the front.
    moved = tensor.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] * group.size,) + tuple(moved.shape[1:]), dtype=tensor.dtype,
                      device=tensor.device)
    dist.all_gather_into_tensor(out, moved, group=_process_group(group, moved))
    return out.movedim(0, dim).contiguous()


def reduce_scatter(tensor: torch.Tensor, group: ParallelGroup, dim: int = -1) -> torch.Tensor:
    """Sum over the group, then keep this rank's 1/size slice along ``dim``."""
    dim = _check_divisible(tensor, dim, group, "reduce_scatter")
    if group.size == 1:
        return tensor
    if _is_xla(tensor):
        _check_xla_world(group)
        xm = _xla_model()
        return xm.reduce_scatter(xm.REDUCE_SUM, tensor, scale=1.0, scatter_dim=dim, shard_count=group.size,
                                 groups=group.replica_groups_as_lists(), pin_layout=False)
    # reduce_scatter_tensor works on dim 0 of contiguous memory: move `dim` to the front and back.
    moved = tensor.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // group.size,) + tuple(moved.shape[1:]), dtype=tensor.dtype,
                      device=tensor.device)
    dist.reduce_scatter_tensor(out, moved, group=_process_group(group, out))
    return out.movedim(0, dim).contiguous()


def all_to_all(tensor: torch.Tensor, group: ParallelGroup, split_dim: int, concat_dim: int) -> torch.Tensor:
    """Cut ``tensor`` into ``group.size`` equal chunks along ``split_dim`` and send chunk i to group rank i; return
    the chunks received, in group-rank order, concatenated along ``concat_dim`` (XLA's ``all_to_all``)."""
    split_dim, concat_dim = _check_divisible(tensor, split_dim, group, "all_to_all"), _check_dim(tensor, concat_dim)
    if group.size == 1:
        return tensor
    if _is_xla(tensor):
        _check_xla_world(group)
        return _xla_model().all_to_all(tensor, split_dimension=split_dim, concat_dimension=concat_dim,
                                       split_count=group.size, groups=group.replica_groups_as_lists(),
                                       pin_layout=False)
    # all_to_all_single exchanges equal blocks of dim 0: stack the chunks there.
    chunks = torch.stack(tensor.chunk(group.size, dim=split_dim))
    received = torch.empty_like(chunks)
    dist.all_to_all_single(received, chunks, group=_process_group(group, chunks))
    return torch.cat(received.unbind(0), dim=concat_dim)


def broadcast(tensor: torch.Tensor, group: ParallelGroup, src_group_rank: int = 0) -> torch.Tensor:
    """Every rank of the group receives the tensor held by group rank ``src_group_rank``."""
    if not 0 <= src_group_rank < group.size:
        raise ValueError(f"src_group_rank={src_group_rank} is outside the {group.kind}-parallel group of size "
                         f"{group.size}")
    if group.size == 1:
        return tensor
    if _is_xla(tensor):
        # Only the source contributes to the sum. The choice is data (the rank tensor), so every rank traces the same
        # graph; `where`, not a product, so NaNs elsewhere cannot leak in.
        is_src = (rank_tensor(group, tensor.device) == src_group_rank).reshape(())
        return all_reduce(torch.where(is_src, tensor, torch.zeros_like(tensor)), group)
    out = tensor.contiguous().clone()
    dist.broadcast(out, src=group.ranks[src_group_rank], group=_process_group(group, out))
    return out


def materialize(tensors: Iterable[Any]) -> None:
    """Run the pending device computation now, so that later host reads of these tensors only copy.

    On XLA, reading a tensor whose graph is pending executes that graph on the reading rank alone: if it holds a
    collective (a step's DP gradient all-reduce) the other ranks never join and the job hangs, and if it does not, ranks
    still compile and run different graphs. Every rank must call this at the same point, before any rank-dependent read
    (checkpoint saving). Eager devices compute as they go: nothing to do.
    """
    if any(isinstance(t, torch.Tensor) and _is_xla(t) for t in tensors):
        import torch_xla

        torch_xla.sync()
        _xla_model().wait_device_ops()


@contextlib.contextmanager
def simulated_xla_runtime(world_size: int, rank: int) -> Iterator[None]:
    """Make torch_xla's runtime report a world of ``world_size`` with this process as ``rank``, for tracing one rank
    of a world this process is not part of (with ``parallel_state.simulated_topology``). Graphs traced inside must
    never execute: their collectives name ranks that do not exist.

    The collective token chains each XLA collective to the previous one; it is cleared on entry and exit so a traced
    graph holds only this rank's collectives, not those of a rank traced before it.
    """
    from unittest import mock

    import torch_xla.runtime as xr

    clear_xla_collective_token()
    try:
        with mock.patch.object(xr, "world_size", lambda: world_size), \
                mock.patch.object(xr, "global_ordinal", lambda: rank):
            yield
    finally:
        clear_xla_collective_token()


def clear_xla_collective_token() -> None:
    """Forget the pending collective token of the XLA device, so the next traced collective starts a fresh chain."""
    import torch_xla

    torch_xla._XLAC._set_all_reduce_token(_xla_model()._get_device_context().device, None)


# ---- host-side coordination (always torch.distributed; gloo on XLA and NCCL runs) ------------------------------------

# A thread may route its host-side collectives over a group of its own (``host_group_of_this_thread``): a background
# checkpoint writer then never meets the training loop's collectives on a shared group.
_THREAD_HOST_GROUP = threading.local()


def _host_process_group():
    topology = get_topology()
    if topology.simulated:
        raise RuntimeError("host-side collectives need a real process group; the installed topology is simulated")
    override = getattr(_THREAD_HOST_GROUP, "process_group", None)
    if override is not None:
        return override
    return topology.host_process_group  # None means the default (gloo) group


def new_host_group():
    """Collective over the world (every rank calls it at the same point): a new gloo group of every rank, for host-side
    coordination that must not share a group with other collectives, such as a checkpoint written on a background
    thread. Its timeout is the world's (torch.distributed's default when that cannot be read)."""
    timeout = None
    try:
        timeout = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - a backend without readable options: torch's default timeout
        timeout = None
    return dist.new_group(backend="gloo", timeout=timeout)


@contextlib.contextmanager
def host_group_of_this_thread(process_group) -> Iterator[None]:
    """Within the block, this thread's host-side collectives (``barrier``, ``all_gather_object`` over the world,
    ``raise_on_every_rank_if_any_failed``) go over ``process_group`` (from ``new_host_group``) instead of the world's
    host group; other threads are not affected."""
    previous = getattr(_THREAD_HOST_GROUP, "process_group", None)
    _THREAD_HOST_GROUP.process_group = process_group
    try:
        yield
    finally:
        _THREAD_HOST_GROUP.process_group = previous


def host_process_group():
    """The torch.distributed process group of this world's host-side (CPU) collectives, for a library that runs its own
    collectives on host objects and takes a ``process_group=`` (``torch.distributed.checkpoint.save`` / ``load``): a
    gloo group of every rank on XLA and NCCL-like worlds, None (the default group, itself gloo) on a gloo world. Within
    ``host_group_of_this_thread``, that thread's group."""
    return _host_process_group()


def barrier() -> None:
    dist.barrier(group=_host_process_group())


def xla_world_device() -> Optional[torch.device]:
    """This process's XLA device when the torch.distributed world's default backend is torch_xla's ``xla`` (where NxD
    puts every model), else None. The trainer API's default model device."""
    if not dist.is_initialized() or dist.get_backend() != "xla":
        return None
    import torch_xla

    return torch_xla.device()


def all_gather_object(obj: Any, group: Optional[ParallelGroup] = None) -> List[Any]:
    """Gather one picklable object from every rank of the world (or of ``group``, in its rank order), on the host."""
    if group is None:
        process_group, size = _host_process_group(), get_topology().world_size
    else:
        _host_process_group()  # refuses a simulated topology, as for the world
        process_group, size = group.process_group_for("cpu"), group.size
    out: List[Any] = [None] * size
    dist.all_gather_object(out, obj, group=process_group)
    return out


def raise_on_every_rank_if_any_failed(error: Optional[BaseException], what: str) -> None:
    """Collective: raise on every rank if any rank failed (a barrier when none did). A failed rank re-raises its own
    error; the others raise a RuntimeError naming the failed ranks and their errors. Use it where one rank can fail
    alone before a collective that the others would then wait in forever."""
    reports = all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
    failed = {rank: report for rank, report in enumerate(reports) if report is not None}
    if not failed:
        return
    if error is not None:
        raise error
    raise RuntimeError(f"{what} failed on rank(s) {sorted(failed)}: "
                       + "; ".join(f"rank {rank}: {report}" for rank, report in sorted(failed.items())))

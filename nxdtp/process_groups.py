"""The torch.distributed groups behind a topology: made collectively by every rank, owned until released.

nxdtp.topology decides which groups a topology has; this module makes them. Each group gets a process group of
the world's default backend (with the full mesh on an "xla" world) and, where that backend refuses CPU tensors, a gloo
twin. Every group made here is owned from the moment it exists, so ``release_owned_groups`` frees all of them, even
after a creation that failed part-way. Also here: the in-process world of one rank behind NxD's
``initialize_fallback_parallel_state``.
"""

from __future__ import annotations

import atexit
from typing import List, Optional

import torch
import torch.distributed as dist

# Every process group made here (by initialize_model_parallel or zero1_groups), this rank's or not.
_OWNED_PROCESS_GROUPS: List[object] = []
# The default group of the world of 1 made here, while it is the default group.
_SINGLE_PROCESS_WORLD: List[object] = []
# The exit handler, once registered.
_EXIT_HANDLER: List[object] = []


def needs_cpu_twins() -> bool:
    """Whether this world needs gloo twins of its groups. CPU tensors are everywhere (model build before the device
    move, pretrained loading, host-side metrics), and the default backend of an XLA, NCCL or other device world refuses
    them: such worlds get a gloo twin of every group. A world whose default already maps CPU tensors to gloo
    ("cpu:gloo,cuda:nccl") needs none."""
    return "cpu:gloo" not in dist.get_backend_config().split(",")


def new_owned_group(*args, **kwargs):
    """``dist.new_group(*args, **kwargs)``, owned from the moment it exists (and released at exit at the latest)."""
    _release_at_exit()
    group = dist.new_group(*args, **kwargs)
    _OWNED_PROCESS_GROUPS.append(group)
    return group


def _release_at_exit() -> None:
    """Have the interpreter's exit release what nxdtp made and still holds: its groups, and the world of 1 it made.
    A world the user made is the user's to destroy. This alone does not keep a finished process from being aborted at
    exit ("terminate called without an active exception"): the topology still references the groups, so their gloo
    threads live on into finalization; what does is that nxdtp leaves those threads no tensor of its own to free
    there (``wait_for_every_rank``)."""
    if not _EXIT_HANDLER:
        atexit.register(_release_everything_made_here)
        _EXIT_HANDLER.append(_release_everything_made_here)


def _release_everything_made_here() -> None:
    release_owned_groups()
    if _SINGLE_PROCESS_WORLD and dist.is_initialized() and dist.group.WORLD is _SINGLE_PROCESS_WORLD[0]:
        dist.destroy_process_group()
    _SINGLE_PROCESS_WORLD.clear()


def mesh_options(default_backend: str, all_groups: List[List[int]]) -> dict:
    """torch_xla's new_group records only the caller's ranks as the group's mesh, so plain torch.distributed
    collectives on it would name incomplete replica groups; NxD passes every group of the kind, and so does nxdtp."""
    if default_backend == "xla":
        return {"pg_options": {"xla_pg_options": {"mesh": [list(g) for g in all_groups]}}}
    return {}


def new_groups_of_kind(kind: str, lists: List[List[int]], timeout, process_groups: dict,
                       cpu_process_groups: dict) -> None:
    """Collective over the whole world: every rank creates every group of ``lists``, in the same order; each gets a
    process group of the default backend (with the full mesh on an "xla" world) and, where the world needs one, a
    gloo twin. Recorded under ``(kind, tuple(ranks))``."""
    default_backend = dist.get_backend()
    separate = needs_cpu_twins()
    for ranks in lists:
        key = (kind, tuple(ranks))
        process_groups[key] = new_owned_group(ranks, timeout=timeout, **mesh_options(default_backend, lists))
        cpu_process_groups[key] = (new_owned_group(ranks, backend="gloo", timeout=timeout) if separate
                                   else process_groups[key])


def wait_for_every_rank(world_cpu_group) -> None:
    """Return once every rank of the world has got here.

    new_group is not a barrier: with gloo, a rank's call returns once its own connections are up, while a peer may
    still be connecting to it. A rank that returned and then destroyed its groups (destroy_model_parallel, or its
    process ending) closed those connections under the peer, whose new_group then failed ("Connection closed by
    peer"), which a loaded machine made likely. So no rank leaves group creation before every rank has made every
    group. Over the world's gloo group (the backend for CPU tensors in every world, whatever its default).

    A barrier, not a collective on a tensor made here: gloo's worker thread drops its reference to a finished
    collective's tensors just after the caller's wait returns, and freeing a tensor that Python made takes the GIL.
    In a script that ends right after initialize_model_parallel the interpreter may be finalizing by then, and a
    thread that asks for the GIL during finalization is ended inside that C++ destructor: std::terminate, SIGABRT
    ("terminate called without an active exception"). A barrier holds no tensor.
    """
    dist.barrier(group=world_cpu_group)


def release_owned_groups() -> None:
    """Destroy every process group made here (the newest first)."""
    while _OWNED_PROCESS_GROUPS:
        group = _OWNED_PROCESS_GROUPS.pop()
        if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER and dist.is_initialized():
            dist.destroy_process_group(group)


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
        _release_at_exit()   # the user did not make this world, so nxdtp ends it
        _SINGLE_PROCESS_WORLD[:] = [dist.group.WORLD]
    return backend


def release_single_process_world() -> None:
    """Destroy the default torch.distributed world if it is a world of 1 (``initialize_single_process_world``'s);
    a world of several processes is left alone."""
    if dist.is_initialized() and dist.get_world_size() == 1:
        dist.destroy_process_group()


def join_gloo_world(rank: int, world_size: int, store_host: str, store_port: int,
                    timeout_s: Optional[float] = None) -> None:
    """Join a CPU world of ``world_size`` gloo processes whose rendezvous store (a ``TCPStore``) another process
    already hosts at ``store_host:store_port``; every rank joins it as a client. The world of the worker processes
    ``nxdtp verify`` starts (``nxdtp.verify.launch``); ``leave_world`` ends it."""
    import datetime

    store = dist.TCPStore(store_host, store_port, world_size=world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s or 300))
    kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, **kwargs)


def leave_world() -> None:
    """Release the groups made here, then destroy the default world (``join_gloo_world``'s)."""
    release_owned_groups()
    if dist.is_initialized():
        dist.destroy_process_group()


def host_rendezvous_store(world_size: int, timeout_s: float = 300):
    """A ``TCPStore`` this process hosts on a port the kernel picks (``store.port``), listening from now on, for
    ``world_size`` processes that join it with ``join_gloo_world``: no port is chosen first and bound later, so none
    can be taken in between."""
    import datetime

    return dist.TCPStore("127.0.0.1", 0, world_size=world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))

"""NxD's ``parallel_state`` over nxdtp's topology core (nxdtp.topology): every name NxD users call, at NxD's path.

The core's names (the topology, its groups, initialize / destroy, simulated topologies, ZeRO-1 groups) are re-exported
here as they are. Each NxD getter below reads one group of the installed topology. nxdtp does tensor, data and expert
parallelism: the getters of the kinds it does not do (pipeline, context, and the optional token-shuffle, kv-shared and
speculative-draft groups) return NxD's values for size 1: each rank's group of such a kind is the rank alone (the
topology's singleton group). NxD's set_* functions accept only the value the fixed topology already has.

This module imports only the core (and the in-process world of nxdtp.process_groups, which NxD users call here), and
the core never imports it; nxdtp's own modules may read either (the getters here are NxD's spelling of the core's
fields: ``get_tensor_model_parallel_rank()`` is ``tensor_parallel_group().rank``).
"""

from __future__ import annotations

import enum
from typing import Dict, List, NamedTuple, Optional

import torch.distributed as dist

from nxdtp.process_groups import initialize_single_process_world, single_process_backend  # noqa: F401 - NxD users' path
from nxdtp.topology import (
    ParallelGroup,
    Topology,
    build_topology,
    data_parallel_group,
    destroy_model_parallel,
    dp_aligned_rank_lists,
    dp_aligned_sharding_examples,
    expert_data_parallel_group,
    expert_parallel_group,
    get_topology,
    group_of,
    initialize_model_parallel,
    model_parallel_is_initialized,
    rank_tensor,
    replace_installed_topology,
    simulated_topology,
    tensor_parallel_group,
    zero1_groups,
)


def _process_group_or_lists(group: ParallelGroup, as_list: bool):
    """What NxD's ``get_*_group(as_list)`` returns: the process group, or with ``as_list`` every group's ranks."""
    return group.replica_groups_as_lists() if as_list else group.process_group


def _singleton() -> ParallelGroup:
    """This rank alone: NxD's pipeline and context model-parallel group, each of size 1."""
    return get_topology().singleton


def _world() -> ParallelGroup:
    return get_topology().world


# ---- tensor and data parallel: the groups nxdtp makes ---------------------------------------------------------------

def get_tensor_model_parallel_group(as_list: bool = False):
    """The torch.distributed group of this rank's tensor-parallel group; with ``as_list=True`` the list of every
    tensor-parallel group's ranks."""
    return _process_group_or_lists(tensor_parallel_group(), as_list)


def get_tensor_model_parallel_size() -> int:
    """The number of ranks in a tensor-parallel group."""
    return tensor_parallel_group().size


def get_tensor_model_parallel_rank() -> int:
    """This rank's position in its tensor-parallel group."""
    return tensor_parallel_group().rank


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of the first rank of this rank's tensor-parallel group (where broadcasts over the group
    start)."""
    return tensor_parallel_group().src_rank


def get_tensor_model_parallel_replica_groups() -> List[List[int]]:
    """Every tensor-parallel group's ranks (the replica groups of XLA collectives)."""
    return tensor_parallel_group().replica_groups_as_lists()


def get_data_parallel_group(as_list: bool = False):
    """The torch.distributed group of this rank's data-parallel group; with ``as_list=True`` the list of every
    data-parallel group's ranks."""
    return _process_group_or_lists(data_parallel_group(), as_list)


def get_data_parallel_size() -> int:
    """The number of ranks in a data-parallel group."""
    return data_parallel_group().size


def get_data_parallel_rank() -> int:
    """This rank's position in its data-parallel group."""
    return data_parallel_group().rank


def get_data_parallel_src_rank() -> int:
    """The global rank of the first rank of this rank's data-parallel group (where broadcasts over the group start)."""
    return data_parallel_group().src_rank


def get_data_parallel_replica_groups() -> List[List[int]]:
    """Every data-parallel group's ranks (the replica groups of XLA collectives)."""
    return data_parallel_group().replica_groups_as_lists()


def get_world_group(as_list: bool = False):
    """The whole world as one group (a copy of the default group), or with ``as_list=True``
    ``[[0, 1, ..., world - 1]]``."""
    return _process_group_or_lists(_world(), as_list)


def get_zero1_sharding_groups() -> List[List[int]]:
    """The groups over which a ZeRO-1 optimizer shards its state by default: NxD's data x context parallel groups,
    which with context and pipeline parallelism of size 1 are the data-parallel groups."""
    return data_parallel_group().replica_groups_as_lists()


def get_world_size() -> int:
    """The number of ranks in the world of the installed topology."""
    return get_topology().world_size


def get_rank() -> int:
    """This process's global rank in the installed topology."""
    return get_topology().rank


def is_global_rank_zero() -> bool:
    """Whether this is global rank 0."""
    return get_rank() == 0


# ---- pipeline and context parallelism: size 1 -----------------------------------------------------------------------

def get_pipeline_model_parallel_group(as_list: bool = False):
    """Pipeline parallelism of size 1: this rank's group is the rank alone (the process group); ``as_list=True`` gives
    ``[[0], [1], ...]``."""
    return _process_group_or_lists(_singleton(), as_list)


def get_pipeline_model_parallel_replica_groups() -> List[List[int]]:
    """Every pipeline-parallel group's ranks: ``[[0], [1], ...]`` (size 1)."""
    return _singleton().replica_groups_as_lists()


def get_pipeline_model_parallel_size() -> int:
    """The pipeline model parallel size: 1."""
    return _singleton().size


def get_pipeline_model_parallel_rank() -> int:
    """This rank's pipeline model parallel rank: 0."""
    return _singleton().rank


def get_context_model_parallel_group(as_list: bool = False):
    """Context parallelism of size 1: this rank's group is the rank alone (the process group); ``as_list=True`` gives
    ``[[0], [1], ...]``."""
    return _process_group_or_lists(_singleton(), as_list)


def get_context_model_parallel_replica_groups() -> List[List[int]]:
    """Every context-parallel group's ranks: ``[[0], [1], ...]`` (size 1)."""
    return _singleton().replica_groups_as_lists()


def get_context_model_parallel_size() -> int:
    """The context model parallel size: 1."""
    return _singleton().size


def get_context_model_parallel_rank() -> int:
    """This rank's context model parallel rank: 0."""
    return _singleton().rank


# ---- expert parallelism ----------------------------------------------------------------------------------------------

def get_expert_model_parallel_group(as_list: bool = False):
    """The torch.distributed group of this rank's expert-parallel group (the ranks whose experts its tokens may go
    to); with ``as_list=True`` every expert-parallel group's ranks. Of size 1 (the rank alone) without expert
    parallelism."""
    return _process_group_or_lists(expert_parallel_group(), as_list)


def get_expert_model_parallel_replica_groups() -> List[List[int]]:
    """Every expert-parallel group's ranks."""
    return expert_parallel_group().replica_groups_as_lists()


def get_expert_model_parallel_size() -> int:
    """The expert model parallel size (``initialize_model_parallel``'s ``expert_model_parallel_size``)."""
    return expert_parallel_group().size


def get_expert_model_parallel_rank() -> int:
    """This rank's position in its expert-parallel group."""
    return expert_parallel_group().rank


def get_expert_data_parallel_group(as_list: bool = False):
    """The torch.distributed group of this rank's expert data-parallel group (the ranks holding the same experts'
    same pieces, over which expert gradients are averaged); with ``as_list=True`` every such group's ranks. It is the
    data-parallel group without expert parallelism."""
    return _process_group_or_lists(expert_data_parallel_group(), as_list)


def get_expert_data_parallel_replica_groups() -> List[List[int]]:
    """Every expert data-parallel group's ranks."""
    return expert_data_parallel_group().replica_groups_as_lists()


def get_expert_data_parallel_size() -> int:
    """The expert data-parallel size: the data-parallel size / ``expert_model_parallel_size``."""
    return expert_data_parallel_group().size


def get_expert_data_parallel_rank() -> int:
    """This rank's position in its expert data-parallel group."""
    return expert_data_parallel_group().rank


# ---- the optional groups NxD builds on request after initialize_model_parallel --------------------------------------
# nxdtp accepts size 1, whose groups are the singleton groups, and records the request in the topology
# (destroy_model_parallel forgets it with the topology).

class _OptionalGroup(NamedTuple):
    init_call: str    # the call that makes the group, for the error of a getter called before it
    why: str          # why only size 1 is supported


_OPTIONAL_GROUPS: Dict[str, _OptionalGroup] = {
    "token_shuffle": _OptionalGroup(
        "initialize_token_shuffle_group(token_shuffle_group_size=1)",
        "nxdtp does not shuffle tokens across data-parallel ranks (an MoE feature) and builds no token-shuffle groups"),
    "kv_shared": _OptionalGroup(
        "initialize_kv_group(kv_shared_group_size=1)",
        "nxdtp builds no kv-shared groups (NxD's grouping of tensor-parallel ranks that hold the same KV heads)"),
    "speculative_draft": _OptionalGroup(
        "initialize_speculative_draft_group(group_size=1)",
        "nxdtp does no speculative decoding and builds no draft-model groups"),
    "pp_gloo": _OptionalGroup("initialize_pp_gloo_groups()", "nxdtp has no pipeline parallelism"),
}


def _optional_group(kind: str) -> ParallelGroup:
    topology = get_topology()
    if kind not in topology.optional_groups:
        raise RuntimeError(f"the {kind.replace('_', '-')} group is not initialized: call "
                           f"parallel_state.{_OPTIONAL_GROUPS[kind].init_call} first (after initialize_model_parallel)")
    return topology.singleton


def _initialize_optional_group(kind: str, call: str, argument: str, value) -> None:
    topology = get_topology()
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{call}: {argument} must be an int, got {value!r} of type {type(value).__name__}")
    if value != 1:
        raise ValueError(f"{call}: {argument}={value} is not supported: {_OPTIONAL_GROUPS[kind].why}; "
                         f"only {argument}=1 is")
    replace_installed_topology(optional_groups=topology.optional_groups | {kind})


def _forget_optional_group(kind: str) -> None:
    if model_parallel_is_initialized():
        replace_installed_topology(optional_groups=get_topology().optional_groups - {kind})


def initialize_token_shuffle_group(token_shuffle_group_size: int = 1) -> None:
    """Token shuffling (an MoE feature) of size 1, that is no shuffling: each rank's token-shuffle group is the rank."""
    _initialize_optional_group("token_shuffle", f"initialize_token_shuffle_group({token_shuffle_group_size!r})",
                               "token_shuffle_group_size", token_shuffle_group_size)


def destroy_token_shuffle_group() -> None:
    """Forget the token-shuffle group (initialize_token_shuffle_group makes it again)."""
    _forget_optional_group("token_shuffle")


def get_token_shuffle_group(as_list: bool = False):
    """This rank's token-shuffle group (the rank alone); ``as_list=True`` gives ``[[0], [1], ...]``."""
    return _process_group_or_lists(_optional_group("token_shuffle"), as_list)


def get_token_shuffle_replica_groups() -> List[List[int]]:
    """Every token-shuffle group's ranks: ``[[0], [1], ...]``."""
    return _optional_group("token_shuffle").replica_groups_as_lists()


def get_token_shuffle_group_size() -> int:
    """The token-shuffle group size: 1."""
    return _optional_group("token_shuffle").size


def initialize_kv_group(kv_shared_group_size: int = 1, sequential_ranks_in_group: bool = False) -> None:
    """KV-shared groups of size 1 (no KV head shared across ranks): each rank's group is the rank alone, whatever
    ``sequential_ranks_in_group`` says (see arrange_kv_groups)."""
    _initialize_optional_group("kv_shared", f"initialize_kv_group({kv_shared_group_size!r})", "kv_shared_group_size",
                               kv_shared_group_size)


def destroy_kv_group() -> None:
    """Forget the kv-shared group (initialize_kv_group makes it again)."""
    _forget_optional_group("kv_shared")


def get_kv_shared_group(as_list: bool = False):
    """This rank's kv-shared group (the rank alone); ``as_list=True`` gives ``[[0], [1], ...]``."""
    return _process_group_or_lists(_optional_group("kv_shared"), as_list)


def get_kv_shared_replica_groups() -> List[List[int]]:
    """Every kv-shared group's ranks: ``[[0], [1], ...]``."""
    return _optional_group("kv_shared").replica_groups_as_lists()


def get_kv_shared_group_size() -> int:
    """The kv-shared group size: 1."""
    return _optional_group("kv_shared").size


def initialize_speculative_draft_group(group_size: int = 1) -> None:
    """Speculative-decoding draft groups of size 1: each rank's group is the rank alone."""
    _initialize_optional_group("speculative_draft", f"initialize_speculative_draft_group({group_size!r})",
                               "group_size", group_size)


def get_speculative_draft_group(as_list: bool = False):
    """This rank's speculative-draft group (the rank alone); ``as_list=True`` gives ``[[0], [1], ...]``."""
    return _process_group_or_lists(_optional_group("speculative_draft"), as_list)


def get_speculative_draft_replica_groups() -> List[List[int]]:
    """Every speculative-draft group's ranks: ``[[0], [1], ...]``."""
    return _optional_group("speculative_draft").replica_groups_as_lists()


def initialize_pp_gloo_groups() -> None:
    """The gloo group of each rank's pipeline group, for pipeline metadata on the host: the rank alone. Idempotent."""
    # Always the size-1 case: the pipeline has one stage, so the call has nothing to refuse.
    _initialize_optional_group("pp_gloo", "initialize_pp_gloo_groups()", "pipeline_model_parallel_size",
                               _singleton().size)


def get_pp_gloo_group():
    """The gloo process group of this rank's pipeline group (this rank alone), after initialize_pp_gloo_groups()."""
    return _optional_group("pp_gloo").cpu_process_group


# ---- set_*: nxdtp's topology is fixed, so only the value it has is accepted ----------------------------------------

def _accept_only_current(call: str, value, current_of, why: str, hint: str = "") -> None:
    """Accept ``value`` if it is what the topology already has (``current_of(topology)``); otherwise raise naming the
    call, the current value and ``why`` it is fixed (which may name {current} and {global_rank})."""
    if not model_parallel_is_initialized():
        raise RuntimeError(
            f"{call}: nxdtp's topology is fixed by initialize_model_parallel, which has not been called; call "
            "initialize_model_parallel(tensor_model_parallel_size=...) instead of setting sizes and ranks"
        )
    topology = get_topology()
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{call}: expected an int, got {value!r} of type {type(value).__name__}")
    current = current_of(topology)
    if value != current:
        raise ValueError(
            f"{call}: nxdtp's topology is fixed by initialize_model_parallel (tensor_model_parallel_size="
            f"{topology.tensor_model_parallel_size}) and {why.format(current=current, global_rank=topology.rank)}; "
            f"only the current value {current} is accepted{hint}"
        )


def set_tensor_model_parallel_size(world_size: int) -> None:
    """NxD's setter of the tensor model parallel size. nxdtp's topology is fixed by initialize_model_parallel, so
    only the value it has is accepted; any other raises ValueError naming the current value."""
    _accept_only_current(f"set_tensor_model_parallel_size({world_size!r})", world_size,
                         lambda topology: topology.tensor_parallel.size, "cannot be changed afterwards",
                         ". To use another size, call destroy_model_parallel() and then "
                         f"initialize_model_parallel(tensor_model_parallel_size={world_size!r})")


def set_tensor_model_parallel_rank(rank: int) -> None:
    """NxD's setter of the tensor model parallel rank. nxdtp's topology is fixed by initialize_model_parallel, so
    only the value it has is accepted; any other raises ValueError naming the current value."""
    _accept_only_current(f"set_tensor_model_parallel_rank({rank!r})", rank,
                         lambda topology: topology.tensor_parallel.rank,
                         "global rank {global_rank} has tensor-parallel rank {current}")


def set_expert_model_parallel_size(world_size: int) -> None:
    """NxD's setter of the expert model parallel size. nxdtp's topology is fixed by initialize_model_parallel, so
    only the value it has is accepted; any other raises ValueError naming the current value."""
    _accept_only_current(f"set_expert_model_parallel_size({world_size!r})", world_size,
                         lambda topology: topology.expert_parallel.size,
                         "its expert model parallel size is {current}")


def set_expert_model_parallel_rank(rank: int) -> None:
    """NxD's setter of the expert model parallel rank. nxdtp's topology is fixed by initialize_model_parallel, so
    only the value it has is accepted; any other raises ValueError naming the current value."""
    _accept_only_current(f"set_expert_model_parallel_rank({rank!r})", rank,
                         lambda topology: topology.expert_parallel.rank,
                         "global rank {global_rank} has expert model parallel rank {current}")


def set_context_model_parallel_size(world_size: int) -> None:
    """NxD's setter of the context model parallel size. nxdtp's topology is fixed by initialize_model_parallel, so
    only the value it has is accepted; any other raises ValueError naming the current value."""
    _accept_only_current(f"set_context_model_parallel_size({world_size!r})", world_size,
                         lambda topology: topology.singleton.size,
                         "nxdtp has no context parallelism (its context model parallel size is 1)")


# ---- the pipeline of one stage: neighbours, send/receive pairs, stage groups ----------------------------------------

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
    """Raises: NxD makes the next-stage send/receive group only for a pipeline of more than one stage."""
    _no_pipeline_send_recv_group("get_next_rank_group")


def get_next_rank_replica_groups() -> List[List[int]]:
    """Raises: NxD makes the next-stage send/receive groups only for a pipeline of more than one stage."""
    _no_pipeline_send_recv_group("get_next_rank_replica_groups")


def get_prev_rank_group(as_list: bool = False):
    """Raises: NxD makes the previous-stage send/receive group only for a pipeline of more than one stage."""
    _no_pipeline_send_recv_group("get_prev_rank_group")


def get_prev_rank_replica_groups() -> List[List[int]]:
    """Raises: NxD makes the previous-stage send/receive groups only for a pipeline of more than one stage."""
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


def get_context_model_parallel_src_tgt_pairs() -> List[tuple]:
    """The (source, target) pairs of the ring through this rank's context-parallel group, sorted: ``[(rank, rank)]``
    for a group of one rank."""
    g = _singleton()
    return sorted((r, g.ranks[(i + 1) % g.size]) for i, r in enumerate(g.ranks))


# ---- experts ---------------------------------------------------------------------------------------------------------

def _mesh_of(group, argument: str) -> List[List[int]]:
    """The replica groups of a group given as a ParallelGroup, as one of this topology's process groups, as a list of
    rank lists, or as a torch_xla process group (its ``_mesh``)."""
    if isinstance(group, ParallelGroup):
        return group.replica_groups_as_lists()
    if isinstance(group, (list, tuple)) and all(isinstance(g, (list, tuple)) for g in group):
        return [list(g) for g in group]
    known = get_topology().find_group(group)
    if known is not None:
        return known.replica_groups_as_lists()
    mesh = getattr(group, "_mesh", None)
    if mesh:
        return [list(g) for g in mesh]
    raise ValueError(
        f"{argument}={group!r} is not a group of the installed topology: pass get_expert_model_parallel_group() (or "
        "another parallel_state group, a ParallelGroup, or its replica groups as lists)"
    )


def get_expert_parallel_rank_from_global_rank(rank: int, expert_parallel_group) -> int:
    """The position of global ``rank`` in its group of ``expert_parallel_group`` (a group, or its replica groups)."""
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
        raise ValueError(f"hardware_type={hardware_type!r} is not one of {list(_HARDWARE_NAMES)} "
                         "(or NxD's hardware enum)")
    tp, kv = tensor_model_parallel_size, kv_shared_group_size
    groups = []
    for first in range(0, num_tensor_model_parallel_groups * tp, tp):
        if sequential_ranks_in_group or hardware_name == "trn2":
            groups += [list(range(start, start + kv)) for start in range(first, first + tp, kv)]
        else:
            groups += [list(range(first + offset, first + tp, tp // kv)) for offset in range(tp // kv)]
    return groups


# ---- misc NxD helpers ------------------------------------------------------------------------------------------------

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
        raise RuntimeError("this torch has no torch.distributed.distributed_c10d._get_default_store; "
                           "no store to return")
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
    if model_parallel_is_initialized():
        return get_topology().rank
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return -1


def rmsg(msg: str) -> str:
    """``msg`` prefixed with this rank's global, pipeline, tensor, data and context parallel ranks (-1 when model
    parallel is not initialized; global rank -1 when torch.distributed is not initialized either)."""
    if model_parallel_is_initialized():
        pp, tp, dp, cp = (_singleton().rank, tensor_parallel_group().rank, data_parallel_group().rank,
                          _singleton().rank)
    else:
        pp = tp = dp = cp = -1
    return f"[rank_{_global_rank_or_minus_one()}_pp{pp}_tp{tp}_dp{dp}_cp{cp}] {msg}"


def rmsg_ep(msg: str) -> str:
    """``msg`` prefixed with this rank's pipeline, expert, tensor and data parallel ranks (requires initialization)."""
    return (f"[pp{_singleton().rank}|ep{_singleton().rank}|"
            f"tp{tensor_parallel_group().rank}|dp{data_parallel_group().rank}] {msg}")


def get_rank_info_str() -> str:
    """``"DP_<dp rank>_TP_<tp rank>_PP_<pp rank>"``, or ``"model_parallel_uninitialized"``."""
    if not model_parallel_is_initialized():
        return "model_parallel_uninitialized"
    return f"DP_{data_parallel_group().rank}_TP_{tensor_parallel_group().rank}_PP_{_singleton().rank}"


__all__ = [
    # the core's (nxdtp.topology)
    "ParallelGroup", "Topology", "build_topology", "simulated_topology", "get_topology",
    "replace_installed_topology", "initialize_model_parallel", "destroy_model_parallel",
    "model_parallel_is_initialized", "tensor_parallel_group", "data_parallel_group", "rank_tensor", "group_of",
    "zero1_groups", "dp_aligned_rank_lists", "dp_aligned_sharding_examples",
    # NxD's
    "get_tensor_model_parallel_group", "get_tensor_model_parallel_size", "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank", "get_tensor_model_parallel_replica_groups", "get_data_parallel_group",
    "get_data_parallel_size", "get_data_parallel_rank", "get_data_parallel_src_rank",
    "get_data_parallel_replica_groups", "get_world_group", "get_pipeline_model_parallel_group",
    "get_pipeline_model_parallel_replica_groups", "get_pipeline_model_parallel_size",
    "get_pipeline_model_parallel_rank", "get_context_model_parallel_group",
    "get_context_model_parallel_replica_groups", "get_context_model_parallel_size",
    "get_context_model_parallel_rank", "get_expert_model_parallel_group",
    "get_expert_model_parallel_replica_groups", "get_expert_model_parallel_size", "get_expert_model_parallel_rank",
    "get_expert_data_parallel_size", "get_expert_data_parallel_rank", "get_expert_data_parallel_group",
    "get_expert_data_parallel_replica_groups", "get_token_shuffle_group", "get_token_shuffle_replica_groups",
    "get_token_shuffle_group_size", "get_kv_shared_group", "get_kv_shared_replica_groups",
    "get_kv_shared_group_size", "get_speculative_draft_group", "get_speculative_draft_replica_groups",
    "get_zero1_sharding_groups", "set_tensor_model_parallel_size", "set_tensor_model_parallel_rank",
    "set_expert_model_parallel_size", "set_expert_model_parallel_rank", "set_context_model_parallel_size",
    "initialize_token_shuffle_group", "destroy_token_shuffle_group", "initialize_kv_group", "destroy_kv_group",
    "initialize_speculative_draft_group", "initialize_pp_gloo_groups", "get_pp_gloo_group",
    "get_pipeline_model_parallel_next_rank", "get_pipeline_model_parallel_prev_rank",
    "get_pipeline_model_parallel_sr_group", "get_next_rank_group", "get_next_rank_replica_groups",
    "get_prev_rank_group", "get_prev_rank_replica_groups", "create_pg_with_ranks",
    "get_context_model_parallel_src_tgt_pairs", "get_expert_parallel_rank_from_global_rank",
    "get_experts_for_expert_parallel_rank", "arrange_kv_groups", "is_tcp_store_available", "get_tcp_store",
    "set_aot_mode", "get_aot_mode", "rmsg", "rmsg_ep", "get_rank_info_str", "is_global_rank_zero", "get_world_size",
    "get_rank",
]

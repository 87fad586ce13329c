"""Rank lists of a tensor-parallel x data-parallel world: pure arithmetic on global ranks, no process groups.

Tensor-parallel (TP) groups are blocks of contiguous ranks, data-parallel (DP) groups take one rank from each TP group
(strided). A ZeRO-1 sharding is DP-aligned when it cuts every DP group into groups of one size. nxdtp.topology
builds its groups from these lists.
"""

from __future__ import annotations

import collections
from typing import Any, Dict, List, Optional, Tuple


def tensor_parallel_rank_lists(world_size: int, tensor_model_parallel_size: int) -> List[List[int]]:
    tp = tensor_model_parallel_size
    return [list(range(start, start + tp)) for start in range(0, world_size, tp)]


def data_parallel_rank_lists(world_size: int, tensor_model_parallel_size: int) -> List[List[int]]:
    tp = tensor_model_parallel_size
    return [list(range(offset, world_size, tp)) for offset in range(tp)]


def expert_parallel_rank_lists(world_size: int, tensor_model_parallel_size: int,
                               expert_model_parallel_size: int) -> List[List[int]]:
    """Expert-parallel (EP) groups, in NxD's layout: the world read as [expert data parallel, EP, TP] with TP
    contiguous, so an EP group is ``ep`` ranks ``tp`` apart inside a block of ``ep * tp`` contiguous ranks (a TP group
    holds one EP rank; the experts of an EP group's ranks are different, their TP ranks equal)."""
    tp, block = tensor_model_parallel_size, tensor_model_parallel_size * expert_model_parallel_size
    return [[start + e * tp + t for e in range(expert_model_parallel_size)]
            for start in range(0, world_size, block) for t in range(tp)]


def expert_data_parallel_rank_lists(world_size: int, tensor_model_parallel_size: int,
                                    expert_model_parallel_size: int) -> List[List[int]]:
    """Expert data-parallel groups: the ranks that hold the same experts' same TP pieces (one per ``ep * tp`` block),
    over which expert gradients are averaged; NxD's order (by EP rank, then TP rank)."""
    tp, block = tensor_model_parallel_size, tensor_model_parallel_size * expert_model_parallel_size
    return [[start + e * tp + t for start in range(0, world_size, block)]
            for e in range(expert_model_parallel_size) for t in range(tp)]


def singleton_rank_lists(world_size: int) -> List[List[int]]:
    """One group per rank, each holding only that rank: the groups of a kind of parallelism of size 1."""
    return [[r] for r in range(world_size)]


def dp_aligned_examples(data_parallel_lists: List[List[int]]) -> Dict[int, List[List[int]]]:
    """For each valid sharding group size k (the divisors of the DP size), one DP-aligned sharding: each DP group cut
    into blocks of k consecutive members."""
    dp = len(data_parallel_lists[0])
    return {k: [g[i:i + k] for g in data_parallel_lists for i in range(0, dp, k)]
            for k in range(1, dp + 1) if dp % k == 0}


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


def _why_not_dp_aligned(lists: Optional[List[List[int]]], data_parallel_lists: List[List[int]],
                        world_size: int) -> Optional[str]:
    if lists is None:
        return "it is not a list of lists of global ranks (ints)"
    flat = [r for g in lists for r in g]
    dp_of = {r: i for i, g in enumerate(data_parallel_lists) for r in g}
    outside = sorted({r for r in flat if r not in dp_of})
    repeated = sorted(r for r, n in collections.Counter(flat).items() if n > 1)
    missing = sorted(set(dp_of) - set(flat))
    sizes = sorted({len(g) for g in lists})
    if outside:
        return f"ranks {outside} are not in the world of {world_size}"
    if repeated:
        return f"ranks {repeated} are in more than one group"
    if missing:
        return f"ranks {missing} are in no group (the groups must cover every rank of the world)"
    if sizes != [len(lists[0])]:
        return f"the groups have different sizes {sizes}"
    crossing = [g for g in lists if len({dp_of[r] for r in g}) > 1]
    if crossing:
        return f"groups {crossing} span several data-parallel groups"
    return None


def dp_aligned_sharding(sharding_groups: Any, data_parallel_lists: List[List[int]]
                        ) -> Tuple[List[List[int]], List[List[int]]]:
    """The ZeRO-1 sharding rank lists that ``sharding_groups`` names, and their replica rank lists, for a world whose
    data-parallel groups are ``data_parallel_lists``; ``ValueError`` naming them and what would be valid unless they
    are DP-aligned (see nxdtp.parallel_state.dp_aligned_rank_lists)."""
    world_size = sum(len(g) for g in data_parallel_lists)
    lists = _parse_rank_lists(sharding_groups)
    if lists is not None:
        lists = sorted(sorted(g) for g in lists)
    reason = _why_not_dp_aligned(lists, data_parallel_lists, world_size)
    if reason is not None:
        examples = "; ".join(f"size {k}: {v}" for k, v in dp_aligned_examples(data_parallel_lists).items())
        raise ValueError(
            f"ZeRO-1 sharding groups {sharding_groups!r} are not DP-aligned: {reason}. Valid sharding groups cut each "
            f"data-parallel group of {data_parallel_lists} into groups of one size k dividing the DP size "
            f"{len(data_parallel_lists[0])} (every rank in exactly one group), for example {examples}; None means the "
            f"data-parallel groups")
    position = {r: i for g in lists for i, r in enumerate(g)}
    replicas = [[r for r in d if position[r] == i] for d in data_parallel_lists for i in range(len(lists[0]))]
    return lists, sorted(replicas)

"""Topology and the NxD getters: pure logic in one process, plus the real groups on gloo ranks."""

import pytest

from nxdtp import parallel_state as ps


def test_tp_groups_are_contiguous_and_dp_groups_strided():
    with ps.simulated_topology(world_size=8, rank=5, tensor_model_parallel_size=4) as topo:
        assert ps.get_tensor_model_parallel_replica_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert ps.get_data_parallel_replica_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
        assert ps.get_tensor_model_parallel_group(as_list=True) == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert ps.get_data_parallel_group(as_list=True) == [[0, 4], [1, 5], [2, 6], [3, 7]]
        assert ps.get_tensor_model_parallel_group() is None  # simulated: no process group
        assert (ps.get_tensor_model_parallel_size(), ps.get_tensor_model_parallel_rank()) == (4, 1)
        assert (ps.get_data_parallel_size(), ps.get_data_parallel_rank()) == (2, 1)
        assert ps.get_tensor_model_parallel_src_rank() == 4
        assert ps.get_data_parallel_src_rank() == 1
        assert (ps.get_pipeline_model_parallel_size(), ps.get_pipeline_model_parallel_rank()) == (1, 0)
        assert topo.simulated and topo.data_parallel_size == 2
    assert not ps.model_parallel_is_initialized()


def test_getters_of_parallelism_nxdtp_does_not_do_give_nxds_size_one_values():
    # Context and expert parallelism of size 1 (NxD's values); the expert data-parallel group is then the DP group.
    with ps.simulated_topology(world_size=8, rank=5, tensor_model_parallel_size=4):
        assert (ps.get_context_model_parallel_size(), ps.get_context_model_parallel_rank()) == (1, 0)
        assert (ps.get_expert_model_parallel_size(), ps.get_expert_model_parallel_rank()) == (1, 0)
        assert (ps.get_expert_data_parallel_size(), ps.get_expert_data_parallel_rank()) == (2, 1)
        assert ps.get_expert_data_parallel_group(as_list=True) == [[0, 4], [1, 5], [2, 6], [3, 7]]
        assert not ps.is_global_rank_zero()
    with ps.simulated_topology(world_size=8, rank=0, tensor_model_parallel_size=4):
        assert ps.is_global_rank_zero()
    with pytest.raises(RuntimeError, match="model parallel is not initialized"):
        ps.get_context_model_parallel_size()


def test_nxd_package_level_names():
    # NxD's parallel_layers/__init__ re-exports these; an NxD script imports them from the package.
    import nxdtp
    from nxdtp import checkpointing, mappings, utils

    assert nxdtp.save is checkpointing.save and nxdtp.load is checkpointing.load
    for name in ("copy_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
                 "reduce_from_tensor_model_parallel_region", "scatter_to_tensor_model_parallel_region"):
        assert getattr(nxdtp, name) is getattr(mappings, name)
    for name in ("copy_tensor_model_parallel_attributes", "set_tensor_model_parallel_attributes",
                 "split_tensor_along_last_dim", "move_model_to_device"):
        assert getattr(nxdtp, name) is getattr(utils, name)


@pytest.mark.parametrize("world,tp", [(1, 1), (2, 2), (4, 2), (8, 8), (8, 1), (6, 3)])
def test_every_rank_is_in_exactly_one_group_of_each_kind(world, tp):
    for rank in range(world):
        topo = ps.build_topology(world, rank, tp)
        tp_groups, dp_groups = topo.tensor_parallel.replica_groups, topo.data_parallel.replica_groups
        assert sorted(r for g in tp_groups for r in g) == list(range(world))
        assert sorted(r for g in dp_groups for r in g) == list(range(world))
        assert rank in topo.tensor_parallel.ranks and rank in topo.data_parallel.ranks
        # A TP group and a DP group meet in exactly one rank: this one.
        assert set(topo.tensor_parallel.ranks) & set(topo.data_parallel.ranks) == {rank}
        assert topo.tensor_parallel.rank == rank % tp and topo.data_parallel.rank == rank // tp


@pytest.mark.parametrize("kwargs,message", [
    (dict(world_size=8, rank=0, tensor_model_parallel_size=3), "tensor_model_parallel_size=3 does not divide world size 8"),
    (dict(world_size=8, rank=0, tensor_model_parallel_size=0), "tensor_model_parallel_size=0 must be >= 1"),
    (dict(world_size=8, rank=0, tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
     "pipeline_model_parallel_size=2 is not supported"),
    (dict(world_size=4, rank=4, tensor_model_parallel_size=2), "rank=4 is outside the world of size 4"),
])
def test_bad_topologies_are_rejected_with_the_values(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ps.build_topology(**kwargs)


def test_use_before_init_names_the_fix():
    with pytest.raises(RuntimeError, match="model parallel is not initialized.*initialize_model_parallel"):
        ps.get_tensor_model_parallel_size()


def test_init_without_process_group_says_so():
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        ps.initialize_model_parallel(2)


def case_real_groups(expected_tp):
    import torch
    import torch.distributed as dist

    assert ps.model_parallel_is_initialized()
    tp, rank = ps.get_tensor_model_parallel_size(), dist.get_rank()
    assert tp == expected_tp
    # The process groups really connect the ranks the topology names.
    mine = torch.tensor([float(rank)])
    dist.all_reduce(mine, group=ps.get_tensor_model_parallel_group())
    tp_ranks = ps.tensor_parallel_group().ranks
    assert mine.item() == sum(tp_ranks), (mine, tp_ranks)
    mine = torch.tensor([float(rank)])
    dist.all_reduce(mine, group=ps.get_data_parallel_group())
    assert mine.item() == sum(ps.data_parallel_group().ranks)
    assert ps.get_tensor_model_parallel_src_rank() == tp_ranks[0]
    # A second initialisation names the live configuration.
    try:
        ps.initialize_model_parallel(tp)
    except RuntimeError as e:
        assert f"already initialized (tensor_model_parallel_size={tp}, world size 4)" in str(e)
    else:
        raise AssertionError("double initialisation was accepted")
    return ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_real_groups_on_gloo(worlds, tp):
    ranks = worlds(4).run(case_real_groups, tensor_model_parallel_size=tp, expected_tp=tp)
    assert ranks == [(r % tp, r // tp) for r in range(4)]


def case_world_not_divisible():
    try:
        ps.initialize_model_parallel(3)
    except ValueError as e:
        assert "tensor_model_parallel_size=3 does not divide world size 4" in str(e), e
        return
    raise AssertionError("tp=3 in a world of 4 was accepted")


def test_tp_not_dividing_real_world(worlds):
    worlds(4).run(case_world_not_divisible, tensor_model_parallel_size=None)


def case_nxd_options_at_defaults():
    try:
        ps.initialize_model_parallel(2, context_parallel_size=2)
    except ValueError as e:
        assert "context_parallel_size=2 is not supported" in str(e), e
    else:
        raise AssertionError("context_parallel_size=2 was accepted")
    assert not ps.model_parallel_is_initialized()
    ps.initialize_model_parallel(2, context_parallel_size=1, expert_model_parallel_size=1, skip_collective_init=False,
                                 lnc_size=1, mesh_only=False)
    assert ps.get_tensor_model_parallel_size() == 2


def test_nxd_options_accepted_only_at_defaults(worlds):
    worlds(2).run(case_nxd_options_at_defaults, tensor_model_parallel_size=None)

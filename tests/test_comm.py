"""nxdtp.comm on gloo ranks: every collective over the TP and DP groups equals the dense math.

Each rank's input is drawn from (seed, global rank), so every rank can compute every other rank's input and with it the
expected result of the collective without communicating.
"""

import pytest
import torch

from nxdtp import comm
from nxdtp import parallel_state as ps


def _input(seed, global_rank, shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed * 1009 + global_rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def _random_shape(gen, dim=None, multiple=1):
    """A random 3-D shape; dimension ``dim`` (if given) a multiple of ``multiple``."""
    shape = [int(torch.randint(1, 5, (1,), generator=gen)) for _ in range(3)]
    if dim is not None:
        shape[dim] = multiple * int(torch.randint(1, 4, (1,), generator=gen))
    return tuple(shape)


def _call_unmodified(fn, x, *args, **kwargs):
    """Call a collective and check that it did not write into its input (comm is functional)."""
    before = x.clone()
    out = fn(x, *args, **kwargs)
    assert torch.equal(x, before), f"{fn.__name__} modified its input"
    return out


def _close(actual, expected, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def case_collectives(seed):
    gen = torch.Generator().manual_seed(seed)
    checked = []
    for group in (ps.tensor_parallel_group(), ps.data_parallel_group()):
        n, me = group.size, ps.get_rank()
        ranks = group.ranks
        label = f"{group.kind} group {ranks}"
        if n == 1:
            x = _input(seed, me, (2, 3, 4))
            # A group of one needs no communication: the input comes back as the result.
            assert comm.all_reduce(x, group) is x
            assert comm.all_reduce(x, group, op="max") is x
            assert comm.all_gather(x, group, dim=1) is x
            assert comm.reduce_scatter(x, group, dim=0) is x
            assert comm.broadcast(x, group, 0) is x
            assert comm.all_to_all(x, group, 0, 2) is x
            checked.append((group.kind, "size-1"))
            continue

        for dtype in (torch.float32, torch.int64):
            shape = _random_shape(gen)
            inputs = [_input(seed, r, shape, dtype) for r in ranks]
            x = inputs[group.rank]
            out = _call_unmodified(comm.all_reduce, x, group, op="sum")
            _close(out, torch.stack(inputs).sum(0), f"all_reduce sum {dtype} over {label}")
            out = _call_unmodified(comm.all_reduce, x, group, op="max")
            _close(out, torch.stack(inputs).amax(0), f"all_reduce max {dtype} over {label}")
            out = _call_unmodified(comm.all_reduce, x, group, op="min")
            _close(out, torch.stack(inputs).amin(0), f"all_reduce min {dtype} over {label}")

        for dim in (0, 1, -1):
            shape = _random_shape(gen)
            inputs = [_input(seed + 1, r, shape) for r in ranks]
            out = _call_unmodified(comm.all_gather, inputs[group.rank], group, dim=dim)
            _close(out, torch.cat(inputs, dim=dim), f"all_gather dim {dim} over {label}")

            shape = _random_shape(gen, dim=dim, multiple=n)
            inputs = [_input(seed + 2, r, shape) for r in ranks]
            out = _call_unmodified(comm.reduce_scatter, inputs[group.rank], group, dim=dim)
            expected = torch.stack(inputs).sum(0).chunk(n, dim=dim)[group.rank]
            _close(out, expected, f"reduce_scatter dim {dim} over {label}")

        # All-to-all: chunk i of every rank's input along split_dim reaches group rank i, in group-rank order along
        # concat_dim; integer and transposed inputs too.
        for split_dim, concat_dim in ((0, 1), (1, 0), (2, 2), (-1, 0)):
            shape = _random_shape(gen, dim=split_dim, multiple=n)
            for dtype in (torch.float32, torch.int64):
                inputs = [_input(seed + 5, r, shape, dtype) for r in ranks]
                out = _call_unmodified(comm.all_to_all, inputs[group.rank], group, split_dim, concat_dim)
                expected = torch.cat([x.chunk(n, dim=split_dim)[group.rank] for x in inputs], dim=concat_dim)
                _close(out, expected, f"all_to_all {split_dim}->{concat_dim} {dtype} over {label}")
        inputs = [_input(seed + 6, r, (3, 2, 2 * n)).transpose(0, 2) for r in ranks]
        _close(_call_unmodified(comm.all_to_all, inputs[group.rank], group, 0, 2),
               torch.cat([x.chunk(n, dim=0)[group.rank] for x in inputs], dim=2),
               f"all_to_all of a transposed tensor over {label}")

        # Broadcast from a non-zero group rank: the source's input reaches everyone, not global rank src.
        for src in sorted({n - 1, 1}):
            shape = _random_shape(gen)
            inputs = [_input(seed + 3 + src, r, shape) for r in ranks]
            out = _call_unmodified(comm.broadcast, inputs[group.rank], group, src)
            _close(out, inputs[src], f"broadcast from group rank {src} over {label}")

        # Non-contiguous input (a transpose) gathers and reduces by value, not by memory layout.
        shape = _random_shape(gen, dim=2, multiple=n)
        inputs = [_input(seed + 7, r, shape).transpose(0, 2) for r in ranks]
        x = inputs[group.rank]
        _close(_call_unmodified(comm.all_gather, x, group, dim=1), torch.cat(inputs, dim=1),
               f"all_gather of a transposed tensor over {label}")
        _close(_call_unmodified(comm.reduce_scatter, x, group, dim=0),
               torch.stack(inputs).sum(0).chunk(n, dim=0)[group.rank],
               f"reduce_scatter of a transposed tensor over {label}")
        checked.append((group.kind, n))
    return checked


@pytest.mark.parametrize("world,tp", [(4, 2), (4, 4), (2, 2), (4, 1)])
def test_collectives_equal_dense_math(worlds, world, tp):
    seed = 1234 + 17 * world + tp
    results = worlds(world).run(case_collectives, tensor_model_parallel_size=tp, seed=seed)
    dp = world // tp
    expected = [("tensor", tp if tp > 1 else "size-1"), ("data", dp if dp > 1 else "size-1")]
    assert results == [expected] * world


# ---- argument errors: raised before any communication, so a simulated topology's groups suffice ----------------------

@pytest.fixture
def group_of_two():
    return ps.build_topology(world_size=4, rank=1, tensor_model_parallel_size=2).tensor_parallel


def test_bad_reduce_op_is_named(group_of_two):
    with pytest.raises(ValueError, match=r"reduce op 'avg' is not supported.*'sum', 'max'"):
        comm.all_reduce(torch.ones(2), group_of_two, op="avg")


@pytest.mark.parametrize("fn", [comm.all_gather, comm.reduce_scatter])
@pytest.mark.parametrize("dim", [3, -4])
def test_dim_out_of_range_names_dim_and_shape(group_of_two, fn, dim):
    with pytest.raises(ValueError, match=rf"dim={dim} is out of range for a tensor of shape \(2, 4, 6\)"):
        fn(torch.ones(2, 4, 6), group_of_two, dim=dim)


def test_reduce_scatter_indivisible_names_shape_and_group_size(group_of_two):
    with pytest.raises(ValueError, match=r"all_to_all: dimension 0 of shape \(3, 4, 5\) has size 3.*group size 2"):
        comm.all_to_all(torch.ones(3, 4, 5), group_of_two, 0, 1)
    with pytest.raises(ValueError, match=r"shape \(3, 4, 5\) has size 5.*group size 2 does not divide"):
        comm.reduce_scatter(torch.ones(3, 4, 5), group_of_two, dim=-1)
    with pytest.raises(ValueError, match=r"shape \(3, 4, 5\) has size 3.*group size 2 does not divide"):
        comm.reduce_scatter(torch.ones(3, 4, 5), group_of_two, dim=0)


def test_broadcast_source_outside_group(group_of_two):
    with pytest.raises(ValueError, match="src_group_rank=2 is outside the tensor-parallel group of size 2"):
        comm.broadcast(torch.ones(2), group_of_two, src_group_rank=2)

"""nxdtp.mappings on gloo ranks: each region's forward value and backward gradient equal the dense math.

For global rank r the input x_r and the upstream gradient dy_r are drawn from (seed, r), so every rank knows what every
rank of its TP group holds. The expected backward of each region is the gradient of sum_r <dy_r, y_r> with respect to
this rank's input, written out with torch ops on the full tensors.
"""

import pytest
import torch

from nxdtp import mappings
from nxdtp import parallel_state as ps


def _tensor(seed, global_rank, shape, salt):
    g = torch.Generator().manual_seed(seed * 7919 + salt * 101 + global_rank)
    return torch.randn(shape, generator=g)


def _run_region(fn, x, dy, **kwargs):
    """Forward and backward of one region on this rank; the input must be left untouched."""
    x = x.clone().requires_grad_(True)
    before = x.detach().clone()
    y = fn(x, **kwargs)
    y.backward(dy)
    assert torch.equal(x.detach(), before), f"{fn.__name__} modified its input"
    return y.detach(), x.grad


def _close(actual, expected, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def case_regions(seed):
    group = ps.tensor_parallel_group()
    n, i, ranks = group.size, group.rank, group.ranks
    gen = torch.Generator().manual_seed(seed)

    def rand_dim():
        return int(torch.randint(1, 4, (1,), generator=gen))

    # Every dimension a multiple of n, so any of them may be split or reduce-scattered.
    full_shape = (n * rand_dim(), n * rand_dim(), n * rand_dim())
    local_shape_last = full_shape[:2] + (full_shape[2] // n,)
    salt = iter(range(1000))
    done = []

    def inputs(shape):
        s = next(salt)
        return [_tensor(seed, r, shape, s) for r in ranks]

    # copy_to: identity forward; backward sums every rank's upstream gradient.
    xs, dys = inputs(full_shape), inputs(full_shape)
    y, dx = _run_region(mappings.copy_to_tensor_model_parallel_region, xs[i], dys[i])
    _close(y, xs[i], "copy_to forward")
    _close(dx, torch.stack(dys).sum(0), "copy_to backward")
    done.append("copy_to")

    # reduce_from: all-reduce forward; backward passes this rank's gradient through.
    xs, dys = inputs(full_shape), inputs(full_shape)
    y, dx = _run_region(mappings.reduce_from_tensor_model_parallel_region, xs[i], dys[i])
    _close(y, torch.stack(xs).sum(0), "reduce_from forward")
    _close(dx, dys[i], "reduce_from backward")
    done.append("reduce_from")

    for dim in (-1, 0, 1):
        local = list(full_shape)
        local[dim] //= n
        # scatter_to TP: keep slice i; backward gathers every rank's slice gradient.
        xs, dys = inputs(full_shape), inputs(tuple(local))
        y, dx = _run_region(mappings.scatter_to_tensor_model_parallel_region, xs[i], dys[i], partition_dim=dim)
        _close(y, xs[i].chunk(n, dim=dim)[i], f"scatter_to_tp dim {dim} forward")
        _close(dx, torch.cat(dys, dim=dim), f"scatter_to_tp dim {dim} backward")

        # gather_from TP: concatenate; backward keeps this rank's slice of its own gradient (a split, no reduction).
        xs, dys = inputs(tuple(local)), inputs(full_shape)
        y, dx = _run_region(mappings.gather_from_tensor_model_parallel_region, xs[i], dys[i], partition_dim=dim)
        _close(y, torch.cat(xs, dim=dim), f"gather_from_tp dim {dim} forward")
        _close(dx, dys[i].chunk(n, dim=dim)[i], f"gather_from_tp dim {dim} backward")
    done += ["scatter_to_tp", "gather_from_tp"]

    # The default partition dim is the last one.
    xs = inputs(full_shape)
    _close(mappings.scatter_to_tensor_model_parallel_region(xs[i]), xs[i].chunk(n, dim=-1)[i], "scatter default dim")
    xs = inputs(local_shape_last)
    _close(mappings.gather_from_tensor_model_parallel_region(xs[i]), torch.cat(xs, dim=-1), "gather default dim")

    for sd in (0, 1):
        local = list(full_shape)
        local[sd] //= n
        local = tuple(local)

        xs, dys = inputs(full_shape), inputs(local)
        y, dx = _run_region(mappings.scatter_to_sequence_parallel_region, xs[i], dys[i], sequence_dimension=sd)
        _close(y, xs[i].chunk(n, dim=sd)[i], f"scatter_to_sp seq dim {sd} forward")
        _close(dx, torch.cat(dys, dim=sd), f"scatter_to_sp seq dim {sd} backward")

        for to_mp in (True, False):
            xs, dys = inputs(local), inputs(full_shape)
            y, dx = _run_region(mappings.gather_from_sequence_parallel_region, xs[i], dys[i],
                                to_model_parallel=to_mp, sequence_dimension=sd)
            what = f"gather_from_sp to_model_parallel={to_mp} seq dim {sd}"
            _close(y, torch.cat(xs, dim=sd), f"{what} forward")
            if to_mp:  # feeds a TP region: the ranks' gradients are partial, reduce-scatter them
                expected = torch.stack(dys).sum(0).chunk(n, dim=sd)[i]
            else:  # feeds replicated code: this rank's gradient is already the full one, keep its slice
                expected = dys[i].chunk(n, dim=sd)[i]
            _close(dx, expected, f"{what} backward")

        xs, dys = inputs(full_shape), inputs(local)
        y, dx = _run_region(mappings.reduce_scatter_to_sequence_parallel_region, xs[i], dys[i],
                            sequence_dimension=sd)
        _close(y, torch.stack(xs).sum(0).chunk(n, dim=sd)[i], f"reduce_scatter_to_sp seq dim {sd} forward")
        _close(dx, torch.cat(dys, dim=sd), f"reduce_scatter_to_sp seq dim {sd} backward")

    # The default sequence dimension is 0 (sequence-first, as in Megatron and NxD).
    xs = inputs(full_shape)
    _close(mappings.scatter_to_sequence_parallel_region(xs[i]), xs[i].chunk(n, dim=0)[i], "sp scatter default")
    xs = inputs(full_shape)
    _close(mappings.reduce_scatter_to_sequence_parallel_region(xs[i]), torch.stack(xs).sum(0).chunk(n, dim=0)[i],
           "sp reduce-scatter default")
    done += ["scatter_to_sp", "gather_from_sp", "reduce_scatter_to_sp"]

    # A chain as a TP MLP uses it: copy_to -> per-rank op -> reduce_from. The gradient reaching x is the sum over ranks
    # of each rank's contribution, and it is the same on every rank of the group.
    ws = inputs((full_shape[2], full_shape[2]))
    x = _tensor(seed, -1, full_shape, 999).requires_grad_(True)  # replicated input: same on every rank
    out = mappings.reduce_from_tensor_model_parallel_region(mappings.copy_to_tensor_model_parallel_region(x) @ ws[i])
    out.pow(2).sum().backward()
    x_dense = x.detach().clone().requires_grad_(True)
    (x_dense @ torch.stack(ws).sum(0)).pow(2).sum().backward()
    _close(out.detach(), (x_dense @ torch.stack(ws).sum(0)).detach(), "copy_to/reduce_from chain forward")
    _close(x.grad, x_dense.grad, "copy_to/reduce_from chain backward")
    done.append("chain")
    return n, done


@pytest.mark.parametrize("world,tp", [(4, 2), (4, 4), (2, 2), (4, 1)])
def test_regions_equal_dense_math(worlds, world, tp):
    results = worlds(world).run(case_regions, tensor_model_parallel_size=tp, seed=4321 + 13 * world + tp)
    assert [n for n, _ in results] == [tp] * world
    assert all(len(done) == 8 for _, done in results)


_REGIONS = [
    mappings.copy_to_tensor_model_parallel_region, mappings.reduce_from_tensor_model_parallel_region,
    mappings.scatter_to_tensor_model_parallel_region, mappings.gather_from_tensor_model_parallel_region,
    mappings.scatter_to_sequence_parallel_region, mappings.gather_from_sequence_parallel_region,
    mappings.reduce_scatter_to_sequence_parallel_region,
]


@pytest.mark.parametrize("region", _REGIONS, ids=lambda f: f.__name__)
def test_process_group_other_than_none_is_rejected(region):
    with ps.simulated_topology(world_size=2, rank=0, tensor_model_parallel_size=2):
        with pytest.raises(ValueError, match="process_group=.* is not supported.*pass process_group=None"):
            region(torch.ones(2, 2, 2), process_group=object())

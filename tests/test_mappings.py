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

    # Outside autograd (a gradient buffer) reduce_from sums in place, as NxD's does, so code that drops the result
    # works.
    xs = inputs(full_shape)
    buffer = xs[i].clone()
    returned = mappings.reduce_from_tensor_model_parallel_region(buffer)
    assert returned is buffer, "reduce_from on a tensor outside autograd must return it, summed in place"
    _close(buffer, torch.stack(xs).sum(0), "reduce_from in place")

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


def case_nxd_regions(seed):
    """The NxD regions beyond the seven: *_with_dim, context and expert regions, the rank-tensor scatters, the
    input-channel scatter, against the same dense math as case_regions."""
    group = ps.tensor_parallel_group()
    n, i, ranks = group.size, group.rank, group.ranks
    salt = iter(range(1000))

    def inputs(shape):
        s = next(salt)
        return [_tensor(seed, r, shape, s) for r in ranks]

    full, done = (2 * n, 3 * n, 2 * n), []
    for dim in (0, 1, 2):
        local = list(full)
        local[dim] //= n
        xs, dys = inputs(tuple(local)), inputs(full)
        y, dx = _run_region(mappings.gather_from_tensor_model_parallel_region_with_dim, xs[i], dys[i], gather_dim=dim)
        _close(y, torch.cat(xs, dim=dim), f"gather_with_dim {dim} forward")
        _close(dx, dys[i].chunk(n, dim=dim)[i], f"gather_with_dim {dim} backward")
        xs, dys = inputs(full), inputs(tuple(local))
        y, dx = _run_region(mappings.reduce_scatter_to_tensor_model_parallel_region_with_dim, xs[i], dys[i],
                            partition_dim=dim)
        _close(y, torch.stack(xs).sum(0).chunk(n, dim=dim)[i], f"reduce_scatter_with_dim {dim} forward")
        _close(dx, torch.cat(dys, dim=dim), f"reduce_scatter_with_dim {dim} backward")

        # The rank as a tensor picks the block (contiguous or round robin); backward puts every rank's gradient back.
        for round_robin, fn in ((False, mappings.scatter_to_process_group_spmd),
                                (True, mappings.round_robin_scatter_to_process_group_spmd)):
            positions = [list(range(r, full[dim], n)) if round_robin
                         else list(range(r * local[dim], (r + 1) * local[dim])) for r in range(n)]
            xs, dys = inputs(full), inputs(tuple(local))
            y, dx = _run_region(fn, xs[i], dys[i], partition_dim=dim, rank=torch.tensor([i], dtype=torch.int32))
            _close(y, xs[i].index_select(dim, torch.tensor(positions[i])), f"{fn.__name__} {dim} forward")
            expected = torch.zeros(full)
            for r in range(n):
                expected.index_copy_(dim, torch.tensor(positions[r]), dys[r])
            _close(dx, expected, f"{fn.__name__} {dim} backward")
    done += ["with_dim", "spmd"]

    xs, dys = inputs((2, 2 * n, 3, 3)), inputs((2, 2, 3, 3))
    y, dx = _run_region(mappings.scatter_input_channels_to_tensor_model_parallel_region, xs[i], dys[i])
    _close(y, xs[i].chunk(n, dim=1)[i], "input channels forward")
    _close(dx, torch.cat(dys, dim=1), "input channels backward")

    # Context and expert parallelism are of size 1: the regions keep values and (replicated) gradients.
    x, dy = inputs(full)[0], inputs(full)[0]
    y, dx = _run_region(mappings.reduce_from_context_model_parallel_region, x, dy)
    _close(y, x, "context forward")
    _close(dx, dy, "context backward")
    for scatter_gather in (False, True):
        y, dx = _run_region(mappings.enter_expert_parallel_region, x, dy.unsqueeze(1), scatter_gather=scatter_gather)
        _close(y, x.unsqueeze(1), "enter expert forward")
        _close(dx, dy, "enter expert backward")
        y, dx = _run_region(mappings.exit_expert_parallel_region, x.unsqueeze(1), dy, scatter_gather=scatter_gather)
        _close(y, x, "exit expert forward")
        _close(dx, dy.unsqueeze(1), "exit expert backward")
    done += ["channels", "context", "expert"]
    return done


@pytest.mark.parametrize("world,tp", [(4, 2), (4, 4)])
def test_nxd_regions_equal_dense_math(worlds, world, tp):
    results = worlds(world).run(case_nxd_regions, tensor_model_parallel_size=tp, seed=99 + world + tp)
    assert all(done == ["with_dim", "spmd", "channels", "context", "expert"] for done in results)


def case_process_groups(seed):
    """``process_group=`` given as nxdtp's own groups, or as subgroups made by dist.new_group, reduces over exactly
    those ranks; a group that cannot carry the tensor is refused by name."""
    import torch.distributed as dist

    topo = ps.get_topology()
    world, rank = topo.world_size, topo.rank
    xs = [_tensor(seed, r, (4, 6), 0) for r in range(world)]
    dys = [_tensor(seed, r, (4, 6), 1) for r in range(world)]

    def check(group_arg, members, what):
        y, dx = _run_region(mappings.reduce_from_tensor_model_parallel_region, xs[rank], dys[rank],
                            process_group=group_arg)
        _close(y, torch.stack([xs[r] for r in members]).sum(0), f"{what}: reduce_from")
        y, dx = _run_region(mappings.copy_to_tensor_model_parallel_region, xs[rank], dys[rank], process_group=group_arg)
        _close(dx, torch.stack([dys[r] for r in members]).sum(0), f"{what}: copy_to backward")
        y, _ = _run_region(mappings.gather_from_tensor_model_parallel_region, xs[rank],
                           dys[rank].repeat(1, len(members)), process_group=group_arg)
        _close(y, torch.cat([xs[r] for r in members], dim=-1), f"{what}: gather")

    tp, dp = topo.tensor_parallel, topo.data_parallel
    for own, what in ((tp, "tp"), (dp, "dp")):
        check(own.process_group, own.ranks, f"{what} process_group")
        check(own.cpu_process_group, own.ranks, f"{what} cpu_process_group")
    check(ps.get_tensor_model_parallel_group(), tp.ranks, "get_tensor_model_parallel_group()")
    # Subgroups made by the user: every rank creates every group, in the same order.
    halves = [list(range(0, world // 2)), list(range(world // 2, world))]
    gloo_groups = [dist.new_group(h, backend="gloo") for h in halves]
    default_groups = [dist.new_group(h) for h in halves]
    mine = 0 if rank < world // 2 else 1
    check(gloo_groups[mine], halves[mine], "gloo subgroup")
    refused = None
    if dist.get_backend() != "gloo":
        try:
            mappings.reduce_from_tensor_model_parallel_region(xs[rank], process_group=default_groups[mine])
        except RuntimeError as error:
            refused = str(error)
    else:
        check(default_groups[mine], halves[mine], "default-backend subgroup")
    try:
        mappings.reduce_from_tensor_model_parallel_region(xs[rank], process_group=gloo_groups[1 - mine])
    except ValueError as error:
        outsider = str(error)
    for g in gloo_groups + default_groups:
        if g != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(g)
    return refused, outsider


@pytest.mark.parametrize("backend", ["gloo", "cpu_refusing", "xla"])
def test_process_group_argument(worlds, backend):
    results = worlds(4, backend).run(case_process_groups, tensor_model_parallel_size=2, seed=5)
    for refused, outsider in results:
        assert "is not a member" in outsider or "is not in process_group" in outsider
        if backend == "gloo":
            assert refused is None
        else:
            assert "cannot carry a cpu tensor" in refused and "backend='gloo'" in refused


@pytest.mark.parametrize("bad", [object(), "tp", 3])
def test_process_group_of_another_type_is_refused(bad):
    with ps.simulated_topology(world_size=2, rank=0, tensor_model_parallel_size=2):
        with pytest.raises(TypeError, match="is not a torch.distributed ProcessGroup"):
            mappings.reduce_from_tensor_model_parallel_region(torch.ones(2, 2), process_group=bad)


def case_reduce_dtype(seed):
    """bf16 partial sums all-reduced in fp32 are closer to the exact sum than a bf16 all-reduce."""
    group = ps.tensor_parallel_group()
    gen = torch.Generator().manual_seed(seed)
    # Partial sums of mixed magnitude, as a row-parallel layer's are: bf16 addition loses the small ones.
    parts = [(torch.randn(4096, generator=gen) * torch.logspace(-3, 2, 4096)).to(torch.bfloat16)
             for _ in range(group.size)]
    exact = torch.stack([p.double() for p in parts]).sum(0)
    mine = parts[group.rank]
    in_fp32 = mappings.reduce_from_tensor_model_parallel_region(mine.clone(), reduce_dtype=torch.float32)
    in_bf16 = mappings.reduce_from_tensor_model_parallel_region(mine.clone())
    x = mine.clone().requires_grad_(True)
    mappings.copy_to_tensor_model_parallel_region(x, reduce_dtype=torch.float32).backward(parts[group.rank])
    return (in_fp32.dtype, (in_fp32.double() - exact).abs().sum().item(), (in_bf16.double() - exact).abs().sum().item(),
            torch.equal(in_fp32, exact.to(torch.float32).to(torch.bfloat16)), x.grad.dtype,
            (x.grad.double() - exact).abs().sum().item())


def test_reduce_dtype_fp32_is_closer_than_bf16(worlds):
    for dtype, err_fp32, err_bf16, equal_to_rounded_exact, grad_dtype, grad_err in worlds(4).run(
            case_reduce_dtype, tensor_model_parallel_size=4, seed=3):
        assert dtype == torch.bfloat16 and grad_dtype == torch.bfloat16
        assert err_fp32 < 0.7 * err_bf16, (err_fp32, err_bf16)
        assert grad_err == err_fp32
        assert equal_to_rounded_exact



def case_reduce_dtype_never_narrows(seed):
    """fp64 partial sums with reduce_dtype=fp32 (the layers' default) are summed in fp64: with two ranks, a + b exactly,
    forward and backward, all-reduce and reduce-scatter."""
    group = ps.tensor_parallel_group()
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randn(8, 3, generator=gen, dtype=torch.float64) * torch.logspace(-9, 3, 3, dtype=torch.float64)
             for _ in range(group.size)]
    exact = parts[0] + parts[1]
    mine = parts[group.rank]
    reduced = mappings.reduce_from_tensor_model_parallel_region(mine.clone(), reduce_dtype=torch.float32)
    x = mine.clone().requires_grad_(True)
    mappings.copy_to_tensor_model_parallel_region(x, reduce_dtype=torch.float32).backward(mine)
    scattered = mappings.reduce_scatter_to_sequence_parallel_region(mine.clone(), 0, reduce_dtype=torch.float32)
    return (reduced.dtype, torch.equal(reduced, exact), torch.equal(x.grad, exact),
            torch.equal(scattered, exact.chunk(group.size)[group.rank]))


def test_reduce_dtype_never_sums_a_wider_input_in_a_narrower_dtype(worlds):
    for dtype, *equal in worlds(2).run(case_reduce_dtype_never_narrows, tensor_model_parallel_size=2, seed=4):
        assert dtype == torch.float64 and all(equal), equal


def case_expert_regions(seed, tp, ep, scatter_gather):
    """NxD's expert regions with expert parallelism: the entry sends each rank's tokens for expert block k to EP rank
    k, the exit brings them back; values and gradients against the formulas written over every rank's tensors. Tokens
    (and their upstream gradients) are equal on the ranks of a TP group, as NxD's scatter_gather assumes."""
    ps.initialize_model_parallel(tp, expert_model_parallel_size=ep)
    try:
        rank = ps.get_topology().rank
        experts, per_rank, capacity, hidden = 2 * ep, 2, 2 * tp, 3
        peers = ps.expert_parallel_group().ranks
        me = ps.get_expert_model_parallel_rank()

        def of(r, shape, salt):  # a tensor of the tokens of global rank r: one per DP rank
            return _tensor(seed, r // tp, shape, salt)

        x, dy = of(rank, (experts, capacity, hidden), 0), of(rank, (per_rank, ep, capacity, hidden), 1)
        y, dx = _run_region(mappings.enter_expert_parallel_region, x, dy, scatter_gather=scatter_gather)
        _close(y, torch.stack([of(p, x.shape, 0)[me * per_rank:(me + 1) * per_rank] for p in peers], dim=1),
               "enter forward")
        _close(dx, torch.cat([of(p, dy.shape, 1)[:, me] for p in peers]), "enter backward")
        z, dz = of(rank, (per_rank, ep, capacity, hidden), 2), of(rank, (experts, capacity, hidden), 3)
        out, dout = _run_region(mappings.exit_expert_parallel_region, z, dz, scatter_gather=scatter_gather)
        _close(out, torch.cat([of(p, z.shape, 2)[:, me] for p in peers]), "exit forward")
        _close(dout, torch.stack([of(p, dz.shape, 3)[me * per_rank:(me + 1) * per_rank] for p in peers], dim=1),
               "exit backward")
        # The exit undoes the entry.
        _close(mappings.exit_expert_parallel_region(y, scatter_gather), x, "exit(enter(x))")
        return tuple(y.shape)
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("world_name", ["gloo", "cpu_refusing"])
@pytest.mark.parametrize("tp,ep,scatter_gather", [(1, 2, False), (2, 2, True), (2, 2, False), (1, 4, False)])
def test_expert_regions_dispatch_over_the_expert_parallel_group(worlds, world_name, tp, ep, scatter_gather):
    shapes = worlds(4, world_name).run(case_expert_regions, tensor_model_parallel_size=None, seed=31 + tp + ep,
                                       tp=tp, ep=ep, scatter_gather=scatter_gather)
    assert shapes == [(2, ep, 2 * tp, 3)] * 4


def test_expert_regions_check_their_shapes():
    with ps.simulated_topology(world_size=4, rank=1, tensor_model_parallel_size=1, expert_model_parallel_size=2):
        with pytest.raises(ValueError, match=r"its 3 experts must be a multiple of expert_model_parallel_size=2"):
            mappings.enter_expert_parallel_region(torch.randn(3, 2, 2), scatter_gather=False)
        with pytest.raises(ValueError, match=r"dimension 1 must be the expert-parallel size 2"):
            mappings.exit_expert_parallel_region(torch.randn(2, 1, 2, 2), scatter_gather=False)

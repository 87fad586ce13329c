"""NxD's parallel convolutions (nxdtp.conv) against torch.nn.Conv2d, on real gloo ranks.

Multi-rank cases run at tp=2, tp=4 and tp=2 x dp=2. Each builds the dense ``nn.Conv2d``, randomises every parameter
(biases included), loads the matching slices into the parallel layer and compares the forward output, the input
gradient and every weight and bias gradient slice with a random upstream gradient. Expected slices are cut by ``_ref``
below (``chunk`` of the zero-padded dense tensor), independently of ``nxdtp.sharded_init.shard_of``.

Channel counts of 5 are padded by ``partition_pad`` at both degrees (to 6 at tp=2, 8 at tp=4, where rank 3 holds only
padding). Padded channels get random garbage wherever a caller could put some (the upstream gradient of a local output,
the padded channels of a parallel input), and their weight and bias gradients must still be exactly the zero padding of
the dense gradients. The Output -> activation -> Input stack uses a sigmoid, which is not zero at zero, so an unmasked
padded channel would show.

Also: same-seed construction, an ``xla`` world (CPU tensors over the gloo twins), the XLA lowering of the stack (one
all-reduce each way, one graph for every rank), a checkpoint saved at tp=2 merged to dense and resharded to tp=4, and
single-process checks of specs, NxD attributes, meta construction and argument errors. fp32 tolerance 1e-5.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nxdtp import parallel_state as ps
from nxdtp.conv import (
    BaseParallelConv,
    Conv2dWithInputGradAllReduce,
    InputChannelParallelConv2d,
    OutputChannelParallelConv2d,
    conv2d_with_weight_grad_allreduce,
)
from tests.test_layers import (
    _assert_attributes_match_specs,
    _check_data_differs_across_dp,
    _check_identities,
    _close,
    _data_seed,
    _equal,
    _identity,
    _randn,
    _randomise_,
    _tp,
)

WORLDS = [pytest.param(2, 2, id="tp2"), pytest.param(4, 4, id="tp4"), pytest.param(4, 2, id="tp2xdp2")]
TOL = dict(atol=1e-5, rtol=1e-5)


# ---- helpers (run inside the workers as well) ------------------------------------------------------------------------

def _padded(n: int, tp: int) -> int:
    return -(-n // tp) * tp


def _pad_dim(full: torch.Tensor, dim: int, size: int, fill=None) -> torch.Tensor:
    """``full`` grown to ``size`` along ``dim`` with zeros, or with ``fill`` (a tensor of the missing part's shape)."""
    extra = list(full.shape)
    extra[dim] = size - full.shape[dim]
    tail = torch.zeros(extra, dtype=full.dtype) if fill is None else fill
    return torch.cat([full, tail], dim=dim)


def _ref(full: torch.Tensor, dim: int, rank: int, tp: int, fill=None) -> torch.Tensor:
    """Reference shard: rank's 1/tp of ``full`` zero-padded (or ``fill``-padded) along ``dim`` to a multiple of tp."""
    full = full.detach()
    return _pad_dim(full, dim, _padded(full.shape[dim], tp), fill).chunk(tp, dim=dim)[rank]


def _garbage(full: torch.Tensor, dim: int, tp: int, seed: int):
    """Random values for the padding of ``full`` along ``dim`` (None when there is none)."""
    extra = list(full.shape)
    extra[dim] = _padded(full.shape[dim], tp) - full.shape[dim]
    return _randn(extra, seed) if extra[dim] else None


def _load(param: torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad():
        param.copy_(value)


KERNEL = (3, 2)
# stride / padding / dilation / padding_mode variants, each compared with nn.Conv2d built with the same arguments.
VARIANTS = [dict(), dict(stride=2, padding=1), dict(stride=(2, 1), padding=(1, 0), dilation=(2, 1)),
            dict(padding=1, padding_mode="reflect"), dict(padding=(1, 2), padding_mode="circular"),
            dict(padding=1, padding_mode="replicate")]


def _check_output_channel(seed, gather_output, bias, out_channels=8, partition_pad=False, **conv):
    rank, tp = _tp()
    what = f"Output(gather_output={gather_output}, bias={bias}, out={out_channels}, pad={partition_pad}, {conv})"
    dense = nn.Conv2d(4, out_channels, KERNEL, bias=bias, **conv)
    _randomise_(dense, seed)
    layer = OutputChannelParallelConv2d(4, out_channels, KERNEL, bias=bias, gather_output=gather_output,
                                        partition_pad=partition_pad, **conv)
    assert layer.channels_per_partition == _padded(out_channels, tp) // tp, what
    _load(layer.weight, _ref(dense.weight, 0, rank, tp))
    if bias:
        _load(layer.bias, _ref(dense.bias, 0, rank, tp))

    x = _randn((2, 4, 7, 6), _data_seed(seed + 1))
    xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    yd = dense(xd)
    g = _randn(yd.shape, _data_seed(seed + 2))
    yd.backward(g)

    out = layer(xp)
    if gather_output:
        _close(out, yd.detach(), f"{what} gathered output")
        out.backward(g)
    else:
        _close(out, _ref(yd, 1, rank, tp), f"{what} local output (padded channels zero)")
        out.backward(_ref(g, 1, rank, tp, fill=_garbage(g, 1, tp, seed + 3)))
    _close(xp.grad, xd.grad, f"{what} input grad")
    _close(layer.weight.grad, _ref(dense.weight.grad, 0, rank, tp), f"{what} weight grad")
    if bias:
        _close(layer.bias.grad, _ref(dense.bias.grad, 0, rank, tp), f"{what} bias grad")
    else:
        assert layer.bias is None, what
    return x.sum().item()


def _check_input_channel(seed, input_is_parallel, bias, in_channels=8, partition_pad=False, **conv):
    rank, tp = _tp()
    what = f"Input(input_is_parallel={input_is_parallel}, bias={bias}, in={in_channels}, pad={partition_pad}, {conv})"
    dense = nn.Conv2d(in_channels, 4, KERNEL, bias=bias, **conv)
    _randomise_(dense, seed)
    layer = InputChannelParallelConv2d(in_channels, 4, KERNEL, bias=bias, input_is_parallel=input_is_parallel,
                                       partition_pad=partition_pad, **conv)
    _load(layer.weight, _ref(dense.weight, 1, rank, tp))
    if bias:
        _load(layer.bias, dense.bias.detach())

    x = _randn((2, in_channels, 7, 6), _data_seed(seed + 1))
    xd = x.clone().requires_grad_()
    # A parallel input's padded channels hold garbage: the layer must ignore them.
    xp = (_ref(x, 1, rank, tp, fill=_garbage(x, 1, tp, seed + 3)) if input_is_parallel else x.clone()).requires_grad_()
    yd = dense(xd)
    g = _randn(yd.shape, _data_seed(seed + 2))
    yd.backward(g)

    out = layer(xp)
    _close(out, yd.detach(), f"{what} output")
    out.backward(g)
    _close(xp.grad, _ref(xd.grad, 1, rank, tp) if input_is_parallel else xd.grad, f"{what} input grad")
    _close(layer.weight.grad, _ref(dense.weight.grad, 1, rank, tp), f"{what} weight grad")
    if bias:
        _close(layer.bias.grad, dense.bias.grad, f"{what} bias grad")
    else:
        assert layer.bias is None, what
    return x.sum().item()


def _check_stack(seed, bias, mid=8, partition_pad=False, **conv):
    """Output(gather_output=False) -> sigmoid -> Input(input_is_parallel=True): the convolution form of a TP MLP."""
    rank, tp = _tp()
    what = f"stack(bias={bias}, mid={mid}, pad={partition_pad}, {conv})"
    conv1, conv2 = nn.Conv2d(3, mid, 3, bias=bias, **conv), nn.Conv2d(mid, 4, KERNEL, bias=bias, **conv)
    _randomise_(conv1, seed)
    _randomise_(conv2, seed + 1)
    first = OutputChannelParallelConv2d(3, mid, 3, bias=bias, gather_output=False, partition_pad=partition_pad, **conv)
    second = InputChannelParallelConv2d(mid, 4, KERNEL, bias=bias, input_is_parallel=True,
                                        partition_pad=partition_pad, **conv)
    _load(first.weight, _ref(conv1.weight, 0, rank, tp))
    _load(second.weight, _ref(conv2.weight, 1, rank, tp))
    if bias:
        _load(first.bias, _ref(conv1.bias, 0, rank, tp))
        _load(second.bias, conv2.bias.detach())

    x = _randn((2, 3, 8, 7), _data_seed(seed + 2))
    xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    yd = conv2(torch.sigmoid(conv1(xd)))
    g = _randn(yd.shape, _data_seed(seed + 3))
    yd.backward(g)
    yp = second(torch.sigmoid(first(xp)))
    _close(yp, yd.detach(), f"{what} output")
    yp.backward(g)
    _close(xp.grad, xd.grad, f"{what} input grad")
    _close(first.weight.grad, _ref(conv1.weight.grad, 0, rank, tp), f"{what} first weight grad")
    _close(second.weight.grad, _ref(conv2.weight.grad, 1, rank, tp), f"{what} second weight grad")
    if bias:
        _close(first.bias.grad, _ref(conv1.bias.grad, 0, rank, tp), f"{what} first bias grad")
        _close(second.bias.grad, conv2.bias.grad, f"{what} second bias grad")
    return x.sum().item()


# ---- 1. same-seed construction ---------------------------------------------------------------------------------------

def case_construction():
    rank, tp = _tp()
    for cls, dim in ((OutputChannelParallelConv2d, 0), (InputChannelParallelConv2d, 1)):
        for bias in (True, False):
            for channels, pad in ((8, False), (5, True)):
                shape = (4, channels) if dim == 0 else (channels, 4)
                what = f"{cls.__name__}{shape}(bias={bias}, partition_pad={pad})"
                torch.manual_seed(21)
                dense = nn.Conv2d(*shape, KERNEL, bias=bias)
                after_dense = torch.get_rng_state()
                torch.manual_seed(21)
                layer = cls(*shape, KERNEL, bias=bias, keep_master_weight=True, partition_pad=pad)
                assert torch.equal(torch.get_rng_state(), after_dense), f"{what}: drew other random numbers"
                _equal(layer.weight.detach(), _ref(dense.weight, dim, rank, tp), f"{what} weight")
                _equal(layer.master_weight, _pad_dim(dense.weight.detach(), dim, _padded(channels, tp)),
                       f"{what} master_weight")
                if not bias:
                    assert layer.bias is None, what
                elif dim == 0:
                    _equal(layer.bias.detach(), _ref(dense.bias, 0, rank, tp), f"{what} bias")
                    _equal(layer.master_bias, _pad_dim(dense.bias.detach(), 0, _padded(channels, tp)), f"{what} master")
                else:
                    _equal(layer.bias.detach(), dense.bias.detach(), f"{what} bias (replicated)")

    # dtype: the fp32 master cast; init_method: replaces the weight init and sees the full dense weight.
    torch.manual_seed(22)
    dense = nn.Conv2d(4, 8, 3)
    torch.manual_seed(22)
    layer = OutputChannelParallelConv2d(4, 8, 3, dtype=torch.bfloat16)
    _equal(layer.weight.detach(), _ref(dense.weight, 0, rank, tp).bfloat16(), "bf16 weight")
    _equal(layer.bias.detach(), _ref(dense.bias, 0, rank, tp).bfloat16(), "bf16 bias")
    seen = []
    torch.manual_seed(23)
    layer = InputChannelParallelConv2d(8, 4, 3, init_method=lambda w: seen.append(tuple(w.shape)) or nn.init.normal_(w))
    torch.manual_seed(23)
    expected = torch.empty(4, 8, 3, 3).normal_()
    assert seen == [(4, 8, 3, 3)]
    _equal(layer.weight.detach(), _ref(expected, 1, rank, tp), "init_method weight")
    assert getattr(OutputChannelParallelConv2d(4, 8, 3), "master_weight", None) is None
    return _identity(), None


@pytest.mark.parametrize("world,tp", WORLDS)
def test_same_seed_construction_equals_dense_slice(worlds, world, tp):
    _check_identities(worlds(world).run(case_construction, tensor_model_parallel_size=tp), world, tp)


# ---- 2. both layers and the stack against nn.Conv2d ------------------------------------------------------------------

def case_conv():
    seed, checksum = 500, None
    for flag in (True, False):
        for bias in (True, False):
            seed += 10
            s = _check_output_channel(seed, flag, bias)
            checksum = s if checksum is None else checksum
            seed += 10
            _check_input_channel(seed, flag, bias)
            for channels in (5, 8):  # 5: padded at tp=2 and tp=4; 8: partition_pad=True pads nothing
                seed += 10
                _check_output_channel(seed, flag, bias, out_channels=channels, partition_pad=True)
                seed += 10
                _check_input_channel(seed, flag, bias, in_channels=channels, partition_pad=True)
    for conv in VARIANTS:
        for flag in (True, False):
            seed += 10
            _check_output_channel(seed, flag, True, **conv)
            seed += 10
            _check_input_channel(seed, flag, True, **conv)
    for bias in (True, False):
        for mid, pad in ((8, False), (5, True)):
            seed += 10
            _check_stack(seed, bias, mid, pad)
    seed += 10
    _check_stack(seed, True, 5, True, stride=2, padding=1, dilation=2, padding_mode="reflect")
    return _identity(), checksum


@pytest.mark.parametrize("world,tp", WORLDS)
def test_conv_layers_equal_dense(worlds, world, tp):
    results = worlds(world).run(case_conv, tensor_model_parallel_size=tp)
    _check_identities(results, world, tp)
    _check_data_differs_across_dp(results, world, tp)


def test_conv_layers_on_an_xla_world_use_the_gloo_twins(worlds):
    # The default backend is torch_xla's "xla", which refuses CPU tensors: every CPU collective (construction is
    # local, the regions are not) must take the TP group's gloo twin.
    results = worlds(2, "xla").run(case_conv, tensor_model_parallel_size=2)
    _check_identities(results, 2, 2)


# ---- 3. XLA lowering: one all-reduce each way, one graph for every rank ----------------------------------------------

def case_stack_lowering():
    import torch_xla

    from tests.test_xla import (
        _collective_counts,
        _grads,
        _hlo,
        _replica_groups,
        _reset_collective_token,
        _simulated_rank,
    )

    device = torch_xla.device()
    graphs, counts, groups = [], [], set()
    for rank in range(4):
        with _simulated_rank(world_size=4, rank=rank, tp=4):
            torch.manual_seed(0)
            stack = nn.Sequential(OutputChannelParallelConv2d(3, 6, 3, gather_output=False, partition_pad=True),
                                  nn.GELU(),
                                  InputChannelParallelConv2d(6, 4, 3, input_is_parallel=True, partition_pad=True))
            stack = stack.to(device)
            x = torch.randn(2, 3, 8, 8).to(device).requires_grad_()
            _reset_collective_token()
            y = stack(x)
            forward = _collective_counts(_hlo([y]))
            _reset_collective_token()
            y.backward(torch.ones(y.shape).to(device))
            input_grad = _collective_counts(_hlo([x.grad]))
            step = _hlo(_grads(stack, [y, x.grad]))
            counts.append((forward, input_grad, _collective_counts(step)))
            groups |= _replica_groups(step)
            graphs.append(step)
            _reset_collective_token()
    return {"distinct_graphs": len(set(graphs)), "counts": counts, "groups": sorted(groups)}


@pytest.mark.xla
def test_conv_stack_lowers_to_one_all_reduce_each_way_and_one_graph(worlds):
    result, = worlds(1, "xla-hlo").run(case_stack_lowering, tensor_model_parallel_size=None)
    one = {"all-reduce": 1, "all-gather": 0, "reduce-scatter": 0}
    two = {"all-reduce": 2, "all-gather": 0, "reduce-scatter": 0}
    assert result["counts"] == [(one, one, two)] * 4
    assert result["groups"] == ["{{0,1,2,3}}"]
    # Ranks 0-2 hold real and padded channels in different mixes, rank 3 only padding: the mask is data.
    assert result["distinct_graphs"] == 1


# ---- 4. checkpoint: save at tp=2, merge to dense, reshard to tp=4 ----------------------------------------------------

def _dense_net(seed):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.Sigmoid(), nn.Conv2d(5, 8, 3), nn.ReLU(),
                        nn.Conv2d(8, 4, 1))
    _randomise_(net, seed)
    return net


def _parallel_net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(OutputChannelParallelConv2d(3, 5, 3, padding=1, gather_output=False, partition_pad=True),
                         nn.Sigmoid(),
                         InputChannelParallelConv2d(5, 8, 3, input_is_parallel=True, partition_pad=True), nn.ReLU(),
                         OutputChannelParallelConv2d(8, 4, 1))


def _net_input():
    return _randn((2, 3, 8, 8), 77)


def case_train_and_save(root: str):
    """Two SGD steps (weight decay, momentum) on the parallel net and on the dense one, then save the parallel one."""
    from nxdtp import checkpointing

    rank, tp = _tp()
    dense, net = _dense_net(0), _parallel_net(1)
    for i in (0, 2, 4):
        dim = net[i].partition_dim
        _load(net[i].weight, _ref(dense[i].weight, dim, rank, tp))
        _load(net[i].bias, _ref(dense[i].bias, 0, rank, tp) if dim == 0 else dense[i].bias.detach())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01) for m in (dense, net)]
    x = _net_input()
    for _ in range(2):
        for model, optimizer in zip((dense, net), optimizers):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    for i in (0, 2, 4):  # the padding stayed zero
        dim = net[i].partition_dim
        _close(net[i].weight.detach(), _ref(dense[i].weight, dim, rank, tp), f"layer {i} weight after the steps")
        if dim == 0:
            _close(net[i].bias.detach(), _ref(dense[i].bias, 0, rank, tp), f"layer {i} bias after the steps")
    checkpointing.save({"model": net, "optimizer": optimizers[1], "global_step": 2}, root)
    with torch.no_grad():
        return {k: v.clone() for k, v in dense.state_dict().items()}, dense(x).clone(), net(x).detach().clone()


def case_load(checkpoint_dir: str):
    from nxdtp import checkpointing

    net = _parallel_net(5)
    assert checkpointing.load(checkpoint_dir, model=net)["global_step"] == 2
    with torch.no_grad():
        return net(_net_input()).clone(), {k: s.to_dict() for k, s in net[0].param_specs().items()}


def test_checkpoint_merges_to_dense_and_reshards_to_tp4(worlds, tmp_path):
    from safetensors.torch import load_file

    from nxdtp.checkpointing import CheckpointIndex
    from nxdtp.checkpointing.merge import merge, reshard

    root = str(tmp_path / "tp2")
    dense_state, dense_out, parallel_out = worlds(2).run(case_train_and_save, tensor_model_parallel_size=2,
                                                          root=root)[0]
    _close(parallel_out, dense_out, "tp=2 output after two steps")
    index = CheckpointIndex.read(os.path.join(root, "step_000002"))
    assert index.tensors["0.weight"].spec.full_shape == (6, 3, 3, 3)
    assert index.tensors["0.weight"].spec.unpadded_shape == (5, 3, 3, 3)
    assert index.tensors["2.weight"].spec.full_shape == (8, 6, 3, 3)
    assert index.tensors["2.weight"].spec.partition_dim == 1
    assert not index.tensors["2.bias"].spec.is_sharded

    merge(root, str(tmp_path / "dense"), progress=False)
    merged = load_file(tmp_path / "dense" / "model.safetensors")
    assert merged.keys() == dense_state.keys()
    for key, value in dense_state.items():
        _close(merged[key], value, f"merged {key}")

    reshard(root, str(tmp_path / "tp4"), 4, progress=False)
    loaded = worlds(4).run(case_load, tensor_model_parallel_size=4, checkpoint_dir=str(tmp_path / "tp4"))
    for rank, (out, specs) in enumerate(loaded):
        _close(out, dense_out, f"tp=4 rank {rank} output")
        assert specs["weight"]["full_shape"] == [8, 3, 3, 3] and specs["weight"]["real_shape"] == [5, 3, 3, 3]


# ---- single process: specs, NxD attributes, meta, the autograd function, bad arguments ------------------------------

def test_specs_nxd_attributes_and_state_dict():
    with ps.simulated_topology(world_size=8, rank=7, tensor_model_parallel_size=4):  # TP rank 3
        out = OutputChannelParallelConv2d(4, 6, (3, 2), partition_pad=True, gather_output=False)
        inp = InputChannelParallelConv2d(6, 4, 3, stride=2, partition_pad=True, input_is_parallel=True)
        plain = OutputChannelParallelConv2d(4, 8, 1, bias=False)
    summary = lambda m: {k: (s.full_shape, s.unpadded_shape, s.partition_dim, s.num_partitions)  # noqa: E731
                         for k, s in m.param_specs().items()}
    assert summary(out) == {"weight": ((8, 4, 3, 2), (6, 4, 3, 2), 0, 4), "bias": ((8,), (6,), 0, 4)}
    assert summary(inp) == {"weight": ((4, 8, 3, 3), (4, 6, 3, 3), 1, 4), "bias": ((4,), (4,), None, 4)}
    assert summary(plain) == {"weight": ((8, 4, 1, 1), (8, 4, 1, 1), 0, 4)}
    assert (out.weight.tensor_model_parallel, out.weight.partition_dim, out.weight.partition_stride) == (True, 0, 1)
    assert (out.bias.tensor_model_parallel, out.bias.partition_dim) == (True, 0)
    assert (inp.weight.tensor_model_parallel, inp.weight.partition_dim, inp.weight.num_partitions) == (True, 1, 4)
    assert (inp.bias.tensor_model_parallel, inp.bias.partition_dim) == (False, -1)
    for m in (out, inp, plain):
        assert isinstance(m, BaseParallelConv)
        assert _assert_attributes_match_specs(m) == len(m.param_specs())
    # NxD's attributes: the split channel count is the padded one.
    assert (out.in_channels, out.out_channels, out.partition_pad_size, out.channels_per_partition) == (4, 8, 2, 2)
    assert (inp.in_channels, inp.out_channels, inp.partition_pad_size, inp.channels_per_partition) == (8, 4, 2, 2)
    assert (out.kernel_size, out.stride, out.padding, out.dilation) == ((3, 2), (1, 1), (0, 0), (1, 1))
    assert (inp.kernel_size, inp.stride, inp.partition_dim, out.partition_dim) == ((3, 3), (2, 2), 1, 0)
    assert out.allreduce_weight_grad and out.gather_output is False and inp.input_is_parallel is True
    assert (plain.partition_pad_size, plain.out_channels) == (0, 8)
    # TP rank 3 holds only padding: its weight is zero, and its mask is zero.
    assert out.nxdtp_real_channels.tolist() == [0.0, 0.0] and not out.weight.any()
    assert not hasattr(plain, "nxdtp_real_channels")
    sd = out.state_dict()
    assert set(sd) == {"weight", "bias", "_extra_state"}  # the mask is derived, not saved
    assert sd["_extra_state"]["params"]["weight"]["real_shape"] == [6, 4, 3, 2]
    with ps.simulated_topology(world_size=8, rank=5, tensor_model_parallel_size=4):  # TP rank 1: both real
        assert OutputChannelParallelConv2d(4, 6, 1, partition_pad=True).nxdtp_real_channels.tolist() == [1.0, 1.0]
    with ps.simulated_topology(world_size=2, rank=1, tensor_model_parallel_size=2):
        with pytest.raises(ValueError, match=re.escape("saved with partition_dim=0, 4 partitions")):
            OutputChannelParallelConv2d(4, 6, (3, 2), partition_pad=True).load_state_dict(sd)


def test_meta_construction_draws_nothing():
    with ps.simulated_topology(world_size=4, rank=1, tensor_model_parallel_size=4):
        state = torch.get_rng_state()
        out = OutputChannelParallelConv2d(64, 1 << 12, 3, device="meta", keep_master_weight=True)
        inp = InputChannelParallelConv2d(1 << 12, 64, 3, device="meta", partition_pad=True)
        assert torch.equal(torch.get_rng_state(), state)
    assert tuple(out.weight.shape) == (1 << 10, 64, 3, 3) and out.master_weight is None
    assert tuple(inp.weight.shape) == (64, 1 << 10, 3, 3) and tuple(inp.bias.shape) == (64,)
    assert all(p.device.type == "meta" for p in (out.weight, out.bias, inp.weight, inp.bias))


def test_nxd_positional_order():
    with ps.simulated_topology(world_size=2, rank=0, tensor_model_parallel_size=2):
        # in, out, kernel, stride, padding, dilation, groups, bias, padding_mode, gather_output / input_is_parallel
        out = OutputChannelParallelConv2d(4, 8, 3, 2, 1, 1, 1, False, "zeros", False)
        inp = InputChannelParallelConv2d(4, 8, 3, 2, 1, 1, 1, False, "zeros", True)
    assert (out.stride, out.padding, out.bias, out.gather_output) == ((2, 2), (1, 1), None, False)
    assert (inp.stride, inp.padding, inp.bias, inp.input_is_parallel) == ((2, 2), (1, 1), None, True)


def test_conv2d_with_weight_grad_allreduce_at_tp1_equals_conv2d():
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=g) for s in ((2, 3, 9, 8), (5, 3, 3, 2), (5,)))
    ref = [t.clone().requires_grad_() for t in (x, w, b)]
    y_ref = F.conv2d(*ref, stride=(2, 1), padding=(1, 1), dilation=(1, 2))
    upstream = torch.randn(y_ref.shape, generator=g)
    y_ref.backward(upstream)
    with ps.simulated_topology(world_size=1, rank=0, tensor_model_parallel_size=1):
        for call in ("function", "apply"):
            ours = [t.clone().requires_grad_() for t in (x, w, b)]
            if call == "function":
                y = conv2d_with_weight_grad_allreduce(*ours, (2, 1), 1, False, dilation=(1, 2))
            else:
                y = Conv2dWithInputGradAllReduce.apply(*ours, (2, 1), (1, 1), True, (1, 2))
            _close(y, y_ref.detach(), call)
            y.backward(upstream)
            for a, e, name in zip(ours, ref, ("input", "weight", "bias")):
                _close(a.grad, e.grad, f"{call} {name} grad")
        # NxD's six arguments (no dilation), without a bias.
        ours = [t.clone().requires_grad_() for t in (x, w)]
        y = Conv2dWithInputGradAllReduce.apply(*ours, None, (1, 1), (0, 0), True)
        y.sum().backward()
        _close(ours[0].grad, torch.autograd.grad(F.conv2d(x.requires_grad_(), w).sum(), x)[0], "six-argument apply")


def test_autocast_runs_the_convolution_in_the_autocast_dtype():
    with ps.simulated_topology(world_size=1, rank=0, tensor_model_parallel_size=1):
        torch.manual_seed(0)
        dense = nn.Conv2d(4, 8, 3)
        x = torch.randn(2, 4, 6, 6)
        for cls in (OutputChannelParallelConv2d, InputChannelParallelConv2d):
            torch.manual_seed(0)
            layer = cls(4, 8, 3)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                expected = dense(x)
                y = layer(x)
                assert y.dtype == expected.dtype == torch.bfloat16
                torch.testing.assert_close(y.float(), expected.float(), atol=2e-2, rtol=2e-2)  # bf16 rounding
            dense.zero_grad()
            expected.float().sum().backward()
            y.float().sum().backward()
            assert layer.weight.grad.dtype == layer.bias.grad.dtype == torch.float32
            torch.testing.assert_close(layer.weight.grad, dense.weight.grad, atol=5e-2, rtol=2e-2)
            torch.testing.assert_close(layer.bias.grad, dense.bias.grad, atol=5e-2, rtol=2e-2)


def test_wrong_input_is_rejected_with_a_message():
    with ps.simulated_topology(world_size=1, rank=0, tensor_model_parallel_size=1):
        layer = OutputChannelParallelConv2d(4, 8, 3)
        with pytest.raises(ValueError, match=re.escape("expected a 4-D [N, C, H, W] input with C=4 (in_channels), got "
                                                       "shape (2, 5, 6, 6)")):
            layer(torch.randn(2, 5, 6, 6))
        with pytest.raises(ValueError, match=re.escape("got shape (4, 6, 6)")):
            layer(torch.randn(4, 6, 6))
    with ps.simulated_topology(world_size=2, rank=1, tensor_model_parallel_size=2):
        layer = InputChannelParallelConv2d(8, 4, 3, input_is_parallel=True)
        with pytest.raises(ValueError, match=re.escape("C=4 (in_channels / tensor_model_parallel_size)")):
            layer(torch.randn(2, 8, 6, 6))


def _esc(s: str) -> str:
    return re.escape(s)


@pytest.mark.parametrize("build,error,message", [
    (lambda: OutputChannelParallelConv2d(4, 6, 3), ValueError,
     _esc("OutputChannelParallelConv2d: out_channels=6 is not divisible by tensor_model_parallel_size=4; pass "
          "partition_pad=True to pad it to 8")),
    (lambda: InputChannelParallelConv2d(10, 4, 3), ValueError,
     _esc("InputChannelParallelConv2d: in_channels=10 is not divisible by tensor_model_parallel_size=4; pass "
          "partition_pad=True to pad it to 12")),
    (lambda: InputChannelParallelConv2d(10, 4, 3, device="meta"), ValueError, _esc("in_channels=10")),
    (lambda: OutputChannelParallelConv2d(4, 8, 3, groups=2), ValueError,
     _esc("OutputChannelParallelConv2d: groups=2 is not supported by nxdtp; only the default groups=1 is")),
    (lambda: InputChannelParallelConv2d(8, 4, 3, groups=4), ValueError, _esc("groups=4 is not supported")),
    (lambda: OutputChannelParallelConv2d(4, 8, 3, padding_mode="mirror"), ValueError,
     _esc("padding_mode='mirror' is not one of ['zeros', 'reflect', 'replicate', 'circular']")),
    (lambda: OutputChannelParallelConv2d(4, 8, 3, dilation=0), ValueError, _esc("dilation=0 must be >= 1")),
    (lambda: OutputChannelParallelConv2d(4, 8, (3, 0)), ValueError, _esc("kernel_size=(3, 0) must be >= 1")),
    (lambda: InputChannelParallelConv2d(8, 4, 3, stride=0), ValueError, _esc("stride=0 must be >= 1")),
    (lambda: InputChannelParallelConv2d(8, 4, 3, padding=-1), ValueError, _esc("padding=-1 must be >= 0")),
    (lambda: OutputChannelParallelConv2d(4, 8, 3, padding="same"), TypeError,
     _esc("padding='same' must be an int or a pair of ints")),
    (lambda: OutputChannelParallelConv2d(4, 8, (3, 3, 3)), TypeError, _esc("kernel_size=(3, 3, 3) must be an int")),
    (lambda: OutputChannelParallelConv2d(0, 8, 3), ValueError, _esc("in_channels=0 must be a positive int")),
    (lambda: BaseParallelConv(4, 8, 3, 1, 0, 1, 1, True, "zeros", 2, torch.float32), ValueError,
     _esc("partition_dim=2 must be 0 (output channels) or 1 (input channels)")),
])
def test_bad_arguments_are_rejected_with_a_message(build, error, message):
    with ps.simulated_topology(world_size=4, rank=1, tensor_model_parallel_size=4):
        with pytest.raises(error, match=message):
            build()


def test_nxd_defaults_are_accepted_and_layers_reexported():
    import nxdtp.layers

    with ps.simulated_topology(world_size=4, rank=1, tensor_model_parallel_size=4):
        OutputChannelParallelConv2d(4, 8, 3, 1, 0, 1, 1, True, "zeros", True, torch.float32, None, None, False, False)
        InputChannelParallelConv2d(8, 4, 3, 1, 0, 1, 1, True, "zeros", False, torch.float32, None, None, False, False)
    for name in ("BaseParallelConv", "Conv2dWithInputGradAllReduce", "conv2d_with_weight_grad_allreduce",
                 "OutputChannelParallelConv2d", "InputChannelParallelConv2d"):
        assert getattr(nxdtp.layers, name) is getattr(__import__("nxdtp.conv", fromlist=[name]), name)
        assert name in nxdtp.layers.__all__

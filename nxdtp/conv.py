"""Tensor-parallel 2-D convolutions with NxD's names: OutputChannelParallelConv2d and InputChannelParallelConv2d.

A convolution weight is ``[out_channels, in_channels, kH, kW]``. Splitting dim 0 (output channels) is the convolution
analogue of ColumnParallelLinear: the input is replicated, each rank computes its block of output channels, and the
input gradient is summed over TP in backward. Splitting dim 1 (input channels) is the analogue of RowParallelLinear:
each rank convolves its block of input channels into a partial sum of the whole output, the partial sums are all-reduced
and the (replicated) bias is added once afterwards. ``Output(gather_output=False) -> activation ->
Input(input_is_parallel=True)`` is the convolution form of the Megatron MLP: one all-reduce forward and one backward.

As the linear layers do, each layer initialises the full weight the way ``torch.nn.Conv2d`` does (on the CPU generator,
the same on every rank) and keeps this rank's slice, so under the same seed it holds exactly a slice of
``nn.Conv2d``'s weight and bias; the layers own the ParamSpecs that checkpoint merge and reshard read.

``partition_pad=True`` pads the split channel count up to a multiple of the TP size with zero channels. The padded
channels never reach a result: their weights start at zero, a gathered output is narrowed back to the real channels,
and a rank-local mask zeroes padded channels (and so their gradients) wherever they would otherwise flow, so the padded
weights get zero gradients and stay zero under any optimizer. The ParamSpecs record the real shape, and merge strips
the padding.

This module sits below nxdtp.layers (which re-exports its names) and uses only the regions of nxdtp.mappings for
communication.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from . import mappings
from .agreement import RankLocalBuffers
from .record import note_of
from .rounding import round_up
from .sharded_init import InitMethod, linear_bias_init, materialise_shard, reject_unsupported
from .spec import ParamSpec, ShardedModule
from .topology import tensor_parallel_group

IntOr2 = Union[int, Tuple[int, int]]

# Convolution kernels are [c_out, c_in, *kernel_spatial_dims] (NxD's constant names).
CONV_KERNEL_OUTPUT_CHANNEL_DIMENSION = 0
CONV_KERNEL_INPUT_CHANNEL_DIMENSION = 1

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")  # torch.nn.Conv2d's


def _as_tuple2(layer: str, name: str, value, minimum: int) -> Tuple[int, int]:
    """An int or a pair of ints (as torch.nn.Conv2d takes them) as a pair, each at least ``minimum``."""
    pair = (value, value) if isinstance(value, int) and not isinstance(value, bool) else value
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in pair)):
        raise TypeError(f"{layer}: {name}={value!r} must be an int or a pair of ints")
    if min(pair) < minimum:
        raise ValueError(f"{layer}: {name}={value!r} must be >= {minimum}")
    return tuple(pair)


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except RuntimeError:  # a device type autocast does not know (meta)
        pass
    return None


class Conv2dWithInputGradAllReduce(torch.autograd.Function):
    """``F.conv2d`` whose input gradient is summed over the tensor-parallel group in backward when
    ``allreduce_weight_grad`` is true (NxD's name for that flag, which in fact all-reduces the *input* gradient).

    ``apply(input, weight, bias, stride, padding, allreduce_weight_grad[, dilation])``: stride, padding and dilation are
    pairs; ``dilation`` is an nxdtp addition (NxD's takes none and means 1). The sum goes through
    ``mappings.reduce_from_tensor_model_parallel_region``, so it runs on every backend nxdtp.comm serves. Backward is
    once-differentiable.
    """

    @staticmethod
    def forward(ctx, input, weight, bias, stride, padding, allreduce_weight_grad, dilation=(1, 1)):
        ctx.save_for_backward(input, weight)
        ctx.stride, ctx.padding, ctx.dilation = tuple(stride), tuple(padding), tuple(dilation)
        ctx.allreduce_weight_grad = bool(allreduce_weight_grad)
        ctx.bias_is_none = bias is None
        return F.conv2d(input, weight, bias, ctx.stride, ctx.padding, ctx.dilation)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        output_mask = [needs[0], needs[1], (not ctx.bias_is_none) and needs[2]]
        # The same kernel autograd uses for F.conv2d, so gradients equal those of torch.nn.Conv2d.
        grad_input, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
            grad_output.contiguous(), input, weight, None if ctx.bias_is_none else [weight.shape[0]], list(ctx.stride),
            list(ctx.padding), list(ctx.dilation), False, [0, 0], 1, output_mask)
        if grad_input is not None and ctx.allreduce_weight_grad:
            grad_input = mappings.reduce_from_tensor_model_parallel_region(grad_input)
        # One gradient per input given to apply (dilation is optional).
        return (grad_input, grad_weight, grad_bias) + (None,) * (len(needs) - 3)


def conv2d_with_weight_grad_allreduce(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                                      stride: IntOr2, padding: IntOr2, allreduce_weight_grad: bool,
                                      dilation: IntOr2 = 1) -> torch.Tensor:
    """``Conv2dWithInputGradAllReduce.apply`` with NxD's signature (plus ``dilation``). Under autocast the tensors are
    cast to the autocast dtype first and the convolution runs with autocast off, so forward and backward agree on it."""
    stride, padding, dilation = (_as_tuple2("conv2d_with_weight_grad_allreduce", name, value, minimum)
                                 for name, value, minimum in (("stride", stride, 1), ("padding", padding, 0),
                                                              ("dilation", dilation, 1)))
    device_type = input.device.type
    dtype = _autocast_dtype(device_type)
    if dtype is None:
        return Conv2dWithInputGradAllReduce.apply(input, weight, bias, stride, padding, allreduce_weight_grad, dilation)
    cast = lambda t: t.to(dtype) if t is not None and t.is_floating_point() else t  # noqa: E731
    with torch.autocast(device_type, enabled=False):
        return Conv2dWithInputGradAllReduce.apply(cast(input), cast(weight), cast(bias), stride, padding,
                                                  allreduce_weight_grad, dilation)


def _check_conv_arguments(layer: str, in_channels: int, out_channels: int, groups: int, padding_mode: str,
                          partition_dim: int) -> None:
    """Refuse what NxD's parallel convolutions do not support, and channel counts that are not positive ints."""
    reject_unsupported(layer, groups=(groups, 1))
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"{layer}: padding_mode={padding_mode!r} is not one of {list(PADDING_MODES)}")
    if partition_dim not in (CONV_KERNEL_OUTPUT_CHANNEL_DIMENSION, CONV_KERNEL_INPUT_CHANNEL_DIMENSION):
        raise ValueError(f"{layer}: partition_dim={partition_dim!r} must be 0 (output channels) or 1 (input "
                         "channels)")
    for name, value in (("in_channels", in_channels), ("out_channels", out_channels)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{layer}: {name}={value!r} must be a positive int")


class BaseParallelConv(ShardedModule):
    """What both parallel convolutions share: argument checks, the channel split (with ``partition_pad``), the same-seed
    initialisation of weight and bias, their ParamSpecs, and NxD's attributes.

    NxD's signature: ``(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode,
    partition_dim, dtype, device=None, init_method=None, keep_master_params=False, partition_pad=False)``, with
    ``partition_dim`` 0 (output channels) or 1 (input channels).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: IntOr2, stride: IntOr2, padding: IntOr2,
                 dilation: IntOr2, groups: int, bias: bool, padding_mode: str, partition_dim: int,
                 dtype: torch.dtype, device=None, init_method: Optional[InitMethod] = None,
                 keep_master_params: bool = False, partition_pad: bool = False):
        super().__init__()
        layer = type(self).__name__
        _check_conv_arguments(layer, in_channels, out_channels, groups, padding_mode, partition_dim)
        self.kernel_size = _as_tuple2(layer, "kernel_size", kernel_size, 1)
        self.stride = _as_tuple2(layer, "stride", stride, 1)
        self.padding = _as_tuple2(layer, "padding", padding, 0)
        self.dilation = _as_tuple2(layer, "dilation", dilation, 1)
        self.groups, self.padding_mode = groups, padding_mode
        self.partition_dim = partition_dim
        self.arg_init_method, self.dtype = init_method, dtype
        self.keep_master_params, self.partition_pad = keep_master_params, partition_pad

        group = tensor_parallel_group()
        real = self._split_channels(layer, in_channels, out_channels, group.size)
        kh, kw = self.kernel_size
        # partition_pad's rule (a multiple of the degree) is recorded, so a reshard pads the channels for another
        # degree as this layer would be built there, whatever other tensors of the model are padded to.
        padding_record = dict(pad_to_multiple_of=1) if partition_pad else {}
        self._make_weight((out_channels, in_channels, kh, kw), real, device, init_method or _conv_weight_init,
                          group.size, padding_record)
        if bias:
            # The dense fan-in, as torch.nn.Conv2d computes it.
            self._make_bias(out_channels, in_channels * kh * kw, device, group.size, padding_record)
        else:
            self.register_parameter("bias", None)
        if self.partition_pad_size:
            self._register_real_channel_mask(real, group.rank, device)
        self._forward_impl = conv2d_with_weight_grad_allreduce

    def _split_channels(self, layer: str, in_channels: int, out_channels: int, tp: int) -> int:
        """Set the channel counts NxD's attributes give (the split one padded to a multiple of ``tp`` with
        ``partition_pad``, refused otherwise); return the real count of the split channels."""
        output_split = self.partition_dim == CONV_KERNEL_OUTPUT_CHANNEL_DIMENSION
        split_name = "out_channels" if output_split else "in_channels"
        real = out_channels if output_split else in_channels
        padded = round_up(real, tp)
        if padded != real and not self.partition_pad:
            raise ValueError(f"{layer}: {split_name}={real} is not divisible by tensor_model_parallel_size={tp}; pass "
                             f"partition_pad=True to pad it to {padded}")
        # As in NxD: the split channel count attribute is the padded one, partition_pad_size the zero channels added.
        self.partition_pad_size = padded - real
        self.in_channels = in_channels if output_split else padded
        self.out_channels = padded if output_split else out_channels
        self.channels_per_partition = padded // tp
        return real

    def _make_weight(self, real_shape: Tuple[int, int, int, int], real: int, device, weight_init: InitMethod,
                     tp: int, padding_record: Dict[str, int]) -> None:
        """This rank's slice of the weight, initialised as nn.Conv2d's (the padded channels zero), and its spec."""
        partition_dim = self.partition_dim
        full_shape = (self.out_channels, self.in_channels) + tuple(real_shape[2:])

        def init_weight(full: torch.Tensor) -> None:
            if tuple(full.shape) == real_shape:
                weight_init(full)
                return
            # The real block is initialised as a tensor of its own, so it draws what nn.Conv2d's weight draws.
            dense = torch.empty(real_shape, dtype=full.dtype)
            weight_init(dense)
            full.zero_()
            full.narrow(partition_dim, 0, real).copy_(dense)

        weight, master = materialise_shard(full_shape, self.dtype, device, init_weight, dim=partition_dim, stride=1,
                                           keep_master=self.keep_master_params)
        self.weight = nn.Parameter(weight)
        if self.keep_master_params:
            self.master_weight = master
        spec = dict(num_partitions=tp, real_shape=real_shape if self.partition_pad_size else None, **padding_record)
        self.register_param_spec("weight", ParamSpec(full_shape=full_shape, partition_dim=partition_dim, **spec))

    def _make_bias(self, out_channels: int, fan_in: int, device, tp: int, padding_record: Dict[str, int]) -> None:
        """The bias (this rank's slice when the output channels are split, else whole), as nn.Conv2d's, and its spec."""

        def init_bias(full: torch.Tensor) -> None:
            if full.shape[0] == out_channels:
                linear_bias_init(full, fan_in)
                return
            dense = torch.empty(out_channels, dtype=full.dtype)
            linear_bias_init(dense, fan_in)
            full.zero_()
            full[:out_channels].copy_(dense)

        sharded = self.partition_dim == CONV_KERNEL_OUTPUT_CHANNEL_DIMENSION
        b, master_bias = materialise_shard((self.out_channels,), self.dtype, device, init_bias,
                                           dim=0 if sharded else None, stride=1, keep_master=self.keep_master_params)
        self.bias = nn.Parameter(b)
        if self.keep_master_params:
            self.master_bias = master_bias
        if sharded:
            self.register_param_spec("bias", ParamSpec(
                full_shape=(self.out_channels,), partition_dim=0, num_partitions=tp,
                real_shape=(out_channels,) if self.partition_pad_size else None, **padding_record))
        else:
            self.register_param_spec("bias", ParamSpec(full_shape=(out_channels,), num_partitions=tp))

    def _register_real_channel_mask(self, real: int, rank: int, device) -> None:
        """The buffer ``_mask_padded_channels`` multiplies by: 1 for this rank's real channels, 0 for its padded
        ones."""
        # A buffer (data, not a Python constant), so every rank traces the same graph; derived from the arguments, so
        # not saved; rank-local, so the broadcast of replicated state leaves it alone.
        start = rank * self.channels_per_partition
        mask = (torch.arange(start, start + self.channels_per_partition) < real).to(torch.float32)
        mask_device = "cpu" if device is None or torch.device(device).type == "meta" else device
        self.register_buffer("nxdtp_real_channels", mask.to(mask_device), persistent=False)
        note_of(self, RankLocalBuffers).names = ("nxdtp_real_channels",)

    def _mask_padded_channels(self, tensor: torch.Tensor) -> torch.Tensor:
        """Zero this rank's padded channels (dim 1) of ``tensor``, and with them their gradients."""
        if not self.partition_pad_size:
            return tensor
        return tensor * self.nxdtp_real_channels.to(tensor.dtype).view(-1, 1, 1)

    def _check_input(self, input_: torch.Tensor, channels: int, what: str) -> None:
        if input_.dim() != 4 or input_.shape[1] != channels:
            raise ValueError(f"{type(self).__name__}: expected a 4-D [N, C, H, W] input with C={channels} ({what}), "
                             f"got shape {tuple(input_.shape)}")

    def _convolve(self, input_: torch.Tensor, bias: Optional[torch.Tensor], allreduce: bool) -> torch.Tensor:
        padding = self.padding
        if self.padding_mode != "zeros":
            # As torch.nn.Conv2d does: pad the spatial dims explicitly, then convolve without padding.
            ph, pw = self.padding
            input_ = F.pad(input_, (pw, pw, ph, ph), mode=self.padding_mode)
            padding = (0, 0)
        return self._forward_impl(input_, self.weight, bias, self.stride, padding, allreduce, self.dilation)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, padding_mode={self.padding_mode!r}, "
                f"bias={self.bias is not None}, partition_dim={self.partition_dim}, "
                f"channels_per_partition={self.channels_per_partition}, partition_pad_size={self.partition_pad_size}")


def _conv_weight_init(weight: torch.Tensor) -> None:
    # torch.nn.Conv2d's default, so a parallel layer equals a slice of nn.Conv2d under the same seed.
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


class OutputChannelParallelConv2d(BaseParallelConv):
    """``torch.nn.Conv2d`` split along its output channels: each TP rank computes its block of output channels.

    The input ``[N, in_channels, H, W]`` is replicated; its gradient is summed over TP in backward. With
    ``gather_output=True`` (the default) the output is all-gathered along the channel dim and equals ``nn.Conv2d``'s;
    otherwise each rank returns its ``[N, out_channels / tp, H', W']`` block (with ``partition_pad``, the padded
    channels of the last ranks are zero).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: IntOr2, stride: IntOr2 = 1,
                 padding: IntOr2 = 0, dilation: IntOr2 = 1, groups: int = 1, bias: bool = True,
                 padding_mode: str = "zeros", gather_output: bool = True, dtype: torch.dtype = torch.float32,
                 device=None, init_method: Optional[InitMethod] = None, keep_master_weight: bool = False,
                 partition_pad: bool = False):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode,
                         CONV_KERNEL_OUTPUT_CHANNEL_DIMENSION, dtype, device, init_method, keep_master_weight,
                         partition_pad)
        self.gather_output = gather_output
        self.allreduce_weight_grad = tensor_parallel_group().size > 1

    def forward(self, in_tensor: torch.Tensor) -> torch.Tensor:
        self._check_input(in_tensor, self.in_channels, "in_channels")
        # The bias is added per rank before any gather: each rank adds its own block of it.
        output_parallel = self._convolve(in_tensor, self.bias, self.allreduce_weight_grad)
        if not self.gather_output:
            return self._mask_padded_channels(output_parallel)
        output = mappings.gather_from_tensor_model_parallel_region(output_parallel, partition_dim=1)
        if self.partition_pad_size:
            output = output.narrow(1, 0, self.out_channels - self.partition_pad_size)
        return output


class InputChannelParallelConv2d(BaseParallelConv):
    """``torch.nn.Conv2d`` split along its input channels: each TP rank convolves its block of input channels into a
    partial sum of the whole output; the partial sums are all-reduced and the replicated bias is added once after.

    With ``input_is_parallel=False`` (the default) the input ``[N, in_channels, H, W]`` is full and this rank's channels
    are kept (the gradient is all-gathered in backward). With ``input_is_parallel=True`` the input is already this
    rank's ``[N, in_channels / tp, H, W]`` block, e.g. the output of
    ``OutputChannelParallelConv2d(gather_output=False)``.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: IntOr2, stride: IntOr2 = 1,
                 padding: IntOr2 = 0, dilation: IntOr2 = 1, groups: int = 1, bias: bool = True,
                 padding_mode: str = "zeros", input_is_parallel: bool = False, dtype: torch.dtype = torch.float32,
                 device=None, init_method: Optional[InitMethod] = None, keep_master_weight: bool = False,
                 partition_pad: bool = False):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode,
                         CONV_KERNEL_INPUT_CHANNEL_DIMENSION, dtype, device, init_method, keep_master_weight,
                         partition_pad)
        self.input_is_parallel = input_is_parallel

    def forward(self, in_tensor: torch.Tensor) -> torch.Tensor:
        if self.input_is_parallel:
            self._check_input(in_tensor, self.channels_per_partition, "in_channels / tensor_model_parallel_size")
            input_parallel = self._mask_padded_channels(in_tensor)
        else:
            self._check_input(in_tensor, self.in_channels - self.partition_pad_size, "in_channels")
            if self.partition_pad_size:
                in_tensor = F.pad(in_tensor, (0, 0, 0, 0, 0, self.partition_pad_size))  # zero channels
            input_parallel = mappings.scatter_input_channels_to_tensor_model_parallel_region(in_tensor)
        # No bias here: it is added once, after the partial sums are reduced.
        output_parallel = self._convolve(input_parallel, None, False)
        output = mappings.reduce_from_tensor_model_parallel_region(output_parallel)
        if self.bias is not None:
            # In the output's dtype, as nn.Conv2d's bias is (under autocast the output is the lower precision).
            output = output + self.bias.to(output.dtype).view(-1, 1, 1)
        return output


__all__ = ["BaseParallelConv", "Conv2dWithInputGradAllReduce", "conv2d_with_weight_grad_allreduce",
           "OutputChannelParallelConv2d", "InputChannelParallelConv2d"]

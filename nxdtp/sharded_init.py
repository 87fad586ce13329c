"""How a parallel layer builds its parameters: the dense tensor initialised once, this rank keeps its shard.

Shared by every layer family (linear, embedding, convolution, fused QKV), so that "a parallel layer made with the same
seed holds exactly the slice of the dense layer's weight" is implemented once.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch
from torch import nn

from .spec import ParamSpec, ShardedModule, split_along
from .topology import ParallelGroup, expert_parallel_group, tensor_parallel_group

InitMethod = Callable[[torch.Tensor], object]


def reject_unsupported(layer: str, **given_and_default) -> None:
    """``name=(given, default)``: NxD options nxdtp does not implement are only accepted at their default."""
    for name, (given, default) in given_and_default.items():
        if given is not default and given != default:
            raise ValueError(f"{layer}: {name}={given!r} is not supported by nxdtp; only the default "
                             f"{name}={default!r} is")


def divide_over_ranks(what: str, size: int, parts: int) -> int:
    if size % parts != 0:
        raise ValueError(f"{what}={size} is not divisible by tensor_model_parallel_size={parts}")
    return size // parts


def linear_weight_init(weight: torch.Tensor) -> None:
    # torch.nn.Linear's default, so a parallel layer equals a slice of nn.Linear under the same seed.
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def linear_bias_init(bias: torch.Tensor, fan_in: int) -> None:
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
    nn.init.uniform_(bias, -bound, bound)


def shard_of(full: torch.Tensor, dim: int, rank: int, num_partitions: int, stride: int = 1) -> torch.Tensor:
    """Rank ``rank``'s part of ``full`` split along ``dim``.

    With ``stride`` s > 1 (fused weights such as QKV), the dimension is first cut into s blocks and the rank takes its
    1/num_partitions slice of each block, so every rank holds matching pieces of Q, K and V. This is the layout
    algebra's cut (``nxdtp.spec.split_along``) under the name layers and NxD-style callers know.
    """
    return split_along(full, dim, rank, num_partitions, stride)


def materialise_shard(shape: Tuple[int, ...], dtype, device, init: Callable[[torch.Tensor], object], dim: Optional[int],
                      stride: int, keep_master: bool, group: Optional[ParallelGroup] = None
                      ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Initialise the full tensor on CPU with ``init`` and keep this rank's shard (all of it when ``dim`` is None) of
    ``group`` (the tensor-parallel group by default)."""
    group = group or tensor_parallel_group()
    if torch.device(device if device is not None else "cpu").type == "meta":
        local = list(shape)
        if dim is not None:
            local[dim] //= group.size
        return torch.empty(local, dtype=dtype, device="meta"), None
    master = torch.empty(shape, dtype=torch.float32)
    init(master)
    local = master if dim is None else shard_of(master, dim, group.rank, group.size, stride)
    local = local.to(dtype=dtype, device=device)
    return local, (master.to(dtype) if keep_master else None)


def split_size(layer: str, what: str, size: int, tp: int, stride: int) -> int:
    """The per-rank size of a dimension split over ``tp`` ranks with ``stride`` fused blocks."""
    if stride < 1:
        raise ValueError(f"{layer}: stride={stride} must be >= 1")
    per_rank = divide_over_ranks(f"{layer} {what}", size, tp)
    if size % (tp * stride) != 0:
        raise ValueError(f"{layer}: {what}={size} is not divisible by tensor_model_parallel_size * stride = "
                         f"{tp} * {stride}")
    return per_rank


def init_linear_weight(layer: ShardedModule, input_size: int, output_size: int, dim: int, stride: int, dtype, device,
                       init_method: Optional[InitMethod], keep_master_weight: bool,
                       group: Optional[ParallelGroup] = None) -> None:
    """Create ``layer.weight`` as this rank's slice of the dense [output_size, input_size] weight, split along
    ``dim``."""
    weight, master = materialise_shard((output_size, input_size), dtype, device, init_method or linear_weight_init,
                                       dim=dim, stride=stride, keep_master=keep_master_weight, group=group)
    layer.weight = nn.Parameter(weight)
    if keep_master_weight:
        layer.master_weight = master
    layer.register_param_spec("weight", ParamSpec(full_shape=(output_size, input_size), partition_dim=dim,
                                                  stride=stride,
                                                  num_partitions=(group or tensor_parallel_group()).size))


def create_local_weight(full_weight: torch.Tensor, partition_dim: int, per_partition_size: int, stride: int,
                        out_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """NxD's name: this tensor-parallel rank's part of ``full_weight`` along ``partition_dim`` (``per_partition_size``
    elements, in ``stride`` blocks as ``shard_of`` cuts them), written into ``out_weight`` when given."""
    group = tensor_parallel_group()
    if full_weight.shape[partition_dim] != per_partition_size * group.size:
        raise ValueError(f"create_local_weight: dimension {partition_dim} of shape {tuple(full_weight.shape)} is not "
                         f"per_partition_size={per_partition_size} * tensor_model_parallel_size={group.size}")
    local = shard_of(full_weight, partition_dim, group.rank, group.size, stride)
    if out_weight is None:
        return local
    with torch.no_grad():
        return out_weight.copy_(local)


def reinitialise_local(param: torch.Tensor, spec: ParamSpec, init: InitMethod, group: ParallelGroup,
                       zero_rows: Tuple[int, ...] = ()) -> torch.Tensor:
    """Draw ``param`` again as its layer would: the dense tensor (the spec's unpadded shape) in fp32 on CPU with
    ``init`` (rows ``zero_rows`` of it set to zero), laid out by the spec (KV copies, zero padding), and this rank's
    part of ``group`` copied into ``param`` in place. The dense draw is the same on every rank under one seed, so every
    data-parallel replica gets the same values, and together the TP ranks hold exactly a dense init's slices. Returns
    the fp32 dense tensor (NxD keeps it as the master weight)."""
    dense = torch.empty(spec.unpadded_shape, dtype=torch.float32)
    init(dense)
    with torch.no_grad():
        for row in zero_rows:
            dense[row].zero_()
        full = spec.full_from_dense(dense)
        local = spec.local_of_full(full, group.rank, expert_parallel_group().rank)
        if tuple(local.shape) != tuple(param.shape):
            raise ValueError(f"re-initialising a parameter of shape {tuple(param.shape)}: its spec gives this rank a "
                             f"part of shape {tuple(local.shape)}")
        param.detach().copy_(local)
    return dense

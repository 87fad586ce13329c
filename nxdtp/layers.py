"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, ParallelEmbedding and a sequence-parallel LayerNorm.

Each layer is built so that, with the same seed, it holds exactly the slice of the weight the dense layer would hold:
the full master weight is initialised on the CPU generator (the same on every rank) and the rank keeps its slice. The
default initialisation matches ``torch.nn.Linear`` / ``torch.nn.Embedding``, so ``ColumnParallelLinear(i, o)`` under seed s
equals a slice of ``nn.Linear(i, o)`` under seed s, biases included.

Layers own their sharding spec (nxdtp.spec); keyword arguments of NxD's layers that nxdtp does not implement are accepted
at their NxD default and rejected otherwise.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import mappings
from .parallel_state import tensor_parallel_group
from .sharded_init import (InitMethod, divide_over_ranks, init_linear_weight, linear_bias_init, materialise_shard,
                           reject_unsupported, shard_of, split_size)
from .spec import ParamSpec, ShardedModule
from .conv import BaseParallelConv, Conv2dWithInputGradAllReduce, InputChannelParallelConv2d, OutputChannelParallelConv2d, conv2d_with_weight_grad_allreduce


class ColumnParallelLinear(ShardedModule):
    """``Y = X A^T + b`` with A split along its output dimension: each TP rank computes its columns of Y.

    The input is replicated (or, with ``sequence_parallel_enabled``, sequence-sharded and all-gathered here). The output
    stays sharded along the last dimension unless ``gather_output=True``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = True,
                 dtype: torch.dtype = torch.float32, device=None, stride: int = 1,
                 init_method: Optional[InitMethod] = None, sequence_parallel_enabled: bool = False,
                 sequence_dimension: Optional[int] = None, keep_master_weight: bool = False,
                 skip_bias_add: bool = False, pad: bool = False, tensor_model_parallel_group=None,
                 reduce_dtype: torch.dtype = torch.float32, input_in_tensor_parallel_region: bool = False,
                 **unsupported):
        super().__init__()
        if unsupported:
            raise TypeError(f"ColumnParallelLinear got unexpected keyword arguments {sorted(unsupported)}")
        reject_unsupported("ColumnParallelLinear", pad=(pad, False),
                            tensor_model_parallel_group=(tensor_model_parallel_group, None),
                            reduce_dtype=(reduce_dtype, torch.float32))
        if sequence_parallel_enabled and gather_output:
            raise ValueError("ColumnParallelLinear: sequence_parallel_enabled=True needs gather_output=False (the "
                             "sequence-parallel input is gathered on entry; gathering the output as well is not defined)")
        tp = tensor_parallel_group().size
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = split_size("ColumnParallelLinear", "output_size", output_size, tp, stride)
        self.gather_output, self.skip_bias_add, self.stride = gather_output, skip_bias_add, stride
        # Several column layers reading one input (Q, K and V) can share a single entry region opened by the caller,
        # so backward sums their input gradients in one all-reduce instead of one each.
        self.input_in_tensor_parallel_region = input_in_tensor_parallel_region
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.sequence_dimension = 0 if sequence_dimension is None else sequence_dimension

        init_linear_weight(self, input_size, output_size, 0, stride, dtype, device, init_method, keep_master_weight)
        if bias:
            b, _ = materialise_shard((output_size,), dtype, device, lambda t: linear_bias_init(t, input_size),
                                dim=0, stride=stride, keep_master=False)
            self.bias = nn.Parameter(b)
            self.register_param_spec("bias", ParamSpec(full_shape=(output_size,), partition_dim=0, stride=stride,
                                                       num_partitions=tp))
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor):
        if self.input_in_tensor_parallel_region:
            input_parallel = input_
        elif self.sequence_parallel_enabled:
            input_parallel = mappings.gather_from_sequence_parallel_region(
                input_, to_model_parallel=True, sequence_dimension=self.sequence_dimension)
        else:
            input_parallel = mappings.copy_to_tensor_model_parallel_region(input_)
        bias = None if self.skip_bias_add else self.bias
        output = F.linear(input_parallel, self.weight, bias)
        if not self.gather_output:
            return (output, self.bias) if self.skip_bias_add else output
        output = self._gather(output)
        if self.skip_bias_add:
            # The caller adds the bias to the full output, so it gets the full bias too.
            return output, (self._gather(self.bias) if self.bias is not None else None)
        return output

    def _gather(self, sharded_last_dim: torch.Tensor) -> torch.Tensor:
        gathered = mappings.gather_from_tensor_model_parallel_region(sharded_last_dim)
        return _unstride_last_dim(gathered, self.stride, tensor_parallel_group().size)

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, output_size={self.output_size}, per_partition="
                f"{self.output_size_per_partition}, bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"stride={self.stride}, sequence_parallel={self.sequence_parallel_enabled}")


def _unstride_last_dim(gathered: torch.Tensor, stride: int, tp: int) -> torch.Tensor:
    """Put an all-gathered strided output back in dense order: [r0: s0 s1 .., r1: s0 s1 ..] -> [s0: r0 r1 .., s1: ..]."""
    if stride == 1 or tp == 1:
        return gathered
    lead, last = gathered.shape[:-1], gathered.shape[-1]
    blocks = gathered.reshape(*lead, tp, stride, last // (tp * stride))
    return blocks.transpose(-3, -2).reshape(*lead, last)


def _stride_last_dim(full: torch.Tensor, stride: int, tp: int) -> torch.Tensor:
    """Inverse of ``_unstride_last_dim``: dense order [s0: r0 r1 .., s1: ..] -> [r0: s0 s1 .., r1: s0 s1 ..]."""
    if stride == 1 or tp == 1:
        return full
    lead, last = full.shape[:-1], full.shape[-1]
    blocks = full.reshape(*lead, stride, tp, last // (tp * stride))
    return blocks.transpose(-3, -2).reshape(*lead, last)


class RowParallelLinear(ShardedModule):
    """``Y = X A^T + b`` with A split along its input dimension: each TP rank computes a partial sum of Y.

    The partial sums are all-reduced (or reduce-scattered along the sequence with ``sequence_parallel_enabled``); the
    bias is replicated and added once after the reduction.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, device=None, stride: int = 1,
                 init_method: Optional[InitMethod] = None, sequence_parallel_enabled: bool = False,
                 sequence_dimension: Optional[int] = None, keep_master_weight: bool = False,
                 skip_bias_add: bool = False, pad: bool = False, reduce_output: bool = True,
                 tensor_model_parallel_group=None, reduce_dtype: torch.dtype = torch.float32, **unsupported):
        super().__init__()
        if unsupported:
            raise TypeError(f"RowParallelLinear got unexpected keyword arguments {sorted(unsupported)}")
        reject_unsupported("RowParallelLinear", pad=(pad, False),
                            tensor_model_parallel_group=(tensor_model_parallel_group, None),
                            reduce_dtype=(reduce_dtype, torch.float32))
        if sequence_parallel_enabled and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel_enabled=True needs input_is_parallel=True")
        if sequence_parallel_enabled and not reduce_output:
            raise ValueError("RowParallelLinear: sequence_parallel_enabled=True reduce-scatters the output; "
                             "reduce_output=False cannot be combined with it")
        if not reduce_output and bias and not skip_bias_add:
            raise ValueError("RowParallelLinear: reduce_output=False with bias=True needs skip_bias_add=True: the output "
                             "is a partial sum, and a bias added on every rank would be counted tensor_model_parallel_size "
                             "times once the caller reduces it")
        tp = tensor_parallel_group().size
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = split_size("RowParallelLinear", "input_size", input_size, tp, stride)
        self.input_is_parallel, self.reduce_output = input_is_parallel, reduce_output
        self.skip_bias_add, self.stride = skip_bias_add, stride
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.sequence_dimension = 0 if sequence_dimension is None else sequence_dimension

        init_linear_weight(self, input_size, output_size, 1, stride, dtype, device, init_method, keep_master_weight)
        if bias:
            b, _ = materialise_shard((output_size,), dtype, device, lambda t: linear_bias_init(t, input_size),
                                dim=None, stride=1, keep_master=False)
            self.bias = nn.Parameter(b)
            # Under sequence parallelism each rank adds the bias to its own sequence shard, so its gradient is a
            # partial sum that must be all-reduced over TP.
            self.register_param_spec("bias", ParamSpec(full_shape=(output_size,), num_partitions=tp,
                                                       sequence_parallel=sequence_parallel_enabled))
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor):
        if self.input_is_parallel:
            input_parallel = input_
        else:
            # With stride > 1 the weight holds the rank's slice of each of the `stride` blocks of the input dimension
            # (shard_of); reorder the full input so that a contiguous split hands every rank the matching columns.
            input_parallel = mappings.scatter_to_tensor_model_parallel_region(
                _stride_last_dim(input_, self.stride, tensor_parallel_group().size))
        output_parallel = F.linear(input_parallel, self.weight)
        if self.sequence_parallel_enabled:
            output = mappings.reduce_scatter_to_sequence_parallel_region(
                output_parallel, sequence_dimension=self.sequence_dimension)
        elif self.reduce_output:
            output = mappings.reduce_from_tensor_model_parallel_region(output_parallel)
        else:
            output = output_parallel
        if self.skip_bias_add:
            return output, self.bias
        return output + self.bias if self.bias is not None else output

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, output_size={self.output_size}, per_partition="
                f"{self.input_size_per_partition}, bias={self.bias is not None}, input_is_parallel="
                f"{self.input_is_parallel}, sequence_parallel={self.sequence_parallel_enabled}")


class ParallelEmbedding(ShardedModule):
    """Embedding split over TP ranks.

    Default: by vocabulary. Each rank holds a contiguous block of rows, looks up only the ids in its block (others read
    as zero) and the partial results are all-reduced (reduce-scattered along the sequence with
    ``sequence_parallel_enabled``). ``shard_across_embedding=True`` splits the embedding dimension instead and all-gathers
    the output. ``pad=True`` pads the vocabulary to a multiple of the TP size; padded rows are zero and never looked up.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 max_norm: Optional[float] = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, init_method: Optional[InitMethod] = None, device=None,
                 dtype: torch.dtype = torch.float32, shard_across_embedding: bool = False, pad: bool = False,
                 tensor_model_parallel_group=None, sequence_parallel_enabled: bool = False,
                 sequence_dimension: Optional[int] = None, pad_to_multiple_of: int = 1, **unsupported):
        super().__init__()
        if unsupported:
            raise TypeError(f"ParallelEmbedding got unexpected keyword arguments {sorted(unsupported)}")
        if pad_to_multiple_of < 1:
            raise ValueError(f"ParallelEmbedding: pad_to_multiple_of={pad_to_multiple_of} must be >= 1")
        reject_unsupported("ParallelEmbedding", max_norm=(max_norm, None), norm_type=(norm_type, 2.0),
                            scale_grad_by_freq=(scale_grad_by_freq, False), sparse=(sparse, False),
                            tensor_model_parallel_group=(tensor_model_parallel_group, None))
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"ParallelEmbedding: padding_idx={padding_idx} must be in "
                                 f"[{-num_embeddings}, {num_embeddings})")
            padding_idx %= num_embeddings  # as torch.nn.Embedding: -1 is the last row
        group = tensor_parallel_group()
        tp = group.size
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.shard_across_embedding = shard_across_embedding
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.sequence_dimension = 0 if sequence_dimension is None else sequence_dimension

        if shard_across_embedding:
            divide_over_ranks("ParallelEmbedding embedding_dim", embedding_dim, tp)
            self.padded_num_embeddings = num_embeddings
            dim = 1
        else:
            # Megatron's make_vocab_size_divisible_by: each rank's block is a multiple of pad_to_multiple_of.
            multiple = tp * pad_to_multiple_of
            self.padded_num_embeddings = num_embeddings
            if num_embeddings % multiple != 0:
                if not pad:
                    raise ValueError(
                        f"ParallelEmbedding: num_embeddings={num_embeddings} is not divisible by "
                        f"tensor_model_parallel_size={tp}" + (f" * pad_to_multiple_of={pad_to_multiple_of}"
                                                              if pad_to_multiple_of > 1 else "")
                        + f"; pass pad=True to pad the vocabulary to {-(-num_embeddings // multiple) * multiple}")
                self.padded_num_embeddings = -(-num_embeddings // multiple) * multiple
            dim = 0
        rows_per_rank = self.padded_num_embeddings // tp
        self.vocab_start_index = 0 if shard_across_embedding else group.rank * rows_per_rank
        self.vocab_end_index = num_embeddings if shard_across_embedding else self.vocab_start_index + rows_per_rank

        full_shape = (self.padded_num_embeddings, embedding_dim)
        user_init = init_method

        def init(full: torch.Tensor) -> None:
            real = full[:num_embeddings]
            (user_init or nn.init.normal_)(real)  # normal_ is torch.nn.Embedding's default
            if padding_idx is not None:
                real[padding_idx].zero_()
            full[num_embeddings:].zero_()

        weight, _ = materialise_shard(full_shape, dtype, device, init, dim=dim, stride=1, keep_master=False)
        self.weight = nn.Parameter(weight)
        self.register_param_spec("weight", ParamSpec(full_shape=full_shape, partition_dim=dim, num_partitions=tp,
                                                     real_shape=(num_embeddings, embedding_dim)))

    def _local_padding_idx(self) -> Optional[int]:
        if self.padding_idx is None or self.shard_across_embedding:
            return self.padding_idx
        if self.vocab_start_index <= self.padding_idx < self.vocab_end_index:
            return self.padding_idx - self.vocab_start_index
        return None

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.shard_across_embedding:
            output = F.embedding(input_, self.weight, self.padding_idx)
            output = mappings.gather_from_tensor_model_parallel_region(output)
            if self.sequence_parallel_enabled:
                output = mappings.scatter_to_sequence_parallel_region(output, self.sequence_dimension)
            return output
        if tensor_parallel_group().size == 1:
            return F.embedding(input_, self.weight, self.padding_idx)
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        output_parallel = F.embedding(local_ids, self.weight, self._local_padding_idx())
        output_parallel = output_parallel.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel_enabled:
            return mappings.reduce_scatter_to_sequence_parallel_region(output_parallel, self.sequence_dimension)
        return mappings.reduce_from_tensor_model_parallel_region(output_parallel)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, padded_num_embeddings={self.padded_num_embeddings}, "
                f"shard_across_embedding={self.shard_across_embedding}, "
                f"sequence_parallel={self.sequence_parallel_enabled}")


class LayerNorm(nn.LayerNorm, ShardedModule):
    """``torch.nn.LayerNorm`` whose parameters are replicated over TP and, with ``sequence_parallel_enabled``, marked so
    that ``nxdtp.grads.allreduce_sequence_parallel_gradients`` sums their gradients over TP (each rank normalises only
    its sequence shard, so each holds a partial gradient)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 sequence_parallel_enabled: bool = False, device=None, dtype=None):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias, device=device,
                         dtype=dtype)
        self.sequence_parallel_enabled = sequence_parallel_enabled
        tp = tensor_parallel_group().size
        for name in ("weight", "bias"):
            if getattr(self, name, None) is not None:
                self.register_param_spec(name, ParamSpec(full_shape=tuple(getattr(self, name).shape), num_partitions=tp,
                                                         sequence_parallel=sequence_parallel_enabled))


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ParallelEmbedding", "LayerNorm", "shard_of",
           "BaseParallelConv", "Conv2dWithInputGradAllReduce", "conv2d_with_weight_grad_allreduce",
           "OutputChannelParallelConv2d", "InputChannelParallelConv2d"]

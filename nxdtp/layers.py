"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, ParallelEmbedding and a sequence-parallel LayerNorm.

Each layer is built so that, with the same seed, it holds exactly the slice of the weight the dense layer would hold:
the full master weight is initialised on the CPU generator (the same on every rank) and the rank keeps its slice. The
default initialisation matches ``torch.nn.Linear`` / ``torch.nn.Embedding``, so ``ColumnParallelLinear(i, o)`` under
seed s equals a slice of ``nn.Linear(i, o)`` under seed s, biases included.

Layers own their sharding spec (nxdtp.spec). Every NxD keyword is accepted; one that nxdtp does not implement at some
value is refused at that value with an error naming it, never silently ignored.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from . import mappings, sequence_parallel_linear
from .conv import (  # noqa: F401 - NxD's path
    BaseParallelConv,
    Conv2dWithInputGradAllReduce,
    InputChannelParallelConv2d,
    OutputChannelParallelConv2d,
    conv2d_with_weight_grad_allreduce,
)
from .rounding import round_up
from .sharded_init import (
    InitMethod,
    create_local_weight,
    init_linear_weight,
    linear_bias_init,
    linear_weight_init,
    materialise_shard,
    reinitialise_local,
    reject_unsupported,
    shard_of,
    split_size,
)
from .spec import ParamSpec, ShardedModule, from_rank_order, to_rank_order
from .topology import (
    ParallelGroup,
    get_topology,
    group_of,
    model_parallel_is_initialized,
    rank_tensor,
    tensor_parallel_group,
)
from .utils import cast_if_autocast_enabled, initialize_fallback_parallel_state


def _check_rank_ordering(layer: str, rank_ordering: Optional[Sequence[int]], tp: int) -> None:
    if rank_ordering is None or list(rank_ordering) == list(range(tp)):
        return
    raise ValueError(f"{layer}: rank_ordering={list(rank_ordering)!r} is not supported by nxdtp: tensor-parallel "
                     f"rank r holds shard r and the collectives gather in rank order; valid are None or "
                     f"{list(range(tp))}")


class BaseParallelLayer(ShardedModule):
    """NxD's base of the parallel layers: the group a layer is split over.

    Built before ``initialize_model_parallel``, it warns and sets up a world of one process on ``device``'s backend
    (``nxdtp.utils.initialize_fallback_parallel_state``), as NxD does, so the layer works unsplit.

    ``tensor_model_parallel_group=None`` means the tensor-parallel group of the installed topology, looked up at each
    use; any other value is resolved once by ``nxdtp.parallel_state.group_of`` (nxdtp's own groups, or a subgroup made
    by ``dist.new_group``).
    """

    def __init__(self, device=None, tensor_model_parallel_group=None):
        super().__init__()
        if not model_parallel_is_initialized():
            # NxD's behaviour: a layer built before any parallel state works as its non-parallel equivalent.
            initialize_fallback_parallel_state(device)
            processes = get_topology().world_size
            over = "a world of one process" if processes == 1 else (
                f"tensor_model_parallel_size=1 over the {processes} processes of this world")
            warnings.warn(f"model parallel is not initialized: falling back to {over} "
                          "(nxdtp.utils.initialize_fallback_parallel_state), so this layer is not split; call "
                          "initialize_model_parallel(...) before building layers to split them", UserWarning,
                          stacklevel=3)
        self._explicit_group: Optional[ParallelGroup] = (
            None if tensor_model_parallel_group is None else group_of(tensor_model_parallel_group))

    def _group(self) -> ParallelGroup:
        return self._explicit_group or tensor_parallel_group()

    def __getstate__(self):
        # A layer holds one TP rank's shard: record which, so that loading it elsewhere is refused (__setstate__).
        state = dict(super().__getstate__())
        group = self._group()
        state["_nxdtp_pickled_shard"] = (group.size, group.rank)
        return state

    def __setstate__(self, state):
        state = dict(state)
        pickled = state.pop("_nxdtp_pickled_shard", None)
        super().__setstate__(state)
        if pickled is None:
            return
        size, rank = pickled
        if not model_parallel_is_initialized():
            raise RuntimeError(f"{type(self).__name__} was pickled as the shard of tensor-parallel rank {rank} of "
                               f"{size}; call initialize_model_parallel(tensor_model_parallel_size={size}) before "
                               "loading it")
        group = self._group()
        if (group.size, group.rank) != (size, rank):
            raise RuntimeError(f"{type(self).__name__} was pickled as the shard of tensor-parallel rank {rank} of "
                               f"{size}, but this process is tensor-parallel rank {group.rank} of {group.size}; load "
                               "it on the rank it was saved from (or save a checkpoint and reshard it: "
                               "docs/checkpoints.md)")

    def get_extra_state(self):
        state = super().get_extra_state()
        group = self._group()
        if group != tensor_parallel_group():
            # Checkpoints store tensor-parallel shards: saving these as such would file one group's slices under the
            # other's ranks. The index refuses a state dict that carries this.
            state["split_over_ranks"] = list(group.ranks)
        return state


class LinearWithAsyncCommunication:
    """NxD's linear autograd function, built from nxdtp's regions: ``apply(input, weight, bias, async_grad_allreduce,
    sequence_parallel_enabled, sequence_dimension=0, save_for_backward=True, process_group=None,
    reduce_dtype=torch.float32)``.

    With ``sequence_parallel_enabled`` the sequence-sharded input is all-gathered and its gradient reduce-scattered;
    only the shard is kept for backward, where it is all-gathered again for the weight gradient
    (``nxdtp.sequence_parallel_linear``, as Megatron-LM does). Otherwise with ``async_grad_allreduce`` the input
    gradient is all-reduced over the group (both sums in ``reduce_dtype``). Not a ``torch.autograd.Function``
    subclass: its gradients are those of the regions it is made of, so there is one implementation of each collective
    path.
    """

    @staticmethod
    def apply(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], async_grad_allreduce: bool,
              sequence_parallel_enabled: bool, sequence_dimension: Optional[int] = 0, save_for_backward: bool = True,
              process_group=None, reduce_dtype: Optional[torch.dtype] = torch.float32) -> torch.Tensor:
        if not save_for_backward:
            raise ValueError("LinearWithAsyncCommunication: save_for_backward=False is not supported by nxdtp: "
                             "autograd keeps what the weight gradient needs; only save_for_backward=True is valid")
        if sequence_parallel_enabled:
            if sequence_dimension is None:
                raise ValueError("LinearWithAsyncCommunication: sequence_parallel_enabled=True needs a "
                                 "sequence_dimension (0 for [seq, batch, hidden] inputs), got None")
            input = sequence_parallel_linear.gather_keeping_shard(input, sequence_dimension, process_group,
                                                                  reduce_dtype=reduce_dtype)
        elif async_grad_allreduce:
            input = sequence_parallel_linear.carry_note(
                input, mappings.copy_to_tensor_model_parallel_region(input, process_group, reduce_dtype=reduce_dtype))
        # An input gathered along the sequence (here, or once for several layers by the caller) keeps only its shard.
        return sequence_parallel_linear.linear(input, weight, bias)


def linear_with_async_allreduce(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                                async_grad_allreduce: bool, sequence_parallel_enabled: bool,
                                sequence_dimension: Optional[int] = 0,
                                autograd_func_class=LinearWithAsyncCommunication, save_for_backward: bool = True,
                                process_group=None,
                                reduce_dtype: Optional[torch.dtype] = torch.float32) -> torch.Tensor:
    """NxD's linear entry point: under autocast the operands are cast to the autocast dtype first (as NxD does), then
    ``autograd_func_class.apply`` runs with autocast off."""
    args = cast_if_autocast_enabled(input, weight, bias)
    sequence_parallel_linear.carry_note(input, args[0])
    with torch.autocast(device_type=input.device.type, enabled=False):
        return autograd_func_class.apply(*args, async_grad_allreduce, sequence_parallel_enabled, sequence_dimension,
                                         save_for_backward, process_group, reduce_dtype)


class BaseParallelLinear(BaseParallelLayer):
    """NxD's base of the linear layers; ``autograd_func_class`` is what the layer's matrix product runs through."""

    autograd_func_class = LinearWithAsyncCommunication

    def _check_pad_false_for_training(self) -> None:
        if self.pad and self.training:
            raise RuntimeError(
                f"{type(self).__name__}: pad=True is for inference only (as in NxD): the zero padding would take "
                "gradients in training wherever a padded output is used. Call model.eval(), or use sizes the "
                f"tensor-parallel size {self._group().size} divides")

    def init_weight_cpu(self) -> None:
        """NxD's re-initialisation of the weight (what NxD's Llama ``init_weights`` calls after a meta-device build):
        the dense weight drawn again on CPU with the layer's ``init_method`` (``nn.Linear``'s default when None), this
        rank's slice kept in place. Every data-parallel replica draws the same values under one seed, and the TP ranks'
        slices together are a dense init's weight (zero padding where the layer pads). The bias is left alone, as in
        NxD. With ``keep_master_weight`` the dense weight is kept as ``master_weight`` again."""
        dense = reinitialise_local(self.weight, self.param_specs()["weight"],
                                   getattr(self, "arg_init_method", None) or linear_weight_init, self._group())
        if getattr(self, "master_weight", None) is not None:
            self.master_weight = self.param_specs()["weight"].full_from_dense(dense).to(self.weight.dtype)


def _padded_linear_weight(layer: BaseParallelLinear, input_size: int, output_size: int, dim: int, padded: int,
                          stride: int, dtype, device, init_method: Optional[InitMethod], keep_master_weight: bool,
                          group: ParallelGroup, pad_multiple: Optional[int] = None) -> None:
    """``layer.weight`` as this rank's slice of the dense weight padded with zeros along ``dim`` to ``padded``, the
    rule ``round_up(size, pad_multiple * tp)`` when ``pad_multiple`` is given (recorded in the spec)."""
    if padded == (output_size, input_size)[dim] and pad_multiple is None:
        init_linear_weight(layer, input_size, output_size, dim, stride, dtype, device, init_method, keep_master_weight,
                           group)
        return
    real = (output_size, input_size)
    full_shape = list(real)
    full_shape[dim] = padded

    def init(full: torch.Tensor) -> None:
        (init_method or linear_weight_init)(full.narrow(dim, 0, real[dim]))  # fan-in of the real weight, as dense
        full.narrow(dim, real[dim], padded - real[dim]).zero_()

    weight, master = materialise_shard(tuple(full_shape), dtype, device, init, dim=dim, stride=stride,
                                       keep_master=keep_master_weight, group=group)
    layer.weight = nn.Parameter(weight)
    if keep_master_weight:
        layer.master_weight = master
    layer.register_param_spec("weight", ParamSpec(full_shape=tuple(full_shape), partition_dim=dim, stride=stride,
                                                  num_partitions=group.size, real_shape=real,
                                                  pad_to_multiple_of=pad_multiple))


def _check_pad_arguments(layer: str, pad: bool, stride: int, pad_alignment_size_per_rank: int = 1) -> None:
    if pad_alignment_size_per_rank < 1:
        raise ValueError(f"{layer}: pad_alignment_size_per_rank={pad_alignment_size_per_rank} must be >= 1")
    if pad and stride != 1:
        raise ValueError(f"{layer}: pad=True with stride={stride} is not supported: padding goes after the last fused "
                         "block, which would leave the blocks unequal; pad each block's size instead")


class ColumnParallelLinear(BaseParallelLinear):
    """``Y = X A^T + b`` with A split along its output dimension: each TP rank computes its columns of Y.

    The input is replicated (or, with ``sequence_parallel_enabled``, sequence-sharded and all-gathered here; then only
    the shard is kept for backward, which all-gathers it again for the weight gradient, and a frozen weight keeps
    nothing). With ``input_in_tensor_parallel_region``, an input that a block's entry region gathered with
    ``nxdtp.sequence_parallel_linear.gather_keeping_shard`` is likewise kept as its shard. The output stays sharded
    along the last dimension unless ``gather_output=True``. The input gradient is summed over the group in
    ``reduce_dtype``. ``pad=True`` pads the output dimension with zero rows to a multiple of
    ``pad_alignment_size_per_rank`` times the group size; a gathered output is cut back to ``output_size`` unless
    ``keep_padded_output``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = True,
                 dtype: torch.dtype = torch.float32, device=None, stride: int = 1,
                 init_method: Optional[InitMethod] = None, sequence_parallel_enabled: bool = False,
                 sequence_dimension: Optional[int] = None, keep_master_weight: bool = False,
                 skip_bias_add: bool = False, pad: bool = False, pad_alignment_size_per_rank: int = 1,
                 keep_padded_output: bool = False, tensor_model_parallel_group=None,
                 reduce_dtype: Optional[torch.dtype] = torch.float32, rank_ordering: Optional[Sequence[int]] = None,
                 input_in_tensor_parallel_region: bool = False, **unsupported):
        super().__init__(device, tensor_model_parallel_group)
        if unsupported:
            raise TypeError(f"ColumnParallelLinear got unexpected keyword arguments {sorted(unsupported)}")
        group = self._group()
        tp = group.size
        _check_rank_ordering("ColumnParallelLinear", rank_ordering, tp)
        _check_pad_arguments("ColumnParallelLinear", pad, stride, pad_alignment_size_per_rank)
        if sequence_parallel_enabled and gather_output:
            raise ValueError("ColumnParallelLinear: sequence_parallel_enabled=True needs gather_output=False (the "
                             "sequence-parallel input is gathered on entry; gathering the output as well is not "
                             "defined)")
        self.input_size, self.output_size = input_size, output_size
        self.arg_init_method = init_method  # NxD's name; init_weight_cpu() draws with it
        self.pad, self.keep_padded_output = pad, keep_padded_output
        self.pad_size = round_up(output_size, pad_alignment_size_per_rank * tp) - output_size if pad else 0
        pad_multiple = pad_alignment_size_per_rank if pad else None
        padded = output_size + self.pad_size
        self.output_size_per_partition = split_size("ColumnParallelLinear", "output_size", padded, tp, stride)
        self.gather_output, self.skip_bias_add, self.stride = gather_output, skip_bias_add, stride
        self.reduce_dtype = dtype if reduce_dtype is None else reduce_dtype
        # Several column layers reading one input (Q, K and V) can share a single entry region opened by the caller,
        # so backward sums their input gradients in one all-reduce instead of one each.
        self.input_in_tensor_parallel_region = input_in_tensor_parallel_region
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.sequence_dimension = 0 if sequence_dimension is None else sequence_dimension

        _padded_linear_weight(self, input_size, output_size, 0, padded, stride, dtype, device, init_method,
                              keep_master_weight, group, pad_multiple)
        if bias:
            def init_bias(full: torch.Tensor) -> None:
                linear_bias_init(full[:output_size], input_size)
                full[output_size:].zero_()

            b, _ = materialise_shard((padded,), dtype, device, init_bias, dim=0, stride=stride, keep_master=False,
                                     group=group)
            self.bias = nn.Parameter(b)
            self.register_param_spec("bias", ParamSpec(full_shape=(padded,), partition_dim=0, stride=stride,
                                                       num_partitions=tp, real_shape=(output_size,),
                                                       pad_to_multiple_of=pad_multiple))
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor):
        self._check_pad_false_for_training()
        in_region = self.input_in_tensor_parallel_region
        output = linear_with_async_allreduce(
            input_, self.weight, None if self.skip_bias_add else self.bias,
            async_grad_allreduce=not in_region and not self.sequence_parallel_enabled,
            sequence_parallel_enabled=not in_region and self.sequence_parallel_enabled,
            sequence_dimension=self.sequence_dimension, autograd_func_class=self.autograd_func_class,
            process_group=self._group(), reduce_dtype=self.reduce_dtype)
        if not self.gather_output:
            return (output, self.bias) if self.skip_bias_add else output
        output = self._gather(output)
        if self.skip_bias_add:
            # The caller adds the bias to the full output, so it gets the full bias too.
            return output, (self._gather(self.bias) if self.bias is not None else None)
        return output

    def _gather(self, sharded_last_dim: torch.Tensor) -> torch.Tensor:
        group = self._group()
        gathered = mappings.gather_from_tensor_model_parallel_region(sharded_last_dim, group)
        gathered = from_rank_order(gathered, -1, group.size, self.stride)
        if self.pad_size and not self.keep_padded_output:
            gathered = gathered.narrow(-1, 0, self.output_size)
        return gathered

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, output_size={self.output_size}, per_partition="
                f"{self.output_size_per_partition}, bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"stride={self.stride}, sequence_parallel={self.sequence_parallel_enabled}"
                + (f", pad_size={self.pad_size}" if self.pad_size else ""))


class RowParallelLinear(BaseParallelLinear):
    """``Y = X A^T + b`` with A split along its input dimension: each TP rank computes a partial sum of Y.

    The partial sums are all-reduced (or reduce-scattered along the sequence with ``sequence_parallel_enabled``) in
    ``reduce_dtype``; the bias is replicated and added once after the reduction. ``pad=True`` pads the input dimension
    with zero columns to a multiple of the group size (a full input is padded with zeros to match).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, device=None, stride: int = 1,
                 init_method: Optional[InitMethod] = None, sequence_parallel_enabled: bool = False,
                 sequence_dimension: Optional[int] = None, keep_master_weight: bool = False,
                 skip_bias_add: bool = False, pad: bool = False, reduce_output: bool = True,
                 tensor_model_parallel_group=None, reduce_dtype: Optional[torch.dtype] = torch.float32,
                 tile_cc: bool = False, rank_ordering: Optional[Sequence[int]] = None, **unsupported):
        super().__init__(device, tensor_model_parallel_group)
        if unsupported:
            raise TypeError(f"RowParallelLinear got unexpected keyword arguments {sorted(unsupported)}")
        group = self._group()
        tp = group.size
        _check_rank_ordering("RowParallelLinear", rank_ordering, tp)
        _check_pad_arguments("RowParallelLinear", pad, stride)
        mappings.note_tile_cc("RowParallelLinear", tile_cc)
        if sequence_parallel_enabled and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel_enabled=True needs input_is_parallel=True")
        if sequence_parallel_enabled and not reduce_output:
            raise ValueError("RowParallelLinear: sequence_parallel_enabled=True reduce-scatters the output; "
                             "reduce_output=False cannot be combined with it")
        if not reduce_output and bias and not skip_bias_add:
            raise ValueError("RowParallelLinear: reduce_output=False with bias=True needs skip_bias_add=True: the "
                             "output is a partial sum, and a bias added on every rank would be counted "
                             "tensor_model_parallel_size times once the caller reduces it")
        self.input_size, self.output_size = input_size, output_size
        self.pad = pad
        self.arg_init_method = init_method  # NxD's name; init_weight_cpu() draws with it
        self.pad_size = round_up(input_size, tp) - input_size if pad else 0
        padded = input_size + self.pad_size
        self.input_size_per_partition = split_size("RowParallelLinear", "input_size", padded, tp, stride)
        self.input_is_parallel, self.reduce_output = input_is_parallel, reduce_output
        self.skip_bias_add, self.stride = skip_bias_add, stride
        self.reduce_dtype = dtype if reduce_dtype is None else reduce_dtype
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.sequence_dimension = 0 if sequence_dimension is None else sequence_dimension

        _padded_linear_weight(self, input_size, output_size, 1, padded, stride, dtype, device, init_method,
                              keep_master_weight, group, 1 if pad else None)
        if bias:
            b, _ = materialise_shard((output_size,), dtype, device, lambda t: linear_bias_init(t, input_size),
                                     dim=None, stride=1, keep_master=False, group=group)
            self.bias = nn.Parameter(b)
            # Under sequence parallelism each rank adds the bias to its own sequence shard, so its gradient is a
            # partial sum that must be all-reduced over TP.
            self.register_param_spec("bias", ParamSpec(full_shape=(output_size,), num_partitions=tp,
                                                       sequence_parallel=sequence_parallel_enabled))
        else:
            self.register_parameter("bias", None)

    def parallel_input(self, input_: torch.Tensor) -> torch.Tensor:
        """The input as this rank's weight columns read it: as given with ``input_is_parallel``, else this rank's
        columns of the full input (padded, strided), with the gradient all-gathered in backward. A LoRA adapter on this
        layer reads its input the same way (``nxdtp.models.peft_lora``)."""
        if self.input_is_parallel:
            return input_
        group = self._group()
        if self.pad_size:
            input_ = F.pad(input_, (0, self.pad_size))
        # With stride > 1 the weight holds the rank's slice of each of the `stride` blocks of the input dimension
        # (shard_of); reorder the full input so that a contiguous split hands every rank the matching columns.
        return mappings.scatter_to_tensor_model_parallel_region(to_rank_order(input_, -1, group.size, self.stride),
                                                                group)

    def forward(self, input_: torch.Tensor):
        self._check_pad_false_for_training()
        group = self._group()
        input_parallel = self.parallel_input(input_)
        output_parallel = linear_with_async_allreduce(
            input_parallel, self.weight, None, async_grad_allreduce=False, sequence_parallel_enabled=False,
            sequence_dimension=self.sequence_dimension, autograd_func_class=self.autograd_func_class,
            process_group=group, reduce_dtype=self.reduce_dtype)
        if self.sequence_parallel_enabled:
            output = mappings.reduce_scatter_to_sequence_parallel_region(
                output_parallel, self.sequence_dimension, group, reduce_dtype=self.reduce_dtype)
        elif self.reduce_output:
            output = mappings.reduce_from_tensor_model_parallel_region(output_parallel, group,
                                                                       reduce_dtype=self.reduce_dtype)
        else:
            output = output_parallel
        if self.skip_bias_add:
            return output, self.bias
        return output + self.bias if self.bias is not None else output

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, output_size={self.output_size}, per_partition="
                f"{self.input_size_per_partition}, bias={self.bias is not None}, input_is_parallel="
                f"{self.input_is_parallel}, sequence_parallel={self.sequence_parallel_enabled}"
                + (f", pad_size={self.pad_size}" if self.pad_size else ""))


class SPMDRank(ShardedModule):
    """The rank as data: ``rank`` is an int32 parameter of one element holding this rank's position, sharded over
    ``world_size`` ranks (its full form is ``arange(world_size)``, which is what a checkpoint stores). Code that
    computes offsets from ``get_rank()`` instead of a Python int traces one graph for every rank.

    ``world_size`` is the tensor-parallel size (the position is the TP rank) or the world size (the global rank).
    """

    def __init__(self, world_size: int, tensor_model_parallel_size: Optional[int] = None):
        super().__init__()
        topology = get_topology()
        tp = topology.tensor_model_parallel_size if tensor_model_parallel_size is None else tensor_model_parallel_size
        world = topology.world_size
        if world_size == tp:
            position = topology.tensor_parallel.rank
        elif world_size == world:
            position = topology.rank
        else:
            raise ValueError(f"SPMDRank: world_size={world_size} is neither the tensor-parallel size {tp} nor the "
                             f"world size {world}")
        self.world_size, self.tensor_model_parallel_size = world_size, tp
        self.rank = nn.Parameter(torch.tensor([position], dtype=torch.int32), requires_grad=False)
        self.register_param_spec("rank", ParamSpec(full_shape=(world_size,), partition_dim=0,
                                                   num_partitions=world_size))

    def get_rank(self) -> torch.Tensor:
        return self.rank

    def initialize_expert_indices(self, num_local_experts: int) -> None:
        """With one expert-parallel rank every expert is local: ``local_expert_indices`` is ``[[0, 1, ...]]``."""
        self.local_expert_indices = nn.Parameter(torch.arange(num_local_experts, dtype=torch.int32).unsqueeze(0),
                                                 requires_grad=False)
        self.register_param_spec("local_expert_indices", ParamSpec(
            full_shape=(self.world_size, num_local_experts), partition_dim=0, num_partitions=self.world_size))

    def get_local_expert_indices(self) -> torch.Tensor:
        return self.local_expert_indices


def _check_embedding_arguments(unsupported: Dict[str, Any], pad_to_multiple_of: int, max_norm: Optional[float],
                               norm_type: float, scale_grad_by_freq: bool, sparse: bool) -> None:
    if unsupported:
        raise TypeError(f"ParallelEmbedding got unexpected keyword arguments {sorted(unsupported)}")
    if pad_to_multiple_of < 1:
        raise ValueError(f"ParallelEmbedding: pad_to_multiple_of={pad_to_multiple_of} must be >= 1")
    # max_norm renormalises looked-up rows in place, which on a vocabulary shard would need the full rows' norms;
    # the others change the gradient's layout or scale per id, which nxdtp's shards do not reproduce.
    reject_unsupported("ParallelEmbedding", max_norm=(max_norm, None), norm_type=(norm_type, 2.0),
                       scale_grad_by_freq=(scale_grad_by_freq, False), sparse=(sparse, False))


class ParallelEmbedding(BaseParallelLayer):
    """Embedding split over TP ranks.

    Default: by vocabulary. Each rank holds a contiguous block of rows, looks up only the ids in its block (others read
    as zero) and the partial results are all-reduced (reduce-scattered along the sequence with
    ``sequence_parallel_enabled``). ``shard_across_embedding=True`` splits the embedding dimension instead and
    all-gathers the output. ``collect_output=False`` skips the collective and returns this rank's part: a partial sum
    (by vocabulary) or its columns (across the embedding). ``pad=True`` pads the vocabulary (or, across the embedding,
    the embedding dimension) with zeros to a multiple of the TP size; padded rows are never looked up, padded columns
    are cut from the output.

    Sequence parallelism: with ``sequence_dimension=None`` (NxD's default) the ids are batch-first ``[batch, seq]`` and
    the output is sequence-first ``[seq/tp, batch, hidden]``, as NxD's. An explicit ``sequence_dimension`` names the
    ids' sequence dimension, which is split in place (``1``: ``[batch, seq/tp, hidden]``; ``0``: ids ``[seq, batch]``).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 max_norm: Optional[float] = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, init_method: Optional[InitMethod] = None, device=None,
                 dtype: torch.dtype = torch.float32, shard_across_embedding: bool = False, pad: bool = False,
                 sequence_parallel_enabled: bool = False, tensor_model_parallel_group=None,
                 use_spmd_rank: bool = False, sequence_dimension: Optional[int] = None, tile_cc: bool = False,
                 rank_ordering: Optional[Sequence[int]] = None, collect_output: bool = True,
                 pad_to_multiple_of: int = 1, **unsupported):
        super().__init__(device, tensor_model_parallel_group)
        _check_embedding_arguments(unsupported, pad_to_multiple_of, max_norm, norm_type, scale_grad_by_freq, sparse)
        group = self._group()
        tp = group.size
        _check_rank_ordering("ParallelEmbedding", rank_ordering, tp)
        mappings.note_tile_cc("ParallelEmbedding", tile_cc)
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"ParallelEmbedding: padding_idx={padding_idx} must be in "
                                 f"[{-num_embeddings}, {num_embeddings})")
            padding_idx %= num_embeddings  # as torch.nn.Embedding: -1 is the last row
        if use_spmd_rank and shard_across_embedding:
            raise ValueError("ParallelEmbedding: use_spmd_rank=True only applies to the vocabulary split; with "
                             "shard_across_embedding=True no rank offset is computed")
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.shard_across_embedding, self.collect_output, self.pad = shard_across_embedding, collect_output, pad
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.sequence_dimension = sequence_dimension
        self.rank_util = SPMDRank(tp) if use_spmd_rank else None
        self.init_method = init_method  # NxD's name; init_weight_cpu() draws with it

        dim, padding_record = self._pad_for_split(tp, pad_to_multiple_of)
        rows_per_rank = self.padded_num_embeddings // tp
        self.num_embeddings_per_partition = self.padded_num_embeddings if shard_across_embedding else rows_per_rank
        self.vocab_start_index = 0 if shard_across_embedding else group.rank * rows_per_rank
        self.vocab_end_index = num_embeddings if shard_across_embedding else self.vocab_start_index + rows_per_rank
        self._make_weight(dtype, device, dim, padding_record, group)

    def _pad_for_split(self, tp: int, pad_to_multiple_of: int) -> Tuple[int, Dict[str, Any]]:
        """Set the padded table size (``pad``, or refused when the split dimension does not divide); return the
        split dimension and the padding rule the weight's spec records."""
        num_embeddings, embedding_dim, pad = self.num_embeddings, self.embedding_dim, self.pad
        self.padded_num_embeddings, self.padded_embedding_dim = num_embeddings, embedding_dim
        if self.shard_across_embedding:
            if embedding_dim % tp != 0 and not pad:
                raise ValueError(f"ParallelEmbedding: embedding_dim={embedding_dim} is not divisible by "
                                 f"tensor_model_parallel_size={tp}; pass pad=True to pad it to "
                                 f"{round_up(embedding_dim, tp)}")
            self.padded_embedding_dim = round_up(embedding_dim, tp)
            dim = 1
            padding_record = dict(pad_to_multiple_of=1) if pad else {}
        else:
            # Megatron's make_vocab_size_divisible_by: each rank's block is a multiple of pad_to_multiple_of.
            multiple = tp * pad_to_multiple_of
            if num_embeddings % multiple != 0:
                if not pad:
                    raise ValueError(
                        f"ParallelEmbedding: num_embeddings={num_embeddings} is not divisible by "
                        f"tensor_model_parallel_size={tp}" + (f" * pad_to_multiple_of={pad_to_multiple_of}"
                                                              if pad_to_multiple_of > 1 else "")
                        + f"; pass pad=True to pad the vocabulary to {round_up(num_embeddings, multiple)}")
                self.padded_num_embeddings = round_up(num_embeddings, multiple)
            dim = 0
            # The vocabulary's rule, so a reshard pads it for another degree as this layer would be built there.
            padding_record = dict(pad_to_multiple_of=pad_to_multiple_of, vocabulary=True) if pad else {}
        self.pad_size = (self.padded_embedding_dim - embedding_dim if self.shard_across_embedding
                         else self.padded_num_embeddings - num_embeddings)
        return dim, padding_record

    def _make_weight(self, dtype: torch.dtype, device, dim: int, padding_record: Dict[str, Any], group) -> None:
        """This rank's slice of the table, initialised as the dense one would be (padding zero), and its spec."""
        num_embeddings, embedding_dim, padding_idx = self.num_embeddings, self.embedding_dim, self.padding_idx
        full_shape = (self.padded_num_embeddings, self.padded_embedding_dim)
        user_init = self.init_method

        def init(full: torch.Tensor) -> None:
            real = full[:num_embeddings, :embedding_dim]
            (user_init or nn.init.normal_)(real)  # normal_ is torch.nn.Embedding's default
            if padding_idx is not None:
                real[padding_idx].zero_()
            full[num_embeddings:].zero_()
            full[:, embedding_dim:].zero_()

        weight, _ = materialise_shard(full_shape, dtype, device, init, dim=dim, stride=1, keep_master=False,
                                      group=group)
        self.weight = nn.Parameter(weight)
        self.register_param_spec("weight", ParamSpec(full_shape=full_shape, partition_dim=dim,
                                                     num_partitions=group.size,
                                                     real_shape=(num_embeddings, embedding_dim), **padding_record))

    def init_weight_cpu(self) -> None:
        """NxD's re-initialisation of the weight: the dense table drawn again on CPU with the layer's ``init_method``
        (``torch.nn.Embedding``'s normal init when None; the ``padding_idx`` row zero), this rank's slice kept in
        place. Every data-parallel replica draws the same values under one seed, and the TP ranks' slices together are
        a dense init's table (zero padding where the layer pads)."""
        init = getattr(self, "init_method", None) or nn.init.normal_   # None on a layer pickled before nxdtp kept it
        reinitialise_local(self.weight, self.param_specs()["weight"], init, self._group(),
                           zero_rows=() if self.padding_idx is None else (self.padding_idx,))

    def _to_sequence_shard(self, output: torch.Tensor, collective: Callable[..., torch.Tensor]) -> torch.Tensor:
        """Apply ``collective(tensor, dim)`` along the sequence: NxD's layout for batch-first ids by default."""
        if self.sequence_dimension is not None:
            return collective(output, self.sequence_dimension)
        if output.dim() < 3:
            raise ValueError(f"ParallelEmbedding: sequence parallelism with sequence_dimension=None expects [batch, "
                             f"seq] ids (output [seq/tp, batch, hidden]); got an output of shape "
                             f"{tuple(output.shape)}. Pass sequence_dimension= to name the ids' sequence dimension")
        return collective(output.transpose(0, 1).contiguous(), 0)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        group = self._group()
        if self.shard_across_embedding:
            output = F.embedding(input_, self.weight, self.padding_idx)
            if not self.collect_output:
                return output
            output = mappings.gather_from_tensor_model_parallel_region(output, group)
            if self.pad_size:
                output = output.narrow(-1, 0, self.embedding_dim)
            if self.sequence_parallel_enabled:
                output = self._to_sequence_shard(
                    output, lambda t, d: mappings.scatter_to_sequence_parallel_region(t, d, group))
            return output
        if group.size == 1 and self.rank_util is None:
            output = F.embedding(input_, self.weight, self.padding_idx)
        else:
            # The shard's first id is data (the rank tensor), not the Python vocab_start_index, so every rank traces
            # one graph; for the same reason padding_idx, which lies on one rank's shard only, is not passed to
            # F.embedding: its row is looked up detached instead, which gives it no gradient on any rank.
            rows = self.num_embeddings_per_partition
            rank = rank_tensor(group, input_.device) if self.rank_util is None else \
                self.rank_util.get_rank().to(input_.device).long()
            start = (rank * rows).reshape(())
            outside = (input_ < start) | (input_ >= start + rows)
            local_ids = (input_ - start).masked_fill(outside, 0)
            output = F.embedding(local_ids, self.weight)
            if self.padding_idx is not None:
                output = torch.where((input_ == self.padding_idx).unsqueeze(-1), output.detach(), output)
            output = output.masked_fill(outside.unsqueeze(-1), 0.0)
        if not self.collect_output:
            return output
        if self.sequence_parallel_enabled:
            return self._to_sequence_shard(
                output, lambda t, d: mappings.reduce_scatter_to_sequence_parallel_region(t, d, group))
        return mappings.reduce_from_tensor_model_parallel_region(output, group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, padded_num_embeddings={self.padded_num_embeddings}, "
                f"shard_across_embedding={self.shard_across_embedding}, "
                f"sequence_parallel={self.sequence_parallel_enabled}")


class LayerNorm(nn.LayerNorm, ShardedModule):
    """``torch.nn.LayerNorm`` whose parameters are replicated over TP and, with ``sequence_parallel_enabled``, marked so
    that ``nxdtp.grads.allreduce_sequence_parallel_gradients`` sums their gradients over TP (each rank normalises only
    its sequence shard, so each holds a partial gradient)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None, sequence_parallel_enabled: bool = False):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias, device=device,
                         dtype=dtype)
        self.sequence_parallel_enabled = sequence_parallel_enabled
        tp = tensor_parallel_group().size
        for name in ("weight", "bias"):
            if getattr(self, name, None) is not None:
                self.register_param_spec(name, ParamSpec(full_shape=tuple(getattr(self, name).shape), num_partitions=tp,
                                                         sequence_parallel=sequence_parallel_enabled))


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ParallelEmbedding", "LayerNorm", "SPMDRank",
           "BaseParallelLayer", "BaseParallelLinear", "LinearWithAsyncCommunication", "linear_with_async_allreduce",
           "create_local_weight", "shard_of", "BaseParallelConv", "Conv2dWithInputGradAllReduce",
           "conv2d_with_weight_grad_allreduce", "OutputChannelParallelConv2d", "InputChannelParallelConv2d"]

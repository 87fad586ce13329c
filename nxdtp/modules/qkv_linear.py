"""NxD's ``GQAQKVColumnParallelLinear``: the Q, K and V projections of grouped-query attention in one column-parallel
layer, with KV heads repeated ``kv_size_multiplier`` times so that TP can exceed the KV head count.

Each rank computes its query heads and the KV heads they attend with. The layout is nxdtp's (``nxdtp.heads``): the
copies of a KV head are adjacent, so with HF's grouping (query head ``q`` uses KV head ``q // (heads / kv_heads)``)
each rank's query heads find their KV heads on the same rank, and the layer equals dense Q, K and V projections.

Unlike NxD, Q, K and V are three parameters even with ``fuse_qkv=True`` (``weight_q``, ``weight_k``, ``weight_v``,
and biases); ``weight_qkv`` reads their concatenation, and a state dict holding NxD's fused ``weight_qkv`` /
``bias_qkv`` loads into them. Separate parameters let the specs describe K and V's copies exactly, so checkpoints merge
to dense projections and reshard to other degrees, and the gradient norm counts each copy once. ``keep_master_weight``
keeps the dense weights and biases under NxD's names, the fused ``master_weight_qkv`` / ``master_bias_qkv`` included.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from .. import mappings, sequence_parallel_linear, sharded_init
from ..parallel_state import tensor_parallel_group
from ..sharded_init import InitMethod, linear_bias_init, linear_weight_init, reject_unsupported
from ..spec import ParamSpec, ShardedModule

PROJECTIONS = ("q", "k", "v")


class GQAQKVColumnParallelLinear(ShardedModule):
    """``(Q, K, V) = (X W_q^T + b_q, X W_k^T + b_k, X W_v^T + b_v)`` with each output split along its heads.

    ``output_sizes`` is ``[num_heads * head_dim, num_kv_heads * head_dim]``. ``kv_size_multiplier`` m repeats every KV
    head m times (NxD's meaning: TP must be a multiple of m, and the repeated KV heads a multiple of TP); the copies'
    gradients are summed in backward, so they stay equal. ``head_dim`` (nxdtp only) is needed when m > 1 and a rank
    holds more than one KV head copy; by default a rank holds exactly one, as with NxD's usual
    ``kv_size_multiplier = tp / num_kv_heads``. The input is replicated, or with ``sequence_parallel_enabled`` split
    along ``sequence_dimension`` (0 by default, NxD's ``[seq, batch, hidden]``) and gathered here; then only the shard
    is kept for backward, and one all-gather in backward rebuilds it for the three weight gradients.
    """

    def __init__(self, input_size: int, output_sizes, bias: bool = True, gather_output: bool = True,
                 dtype: torch.dtype = torch.float32, device=None, init_method: Optional[InitMethod] = None,
                 sequence_parallel_enabled: bool = False, keep_master_weight: bool = False,
                 kv_size_multiplier: int = 1, fuse_qkv: bool = True, reduce_dtype: torch.dtype = torch.float32,
                 sequence_dimension: Optional[int] = None, head_dim: Optional[int] = None, **unsupported):
        super().__init__()
        name = type(self).__name__
        if unsupported:
            raise TypeError(f"{name} got unexpected keyword arguments {sorted(unsupported)}")
        reject_unsupported(name, reduce_dtype=(reduce_dtype, torch.float32))
        tp = tensor_parallel_group().size
        q_size, kv_size = _two_sizes(name, output_sizes)
        m = kv_size_multiplier
        if m < 1 or tp % m != 0:
            raise ValueError(f"{name}: kv_size_multiplier={m} does not divide tensor_model_parallel_size={tp}")
        if (kv_size * m) % tp != 0:
            raise ValueError(f"{name}: output_sizes[1] * kv_size_multiplier = {kv_size} * {m} is not divisible by "
                             f"tensor_model_parallel_size={tp}; choose kv_size_multiplier so that it is")
        if q_size % tp != 0:
            raise ValueError(f"{name}: output_sizes[0]={q_size} is not divisible by tensor_model_parallel_size={tp}")
        if gather_output and m > 1:
            raise ValueError(f"{name}: gather_output=True with kv_size_multiplier={m} would gather every KV head {m} "
                             "times; use gather_output=False (the attention then runs on this rank's heads)")
        if sequence_parallel_enabled and gather_output:
            raise ValueError(f"{name}: sequence_parallel_enabled=True needs gather_output=False")
        kv_local = kv_size * m // tp
        block = head_dim if head_dim is not None else kv_local
        if kv_size % block != 0 or kv_local % block != 0 or q_size % block != 0:
            raise ValueError(f"{name}: head_dim={block} does not divide output_sizes={[q_size, kv_size]} and this "
                             f"rank's {kv_local} KV rows; pass the attention's head_dim=")
        self.input_size, self.output_sizes = input_size, [q_size, kv_size]
        self.gather_output, self.fuse_qkv, self.kv_size_multiplier = gather_output, fuse_qkv, m
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.sequence_dimension = 0 if sequence_dimension is None else sequence_dimension
        self.q_output_size_per_partition, self.kv_output_size_per_partition = q_size // tp, kv_local
        self.head_dim = block
        self.init_method = init_method  # initialize_weight_biases() draws with it again
        self.keep_master_weight = keep_master_weight
        masters = {"weight": {}, "bias": {}}
        for part in PROJECTIONS:
            rows, copies = (q_size, {}) if part == "q" else (kv_size, dict(replicas=m, replica_block=block))
            spec = ParamSpec(full_shape=(rows * copies.get("replicas", 1), input_size), partition_dim=0,
                             num_partitions=tp, real_shape=(rows, input_size), **copies)
            weight, masters["weight"][part] = _local_of_dense(spec, dtype, device, init_method or linear_weight_init)
            setattr(self, "weight_" + part, nn.Parameter(weight))
            self.register_param_spec("weight_" + part, spec)
            if bias:
                bias_spec = ParamSpec(full_shape=spec.full_shape[:1], partition_dim=0, num_partitions=tp,
                                      real_shape=spec.unpadded_shape[:1], replicas=spec.replicas,
                                      replica_block=spec.replica_block)
                value, dense_bias = _local_of_dense(bias_spec, dtype, device, lambda t: linear_bias_init(t, input_size))
                # NxD keeps the master biases in the layer's dtype (its master weights in fp32).
                masters["bias"][part] = dense_bias.to(dtype) if dense_bias is not None else None
                setattr(self, "bias_" + part, nn.Parameter(value))
                self.register_param_spec("bias_" + part, bias_spec)
            else:
                self.register_parameter("bias_" + part, None)
        if keep_master_weight:
            self._keep_masters(masters)

    def _keep_masters(self, masters) -> None:
        """NxD's names for the dense tensors the shards were cut from: ``master_weight_q/_k/_v`` and
        ``master_bias_q/_k/_v`` (plain tensors on CPU, not parameters, so they stay out of state dicts and optimizers),
        and with ``fuse_qkv`` also NxD's ``master_weight_qkv`` / ``master_bias_qkv``: Q, K, V concatenated, each KV head
        once however many copies the ranks hold. NxD sets the separate names to None when fused; nxdtp keeps them, as
        views of the concatenation, so the fused masters cost no second copy. None on the meta device (nothing drawn).
        """
        for kind, dense in masters.items():
            if not dense:   # no bias: NxD keeps no master biases either
                continue
            fused = None if any(t is None for t in dense.values()) else torch.cat([dense[p] for p in PROJECTIONS])
            if fused is not None and self.fuse_qkv:
                dense = dict(zip(PROJECTIONS, fused.split([dense[p].shape[0] for p in PROJECTIONS])))
            for part in PROJECTIONS:
                setattr(self, f"master_{kind}_{part}", dense[part])
            if self.fuse_qkv:
                setattr(self, f"master_{kind}_qkv", fused)

    def initialize_weight_biases(self) -> None:
        """NxD's re-initialisation (what NxD's Llama ``init_weights`` calls after a meta-device build): the dense Q, K
        and V weights (the layer's ``init_method``, ``nn.Linear``'s default when None) and biases drawn again on CPU in
        the order the constructor draws them, each laid out as its spec says (KV heads repeated) and this rank's part
        kept in place. Every data-parallel replica draws the same values under one seed; the TP ranks' parts together
        are dense projections' weights, so the layer equals dense Q, K and V again. The master tensors of
        ``keep_master_weight`` are replaced by the new dense ones."""
        group = tensor_parallel_group()
        specs = self.param_specs()
        init = getattr(self, "init_method", None) or linear_weight_init   # None on a layer pickled before nxdtp kept it
        masters = {"weight": {}, "bias": {}}
        for part in PROJECTIONS:
            masters["weight"][part] = sharded_init.reinitialise_local(
                getattr(self, "weight_" + part), specs["weight_" + part], init, group)
            bias = getattr(self, "bias_" + part)
            if bias is not None:
                masters["bias"][part] = sharded_init.reinitialise_local(
                    bias, specs["bias_" + part], lambda t: linear_bias_init(t, self.input_size), group).to(bias.dtype)
        if getattr(self, "keep_master_weight", False):
            self._keep_masters(masters)

    @property
    def weight_qkv(self) -> torch.Tensor:
        """This rank's Q rows, then K, then V: NxD's fused weight (a new tensor, not a parameter)."""
        return torch.cat([self.weight_q, self.weight_k, self.weight_v])

    def forward(self, input_: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.sequence_parallel_enabled:
            # Q, K and V keep only the sequence shard for backward and share one re-gather there.
            input_parallel = sequence_parallel_linear.gather_keeping_shard(input_, self.sequence_dimension)
        else:
            input_parallel = mappings.copy_to_tensor_model_parallel_region(input_)
        outputs = []
        for part in PROJECTIONS:
            weight, bias = getattr(self, "weight_" + part), getattr(self, "bias_" + part)
            if part != "q" and self.kv_size_multiplier > 1:
                # Copies of a KV head on other ranks: each gets the sum of all copies' gradients.
                weight = mappings.sum_gradients_over_replicas(weight, self.kv_size_multiplier, self.head_dim)
                bias = mappings.sum_gradients_over_replicas(bias, self.kv_size_multiplier, self.head_dim) \
                    if bias is not None else None
            output = sequence_parallel_linear.linear(input_parallel, weight, bias)
            outputs.append(mappings.gather_from_tensor_model_parallel_region(output) if self.gather_output else output)
        return tuple(outputs)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # NxD's fused keys (fuse_qkv=True) hold this rank's Q rows, then K, then V: split them into the three.
        sizes = [self.q_output_size_per_partition] + [self.kv_output_size_per_partition] * 2
        for kind in ("weight", "bias"):
            fused = state_dict.pop(prefix + kind + "_qkv", None)
            if fused is None:
                continue
            if fused.shape[0] != sum(sizes):
                error_msgs.append(f"{prefix}{kind}_qkv has {fused.shape[0]} rows, but this rank's Q, K and V have "
                                  f"{sizes} = {sum(sizes)}")
                continue
            for part, value in zip(PROJECTIONS, torch.split(fused, sizes)):
                state_dict[f"{prefix}{kind}_{part}"] = value
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, output_sizes={self.output_sizes}, kv_size_multiplier="
                f"{self.kv_size_multiplier}, head_dim={self.head_dim}, bias={self.bias_q is not None}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel_enabled}")


def _two_sizes(name: str, output_sizes) -> Tuple[int, int]:
    sizes = list(output_sizes)
    if len(sizes) != 2 or not all(isinstance(s, int) and s > 0 for s in sizes):
        raise ValueError(f"{name}: output_sizes={output_sizes!r} must be [q_size, kv_size], two positive ints")
    return sizes[0], sizes[1]


def _local_of_dense(spec: ParamSpec, dtype, device, init) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Initialise the dense tensor in fp32 on CPU (the same on every rank under one seed), repeat its blocks as the spec
    says, and keep this rank's part in ``dtype``; return it and the fp32 dense tensor. On the meta device only the
    shape, and no dense tensor."""
    group = tensor_parallel_group()
    if torch.device(device if device is not None else "cpu").type == "meta":
        return torch.empty(spec.local_shape(), dtype=dtype, device="meta"), None
    dense = torch.empty(spec.unpadded_shape, dtype=torch.float32)
    init(dense)
    local = spec.shard(dense, group.rank)
    return local.to(dtype=dtype, device=device), dense

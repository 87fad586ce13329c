"""NxD's ``GQAQKVColumnParallelLinear``: the Q, K and V projections of grouped-query attention in one column-parallel
layer, with KV heads repeated ``kv_size_multiplier`` times so that TP can exceed the KV head count.

Each rank computes its query heads and the KV heads they attend with. The layout is nxdtp's (``nxdtp.heads``): the
copies of a KV head are adjacent, so with HF's grouping (query head ``q`` uses KV head ``q // (heads / kv_heads)``)
each rank's query heads find their KV heads on the same rank, and the layer equals dense Q, K and V projections.

With ``fuse_qkv=True`` (the default), as in NxD, the trained parameters are ``weight_qkv`` and ``bias_qkv``: this
rank's Q rows, then K, then V, in storage of their own, so an optimizer steps them and backward leaves the gradient in
``weight_qkv.grad``. ``weight_q``, ``weight_k``, ``weight_v`` (and ``bias_q/_k/_v``) are then their row blocks, views
that are not parameters. The layout algebra describes Q, K and V, not the fused rows (one ``ParamSpec`` cannot hold
parts of different sizes and copies), so the specs stay per part and the state dict keeps them under their own keys:
checkpoints merge to dense projections and reshard to other degrees whether the layer is fused or not, and a state dict
with NxD's fused keys loads too. The fused parameters carry the NxD attribute cache of their parts, with
``replica_segments`` where K and V hold copies Q does not, so the gradient norm counts each copy once.
With ``fuse_qkv=False`` the three projections are the parameters. ``keep_master_weight`` keeps the dense weights and
biases under NxD's names, the fused ``master_weight_qkv`` / ``master_bias_qkv`` included.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import mappings, sequence_parallel_linear, sharded_init
from ..sharded_init import InitMethod, linear_bias_init, linear_weight_init, reject_unsupported
from ..spec import ParamSpec, ShardedModule, attach_spec_attributes
from ..topology import tensor_parallel_group

PROJECTIONS = ("q", "k", "v")
KINDS = ("weight", "bias")
# Q, K and V's own tensors, in the order the layer registers (and saves) them.
PART_NAMES = tuple(f"{kind}_{part}" for part in PROJECTIONS for kind in KINDS)
FUSED_NAMES = tuple(kind + "_qkv" for kind in KINDS)


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
        init = init_method or linear_weight_init
        local, specs, masters = self._draw([q_size, kv_size], tp, bias, dtype, device, init)
        self._install(local, specs)
        if keep_master_weight:
            self._keep_masters(masters)

    def _draw(self, sizes: List[int], tp: int, bias: bool, dtype, device, init: InitMethod):
        """This rank's parts of dense Q, K and V weights and biases drawn in that order (Q's weight, Q's bias, K's
        weight, ...), their specs, and the dense tensors (NxD's master weights)."""
        local, specs, masters = {}, {}, {"weight": {}, "bias": {}}
        for part in PROJECTIONS:
            rows = sizes[0] if part == "q" else sizes[1]
            copies = {} if part == "q" else dict(replicas=self.kv_size_multiplier, replica_block=self.head_dim)
            spec = ParamSpec(full_shape=(rows * copies.get("replicas", 1), self.input_size), partition_dim=0,
                             num_partitions=tp, real_shape=(rows, self.input_size), **copies)
            local["weight_" + part], masters["weight"][part] = _local_of_dense(spec, dtype, device, init)
            specs["weight_" + part] = spec
            if bias:
                bias_spec = ParamSpec(full_shape=spec.full_shape[:1], partition_dim=0, num_partitions=tp,
                                      real_shape=spec.unpadded_shape[:1], replicas=spec.replicas,
                                      replica_block=spec.replica_block)
                local["bias_" + part], dense_bias = _local_of_dense(
                    bias_spec, dtype, device, lambda t: linear_bias_init(t, self.input_size))
                # NxD keeps the master biases in the layer's dtype (its master weights in fp32).
                masters["bias"][part] = dense_bias.to(dtype) if dense_bias is not None else None
                specs["bias_" + part] = bias_spec
        return local, specs, masters

    def _install(self, local: Dict[str, torch.Tensor], specs: Dict[str, ParamSpec]) -> None:
        """Register the parameters: with ``fuse_qkv`` NxD's ``weight_qkv`` and ``bias_qkv`` (None without a bias),
        this rank's Q rows, then K, then V, concatenated into storage of their own; otherwise ``weight_q``,
        ``bias_q``, ``weight_k``, ... Then the parts' specs, which the fused parameters' attributes come from."""
        if self.fuse_qkv:
            for kind in KINDS:
                parts = [local.get(f"{kind}_{part}") for part in PROJECTIONS]
                self.register_parameter(kind + "_qkv", None if parts[0] is None else nn.Parameter(torch.cat(parts)))
        else:
            for name in PART_NAMES:
                self.register_parameter(name, nn.Parameter(local[name]) if name in local else None)
        for name, spec in specs.items():
            self.register_param_spec(name, spec)
        self._attach_fused_attributes()

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

    # ---- the fused parameters and their parts ---------------------------------------------------------------------

    def _fused(self) -> bool:
        return "weight_qkv" in self._parameters

    def _part_rows(self) -> List[int]:
        return [self.q_output_size_per_partition] + [self.kv_output_size_per_partition] * 2

    def __getattr__(self, name: str):
        # Called only for names nn.Module does not hold. Fused: Q, K and V's weights and biases are row blocks of
        # weight_qkv / bias_qkv. Not fused: weight_qkv / bias_qkv read the concatenation of the three (a new tensor).
        parameters = self.__dict__.get("_parameters", {})
        if name in PART_NAMES and name not in parameters and name.rsplit("_", 1)[0] + "_qkv" in parameters:
            return self._part_views()[name]
        if name in FUSED_NAMES and name not in parameters and name[:-len("qkv")] + "q" in parameters:
            parts = [parameters[name[:-len("qkv")] + part] for part in PROJECTIONS]
            return None if parts[0] is None else torch.cat(parts)
        return super().__getattr__(name)

    def _part_views(self) -> Dict[str, Optional[torch.Tensor]]:
        """``weight_q``, ``bias_q``, ``weight_k``, ...: row blocks of the fused parameters, views sharing their storage
        (so in-place loads and re-initialisation reach the trained parameter), made once per fused parameter: code
        that pairs the specs with the state dict's tensors does so by identity. Made again when a fused parameter is
        replaced (a device move) or changes dtype, device or shape."""
        fused = [self._parameters.get(name) for name in FUSED_NAMES]
        key = tuple(None if t is None else (id(t), t.dtype, t.device, tuple(t.shape)) for t in fused)
        cached = self.__dict__.get("_nxdtp_part_views")
        if cached is None or cached[0] != key:
            views = {name: None for name in PART_NAMES}
            for kind, tensor in zip(KINDS, fused):
                if tensor is not None:
                    for part, view in zip(PROJECTIONS, tensor.detach().split(self._part_rows())):
                        views[f"{kind}_{part}"] = view
            # The fused tensors are kept with their views, so that no other tensor can reuse their ids.
            cached = (key, views, fused)
            self.__dict__["_nxdtp_part_views"] = cached
        return cached[1]

    def _attach_fused_attributes(self) -> None:
        """The NxD attribute cache of ``weight_qkv`` / ``bias_qkv``, from their parts' specs: split along dim 0 over
        TP as each part is; ``fused_parts`` names the parts. Where the parts hold different numbers of copies (K and V
        repeated ``kv_size_multiplier`` times, Q not), ``num_replicas`` is 1 and ``replica_segments`` gives (rows,
        copies) per part along dim 0, so the gradient norm counts each copy once."""
        specs = self.param_specs()
        for kind in KINDS:
            fused = self._parameters.get(kind + "_qkv")
            if fused is None:
                continue
            parts = [specs[f"{kind}_{part}"] for part in PROJECTIONS]
            attach_spec_attributes(fused, parts[0])
            fused.fused_parts = tuple(f"{kind}_{part}" for part in PROJECTIONS)
            if len({spec.replicas for spec in parts}) > 1:
                fused.replica_segments = tuple((spec.local_shape()[0], spec.replicas) for spec in parts)

    def fused_parameters(self) -> Dict[str, Tuple[Tuple[str, int], ...]]:
        """``weight_qkv`` / ``bias_qkv`` (when fused and present): Q's rows, then K's, then V's, as this rank holds
        them (ShardedModule.fused_parameters)."""
        if not self._fused():
            return {}
        rows = self._part_rows()
        return {kind + "_qkv": tuple((f"{kind}_{part}", n) for part, n in zip(PROJECTIONS, rows))
                for kind in KINDS if self._parameters.get(kind + "_qkv") is not None}

    def reattach_spec_attributes(self) -> None:
        super().reattach_spec_attributes()
        self._attach_fused_attributes()

    def __getstate__(self):
        # The views are remade from the copied fused parameters, not copied beside them.
        state = super().__getstate__()
        state.pop("_nxdtp_part_views", None)
        return state

    def _projections(self):
        """(part, weight, bias) of Q, K and V as the forward multiplies them: fused, row blocks of ``weight_qkv`` and
        ``bias_qkv`` cut inside autograd (so backward fills ``weight_qkv.grad``); otherwise the three parameters."""
        if not self._fused():
            return [(part, getattr(self, "weight_" + part), getattr(self, "bias_" + part)) for part in PROJECTIONS]
        rows = self._part_rows()
        weights = self.weight_qkv.split(rows)
        biases = self.bias_qkv.split(rows) if self.bias_qkv is not None else (None,) * len(PROJECTIONS)
        return list(zip(PROJECTIONS, weights, biases))

    def forward(self, input_: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.sequence_parallel_enabled:
            # Q, K and V keep only the sequence shard for backward and share one re-gather there.
            input_parallel = sequence_parallel_linear.gather_keeping_shard(input_, self.sequence_dimension)
        else:
            input_parallel = mappings.copy_to_tensor_model_parallel_region(input_)
        outputs = []
        for part, weight, bias in self._projections():
            if part != "q" and self.kv_size_multiplier > 1:
                # Copies of a KV head on other ranks: each gets the sum of all copies' gradients.
                weight = mappings.sum_gradients_over_replicas(weight, self.kv_size_multiplier, self.head_dim)
                bias = mappings.sum_gradients_over_replicas(bias, self.kv_size_multiplier, self.head_dim) \
                    if bias is not None else None
            output = sequence_parallel_linear.linear(input_parallel, weight, bias)
            outputs.append(mappings.gather_from_tensor_model_parallel_region(output) if self.gather_output else output)
        return tuple(outputs)

    # ---- state dicts ------------------------------------------------------------------------------------------------

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        own = OrderedDict()
        super()._save_to_state_dict(own, prefix, keep_vars)
        if self._fused():
            # Q, K and V under their own keys, with their own specs: the checkpoint a layer of three parameters
            # writes, which merges to dense projections and reshards to any degree.
            for name in FUSED_NAMES:
                own.pop(prefix + name, None)
            for name, view in self._part_views().items():
                if view is not None:
                    destination[prefix + name] = view if keep_vars else view.detach()
        destination.update(own)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # Either layout loads into either layer: the parts' keys (nxdtp's state dicts) or NxD's fused keys, this
        # rank's Q rows, then K, then V.
        if self._fused():
            self._fuse_part_keys(state_dict, prefix, missing_keys, error_msgs)
        else:
            self._split_fused_keys(state_dict, prefix, error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        for kind in KINDS:   # the keys this layer's state dict has: the parts', not the fused parameter's
            if prefix + kind + "_qkv" in missing_keys:
                missing_keys.remove(prefix + kind + "_qkv")
                missing_keys.extend(f"{prefix}{kind}_{part}" for part in PROJECTIONS)

    def _fused_rows_error(self, key: str, value: torch.Tensor) -> Optional[str]:
        sizes = self._part_rows()
        if value.shape[0] == sum(sizes):
            return None
        return f"{key} has {value.shape[0]} rows, but this rank's Q, K and V have {sizes} = {sum(sizes)}"

    def _split_fused_keys(self, state_dict, prefix, error_msgs) -> None:
        """Three parameters: NxD's fused keys are split into them."""
        for kind in KINDS:
            fused = state_dict.pop(prefix + kind + "_qkv", None)
            if fused is None:
                continue
            error = self._fused_rows_error(prefix + kind + "_qkv", fused)
            if error:
                error_msgs.append(error)
                continue
            for part, value in zip(PROJECTIONS, torch.split(fused, self._part_rows())):
                state_dict[f"{prefix}{kind}_{part}"] = value

    def _fuse_part_keys(self, state_dict, prefix, missing_keys, error_msgs) -> None:
        """Fused parameters: the parts' keys become the fused key (this rank's rows checked, each part named). A part
        the state dict lacks keeps its current rows and is reported missing."""
        specs, current = self.param_specs(), self._part_views()
        for kind in KINDS:
            fused_key = prefix + kind + "_qkv"
            if fused_key in state_dict:
                error = self._fused_rows_error(fused_key, state_dict[fused_key])
                if error:
                    error_msgs.append(error)
                    state_dict.pop(fused_key)
                continue
            if current[f"{kind}_{PROJECTIONS[0]}"] is None:   # no bias: a dict's biases stay unexpected keys
                continue
            given = {part: state_dict.pop(f"{prefix}{kind}_{part}") for part in PROJECTIONS
                     if f"{prefix}{kind}_{part}" in state_dict}
            if not given:
                continue
            wrong = [f"{prefix}{kind}_{part} has shape {list(value.shape)}, but this rank's part has shape "
                     f"{list(specs[f'{kind}_{part}'].local_shape())}" for part, value in given.items()
                     if tuple(value.shape) != specs[f"{kind}_{part}"].local_shape()]
            if wrong:
                error_msgs.extend(wrong)
                continue
            like = next(iter(given.values()))
            state_dict[fused_key] = torch.cat([given[part] if part in given else
                                               current[f"{kind}_{part}"].to(like) for part in PROJECTIONS])
            missing_keys.extend(f"{prefix}{kind}_{part}" for part in PROJECTIONS if part not in given)

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

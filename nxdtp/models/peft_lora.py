"""LoRA adapters (Hugging Face PEFT) on tensor-parallel models: ``peft.get_peft_model(tp_model, LoraConfig(...))``
trains what dense LoRA trains on the dense model.

PEFT wraps each targeted layer in a LoRA layer that adds ``scaling * B(A(dropout(x)))`` to the base layer's output.
On nxdtp's parallel layers the adapter is split the way its base layer is, so no rank ever holds a dense adapter of a
sharded layer and the added term is exactly this rank's part of the dense one:

* **Column-parallel base** (``W`` split by output rows): ``A`` ``[r, in]`` is replicated, ``B`` ``[out, r]`` is split
  by rows like ``W`` (with its stride, padding and repeated KV heads), so ``B_shard(A x)`` is this rank's output
  columns. Every rank's ``B_shard`` reads the same ``h = A x``, so the gradient of ``h`` on one rank is only that
  rank's part; ``A``'s gradient must be summed over TP. Where the input is inside the block's entry region (Q/K/V and
  gate/up behind one region) ``A`` itself enters through ``copy_to_tensor_model_parallel_region`` (its gradient is
  all-reduced; ``x``'s partial gradient is summed by the block's region like the base layer's). Where the layer opens
  its own region, ``h`` enters the region instead (its gradient, ``[tokens, r]``, is all-reduced, which also completes
  ``A``'s gradient and ``x``'s). Where the layer gathers a sequence-parallel input itself, ``h`` is computed on this
  rank's tokens and all-gathered along the sequence (its gradient reduce-scattered), and ``A`` sums its per-token
  gradient over TP.
* **Row-parallel base** (``W`` split by input columns): ``A`` ``[r, in]`` is split by columns like ``W`` (padding
  and zero-head masks included), ``B`` ``[out, r]`` is replicated. ``A_shard x_shard`` is a partial sum of ``h``; it is
  all-reduced (or reduce-scattered along the sequence under sequence parallelism) before ``B``, like the base layer's
  output, so ``B`` sees the dense ``h``. Under sequence parallelism ``B`` acts on this rank's tokens and sums its
  gradient over TP; with ``reduce_output=False`` ``B h_partial`` joins the caller's reduction and ``B`` sums too.
* **Repeated KV heads** (``KVReplicatedColumnParallel``): ``B`` of ``k_proj`` / ``v_proj`` repeats every head's rows
  as the base weight does, and the copies' gradients are summed (``sum_gradients_over_replicas``), so copies stay equal.
* **Dropout** on the adapter's input follows the input: the same mask on every rank for a replicated input (drawn
  outside any RNG fork), per-rank masks for a sharded one (inside the tracker's fork).

Each factor is a ``LoraFactor`` (an ``nn.Linear`` owning a ``ParamSpec``), so the gradient norm counts it once,
checkpoints (``nxdtp.checkpointing``) save, merge and reshard it, and a dense adapter loads into its shard.
``save_pretrained`` writes the dense adapter (each factor gathered through its spec, one tensor at a time, on every
rank); ``merge`` adds ``scaling * B_shard @ A`` (column) or ``scaling * B @ A_shard`` (row) to the weight shard.

Supported: plain LoRA (``LoraConfig``) with ``r``, ``lora_alpha``, ``use_rslora``, ``rank_pattern`` /
``alpha_pattern``, ``lora_dropout``, ``init_lora_weights`` True / False / ``"gaussian"``, several adapters,
``disable_adapter()``, merge / unmerge / ``merge_and_unload``. Everything else is refused by name when the adapter is
injected, before any layer changes (``check_config``). This module imports PEFT; ``hf_integration.support_peft``
installs it into PEFT when a plan finishes a model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import LoraLayer
from peft.tuners.lora.model import LoraModel
from peft.tuners.tuners_utils import BaseTuner, check_adapters_to_merge
from peft.utils import PeftType
from torch import nn

from .. import comm, mappings, sequence_parallel_linear
from ..checkpointing.dense import gather_dense
from ..layers import BaseParallelLayer, ColumnParallelLinear, RowParallelLinear
from ..random import get_xla_rng_tracker
from ..spec import ParamSpec, ShardedModule
from ..topology import ParallelGroup, tensor_parallel_group

# LoraConfig values nxdtp shards. Each other value of these options changes what the adapter computes or how it is
# initialised from the base weight (a dense SVD, a quantisation error, ...), which a rank holding a shard cannot do
# alone; refusing names the option instead of training something else than dense LoRA would.
SUPPORTED_INIT = (True, False, "gaussian")
# The PEFT releases this module is written and tested against: it wraps PEFT entry points whose signatures PEFT does not
# promise to keep (setup.cfg's extras say the same). Outside the range, LoRA on a TP model is refused by name.
SUPPORTED_PEFT = ((0, 21, 2), (0, 22))
SUPPORTED_PEFT_PIP = "peft>=0.21.2,<0.22"


def peft_version_supported(version: str) -> bool:
    try:
        parts = tuple(int(part) for part in version.split("+")[0].split(".")[:3])
    except ValueError:
        return False
    return SUPPORTED_PEFT[0] <= parts and parts[:2] < SUPPORTED_PEFT[1]


# ---- the factors -----------------------------------------------------------------------------------------------------

class LoraFactor(nn.Linear, ShardedModule):
    """One LoRA factor (``lora_A`` or ``lora_B`` of one adapter) as this rank holds it: an ``nn.Linear`` without bias
    whose weight is this rank's part of the dense factor, described by its spec (``weight``). ``load_state_dict`` takes
    the dense factor too (a PEFT adapter saved from a dense model) and keeps this rank's part of it."""

    def __init__(self, local: torch.Tensor, spec: ParamSpec, requires_grad: bool, group: Optional[ParallelGroup]):
        # Built on the meta device and then given the weight: nn.Linear's own initialisation would draw from the
        # generator and shift every later draw (the same seed would no longer give dense PEFT's adapters).
        super().__init__(local.shape[1], local.shape[0], bias=False, device="meta", dtype=local.dtype)
        self.weight = nn.Parameter(local, requires_grad=requires_grad)
        self._explicit_group = group
        self.register_param_spec("weight", spec)

    def group(self) -> ParallelGroup:
        return self._explicit_group or tensor_parallel_group()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        value = state_dict.get(key)
        spec = self.param_specs()["weight"]
        if isinstance(value, torch.Tensor) and tuple(value.shape) != spec.local_shape() and \
                tuple(value.shape) in (tuple(spec.unpadded_shape), tuple(spec.full_shape)):
            # A dense factor (or a full one, padded): keep this rank's part, laid out as the spec says.
            full = spec.full_from_dense(value) if tuple(value.shape) != tuple(spec.full_shape) else value
            if spec.is_sharded:
                full = spec.piece_of_full(full, self.group().rank)
            state_dict = dict(state_dict)
            state_dict[key] = full
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


def _linear_weight_spec(base: nn.Module) -> Tuple[ParamSpec, bool]:
    """The base weight's spec in ``nn.Linear``'s ``[out, in]`` layout, and whether the weight itself is stored
    transposed (GPT-2's Conv1D layout, ``[in, out]``): a column layer splits ``out`` (dim 0 of ``[out, in]``), a row
    layer ``in`` (dim 1), so a spec split along the other dim describes the transposed layout."""
    spec = base.param_specs()["weight"]
    natural = 0 if isinstance(base, ColumnParallelLinear) else 1
    if spec.partition_dim == natural:
        return spec, False
    flipped = lambda shape: tuple(reversed(tuple(shape)))  # noqa: E731
    return dataclasses.replace(spec, full_shape=flipped(spec.full_shape), real_shape=flipped(spec.unpadded_shape),
                               partition_dim=natural), True


def factor_specs(base: nn.Module, r: int) -> Tuple[ParamSpec, ParamSpec]:
    """The specs of ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]`` on ``base``: the factor on the split side of the
    base weight is split like it (stride, padding, repeated blocks), the other one replicated."""
    weight, _ = _linear_weight_spec(base)
    full, real = weight.full_shape, weight.unpadded_shape
    tp = weight.num_partitions
    if isinstance(base, ColumnParallelLinear):
        a = ParamSpec(full_shape=(r, real[1]), num_partitions=tp)
        b = dataclasses.replace(weight, full_shape=(full[0], r), real_shape=(real[0], r), sequence_parallel=False)
    else:
        a = dataclasses.replace(weight, full_shape=(r, full[1]), real_shape=(r, real[1]), sequence_parallel=False)
        b = ParamSpec(full_shape=(real[0], r), num_partitions=tp)
    return a, b


# ---- the layer -------------------------------------------------------------------------------------------------------

class LoraParallelLinear(nn.Module, LoraLayer):
    """PEFT's LoRA layer for nxdtp's ``ColumnParallelLinear`` and ``RowParallelLinear`` (the module docstring says how
    the factors are split and where the TP regions are). Made by PEFT's dispatch (``LoraConfig``'s custom modules,
    which ``prepare_injection`` registers), with PEFT's arguments."""

    def __init__(self, base_layer: nn.Module, adapter_name: str, config, r: int = 0, lora_alpha: int = 1,
                 **kwargs) -> None:
        super().__init__()
        LoraLayer.__init__(self, base_layer, **kwargs)
        base = self.get_base_layer()
        self.is_column = isinstance(base, ColumnParallelLinear)
        _, transposed = _linear_weight_spec(base)
        # PEFT's own Linear reads fan_in_fan_out from the config (True for Conv1D weights, [in, out]); here the spec
        # says which layout the weight has. Keep the config in step, as PEFT's dispatch does for Conv1D, so the
        # adapter_config.json saved from here loads on the dense model without PEFT correcting it.
        if bool(config.fan_in_fan_out) != transposed:
            warnings.warn(f"fan_in_fan_out={config.fan_in_fan_out} but the weight of {kwargs.get('target_name', '')!r} "
                          f"is stored {'[in, out] (Conv1D layout)' if transposed else '[out, in]'}: setting "
                          f"fan_in_fan_out={transposed}")
            config.fan_in_fan_out = transposed
        self.fan_in_fan_out = transposed
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

    def _get_in_out_features(self, module: nn.Module):
        # PEFT sizes the dense factors it creates by these: the dense layer's, not this rank's shard.
        weight, _ = _linear_weight_spec(module)
        out_features, in_features = weight.unpadded_shape
        return in_features, out_features

    def _group(self) -> ParallelGroup:
        return self.get_base_layer()._group()

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config, **kwargs) -> None:
        check_layer_config(config, kwargs.get("target_name", adapter_name))
        # PEFT makes and initialises the dense factors exactly as it would on the dense layer (so one seed gives the
        # same adapter), then each rank keeps its part.
        LoraLayer.update_layer(self, adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)
        base = self.get_base_layer()
        group = self._group()
        specs = dict(zip(("lora_A", "lora_B"), factor_specs(base, r)))
        for name, spec in specs.items():
            dense_module = getattr(self, name)[adapter_name]
            dense = dense_module.weight.detach()
            if dense.device.type != "meta" and group.size > 1:
                # Ranks seeded differently would otherwise hold pieces of different dense factors.
                dense = comm.broadcast(dense.contiguous(), group, src_group_rank=0)
            full = spec.full_from_dense(dense)
            local = spec.piece_of_full(full, group.rank) if spec.is_sharded else full.clone()
            getattr(self, name)[adapter_name] = LoraFactor(local.contiguous(), spec,
                                                           dense_module.weight.requires_grad,
                                                           getattr(base, "_explicit_group", None))

    # ---- forward ----

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any):
        self._check_forward_args(x, *args, **kwargs)
        if kwargs.pop("adapter_names", None) is not None:
            raise ValueError("adapter_names= (a batch mixing adapters) is not supported on nxdtp's tensor-parallel "
                             "LoRA layers: run one adapter per batch (set_adapter)")
        for key in ("alora_offsets",):
            kwargs.pop(key, None)
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        result = self.base_layer(x, *args, **kwargs)
        if self.merged:
            return result
        output, rest = (result[0], result[1:]) if isinstance(result, tuple) else (result, None)
        lora = None
        for adapter in self.active_adapters:
            if adapter not in self.lora_A.keys():
                continue
            term = self._column_term(x, adapter) if self.is_column else self._row_term(x, adapter)
            lora = term if lora is None else lora + term
        if lora is not None:
            base = self.get_base_layer()
            if self.is_column and base.gather_output:
                lora = base._gather(lora)   # the same all-gather (and stride, padding) as the base output's
            output = output + lora.to(output.dtype)
        return output if rest is None else (output,) + tuple(rest)

    def _column_term(self, x: torch.Tensor, adapter: str) -> torch.Tensor:
        base = self.get_base_layer()
        group = base._group()
        a, b = self.lora_A[adapter].weight, self.lora_B[adapter].weight
        dropout = self.lora_dropout[adapter]
        x = self._cast_input_dtype(x, a.dtype)
        if base.input_in_tensor_parallel_region:
            # x is inside the block's entry region (replicated, or the gathered sequence): its gradient is summed over
            # TP there, so the partial A^T dh of this rank is what it needs; A's own gradient must be summed here.
            with _replicated_draws(dropout):
                dropped = dropout(x)   # without dropout, x itself, which may carry the sequence shard it came from
            # On a gathered sequence, linear keeps only the shard for backward, like the base projections.
            h = sequence_parallel_linear.linear(dropped, mappings.copy_to_tensor_model_parallel_region(a, group))
        elif base.sequence_parallel_enabled:
            # x is this rank's tokens; the base layer gathers them itself. Gather h (r wide) instead of x: its
            # gradient is reduce-scattered back to this rank's tokens, and A's per-token gradient summed over TP.
            with _per_rank_draws(dropout):
                dropped = dropout(x)
            h = mappings.gather_from_sequence_parallel_region(
                F.linear(dropped, mappings.copy_to_tensor_model_parallel_region(a, group)), base.sequence_dimension,
                True, group, reduce_dtype=base.reduce_dtype)
        else:
            # x is replicated and outside any region (the layer opens its own): h enters the region, so its gradient
            # is summed over TP, which completes A's gradient and x's at once ([tokens, r] instead of [tokens, in]).
            with _replicated_draws(dropout):
                dropped = dropout(x)
            h = mappings.copy_to_tensor_model_parallel_region(F.linear(dropped, a), group,
                                                              reduce_dtype=base.reduce_dtype)
        spec = self.lora_B[adapter].param_specs()["weight"]
        if spec.replicas > 1:
            # Each repeated KV head's copies (on whichever ranks) get the sum of their gradients, as the base weight's.
            b = mappings.sum_gradients_over_replicas(b, spec.replicas, spec.replica_block)
        return F.linear(h, b) * self.scaling[adapter]

    def _row_term(self, x: torch.Tensor, adapter: str) -> torch.Tensor:
        base = self.get_base_layer()
        group = base._group()
        a, b = self.lora_A[adapter].weight, self.lora_B[adapter].weight
        dropout = self.lora_dropout[adapter]
        x_parallel = base.parallel_input(self._cast_input_dtype(x, a.dtype))
        mask = getattr(base, "nxdtp_real_columns", None)
        if mask is not None:
            # Zero heads' columns: the base layer masks them out of its input (HeadPadded); so must the adapter, or A's
            # zero columns would take gradients from the zero heads' attention outputs.
            x_parallel = x_parallel * mask.to(x_parallel.dtype)
        with _per_rank_draws(dropout):   # this rank's columns of the activation
            dropped = dropout(x_parallel)
        h_partial = F.linear(dropped, a)
        if base.sequence_parallel_enabled:
            # Like the base output: summed over TP and split along the sequence; B then sees this rank's tokens only,
            # so its gradient is summed over TP.
            h = mappings.reduce_scatter_to_sequence_parallel_region(h_partial, base.sequence_dimension, group,
                                                                    reduce_dtype=base.reduce_dtype)
            b = mappings.copy_to_tensor_model_parallel_region(b, group)
        elif base.reduce_output:
            h = mappings.reduce_from_tensor_model_parallel_region(h_partial, group, reduce_dtype=base.reduce_dtype)
        else:
            # The caller sums this rank's output with the others': B h_partial joins that sum (B is linear), and B's
            # gradient, one part per rank, is summed over TP.
            h = h_partial
            b = mappings.copy_to_tensor_model_parallel_region(b, group)
        return F.linear(h, b) * self.scaling[adapter]

    # ---- merging ----

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """``scaling * B @ A`` of this rank, in the base weight's layout: its shard of the dense delta."""
        a, b = self.lora_A[adapter].weight, self.lora_B[adapter].weight
        dtype = b.dtype
        cast = b.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)   # slow half matmuls on CPUs
        if cast:
            a, b = a.float(), b.float()
        delta = (b @ a) * self.scaling[adapter]
        if self.fan_in_fan_out:
            delta = delta.t()
        return delta.to(dtype) if cast else delta

    def merge(self, safe_merge: bool = False, adapter_names: Optional[list] = None) -> None:
        adapter_names = check_adapters_to_merge(self, adapter_names)
        weight = self.get_base_layer().weight
        for adapter in adapter_names:
            if adapter not in self.lora_A.keys():
                continue
            delta = self.get_delta_weight(adapter).to(weight.dtype)
            if safe_merge:
                merged = weight.data + delta
                if not torch.isfinite(merged).all():
                    raise ValueError(f"NaNs detected in the merged weights. The adapter {adapter} seems to be broken")
                weight.data = merged
            else:
                weight.data += delta
            self.merged_adapters.append(adapter)

    def unmerge(self) -> None:
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        weight = self.get_base_layer().weight
        while self.merged_adapters:
            adapter = self.merged_adapters.pop()
            if adapter in self.lora_A.keys():
                weight.data -= self.get_delta_weight(adapter).to(weight.dtype)

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


def _has_draws(dropout: nn.Module) -> bool:
    return dropout.training and isinstance(dropout, nn.Dropout) and dropout.p > 0


def _replicated_draws(dropout: nn.Module):
    """Around dropout on an input every TP rank holds whole: the same mask on every rank, even inside a fork."""
    return get_xla_rng_tracker().replicated() if _has_draws(dropout) else contextlib.nullcontext()


def _per_rank_draws(dropout: nn.Module):
    """Around dropout on this rank's part of an activation: a mask of its own (the tracker's per-rank state)."""
    return get_xla_rng_tracker().fork() if _has_draws(dropout) else contextlib.nullcontext()


def _refuse_layer(target: nn.Module, adapter_name: str, config, **kwargs):
    """PEFT's dispatch for nxdtp layers LoRA is not implemented on: refuse by name."""
    base = target.get_base_layer() if isinstance(target, LoraLayer) else target
    raise ValueError(f"LoRA on {kwargs.get('target_name', '?')!r} ({type(base).__name__}) is not supported by nxdtp: "
                     "LoRA targets ColumnParallelLinear and RowParallelLinear layers (attention and MLP projections); "
                     "remove it from target_modules")


# ---- the checks at injection time ------------------------------------------------------------------------------------

_VARIANT_NAMES = {"use_dora": "DoRA (use_dora=True)", "velora_config": "VeLoRA (velora_config)",
                  "alora_invocation_tokens": "aLoRA (alora_invocation_tokens)",
                  "monteclora_config": "MonteCLoRA (monteclora_config)", "use_bdlora": "BD-LoRA (use_bdlora)",
                  "arrow_config": "Arrow (arrow_config)", "kasa_config": "KaSA (kasa_config)"}


def check_layer_config(config, where: str) -> None:
    """Refuse LoRA options that nxdtp's layers do not shard, naming the option and what is supported."""
    supported = ("plain LoRA (r, lora_alpha, use_rslora, rank_pattern, alpha_pattern, lora_dropout, "
                 f"init_lora_weights in {list(SUPPORTED_INIT)})")
    for field in dataclasses.fields(config):
        if field.metadata.get("is_lora_variant") and getattr(config, field.name):
            name = _VARIANT_NAMES.get(field.name, f"the LoRA variant {field.name}={getattr(config, field.name)!r}")
            raise ValueError(f"{name} is not supported on nxdtp tensor-parallel layers ({where}): nxdtp shards "
                             f"{supported}")
    init = config.init_lora_weights
    if not any(init is value or (isinstance(init, str) and init == value) for value in SUPPORTED_INIT):
        raise ValueError(f"init_lora_weights={init!r} is not supported on nxdtp tensor-parallel layers ({where}): it "
                         f"initialises the adapter from the dense base weight, which no rank holds; valid values are "
                         f"{list(SUPPORTED_INIT)}")
    refused = {
        "lora_bias": (config.lora_bias, False, "a bias on lora_B"),
        "use_qalora": (getattr(config, "use_qalora", False), False, "QALoRA"),
        "megatron_config": (config.megatron_config, None, "PEFT's Megatron layers (nxdtp shards the adapters itself)"),
    }
    for option, (value, default, what) in refused.items():
        if value != default and value is not default:
            raise ValueError(f"{option}={value!r} ({what}) is not supported on nxdtp tensor-parallel layers ({where}); "
                             f"use {option}={default!r}")


def _sharded_modules(model: nn.Module) -> Dict[str, nn.Module]:
    return {name: module for name, module in model.named_modules()
            if isinstance(module, ShardedModule) and any(spec.is_sharded for spec in module.param_specs().values())}


def check_config(tuner: BaseTuner, model: nn.Module, config) -> None:
    """Everything nxdtp refuses about this PEFT config on ``model``, before PEFT changes anything."""
    peft_type = getattr(config, "peft_type", None)
    if peft_type != PeftType.LORA or not isinstance(tuner, LoraModel):
        method = getattr(peft_type, "value", peft_type)
        if peft_type == PeftType.LORA:
            method = f"LoRA through {type(tuner).__name__}"
        raise ValueError(f"PEFT method {method} is not supported on an nxdtp tensor-parallel model: nxdtp supports "
                         "LoRA (peft.LoraConfig with get_peft_model / PeftModel.from_pretrained)")
    check_layer_config(config, "LoraConfig")
    for option, value, default, why in (
            ("layer_replication", config.layer_replication, None, "copies layers, and their shards with them"),
            ("trainable_token_indices", config.trainable_token_indices, None,
             "trains rows of the vocab-parallel embedding"),
            ("target_parameters", config.target_parameters, None, "wraps parameters, not layers"),
            ("bias", config.bias, "none", "trains the base layers' biases, some of them sharded")):
        if value is not None and value != default and value not in ([], {}):
            raise ValueError(f"{option}={value!r} is not supported on an nxdtp tensor-parallel model (it {why}); use "
                             f"{option}={default!r}")
    if config.modules_to_save:
        sharded = [name for name in _sharded_modules(model)
                   if any(name == m or name.endswith("." + m) for m in config.modules_to_save)]
        if sharded:
            raise ValueError(f"modules_to_save={list(config.modules_to_save)} includes tensor-parallel modules "
                             f"{sharded[:3]}: a trainable copy of a sharded module is not supported by nxdtp's LoRA; "
                             "save only replicated modules (a classifier), or target the layer with LoRA instead")


def _all_linear_names(model: nn.Module) -> set:
    """PEFT's ``target_modules="all-linear"`` on a TP model: every Linear-like layer (nxdtp's parallel linear layers
    and the replicated ``nn.Linear``), without the output layer, as PEFT does on a dense model."""
    names = {name.rpartition(".")[2] for name, module in model.named_modules()
             if isinstance(module, (ColumnParallelLinear, RowParallelLinear, nn.Linear)) and name}
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None:
        names -= {name.rpartition(".")[2] for name, module in model.named_modules() if module is output}
    return names


def prepare_injection(tuner: BaseTuner, model: nn.Module, config) -> None:
    """Before PEFT injects ``config``'s adapter into ``model`` (a model with nxdtp parallel layers): refuse what is not
    supported, and route nxdtp's layers to ``LoraParallelLinear`` through PEFT's custom-module dispatch."""
    import peft

    if not peft_version_supported(peft.__version__):
        raise ImportError(f"peft {peft.__version__} is not supported by nxdtp's LoRA on tensor-parallel models: "
                          f"supported versions are {SUPPORTED_PEFT_PIP[4:]}; pip install '{SUPPORTED_PEFT_PIP}'")
    check_config(tuner, model, config)
    if config.target_modules == "all-linear":
        # PEFT's own expansion looks for nn.Linear and Conv1D only, and would miss every parallel layer.
        config.target_modules = _all_linear_names(model)
    # First match wins: the two supported layers before their base class, which refuses the rest by name.
    config._register_custom_module({ColumnParallelLinear: LoraParallelLinear, RowParallelLinear: LoraParallelLinear,
                                    BaseParallelLayer: _refuse_layer})


def holds_parallel_layers(model: nn.Module) -> bool:
    return any(isinstance(module, BaseParallelLayer) for module in model.modules())


# ---- saving: the dense adapter ---------------------------------------------------------------------------------------

def dense_adapter_state_dict(model: nn.Module, state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """PEFT's adapter state dict with every sharded entry gathered to the dense tensor (through its spec, one tensor at
    a time: a collective, so every TP rank must call it with the same keys) and the specs (``_extra_state``) left out,
    so the saved adapter is the one dense LoRA would have saved."""
    dense = {}
    for key, value in state_dict.items():
        owner_name, _, leaf = key.rpartition(".")
        try:
            owner = model.get_submodule(owner_name)
        except AttributeError:
            owner = None
        if not isinstance(owner, ShardedModule):
            dense[key] = value
            continue
        if leaf == "_extra_state":
            continue
        spec = owner.param_specs().get(leaf)
        if spec is None or not isinstance(value, torch.Tensor) or tuple(value.shape) != spec.local_shape():
            dense[key] = value   # not a sharded local tensor (a state dict passed in already dense)
            continue
        if spec.is_sharded:
            group = owner.group() if isinstance(owner, LoraFactor) else owner._group()
        else:
            group = tensor_parallel_group()   # not used: a replicated tensor is already whole
        dense[key] = gather_dense(value, spec, group).contiguous().clone()   # not a view of the padded tensor
    return dense


# ---- installing into PEFT --------------------------------------------------------------------------------------------

_MARK = "_nxdtp_original"


def install() -> None:
    """Wrap the three PEFT entry points nxdtp needs, once: adapter injection (checks and dispatch), the adapter state
    dict that ``save_pretrained`` writes (gathered), and prompt-learning setup (refused). Each wrapper does nothing on
    models without nxdtp layers."""
    if not hasattr(BaseTuner.inject_adapter, _MARK):
        original_inject = BaseTuner.inject_adapter

        @functools.wraps(original_inject)
        def inject_adapter(self, model, adapter_name, *args, **kwargs):
            if holds_parallel_layers(model):
                prepare_injection(self, model, self.peft_config[adapter_name])
            return original_inject(self, model, adapter_name, *args, **kwargs)

        setattr(inject_adapter, _MARK, original_inject)
        BaseTuner.inject_adapter = inject_adapter

    import peft

    if not peft_version_supported(peft.__version__):
        return   # only the injection wrapper, which refuses this release on TP models by name
    current = LoraModel.__dict__["_get_adapter_state_dict"]
    if not hasattr(current.__func__, _MARK):
        original_state = current.__func__

        @functools.wraps(original_state)
        def _get_adapter_state_dict(cls, model, config, adapter_name, state_dict, unwanted_adapter_names):
            selected = original_state(cls, model, config, adapter_name, state_dict, unwanted_adapter_names)
            return dense_adapter_state_dict(model, selected) if holds_parallel_layers(model) else selected

        setattr(_get_adapter_state_dict, _MARK, original_state)
        LoraModel._get_adapter_state_dict = classmethod(_get_adapter_state_dict)

    from peft.peft_model import PeftModel

    if not hasattr(PeftModel._setup_prompt_encoder, _MARK):
        original_setup = PeftModel._setup_prompt_encoder

        @functools.wraps(original_setup)
        def _setup_prompt_encoder(self, adapter_name):
            if holds_parallel_layers(self.base_model):
                method = getattr(self.peft_config[adapter_name].peft_type, "value", "prompt learning")
                raise ValueError(f"PEFT method {method} is not supported on an nxdtp tensor-parallel model: nxdtp "
                                 "supports LoRA (peft.LoraConfig)")
            return original_setup(self, adapter_name)

        setattr(_setup_prompt_encoder, _MARK, original_setup)
        PeftModel._setup_prompt_encoder = _setup_prompt_encoder


__all__ = ["LoraParallelLinear", "LoraFactor", "factor_specs", "gather_dense", "check_config", "install",
           "SUPPORTED_INIT"]

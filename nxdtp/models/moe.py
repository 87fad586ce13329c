"""Tensor- and expert-parallel plan for Hugging Face mixture-of-experts decoders: MixtralForCausalLM,
Qwen2MoeForCausalLM and Qwen3MoeForCausalLM (transformers 5, whose experts are one module holding every expert's
weights: ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I)).

* Attention, embeddings, norms and the LM head as for the Llama family (``nxdtp.models.llama``).
* The experts module is split by ``ParallelExperts``: a rank holds ``E / ep`` consecutive experts (the topology's
  expert-parallel size) and its 1/tp share of each expert's intermediate dimension. Its forward routes as
  ``nxdtp.modules.moe`` does, dropless: each token goes to the ranks holding its chosen experts (an all-to-all over
  the expert-parallel group) and back; the TP ranks' partial sums are all-reduced once. The router stays replicated
  and HF's own: the routing is HF's.
* Dense MLPs (Qwen3-MoE's ``mlp_only_layers``) and Qwen2-MoE's shared expert are split as the Llama MLP; the shared
  expert's sigmoid gate stays replicated.
* ``sequence_parallel=True``: as the Llama family's, with each sparse block run on the whole sequence (gathered on
  entry, this rank's shard of the output kept).
* The load-balancing loss (``output_router_logits=True``) counts tokens over the whole data-parallel batch, so the DP
  mean of the loss and the DP average of its gradient are the dense model's on the global batch.

Gradients: ``nxdtp.grads.allreduce_gradients(model)`` averages them over DP with NxD's two passes (experts over the
expert data-parallel group); ``get_grad_norm`` counts each expert once. ``from_pretrained_sharded`` reads
transformers' per-expert files (``ExpertsAsModuleHolds``). Checkpoints hold every expert (``ParamSpec``'s
``expert_partitions``; nxdtp.checkpointing.experts), so they load at any expert-parallel size. Not provided yet:
transformers 4.x's per-expert modules.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import comm, mappings
from ..forward_wrappers import add_mixin, wrap_forward
from ..modules.moe.expert_mlps import routed_slots, run_experts_on_slots, tokens_in_largest_batch
from ..modules.moe.moe_parallel_layers import local_expert_count
from ..plan import Effect, Style, WrapForward, wrapper_factory
from ..spec import ParamSpec, ShardedModule, split_along
from ..storage import owning
from ..topology import ParallelGroup, data_parallel_group, expert_parallel_group
from .common import require_supported_transformers, splits_sequence, with_and_without_prefix
from .family import Family
from .llama import LAYER, SEQUENCE_DIM, build_decoder_plan, dense_mlp_styles

NAME = "MoE decoder"
SUPPORTED = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# transformers 5's experts modules (``use_experts_implementation``) declare their layout in these attributes; the one
# ParallelExperts computes: gate rows then up rows in one (E, 2I, H) weight, no biases, no norm after each expert.
STANDARD_LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
                   "has_post_expert_norm": False}


def moe_decoder_plan(sequence_parallel: bool = False, make_vocab_size_divisible_by: int = 1, pad_heads: bool = True):
    require_supported_transformers(NAME)

    def mlp_styles(model: nn.Module, group: ParallelGroup) -> dict:
        return _mlp_styles(model, sequence_parallel)

    return build_decoder_plan(NAME, SUPPORTED, _sizes, mlp_styles, sequence_parallel, make_vocab_size_divisible_by,
                              pad_heads, finalize=count_router_tokens_over_data_parallel)


def _sizes(config) -> dict:
    sizes = {"moe_intermediate_size": getattr(config, "moe_intermediate_size", None),
             "shared_expert_intermediate_size": getattr(config, "shared_expert_intermediate_size", None)}
    if not hasattr(config, "moe_intermediate_size") or getattr(config, "mlp_only_layers", None):
        sizes["intermediate_size"] = config.intermediate_size
    return {name: value for name, value in sizes.items() if value}


def _mlp_styles(model: nn.Module, sequence_parallel: bool) -> dict:
    """Per layer: the experts split, or the dense MLP's styles; a shared expert as a dense MLP. With sequence
    parallelism a sparse block gathers the sequence on entry and keeps its shard of the output: everything inside it
    (router, experts, shared expert) sees the whole sequence, as without."""
    whole = dict(sequence_parallel=False, sequence_dimension=SEQUENCE_DIM)
    styles = {}
    for index, layer in enumerate(model.model.layers):
        mlp = LAYER.replace("*", str(index)) + "mlp"
        if not hasattr(layer.mlp, "experts"):
            styles.update(dense_mlp_styles(mlp, dict(whole, sequence_parallel=sequence_parallel)))
            continue
        styles[mlp + ".experts"] = ParallelExperts()
        if sequence_parallel:
            # It leaves the sequence-parallel region on entry and re-enters it on exit: no region changes outside.
            styles[mlp] = WrapForward("nxdtp_moe_whole_sequence", whole_sequence_block(SEQUENCE_DIM))
        if hasattr(layer.mlp, "shared_expert"):
            styles.update(dense_mlp_styles(mlp + ".shared_expert", whole))
    return styles


@wrapper_factory
def whole_sequence_block(sequence_dimension: int):
    """A forward wrapper for a block that runs on the whole sequence inside a sequence-parallel model: gather the
    shards on entry (every consumer inside returns the whole gradient on every TP rank, so backward keeps this rank's
    slice), keep this rank's shard of the output (backward gathers it). In generation_mode the sequence stays whole."""

    def wrapper(forward, hidden_states, *args, **kwargs):
        if not splits_sequence(forward.__self__):
            return forward(hidden_states, *args, **kwargs)
        full = mappings.gather_from_sequence_parallel_region(hidden_states, sequence_dimension,
                                                             to_model_parallel=False)
        output = forward(full, *args, **kwargs)
        return mappings.scatter_to_sequence_parallel_region(output, sequence_dimension)

    return wrapper


# ---- the experts -----------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ParallelExperts(Style):
    """An HF experts module (``gate_up_proj`` (E, 2I, H), gate rows then up rows; ``down_proj`` (E, H, I);
    ``forward(hidden_states, top_k_index, top_k_weights)``) split over experts (EP) and each expert's intermediate
    dimension (TP), in place: parameter names stay HF's. HF's ``moe_tp_experts`` style maps here too."""

    expects = nn.Module
    effect = Effect(replaces=False, opens="tensor-parallel", closes="tensor-parallel", records=("stride",))

    def check(self, module: nn.Module, name: str) -> None:
        weights = {w: getattr(module, w, None) for w in ("gate_up_proj", "down_proj")}
        if any(not isinstance(w, nn.Parameter) or w.dim() != 3 for w in weights.values()):
            raise TypeError(f"ParallelExperts applies to an experts module holding 3-D gate_up_proj and down_proj "
                            f"parameters (transformers 5's layout), but '{name}' is {type(module).__name__}")
        layout = {flag: getattr(module, flag, STANDARD_LAYOUT[flag]) for flag in STANDARD_LAYOUT}
        apply_gate = getattr(type(module), "_apply_gate", None)
        if layout != STANDARD_LAYOUT or (apply_gate is not None and apply_gate.__name__ != "_default_apply_gate"):
            raise NotImplementedError(f"'{name}' ({type(module).__name__}): experts laid out as {layout}, or with a "
                                      f"gating of their own, are not supported yet; supported: {STANDARD_LAYOUT} "
                                      "with the default act(gate) * up")

    def convert(self, module: nn.Module, name: str, group: ParallelGroup) -> nn.Module:
        self.check(module, name)
        ep = expert_parallel_group()
        num_experts = module.gate_up_proj.shape[0]
        local = local_expert_count(name, num_experts, ep.size)
        add_mixin(module, ShardedHFExperts)
        module.nxdtp_num_experts, module.nxdtp_expert_parallel_size = num_experts, ep.size
        for param_name, tp_dim, stride in (("gate_up_proj", 1, 2), ("down_proj", 2, 1)):
            original = getattr(module, param_name)
            dense = original.detach()
            mine = dense.narrow(0, ep.rank * local, local)
            piece = split_along(mine, tp_dim, group.rank, group.size, stride)
            setattr(module, param_name, nn.Parameter(owning(piece), requires_grad=original.requires_grad))
            module.register_param_spec(param_name, ParamSpec(full_shape=tuple(dense.shape), partition_dim=tp_dim,
                                                             stride=stride, num_partitions=group.size,
                                                             expert_partitions=ep.size))
        module.reattach_spec_attributes()
        return module


class ShardedHFExperts(ShardedModule):
    """Mixed into an HF experts module by ``ParallelExperts``: its forward over this rank's experts and shard."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        total_tokens = hidden_states.shape[0]
        affinities = torch.zeros(total_tokens, self.nxdtp_num_experts, dtype=top_k_weights.dtype,
                                 device=top_k_weights.device).scatter(1, top_k_index, top_k_weights)
        # Each TP rank's experts see the weights and the tokens through its share of the output: sum those
        # gradients over TP, so that the router's and the block input's gradients are whole on every rank.
        affinities = mappings.copy_to_tensor_model_parallel_region(affinities)
        tokens = mappings.copy_to_tensor_model_parallel_region(hidden_states)
        capacity = tokens_in_largest_batch(hidden_states)   # dropless
        slot_token, affinities = routed_slots(affinities, top_k_index, None, capacity, normalize=False)
        partial = run_experts_on_slots(tokens, slot_token, affinities.to(tokens.dtype), self._local_experts)
        return mappings.reduce_from_tensor_model_parallel_region(partial)

    def _local_experts(self, slots: torch.Tensor) -> torch.Tensor:
        """(E, C, H) -> (E, C, H): every expert's MLP on its slots, on the ranks that hold it."""
        if self.nxdtp_expert_parallel_size > 1:
            dispatched = mappings.enter_expert_parallel_region(slots, scatter_gather=False)  # (E/ep, ep, C, H)
        else:
            dispatched = slots.unsqueeze(1)
        gate, up = torch.einsum("e...h,eih->e...i", dispatched, self.gate_up_proj).chunk(2, dim=-1)
        out = torch.einsum("e...i,ehi->e...h", self.act_fn(gate) * up, self.down_proj)
        if self.nxdtp_expert_parallel_size > 1:
            return mappings.exit_expert_parallel_region(out, scatter_gather=False)
        return out.squeeze(1)

    def reattach_spec_attributes(self) -> None:
        # NxD's mark, which the specs do not carry: new Parameter objects (a copy, a model built on meta and
        # materialised) get it again with their spec attributes.
        super().reattach_spec_attributes()
        for name in ("gate_up_proj", "down_proj"):
            getattr(self, name).expert_model_parallel = True


# ---- the load-balancing loss over the data-parallel batch ------------------------------------------------------------

def count_router_tokens_over_data_parallel(model: nn.Module) -> None:
    """Make ``model``'s ``aux_loss`` (and its share of ``loss``) count the routed tokens over the data-parallel batch,
    for an HF MoE model that computes transformers' load-balancing loss from its ``num_experts``,
    ``num_experts_per_tok`` and ``router_aux_loss_coef``; a model without them keeps its own."""
    if all(hasattr(model, name) for name in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")):
        wrap_forward(model, "nxdtp_moe_aux_loss_over_data_parallel", _aux_loss_over_data_parallel)


def _aux_loss_over_data_parallel(forward, *args, **kwargs):
    """HF's forward, with its load-balancing loss (and its share of ``loss``) replaced by the loss that counts the
    tokens routed to each expert over the whole data-parallel batch, when it is a training loss (labels given,
    gradients on): evaluation and generation keep HF's own, and no DP rank waits for another."""
    output = forward(*args, **kwargs)
    arguments = inspect.signature(forward).bind_partial(*args, **kwargs).arguments
    if getattr(output, "aux_loss", None) is None or getattr(output, "router_logits", None) is None or \
            arguments.get("labels") is None or not torch.is_grad_enabled():
        return output
    model = forward.__self__
    _refuse_router_logits_without_gradient(model, output.router_logits, model.router_aux_loss_coef)
    attention_mask = arguments.get("attention_mask")
    aux = load_balancing_loss_over_data_parallel(output.router_logits, model.num_experts,
                                                 model.num_experts_per_tok, attention_mask)
    if output.loss is not None:
        output.loss = output.loss + model.router_aux_loss_coef * (aux - output.aux_loss)
    output.aux_loss = aux
    return output


def _refuse_router_logits_without_gradient(model: nn.Module, router_logits, coefficient: float) -> None:
    """transformers records the router logits inside each decoder layer (a hook on the router). When the layer is
    recomputed in backward (activation checkpointing: nxdtp's, or HF's gradient checkpointing), its forward ran without
    gradients, so the recorded logits have none although the router trains, and the load-balancing loss would train
    nothing, without a word. (Logits without a gradient because the router is frozen are as they should be.)"""
    if not coefficient:
        return
    routers = _routers(model)
    for layer, logits in enumerate(router_logits):
        trains = any(p.requires_grad for p in routers[layer].parameters()) if len(routers) == len(router_logits) \
            else torch.is_grad_enabled()
        if trains and not logits.requires_grad:
            raise RuntimeError(
                f"the router logits of MoE layer {layer} carry no gradient although its router trains, so "
                f"router_aux_loss_coef={coefficient} would train nothing: the decoder layers are "
                "activation-checkpointed (recomputed in backward, their forward run without gradients) and "
                "transformers records the router logits inside them. Checkpoint the attention only "
                "(activation_checkpoint_config=<the model's Attention class>, the examples' "
                "--selective_checkpoint_enabled), or train without activation checkpointing")


def _routers(model: nn.Module) -> list:
    """The modules whose outputs transformers records as router logits, in layer order (its ``_can_record_outputs``);
    empty where the model does not say."""
    recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    router_class = getattr(recorder, "target_class", recorder)
    if not isinstance(router_class, type):
        return []
    return [module for module in model.modules() if isinstance(module, router_class)]


def load_balancing_loss_over_data_parallel(router_logits, num_experts: int, top_k: int,
                                           attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """transformers' load-balancing loss (``num_experts * sum_e f_e * P_e`` over every layer's router logits, padding
    excluded by ``attention_mask``) with f_e and the token count taken over the data-parallel batch: the DP ranks'
    mean of it is the dense model's loss on the global batch. The counts carry no gradient."""
    logits = torch.cat([layer.float() for layer in router_logits])
    probabilities = torch.softmax(logits, dim=-1)
    chosen = torch.topk(probabilities, top_k, dim=-1).indices
    weight = torch.ones(logits.shape[0], device=logits.device)
    if attention_mask is not None:
        weight = attention_mask.reshape(-1).to(logits.device, torch.float32).repeat(len(router_logits))
    choices = (chosen.unsqueeze(-1) == torch.arange(num_experts, device=logits.device)).sum(1).float()
    counts = torch.cat([(choices * weight.unsqueeze(-1)).sum(0), weight.sum().reshape(1)]).detach()
    group = data_parallel_group()
    counts = comm.all_reduce(counts, group)
    tokens_per_expert, total = counts[:num_experts] / counts[-1], counts[-1] / group.size
    router_prob_per_expert = (probabilities * weight.unsqueeze(-1)).sum(0) / total
    return torch.sum(tokens_per_expert * router_prob_per_expert) * num_experts


# ---- reading experts stored one by one -------------------------------------------------------------------------------

_PER_EXPERT = re.compile(r"^(?P<prefix>.*)\.experts\.(?P<expert>\d+)\.(?P<part>w1|w3|w2|gate_proj|up_proj|down_proj)"
                         r"\.weight$")
_GATE, _UP = ("w1", "gate_proj"), ("w3", "up_proj")


class ExpertsAsModuleHolds:
    """An HF checkpoint reader (``hf_loading.CheckpointReader``) that also offers experts stored one by one (Hugging
    Face's files for Mixtral, ``block_sparse_moe.experts.N.w1/w3/w2``, and for the Qwen MoE models,
    ``mlp.experts.N.gate_proj/up_proj/down_proj``) under the keys of transformers 5's experts module:
    ``mlp.experts.gate_up_proj`` (E, 2I, H), gate rows then up rows, and ``mlp.experts.down_proj`` (E, H, I); and
    Mixtral's router ``block_sparse_moe.gate.weight`` as ``mlp.gate.weight``. A slice along one dimension reads only
    the matching slices of the stored tensors, so each rank still reads only its share."""

    def __init__(self, reader) -> None:
        self._reader = reader
        self._parts: Dict[str, Dict[int, Dict[str, str]]] = {}   # module key -> expert -> part -> stored key
        self._aliases: Dict[str, str] = {}
        for key in reader.keys():
            match = _PER_EXPERT.match(key)
            if match is None:
                if ".block_sparse_moe.gate." in key:
                    self._aliases[key.replace(".block_sparse_moe.", ".mlp.")] = key
                continue
            prefix = match["prefix"].replace(".block_sparse_moe", ".mlp")
            part = match["part"]
            fused = f"{prefix}.experts.{'down_proj' if part in ('w2', 'down_proj') else 'gate_up_proj'}"
            self._parts.setdefault(fused, {}).setdefault(int(match["expert"]), {})[part] = key

    def keys(self) -> List[str]:
        return self._reader.keys() + list(self._parts) + list(self._aliases)

    def _stored(self, key: str) -> List[str]:
        if key in self._aliases:
            return [self._aliases[key]]
        return [k for expert in sorted(self._parts[key]) for k in self._parts[key][expert].values()]

    def path(self, key: str) -> str:
        return self._reader.path(self._stored(key)[0] if key in self._parts or key in self._aliases else key)

    def dtype_name(self, key: str) -> str:
        return self._reader.dtype_name(self._stored(key)[0] if key in self._parts or key in self._aliases else key)

    def shape(self, key: str) -> Tuple[int, ...]:
        if key in self._aliases:
            return self._reader.shape(self._aliases[key])
        if key not in self._parts:
            return self._reader.shape(key)
        experts = self._parts[key]
        rows, columns = self._reader.shape(next(iter(experts[0].values())))
        return (len(experts), 2 * rows, columns) if key.endswith("gate_up_proj") else (len(experts), rows, columns)

    def read(self, key: str, dim: Optional[int] = None, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
        if key in self._aliases:
            return self._reader.read(self._aliases[key], dim, start, stop)
        if key not in self._parts:
            return self._reader.read(key, dim, start, stop)
        shape = self.shape(key)
        dim, stop = (0, shape[0]) if dim is None else (dim, shape[dim] if stop is None else stop)
        experts = range(start, stop) if dim == 0 else range(shape[0])
        rows = (0, shape[1]) if dim != 1 else (start, stop)
        columns = (start, stop) if dim == 2 else (0, shape[2])
        return torch.stack([self._expert(key, e, rows, columns) for e in experts])

    def _expert(self, key: str, expert: int, rows, columns) -> torch.Tensor:
        """Rows ``[rows)`` and columns ``[columns)`` of one expert's matrix as the module holds it."""
        parts = self._parts[key][expert]
        if key.endswith("down_proj"):
            stored = next(iter(parts.values()))
            return self._reader.read(stored, 1, *columns).narrow(0, rows[0], rows[1] - rows[0])
        gate, up = (next(parts[p] for p in names if p in parts) for names in (_GATE, _UP))
        half = self._reader.shape(gate)[0]
        pieces = [self._reader.read(stored, 0, max(rows[0], offset) - offset, min(rows[1], offset + half) - offset)
                  for stored, offset in ((gate, 0), (up, half)) if rows[0] < offset + half and rows[1] > offset]
        return torch.cat(pieces).narrow(1, columns[0], columns[1] - columns[0])

    def release(self) -> None:
        self._reader.release()


def experts_as_module_holds(reader):
    """``reader``, wrapped in ``ExpertsAsModuleHolds`` when its checkpoint stores experts one by one."""
    wrapped = ExpertsAsModuleHolds(reader)
    return wrapped if wrapped._parts or wrapped._aliases else reader


def checkpoint_keys(name: str):
    return with_and_without_prefix(name, "model.")


FAMILY = Family(NAME, SUPPORTED, moe_decoder_plan, checkpoint_keys, oldest_transformers=(5, 0))

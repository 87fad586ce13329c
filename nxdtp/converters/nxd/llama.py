"""Import a Llama (or Mistral) checkpoint written by NxD into a dense HF ``*ForCausalLM`` directory, reading the
per-rank layout of NxD's Llama training model; ``Planner`` also serves Mixtral, whose layers differ only in the MLP
(docs/checkpoints.md, "Llama and Mistral")."""

from __future__ import annotations

import copy
import fnmatch
import math
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ...models.common import require_supported_transformers
from ...models.llama import NAME as LLAMA_FAMILY
from ...spec import ParamSpec
from .reader import (
    AUTO,
    NxdCheckpointError,
    NxdSource,
    RankFiles,
    RankShard,
    check_pieces,
    check_saved_tp,
    expected_layout,
    import_checkpoint,
    load_config_dict,
    one_dtype,
    replicated,
    say,
)

# model_type -> (config class, model class) in transformers
_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM")}
MODEL_TYPES = tuple(_CLASSES)

# Buffers older transformers versions kept in the state dict; they are not weights and HF rebuilds them.
DROPPED_BUFFER_PATTERNS = ("*rotary_emb.inv_freq",)

LAYER = "model.layers.{}."
VOCAB_KEYS = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class AttentionForm:
    """One of the ways NxD's Llama attention stores Q, K and V (the key suffixes after ``self_attn.``)."""

    name: str
    keys: Tuple[str, ...]  # one fused key (Q rows, then K, then V on each rank), or the Q, K and V keys
    kv_replication: bool  # whether the layer can hold kv_size_multiplier copies of each KV head
    equal_heads: bool = False  # whether it exists only for models with as many KV heads as query heads


ATTENTION_FORMS = (
    AttentionForm("GQAQKVColumnParallelLinear(fuse_qkv=True)", ("qkv_proj.weight_qkv",), True),
    AttentionForm("GQAQKVColumnParallelLinear(fuse_qkv=False)",
                  ("qkv_proj.weight_q", "qkv_proj.weight_k", "qkv_proj.weight_v"), True),
    AttentionForm("ColumnParallelLinear(stride=3) over Q|K|V", ("qkv_proj.weight",), False, equal_heads=True),
    AttentionForm("ColumnParallelLinear q_proj, k_proj, v_proj", ("q_proj.weight", "k_proj.weight", "v_proj.weight"),
                  False),
)


def head_layout(num_heads: int, num_kv_heads: int, tp: int, multiplier: int):
    """Where each dense head lives in the NxD ranks: ``(q_sources, kv_copies)``: the (TP rank, local Q slot) of HF query
    head h, and every (TP rank, local KV slot) holding a copy of KV head g. Q heads are placed so that the ranks'
    ``repeat_kv`` pairing and HF's agree."""
    q_local, kv_local = num_heads // tp, num_kv_heads * multiplier // tp
    per_kv = q_local // kv_local
    group = num_heads // num_kv_heads

    def kv_head(rank: int, slot: int) -> int:
        return (rank * kv_local + slot) % num_kv_heads  # K.repeat(multiplier, 1), then rank r's 1/tp

    kv_copies: List[List[Tuple[int, int]]] = [[] for _ in range(num_kv_heads)]
    for rank in range(tp):
        for slot in range(kv_local):
            kv_copies[kv_head(rank, slot)].append((rank, slot))
    q_sources: List[Optional[Tuple[int, int]]] = [None] * num_heads
    next_free = [g * group for g in range(num_kv_heads)]
    for rank in range(tp):
        for slot in range(q_local):
            g = kv_head(rank, slot // per_kv)
            q_sources[next_free[g]] = (rank, slot)
            next_free[g] += 1
    return q_sources, kv_copies


def load_decoder_config(config_json, classes: Dict[str, Tuple[str, str]], family: str, module: str):
    """The HF config and model class of ``config_json`` (``classes``: model type -> config and model class names);
    refused for another model type, a transformers release the ``family`` plan was not written for, and biases NxD's
    decoder layers lack."""
    import transformers
    from transformers import PretrainedConfig

    require_supported_transformers(family)

    if isinstance(config_json, PretrainedConfig):
        config, where = copy.deepcopy(config_json), type(config_json).__name__  # architectures is set before saving
        model_type = getattr(config, "model_type", None)
    else:
        raw, where = load_config_dict(config_json)
        model_type = raw.get("model_type") or next(
            (t for a in raw.get("architectures") or [] for t, (_, m) in classes.items() if a == m), None)
        config = None
    if model_type not in classes:
        raise NxdCheckpointError(f"config {where}: model_type is {model_type!r}; {module} reads model_type "
                                 f"{', '.join(classes)}")
    config_class, model_class = (getattr(transformers, name) for name in classes[model_type])
    if config is None:
        config = config_class.from_dict(raw)
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(config, flag, False):
            raise NxdCheckpointError(f"config {where} sets {flag}=true, but NxD's Llama layers have no biases, so no "
                                     "NxD checkpoint matches it; set it to false if the model was trained with NxD")
    return config, model_class


class Laid(NamedTuple):
    """An HF tensor read through NxD's layout of one key (``NxdSource.laid_out``'s arguments)."""

    nxd_key: str
    spec: ParamSpec
    offset: int = 0  # the first dense row of the HF tensor in the NxD tensor (gate, then up)
    handles: Optional[List[str]] = None  # the readers of its pieces, if not the TP ranks' files
    swap: Optional[Tuple[int, int]] = None  # the dims the HF tensor has swapped (NxD's experts are transposed)


@dataclass(frozen=True)
class _QKVKeys:
    """One layer's Q, K and V keys in an NxD checkpoint, and how a rank's tensors under them split into its Q, K and V
    rows."""

    names: Tuple[str, ...]  # one fused key (Q rows, then K, then V), or the Q, K and V keys
    q_rows: int  # Q rows per rank
    hidden: int

    @property
    def fused(self) -> bool:
        return len(self.names) == 1

    def shapes(self, kv_rows: int) -> Tuple[Tuple[int, ...], ...]:
        """The shape of each key on every rank, with ``kv_rows`` K (and V) rows per rank."""
        if self.fused:
            return ((self.q_rows + 2 * kv_rows, self.hidden),)
        return (self.q_rows, self.hidden), (kv_rows, self.hidden), (kv_rows, self.hidden)

    def blocks(self, shard: RankShard, kv_rows: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A rank's Q, K and V rows."""
        if self.fused:
            return torch.split(shard.get(self.names[0]), [self.q_rows, kv_rows, kv_rows])
        return shard.get(self.names[0]), shard.get(self.names[1]), shard.get(self.names[2])


class Planner:
    """Checks an NxD Llama checkpoint against the config and says how to build each dense tensor. A family whose
    layers differ from Llama's only in the MLP (Mixtral) overrides ``_mlp``, ``MODEL`` and ``_nxd_name``."""

    MODEL = "NxD's Llama model"

    def __init__(self, config, model_class, shards: Sequence[RankShard], files: RankFiles, progress: bool):
        self.config, self.shards, self.files, self.progress = config, shards, files, progress
        self.tp = len(shards)
        self.shapes, self.tied = expected_layout(config, model_class)
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.hidden = config.hidden_size
        self.head_dim = self.shapes[LAYER.format(0) + "self_attn.q_proj.weight"][0] // self.heads
        self.keys = set(shards[0].state)
        self.dropped = sorted(k for k in self.keys if any(fnmatch.fnmatchcase(k, p) for p in DROPPED_BUFFER_PATTERNS))
        self.consumed = set(self.dropped)
        # HF key -> (stored dtype, a build of the dense tensor, or a Laid: the NxD key and its layout)
        self.producers: Dict[str, Tuple[torch.dtype, Any]] = {}
        self.handles: Dict[str, Any] = {}  # readers of pieces beyond the TP ranks' files (NxdSource.add_handles)
        self.multiplier: Optional[int] = None

    # -- errors --

    def _shape_error(self, shard: RankShard, key: str, shape, want: str) -> NxdCheckpointError:
        return NxdCheckpointError(f"{shard.tensor_file(key)}: '{key}' has shape {list(shape)}, but the config needs "
                                  f"{want}")

    def _check_saved_tp(self) -> None:
        """A missing last rank leaves ranks 0..tp-2 contiguous: o_proj's slice width tells the saved degree."""
        key = LAYER.format(0) + "self_attn.o_proj.weight"
        if key in self.keys and self.shards[0].get(key).dim() == 2:
            check_saved_tp(self.files, self.shards[0], key, 1, self.heads * self.head_dim)

    # -- plain tensors --

    def _replicated(self, key: str, hf_key: Optional[str] = None) -> None:
        """``key``, whole on every TP rank, is the HF tensor ``hf_key`` (default: the same name)."""
        hf_key = hf_key or key
        dtype = check_pieces(self.shards, key, ParamSpec(full_shape=self.shapes[hf_key]), "whole on every TP rank")
        self.producers[hf_key] = (dtype, lambda: replicated(self.shards, key))
        self.consumed.add(key)

    def _split(self, key: str, dim: int) -> None:
        full = self.shapes[key]
        if full[dim] % self.tp:
            raise NxdCheckpointError(f"'{key}' of shape {list(full)} cannot be split along dim {dim} over {self.tp} "
                                     "TP ranks, so NxD cannot have written it at this degree")
        spec = ParamSpec(full_shape=full, partition_dim=dim, num_partitions=self.tp)
        how = f"its 1/{self.tp} slice along dim {dim} of the full {list(full)}"
        self.producers[key] = (check_pieces(self.shards, key, spec, how), Laid(key, spec))
        self.consumed.add(key)

    def _vocab(self, key: str) -> None:
        vocab, width = self.shapes[key]
        rows = math.ceil(vocab / self.tp)
        padding = rows * self.tp - vocab
        # NxD pads the vocabulary at its end to a multiple of tp.
        spec = ParamSpec(full_shape=(rows * self.tp, width), partition_dim=0, num_partitions=self.tp,
                         real_shape=(vocab, width))
        how = f"its 1/{self.tp} slice of the {vocab}-token vocabulary" + (
            f" padded to {rows * self.tp}" if padding else "")
        self.producers[key] = (check_pieces(self.shards, key, spec, how), Laid(key, spec))
        if padding:
            say(self.progress, f"'{key}': dropping the {padding} padding row(s) past the vocabulary size {vocab}")
        self.consumed.add(key)

    def _gate_up(self, layer: str) -> None:
        key = layer + "mlp.gate_up_proj.weight"
        gate, up = layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight"
        if key not in self.keys:
            return  # the HF keys are then reported missing
        intermediate, hidden = self.shapes[gate]
        if intermediate % self.tp:
            raise NxdCheckpointError(f"'{key}': intermediate_size {intermediate} cannot be split over {self.tp} TP "
                                     "ranks, so NxD cannot have written it at this degree")
        local = intermediate // self.tp
        # Gate and up fused with stride 2: each rank's piece is its gate rows, then its up rows.
        spec = ParamSpec(full_shape=(2 * intermediate, hidden), partition_dim=0, num_partitions=self.tp, stride=2)
        dtype = check_pieces(self.shards, key, spec, f"this rank's {local} gate rows, then its {local} up rows, of "
                                                     f"intermediate_size {intermediate}")
        self.producers[gate] = (dtype, Laid(key, spec, 0))
        self.producers[up] = (dtype, Laid(key, spec, intermediate))
        self.consumed.add(key)

    # -- attention --

    def _form(self, layer: str) -> Optional[AttentionForm]:
        present = [f for f in ATTENTION_FORMS if any(layer + "self_attn." + k in self.keys for k in f.keys)]
        if len(present) > 1:
            raise NxdCheckpointError(f"{self.shards[0].path}: {layer}self_attn holds the keys of more than one NxD "
                                     f"attention layout ({'; '.join(f.name for f in present)})")
        if not present:
            return None
        form = present[0]
        absent = [layer + "self_attn." + k for k in form.keys if layer + "self_attn." + k not in self.keys]
        if absent:
            raise NxdCheckpointError(f"{self.shards[0].path}: {absent[0]} is missing ({form.name} stores "
                                     f"{', '.join(form.keys)})")
        return form

    def _attention(self, index: int) -> None:
        layer = LAYER.format(index)
        form = self._form(layer)
        if form is None:
            return  # the HF keys are then reported missing
        qkv = _QKVKeys(tuple(layer + "self_attn." + k for k in form.keys), self.heads * self.head_dim // self.tp,
                       self.hidden)
        o_key = layer + "self_attn.o_proj.weight"
        options = self._layouts_of(layer, form, qkv)
        kv_rows = self._kv_rows(qkv, options)
        multiplier = self._one_multiplier(qkv, options[kv_rows])
        self._split(o_key, 1)  # checks each rank's slice; _produce_attention then builds it with the heads reordered
        dtype = self._one_attention_dtype(qkv.names + (o_key,))
        q_sources, kv_copies = head_layout(self.heads, self.kv_heads, self.tp, multiplier)
        self._check_kv_copies_equal(qkv, kv_rows, kv_copies, multiplier)
        self._produce_attention(layer, qkv, kv_rows, o_key, q_sources, kv_copies, dtype)

    def _layouts_of(self, layer: str, form: AttentionForm, qkv: _QKVKeys) -> Dict[int, int]:
        """KV rows per rank -> kv_size_multiplier, for every multiplier NxD accepts for this form, config and tp; raise
        if the form cannot hold the config's heads at all."""
        options = {}
        for m in (range(1, self.tp + 1) if form.kv_replication else (1,)):
            kv_total = self.kv_heads * m
            # NxD: tp % m == 0 and tp divides the replicated KV heads; each rank's Q heads share its KV heads evenly.
            if self.tp % m == 0 and kv_total % self.tp == 0 and self.heads % kv_total == 0:
                options[kv_total // self.tp * self.head_dim] = m
        if form.equal_heads and self.heads != self.kv_heads:
            raise NxdCheckpointError(f"{self.shards[0].path}: '{qkv.names[0]}' is NxD's {form.name}, which holds equal "
                                     f"numbers of query and KV heads, but the config has {self.heads} query and "
                                     f"{self.kv_heads} KV heads")
        if not options:
            raise NxdCheckpointError(f"{self.shards[0].path}: {layer}self_attn: NxD's {form.name} cannot split "
                                     f"{self.heads} query and {self.kv_heads} KV heads over {self.tp} TP ranks")
        return options

    def _kv_rows(self, qkv: _QKVKeys, options: Dict[int, int]) -> int:
        """The K (and V) rows per rank, read from TP rank 0's shapes, which must be one of the layouts ``options``
        allows and those of every other rank."""
        first = self.shards[0]
        found = [tuple(first.get(n).shape) for n in qkv.names]
        if qkv.fused:
            kv_rows = (found[0][0] - qkv.q_rows) / 2 if found[0] else 0  # not whole when the rows fit no layout
        else:
            kv_rows = found[1][0] if found[1] else 0
        if kv_rows not in options or found != list(qkv.shapes(int(kv_rows))):
            # Name the key that is wrong: the fused one, else Q, else K if its rows fit no layout, else V.
            if qkv.fused or found[0] != (qkv.q_rows, self.hidden):
                wrong = 0
            else:
                wrong = 1 if found[1] not in {(rows, self.hidden) for rows in options} else 2
            raise self._shape_error(first, qkv.names[wrong], found[wrong], self._describe_layouts(qkv, options))
        kv_rows = int(kv_rows)
        for shard in self.shards[1:]:
            for name, want in zip(qkv.names, qkv.shapes(kv_rows)):
                if tuple(shard.get(name).shape) != want:
                    raise self._shape_error(shard, name, shard.get(name).shape, f"{list(want)}, as on TP rank 0")
        return kv_rows

    def _describe_layouts(self, qkv: _QKVKeys, options: Dict[int, int]) -> str:
        """The shapes the config allows for the layer's keys, for an error message."""
        q_rows = qkv.q_rows
        if not qkv.fused:
            parts = [f"{[q_rows, self.hidden]} for Q and {[rows, self.hidden]} for K and V (kv_size_multiplier "
                     f"{m})" for rows, m in options.items()]
        else:
            parts = [f"{[q_rows + 2 * rows, self.hidden]}: {q_rows} Q rows, then {rows} K and {rows} V rows "
                     f"(kv_size_multiplier {m})" for rows, m in options.items()]
        return (" or ".join(parts) + f"; from {self.heads} query and {self.kv_heads} KV heads of size "
                f"{self.head_dim} over {self.tp} TP ranks")

    def _one_multiplier(self, qkv: _QKVKeys, multiplier: int) -> int:
        """The layer's kv_size_multiplier, which must be that of every earlier layer (NxD uses one per model)."""
        if self.multiplier is not None and multiplier != self.multiplier:
            raise NxdCheckpointError(f"{self.shards[0].path}: '{qkv.names[0]}' holds each KV head {multiplier} "
                                     f"time(s) over the ranks, but earlier layers hold them {self.multiplier} time(s)")
        self.multiplier = multiplier
        return multiplier

    def _one_attention_dtype(self, names: Tuple[str, ...]) -> torch.dtype:
        """The dtype the layer's attention weights share (each on every rank); a layer that mixes dtypes is refused."""
        dtype = one_dtype(self.shards, names[0])
        for name in names[1:]:
            if one_dtype(self.shards, name) != dtype:
                raise NxdCheckpointError(f"'{name}' is {one_dtype(self.shards, name)}, but '{names[0]}' is {dtype}")
        return dtype

    def _check_kv_copies_equal(self, qkv: _QKVKeys, kv_rows: int, kv_copies: List[List[Tuple[int, int]]],
                               multiplier: int) -> None:
        """Every copy of a KV head (kv_size_multiplier > 1) equals the first: the dense model can hold only one."""
        d = self.head_dim
        for part, label in ((1, "K"), (2, "V")):
            key = qkv.names[0 if qkv.fused else part]
            for head, copies in enumerate(kv_copies):
                rank0, slot0 = copies[0]
                reference = qkv.blocks(self.shards[rank0], kv_rows)[part][slot0 * d:(slot0 + 1) * d]
                for rank, slot in copies[1:]:
                    if not torch.equal(qkv.blocks(self.shards[rank], kv_rows)[part][slot * d:(slot + 1) * d],
                                       reference):
                        raise NxdCheckpointError(
                            f"{self.shards[rank].tensor_file(key)}: the {label} weights of KV head {head} in '{key}' "
                            f"differ between TP rank {rank0} and TP rank {rank}. NxD holds kv_size_multiplier="
                            f"{multiplier} copies of each KV head, which must stay equal, and the dense model can "
                            "hold only one: this checkpoint is damaged, or its copies were never equal")

    def _produce_attention(self, layer: str, qkv: _QKVKeys, kv_rows: int, o_key: str,
                           q_sources: List[Optional[Tuple[int, int]]], kv_copies: List[List[Tuple[int, int]]],
                           dtype: torch.dtype) -> None:
        """Say how HF's q_proj, k_proj, v_proj and o_proj are built (when written): each head from the (rank, slot)
        ``head_layout`` gives it, the first copy of each KV head."""
        d = self.head_dim

        def block(rank: int, part: int) -> torch.Tensor:
            return qkv.blocks(self.shards[rank], kv_rows)[part]

        def q() -> torch.Tensor:
            return torch.cat([block(r, 0)[s * d:(s + 1) * d] for r, s in q_sources])

        def kv(part: int) -> torch.Tensor:
            return torch.cat([block(r, part)[s * d:(s + 1) * d] for r, s in (c[0] for c in kv_copies)])

        def o() -> torch.Tensor:
            return torch.cat([self.shards[r].get(o_key)[:, s * d:(s + 1) * d] for r, s in q_sources], dim=1)

        hf = layer + "self_attn."
        self.producers[hf + "q_proj.weight"] = (dtype, q)
        self.producers[hf + "k_proj.weight"] = (dtype, lambda: kv(1))
        self.producers[hf + "v_proj.weight"] = (dtype, lambda: kv(2))
        self.producers[o_key] = (dtype, o)
        self.consumed.update(list(qkv.names) + [o_key])

    # -- the whole model --

    def plan(self, dtype: Optional[torch.dtype]) -> NxdSource:
        self._check_saved_tp()
        if self.heads % self.tp:
            raise NxdCheckpointError(f"the config's {self.heads} query heads cannot be split over {self.tp} TP ranks, "
                                     "so NxD's Llama attention cannot have written this checkpoint")
        present = lambda key: key in self.keys  # noqa: E731
        for key in VOCAB_KEYS:
            if present(key) and key in self.shapes:
                self._vocab(key)
        if present("model.norm.weight"):
            self._replicated("model.norm.weight")
        for index in range(self.config.num_hidden_layers):
            layer = LAYER.format(index)
            self._attention(index)
            self._mlp(layer)
            for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                if present(layer + norm):
                    self._replicated(layer + norm)
        unexpected = sorted(self.keys - self.consumed)
        if unexpected:
            raise NxdCheckpointError(f"{self.shards[0].path}: keys {self.MODEL} of this config does not have: "
                                     f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
        if self.dropped:
            say(self.progress, f"dropping buffers that are not weights: {self.dropped}")
        if self.multiplier and self.multiplier > 1:
            say(self.progress, f"KV heads held {self.multiplier} times (kv_size_multiplier): copies checked equal, "
                               "one kept")
        return self._source(dtype)

    def _mlp(self, layer: str) -> None:
        """The layer's MLP: NxD's gate_up_proj (stride 2) and down_proj."""
        self._gate_up(layer)
        if layer + "mlp.down_proj.weight" in self.keys:
            self._split(layer + "mlp.down_proj.weight", 1)

    def _add(self, source: NxdSource, key: str, name: str, write: bool = True) -> None:
        stored, how = self.producers[name]
        if callable(how):
            source.built(key, self.shapes[key], stored, how, write)
        else:
            source.laid_out(key, self.shapes[key], stored, *how, write=write)

    def _source(self, dtype: Optional[torch.dtype]) -> NxdSource:
        """HF's save_pretrained layout: each tied group once, under its source name; a tied pair held under both
        names must agree, or the HF model would silently use one."""
        source = NxdSource(self.shards, dtype)
        source.add_handles(self.handles)
        for key, shape in self.shapes.items():
            if key in self.tied:
                continue
            aliases = [a for a, s in self.tied.items() if s == key and a in self.producers]
            names = [k for k in [key] + aliases if k in self.producers]
            if not names:
                raise NxdCheckpointError(f"{self.shards[0].path}: '{key}' (shape {list(shape)}) is missing from the "
                                         f"checkpoint's model state dict ({self._nxd_name(key)})")
            self._add(source, key, names[0])
            for alias in names[1:]:
                self._add(source, alias, alias, write=False)
                source.check_tied(alias, key)
        return source

    @staticmethod
    def _nxd_name(key: str) -> str:
        if key.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            return ("NxD stores it in self_attn.qkv_proj.weight_qkv, self_attn.qkv_proj.weight_q/_k/_v, "
                    "self_attn.qkv_proj.weight or self_attn.q_proj/k_proj/v_proj.weight")
        if key.endswith(("gate_proj.weight", "up_proj.weight")):
            return f"NxD stores it in '{key.rsplit('.', 2)[0]}.gate_up_proj.weight'"
        return f"NxD stores it as '{key}'"


def merge_nxd_checkpoint(checkpoint_dir: str, config_json, output_dir: str, force: bool = False,
                         progress: bool = True, model_key: Optional[str] = AUTO, dtype: Optional[torch.dtype] = None,
                         tag: Optional[str] = None, verify_checksums: bool = True) -> str:
    """Merge an NxD Llama (or Mistral) checkpoint into a dense HF directory, checked before anything is written,
    atomically; return ``output_dir`` (arguments: docs/api.md)."""
    config, model_class = load_decoder_config(config_json, _CLASSES, LLAMA_FAMILY, __name__)

    def layout(shards: List[RankShard], files: RankFiles, dtype: Optional[torch.dtype]) -> NxdSource:
        return Planner(config, model_class, shards, files, progress).plan(dtype)

    return import_checkpoint(checkpoint_dir, output_dir, config, model_class.__name__, layout, force=force,
                             progress=progress, model_key=model_key, tag=tag, dtype=dtype,
                             verify_checksums=verify_checksums)

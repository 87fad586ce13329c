"""Section 6: activation memory per rank of a BERT-large layer stack, measured, next to Megatron's formula.

What is measured: an HF ``BertModel`` (no pooler) with BERT-large's layer shape (hidden 1024, 16 heads, intermediate
4096) and a few layers, sequence 512, batch 4, dropout 0.1 (HF's default; the formula counts dropout masks), fp32 and
bf16, one forward in training mode, in each of these configurations:

* dense: the unsharded model, one process;
* TP: ``parallelize_bert(model)`` in a real gloo world of tp processes;
* TP+SP: ``parallelize_bert(model, sequence_parallel=True)``;
* TP+SP+checkpoint: the same, each encoder layer wrapped by ``checkpoint_layers`` (nxdtp.random's ``checkpoint``,
  the way a user recomputes layers).

Per rank:

* **bytes autograd saves**: every tensor ``torch.autograd.graph.saved_tensors_hooks`` packs during the forward,
  counted once per storage (Q, K and V save the same input; a view saves its base's storage), parameters left out.
  A storage belongs to the encoder layer whose module saved it; one saved by several layers (the attention mask a
  checkpointed layer keeps) is *shared* and reported apart. Per layer = the mean over the measured layers.
* **breakdown**: each saved storage is tagged with the module that was running when it was packed (module forward
  hooks) and the autograd nodes that hold it (a walk of the graph from the output, reading each node's saved
  tensors), and mapped to a term of the formula (QKV input, softmax output, GELU input, ...) or to "other".
* **peak RSS increase** during the forward (``VmHWM`` after the forward minus ``VmRSS`` before it, the watermark
  reset first) and the RSS still held after it. The workers run with a fixed glibc mmap threshold, so freed tensors
  go back to the kernel and RSS follows the live tensors.

Next to it, Megatron's formula (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models") per layer, generalised to an activation size of e bytes (1-byte dropout masks): see ``megatron_terms``.
"""

from __future__ import annotations

import gc
import re
from typing import Any, Dict, List, Optional

from .common import WorkerGroup, fmt, fmt_bytes, log, markdown_table, memory_measuring_workers

LAYER = dict(hidden_size=1024, num_attention_heads=16, intermediate_size=4096)  # BERT-large
FULL = dict(layer=LAYER, layers=2, seq=512, batch=4, tps=(2, 4, 8), dtypes=("float32", "bfloat16"))
QUICK = dict(layer=dict(hidden_size=64, num_attention_heads=4, intermediate_size=256), layers=2, seq=64, batch=2,
             tps=(2,), dtypes=("float32", "bfloat16"))
MODES = ("dense", "tp", "tp_sp", "tp_sp_ckpt")
LABELS = {"dense": "dense", "tp": "TP", "tp_sp": "TP+SP", "tp_sp_ckpt": "TP+SP+checkpoint"}
DROPOUT = 0.1
ATTENTION = "sdpa"  # transformers 5's default for BERT; "eager" is measured once (dense) for comparison
VOCAB = 512  # the embeddings are outside the measured layers: keep them small
SEED = 1234
GLOO_TIMEOUT_S = 600
ACTIVATION_BYTES = {"float32": 4, "bfloat16": 2}
MASK_BYTES = 1

# The formula's terms, in the order of Korthikanti et al.'s derivation (section 4.1).
T_INPUT, T_Q, T_K = "Q/K/V linear input (layer input)", "Q (QK^T input)", "K (QK^T input)"
T_SOFTMAX, T_ATT_MASK, T_ATT_DROP, T_V = ("softmax output", "attention dropout mask",
                                          "attention dropout output (input of x V)", "V")
T_PROJ, T_ATT_OUT_MASK, T_LN1 = ("attention output dense input", "attention output dropout mask",
                                 "attention LayerNorm input")
T_MLP_IN, T_GELU, T_MLP2, T_MLP_MASK, T_LN2 = ("intermediate.dense input", "GELU input",
                                               "output.dense input (GELU output)", "MLP output dropout mask",
                                               "output LayerNorm input")
T_CKPT, T_LN_STATS = "layer input kept by checkpoint", "LayerNorm mean and rstd (not in the formula)"
TERM_ORDER = (T_INPUT, T_Q, T_K, T_SOFTMAX, T_ATT_MASK, T_ATT_DROP, T_V, T_PROJ, T_ATT_OUT_MASK, T_LN1, T_MLP_IN,
              T_GELU, T_MLP2, T_MLP_MASK, T_LN2, T_LN_STATS, T_CKPT)


def megatron_terms(activation_bytes: int, tp: int, sequence_parallel: bool, checkpoint: bool,
                   heads_seq_over_hidden: float, mask_bytes: int = MASK_BYTES,
                   attention_bytes: Optional[int] = None) -> Dict[str, float]:
    """Megatron's per-layer activation bytes, term by term, in units of s*b*h (full sequence, batch, hidden).

    Korthikanti et al. count 2-byte activations and 1-byte dropout masks: 34 sbh + 5 a s^2 b per layer. Of the 34,
    16 terms of 2 bytes are activations (QKV input 1, Q and K 2, V 1, output-dense input 1, MLP input 1, GELU input
    4, second MLP linear input 4, two LayerNorm inputs 2) and 2 are 1-byte masks (the two hidden dropouts); of the 5
    a s^2 b, the softmax output and the dropout output are 2-byte activations and the attention dropout mask 1 byte.
    With e-byte activations: sbh(16e + 2) + a s^2 b (2e + 1); e = 4 (fp32): sbh(66 + 9as/h).
    Tensor parallelism divides Q, K, V, the output-dense input, the GELU and second-linear inputs and the attention
    terms by t (sbh(4e + 2 + 12e/t) + a s^2 b (2e + 1)/t; e = 2: sbh(10 + 24/t + 5as/(ht))); sequence parallelism
    divides the rest too. Full recomputation keeps only the layer input: e sbh, / t with sequence parallelism.

    ``mask_bytes`` and ``attention_bytes`` (Q, K, V, the softmax and dropout outputs and the attention dropout mask;
    default: as the other activations) describe kernels that store other sizes than the paper assumes (see
    ``cpu_kernel_terms``).
    """
    e, t, r = activation_bytes, tp, heads_seq_over_hidden
    m, a = mask_bytes, activation_bytes if attention_bytes is None else attention_bytes
    attention_mask = m if attention_bytes is None else a
    if checkpoint:
        return {T_CKPT: e / (t if sequence_parallel else 1)}
    rest = t if sequence_parallel else 1  # what TP alone leaves replicated
    return {T_INPUT: e / rest, T_Q: a / t, T_K: a / t, T_SOFTMAX: a * r / t, T_ATT_MASK: attention_mask * r / t,
            T_ATT_DROP: a * r / t, T_V: a / t, T_PROJ: e / t, T_ATT_OUT_MASK: m / rest, T_LN1: e / rest,
            T_MLP_IN: e / rest, T_GELU: 4 * e / t, T_MLP2: 4 * e / t, T_MLP_MASK: m / rest, T_LN2: e / rest}


def megatron_closed_form(tp: int, mode: str, heads_seq_over_hidden: float) -> float:
    """The paper's own expressions (2-byte activations), in units of sbh: a check of ``megatron_terms``."""
    r, t = heads_seq_over_hidden, tp
    return {"dense": 34 + 5 * r, "tp": 10 + 24 / t + 5 * r / t, "tp_sp": 34 / t + 5 * r / t,
            "tp_sp_ckpt": 2 / t}[mode]


def formula_terms(mode: str, tp: int, dtype: str, shape: Dict[str, int]) -> Dict[str, float]:
    r = shape["num_attention_heads"] * shape["seq"] / shape["hidden_size"]
    return megatron_terms(ACTIVATION_BYTES[dtype], 1 if mode == "dense" else tp, mode.startswith("tp_sp"),
                          mode == "tp_sp_ckpt", r)


def cpu_kernel_terms(mode: str, tp: int, dtype: str, attention: str, shape: Dict[str, int]) -> Dict[str, float]:
    """The formula with the sizes PyTorch's CPU kernels store (torch 2.9), so that what remains between it and the
    measurement is the library's own:

    * dropout on CPU is ``input * mask`` with a mask of the input's dtype (the fused ``native_dropout``, whose mask is
      1-byte bool as the paper assumes, runs on CUDA only): masks take e bytes;
    * ``scaled_dot_product_attention`` with dropout in training has no fused CPU kernel and runs its math fallback,
      which computes bf16/fp16 inputs in fp32 (unless
      ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)``): with sdpa, Q, K, V, the softmax and dropout
      outputs and the attention dropout mask take 4 bytes.
    """
    e = ACTIVATION_BYTES[dtype]
    r = shape["num_attention_heads"] * shape["seq"] / shape["hidden_size"]
    return megatron_terms(e, 1 if mode == "dense" else tp, mode.startswith("tp_sp"), mode == "tp_sp_ckpt", r,
                          mask_bytes=e, attention_bytes=4 if attention == "sdpa" else e)


# ---- what a saved tensor is ----------------------------------------------------------------------------------------

_LAYER_PATH = re.compile(r"(?:^|\.)layer\.(\d+)(?:\.(.*))?$")


def classify(relative_module: str, holders: List[str], shape: tuple, seq: int, hidden: int) -> str:
    """The formula term a tensor saved inside an HF BERT layer stands for. ``relative_module`` is the path of the
    module that packed it, below ``encoder.layer.N`` ('' for the layer itself); ``holders`` are 'Node.attribute'
    names of the autograd nodes holding it."""
    joined = " ".join(holders)
    last = shape[-1] if shape else None
    if "Checkpoint" in joined:
        return T_CKPT
    if relative_module in ("attention.self.query", "attention.self.key", "attention.self.value"):
        return T_INPUT
    if relative_module == "attention.self":
        if "Softmax" in joined:
            return T_SOFTMAX
        if "NativeDropout" in joined or "MulBackward0.other" in joined:
            return T_ATT_MASK
        for attribute, term in ((".query", T_Q), (".key", T_K), (".value", T_V)):  # fused SDPA kernels
            if any(h.endswith(attribute) for h in holders):
                return term
        if "BmmBackward0.self" in joined:
            return T_ATT_DROP if last == seq else T_Q
        if "BmmBackward0.mat2" in joined:
            return T_K if last == seq else T_V
        if last == hidden:  # kept by the attention block's entry (a region saving the sequence shard for Q/K/V)
            return T_INPUT
    if relative_module.endswith("LayerNorm"):
        if any(h.endswith(".input") for h in holders):
            return T_LN1 if relative_module.startswith("attention") else T_LN2
        return T_LN_STATS
    simple = {"attention.output.dense": T_PROJ, "attention.output.dropout": T_ATT_OUT_MASK,
              "intermediate.dense": T_MLP_IN, "intermediate.intermediate_act_fn": T_GELU, "output.dense": T_MLP2,
              "output.dropout": T_MLP_MASK}
    if relative_module in simple:
        return simple[relative_module]
    return f"other: {relative_module or '(layer)'} {holders[0] if holders else '?'}"


# ======================================================================================================================
# Worker side
# ======================================================================================================================

def _saved_tensor_holders(root) -> Dict[int, List[str]]:
    """Storage address -> 'Node.attribute' of every autograd node reachable from ``root`` that saved it."""
    import torch

    holders: Dict[int, List[str]] = {}

    def note(tensor, label):
        if isinstance(tensor, torch.Tensor):
            holders.setdefault(tensor.untyped_storage().data_ptr(), []).append(label)

    seen, todo = set(), [root]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = node.name()
        for attribute in dir(node):
            if attribute.startswith("_saved_"):
                try:
                    value = getattr(node, attribute)
                except RuntimeError:  # freed, or not a tensor attribute in this build
                    continue
                for v in value if isinstance(value, (tuple, list)) else (value,):
                    note(v, f"{name}.{attribute[len('_saved_'):]}")
        if hasattr(node, "saved_tensors"):  # custom autograd.Function nodes (nxdtp's regions, checkpoint)
            try:
                for v in node.saved_tensors:
                    note(v, f"{name}.saved_tensors")
            except RuntimeError:
                pass
        todo.extend(next_node for next_node, _ in node.next_functions)
    return holders


class _SavedTensorRecorder:
    """Records each storage autograd saves during a forward, with the module running when it was saved."""

    def __init__(self, model):
        import torch

        self.model = model
        self.parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.stack = ["(outside any module)"]
        self.storages: Dict[int, Dict[str, Any]] = {}
        self._handles = []
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._enter(name)))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _enter(self, name):
        def hook(module, args):
            self.stack.append(name)
        return hook

    def _leave(self, module, args, output):
        self.stack.pop()

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        entry = self.storages.setdefault(key, {"bytes": storage.nbytes(), "dtype": str(tensor.dtype).replace(
            "torch.", ""), "shape": tuple(tensor.shape), "modules": [], "parameter": key in self.parameter_storages})
        if self.stack[-1] not in entry["modules"]:
            entry["modules"].append(self.stack[-1])
        return tensor

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()


def _build(spec: Dict[str, Any], mode: str, dtype: str, attention: str):
    import torch
    from transformers import BertConfig, BertModel

    from nxdtp.models.bert import checkpoint_layers, parallelize_bert

    config = BertConfig(**spec["layer"], num_hidden_layers=spec["layers"], vocab_size=VOCAB,
                        max_position_embeddings=spec["seq"], type_vocab_size=2, hidden_dropout_prob=DROPOUT,
                        attention_probs_dropout_prob=DROPOUT, attn_implementation=attention)
    torch.manual_seed(SEED)
    model = BertModel(config, add_pooling_layer=False)
    if mode != "dense":
        parallelize_bert(model, sequence_parallel=mode.startswith("tp_sp"))
    if mode == "tp_sp_ckpt":
        checkpoint_layers(model)
    return model.to(getattr(torch, dtype)).train()


def _batch(spec: Dict[str, Any]):
    import torch

    generator = torch.Generator().manual_seed(SEED + 1)
    input_ids = torch.randint(0, VOCAB, (spec["batch"], spec["seq"]), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, -spec["seq"] // 8:] = 0  # a padded sequence, as real batches have
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def h_measure(state, spec: Dict[str, Any], mode: str, dtype: str, attention: str = ATTENTION) -> Optional[dict]:
    """One forward of the layer stack in ``mode``; what autograd saved and how RSS moved on this rank."""
    if mode == "dense" and state["rank"] != 0:
        return None
    from .rss import proc_status_kib, reset_peak_rss

    model = _build(spec, mode, dtype, attention)
    batch = _batch(spec)
    model(**batch)  # warm-up: lazily built state (masks, communication buffers) is not counted below
    gc.collect()
    before = proc_status_kib()
    peak_reset = reset_peak_rss()
    with _SavedTensorRecorder(model) as recorder:
        output = model(**batch).last_hidden_state
    after = proc_status_kib()
    holders = _saved_tensor_holders(output.grad_fn)

    layers = spec["layers"]
    per_layer = [0] * layers
    terms: Dict[str, float] = {}
    shared = outside = parameters = 0
    detail = []  # the last layer's tensors, one row per storage
    for key, entry in recorder.storages.items():
        if entry["parameter"]:
            parameters += entry["bytes"]
            continue
        found = [(int(m.group(1)), m.group(2) or "") for m in map(_LAYER_PATH.search, entry["modules"]) if m]
        indices = {index for index, _ in found}
        if len(indices) > 1:
            shared += entry["bytes"]
            continue
        if not indices:
            outside += entry["bytes"]
            continue
        index, relative = found[0]
        per_layer[index] += entry["bytes"]
        term = classify(relative, holders.get(key, []), entry["shape"], spec["seq"], spec["layer"]["hidden_size"])
        terms[term] = terms.get(term, 0) + entry["bytes"] / layers
        if index == layers - 1:
            detail.append({"module": relative, "holders": sorted(set(holders.get(key, []))), "dtype": entry["dtype"],
                           "shape": list(entry["shape"]), "bytes": entry["bytes"], "term": term})
    result = {
        "rank": state["rank"], "saved_bytes_per_layer": per_layer, "saved_bytes_shared_by_layers": shared,
        "saved_bytes_outside_layers": outside, "parameter_bytes_referenced": parameters,
        "terms_bytes_per_layer": terms, "last_layer_detail": sorted(detail, key=lambda d: -d["bytes"]),
        "rss_before_kib": before["VmRSS"], "rss_after_kib": after["VmRSS"],
        "peak_rss_increase_kib": (after["VmHWM"] - before["VmRSS"]) if peak_reset else None,
        "rss_held_after_forward_kib": after["VmRSS"] - before["VmRSS"],
    }
    del output, model, recorder
    gc.collect()
    return result


def worker_main(conn, name: str, rank: int, world: int, port: int) -> None:
    from .common import serve_in_gloo_world

    def seed():
        from nxdtp.random import model_parallel_xla_manual_seed

        model_parallel_xla_manual_seed(SEED)  # dropout inside TP regions draws from the tracker's per-rank state

    serve_in_gloo_world(conn, {"measure": h_measure}, rank, world, port, world, GLOO_TIMEOUT_S, before_serving=seed)


# ======================================================================================================================
# Driver side
# ======================================================================================================================

def _start_world(tp: int) -> WorkerGroup:
    return memory_measuring_workers(f"activation memory tp={tp}", worker_main, tp)


def _summarise_ranks(per_rank: List[dict], spec: Dict[str, Any], mode: str, tp: int, dtype: str,
                     attention: str) -> Dict[str, Any]:
    ranks = [r for r in per_rank if r is not None]
    layers = spec["layers"]
    shape = dict(spec["layer"], seq=spec["seq"], batch=spec["batch"])
    sbh = spec["seq"] * spec["batch"] * spec["layer"]["hidden_size"]
    per_layer = [max(r["saved_bytes_per_layer"][i] for r in ranks) for i in range(layers)]
    measured = sum(per_layer) / layers
    formula = formula_terms(mode, tp, dtype, shape)
    formula_bytes = sum(formula.values()) * sbh
    kernel_formula = cpu_kernel_terms(mode, tp, dtype, attention, shape)
    kernel_bytes = sum(kernel_formula.values()) * sbh
    present = {t for r in ranks for t in r["terms_bytes_per_layer"]} | set(formula)
    terms = [t for t in TERM_ORDER if t in present] + sorted(present - set(TERM_ORDER))
    peaks = [r["peak_rss_increase_kib"] for r in ranks]
    return {
        "mode": mode, "tp": 1 if mode == "dense" else tp, "dtype": dtype, "attention": attention,
        "layers_measured": layers, "ranks_measured": len(ranks),
        "saved_bytes_per_layer": measured, "saved_bytes_per_layer_by_layer": per_layer,
        "saved_bytes_per_layer_ranks_equal": len({tuple(r["saved_bytes_per_layer"]) for r in ranks}) == 1,
        "saved_sbh_per_layer": measured / sbh,
        "formula_bytes_per_layer": formula_bytes, "formula_sbh_per_layer": formula_bytes / sbh,
        "measured_over_formula": measured / formula_bytes,
        "cpu_kernel_formula_bytes_per_layer": kernel_bytes, "cpu_kernel_formula_sbh_per_layer": kernel_bytes / sbh,
        "measured_over_cpu_kernel_formula": measured / kernel_bytes,
        "saved_bytes_shared_by_layers": max(r["saved_bytes_shared_by_layers"] for r in ranks),
        "saved_bytes_outside_layers": max(r["saved_bytes_outside_layers"] for r in ranks),
        "terms_sbh_per_layer": {t: {"measured": max(r["terms_bytes_per_layer"].get(t, 0) for r in ranks) / sbh,
                                    "formula": formula.get(t, 0.0), "cpu_kernel_formula": kernel_formula.get(t, 0.0)}
                                for t in terms},
        "peak_rss_increase_bytes_max_rank": None if None in peaks else max(peaks) * 1024,
        "rss_held_after_forward_bytes_max_rank": max(r["rss_held_after_forward_kib"] for r in ranks) * 1024,
        "last_layer_detail_rank0": ranks[0]["last_layer_detail"],
    }


def run(quick: bool) -> Dict[str, Any]:
    spec = QUICK if quick else FULL
    rows: List[Dict[str, Any]] = []
    for tp in spec["tps"]:
        log(f"activation memory: starting a gloo world of {tp}")
        group = _start_world(tp)
        try:
            if tp == spec["tps"][0]:  # dense runs on rank 0 of the first world, the other ranks idle
                for dtype in spec["dtypes"]:
                    for attention in (ATTENTION, "eager"):
                        log(f"activation memory: dense {dtype} {attention}")
                        rows.append(_summarise_ranks(group.call("measure", spec=spec, mode="dense", dtype=dtype,
                                                                attention=attention),
                                                     spec, "dense", tp, dtype, attention))
            for dtype in spec["dtypes"]:
                for mode in MODES[1:]:
                    log(f"activation memory: tp={tp} {LABELS[mode]} {dtype}")
                    rows.append(_summarise_ranks(group.call("measure", spec=spec, mode=mode, dtype=dtype),
                                                 spec, mode, tp, dtype, ATTENTION))
        finally:
            group.close()
    return _result(spec, rows)


def _find(rows, mode, dtype, tp=None, attention=ATTENTION):
    for row in rows:
        if row["mode"] == mode and row["dtype"] == dtype and row["attention"] == attention and \
                (tp is None or row["tp"] == tp):
            return row
    raise KeyError((mode, dtype, tp, attention))


def _result(spec: Dict[str, Any], rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    ratios, numbers = [], {}
    for dtype in spec["dtypes"]:
        dense = _find(rows, "dense", dtype)
        numbers[f"{dtype}_dense_saved_bytes_per_layer"] = dense["saved_bytes_per_layer"]
        numbers[f"{dtype}_dense_measured_over_formula"] = dense["measured_over_formula"]
        for tp in spec["tps"]:
            tp_row, sp, ckpt = (_find(rows, m, dtype, tp) for m in ("tp", "tp_sp", "tp_sp_ckpt"))
            entry = {"dtype": dtype, "tp": tp,
                     "tp_over_dense": tp_row["saved_bytes_per_layer"] / dense["saved_bytes_per_layer"],
                     "tp_over_dense_formula": tp_row["formula_bytes_per_layer"] / dense["formula_bytes_per_layer"],
                     "sp_over_tp": sp["saved_bytes_per_layer"] / tp_row["saved_bytes_per_layer"],
                     "sp_over_tp_formula": sp["formula_bytes_per_layer"] / tp_row["formula_bytes_per_layer"],
                     "ckpt_over_sp": ckpt["saved_bytes_per_layer"] / sp["saved_bytes_per_layer"],
                     "ckpt_over_sp_formula": ckpt["formula_bytes_per_layer"] / sp["formula_bytes_per_layer"]}
            for name, (a, b) in {"tp_over_dense": (tp_row, dense), "sp_over_tp": (sp, tp_row),
                                 "ckpt_over_sp": (ckpt, sp)}.items():
                entry[f"{name}_cpu_kernel_formula"] = (a["cpu_kernel_formula_bytes_per_layer"]
                                                       / b["cpu_kernel_formula_bytes_per_layer"])
            ratios.append(entry)
            for key in ("tp_over_dense", "tp_over_dense_formula", "tp_over_dense_cpu_kernel_formula", "sp_over_tp",
                        "sp_over_tp_formula", "sp_over_tp_cpu_kernel_formula", "ckpt_over_sp",
                        "ckpt_over_sp_formula"):
                numbers[f"{dtype}_tp{tp}_{key}"] = entry[key]
            for row in (tp_row, sp, ckpt):
                prefix = f"{dtype}_tp{tp}_{row['mode']}"
                numbers[f"{prefix}_saved_bytes_per_layer"] = row["saved_bytes_per_layer"]
                numbers[f"{prefix}_measured_over_formula"] = row["measured_over_formula"]
                numbers[f"{prefix}_measured_over_cpu_kernel_formula"] = row["measured_over_cpu_kernel_formula"]
                if row["peak_rss_increase_bytes_max_rank"] is not None:
                    numbers[f"{prefix}_peak_rss_increase_bytes"] = row["peak_rss_increase_bytes_max_rank"]
    return {"spec": {k: (list(v) if isinstance(v, tuple) else v) for k, v in spec.items()},
            "attention": ATTENTION, "dropout": DROPOUT, "rows": rows, "ratios": ratios, "numbers": numbers}


# ---- report -------------------------------------------------------------------------------------------------------

def _pct(value: float) -> str:
    return f"{value * 100:+.1f} %"


def tables(result: Dict[str, Any]) -> str:
    spec, rows = result["spec"], result["rows"]
    layer = spec["layer"]
    sbh = spec["seq"] * spec["batch"] * layer["hidden_size"]
    r = layer["num_attention_heads"] * spec["seq"] / layer["hidden_size"]
    lines = [f"HF BertModel layers (hidden {layer['hidden_size']}, {layer['num_attention_heads']} heads, intermediate "
             f"{layer['intermediate_size']}), {spec['layers']} layers measured, sequence {spec['seq']}, batch "
             f"{spec['batch']}, dropout {result['dropout']}, attention {result['attention']}; one forward in training "
             f"mode per configuration, real gloo worlds of tp processes. Saved = bytes autograd's saved-tensor hooks "
             f"see, each storage once, parameters excluded, per layer (mean over the layers) and per rank (the "
             f"largest rank). Units: s*b*h = {sbh:,} elements; as/h = {fmt(r, 1)}. Formula: Korthikanti et al. "
             f"2022, e-byte activations, 1-byte masks: dense sbh(16e+2) + as^2b(2e+1); TP sbh(4e+2+12e/t) + "
             f"as^2b(2e+1)/t; TP+SP everything / t; full recomputation e*sbh (/t with SP); e=2 gives the paper's "
             f"34 + 5as/h. CPU-kernel formula: the same terms at the sizes PyTorch's CPU kernels store (dropout masks "
             f"in the activation dtype; sdpa's math fallback in fp32).", ""]
    for dtype in spec["dtypes"]:
        body = []
        for row in rows:
            if row["dtype"] != dtype:
                continue
            label = LABELS[row["mode"]] + (f" ({row['attention']})" if row["attention"] != ATTENTION else "")
            by_layer = row["saved_bytes_per_layer_by_layer"]
            saved = fmt_bytes(row["saved_bytes_per_layer"]) + (
                "" if len(set(by_layer)) == 1 else f" (by layer: {', '.join(fmt_bytes(b) for b in by_layer)})")
            body.append([label, row["tp"], saved, fmt(row["saved_sbh_per_layer"], 2),
                         fmt(row["formula_sbh_per_layer"], 2), fmt(row["measured_over_formula"], 3),
                         fmt(row["cpu_kernel_formula_sbh_per_layer"], 2),
                         fmt(row["measured_over_cpu_kernel_formula"], 3),
                         fmt_bytes(row["saved_bytes_shared_by_layers"]),
                         fmt_bytes(row["peak_rss_increase_bytes_max_rank"]),
                         fmt_bytes(row["rss_held_after_forward_bytes_max_rank"])])
        lines += [f"**{dtype}**", "", markdown_table(
            ["configuration", "tp", "saved / layer / rank", "saved, sbh", "formula, sbh", "measured / formula",
             "CPU-kernel formula, sbh", "measured / CPU-kernel formula", "saved once for all layers",
             f"peak RSS increase in the forward ({spec['layers']} layers + embeddings)", "RSS held after the forward"],
            body), ""]
    ratio_rows = [[x["dtype"], x["tp"], fmt(x["tp_over_dense"], 3), fmt(x["tp_over_dense_formula"], 3),
                   _pct(x["tp_over_dense"] / x["tp_over_dense_formula"] - 1),
                   fmt(x["tp_over_dense_cpu_kernel_formula"], 3), fmt(x["sp_over_tp"], 3),
                   fmt(x["sp_over_tp_formula"], 3), _pct(x["sp_over_tp"] / x["sp_over_tp_formula"] - 1),
                   fmt(x["sp_over_tp_cpu_kernel_formula"], 3), fmt(x["ckpt_over_sp"], 4),
                   fmt(x["ckpt_over_sp_formula"], 4)] for x in result["ratios"]]
    lines += ["Ratios of saved bytes per layer per rank, measured next to the formula's (gap = measured / formula - 1) "
              "and the CPU-kernel formula's:", "", markdown_table(
                  ["dtype", "tp", "TP / dense", "formula", "gap", "CPU-kernel formula", "TP+SP / TP", "formula", "gap",
                   "CPU-kernel formula", "TP+SP+checkpoint / TP+SP", "formula"], ratio_rows), ""]
    tp = max(spec["tps"])
    for dtype in spec["dtypes"]:
        chosen = [_find(rows, "dense", dtype)] + [_find(rows, m, dtype, tp) for m in MODES[1:]]
        terms = []
        for row in chosen:
            terms += [t for t in row["terms_sbh_per_layer"] if t not in terms]

        def cell(row, term):
            values = row["terms_sbh_per_layer"].get(term, {})
            return " / ".join(fmt(values.get(k, 0), 3) for k in ("measured", "formula", "cpu_kernel_formula"))

        body = [[term] + [cell(row, term) for row in chosen] for term in terms]
        body.append(["total"] + [f"{fmt(row['saved_sbh_per_layer'], 3)} / {fmt(row['formula_sbh_per_layer'], 3)} / "
                                 f"{fmt(row['cpu_kernel_formula_sbh_per_layer'], 3)}" for row in chosen])
        lines += [f"Breakdown, {dtype}, tp={tp}, per layer per rank in sbh units: measured / formula / CPU-kernel "
                  "formula, per term (the module that saved a tensor and the autograd node holding it decide its "
                  "term):", "", markdown_table(["term"] + [LABELS[row["mode"]] for row in chosen], body), ""]
    return "\n".join(lines).rstrip()

"""Section 6: the bytes autograd saves per BERT-large layer per rank, each storage once, by a term of Megatron's formula
(Korthikanti et al. 2022), and the forward's peak RSS (docs/performance.md, section 6)."""

from __future__ import annotations

import contextlib
import gc
import re
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from transformers import BertConfig, BertModel

from nxdtp.models.bert import checkpoint_layers, parallelize_bert
from nxdtp.random import model_parallel_xla_manual_seed

from .common import SEED, Pool, log, rss_mark, section, table

FULL = dict(layer=dict(hidden_size=1024, num_attention_heads=16, intermediate_size=4096), layers=2, seq=512,
            batch=4, tps=(2, 4, 8), dtypes=("float32", "bfloat16"))
QUICK = dict(FULL, layer=dict(hidden_size=64, num_attention_heads=4, intermediate_size=256), seq=64, batch=2, tps=(2,))
MODES = ("dense", "tp", "tp_sp", "tp_sp_ckpt")
LABELS = {"dense": "dense", "tp": "TP", "tp_sp": "TP+SP", "tp_sp_ckpt": "TP+SP+checkpoint"}
DROPOUT = 0.1
ATTENTION = "sdpa"  # transformers 5's default for BERT; "eager" is measured once (dense) for comparison
VOCAB = 512  # the embeddings are outside the measured layers: keep them small
ACTIVATION_BYTES = {"float32": 4, "bfloat16": 2}
MASK_BYTES = 1

# The formula's terms, in the order of Korthikanti et al.'s derivation (section 4.1), then the two outside it.
TERM_ORDER = (T_INPUT, T_Q, T_K, T_SOFTMAX, T_ATT_MASK, T_ATT_DROP, T_V, T_PROJ, T_ATT_OUT_MASK, T_LN1, T_MLP_IN,
              T_GELU, T_MLP2, T_MLP_MASK, T_LN2, T_LN_STATS, T_CKPT) = (
    "Q/K/V linear input (layer input)", "Q (QK^T input)", "K (QK^T input)", "softmax output", "attention dropout mask",
    "attention dropout output (input of x V)", "V", "attention output dense input", "attention output dropout mask",
    "attention LayerNorm input", "intermediate.dense input", "GELU input", "output.dense input (GELU output)",
    "MLP output dropout mask", "output LayerNorm input", "LayerNorm mean and rstd (not in the formula)",
    "layer input kept by checkpoint")


def megatron_terms(activation_bytes: int, tp: int, sequence_parallel: bool, checkpoint: bool,
                   heads_seq_over_hidden: float, mask_bytes: int = MASK_BYTES,
                   attention_bytes: Optional[int] = None) -> Dict[str, float]:
    """Megatron's per-layer activation bytes by term, in units of sbh, generalised to e-byte activations: sbh(16e + 2)
    + as^2b(2e + 1). ``mask_bytes`` and ``attention_bytes`` describe kernels that store other sizes."""
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


def formula_terms(mode: str, tp: int, dtype: str, shape: Dict[str, int], attention: Optional[str] = None):
    """Megatron's terms of ``mode``; given ``attention``, at the sizes PyTorch's CPU kernels store (torch 2.9), so what
    remains is the library's own: CPU dropout keeps an e-byte mask, sdpa with dropout computes bf16 in fp32."""
    e, r = ACTIVATION_BYTES[dtype], shape["num_attention_heads"] * shape["seq"] / shape["hidden_size"]
    kernel = {} if attention is None else dict(mask_bytes=e, attention_bytes=4 if attention == "sdpa" else e)
    return megatron_terms(e, 1 if mode == "dense" else tp, mode.startswith("tp_sp"), mode == "tp_sp_ckpt", r, **kernel)


# ---- what a saved tensor is ----------------------------------------------------------------------------------------

_LAYER_PATH = re.compile(r"(?:^|\.)layer\.(\d+)(?:\.(.*))?$")


def classify(relative_module: str, holders: List[str], shape: tuple, seq: int, hidden: int) -> str:
    """The term a tensor saved inside an HF BERT layer stands for, by the module below ``encoder.layer.N`` that packed
    it ('' for the layer) and the 'Node.attribute' names of the autograd nodes holding it."""
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


def _saved_tensor_holders(root) -> Dict[int, List[str]]:
    """Storage address -> 'Node.attribute' of every autograd node reachable from ``root`` that saved it."""
    holders: Dict[int, List[str]] = {}
    seen, todo = set(), [root]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        custom = ["saved_tensors"] if hasattr(node, "saved_tensors") else []  # autograd.Function nodes, checkpoint
        for attribute in [a for a in dir(node) if a.startswith("_saved_")] + custom:
            try:
                value = getattr(node, attribute)
            except RuntimeError:  # freed, or not a tensor attribute in this build
                continue
            for v in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(v, torch.Tensor):
                    label = f"{node.name()}.{attribute.removeprefix('_saved_')}"
                    holders.setdefault(v.untyped_storage().data_ptr(), []).append(label)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return holders


@contextlib.contextmanager
def _recording(model):
    """Yields {storage address: its bytes, shape and the modules running when autograd saved it} for the forward
    run within."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack, storages = ["(outside any module)"], {}

    def pack(tensor):
        key = tensor.untyped_storage().data_ptr()
        entry = storages.setdefault(key, {"bytes": tensor.untyped_storage().nbytes(), "shape": tuple(tensor.shape),
                                          "modules": [], "parameter": key in parameters})
        entry["modules"] += [] if stack[-1] in entry["modules"] else [stack[-1]]
        return tensor

    def leave(module, args, output) -> None:  # a forward hook's result would replace the output
        stack.pop()

    handles = [h for name, m in model.named_modules() for h in (
        m.register_forward_pre_hook(lambda module, args, name=name: stack.append(name)),
        m.register_forward_hook(leave, always_call=True))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield storages
    finally:
        for handle in handles:
            handle.remove()


def _build(spec: Dict[str, Any], mode: str, dtype: str, attention: str):
    """The layer stack in ``mode``, and a seeded batch with one padded sequence, as real batches have."""
    config = BertConfig(**spec["layer"], num_hidden_layers=spec["layers"], vocab_size=VOCAB,
                        max_position_embeddings=spec["seq"], type_vocab_size=2, hidden_dropout_prob=DROPOUT,
                        attention_probs_dropout_prob=DROPOUT, attn_implementation=attention)
    torch.manual_seed(SEED)
    model = BertModel(config, add_pooling_layer=False)
    if mode != "dense":
        parallelize_bert(model, sequence_parallel=mode.startswith("tp_sp"))
    if mode == "tp_sp_ckpt":
        checkpoint_layers(model)
    input_ids = torch.randint(0, VOCAB, (spec["batch"], spec["seq"]), generator=torch.Generator().manual_seed(SEED + 1))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, -spec["seq"] // 8:] = 0
    return model.to(getattr(torch, dtype)).train(), {"input_ids": input_ids, "attention_mask": attention_mask}


def _attribute(storages, holders, spec) -> Dict[str, Any]:
    """Each saved storage to its encoder layer (or shared by several, or outside them) and to a formula term."""
    layers = spec["layers"]
    out: Dict[str, Any] = {"saved_bytes_per_layer": [0] * layers, "terms_bytes_per_layer": {},
                           "saved_bytes_shared_by_layers": 0, "saved_bytes_outside_layers": 0,
                           "parameter_bytes_referenced": 0}
    for key, entry in storages.items():
        found = [(int(m.group(1)), m.group(2) or "") for m in map(_LAYER_PATH.search, entry["modules"]) if m]
        where = ("parameter_bytes_referenced" if entry["parameter"] else "saved_bytes_outside_layers" if not found
                 else "saved_bytes_shared_by_layers" if len({i for i, _ in found}) > 1 else None)
        if where:
            out[where] += entry["bytes"]
            continue
        index, relative = found[0]
        out["saved_bytes_per_layer"][index] += entry["bytes"]
        term = classify(relative, holders.get(key, []), entry["shape"], spec["seq"], spec["layer"]["hidden_size"])
        out["terms_bytes_per_layer"][term] = out["terms_bytes_per_layer"].get(term, 0) + entry["bytes"] / layers
    return out


def case_measure(spec: Dict[str, Any], mode: str, dtype: str, attention: str = ATTENTION) -> Optional[dict]:
    """One forward of the layer stack in ``mode`` on this rank: what autograd saved and how RSS moved."""
    if mode == "dense" and dist.get_rank() != 0:
        return None
    model_parallel_xla_manual_seed(SEED)  # dropout inside TP regions draws from the tracker's per-rank state
    model, batch = _build(spec, mode, dtype, attention)
    model(**batch)  # warm-up: lazily built state (masks, communication buffers) is not counted below
    mark = rss_mark()
    with _recording(model) as storages:
        output = model(**batch).last_hidden_state
    rss = mark()
    result = _attribute(storages, _saved_tensor_holders(output.grad_fn), spec)
    result.update(peak_rss_increase_kib=rss["peak"], rss_held_after_forward_kib=rss["held"])
    del output, model, storages
    gc.collect()
    return result


def _summarise_ranks(per_rank: List[dict], spec: Dict[str, Any], mode: str, tp: int, dtype: str,
                     attention: str) -> Dict[str, Any]:
    ranks = [r for r in per_rank if r is not None]
    shape = dict(spec["layer"], seq=spec["seq"], batch=spec["batch"])
    sbh = spec["seq"] * spec["batch"] * spec["layer"]["hidden_size"]
    by_layer = [max(r["saved_bytes_per_layer"][i] for r in ranks) for i in range(spec["layers"])]
    measured = sum(by_layer) / spec["layers"]
    formula, kernel = formula_terms(mode, tp, dtype, shape), formula_terms(mode, tp, dtype, shape, attention)
    present = {t for r in ranks for t in r["terms_bytes_per_layer"]} | set(formula)
    terms = [t for t in TERM_ORDER if t in present] + sorted(present - set(TERM_ORDER))
    peaks = [r["peak_rss_increase_kib"] for r in ranks]
    row = {"mode": mode, "tp": 1 if mode == "dense" else tp, "dtype": dtype, "attention": attention,
           "ranks_measured": len(ranks), "saved_bytes_per_layer": measured, "saved_bytes_per_layer_by_layer": by_layer,
           "saved_bytes_per_layer_ranks_equal": len({tuple(r["saved_bytes_per_layer"]) for r in ranks}) == 1,
           "saved_sbh_per_layer": measured / sbh,
           "terms_sbh_per_layer": {t: {"measured": max(r["terms_bytes_per_layer"].get(t, 0) for r in ranks) / sbh,
                                       "formula": formula.get(t, 0.0), "cpu_kernel_formula": kernel.get(t, 0.0)}
                                   for t in terms},
           "saved_bytes_shared_by_layers": max(r["saved_bytes_shared_by_layers"] for r in ranks),
           "peak_rss_increase_bytes_max_rank": None if None in peaks else max(peaks) * 1024,
           "rss_held_after_forward_bytes_max_rank": max(r["rss_held_after_forward_kib"] for r in ranks) * 1024}
    for name, terms_ in (("formula", formula), ("cpu_kernel_formula", kernel)):
        row[f"{name}_bytes_per_layer"] = sum(terms_.values()) * sbh
        row[f"{name}_sbh_per_layer"] = sum(terms_.values())
        row[f"measured_over_{name}"] = measured / row[f"{name}_bytes_per_layer"]
    return row


def _chain(rows: List[dict], dtype: str, tp: int) -> List[dict]:
    """The rows of ``dtype`` of each mode in turn: dense (of the default attention), then each TP mode at ``tp``."""
    return [next(r for r in rows if (r["mode"], r["dtype"], r["attention"], r["tp"]) == (
        mode, dtype, ATTENTION, 1 if mode == "dense" else tp)) for mode in MODES]


def run(ctx) -> Dict[str, Any]:
    spec = QUICK if ctx.quick else FULL
    rows = []
    for tp in spec["tps"]:
        log(f"activation memory: starting a gloo world of {tp}")
        first = [("dense", d, a) for d in spec["dtypes"] for a in (ATTENTION, "eager")] if tp == spec["tps"][0] else []
        with Pool(tp, tp=tp, malloc=True) as pool:  # dense runs on rank 0, the other ranks idle
            for mode, dtype, attention in first + [(m, d, ATTENTION) for d in spec["dtypes"] for m in MODES[1:]]:
                log(f"activation memory: tp={tp} {LABELS[mode]} {dtype} {attention}")
                per_rank = pool.call(case_measure, spec=spec, mode=mode, dtype=dtype, attention=attention)
                rows.append(_summarise_ranks(per_rank, spec, mode, tp, dtype, attention))
    # Each mode over the one before it: measured / formula / CPU-kernel formula.
    ratios = [{"dtype": dtype, "tp": tp, **{name: [a[k] / b[k] for k in (
        "saved_bytes_per_layer", "formula_bytes_per_layer", "cpu_kernel_formula_bytes_per_layer")]
        for name, b, a in zip(("tp_over_dense", "sp_over_tp", "ckpt_over_sp"), chain, chain[1:])}}
        for dtype in spec["dtypes"] for tp in spec["tps"] for chain in [_chain(rows, dtype, tp)]]
    out = {"spec": {k: (list(v) if isinstance(v, tuple) else v) for k, v in spec.items()}, "attention": ATTENTION,
           "dropout": DROPOUT, "rows": rows, "ratios": ratios}
    return dict(out, **section(_tables(out)))


COLUMNS = {"configuration": lambda r: LABELS[r["mode"]] + ("" if r["attention"] == ATTENTION else
                                                              f" ({r['attention']})"),
           "tp": "tp", "saved / layer / rank|bytes": "saved_bytes_per_layer", "saved, sbh": "saved_sbh_per_layer",
           "formula, sbh": "formula_sbh_per_layer", "measured / formula": "measured_over_formula",
           "CPU-kernel formula, sbh": "cpu_kernel_formula_sbh_per_layer",
           "measured / CPU-kernel formula": "measured_over_cpu_kernel_formula",
           "saved once for all layers|bytes": "saved_bytes_shared_by_layers",
           "peak RSS increase in the forward|bytes": "peak_rss_increase_bytes_max_rank",
           "RSS held after the forward|bytes": "rss_held_after_forward_bytes_max_rank"}
KINDS = ("measured", "formula", "cpu_kernel_formula")


def _tables(out: Dict[str, Any]) -> List[Any]:
    spec, rows = out["spec"], out["rows"]
    sbh = spec["seq"] * spec["batch"] * spec["layer"]["hidden_size"]
    blocks = [f"{spec['layers']} HF BertModel layers ({spec['layer']}), sequence {spec['seq']}, batch {spec['batch']}, "
              f"dropout {out['dropout']}, attention {out['attention']}; saved bytes per layer (mean over the layers) "
              f"per rank (the largest); s*b*h = {sbh:,}. Formula: Korthikanti et al. 2022 with e-byte activations and "
              "1-byte masks; CPU-kernel formula: the same terms at the sizes PyTorch's CPU kernels store."]
    for dtype in spec["dtypes"]:
        blocks += [f"**{dtype}**", table(COLUMNS, (r for r in rows if r["dtype"] == dtype), name=dtype, keys=2)]
    names = {"TP / dense|.4f": "tp_over_dense", "TP+SP / TP|.4f": "sp_over_tp",
             "TP+SP+checkpoint / TP+SP|.4f": "ckpt_over_sp"}
    blocks += ["Ratios of saved bytes per layer per rank: measured / formula / CPU-kernel formula.",
               table({"dtype": "dtype", "tp": "tp", **names}, out["ratios"], keys=2)]
    tp = max(spec["tps"])
    for dtype in spec["dtypes"]:
        chosen = _chain(rows, dtype, tp)
        terms = list(dict.fromkeys(t for r in chosen for t in r["terms_sbh_per_layer"]))
        body = [[t] + [[r["terms_sbh_per_layer"].get(t, {}).get(k, 0) for k in KINDS] for r in chosen] for t in terms]
        body.append(["total"] + [[r[f"{k.replace('measured', 'saved')}_sbh_per_layer"] for k in KINDS]
                                 for r in chosen])
        blocks += [f"Breakdown, {dtype}, tp={tp}, sbh per layer per rank: measured / formula / CPU-kernel formula, "
                   "per term (decided by the module that saved a tensor and the autograd node holding it):",
                   table(["term"] + [LABELS[r["mode"]] + "|.3f" for r in chosen], body, name=f"{dtype} tp{tp}")]
    return blocks

"""Section 2: parameter and AdamW-state bytes per rank of BERT-large BertForPreTraining at TP = 1, 2, 4, 8.

nxdtp's figures are counted, not computed: the model is built on the meta device (no storage) and sharded by
``parallelize_bert`` under ``simulated_topology(world_size=tp, rank=r, tensor_model_parallel_size=tp)``, as
tests/test_models_bert.py does for tp=8; every rank is counted (they differ only if the vocabulary padding did).

Next to it:

* the limit, dense / tp: what a rank would hold if every parameter were split;
* NxD's attention-only recipe, computed from the config: NxD's BERT example shards only Q, K, V (column-parallel:
  weight and bias split) and the attention output dense (row-parallel: weight split, bias replicated); everything
  else (embeddings, MLP, LayerNorms, pooler, heads) is replicated.

Bytes assume fp32 training with AdamW: parameters 4 B, gradients 4 B, optimizer state 8 B (exp_avg and exp_avg_sq)
per parameter, plus one step counter per parameter tensor (ignored: a few hundred scalars).

What a rank holds is measured as well as counted, since a shard that is a view of the dense tensor has 1/tp of its
elements but keeps all of its storage:

* the storage bytes its parameters hold (``nxdtp.storage.held_bytes``: each distinct storage once, whole), on meta;
* the RSS a rank gains: in a fresh process (glibc told to map large blocks on their own and trimmed before each
  reading, so freed memory leaves the RSS), for each TP size in turn a CPU BertForPreTraining is built, then
  parallelized in place at the last rank of a simulated topology, then freed; the RSS after parallelizing minus the
  RSS before building, next to the bytes its parameters hold and the RSS the dense model took.
"""

from __future__ import annotations

from typing import Any, Dict, List

from .common import fmt, fmt_bytes, markdown_table, verdict

BERT_LARGE = dict(vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                  intermediate_size=4096, max_position_embeddings=512, type_vocab_size=2)
TPS = (1, 2, 4, 8)
BYTES_PER_PARAMETER = 4
ADAMW_STATE_PER_PARAMETER = 2  # exp_avg, exp_avg_sq
TARGET_PERCENT_AT_TP8 = 13.3


def analytic_counts(cfg: Dict[str, int], tp: int) -> Dict[str, int]:
    """Dense BertForPreTraining parameters, and a rank's share under NxD's attention-only recipe, from the config."""
    h, n_layers, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    vocab, positions, types = cfg["vocab_size"], cfg["max_position_embeddings"], cfg["type_vocab_size"]
    layer_norm = 2 * h
    embeddings = (vocab + positions + types) * h + layer_norm
    qkv = 3 * (h * h + h)
    attention_out = h * h + h
    mlp = (h * inter + inter) + (inter * h + h)
    layer = qkv + attention_out + layer_norm + mlp + layer_norm
    pooler = h * h + h
    # MLM head: transform dense + LayerNorm, decoder weight tied to the word embedding, decoder bias; NSP head.
    heads = (h * h + h) + layer_norm + vocab + (2 * h + 2)
    dense = embeddings + n_layers * layer + pooler + heads
    nxd_layer = qkv // tp + (h * h) // tp + h + layer_norm + mlp + layer_norm
    nxd = embeddings + n_layers * nxd_layer + pooler + heads
    return {"dense": dense, "nxd_attention_only": nxd}


def _parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied weight once


def _held_bytes(model) -> int:
    from nxdtp.storage import held_bytes

    return held_bytes(model.parameters())


def run(cfg: Dict[str, int] = None) -> Dict[str, Any]:
    import torch
    from transformers import BertConfig, BertForPreTraining

    from nxdtp.models.bert import parallelize_bert
    from nxdtp.parallel_state import simulated_topology

    cfg = dict(cfg or BERT_LARGE)
    config = BertConfig(**cfg)
    with torch.device("meta"):
        dense_model = BertForPreTraining(config)
    dense = _parameter_count(dense_model)
    analytic_dense = analytic_counts(cfg, 1)["dense"]
    if analytic_dense != dense:
        raise AssertionError(f"the analytic parameter count {analytic_dense:,} differs from the model's {dense:,}: "
                             "the NxD attention-only figures would be wrong")
    rows = []
    for tp in TPS:
        per_rank, held = [], []
        for rank in sorted({0, tp - 1}):
            with torch.device("meta"):
                model = BertForPreTraining(config)
            with simulated_topology(world_size=tp, rank=rank, tensor_model_parallel_size=tp):
                parallelize_bert(model)  # meta tensors: no broadcast, no process group needed
            if any(p.device.type != "meta" for p in model.parameters()):
                raise AssertionError("parallelize_bert materialised a meta model")
            per_rank.append(_parameter_count(model))
            held.append(_held_bytes(model))
        nxdtp_count = max(per_rank)
        nxd_count = analytic_counts(cfg, tp)["nxd_attention_only"]
        rows.append({
            "tp": tp, "nxdtp_parameters_per_rank": nxdtp_count, "ranks_counted": sorted({0, tp - 1}),
            "ranks_equal": len(set(per_rank)) == 1,
            "nxdtp_parameter_bytes": nxdtp_count * BYTES_PER_PARAMETER,
            "nxdtp_storage_bytes_held": max(held),
            "nxdtp_adamw_state_bytes": nxdtp_count * BYTES_PER_PARAMETER * ADAMW_STATE_PER_PARAMETER,
            "nxdtp_training_bytes": nxdtp_count * BYTES_PER_PARAMETER * (2 + ADAMW_STATE_PER_PARAMETER),
            "nxdtp_percent_of_dense": 100 * nxdtp_count / dense,
            "limit_percent_of_dense": 100 / tp,
            "limit_parameter_bytes": dense * BYTES_PER_PARAMETER / tp,
            "nxd_parameters_per_rank": nxd_count,
            "nxd_parameter_bytes": nxd_count * BYTES_PER_PARAMETER,
            "nxd_adamw_state_bytes": nxd_count * BYTES_PER_PARAMETER * ADAMW_STATE_PER_PARAMETER,
            "nxd_percent_of_dense": 100 * nxd_count / dense,
        })
    at8 = next(r for r in rows if r["tp"] == 8)
    return {
        "config": cfg, "dense_parameters": dense, "dense_parameter_bytes": dense * BYTES_PER_PARAMETER,
        "dense_adamw_state_bytes": dense * BYTES_PER_PARAMETER * ADAMW_STATE_PER_PARAMETER,
        "rows": rows, "target_percent_at_tp8": TARGET_PERCENT_AT_TP8,
        "target_met": at8["nxdtp_percent_of_dense"] <= TARGET_PERCENT_AT_TP8,
        "numbers": {**{f"nxdtp_percent_tp{r['tp']}": r["nxdtp_percent_of_dense"] for r in rows},
                    **{f"nxd_percent_tp{r['tp']}": r["nxd_percent_of_dense"] for r in rows},
                    **{f"nxdtp_parameter_bytes_tp{r['tp']}": r["nxdtp_parameter_bytes"] for r in rows},
                    **{f"nxdtp_storage_bytes_held_tp{r['tp']}": r["nxdtp_storage_bytes_held"] for r in rows},
                    **{f"nxdtp_adamw_state_bytes_tp{r['tp']}": r["nxdtp_adamw_state_bytes"] for r in rows}},
    }


def tables(result: Dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [f"BERT-large BertForPreTraining (hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
             f"{cfg['num_attention_heads']} heads, intermediate {cfg['intermediate_size']}, vocab "
             f"{cfg['vocab_size']}): "
             f"dense {result['dense_parameters']:,} parameters = {fmt_bytes(result['dense_parameter_bytes'])} fp32, "
             f"AdamW state {fmt_bytes(result['dense_adamw_state_bytes'])}. Per rank, built on meta and sharded under a "
             "simulated topology; NxD attention-only computed from the config.", ""]
    rows = []
    for r in result["rows"]:
        rows.append([r["tp"], f"{r['nxdtp_parameters_per_rank']:,}", fmt_bytes(r["nxdtp_parameter_bytes"]),
                     fmt_bytes(r["nxdtp_storage_bytes_held"]),
                     fmt_bytes(r["nxdtp_adamw_state_bytes"]), fmt_bytes(r["nxdtp_training_bytes"]),
                     f"{fmt(r['nxdtp_percent_of_dense'])} %", f"{fmt(r['limit_percent_of_dense'])} %",
                     f"{r['nxd_parameters_per_rank']:,}", fmt_bytes(r["nxd_parameter_bytes"]),
                     fmt_bytes(r["nxd_adamw_state_bytes"]), f"{fmt(r['nxd_percent_of_dense'])} %"])
    lines.append(markdown_table(
        ["tp", "nxdtp parameters / rank", "parameter bytes", "storage bytes held", "AdamW state bytes",
         "params + grads + AdamW", "% of dense", "limit: dense / tp", "NxD attention-only parameters / rank",
         "NxD parameter bytes", "NxD AdamW state bytes", "NxD % of dense"], rows))
    at8 = next(r for r in result["rows"] if r["tp"] == 8)
    lines += ["", f"Target at tp=8: <= {TARGET_PERCENT_AT_TP8} % of dense; nxdtp "
                  f"{fmt(at8['nxdtp_percent_of_dense'])} % "
                  f"({verdict(at8['nxdtp_percent_of_dense'], TARGET_PERCENT_AT_TP8)}); limit "
                  f"{fmt(at8['limit_percent_of_dense'])} %; NxD attention-only {fmt(at8['nxd_percent_of_dense'])} %."]
    if "rss" in result:
        lines += ["", _rss_table(result["rss"])]
    return "\n".join(lines)


# ---- the RSS a rank gains --------------------------------------------------------------------------------------------

QUICK_CFG = dict(vocab_size=1024, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024,
                 max_position_embeddings=128, type_vocab_size=2)
RSS_TPS = {False: (1, 2, 8), True: (1, 2)}


def rss_worker(args: Dict[str, Any]) -> List[Dict[str, Any]]:
    """In a fresh process, for each TP size in ``args["tps"]`` in turn: build the dense model on CPU, parallelize it in
    place at the last rank of a simulated topology, report RSS and the bytes held, and free it before the next."""
    import gc

    import torch
    from transformers import BertConfig, BertForPreTraining

    from nxdtp.models.bert import parallelize_bert
    from nxdtp.parallel_state import simulated_topology

    from .rss import malloc_trim, proc_status_kib

    def rss() -> int:
        gc.collect()
        malloc_trim()
        return proc_status_kib()["VmRSS"] * 1024

    config = BertConfig(**args["cfg"])
    rows = []
    for tp in args["tps"]:
        torch.manual_seed(0)
        start = rss()
        model = BertForPreTraining(config)
        dense_bytes, dense_rss = _held_bytes(model), rss() - start
        with simulated_topology(world_size=tp, rank=tp - 1, tensor_model_parallel_size=tp):
            parallelize_bert(model, broadcast_replicated=False)   # no collective: the rank's own values are kept
        rows.append({"tp": tp, "dense_parameter_bytes": dense_bytes, "dense_rss_gain": dense_rss,
                     "rss_gain": rss() - start, "storage_bytes_held": _held_bytes(model),
                     "parameter_bytes": _parameter_count(model) * BYTES_PER_PARAMETER})
        del model
    return rows


def add_rss(result: Dict[str, Any], quick: bool) -> None:
    """``rss_worker`` in a process of its own; its rows and numbers go into ``result``."""
    import os
    import tempfile

    from .common import MALLOC_ENV, run_worker_script

    cfg = QUICK_CFG if quick else BERT_LARGE
    with tempfile.TemporaryDirectory() as tmp:
        rows = run_worker_script("memory-rss", {"cfg": cfg, "tps": list(RSS_TPS[quick])}, os.path.join(tmp, "rss.json"),
                                 env=MALLOC_ENV)
    result["rss"] = {"config": cfg, "rows": rows}
    result["numbers"].update({f"rss_{key}_tp{r['tp']}": r[key] for r in rows
                              for key in ("rss_gain", "storage_bytes_held", "parameter_bytes")})


def _rss_table(result: Dict[str, Any]) -> str:
    cfg = result["config"]
    rows = [[r["tp"], fmt_bytes(r["parameter_bytes"]), fmt_bytes(r["storage_bytes_held"]), fmt_bytes(r["rss_gain"]),
             f"{fmt(100 * r['rss_gain'] / r['dense_rss_gain'])} %", fmt_bytes(r["dense_rss_gain"])]
            for r in result["rows"]]
    return "\n".join([
        f"The RSS a rank gains, measured: BertForPreTraining (hidden {cfg['hidden_size']}, "
        f"{cfg['num_hidden_layers']} layers, vocab {cfg['vocab_size']}) built on CPU in a fresh process and "
        "parallelized in place at the last rank; RSS after parallelizing minus RSS before building.", "",
        markdown_table(["tp", "parameter bytes", "storage bytes held", "RSS gained", "% of the dense model's RSS",
                        "dense model's RSS"], rows)])

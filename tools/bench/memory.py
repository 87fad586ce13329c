"""Section 2: parameter and AdamW bytes per rank of BERT-large at TP 1, 2, 4, 8, counted and measured."""

from __future__ import annotations

import gc
from typing import Any, Dict, List

from transformers import BertForPreTraining  # noqa: F401 - the model code loaded before the RSS baselines

from nxdtp.models.bert import parallelize_bert
from nxdtp.parallel_state import simulated_topology
from nxdtp.storage import held_bytes

from .common import BERT_LARGE, fresh, hf_model, malloc_trim, proc_status_kib, section, table, verdict

QUICK_CFG = dict(vocab_size=1024, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024,
                 max_position_embeddings=128, type_vocab_size=2)
TPS, RSS_TPS = (1, 2, 4, 8), {False: (1, 2, 8), True: (1, 2)}
TARGET_PERCENT_AT_TP8 = 13.3


def analytic_counts(cfg: Dict[str, int], tp: int) -> Dict[str, int]:
    """Dense BertForPreTraining parameters, and a rank's share under NxD's attention-only recipe."""
    h, inter, ln = cfg["hidden_size"], cfg["intermediate_size"], 2 * cfg["hidden_size"]
    embeddings = (cfg["vocab_size"] + cfg["max_position_embeddings"] + cfg["type_vocab_size"]) * h + ln
    qkv, attention_out, mlp = 3 * (h * h + h), h * h + h, (h * inter + inter) + (inter * h + h)
    # pooler; MLM head: transform + LayerNorm, decoder tied to the word embedding, its bias; NSP head
    rest = embeddings + (h * h + h) + (h * h + h) + ln + cfg["vocab_size"] + (2 * h + 2)
    layers = cfg["num_hidden_layers"]
    return {"dense": rest + layers * (qkv + attention_out + 2 * ln + mlp),
            "nxd_attention_only": rest + layers * (qkv // tp + (h * h) // tp + h + 2 * ln + mlp)}


def _counts(model) -> tuple:
    return sum(p.numel() for p in model.parameters()), held_bytes(model.parameters())


def case_count(cfg: Dict[str, int]) -> Dict[str, Any]:
    dense = _counts(hf_model(cfg, device="meta"))[0]
    if analytic_counts(cfg, 1)["dense"] != dense:
        raise AssertionError(f"the analytic parameter count {analytic_counts(cfg, 1)['dense']:,} differs from the "
                             f"model's {dense:,}: the NxD attention-only figures would be wrong")
    rows = []
    for tp in TPS:
        counted = []
        for rank in sorted({0, tp - 1}):
            model = hf_model(cfg, device="meta")
            with simulated_topology(world_size=tp, rank=rank, tensor_model_parallel_size=tp):
                parallelize_bert(model)  # meta tensors: nothing communicated
            if any(p.device.type != "meta" for p in model.parameters()):
                raise AssertionError("parallelize_bert materialised a meta model")
            counted.append(_counts(model))
        n, nxd = max(c[0] for c in counted), analytic_counts(cfg, tp)["nxd_attention_only"]
        rows.append({"tp": tp, "nxdtp_parameters_per_rank": n, "ranks_equal": len(set(counted)) == 1,
                     "nxdtp_parameter_bytes": 4 * n, "nxdtp_storage_bytes_held": max(c[1] for c in counted),
                     "nxdtp_adamw_state_bytes": 8 * n, "nxdtp_training_bytes": 16 * n,
                     "nxdtp_percent_of_dense": 100 * n / dense, "limit_percent_of_dense": 100 / tp,
                     "nxd_parameters_per_rank": nxd, "nxd_parameter_bytes": 4 * nxd, "nxd_adamw_state_bytes": 8 * nxd,
                     "nxd_percent_of_dense": 100 * nxd / dense})
    return {"config": cfg, "dense_parameters": dense, "rows": rows}


def case_rss(cfg: Dict[str, int], tps: List[int]) -> List[Dict[str, Any]]:
    """For each TP size in turn: build the dense model on CPU, parallelize it in place at the last rank, free it."""
    def rss() -> int:
        gc.collect()
        malloc_trim()
        return proc_status_kib()["VmRSS"] * 1024

    rows = []
    for tp in tps:
        start = rss()
        model = hf_model(cfg, seed=0, device="cpu")
        dense_bytes, dense_rss = _counts(model)[1], rss() - start
        with simulated_topology(world_size=tp, rank=tp - 1, tensor_model_parallel_size=tp):
            parallelize_bert(model, broadcast_replicated=False)  # no collective: the rank's own values are kept
        n, held = _counts(model)
        rows.append({"tp": tp, "dense_parameter_bytes": dense_bytes, "dense_rss_gain": dense_rss,
                     "rss_gain": rss() - start, "storage_bytes_held": held, "parameter_bytes": 4 * n})
        del model
    return rows


def run(ctx) -> Dict[str, Any]:
    out = fresh(case_count, cfg=BERT_LARGE)[0]
    cfg = QUICK_CFG if ctx.quick else BERT_LARGE
    out["rss"] = {"config": cfg, "rows": fresh(case_rss, malloc=True, cfg=cfg, tps=list(RSS_TPS[ctx.quick]))[0]}
    return dict(out, **section(_tables(out)))


COLUMNS = {"tp": "tp", "nxdtp parameters / rank": "nxdtp_parameters_per_rank",
           "parameter bytes|bytes": "nxdtp_parameter_bytes", "storage bytes held|bytes": "nxdtp_storage_bytes_held",
           "AdamW state bytes|bytes": "nxdtp_adamw_state_bytes", "params + grads + AdamW|bytes": "nxdtp_training_bytes",
           "% of dense|.2f": "nxdtp_percent_of_dense", "limit: dense / tp|.2f": "limit_percent_of_dense",
           "NxD attention-only parameters / rank": "nxd_parameters_per_rank",
           "NxD parameter bytes|bytes": "nxd_parameter_bytes", "NxD AdamW state bytes|bytes": "nxd_adamw_state_bytes",
           "NxD % of dense|.2f": "nxd_percent_of_dense"}


def _tables(out: Dict[str, Any]) -> List[Any]:
    cfg, dense, at8 = out["config"], out["dense_parameters"], out["rows"][-1]
    rss_cfg = out["rss"]["config"]
    return [f"BERT-large BertForPreTraining ({', '.join(f'{k} {v}' for k, v in cfg.items())}): dense {dense:,} "
            f"parameters, {4 * dense / (1 << 20):,.1f} MiB fp32. Per rank, built on meta and sharded under a simulated "
            "topology; NxD attention-only computed from the config; percentages of dense.",
            table(COLUMNS, out["rows"]),
            f"Target at tp=8: <= {TARGET_PERCENT_AT_TP8} % of dense; nxdtp {at8['nxdtp_percent_of_dense']:.2f} % "
            f"({verdict(at8['nxdtp_percent_of_dense'], TARGET_PERCENT_AT_TP8)}); limit "
            f"{at8['limit_percent_of_dense']:.2f} %; NxD attention-only {at8['nxd_percent_of_dense']:.2f} %.",
            f"The RSS a rank gains, measured: BertForPreTraining (hidden {rss_cfg['hidden_size']}, "
            f"{rss_cfg['num_hidden_layers']} layers, vocab {rss_cfg['vocab_size']}) built on CPU in a fresh process "
            "and parallelized in place at the last rank; RSS after parallelizing minus RSS before building.",
            table(["tp", "parameter bytes|bytes", "storage bytes held|bytes", "RSS gained|bytes",
                   "% of the dense model's RSS|.2f", "dense model's RSS|bytes"],
                  ([r["tp"], r["parameter_bytes"], r["storage_bytes_held"], r["rss_gain"],
                    100 * r["rss_gain"] / r["dense_rss_gain"], r["dense_rss_gain"]] for r in out["rss"]["rows"]),
                  name="rss")]

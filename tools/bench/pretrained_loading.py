"""Peak host memory of loading a pretrained HF BERT, nxdtp's per-rank ``from_pretrained_sharded`` (a world of TP ranks)
against plain ``from_pretrained`` (``python -m tools.bench pretrained_loading --help``; docs/checkpoints.md)."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from typing import Any, Dict

import safetensors.torch  # noqa: F401 - what either loader imports, before both baselines
import torch
import torch.distributed as dist
from transformers import BertForPreTraining

from nxdtp.models import hf_loading  # noqa: F401
from nxdtp.models.bert import from_pretrained_sharded

from .common import BERT_LARGE, Pool, emit, fresh, hf_model, measure_rss, proc_status_kib, table, version
from .merge_timing import files_under, safetensors_tensor_bytes

CONFIGS = {  # BERT-Large, BERT-Base (Devlin et al.), BERT-Small (Turc et al.'s miniatures)
    "large": BERT_LARGE, "base": dict(BERT_LARGE, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                      intermediate_size=3072),
    "small": dict(BERT_LARGE, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, intermediate_size=2048)}


def case_create(config: str, model_dir: str) -> None:
    hf_model(CONFIGS[config], seed=0, architectures=["BertForPreTraining"]).save_pretrained(model_dir)


def case_load(model_dir: str, sharded: bool) -> Dict[str, Any]:
    """Load (after the same imports in every process), then read every parameter once: lazily faulted mapped views
    show their cost only then."""
    dist.barrier()
    model, result = measure_rss(lambda: from_pretrained_sharded(model_dir) if sharded
                                else BertForPreTraining.from_pretrained(model_dir))
    params = list({id(p): p for p in model.parameters()}.values())
    with torch.no_grad():
        for p in params:
            p.sum()
    result.update(rank=dist.get_rank() if sharded else None, own_params_mib=sum(
        p.numel() * p.element_size() for p in params) / (1 << 20), own_numel=sum(p.numel() for p in params),
        touched_increase_mib=proc_status_kib()["VmHWM"] / 1024 - result["baseline_mib"],
        param_dtypes=sorted({str(p.dtype) for p in params}))
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench pretrained_loading", description=__doc__)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="base", help="BERT size (default: base)")
    parser.add_argument("--tp", type=int, default=4, help="tensor-parallel size = number of ranks (default: 4)")
    parser.add_argument("--workdir", help="where the checkpoint is written (kept); default: a temporary directory")
    parser.add_argument("--json", metavar="OUT", help="also write every figure to this JSON file")
    parser.add_argument("--skip-hf", action="store_true", help="do not measure plain HF from_pretrained")
    args = parser.parse_args(argv)
    cfg = CONFIGS[args.config]
    for what in ("num_attention_heads", "intermediate_size"):
        if cfg[what] % args.tp:
            parser.error(f"--tp {args.tp} does not divide {what}={cfg[what]} of BERT-{args.config}")
    workdir = os.path.abspath(args.workdir) if args.workdir else tempfile.mkdtemp(prefix="bench_pretrained_loading_")
    model_dir = os.path.join(workdir, f"bert-{args.config}")
    try:
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            fresh(case_create, config=args.config, model_dir=model_dir)
        full = sum(safetensors_tensor_bytes(p)[1] for p in files_under(model_dir) if p.endswith(".safetensors"))
        with Pool(args.tp, tp=args.tp) as pool:
            sharded = pool.call(case_load, model_dir=model_dir, sharded=True)
        hf = None if args.skip_hf else fresh(case_load, model_dir=model_dir, sharded=False)[0]
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    out = {"config": args.config, "model_config": cfg, "tp": args.tp, "full_checkpoint_bytes": full,
           "sharded": sharded, "hf": hf, "env": {k: version(k) for k in ("torch", "transformers", "safetensors")}}
    return emit(_tables(out), out, args.json)


def _tables(out: Dict[str, Any]) -> list:
    full = out["full_checkpoint_bytes"] / (1 << 20)
    rows = [(f"nxdtp from_pretrained_sharded (tp={out['tp']})", r) for r in out["sharded"]]
    rows += [("HF from_pretrained (1 process)", out["hf"])] if out["hf"] else []
    columns = ["loader", "rank", "baseline MiB|.1f", "peak MiB|.1f", "increase MiB|.1f", "own shard MiB|.1f",
               "increase / full|.3f", "increase / own|.2f", "anon + MiB (sampled peak)|.1f",
               "file-backed + MiB (sampled peak)|.1f", "increase MiB after reading all params|.1f", "load s|.2f"]
    worst = max(out["sharded"], key=lambda r: r["increase_mib"])
    return [f"BERT-{out['config']} ({out['model_config']}), checkpoint tensors {full:.1f} MiB, tp={out['tp']}, one "
            f"thread per process, peak-RSS reset before load: {all(r['peak_reset'] for _, r in rows)}",
            table(columns, ([name, r["rank"], r["baseline_mib"], r["peak_mib"], r["increase_mib"], r["own_params_mib"],
                             r["increase_mib"] / full, r["increase_mib"] / r["own_params_mib"],
                             r["sampled_peak_anon_increase_mib"], r["sampled_peak_file_increase_mib"],
                             r["touched_increase_mib"], r["seconds"]] for name, r in rows)),
            f"sharded, worst rank: increase {worst['increase_mib']:.1f} MiB = {worst['increase_mib'] / full:.3f} x "
            f"full checkpoint = {worst['increase_mib'] / worst['own_params_mib']:.2f} x own shard; private (anon) "
            f"increase <= {max(r['sampled_peak_anon_increase_mib'] / r['own_params_mib'] for r in out['sharded']):.2f}"
            " x own shard. increase = peak RSS of the load (VmHWM, reset before it) - RSS before it; anon = private "
            "memory; file-backed = pages of the mapped checkpoint (page cache, shared, reclaimable)."]

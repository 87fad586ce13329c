"""Section 5 and ``python -m tools.bench merge_timing``: wall time and peak host memory of merging a tp=8 checkpoint,
and of the DCP export and imports, against a raw copy of the same bytes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import transformers as tf

import nxdtp.checkpointing
from nxdtp.checkpointing.dcp_export import export_dcp
from nxdtp.checkpointing.dcp_import import import_dcp
from nxdtp.checkpointing.merge import merge
from nxdtp.converters.dcp import import_dcp_resharded
from nxdtp.models import parallelize_model
from nxdtp.models.hf_loading import materialize_meta_model

from . import common
from .common import BERT_LARGE, alternate, emit, fresh, hf_model, log, measure_rss, median, summary, table, tool_args

TP = 8
# A Llama-3.2-1B-shaped decoder (GQA: 32 query heads, 8 KV heads; tied embeddings; 1.24 B parameters, 4.9 GB fp32).
LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, vocab_size=128256, max_position_embeddings=2048, tie_word_embeddings=True)
MODELS = {"bert-large": BERT_LARGE, "llama-1b": LLAMA_1B}
QUICK_CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, vocab_size=1000,
                    max_position_embeddings=64, type_vocab_size=2)
CONFIG_NAME = "config.json"  # beside the checkpoint; the DCP export copies it, the import builds from it
COPY_BUFFER_BYTES = 16 << 20
TARGETS = {"wall_ratio": 2.0, "rss_fraction": 0.25}
KINDS, DCP_KINDS = ("raw", "merge", "naive"), ("to_dcp", "from_dcp", "from_dcp_reshard")
LABELS = {"raw": "raw copy (stream, 16 MiB buffer, fsync)", "merge": "merge -> model.safetensors",
          "naive": "naive copy (read whole file, write, fsync)", "to_dcp": "export -> DCP (nxdtp-merge --to dcp)",
          "from_dcp": "import DCP -> HF dir (nxdtp-merge --from-dcp)",
          "from_dcp_reshard": "import DCP -> nxdtp checkpoint at the same tp (nxdtp-merge --from-dcp --reshard)"}


def tag_dir(checkpoint_dir: str) -> Optional[str]:
    """The newest complete tag directory of ``checkpoint_dir``, or None."""
    tags = nxdtp.checkpointing.list_tags(checkpoint_dir)
    return os.path.join(checkpoint_dir, tags[-1]) if tags else None


def files_under(path: str) -> List[str]:
    return sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names)


def safetensors_tensor_bytes(path: str) -> tuple:
    """(tensor count, bytes of tensor data) of a safetensors file, from its header."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    spans = [v["data_offsets"] for k, v in header.items() if k != "__metadata__"]
    return len(spans), sum(end - begin for begin, end in spans)


def case_create(model: str, checkpoint_dir: str, config: Optional[Dict[str, Any]] = None) -> None:
    """On every rank of a world of tp ranks: build on meta, shard, fill with N(0, 0.02) (replicas equal), save."""
    arch = "bert" if model == "bert-large" else "llama"
    dense = hf_model(config or MODELS[model], arch, device="meta",
                     architectures=["BertForPreTraining" if arch == "bert" else "LlamaForCausalLM"])
    parallelize_model(dense, broadcast_replicated=False)
    materialize_meta_model(dense, "cpu")
    replicated, own = (torch.Generator().manual_seed(s) for s in (1234, 10_000 + dist.get_rank()))
    with torch.no_grad():
        for param in dense.parameters():  # tied parameters once, the same order on every rank
            param.normal_(0.0, 0.02, generator=own if getattr(param, "tensor_model_parallel", False) else replicated)
        for buffer in dense.buffers():
            buffer.zero_()
    nxdtp.checkpointing.save({"model": dense, "global_step": 1}, checkpoint_dir)
    if dist.get_rank() == 0:
        dense.config.to_json_file(os.path.join(checkpoint_dir, CONFIG_NAME))


def _copy(sources: List[str], destination: str, whole: bool) -> int:
    """Stream each file through one 16 MiB buffer, or (naive) read it whole and write it; fsync each."""
    buffer = None if whole else memoryview(bytearray(COPY_BUFFER_BYTES))
    for source in sources:
        with open(source, "rb", buffering=0) as src, \
                open(os.path.join(destination, os.path.basename(source)), "wb") as dst:
            if whole:
                dst.write(src.read())
            while not whole and (n := src.readinto(buffer)):
                dst.write(buffer[:n])
            dst.flush()
            os.fsync(dst.fileno())
    return sum(map(os.path.getsize, sources))


def _operation(kind: str, checkpoint_dir: str, dcp_dir: str, output_dir: str, reshard_tp: int):
    tag = os.path.basename(tag_dir(checkpoint_dir))
    config = os.path.join(checkpoint_dir, CONFIG_NAME)
    if kind in ("raw", "naive"):
        os.makedirs(output_dir)
        return lambda: _copy(files_under(os.path.join(tag_dir(checkpoint_dir), "model")), output_dir, kind == "naive")
    return {"merge": lambda: merge(checkpoint_dir, output_dir, tag=tag, progress=False),
            "to_dcp": lambda: export_dcp(checkpoint_dir, output_dir, tag=tag, progress=False, config=config),
            "from_dcp": lambda: import_dcp(dcp_dir, output_dir, config=config, progress=False),
            "from_dcp_reshard": lambda: import_dcp_resharded(dcp_dir, output_dir, reshard_tp, config=config,
                                                             progress=False)}[kind]


def case_measure(kind: str, checkpoint_dir: str, dcp_dir: str, output_dir: str, reshard_tp: int) -> Dict[str, Any]:
    """One operation in this (fresh) process: its wall time and memory over the RSS before it, after loading the HF
    model classes the DCP import builds (``import transformers`` loads them lazily), which is timed apart."""
    before, start = common.proc_status_kib()["VmRSS"], time.perf_counter()
    imported = {"classes": [tf.BertForPreTraining.__name__, tf.LlamaForCausalLM.__name__],
                "seconds": time.perf_counter() - start,
                "rss_mib": (common.proc_status_kib()["VmRSS"] - before) / 1024}
    value, result = measure_rss(_operation(kind, checkpoint_dir, dcp_dir, output_dir, reshard_tp))
    result.update(kind=kind, model_code_import=imported)
    if kind == "merge":
        result.update(output_bytes=os.path.getsize(value), output_tensors=safetensors_tensor_bytes(value)[0])
    else:
        result["output_bytes"] = sum(map(os.path.getsize, files_under(output_dir)))
    return result


def warm(paths: List[str]) -> None:
    for path in paths:
        with open(path, "rb") as f:
            while f.read(COPY_BUFFER_BYTES):
                pass


def _summarise(runs: List[Dict[str, Any]], checkpoint_bytes: int) -> Dict[str, Any]:
    """Per kind: median/min/max over the rounds; per target kind its ratios against the raw copy."""
    fields = ("seconds", "increase_mib", "maxrss_increase_mib", "sampled_peak_anon_increase_mib",
              "sampled_peak_file_increase_mib")
    by_kind = {k: [r for r in runs if r["kind"] == k] for k in KINDS + DCP_KINDS}
    out: Dict[str, Any] = {k: {f: summary(r[f] for r in rs) for f in fields} for k, rs in by_kind.items() if rs}
    out["targets"] = {}
    for kind in (k for k in ("merge",) + DCP_KINDS if by_kind[k]):
        ratio = out[kind]["seconds"]["median"] / out["raw"]["seconds"]["median"]
        fraction = out[kind]["increase_mib"]["median"] * (1 << 20) / checkpoint_bytes
        out["targets"][kind] = {"wall_ratio": ratio, "rss_fraction": fraction,
                                "wall_ratio_per_round": [o["seconds"] / r["seconds"] for r, o in
                                                         zip(by_kind["raw"], by_kind[kind])],
                                "wall_target_met": ratio <= TARGETS["wall_ratio"],
                                "rss_target_met": fraction <= TARGETS["rss_fraction"]}
    return out


def _workdir(path: Optional[str]):
    """``path``, or a temporary directory removed at the end."""
    return contextlib.nullcontext(os.path.abspath(path)) if path else tempfile.TemporaryDirectory(prefix="bench_merge_")


def ensure_checkpoint(model: str, workdir: str, config: Optional[Dict[str, Any]] = None, tp: int = TP) -> str:
    """``model``'s checkpoint at ``tp`` in ``workdir``, created by a world of tp ranks unless it is there."""
    checkpoint_dir = os.path.join(workdir, f"{model}-tp{tp}")
    if tag_dir(checkpoint_dir) is None:
        log(f"merge timing: creating {checkpoint_dir} (a world of {tp} ranks)")
        fresh(case_create, world=tp, tp=tp, model=model, checkpoint_dir=checkpoint_dir, config=config)
    return checkpoint_dir


def measure(model: str, workdir: str, rounds: int, kinds: List[str], config: Optional[Dict[str, Any]] = None,
            tp: int = TP) -> Dict[str, Any]:
    """Create (or reuse) ``model``'s checkpoint at ``tp`` in ``workdir``; measure ``kinds`` on it, ``rounds`` times in
    turn, each in a fresh process after its inputs were read (warm page cache)."""
    dirs = {"checkpoint": ensure_checkpoint(model, workdir, config, tp),
            "dcp": os.path.join(workdir, f"{model}-tp{tp}-dcp")}
    sources = files_under(os.path.join(tag_dir(dirs["checkpoint"]), "model"))

    def one(kind: str) -> dict:
        warm(files_under(dirs["dcp"]) if kind.startswith("from_dcp") else sources)
        output = os.path.join(dirs["scratch"], kind)
        r = fresh(case_measure, kind=kind, checkpoint_dir=dirs["checkpoint"], dcp_dir=dirs["dcp"],
                  output_dir=output, reshard_tp=tp)[0]
        shutil.rmtree(output, ignore_errors=True)
        log(f"merge timing: {kind}: {r['seconds']:.2f} s, peak RSS +{r['increase_mib']:.1f} MiB")
        return r

    if set(kinds) & {"from_dcp", "from_dcp_reshard"} and not os.path.isfile(os.path.join(dirs["dcp"], ".metadata")):
        shutil.rmtree(dirs["dcp"], ignore_errors=True)  # the imports' input: this checkpoint's export, made once
        fresh(case_measure, kind="to_dcp", checkpoint_dir=dirs["checkpoint"], dcp_dir="", output_dir=dirs["dcp"],
              reshard_tp=tp)
    with tempfile.TemporaryDirectory(prefix="run_", dir=workdir) as dirs["scratch"]:
        by_kind = alternate(kinds, rounds, one)
    runs = [dict(by_kind[k][i], round=i) for i in range(rounds) for k in kinds]
    checkpoint_bytes = sum(map(os.path.getsize, sources))
    return {"model": model, "model_config": config or MODELS[model], "tp": tp, "checkpoint_bytes": checkpoint_bytes,
            "checkpoint_tensor_bytes": sum(safetensors_tensor_bytes(p)[1] for p in sources),
            "model_files": len(sources), "rounds": rounds, "targets": TARGETS, "runs": runs,
            "summary": _summarise(runs, checkpoint_bytes),
            "env": {k: common.version(k) for k in ("torch", "transformers", "safetensors")}}


def tables(out: Dict[str, Any]) -> List[Any]:
    mib, runs, s = out["checkpoint_bytes"] / (1 << 20), out["runs"], out["summary"]
    merged = next((r for r in runs if r["kind"] == "merge"), {})
    imports = [r["model_code_import"] for r in runs]
    verdict = lambda met: "met" if met else "MISSED"  # noqa: E731
    return [f"{out['model']} ({out['model_config']}) saved at tp={out['tp']}, float32: {out['model_files']} model "
            f"files, {out['checkpoint_bytes']:,} bytes ({mib:.1f} MiB), {out['checkpoint_tensor_bytes']:,} bytes of "
            f"tensor data; merged model.safetensors: {merged.get('output_bytes', 0):,} bytes, "
            f"{merged.get('output_tensors')} tensors. Warm page cache, {out['rounds']} round(s), medians; peak-RSS "
            f"reset before each call: {all(r['peak_reset'] for r in runs)}.",
            table(["operation", "wall s median (min-max)|.2f", "peak RSS increase MiB median (min-max)|.1f",
                   "% of checkpoint|.1f", "anon + MiB (sampled)|.1f", "file-backed + MiB (sampled)|.1f"],
                  ([LABELS[k], s[k]["seconds"], s[k]["increase_mib"], 100 * s[k]["increase_mib"]["median"] / mib,
                    s[k]["sampled_peak_anon_increase_mib"]["median"], s[k]["sampled_peak_file_increase_mib"]["median"]]
                   for k in KINDS + DCP_KINDS if k in s)),
            table(["operation", f"op / raw wall (target <= {TARGETS['wall_ratio']:g})", "wall",
                   f"RSS increase % of checkpoint (target <= {100 * TARGETS['rss_fraction']:g} %)", "RSS",
                   "op / raw wall per round|.2f"],
                  ([k, t["wall_ratio"], verdict(t["wall_target_met"]), 100 * t["rss_fraction"],
                    verdict(t["rss_target_met"]), t["wall_ratio_per_round"]] for k, t in s["targets"].items())),
            "Importing the HF model classes before each baseline (not in the figures) took "
            f"{median(i['seconds'] for i in imports):.2f} s and {median(i['rss_mib'] for i in imports):.1f} MiB of "
            "RSS (medians)."]


def run(ctx) -> Dict[str, Any]:
    """Section 5: BERT-large at tp=8 (``--quick``: a tiny BERT at tp=2), warm page cache, raw / merge / naive."""
    config, tp = (QUICK_CONFIG, 2) if ctx.quick else (None, TP)
    with _workdir(ctx.merge_workdir) as workdir:
        out = measure("bert-large", workdir, ctx.merge_rounds or (1 if ctx.quick else 3), list(KINDS), config, tp)
    return dict(out, **common.section(tables(out)))


def main(argv=None) -> int:
    parser, args = tool_args("merge_timing", __doc__, argv, {
        "--workdir": dict(help="where the checkpoint is created (reused when it holds one); default: a temporary "
                               "directory, removed at exit"),
        "--rounds": dict(type=int, default=3, help="measurements of each operation (default: 3)"),
        "--no-naive": dict(action="store_true", help="skip the naive read-whole-file copy"),
        "--models": dict(default="bert-large", help=f"comma-separated, from {', '.join(MODELS)}"),
        "--dcp": dict(action="store_true", help="also the DCP export and the two imports of that export")})
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.rounds < 1 or not models or set(models) - set(MODELS):
        parser.error(f"--rounds {args.rounds} (>= 1), --models {args.models!r} (from {', '.join(MODELS)})")
    kinds = [k for k in KINDS if not (args.no_naive and k == "naive")] + (list(DCP_KINDS) if args.dcp else [])
    with _workdir(args.workdir) as workdir:
        outs = [measure(m, workdir, args.rounds, kinds) for m in models]
    # One model: its figures at the top level of the JSON; several: a list of them.
    return emit([b for out in outs for b in tables(out)], outs[0] if len(outs) == 1 else {"models": outs}, args.json)

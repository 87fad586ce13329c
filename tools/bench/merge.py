"""Section 5: checkpoint merge, from tools/bench_merge.py (imported and called; nothing of it is re-implemented).

``bench_merge.main`` measures, each in a fresh process and alternating over rounds, a streaming raw copy of the
checkpoint's model files, ``nxdtp.checkpointing.merge`` into one ``model.safetensors``, and a naive read-whole-file
copy; wall time and peak RSS increase over the process's baseline after its imports. This section runs it with the
page cache warm only (dropping it needs root and would slow everyone else on a shared machine) and reports its
medians.

Full: BERT-large saved at tp=8, as bench_merge creates it (torchrun, 8 gloo ranks). ``--quick``: a tiny BERT saved
at tp=2 by the same ``bench_merge.worker_create`` (its module-level config swapped for the tiny one), run on the two
nxdtp worker processes of section 1, which saves starting a torchrun world.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import tempfile
from typing import Any, Dict, Optional

from . import merge_timing as bench_merge
from .common import fmt, log, markdown_table, stdout_to_stderr, verdict

QUICK_CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, vocab_size=1000,
                    max_position_embeddings=64, type_vocab_size=2)
QUICK_TP = 2


@contextlib.contextmanager
def _bench_merge_model(config: Dict[str, int], tp: int):
    """bench_merge with another model config and tp (module globals; restored on exit)."""
    saved = bench_merge.BERT_LARGE, bench_merge.TP
    bench_merge.BERT_LARGE, bench_merge.TP = dict(config), tp
    try:
        yield bench_merge
    finally:
        bench_merge.BERT_LARGE, bench_merge.TP = saved


@contextlib.contextmanager
def _inside_current_world():
    """Let bench_merge.worker_create run on ranks that already joined a world and a tp=world topology: its own
    init / destroy calls become no-ops for the duration."""
    import torch.distributed as dist

    from nxdtp import parallel_state

    names = ((dist, "init_process_group"), (dist, "destroy_process_group"),
             (parallel_state, "initialize_model_parallel"), (parallel_state, "destroy_model_parallel"))
    saved = [(owner, name, getattr(owner, name)) for owner, name in names]
    for owner, name in names:
        setattr(owner, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def create_checkpoint(config: Dict[str, int], checkpoint_dir: str) -> str:
    """Runs on every rank of the nxdtp workers (tp = world = 2): bench_merge.worker_create with the given config.
    Section 1 leaves its tp=world topology installed on these workers; without section 1 (``--sections merge``) it is
    installed here for the call."""
    import torch.distributed as dist

    from nxdtp import parallel_state

    installed_here = not parallel_state.model_parallel_is_initialized()
    if installed_here:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    try:
        with _bench_merge_model(config, dist.get_world_size()) as bench_merge, _inside_current_world():
            bench_merge.worker_create(argparse.Namespace(checkpoint_dir=checkpoint_dir))
    finally:
        if installed_here:
            parallel_state.destroy_model_parallel()
    return checkpoint_dir


def prepare(quick: bool, workdir: Optional[str] = None, competitors=None) -> Dict[str, Any]:
    """Choose the work directory. Under --quick, the nxdtp workers of section 1 (2 gloo ranks with everything
    imported) write the tiny tp=2 checkpoint; a full run leaves the BERT-large one to bench_merge."""
    temporary = workdir is None
    if temporary:
        workdir = tempfile.mkdtemp(prefix="bench_merge_")
    elif quick:
        workdir = os.path.join(workdir, "quick")
    os.makedirs(workdir, exist_ok=True)
    config, tp = (QUICK_CONFIG, QUICK_TP) if quick else (dict(bench_merge.BERT_LARGE), bench_merge.TP)
    checkpoint_dir = os.path.join(workdir, bench_merge.CHECKPOINT_NAME)
    if quick and bench_merge._tag_dir(checkpoint_dir) is None:
        group = competitors.get("nxdtp")
        if group.world_size != tp:
            raise AssertionError(f"the quick checkpoint is tp={tp}, the nxdtp workers are {group.world_size} ranks")
        log(f"checkpoint merge: writing a tiny tp={tp} checkpoint (bench_merge.worker_create on the nxdtp workers)")
        group.call("call", target="bench.merge:create_checkpoint",
                   kwargs={"config": config, "checkpoint_dir": checkpoint_dir})
    return {"workdir": workdir, "temporary": temporary, "config": config, "tp": tp, "checkpoint_dir": checkpoint_dir}


def cleanup(prepared: Optional[Dict[str, Any]]) -> None:
    """Remove a temporary work directory (run() does it too; this covers a run that stopped before section 5)."""
    if prepared and prepared["temporary"]:
        shutil.rmtree(prepared["workdir"], ignore_errors=True)


def run(prepared: Dict[str, Any], rounds: int) -> Dict[str, Any]:
    workdir = prepared["workdir"]
    try:
        log(f"checkpoint merge: tools/bench_merge.py, {rounds} round(s), warm page cache"
            + ("" if bench_merge._tag_dir(prepared["checkpoint_dir"]) else " (creating the BERT-large tp=8 "
               "checkpoint first)"))
        json_path = os.path.join(workdir, "bench_merge.json")
        printed = io.StringIO()
        with _bench_merge_model(prepared["config"], prepared["tp"]), stdout_to_stderr(), \
                contextlib.redirect_stdout(printed):
            bench_merge.main(["--workdir", workdir, "--rounds", str(rounds), "--cache", "warm", "--json", json_path])
        with open(json_path) as f:
            figures = json.load(f)
    finally:
        if prepared["temporary"]:
            shutil.rmtree(workdir, ignore_errors=True)
    s = figures["results"]["warm"]["summary"]
    out = {"model_config": figures["model_config"], "tp": figures["tp"], "rounds": figures["rounds"], "cache": "warm",
           "checkpoint_bytes": figures["checkpoint_bytes"], "model_files": figures["model_files"],
           "targets": figures["targets"], "summary": s, "bench_merge_json": figures,
           "bench_merge_output": printed.getvalue()}
    out["numbers"] = {
        "merge_s": s["merge"]["seconds"]["median"], "raw_copy_s": s["raw"]["seconds"]["median"],
        "merge_over_raw": s["wall_ratio"],
        "merge_rss_increase_mib": s["merge"]["increase_mib"]["median"],
        "merge_rss_increase_fraction": s["rss_fraction"],
        "raw_copy_rss_increase_mib": s["raw"]["increase_mib"]["median"],
    }
    if "naive" in s:
        out["numbers"]["naive_copy_s"] = s["naive"]["seconds"]["median"]
        out["numbers"]["naive_copy_rss_increase_mib"] = s["naive"]["increase_mib"]["median"]
    return out


def tables(result: Dict[str, Any]) -> str:
    s = result["summary"]
    ckpt_mib = result["checkpoint_bytes"] / (1 << 20)
    cfg = result["model_config"]
    lines = [f"BertForPreTraining (hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, vocab "
             f"{cfg['vocab_size']}) saved at tp={result['tp']}: {result['model_files']} model files, "
             f"{result['checkpoint_bytes']:,} bytes ({ckpt_mib:.1f} MiB). tools/bench_merge.py, "
             f"{result['rounds']} round(s), page cache warm, medians; RSS increase = peak - the process's RSS after "
             "its imports.", ""]
    rows = []
    for kind in bench_merge.KINDS:
        if kind not in s:
            continue
        k = s[kind]
        rows.append([bench_merge.KIND_LABELS[kind], f"{fmt(k['seconds']['median'])} ({fmt(k['seconds']['min'])}-"
                     f"{fmt(k['seconds']['max'])})", fmt(k["increase_mib"]["median"], 1),
                     f"{fmt(100 * k['increase_mib']['median'] / ckpt_mib, 1)} %"])
    lines.append(markdown_table(["operation", "wall s median (min-max)", "peak RSS increase MiB",
                                 "% of checkpoint"], rows))
    t = result["targets"]
    lines += ["", markdown_table(["figure", "value", "target", "verdict"], [
        ["merge / raw copy wall time", fmt(s["wall_ratio"]), f"<= {t['wall_ratio']:g}",
         verdict(s["wall_ratio"], t["wall_ratio"])],
        ["merge RSS increase / checkpoint size", f"{fmt(100 * s['rss_fraction'], 1)} %",
         f"<= {100 * t['rss_fraction']:g} %", verdict(s["rss_fraction"], t["rss_fraction"])],
    ])]
    return "\n".join(lines)

"""Peak host memory of loading a pretrained Hugging Face BERT: nxdtp's per-rank sharded loading vs. plain HF.

``from_pretrained_sharded`` builds the model on the meta device, shards it, materialises only this rank's shard and
reads only this rank's slices of the checkpoint, so a rank's peak host memory should be about its shard, not the
full model. This script measures that and prints figures; it is a benchmark, not a test (it asserts nothing).

What it does:

1. Writes an HF BERT checkpoint with random weights (``BertForPreTraining(BertConfig(...)).save_pretrained``) into
   ``WORKDIR/bert-<config>``, in a separate process, unless that directory already holds one.
2. Launches ``python -m torch.distributed.run --standalone --nproc_per_node=TP`` on this file (gloo, TP = world
   size). Each rank imports torch / transformers / nxdtp, calls ``init_process_group`` and
   ``initialize_model_parallel``, records its baseline RSS, then calls ``from_pretrained_sharded(dir)`` and records
   its peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``) and the bytes of its own parameters.
3. Measures plain ``BertForPreTraining.from_pretrained(dir)`` in one process the same way.
4. Prints a markdown table and, with ``--json``, writes every figure to a JSON file.

Measurement details:

* baseline = current RSS (``VmRSS``) after the imports and process-group setup; increase = peak - baseline.
* Before loading, the peak-RSS watermark is reset (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0), so the
  peak is the peak *of the load*, not of the imports. Where the reset is refused the peak may predate the load;
  the JSON records ``peak_reset``.
* RSS counts file-backed pages of memory-mapped checkpoints (``RssFile``) as well as private memory (``RssAnon``).
  Mapped checkpoint pages live in the page cache, are shared by every rank mapping the same file and can be
  reclaimed; private pages cannot. A sampling thread records the highest ``RssAnon`` and ``RssFile`` it saw
  (sampled every millisecond or so, so they can miss short spikes: they explain the peak, they do not replace it).
* own shard = sum of ``numel * element_size`` over this rank's unique parameters (tied weights counted once);
  full checkpoint = sum of the tensor bytes the checkpoint's safetensors files hold.
* Threads: ``OMP_NUM_THREADS=1`` in every measuring process. The checkpoint is in the page cache when measured
  (just written, or read by the previous measurement), so the figures are about memory, not disk speed.

Usage::

    python tools/bench_pretrained_loading.py --config base --tp 4 [--workdir DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from .common import child_env, tool_script
from .rss import RssSampler as _RssSampler
from .rss import maxrss_kib as _maxrss_kib
from .rss import proc_status_kib as _proc_status_kib
from .rss import reset_peak_rss as _reset_peak_rss

CONFIGS = {
    # BERT-Large, BERT-Base (Devlin et al.), and BERT-Small (Turc et al.'s miniatures: L=4, H=512).
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "small": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, intermediate_size=2048),
}
COMMON = dict(vocab_size=30522, max_position_embeddings=512, type_vocab_size=2)

MIB = 1 << 20


def _param_bytes(model) -> int:
    unique = {id(p): p for p in model.parameters()}
    return sum(p.numel() * p.element_size() for p in unique.values())


def _measure(load) -> dict:
    """Run ``load()`` and return its memory figures (MiB) relative to the RSS just before it.

    After the load, every parameter is read once (as a first forward pass would): a loader that leaves parameters
    as lazily faulted views of a memory-mapped file shows its resident cost only then.
    """
    import gc

    import torch

    gc.collect()
    before = _proc_status_kib()
    maxrss_before = _maxrss_kib()
    peak_reset = _reset_peak_rss()
    start = time.perf_counter()
    with _RssSampler() as sampler:
        model = load()
    seconds = time.perf_counter() - start
    peak_kib = _maxrss_kib()
    after = _proc_status_kib()
    params = list({id(p): p for p in model.parameters()}.values())
    with torch.no_grad():
        for p in params:
            p.sum()
    touched_peak_kib = _maxrss_kib()
    touched = _proc_status_kib()
    return {
        "baseline_mib": before["VmRSS"] / 1024,
        "baseline_anon_mib": before.get("RssAnon", 0) / 1024,
        "baseline_file_mib": before.get("RssFile", 0) / 1024,
        "maxrss_before_load_mib": maxrss_before / 1024,
        "peak_reset": peak_reset,
        "peak_mib": peak_kib / 1024,
        "peak_vmhwm_mib": after["VmHWM"] / 1024,
        "increase_mib": (peak_kib - before["VmRSS"]) / 1024,
        "sampled_peak_anon_increase_mib": (sampler.peak["RssAnon"] - before.get("RssAnon", 0)) / 1024,
        "sampled_peak_file_increase_mib": (sampler.peak["RssFile"] - before.get("RssFile", 0)) / 1024,
        "after_rss_mib": after["VmRSS"] / 1024,
        "after_anon_increase_mib": (after.get("RssAnon", 0) - before.get("RssAnon", 0)) / 1024,
        "after_file_increase_mib": (after.get("RssFile", 0) - before.get("RssFile", 0)) / 1024,
        "touched_peak_mib": touched_peak_kib / 1024,
        "touched_increase_mib": (touched_peak_kib - before["VmRSS"]) / 1024,
        "touched_anon_increase_mib": (touched.get("RssAnon", 0) - before.get("RssAnon", 0)) / 1024,
        "touched_file_increase_mib": (touched.get("RssFile", 0) - before.get("RssFile", 0)) / 1024,
        "own_params_mib": _param_bytes(model) / MIB,
        "own_numel": sum(p.numel() for p in params),
        "param_dtypes": sorted({str(p.dtype) for p in params}),
        "load_seconds": seconds,
    }


def checkpoint_tensor_bytes(model_dir: str) -> int:
    """Bytes of tensor data in the safetensors files of ``model_dir`` (read from their headers only)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    total = 0
    for file in files:
        with open(os.path.join(model_dir, file), "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    return total


def _checkpoint_exists(model_dir: str) -> bool:
    return os.path.isfile(os.path.join(model_dir, "config.json")) and (
        os.path.isfile(os.path.join(model_dir, "model.safetensors"))
        or os.path.isfile(os.path.join(model_dir, "model.safetensors.index.json")))


# ---- worker entry points (each runs in its own process) --------------------------------------------------------------

def worker_create(args) -> None:
    import torch
    from transformers import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    config = BertConfig(**COMMON, **CONFIGS[args.config], architectures=["BertForPreTraining"])
    model = BertForPreTraining(config)
    model.save_pretrained(args.model_dir)


def _import_everything() -> None:
    """Import what either loader imports, so both baselines hold the same modules and the increase is the load's."""
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import transformers  # noqa: F401
    from transformers import BertConfig, BertForPreTraining  # noqa: F401  (lazy in transformers: import now)

    import nxdtp  # noqa: F401
    from nxdtp import plan  # noqa: F401
    from nxdtp.models import bert, hf_loading  # noqa: F401


def worker_hf(args) -> None:
    _import_everything()
    from transformers import BertForPreTraining

    result = _measure(lambda: BertForPreTraining.from_pretrained(args.model_dir))
    result["rank"] = None
    with open(args.result, "w") as f:
        json.dump(result, f)


def worker_sharded(args) -> None:
    _import_everything()
    import torch.distributed as dist

    from nxdtp import parallel_state
    from nxdtp.models.bert import from_pretrained_sharded

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    rank = dist.get_rank()
    dist.barrier()
    try:
        result = _measure(lambda: from_pretrained_sharded(args.model_dir))
        result["rank"] = rank
        result["tp"] = dist.get_world_size()
        with open(os.path.join(args.result, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


# ---- driver ----------------------------------------------------------------------------------------------------------

def _run(cmd, what: str) -> None:
    print(f"# {what}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, env=child_env(), check=True)
    print(f"# {what}: done in {time.perf_counter() - start:.1f} s", flush=True)


def _version(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "?"


def _fmt(value, digits=1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _table(rows, full_mib: float) -> str:
    header = ("| loader | rank | baseline MiB | peak MiB | increase MiB | own shard MiB | full ckpt MiB "
              "| increase / full | increase / own | anon + MiB (sampled peak) | file-backed + MiB (sampled peak) "
              "| increase MiB after reading all params | load s |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for name, r in rows:
        lines.append(
            f"| {name} | {'-' if r['rank'] is None else r['rank']} | {_fmt(r['baseline_mib'])} | {_fmt(r['peak_mib'])} "
            f"| {_fmt(r['increase_mib'])} | {_fmt(r['own_params_mib'])} | {_fmt(full_mib)} "
            f"| {_fmt(r['increase_mib'] / full_mib, 3)} | {_fmt(r['increase_mib'] / r['own_params_mib'], 2)} "
            f"| {_fmt(r['sampled_peak_anon_increase_mib'])} | {_fmt(r['sampled_peak_file_increase_mib'])} "
            f"| {_fmt(r['touched_increase_mib'])} | {_fmt(r['load_seconds'], 2)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="base", help="BERT size (default: base)")
    parser.add_argument("--tp", type=int, default=4, help="tensor-parallel size = number of ranks (default: 4)")
    parser.add_argument("--workdir", default=None,
                        help="where the checkpoint is written (kept); default: a temporary directory, removed after")
    parser.add_argument("--json", default=None, metavar="OUT", help="also write every figure to this JSON file")
    parser.add_argument("--skip-hf", action="store_true", help="do not measure plain HF from_pretrained")
    # Internal: how this file runs as a worker process.
    parser.add_argument("--worker", choices=("create", "hf", "sharded"), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker is not None:
        {"create": worker_create, "hf": worker_hf, "sharded": worker_sharded}[args.worker](args)
        return 0

    cfg = CONFIGS[args.config]
    for what in ("num_attention_heads", "intermediate_size"):
        if cfg[what] % args.tp:
            parser.error(f"--tp {args.tp} does not divide {what}={cfg[what]} of BERT-{args.config}")

    temporary = args.workdir is None
    workdir = tempfile.mkdtemp(prefix="bench_pretrained_loading_") if temporary else os.path.abspath(args.workdir)
    os.makedirs(workdir, exist_ok=True)
    model_dir = os.path.join(workdir, f"bert-{args.config}")
    results_dir = tempfile.mkdtemp(prefix="results_", dir=workdir)
    me = tool_script("bench_pretrained_loading.py")
    py = sys.executable
    try:
        if _checkpoint_exists(model_dir):
            print(f"# checkpoint: reusing {model_dir}", flush=True)
        else:
            _run([py, me, "--worker", "create", "--config", args.config, "--model-dir", model_dir],
                 "create checkpoint")
        full_bytes = checkpoint_tensor_bytes(model_dir)
        full_mib = full_bytes / MIB

        _run([py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.tp}",
              me, "--worker", "sharded", "--model-dir", model_dir, "--result", results_dir],
             f"from_pretrained_sharded, tp={args.tp}")
        sharded = []
        for rank in range(args.tp):
            with open(os.path.join(results_dir, f"rank{rank}.json")) as f:
                sharded.append(json.load(f))

        hf = None
        if not args.skip_hf:
            hf_result = os.path.join(results_dir, "hf.json")
            _run([py, me, "--worker", "hf", "--model-dir", model_dir, "--result", hf_result],
                 "HF BertForPreTraining.from_pretrained")
            with open(hf_result) as f:
                hf = json.load(f)
    finally:
        shutil.rmtree(workdir if temporary else results_dir, ignore_errors=True)

    rows = [(f"nxdtp from_pretrained_sharded (tp={args.tp})", r) for r in sharded]
    if hf is not None:
        rows.append(("HF from_pretrained (1 process)", hf))
    print()
    print(f"BERT-{args.config} ({', '.join(f'{k}={v}' for k, v in cfg.items())}, vocab {COMMON['vocab_size']}), "
          f"checkpoint tensors {full_mib:.1f} MiB, tp={args.tp}, OMP_NUM_THREADS=1, "
          f"peak-RSS reset before load: {all(r['peak_reset'] for _, r in rows)}")
    print()
    print(_table(rows, full_mib))
    print()
    print("increase = peak RSS of the load (ru_maxrss) - RSS before it. anon = private memory; file-backed = pages "
          "of memory-mapped files (mostly the checkpoint), which sit in the page cache, are shared by every process "
          "mapping the file and are reclaimable. The last increase column is after reading every parameter once.")
    worst = max(sharded, key=lambda r: r["increase_mib"])
    worst_anon = max(r["sampled_peak_anon_increase_mib"] / r["own_params_mib"] for r in sharded)
    print()
    print(f"sharded, worst rank: increase {worst['increase_mib']:.1f} MiB = {worst['increase_mib'] / full_mib:.3f} x "
          f"full checkpoint = {worst['increase_mib'] / worst['own_params_mib']:.2f} x own shard; "
          f"private (anon) increase <= {worst_anon:.2f} x own shard")
    if hf is not None:
        print(f"HF, one process: increase {hf['increase_mib']:.1f} MiB during from_pretrained, "
              f"{hf['touched_increase_mib']:.1f} MiB = {hf['touched_increase_mib'] / full_mib:.3f} x full checkpoint "
              f"once every parameter has been read")

    if args.json:
        out = {"config": args.config, "model_config": {**COMMON, **cfg}, "tp": args.tp,
               "full_checkpoint_bytes": full_bytes, "full_checkpoint_mib": full_mib,
               "sharded": sharded, "hf": hf,
               "env": {"python": sys.version.split()[0], "torch": _version("torch"),
                       "transformers": _version("transformers"), "safetensors": _version("safetensors"),
                       "OMP_NUM_THREADS": "1", "cpu_count": os.cpu_count()}}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"# wrote {args.json}")
    return 0


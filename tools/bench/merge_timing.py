"""Wall time and peak host memory of merging a tp=8 BERT-large checkpoint, next to a raw copy of the same bytes.

``nxdtp.checkpointing.merge`` reassembles every tensor of a sharded checkpoint from its TP pieces and streams the
dense tensors into one ``model.safetensors``. This script measures how long that takes and how much memory it needs,
against the lower bound of any streaming merge: reading the same bytes and writing them once. It prints figures; it is
a benchmark, not a test (it asserts nothing).

Targets: merge wall time <= 2 x the raw copy's, and a peak RSS increase <= 25 % of the checkpoint size.

What it does:

1. Creates the checkpoint in ``WORKDIR/bert-large-tp8`` unless that directory already holds a complete one:
   ``python -m torch.distributed.run --standalone --nproc_per_node=8`` on this file. Each rank (gloo,
   ``initialize_model_parallel(8)``) builds ``BertForPreTraining`` (BERT-large: hidden 1024, 24 layers, 16 heads,
   intermediate 4096, vocab 30522) on the meta device, shards it with ``parallelize_bert(broadcast_replicated=False)``,
   materialises it with ``materialize_meta_model(model, "cpu")``, fills every parameter with N(0, 0.02) values (sharded
   parameters from a per-rank seed, replicated ones from one seed shared by all ranks, so the replicas agree) and calls
   ``nxdtp.checkpointing.save({"model": model, "global_step": 1}, dir)``.
2. Measures, each in a fresh process, ``--rounds`` times, alternating (raw, merge, naive, raw, merge, naive, ...):

   * raw: streaming copy of every file of the tag's ``model/`` directory to a new file, through one reused 16 MiB
     buffer (``readinto`` / ``write``), then ``fsync``. This is "a raw read + write of the same bytes", the floor for a
     merge that streams.
   * merge: ``merge(checkpoint_dir, fresh_output_dir, tag=..., progress=False)``.
   * naive: each rank file read whole (``f.read()``), written, ``fsync``; for context: its RSS increase is the
     largest rank file.

   Each output is deleted after its measurement (outside the timed part). Figures are medians over rounds.
3. Does this with the page cache dropped before every measurement (``cold``: ``sync; echo 3 >
   /proc/sys/vm/drop_caches``, needs root; where refused, it says so and the inputs stay warm) and with the input files
   read once just before (``warm``). ``--cache`` picks one or both.
4. Prints markdown tables and, with ``--json``, writes every figure to a JSON file.

Measurement details:

* Every measuring process imports the same modules (torch, safetensors, tqdm, nxdtp, nxdtp.checkpointing.merge,
  and the HF model classes, which ``import transformers`` loads lazily and the DCP import builds on the meta device)
  before its baseline, so baselines match. baseline = VmRSS after the imports. What importing the model classes cost
  is recorded (``model_code_import``) and printed beside the tables.
* Before the timed call the peak-RSS watermark is reset (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0);
  peak = VmHWM after the call. ``getrusage`` ``ru_maxrss`` is recorded too (it can also hold the watermark of an
  earlier exited thread, which ``clear_refs`` does not reset, so it can only be higher). increase = peak - baseline.
* RSS counts file-backed pages of memory-mapped files (``RssFile``) as well as private memory (``RssAnon``).
  Mapped checkpoint pages live in the page cache and are reclaimable; private pages are not. A sampling thread (every
  2 ms; the raw copy has it too) records the highest ``RssAnon`` / ``RssFile`` it saw: they explain the peak, they can
  miss short spikes.
* Output written with ``write()`` goes to the page cache, which is not in the writer's RSS; both sides ``fsync``, so
  both pay for the disk.
* checkpoint size = bytes of the tag's ``model/`` files (what the raw copy reads and writes); the tensor bytes and
  the merged file's size are printed too. ``OMP_NUM_THREADS=1`` in every measuring process.

Usage::

    python tools/bench_merge.py [--workdir DIR] [--keep] [--rounds 3] [--cache cold|warm|both] [--no-naive]
                                [--models bert-large,llama-1b] [--dcp] [--json OUT]

``--dcp`` adds three operations to the rounds: the export to DCP (``export_dcp``, ``nxdtp-merge --to dcp``), and two
imports of that checkpoint's own export, made once before the rounds: back to an HF directory (``import_dcp``,
``nxdtp-merge --from-dcp``) and to an nxdtp checkpoint at the same TP size (``import_dcp_resharded``, ``nxdtp-merge
--from-dcp --reshard 8``); all three are held to the same targets against the raw copy. ``--models`` measures several
checkpoints in one run (``llama-1b``: a Llama-3.2-1B shape, 1.24 B parameters, tied embeddings); with more than one,
the JSON is ``{"models": [...]}``, one entry per model in the single-model form.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from .common import child_env, tool_script
from .rss import RssSampler as _RssSampler
from .rss import maxrss_kib as _maxrss_kib
from .rss import proc_status_kib as _proc_status_kib
from .rss import reset_peak_rss as _reset_peak_rss

TP = 8
BERT_LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                  vocab_size=30522, max_position_embeddings=512, type_vocab_size=2)
# A Llama-3.2-1B-shaped decoder (GQA: 32 query heads, 8 KV heads; tied embeddings; 1.24 B parameters, 4.9 GB fp32).
LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, vocab_size=128256, max_position_embeddings=2048, tie_word_embeddings=True)
MODELS = ("bert-large", "llama-1b")
CHECKPOINT_NAME = f"bert-large-tp{TP}"
CONFIG_NAME = "config.json"  # written beside the checkpoint; the DCP export copies it, the import builds from it
GLOBAL_STEP = 1
COPY_BUFFER_BYTES = 16 << 20
SAMPLE_INTERVAL_S = 0.002
TARGET_WALL_RATIO = 2.0
TARGET_RSS_FRACTION = 0.25
KINDS = ("raw", "merge", "naive")
DCP_KINDS = ("to_dcp", "from_dcp", "from_dcp_reshard")  # with --dcp
ALL_KINDS = KINDS + DCP_KINDS
# The operations held to the targets against the raw copy.
TARGET_KINDS = ("merge",) + DCP_KINDS
KIND_LABELS = {"raw": "raw copy (stream, 16 MiB buffer, fsync)", "merge": "merge -> model.safetensors",
               "naive": "naive copy (read whole file, write, fsync)",
               "to_dcp": "export -> DCP (nxdtp-merge --to dcp)",
               "from_dcp": "import DCP -> HF dir (nxdtp-merge --from-dcp)",
               "from_dcp_reshard": f"import DCP -> nxdtp checkpoint at tp={TP} (nxdtp-merge --from-dcp --reshard {TP})"}

MIB = 1 << 20



def _measure(run) -> dict:
    """Run ``run()`` and return its wall time and memory figures (MiB) relative to the RSS just before it."""
    import gc

    gc.collect()
    before = _proc_status_kib()
    maxrss_before = _maxrss_kib()
    peak_reset = _reset_peak_rss()
    start = time.perf_counter()
    with _RssSampler(SAMPLE_INTERVAL_S) as sampler:
        run()
    seconds = time.perf_counter() - start
    after = _proc_status_kib()
    maxrss = _maxrss_kib()
    peak_kib = after["VmHWM"] if peak_reset else maxrss
    return {
        "seconds": seconds,
        "baseline_mib": before["VmRSS"] / 1024,
        "baseline_anon_mib": before.get("RssAnon", 0) / 1024,
        "baseline_file_mib": before.get("RssFile", 0) / 1024,
        "peak_reset": peak_reset,
        "peak_mib": peak_kib / 1024,
        "increase_mib": (peak_kib - before["VmRSS"]) / 1024,
        "maxrss_before_mib": maxrss_before / 1024,
        "maxrss_mib": maxrss / 1024,
        "maxrss_increase_mib": (maxrss - before["VmRSS"]) / 1024,
        "sampled_peak_anon_increase_mib": (sampler.peak["RssAnon"] - before.get("RssAnon", 0)) / 1024,
        "sampled_peak_file_increase_mib": (sampler.peak["RssFile"] - before.get("RssFile", 0)) / 1024,
        "after_anon_increase_mib": (after.get("RssAnon", 0) - before.get("RssAnon", 0)) / 1024,
        "after_file_increase_mib": (after.get("RssFile", 0) - before.get("RssFile", 0)) / 1024,
    }


# ---- checkpoint layout (no torch needed) -----------------------------------------------------------------------------

def _tag_dir(checkpoint_dir: str):
    """The newest complete tag directory of ``checkpoint_dir``, or None."""
    try:
        with open(os.path.join(checkpoint_dir, "newest")) as f:
            tag = f.read().strip()
    except OSError:
        return None
    tag_dir = os.path.join(checkpoint_dir, tag)
    return tag_dir if tag and os.path.isfile(os.path.join(tag_dir, "done")) else None


def _model_files(tag_dir: str):
    model_dir = os.path.join(tag_dir, "model")
    return [os.path.join(model_dir, f) for f in sorted(os.listdir(model_dir)) if f.endswith(".safetensors")]


def _safetensors_tensor_bytes(path: str):
    """(tensor count, bytes of tensor data) of a safetensors file, from its header."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    spans = [v["data_offsets"] for k, v in header.items() if k != "__metadata__"]
    return len(spans), sum(end - begin for begin, end in spans)


# ---- worker entry points (each runs in its own process) --------------------------------------------------------------

def _import_everything() -> None:
    """What the merge imports, in every measuring process, so the baselines hold the same modules."""
    import safetensors  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import tqdm  # noqa: F401
    import transformers  # noqa: F401 - the DCP import builds the model on the meta device

    import nxdtp  # noqa: F401
    import nxdtp.checkpointing  # noqa: F401
    import nxdtp.checkpointing.dcp_export  # noqa: F401
    import nxdtp.checkpointing.dcp_import  # noqa: F401
    import nxdtp.checkpointing.merge  # noqa: F401
    import nxdtp.converters.dcp  # noqa: F401
    import nxdtp.models  # noqa: F401 - the resharding import shards the model's description by its plan

    MODEL_CODE_IMPORT.update(_import_model_code())


# What importing the HF model classes cost the measuring process (set by _import_everything).
MODEL_CODE_IMPORT: dict = {}


def _import_model_code() -> dict:
    """Import the model classes the DCP import builds on the meta device, and say what that cost (seconds, RSS MiB).
    ``import transformers`` loads them lazily, so without this the import's figures would count the loading of
    transformers' model code (about 230 MiB of RSS and 1.5-5 s on the development machine), which any process that
    builds the model pays once, as it pays ``import torch``; the benchmark reports it beside the figures instead."""
    before, start = _proc_status_kib(), time.perf_counter()
    from transformers import BertForPreTraining, LlamaForCausalLM  # noqa: F401

    after = _proc_status_kib()
    return {"seconds": time.perf_counter() - start, "rss_mib": (after["VmRSS"] - before["VmRSS"]) / 1024}


def checkpoint_name(model: str) -> str:
    return CHECKPOINT_NAME if model == "bert-large" else f"{model}-tp{TP}"


def _model_and_config(model_name: str):
    """The HF model class and config of ``model_name`` (read at call time: section 5 swaps BERT_LARGE and TP)."""
    from transformers import BertConfig, BertForPreTraining, LlamaConfig, LlamaForCausalLM

    if model_name == "bert-large":
        return BertForPreTraining, BertConfig(**BERT_LARGE, architectures=["BertForPreTraining"])
    if model_name == "llama-1b":
        return LlamaForCausalLM, LlamaConfig(**LLAMA_1B, architectures=["LlamaForCausalLM"])
    raise ValueError(f"unknown model {model_name!r}; choose from {list(MODELS)}")


def worker_create(args) -> None:
    import torch
    import torch.distributed as dist

    import nxdtp.checkpointing
    from nxdtp import parallel_state
    from nxdtp.models import parallelize_model
    from nxdtp.models.hf_loading import materialize_meta_model

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    rank = dist.get_rank()
    try:
        model_class, config = _model_and_config(getattr(args, "model", None) or "bert-large")
        with torch.device("meta"):
            model = model_class(config)
        parallelize_model(model, broadcast_replicated=False)
        materialize_meta_model(model, "cpu")
        # Same parameter order on every rank: replicated parameters draw the same values everywhere.
        replicated = torch.Generator().manual_seed(1234)
        own = torch.Generator().manual_seed(10_000 + rank)
        with torch.no_grad():
            for _, param in model.named_parameters():  # tied parameters once
                sharded = bool(getattr(param, "tensor_model_parallel", False))
                param.normal_(0.0, 0.02, generator=own if sharded else replicated)
            for _, buffer in model.named_buffers():  # non-persistent in HF BERT; keep them defined anyway
                buffer.zero_()
        tag_dir = nxdtp.checkpointing.save({"model": model, "global_step": GLOBAL_STEP}, args.checkpoint_dir)
        if rank == 0:
            config.to_json_file(os.path.join(args.checkpoint_dir, CONFIG_NAME))
            print(f"# saved {tag_dir}", flush=True)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _copy_stream(sources, destination_dir: str) -> int:
    buffer = bytearray(COPY_BUFFER_BYTES)
    view = memoryview(buffer)
    total = 0
    for source in sources:
        with open(source, "rb", buffering=0) as src, \
                open(os.path.join(destination_dir, os.path.basename(source)), "wb", buffering=0) as dst:
            while True:
                n = src.readinto(buffer)
                if not n:
                    break
                written = 0
                while written < n:
                    written += dst.write(view[written:n])
                total += n
            os.fsync(dst.fileno())
    return total


def _copy_naive(sources, destination_dir: str) -> int:
    total = 0
    for source in sources:
        with open(source, "rb") as src:
            data = src.read()
        with open(os.path.join(destination_dir, os.path.basename(source)), "wb") as dst:
            dst.write(data)
            dst.flush()
            os.fsync(dst.fileno())
        total += len(data)
        del data
    return total


def worker_measure(args) -> None:
    _import_everything()
    tag_dir = _tag_dir(args.checkpoint_dir)
    sources = _model_files(tag_dir)
    outcome = {}
    config = os.path.join(args.checkpoint_dir, CONFIG_NAME)
    if args.worker == "merge":
        from nxdtp.checkpointing.merge import merge

        def run():
            outcome["path"] = merge(args.checkpoint_dir, args.output_dir, tag=os.path.basename(tag_dir),
                                    progress=False)
    elif args.worker == "to_dcp":
        from nxdtp.checkpointing.dcp_export import export_dcp

        def run():
            export_dcp(args.checkpoint_dir, args.output_dir, tag=os.path.basename(tag_dir), progress=False,
                       config=config)
    elif args.worker == "from_dcp":
        from nxdtp.checkpointing.dcp_import import import_dcp

        def run():
            import_dcp(args.dcp_dir, args.output_dir, config=config, progress=False)
    elif args.worker == "from_dcp_reshard":
        from nxdtp.converters.dcp import import_dcp_resharded

        def run():
            import_dcp_resharded(args.dcp_dir, args.output_dir, TP, config=config, progress=False)
    else:
        os.makedirs(args.output_dir)
        copy = _copy_stream if args.worker == "raw" else _copy_naive

        def run():
            outcome["bytes"] = copy(sources, args.output_dir)

    result = _measure(run)
    result["kind"] = args.worker
    result["model_code_import"] = dict(MODEL_CODE_IMPORT)
    if args.worker in DCP_KINDS:
        result["output_bytes"] = _directory_bytes(args.output_dir)
    elif args.worker == "merge":
        result["output_file"] = outcome["path"]
        result["output_bytes"] = os.path.getsize(outcome["path"])
        result["output_tensors"], result["output_tensor_bytes"] = _safetensors_tensor_bytes(outcome["path"])
    else:
        result["output_bytes"] = outcome["bytes"]
    with open(args.result, "w") as f:
        json.dump(result, f)


def _directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


# ---- driver ----------------------------------------------------------------------------------------------------------

def _run(cmd, what: str, quiet: bool = False) -> None:
    if not quiet:
        print(f"# {what}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, env=child_env(), check=True)
    if not quiet:
        print(f"# {what}: done in {time.perf_counter() - start:.1f} s", flush=True)


def _drop_page_cache() -> str:
    """'' when the kernel dropped the page cache, else why not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return ""
    except OSError as e:
        return f"{type(e).__name__}: {e}"


def _warm(paths) -> None:
    buffer = bytearray(COPY_BUFFER_BYTES)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
    os.sync()


def _version(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "?"


def _stats(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _fmt(value, digits=2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _summarise(runs, checkpoint_bytes: int) -> dict:
    """Per kind: median/min/max of wall and RSS figures over the rounds."""
    summary = {}
    for kind in ALL_KINDS:
        rs = [r for r in runs if r["kind"] == kind]
        if not rs:
            continue
        summary[kind] = {field: _stats([r[field] for r in rs]) for field in
                         ("seconds", "increase_mib", "maxrss_increase_mib", "sampled_peak_anon_increase_mib",
                          "sampled_peak_file_increase_mib")}
        summary[kind]["rounds"] = len(rs)
    raws = [r for r in runs if r["kind"] == "raw"]
    summary["targets"] = {}
    for kind in TARGET_KINDS:
        if kind not in summary:
            continue
        ratio = summary[kind]["seconds"]["median"] / summary["raw"]["seconds"]["median"]
        rss_fraction = summary[kind]["increase_mib"]["median"] * MIB / checkpoint_bytes
        summary["targets"][kind] = {
            "wall_ratio": ratio, "rss_fraction": rss_fraction,
            "wall_ratio_per_round": [o["seconds"] / r["seconds"]
                                     for r, o in zip(raws, [r for r in runs if r["kind"] == kind])],
            "wall_target_met": ratio <= TARGET_WALL_RATIO, "rss_target_met": rss_fraction <= TARGET_RSS_FRACTION}
    if "merge" in summary["targets"]:  # section 5 and earlier JSON readers take the merge's figures at the top
        summary.update({key: value for key, value in summary["targets"]["merge"].items()})
    return summary


def _tables(results, checkpoint_bytes: int) -> str:
    ckpt_mib = checkpoint_bytes / MIB
    header = ("| cache | operation | wall s median | wall s min | wall s max | peak RSS increase MiB median (min-max) "
              "| % of checkpoint | anon + MiB (sampled) | file-backed + MiB (sampled) |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for cache, block in results.items():
        s = block["summary"]
        for kind in ALL_KINDS:
            if kind not in s:
                continue
            k = s[kind]
            lines.append(
                f"| {cache} | {KIND_LABELS[kind]} | {_fmt(k['seconds']['median'])} | {_fmt(k['seconds']['min'])} "
                f"| {_fmt(k['seconds']['max'])} | {_fmt(k['increase_mib']['median'], 1)} "
                f"({_fmt(k['increase_mib']['min'], 1)}-{_fmt(k['increase_mib']['max'], 1)}) "
                f"| {_fmt(100 * k['increase_mib']['median'] / ckpt_mib, 1)} % "
                f"| {_fmt(k['sampled_peak_anon_increase_mib']['median'], 1)} "
                f"| {_fmt(k['sampled_peak_file_increase_mib']['median'], 1)} |")
    lines.append("")
    header = ("| cache | operation | checkpoint bytes | wall s median (min-max) | raw copy wall s median | op / raw "
              f"(target <= {TARGET_WALL_RATIO:g}) | RSS increase MiB | % of checkpoint (target <= "
              f"{100 * TARGET_RSS_FRACTION:g} %) | raw copy RSS increase MiB | naive copy RSS increase MiB |")
    lines += [header, "|" + "---|" * (header.count("|") - 1)]
    for cache, block in results.items():
        s = block["summary"]
        r = s["raw"]
        naive = _fmt(s["naive"]["increase_mib"]["median"], 1) if "naive" in s else "-"
        for kind, t in s["targets"].items():
            m = s[kind]
            wall = (f"{t['wall_ratio']:.2f}: {'met' if t['wall_target_met'] else 'MISSED'} "
                    f"({t['wall_ratio'] / TARGET_WALL_RATIO:.2f} x the limit)")
            rss = (f"{100 * t['rss_fraction']:.1f} %: {'met' if t['rss_target_met'] else 'MISSED'} "
                   f"({t['rss_fraction'] / TARGET_RSS_FRACTION:.2f} x the limit, "
                   f"{100 * (t['rss_fraction'] - TARGET_RSS_FRACTION):+.1f} points)")
            lines.append(
                f"| {cache} | {kind} | {checkpoint_bytes:,} ({ckpt_mib:.1f} MiB) | {_fmt(m['seconds']['median'])} "
                f"({_fmt(m['seconds']['min'])}-{_fmt(m['seconds']['max'])}) | {_fmt(r['seconds']['median'])} "
                f"| {wall} | {_fmt(m['increase_mib']['median'], 1)} | {rss} | {_fmt(r['increase_mib']['median'], 1)} "
                f"| {naive} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=None,
                        help="where the checkpoint is created (reused when it holds one; outputs are written beside "
                             "it and deleted); default: a temporary directory, removed at exit unless --keep")
    parser.add_argument("--keep", action="store_true", help="keep the temporary work directory (and say where)")
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each operation (default: 3)")
    parser.add_argument("--cache", choices=("cold", "warm", "both"), default="both",
                        help="drop the page cache before each measurement (cold, needs root), read the inputs "
                             "just before (warm), or both (default)")
    parser.add_argument("--no-naive", action="store_true", help="skip the naive read-whole-file copy")
    parser.add_argument("--models", default="bert-large",
                        help=f"comma-separated, from {', '.join(MODELS)} (default: bert-large); each is saved at "
                             f"tp={TP} and measured in turn")
    parser.add_argument("--dcp", action="store_true",
                        help="also measure the DCP bridge: export to DCP (nxdtp-merge --to dcp) and import of that "
                             "export back to an HF directory (nxdtp-merge --from-dcp) and to an nxdtp checkpoint "
                             "(--from-dcp --reshard 8)")
    parser.add_argument("--json", default=None, metavar="OUT", help="also write every figure to this JSON file")
    # Internal: how this file runs as a worker process.
    parser.add_argument("--worker", choices=("create",) + ALL_KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-dir", help=argparse.SUPPRESS)
    parser.add_argument("--dcp-dir", help=argparse.SUPPRESS)
    parser.add_argument("--output-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.worker is not None:
        (worker_create if args.worker == "create" else worker_measure)(args)
        return 0
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown or not models:
        parser.error(f"--models {args.models!r}: unknown {unknown}; choose from {', '.join(MODELS)}")

    temporary = args.workdir is None
    workdir = tempfile.mkdtemp(prefix="bench_merge_") if temporary else os.path.abspath(args.workdir)
    os.makedirs(workdir, exist_ok=True)
    outs = []
    try:
        for model in models:
            outs.append(_bench_model(model, args, workdir))
    finally:
        if temporary and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        elif temporary:
            print(f"# kept {workdir}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            # One model: its figures at the top level (what section 5 reads); several: a list of them.
            json.dump(outs[0] if len(outs) == 1 else {"models": outs}, f, indent=2)
        print(f"# wrote {args.json}")
    return 0


def _measure_round(me: str, kind: str, cache: str, checkpoint_dir: str, dcp_dir: str, scratch: str, round_: int,
                   sources, model: str) -> dict:
    output_dir = os.path.join(scratch, f"{cache}-{kind}-{round_}")
    result_path = os.path.join(scratch, f"{cache}-{kind}-{round_}.json")
    if cache == "warm":
        _warm(_files_under(dcp_dir) if kind.startswith("from_dcp") else sources)
    _run([sys.executable, me, "--worker", kind, "--model", model, "--checkpoint-dir", checkpoint_dir,
          "--dcp-dir", dcp_dir, "--output-dir", output_dir, "--result", result_path],
         f"{cache} {kind} round {round_ + 1}", quiet=True)
    with open(result_path) as f:
        r = json.load(f)
    r["round"] = round_
    print(f"# {model} {cache} round {round_ + 1} {kind:8s}: {r['seconds']:.2f} s, peak RSS +"
          f"{r['increase_mib']:.1f} MiB (anon +{r['sampled_peak_anon_increase_mib']:.1f}, "
          f"file-backed +{r['sampled_peak_file_increase_mib']:.1f})", flush=True)
    shutil.rmtree(output_dir, ignore_errors=True)
    return r


def _print_model_code_import(results) -> None:
    imports = [r["model_code_import"] for b in results.values() for r in b["runs"] if r.get("model_code_import")]
    if imports:
        print(f"Importing the HF model classes before each baseline (not in the figures) took "
              f"{statistics.median(i['seconds'] for i in imports):.2f} s and "
              f"{statistics.median(i['rss_mib'] for i in imports):.1f} MiB of RSS (medians over the processes).")


def _files_under(path: str):
    return sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names)


def _bench_model(model: str, args, workdir: str) -> dict:
    """Create (or reuse) ``model``'s tp=TP checkpoint in ``workdir`` and measure every operation on it."""
    checkpoint_dir = os.path.join(workdir, checkpoint_name(model))
    dcp_dir = os.path.join(workdir, checkpoint_name(model) + "-dcp")
    scratch = tempfile.mkdtemp(prefix="run_", dir=workdir)
    me = tool_script("bench_merge.py")
    py = sys.executable
    kinds = [k for k in KINDS if not (args.no_naive and k == "naive")] + (list(DCP_KINDS) if args.dcp else [])
    caches = ["cold", "warm"] if args.cache == "both" else [args.cache]
    results = {}
    try:
        if _tag_dir(checkpoint_dir) is not None:
            print(f"# checkpoint: reusing {checkpoint_dir}", flush=True)
        else:
            _run([py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={TP}", me, "--worker",
                  "create", "--model", model, "--checkpoint-dir", checkpoint_dir], f"create {model} (tp={TP})")
        tag_dir = _tag_dir(checkpoint_dir)
        sources = _model_files(tag_dir)
        checkpoint_bytes = sum(os.path.getsize(p) for p in sources)
        counted = [_safetensors_tensor_bytes(p) for p in sources]
        tensor_bytes = sum(b for _, b in counted)
        print(f"# checkpoint {tag_dir}: {len(sources)} model files, {checkpoint_bytes:,} bytes "
              f"({tensor_bytes:,} of tensor data, {sum(n for n, _ in counted)} pieces)", flush=True)
        if args.dcp and not os.path.isfile(os.path.join(dcp_dir, ".metadata")):
            # The import's input: this checkpoint's own export, made once (its timing is not a measurement).
            shutil.rmtree(dcp_dir, ignore_errors=True)
            _run([py, me, "--worker", "to_dcp", "--model", model, "--checkpoint-dir", checkpoint_dir, "--output-dir",
                  dcp_dir, "--result", os.path.join(scratch, "export-once.json")], f"export {model} to DCP once")

        drop_refused = None
        for cache in caches:
            if cache == "cold" and drop_refused:
                print(f"# cold: skipped, the page cache cannot be dropped ({drop_refused})", flush=True)
                continue
            runs = []
            for round_ in range(args.rounds):
                for kind in kinds:
                    if cache == "cold":
                        drop_refused = _drop_page_cache() or None
                        if drop_refused:
                            break
                    runs.append(_measure_round(me, kind, cache, checkpoint_dir, dcp_dir, scratch, round_, sources,
                                               model))
                if drop_refused:
                    break
            if drop_refused:
                print(f"# cold: the page cache cannot be dropped ({drop_refused}); only warm figures follow",
                      flush=True)
                if "warm" not in caches:
                    caches.append("warm")
                continue
            results[cache] = {"runs": runs, "summary": _summarise(runs, checkpoint_bytes)}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    config = BERT_LARGE if model == "bert-large" else LLAMA_1B
    merged = next(r for block in results.values() for r in block["runs"] if r["kind"] == "merge")
    print()
    print(f"{model} ({', '.join(f'{k}={v}' for k, v in config.items())}) saved at tp={TP}, "
          f"float32: {len(sources)} model files, {checkpoint_bytes:,} bytes ({checkpoint_bytes / MIB:.1f} MiB), "
          f"{tensor_bytes:,} bytes of tensor data. Merged model.safetensors: {merged['output_bytes']:,} bytes, "
          f"{merged['output_tensors']} tensors. {args.rounds} rounds, medians; OMP_NUM_THREADS=1; "
          f"{os.cpu_count()} CPUs; peak-RSS reset before each call: "
          f"{all(r['peak_reset'] for b in results.values() for r in b['runs'])}; page cache dropped before each cold "
          f"measurement: {'cold' in results}" + (f" (refused: {drop_refused})" if drop_refused else "") + ".")
    print()
    print(_tables(results, checkpoint_bytes))
    print()
    print("increase = peak RSS of the call (VmHWM after resetting it) - RSS before it. anon = private memory; "
          "file-backed = pages of memory-mapped files (the checkpoint's), which sit in the page cache and are "
          "reclaimable. cold: page cache dropped before each measurement; warm: inputs read just before.")
    _print_model_code_import(results)
    for cache, block in results.items():
        for kind, t in block["summary"]["targets"].items():
            print(f"{cache}: {kind} / raw wall per round: {', '.join(f'{x:.2f}' for x in t['wall_ratio_per_round'])}")
    return {"model": model, "model_config": config, "tp": TP, "checkpoint_bytes": checkpoint_bytes,
            "checkpoint_tensor_bytes": tensor_bytes, "model_files": len(sources), "rounds": args.rounds,
            "page_cache_drop_refused": drop_refused, "targets": {"wall_ratio": TARGET_WALL_RATIO,
                                                                 "rss_fraction": TARGET_RSS_FRACTION},
            "results": results,
            "env": {"python": sys.version.split()[0], "torch": _version("torch"),
                    "transformers": _version("transformers"), "safetensors": _version("safetensors"),
                    "OMP_NUM_THREADS": "1", "cpu_count": os.cpu_count()}}

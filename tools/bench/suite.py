"""nxdtp benchmark (issue 6): prints markdown tables and, with ``--json OUT``, writes every figure to a JSON file.

Sections (docs/performance.md explains how each is measured):

1. train   Train step on CPU: BertForPreTraining, dense (1 process) vs nxdtp TP=2 vs PyTorch DTensor TP=2 (2 gloo
           ranks each), one thread per rank, alternating step by step, medians; loss agreement; peak RSS per rank.
           Then a Llama-shaped decoder (LlamaForCausalLM, GQA): dense vs nxdtp TP=2, the same figures.
2. memory  Parameter and AdamW-state bytes per rank of BERT-large at TP = 1, 2, 4, 8 (meta device, simulated
           topology), next to dense/tp and NxD's attention-only recipe.
3. comm    All-reduce / all-gather / reduce-scatter per BERT layer per train step, from the XLA HLO of a simulated
           rank and from a counting 2-rank gloo run, with and without sequence parallelism, next to Megatron's.
4. xla     Compiled and executed XLA graphs per train step on XLA:CPU (tp=1, 10 steps); distinct graphs over every
           rank of simulated tp=8 x dp=4 worlds (BERT-large-shaped and Llama-shaped layers, SP off and on); the
           compile time of one graph.
5. merge   Checkpoint merge time and memory, from tools/bench_merge.py.
6. actmem  Activation memory per rank of BERT-large layers (bytes autograd saves, peak RSS): dense, TP, TP+SP,
           TP+SP+checkpointing at tp = 2, 4, 8 (gloo worlds), fp32 and bf16, next to Megatron's formula.
7. zero1   ZeRO-1 (NeuronZero1Optimizer): bytes per parameter per rank at dp = 1, 2, 4, 8 (BERT-large, Llama-3-8B-shaped
           at tp=8; meta device, counted) next to 6 + 12/d; peak RSS of a tp2 x dp2 step, ZeRO-1 vs plain AdamW + DP
           all-reduce (4 gloo ranks); step time ZeRO-1 / plain DP at tp1 x dp2 and tp2 x dp2, alternating, medians.
8. async_save  The step loop's stall while a checkpoint is written: ``save_checkpoint`` synchronous against
           ``async_save=True`` (tp2 x dp1 gloo world, ZeRO-1 AdamW, Llama-shaped model), alternating rounds, medians.
   gpu     Only with --gpu: section 1's model on one GPU, dense vs nxdtp tp=1 over NCCL.

Usage::

    python tools/benchmark.py [--quick] [--json OUT] [--sections train,memory,comm,xla,merge,actmem,zero1,async_save]
                              [--rounds N] [--warmup N] [--profile] [--nxdtp-vocab-multiple N] [--gpu]
                              [--merge-rounds N] [--merge-workdir DIR]

``--quick``: tiny models and few repeats (a test runs it); its figures check that everything works, not speed.
Progress goes to stderr, the report to stdout.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import sys
import time

from . import common

SECTIONS = ("train", "memory", "comm", "xla", "merge", "actmem", "zero1", "async_save")
OPTIONAL = ("gpu",)  # only when asked for: --gpu or --sections ...,gpu
KEYS = {"train": "train_step", "memory": "memory", "comm": "communication", "xla": "xla_graphs",
        "merge": "checkpoint_merge", "actmem": "activation_memory", "zero1": "zero1", "async_save": "async_save",
        "gpu": "gpu_train_step"}
TITLES = {"train": "1. Train step, CPU", "memory": "2. Memory per rank, BERT-large",
          "comm": "3. Communication per BERT layer", "xla": "4. XLA graphs per step",
          "merge": "5. Checkpoint merge", "actmem": "6. Activation memory per rank, BERT-large layers",
          "zero1": "7. ZeRO-1: bytes per parameter, peak RSS, step time",
          "async_save": "8. Checkpoint stall: save_checkpoint, sync against async_save",
          "gpu": "GPU: train step, dense vs nxdtp tp=1"}


def _run_worker(name: str, worker_args: str, out_path: str) -> int:
    args = json.loads(worker_args)
    if name == "hlo":
        from .communication import hlo_worker as fn
    elif name == "xla-graphs":
        from .xla_graphs import worker as fn
    elif name == "memory-rss":
        from .memory import rss_worker as fn
    else:
        raise SystemExit(f"unknown worker {name!r}")
    result = fn(args)
    if result is not None:
        with open(out_path, "w") as f:
            json.dump(result, f)
    return 0


def _non_finite(numbers: dict) -> list:
    return [k for k, v in numbers.items()
            if v is None or not isinstance(v, (int, float)) or not math.isfinite(float(v))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats (about a minute)")
    parser.add_argument("--json", metavar="OUT", help="write every figure to this JSON file")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed alternating rounds of section 1 (default: 10, --quick: 3)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per competitor (default: 2)")
    parser.add_argument("--nxdtp-vocab-multiple", type=int, default=128, metavar="N",
                        help="section 1: parallelize_bert(make_vocab_size_divisible_by=N) for nxdtp (default 128, as "
                             "the pretraining example uses; 1 is the library default)")
    parser.add_argument("--profile", action="store_true",
                        help="section 1: also profile one step of each competitor (torch.profiler, rank 0)")
    parser.add_argument("--gpu", action="store_true",
                        help="also run section 1's model on one GPU, dense vs nxdtp tp=1 over NCCL")
    parser.add_argument("--gpu-device", default="cuda:0", help=argparse.SUPPRESS)  # "cpu" checks that code path
    parser.add_argument("--merge-rounds", type=int, default=None,
                        help="rounds of tools/bench_merge.py (default: 3, --quick: 1)")
    parser.add_argument("--merge-workdir", default=None,
                        help="where section 5 keeps its checkpoint (reused when present); default: a temporary "
                             "directory")
    # Internal: how this file runs as a worker process.
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-args", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _run_worker(args.worker, args.worker_args, args.worker_out)

    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if args.gpu and "gpu" not in sections:
        sections.append("gpu")
    unknown = sorted(set(sections) - set(SECTIONS + OPTIONAL))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {list(SECTIONS + OPTIONAL)}")
    from . import activation_memory, async_save, communication, memory, merge, train_step, xla_graphs, zero1

    started = time.perf_counter()
    machine = common.machine()
    results, seconds = {}, {}
    spec = train_step.QUICK if args.quick else train_step.FULL
    competitors = train_step.Competitors()
    # Under --quick the sections that run in processes of their own (HLO tracing, XLA graphs) start at once, beside
    # section 1, to use both cores; --quick's timings are not for comparison. A full run does everything one after
    # the other, so nothing disturbs the timed sections.
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2) if args.quick else None

    def later(name, fn, *fn_args):
        def call():
            t0 = time.perf_counter()
            value = fn(*fn_args)
            seconds[name] = time.perf_counter() - t0
            return value
        if pool is None:
            return call
        future = pool.submit(call)
        return future.result

    def timed(name, fn):
        t0 = time.perf_counter()
        results[KEYS[name]] = fn()
        seconds.setdefault(name, time.perf_counter() - t0)
        common.log(f"{TITLES[name]}: done in {time.perf_counter() - t0:.1f} s")

    hlo = later("comm (HLO)", communication.trace_hlo, spec, train_step.SEED) if "comm" in sections else None
    xla = later("xla", xla_graphs.run, args.quick, train_step.SEED) if "xla" in sections else None
    merge_prepared = None
    try:
        try:
            if "train" in sections:
                timed("train", lambda: train_step.run(competitors, args.quick, rounds=args.rounds,
                                                      warmup=args.warmup, profile=args.profile,
                                                      nxdtp_vocab_multiple=args.nxdtp_vocab_multiple))
            if "gpu" in sections:
                timed("gpu", lambda: train_step.run_gpu(competitors, args.quick, device=args.gpu_device,
                                                        rounds=args.rounds, warmup=args.warmup))
            if "comm" in sections:
                timed("comm", lambda: communication.run(competitors, spec, train_step.SEED, hlo()))
            if "merge" in sections:
                merge_prepared = merge.prepare(args.quick, args.merge_workdir, competitors)
            if "memory" in sections:
                # In the dense worker: its torch / transformers / nxdtp imports are already paid for.
                timed("memory", lambda: competitors.get("dense").call("call", target="bench.memory:run")[0])
        finally:
            competitors.close()
        if "memory" in sections:  # fresh processes of its own, after section 1's workers are gone
            t0 = time.perf_counter()
            memory.add_rss(results[KEYS["memory"]], args.quick)
            seconds["memory"] += time.perf_counter() - t0
        if "actmem" in sections:  # gloo worlds of its own, after section 1's workers are gone
            timed("actmem", lambda: activation_memory.run(args.quick))
        if "zero1" in sections:  # gloo worlds of its own, one at a time
            timed("zero1", lambda: zero1.run(args.quick))
        if "async_save" in sections:  # a gloo world of its own
            timed("async_save", lambda: async_save.run(args.quick))
        if "xla" in sections:
            timed("xla", xla)
        if "merge" in sections:
            rounds = args.merge_rounds or (1 if args.quick else 3)
            timed("merge", lambda: merge.run(merge_prepared, rounds))
    finally:
        merge.cleanup(merge_prepared)
    if pool is not None:
        pool.shutdown()
    wall = time.perf_counter() - started
    machine["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None

    renderers = {"train": train_step.tables, "memory": memory.tables, "comm": communication.tables,
                 "xla": xla_graphs.tables, "merge": merge.tables,
                 "actmem": activation_memory.tables, "zero1": zero1.tables, "async_save": async_save.tables,
                 "gpu": train_step.gpu_tables}
    command = "python tools/benchmark.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"# nxdtp benchmark{' (--quick: tiny sizes, not for comparison)' if args.quick else ''}")
    print()
    print(f"{machine['date_utc']}; {machine['cpu_model']}, {machine['logical_cpus']} logical CPUs "
          f"({machine['usable_cpus']} usable), {common.fmt(machine['memory_gib'], 1)} GiB; {machine['platform']}; "
          f"Python {machine['python']}, torch {machine['torch']}, torch-xla {machine['torch_xla']}, transformers "
          f"{machine['transformers']}; load average at start {machine['load_average_at_start']}, at end "
          f"{[round(x, 2) for x in machine['load_average_at_end'] or []]}. Command: `{command.strip()}`; "
          f"{wall:.0f} s.")
    for name in SECTIONS + OPTIONAL:
        if KEYS[name] in results:
            print()
            print(f"## {TITLES[name]}")
            print()
            print(renderers[name](results[KEYS[name]]))
    problems = {KEYS[n]: _non_finite(results[KEYS[n]]["numbers"]) for n in sections}
    problems = {k: v for k, v in problems.items() if v}
    if args.json:
        out = {"command": command.strip(), "quick": args.quick, "sections_run": sections, "machine": machine,
               "wall_s": wall, "section_wall_s": seconds, "sections": results, "non_finite_numbers": problems}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
        common.log(f"wrote {args.json}")
    if problems:
        common.log(f"sections with missing or non-finite numbers: {problems}")
        return 1
    return 0


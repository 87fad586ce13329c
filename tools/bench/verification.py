"""What checksum verification costs: merge and load of a BERT-large tp=8 checkpoint with and without it.

Every measurement runs in a fresh process, with the input files read once just before (warm page cache), and the
four kinds alternate round by round (merge verified, merge unverified, load verified, load unverified, ...), so a
disturbance of the machine hits all alike. Figures are medians over ``--rounds``. It prints a markdown table; it is a
benchmark, not a test.

* merge: ``merge(checkpoint_dir, fresh_out, verify=...)``, which with ``verify=True`` reads every model file once more
  to check its checksum before writing anything.
* load: what ``load`` reads on one rank, in one process without a world: ``integrity.read_index``, the checks
  ``load`` makes before reading (``integrity.verify_files(..., tensors_as_read=True)``: sizes, and whole-file
  checksums of files without per-tensor records), then ``read_model_shard`` for TP rank ``--load-rank`` (its own file
  and TP rank 0's replicated tensors, memory-mapped; verified, each tensor is hashed right after it is read, and each
  file's header before it is parsed), and last every tensor copied once (``clone``) after the ranks would agree that
  nothing is damaged.
* load-live: the same, but the copy goes into tensors allocated and written before the clock starts (``copy_``), as
  ``load_state_dict`` copies into a live model's parameters. ``clone`` also pays for fresh memory (page faults and
  zeroing, most of its time here), so "load" understates what verification adds to a real load and "load-live"
  shows it.

"time in verification" is the time spent inside ``verify_files`` and ``TensorChecks`` (the hashing, measured in the
run), which is free of the run-to-run noise of the machine. The CPU time of each measurement (the process's, so it
leaves out waiting for a core on a busy machine) is reported beside the wall time.

The checkpoint is the one ``tools/bench_merge.py`` creates (``bert-large-tp8`` in ``--workdir``); it is created the
same way when absent (``torch.distributed.run --nproc_per_node=8 tools/bench_merge.py --worker create``).

Usage::

    python tools/bench_verify.py --workdir DIR [--rounds 5] [--operations merge,load,load-live] [--load-rank 1]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from .common import child_env, tool_script

CHECKPOINT_NAME = "bert-large-tp8"
OPERATIONS = ("merge", "load", "load-live")
KINDS = tuple(kind for op in OPERATIONS for kind in (op, f"{op}-unverified"))
TARGET_OVERHEAD = 0.10


def _tag_dir(checkpoint_dir: str):
    try:
        with open(os.path.join(checkpoint_dir, "newest")) as f:
            tag_dir = os.path.join(checkpoint_dir, f.read().strip())
    except OSError:
        return None
    return tag_dir if os.path.isfile(os.path.join(tag_dir, "done")) else None


def _warm(tag_dir: str) -> None:
    buffer = bytearray(16 << 20)
    for dirpath, _, names in os.walk(tag_dir):
        for name in names:
            with open(os.path.join(dirpath, name), "rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass


def worker(args) -> None:
    import torch  # noqa: F401 - imported before the clock starts, as in every kind

    from nxdtp.checkpointing import integrity
    from nxdtp.checkpointing.index import model_file
    from nxdtp.checkpointing.merge import merge
    from nxdtp.checkpointing.save_load import read_model_shard

    tag_dir = _tag_dir(args.checkpoint_dir)
    verify = not args.worker.endswith("unverified")
    verifying = []  # seconds spent verifying: the direct cost, free of the run-to-run noise of the machine

    def timed(function):
        def measured(*a, **k):
            began = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                verifying.append(time.perf_counter() - began)
        return measured

    integrity.verify_files = timed(integrity.verify_files)
    integrity.TensorChecks.check = timed(integrity.TensorChecks.check)
    integrity.TensorChecks.check_header = timed(integrity.TensorChecks.check_header)
    live = None
    if args.worker.startswith("load-live"):  # the model's parameters, allocated and written before the clock starts
        from nxdtp.checkpointing.index import dtype_from_name

        shapes = integrity.read_index(tag_dir, False)
        live = {key: torch.ones(entry.spec.local_shape(), dtype=dtype_from_name(entry.dtype))
                for key, entry in shapes.tensors.items()}
    start, start_cpu = time.perf_counter(), time.process_time()
    if args.worker.startswith("merge"):
        merge(args.checkpoint_dir, args.output_dir, progress=False, verify=verify)
    else:
        index = integrity.read_index(tag_dir, verify)
        if verify:  # as load() checks before reading
            integrity.verify_files(tag_dir, index, sorted({model_file(args.load_rank), model_file(0)}),
                                   tensors_as_read=True)
        state = read_model_shard(tag_dir, index, args.load_rank, verify)
        if live is None:
            copies = [tensor.clone() for tensor in state.values()]
            copies.clear()  # freed inside the clock, as the previous version of this benchmark did
        else:
            with torch.no_grad():
                for key, tensor in live.items():  # tied aliases are one parameter: copied once
                    tensor.copy_(state[key])
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    with open(args.result, "w") as f:
        json.dump({"kind": args.worker, "seconds": seconds, "cpu_seconds": cpu_seconds,
                   "verify_seconds": sum(verifying)}, f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", help="holds (or gets) the bert-large-tp8 checkpoint (required)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--operations", default=",".join(OPERATIONS),
                        help=f"comma-separated, of {', '.join(OPERATIONS)} (default all)")
    parser.add_argument("--load-rank", type=int, default=1, help="the TP rank whose load is timed (default 1)")
    parser.add_argument("--json", default=None, metavar="OUT")
    parser.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-dir", help=argparse.SUPPRESS)
    parser.add_argument("--output-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.workdir is None:
        parser.error("--workdir is required")
    operations = [op for op in OPERATIONS if op in args.operations.split(",")]
    if not operations or set(args.operations.split(",")) - set(OPERATIONS):
        parser.error(f"--operations {args.operations!r}: give some of {', '.join(OPERATIONS)}, comma-separated")
    kinds = [kind for op in operations for kind in (op, f"{op}-unverified")]

    env = child_env({"OMP_NUM_THREADS": "1"})
    checkpoint_dir = os.path.join(os.path.abspath(args.workdir), CHECKPOINT_NAME)
    if _tag_dir(checkpoint_dir) is None:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8",
                        tool_script("bench_merge.py"), "--worker", "create", "--checkpoint-dir",
                        checkpoint_dir], check=True, env=env)
    tag_dir = _tag_dir(checkpoint_dir)
    size = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(os.path.join(tag_dir, "model")) for n in ns)
    times = {kind: [] for kind in kinds}
    cpu_times = {kind: [] for kind in kinds}
    verify_times = {kind: [] for kind in kinds}
    scratch = os.path.join(os.path.abspath(args.workdir), "bench_verify_out")
    for round_ in range(args.rounds):
        # ABBA: odd rounds run each pair in the other order, so neither side always follows the page-cache warm-up.
        pairs = [kinds[i:i + 2] for i in range(0, len(kinds), 2)]
        for kind in (kinds if round_ % 2 == 0 else [kind for pair in pairs for kind in reversed(pair)]):
            shutil.rmtree(scratch, ignore_errors=True)
            result = scratch + ".json"
            _warm(tag_dir)
            subprocess.run([sys.executable, tool_script("bench_verify.py"), "--worker", kind, "--checkpoint-dir",
                            checkpoint_dir, "--output-dir", scratch, "--result", result,
                            "--load-rank", str(args.load_rank)], check=True, env=env)
            with open(result) as f:
                measured = json.load(f)
            times[kind].append(measured["seconds"])
            cpu_times[kind].append(measured["cpu_seconds"])
            verify_times[kind].append(measured["verify_seconds"])
            print(f"# round {round_ + 1} {kind}: {times[kind][-1]:.3f} s", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    medians = {kind: statistics.median(values) for kind, values in times.items()}
    print(f"\nBERT-large tp=8, model files {size:,} bytes; warm page cache; median of {args.rounds} rounds\n")
    print("| operation | verified s (min-max) | unverified s (min-max) | overhead | CPU s verified / unverified "
          "(overhead) | time in verification | target <= 10 % |")
    print("|---|---|---|---|---|---|---|")
    figures = {}
    for op in operations:
        on, off = medians[op], medians[f"{op}-unverified"]
        cpu_on, cpu_off = statistics.median(cpu_times[op]), statistics.median(cpu_times[f"{op}-unverified"])
        overhead = on / off - 1
        hashing = statistics.median(verify_times[op])
        figures[op] = {"verified": times[op], "unverified": times[f"{op}-unverified"], "overhead": overhead,
                       "cpu_verified": cpu_times[op], "cpu_unverified": cpu_times[f"{op}-unverified"],
                       "verify_seconds": verify_times[op]}
        label = {"merge": "merge (all 8 files)",
                 "load": f"load, TP rank {args.load_rank} (its file + rank 0's), copied with clone",
                 "load-live": f"load, TP rank {args.load_rank}, copied into live tensors"}[op]
        print(f"| {label} | {on:.3f} ({min(times[op]):.3f}-{max(times[op]):.3f}) | {off:.3f} "
              f"({min(times[op + '-unverified']):.3f}-{max(times[op + '-unverified']):.3f}) | {100 * overhead:+.1f} % "
              f"| {cpu_on:.3f} / {cpu_off:.3f} ({100 * (cpu_on / cpu_off - 1):+.1f} %) "
              f"| {hashing:.3f} s ({100 * hashing / off:.1f} % of unverified) "
              f"| {'met' if overhead <= TARGET_OVERHEAD else 'MISSED'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model_bytes": size, "rounds": args.rounds, "figures": figures}, f, indent=1)
    return 0


#!/usr/bin/env python
"""What checksum verification costs: merge and load of a BERT-large tp=8 checkpoint with and without it.

Every measurement runs in a fresh process, with the input files read once just before (warm page cache), and the
four kinds alternate round by round (merge verified, merge unverified, load verified, load unverified, ...), so a
disturbance of the machine hits all alike. Figures are medians over ``--rounds``. It prints a markdown table; it is a
benchmark, not a test.

* merge: ``merge(checkpoint_dir, fresh_out, verify=...)``, which with ``verify=True`` reads every model file once more
  to check its checksum before writing anything.
* load: what ``load`` reads on one rank, in one process without a world: ``integrity.read_index``, then
  ``read_model_shard`` for TP rank ``--load-rank`` (its own file and TP rank 0's, memory-mapped) with every tensor
  copied once, as ``load_state_dict`` does; verified, through ``integrity.read_while_verifying`` as ``load`` does (a
  thread hashes the files while they are read).

The checkpoint is the one ``tools/bench_merge.py`` creates (``bert-large-tp8`` in ``--workdir``); it is created the
same way when absent (``torch.distributed.run --nproc_per_node=8 tools/bench_merge.py --worker create``).

Usage::

    python tools/bench_verify.py --workdir DIR [--rounds 5] [--load-rank 1] [--json OUT]
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

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKPOINT_NAME = "bert-large-tp8"
KINDS = ("merge", "merge-unverified", "load", "load-unverified")
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
    from nxdtp.checkpointing.merge import merge
    from nxdtp.checkpointing.save_load import read_model_shard
    from nxdtp.checkpointing.index import model_file

    tag_dir = _tag_dir(args.checkpoint_dir)
    verify = not args.worker.endswith("unverified")
    verifying = []  # seconds spent in verify_files: the direct cost, free of the run-to-run noise of the disk
    timed_verify = integrity.verify_files

    def verify_files(*a, **k):
        began = time.perf_counter()
        try:
            return timed_verify(*a, **k)
        finally:
            verifying.append(time.perf_counter() - began)

    integrity.verify_files = verify_files
    start = time.perf_counter()
    if args.worker.startswith("merge"):
        merge(args.checkpoint_dir, args.output_dir, progress=False, verify=verify)
    else:
        index = integrity.read_index(tag_dir, verify)

        def read():
            state = read_model_shard(tag_dir, index, args.load_rank)
            return [tensor.clone() for tensor in state.values()]  # the copy load_state_dict makes

        files = sorted({model_file(args.load_rank), model_file(0)}) if verify else None
        _, error = integrity.read_while_verifying(tag_dir, index, files, read)  # as load() reads and verifies
        if error is not None:
            raise error
    seconds = time.perf_counter() - start
    with open(args.result, "w") as f:
        json.dump({"kind": args.worker, "seconds": seconds, "verify_seconds": sum(verifying)}, f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", help="holds (or gets) the bert-large-tp8 checkpoint (required)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--load-rank", type=int, default=1, help="the TP rank whose load is timed (default 1)")
    parser.add_argument("--json", default=None, metavar="OUT")
    parser.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-dir", help=argparse.SUPPRESS)
    parser.add_argument("--output-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        if REPO_ROOT not in sys.path:
            sys.path.insert(0, REPO_ROOT)
        worker(args)
        return 0
    if args.workdir is None:
        parser.error("--workdir is required")

    env = dict(os.environ, OMP_NUM_THREADS="1")
    checkpoint_dir = os.path.join(os.path.abspath(args.workdir), CHECKPOINT_NAME)
    if _tag_dir(checkpoint_dir) is None:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8",
                        os.path.join(REPO_ROOT, "tools", "bench_merge.py"), "--worker", "create", "--checkpoint-dir",
                        checkpoint_dir], check=True, env=env)
    tag_dir = _tag_dir(checkpoint_dir)
    size = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(os.path.join(tag_dir, "model")) for n in ns)
    times = {kind: [] for kind in KINDS}
    verify_times = {kind: [] for kind in KINDS}
    scratch = os.path.join(os.path.abspath(args.workdir), "bench_verify_out")
    for round_ in range(args.rounds):
        # ABBA: odd rounds run each pair in the other order, so neither side always follows the page-cache warm-up.
        for kind in (KINDS if round_ % 2 == 0 else KINDS[1::-1] + KINDS[:1:-1]):
            shutil.rmtree(scratch, ignore_errors=True)
            result = scratch + ".json"
            _warm(tag_dir)
            subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", kind, "--checkpoint-dir",
                            checkpoint_dir, "--output-dir", scratch, "--result", result,
                            "--load-rank", str(args.load_rank)], check=True, env=env)
            with open(result) as f:
                measured = json.load(f)
            times[kind].append(measured["seconds"])
            verify_times[kind].append(measured["verify_seconds"])
            print(f"# round {round_ + 1} {kind}: {times[kind][-1]:.3f} s", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    medians = {kind: statistics.median(values) for kind, values in times.items()}
    print(f"\nBERT-large tp=8, model files {size:,} bytes; warm page cache; median of {args.rounds} rounds\n")
    print("| operation | verified s (min-max) | unverified s (min-max) | overhead | time in verify_files | "
          "target <= 10 % |")
    print("|---|---|---|---|---|---|")
    figures = {}
    for op in ("merge", "load"):
        on, off = medians[op], medians[f"{op}-unverified"]
        overhead = on / off - 1
        hashing = statistics.median(verify_times[op])
        figures[op] = {"verified": times[op], "unverified": times[f"{op}-unverified"], "overhead": overhead,
                       "verify_seconds": verify_times[op]}
        label = "merge (all 8 files)" if op == "merge" else f"load, TP rank {args.load_rank} (its file + rank 0's)"
        print(f"| {label} | {on:.2f} ({min(times[op]):.2f}-{max(times[op]):.2f}) | {off:.2f} "
              f"({min(times[op + '-unverified']):.2f}-{max(times[op + '-unverified']):.2f}) | {100 * overhead:+.1f} % "
              f"| {hashing:.3f} s ({100 * hashing / off:.1f} % of unverified) "
              f"| {'met' if overhead <= TARGET_OVERHEAD else 'MISSED'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model_bytes": size, "rounds": args.rounds, "figures": figures}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

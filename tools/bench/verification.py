"""What checksum verification costs: merge and load of merge_timing's BERT-large tp=8 checkpoint with and without it
(``python -m tools.bench verify --help``; docs/performance.md, "Checksum verification cost")."""

from __future__ import annotations

import os
import shutil
import time
from typing import Dict

import torch

from nxdtp.checkpointing import integrity
from nxdtp.checkpointing.index import dtype_from_name, model_file
from nxdtp.checkpointing.merge import merge
from nxdtp.checkpointing.save_load import read_model_shard

from .common import alternate, emit, fresh, median, summary, table, tool_args
from .merge_timing import ensure_checkpoint, files_under, tag_dir, warm

OPERATIONS = ("merge", "load", "load-live")
TARGET_OVERHEAD = 0.10


def _timing_verification(spent: list) -> None:
    """Time every call of the verification functions: their direct cost, free of the machine's noise."""
    def timed(function):
        def measured(*args, **kwargs):
            began = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - began)
        return measured

    integrity.verify_files = timed(integrity.verify_files)
    for name in ("check", "check_header"):
        setattr(integrity.TensorChecks, name, timed(getattr(integrity.TensorChecks, name)))


def _load(tag: str, load_rank: int, verify: bool, live) -> None:
    index = integrity.read_index(tag, verify)
    if verify:  # as load() checks before reading
        integrity.verify_files(tag, index, sorted({model_file(load_rank), model_file(0)}), tensors_as_read=True)
    state = read_model_shard(tag, index, load_rank, verify)
    if live is None:
        copies = [tensor.clone() for tensor in state.values()]
        copies.clear()  # freed inside the clock
        return
    with torch.no_grad():
        for key, tensor in live.items():  # tied aliases are one parameter: copied once
            tensor.copy_(state[key])


def case_verify(kind: str, checkpoint_dir: str, output_dir: str, load_rank: int) -> Dict[str, float]:
    """One measurement, in a fresh process: ``kind`` is an operation, ``-unverified`` for the run without checks."""
    tag, verify, spent = tag_dir(checkpoint_dir), not kind.endswith("unverified"), []
    _timing_verification(spent)
    live = None
    if kind.startswith("load-live"):  # the model's parameters, allocated and written before the clock starts
        live = {key: torch.ones(entry.spec.local_shape(), dtype=dtype_from_name(entry.dtype))
                for key, entry in integrity.read_index(tag, False).tensors.items()}
    start, start_cpu = time.perf_counter(), time.process_time()
    if kind.startswith("merge"):
        merge(checkpoint_dir, output_dir, progress=False, verify=verify)
    else:
        _load(tag, load_rank, verify, live)
    return {"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - start_cpu,
            "verify_seconds": sum(spent)}


def main(argv=None) -> int:
    parser, args = tool_args("verify", __doc__, argv, {
        "--workdir": dict(required=True, help="holds (or gets) the bert-large-tp8 checkpoint"),
        "--rounds": dict(type=int, default=5), "--load-rank": dict(type=int, default=1, help="the TP rank whose load "
                                                                   "is timed (default 1)"),
        "--operations": dict(default=",".join(OPERATIONS), help=f"comma-separated, of {OPERATIONS}")})
    operations = [op for op in OPERATIONS if op in args.operations.split(",")]
    if not operations or set(args.operations.split(",")) - set(OPERATIONS):
        parser.error(f"--operations {args.operations!r}: give some of {', '.join(OPERATIONS)}, comma-separated")
    checkpoint_dir = ensure_checkpoint("bert-large", os.path.abspath(args.workdir))
    tag, scratch = tag_dir(checkpoint_dir), os.path.join(os.path.abspath(args.workdir), "bench_verify_out")

    def one(kind: str) -> Dict[str, float]:
        shutil.rmtree(scratch, ignore_errors=True)
        warm(files_under(tag))
        return fresh(case_verify, kind=kind, checkpoint_dir=checkpoint_dir, output_dir=scratch,
                     load_rank=args.load_rank)[0]

    # ABBA: odd rounds run each pair the other way round, so neither side always follows the warm-up.
    samples = alternate([k for op in operations for k in (op, f"{op}-unverified")], args.rounds, one, swap=True,
                        what="verify")
    shutil.rmtree(scratch, ignore_errors=True)
    size = sum(map(os.path.getsize, files_under(os.path.join(tag, "model"))))
    figures = {}
    for op in operations:
        on, off = samples[op], samples[f"{op}-unverified"]
        f = figures[op] = {name: [r[key] for r in runs] for name, runs, key in (
            ("verified", on, "seconds"), ("unverified", off, "seconds"), ("cpu_verified", on, "cpu_seconds"),
            ("cpu_unverified", off, "cpu_seconds"), ("verify_seconds", on, "verify_seconds"))}
        f.update(overhead=median(f["verified"]) / median(f["unverified"]) - 1,
                 cpu_overhead=median(f["cpu_verified"]) / median(f["cpu_unverified"]) - 1,
                 verification_share=median(f["verify_seconds"]) / median(f["unverified"]))
    labels = {"merge": "merge (all 8 files)",
              "load": f"load, TP rank {args.load_rank} (its file + rank 0's), copied with clone",
              "load-live": f"load, TP rank {args.load_rank}, copied into live tensors"}
    rows = [[labels[op], summary(f["verified"]), summary(f["unverified"]), 100 * f["overhead"],
             [median(f["cpu_verified"]), median(f["cpu_unverified"])], 100 * f["cpu_overhead"],
             median(f["verify_seconds"]), 100 * f["verification_share"],
             "met" if f["overhead"] <= TARGET_OVERHEAD else "MISSED"] for op, f in figures.items()]
    columns = ["operation", "verified s (min-max)|.3f", "unverified s (min-max)|.3f", "overhead %|+.1f",
               "CPU s verified / unverified|.3f", "CPU overhead %|+.1f", "time in verification s|.3f",
               "% of unverified|+.1f", "target <= 10 %"]
    return emit([f"BERT-large tp=8, model files {size:,} bytes; warm page cache; median of {args.rounds} rounds",
                 table(columns, rows)], {"model_bytes": size, "rounds": args.rounds, "figures": figures}, args.json)

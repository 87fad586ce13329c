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

The checkpoint is the one ``merge_timing`` creates (``bert-large-tp8`` in ``--workdir``), created the same way when
absent.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from typing import Any, Dict

from .common import fresh, log, median, render, table
from .merge_timing import ensure_checkpoint, files_under, tag_dir, warm

OPERATIONS = ("merge", "load", "load-live")
TARGET_OVERHEAD = 0.10


def _timing_verification(spent: list) -> None:
    """Time every call of the verification functions (the direct cost, free of the machine's run-to-run noise)."""
    from nxdtp.checkpointing import integrity

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
    import torch

    from nxdtp.checkpointing import integrity
    from nxdtp.checkpointing.index import model_file
    from nxdtp.checkpointing.save_load import read_model_shard

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
    import torch

    from nxdtp.checkpointing import integrity
    from nxdtp.checkpointing.index import dtype_from_name
    from nxdtp.checkpointing.merge import merge

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
    parser = argparse.ArgumentParser(prog="python -m tools.bench verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, help="holds (or gets) the bert-large-tp8 checkpoint")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--operations", default=",".join(OPERATIONS), help=f"comma-separated, of {OPERATIONS}")
    parser.add_argument("--load-rank", type=int, default=1, help="the TP rank whose load is timed (default 1)")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)
    operations = [op for op in OPERATIONS if op in args.operations.split(",")]
    if not operations or set(args.operations.split(",")) - set(OPERATIONS):
        parser.error(f"--operations {args.operations!r}: give some of {', '.join(OPERATIONS)}, comma-separated")
    checkpoint_dir = ensure_checkpoint("bert-large", os.path.abspath(args.workdir))
    tag, scratch = tag_dir(checkpoint_dir), os.path.join(os.path.abspath(args.workdir), "bench_verify_out")
    samples: Dict[str, list] = {f"{op}{v}": [] for op in operations for v in ("", "-unverified")}
    for round_ in range(args.rounds):
        # ABBA: odd rounds run each pair the other way round, so neither side always follows the warm-up.
        for op in operations:
            for kind in (op, f"{op}-unverified")[::1 if round_ % 2 == 0 else -1]:
                shutil.rmtree(scratch, ignore_errors=True)
                warm(files_under(tag))
                samples[kind].append(fresh(case_verify, kind=kind, checkpoint_dir=checkpoint_dir,
                                           output_dir=scratch, load_rank=args.load_rank)[0])
                log(f"verify: round {round_ + 1} {kind}: {samples[kind][-1]['seconds']:.3f} s")
    shutil.rmtree(scratch, ignore_errors=True)
    size = sum(map(os.path.getsize, files_under(os.path.join(tag, "model"))))
    figures = {op: _figures(samples[op], samples[f"{op}-unverified"]) for op in operations}
    print(render(_tables(figures, size, args)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model_bytes": size, "rounds": args.rounds, "figures": figures}, f, indent=1)
    return 0


def _figures(on: list, off: list) -> Dict[str, Any]:
    pick = lambda runs, key: [r[key] for r in runs]  # noqa: E731
    out = {"verified": pick(on, "seconds"), "unverified": pick(off, "seconds"), "cpu_verified": pick(on, "cpu_seconds"),
           "cpu_unverified": pick(off, "cpu_seconds"), "verify_seconds": pick(on, "verify_seconds")}
    out["overhead"] = median(out["verified"]) / median(out["unverified"]) - 1
    out["cpu_overhead"] = median(out["cpu_verified"]) / median(out["cpu_unverified"]) - 1
    out["verification_share"] = median(out["verify_seconds"]) / median(out["unverified"])
    return out


def _tables(figures: Dict[str, Any], size: int, args) -> list:
    from .common import summary

    labels = {"merge": "merge (all 8 files)",
              "load": f"load, TP rank {args.load_rank} (its file + rank 0's), copied with clone",
              "load-live": f"load, TP rank {args.load_rank}, copied into live tensors"}
    rows = [[labels[op], summary(f["verified"]), summary(f["unverified"]), 100 * f["overhead"],
             [median(f["cpu_verified"]), median(f["cpu_unverified"])], 100 * f["cpu_overhead"],
             median(f["verify_seconds"]), 100 * f["verification_share"],
             "met" if f["overhead"] <= TARGET_OVERHEAD else "MISSED"] for op, f in figures.items()]
    columns = ["operation", "verified s (min-max)", "unverified s (min-max)", "overhead %",
               "CPU s verified / unverified", "CPU overhead %", "time in verification s", "% of unverified",
               "target <= 10 %"]
    return [f"BERT-large tp=8, model files {size:,} bytes; warm page cache; median of {args.rounds} rounds",
            table(columns, rows, {c: ".3f" for c in columns[1:3] + columns[4:5] + columns[6:7]}
                  | {c: "+.1f" for c in (columns[3], columns[5], columns[7])})]

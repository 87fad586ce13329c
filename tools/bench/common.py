"""What the sections share: worker pools, models, the machine, statistics, memory probes and the one markdown renderer.
Workers import torch after their thread counts are set, so this module imports it only inside functions."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import math
import os
import platform
import re
import sys
import threading
import time
from statistics import median  # of any iterable: it sorts a copy
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from tests.harness import WorkerGroup

MIB = 1 << 20
BERT_LARGE = dict(vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                  intermediate_size=4096, max_position_embeddings=512, type_vocab_size=2)
SINGLE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                     "TOKENIZERS_PARALLELISM": "false"}
SEED, MAX_GRAD_NORM = 1234, 1.0  # the sections' seed and clipping norm
ADAMW = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
EMPTY = "-"  # a table cell with no figure on purpose; a None cell is a figure that went missing (``figures``)


# ---- worker pools and models -----------------------------------------------------------------------------------------

def case_started(fixed_mmap_threshold: bool) -> int:
    """A fixed glibc mmap threshold (M_MMAP_THRESHOLD = -3, 64 KiB) returns freed tensors to the kernel at once."""
    import torch

    with contextlib.suppress(RuntimeError):  # one inter-op thread too, where none has started yet
        torch.set_num_interop_threads(1)
    if fixed_mmap_threshold:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)
    return os.getpid()


@contextlib.contextmanager
def report_on_stdout():
    """Within: what workers print goes to stderr; what this process prints is held, then printed on stdout."""
    held, saved = io.StringIO(), os.dup(1)
    sys.stdout.flush()
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(held):
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        sys.stdout.write(held.getvalue())
        sys.stdout.flush()


class Pool(WorkerGroup):
    """The test harness's ``WorkerGroup`` of ``world`` single-threaded ranks keeping its topology (TP size ``tp``) and
    module state between calls; ``malloc``: see ``case_started``."""

    def __init__(self, world: int, tp: Optional[int] = None, env: Optional[Dict[str, str]] = None,
                 backend: str = "gloo", malloc: bool = False):
        super().__init__(world, env={**SINGLE_THREAD_ENV, **(env or {})}, backend=backend, keep_topology=True)
        self.tp = tp
        self.run(case_started, tensor_model_parallel_size=None, fixed_mmap_threshold=malloc)

    def call(self, case: Callable, **kwargs) -> List[Any]:
        """``case(**kwargs)`` on every rank; the answers by rank."""
        return self.run(case, tensor_model_parallel_size=self.tp, **kwargs)

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fresh(case: Callable, world: int = 1, tp: Optional[int] = None, malloc: bool = False,
          env: Optional[Dict[str, str]] = None, **kwargs) -> List[Any]:
    """``case(**kwargs)`` in new processes that end after it (memory baselines, cold imports, XLA processes)."""
    with Pool(world, tp, env, malloc=malloc) as pool:
        return pool.call(case, **kwargs)


def barrier() -> None:
    import torch.distributed as dist

    if dist.get_world_size() > 1:
        dist.barrier()


def timed(function: Callable[[], Any]) -> float:
    """The seconds ``function()`` takes, started on every rank at once (after a barrier)."""
    barrier()
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def hf_model(cfg: Dict[str, Any], arch: str = "bert", seed: Optional[int] = None, device: Optional[str] = None,
             **extra):
    """BertForPreTraining, or ``arch``'s ForCausalLM (llama, mixtral), of config ``cfg`` and ``extra``, seeded when
    ``seed`` is given."""
    import torch
    import transformers as tf

    if seed is not None:
        torch.manual_seed(seed)
    name = arch.capitalize()
    cls = getattr(tf, f"{name}ForPreTraining" if arch == "bert" else f"{name}ForCausalLM")
    with torch.device(device) if device else contextlib.nullcontext():
        return cls(getattr(tf, f"{name}Config")(**cfg, **extra))


def model_text(cfg: Dict[str, Any]) -> str:
    return (f"hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} heads"
            + (f" ({cfg['num_key_value_heads']} KV)" if "num_key_value_heads" in cfg else "")
            + f", intermediate {cfg['intermediate_size']}, vocab {cfg['vocab_size']}")


# ---- machine, statistics, log ----------------------------------------------------------------------------------------

def version(package: str) -> Optional[str]:
    from importlib import metadata

    with contextlib.suppress(metadata.PackageNotFoundError):
        return metadata.version(package)
    return None


def _proc_field(path: str, prefix: str) -> Optional[str]:
    with contextlib.suppress(OSError), open(path) as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith(prefix)), None)
    return None


def machine() -> Dict[str, Any]:
    memory = _proc_field("/proc/meminfo", "MemTotal")
    return {"cpu_model": _proc_field("/proc/cpuinfo", "model name") or platform.processor() or "?",
            "logical_cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
            "memory_gib": int(memory.split()[0]) / (1 << 20) if memory else None, "platform": platform.platform(),
            "python": platform.python_version(),
            **{p.replace("-", "_"): version(p) for p in ("torch", "torch-xla", "transformers", "safetensors")},
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}


def summary(values: Iterable[float]) -> Dict[str, Any]:
    values = list(values)
    return {"median": median(values), "min": min(values), "max": max(values), "n": len(values)}


def verdict(value: Optional[float], target: float) -> str:
    if value is None:
        return EMPTY
    return "met" if value <= target else f"MISSED by {(value - target) / target * 100:.1f} %"


def alternate(variants: Sequence[str], rounds: int, run_one: Callable[[str], Any], warmup: int = 0,
              swap: bool = False, what: str = "") -> Dict[str, List[Any]]:
    """``run_one(variant)`` for each variant in turn, ``warmup + rounds`` times (the order reversed every other round
    when ``swap``, so drift hits all alike); the results of the timed rounds by variant."""
    out: Dict[str, List[Any]] = {v: [] for v in variants}
    for index in range(warmup + rounds):
        for variant in (list(reversed(variants)) if swap and index % 2 else variants):
            result = run_one(variant)
            if index >= warmup:
                out[variant].append(result)
        if what:
            log(f"{what}: round {index + 1}/{warmup + rounds}")
    return out


def log(message: str) -> None:
    print(f"# [{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def slowest(per_rank: Sequence[Dict[str, Any]], keys: Iterable[str]) -> Dict[str, Any]:
    """Per key, the largest value over the ranks (None where a rank has None): the slowest or the largest rank."""
    return {k: None if None in (v := [r[k] for r in per_rank]) else max(v) for k in keys}


def tool_args(name: str, doc: str, argv, options: Dict[str, Dict[str, Any]]):
    """``(parser, args)`` of ``python -m tools.bench name``: ``options`` maps each flag to add_argument's keywords;
    ``--json OUT`` is every tool's."""
    parser = argparse.ArgumentParser(prog=f"python -m tools.bench {name}", description=doc)
    for flag, keywords in options.items():
        parser.add_argument(flag, **keywords)
    parser.add_argument("--json", metavar="OUT", help="also write every figure to this JSON file")
    return parser, parser.parse_args(argv)


def emit(blocks: Iterable[Any], data: Any, json_path: Optional[str]) -> int:
    """A tool's end: its report on stdout, ``data`` (its figures) to ``json_path`` when given."""
    print(render(blocks))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(data, f, indent=1, default=str)
        log(f"wrote {json_path}")
    return 0


# ---- memory probes (Linux) -------------------------------------------------------------------------------------------

def proc_status_kib() -> Dict[str, int]:
    """VmRSS, VmHWM (the peak), RssAnon, RssFile of this process, in KiB."""
    with open("/proc/self/status") as f:
        fields = (line.partition(":") for line in f)
        return {k: int(v.split()[0]) for k, _, v in fields if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}


def malloc_trim() -> None:
    """Give the heap's free pages back to the kernel (glibc), so RSS measured next counts what is alive."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError):  # not glibc: the figure then also counts what the heap kept
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def reset_peak_rss() -> bool:
    """Reset this process's peak-RSS watermark (VmHWM) to its current RSS; False where the kernel refuses."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        return f.write("5") > 0
    return False


def rss_mark() -> Callable[[], Dict[str, Any]]:
    """After a gc, reset the peak watermark; the function returned gives the RSS (KiB) before, and the peak (None where
    the reset was refused) and held increases since, with both /proc/self/status readings."""
    import gc

    gc.collect()
    status, peak_reset = proc_status_kib(), reset_peak_rss()
    before = status["VmRSS"]

    def since() -> Dict[str, Any]:
        after = proc_status_kib()
        return {"before": before, "peak": after["VmHWM"] - before if peak_reset else None,
                "held": after["VmRSS"] - before, "status_before": status, "status_after": after}
    return since


def measure_rss(run: Callable[[], Any]) -> tuple:
    """``(run()'s value, figures)``: wall time and memory (MiB) over the RSS before the call; the peak from VmHWM after
    a reset (else ``ru_maxrss``), RssAnon / RssFile sampled every 2 ms by a thread."""
    import resource

    mark, peak, stop = rss_mark(), {"RssAnon": 0, "RssFile": 0}, threading.Event()

    def sample() -> None:
        while True:
            status = proc_status_kib()
            peak.update({k: max(v, status.get(k, 0)) for k, v in peak.items()})
            if stop.wait(0.002):
                return

    sampler = threading.Thread(target=sample, daemon=True)
    start = time.perf_counter()
    sampler.start()
    value = run()
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    rss, maxrss = mark(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    before, after, peak_reset = rss["status_before"], rss["status_after"], rss["peak"] is not None
    top = after["VmHWM"] if peak_reset else maxrss
    return value, {"seconds": seconds, "baseline_mib": before["VmRSS"] / 1024, "peak_reset": peak_reset,
                   "peak_mib": top / 1024, "increase_mib": (top - before["VmRSS"]) / 1024,
                   "maxrss_increase_mib": (maxrss - before["VmRSS"]) / 1024,
                   **{f"sampled_peak_{k[3:].lower()}_increase_mib": (max(peak[k], after.get(k, 0)) - before.get(k, 0))
                      / 1024 for k in peak}}


# ---- the one renderer ------------------------------------------------------------------------------------------------

def fmt_bytes(n: float) -> str:
    if abs(n) < 1024:
        return f"{n:,.0f} B"
    if abs(n) < MIB:
        return f"{n / 1024:,.1f} KiB"
    return f"{n / MIB:,.1f} MiB" if abs(n) < (1 << 30) else f"{n / (1 << 30):,.2f} GiB"


def cell(value: Any, spec: str = "") -> str:
    """One table cell: a number by ``spec`` ("bytes", a format spec, or a readable default), a median/min/max dict as
    "median (min-max)", a list as "a / b", a bool as yes / no, None or NaN as "-"."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, (bool, str)):
        return {True: "yes", False: "no"}.get(value, value) if isinstance(value, bool) else value
    if isinstance(value, dict):
        return f"{cell(value['median'], spec)} ({cell(value['min'], spec)}-{cell(value['max'], spec)})"
    if isinstance(value, (list, tuple)):
        return " / ".join(cell(v, spec) for v in value)
    if spec:
        return fmt_bytes(value) if spec == "bytes" else format(value, spec)
    if isinstance(value, int) or abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) >= 0.001 or value == 0 else f"{value:.2e}"


def table(columns, rows: Iterable[Any], formats: Optional[Dict[str, str]] = None, name: str = "", keys: int = 1):
    """A table as data. A column named "name|spec" is shown as "name" with cells formatted by ``cell(v, spec)``;
    ``formats`` maps more column names to specs. ``name`` and the first ``keys`` columns name its figures (``figures``;
    none for ``keys=0``). ``columns`` as a dict: one row per item of ``rows``, each column the item's value at the key
    it maps to (``EMPTY`` where it has none), or the value of the function it maps to on the item."""
    if isinstance(columns, dict):
        rows = ([f(i) if callable(f) else i.get(f, EMPTY) for f in columns.values()] for i in rows)
    names = [c.split("|")[0] for c in columns]
    specs = {**{n: c.split("|")[1] for n, c in zip(names, columns) if "|" in c}, **(formats or {})}
    return {"columns": names, "rows": [list(r) for r in rows], "formats": specs, "name": name, "keys": keys}


def snake(*parts: Any) -> str:
    return re.sub(r"[^0-9a-z]+", "_", " ".join(map(str, parts)).lower()).strip("_")


def figures(blocks: Iterable[Any], **extra: Any) -> Dict[str, Any]:
    """A section's ``numbers``: ``extra``, then each number in its tables (a median/min/max cell's median, each item
    of a list) as "table name, row, column" in snake case; a row is named by its key cells (a number with its column's
    name: tp=2 is "tp2"). Text cells (``EMPTY`` among them) are no figures; a None cell is kept, as None."""
    out = dict(extra)
    for block in (b for b in blocks if not isinstance(b, str) and b["keys"]):
        k, columns = block["keys"], block["columns"]
        for row in block["rows"]:
            label = [v if isinstance(v, str) else f"{c}{v}" for c, v in zip(columns[:k], row[:k])]
            for column, value in zip(columns[k:], row[k:]):
                value = value["median"] if isinstance(value, dict) else value
                values = value if isinstance(value, (list, tuple)) else [value]
                for i, v in enumerate(values):
                    key = snake(block["name"], *label, column, i + 1 if len(values) > 1 else "")
                    if key in out:
                        raise ValueError(f"two figures named {key!r}: give the table a name or more key columns")
                    if v is None or isinstance(v, (int, float)) and not isinstance(v, bool):
                        out[key] = v
    return out


def section(blocks: List[Any], **extra: Any) -> Dict[str, Any]:
    """A section's ``tables`` and their ``figures`` (with ``extra``)."""
    return {"tables": blocks, "numbers": figures(blocks, **extra)}


def render(blocks: Iterable[Any]) -> str:
    """Markdown of a report: each block is a paragraph (a string) or a ``table``."""
    out = []
    for block in blocks:
        if isinstance(block, str):
            out.append(block)
            continue
        specs = [block["formats"].get(c, "") for c in block["columns"]]
        lines = ["| " + " | ".join(block["columns"]) + " |", "|" + "---|" * len(specs)]
        lines += ["| " + " | ".join(cell(v, s) for v, s in zip(row, specs)) + " |" for row in block["rows"]]
        out.append("\n".join(lines))
    return "\n\n".join(out)

"""What the benchmark sections share: worker pools (the test harness's), the environment of measuring processes, the
machine description, statistics, memory probes, and the one renderer that turns a section's tables into markdown.

The sections import torch only inside functions: workers import it themselves, after their thread counts are set,
so every competitor's memory baseline is taken after the same imports."""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import platform
import statistics
import sys
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from tests.harness import WorkerGroup

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 1 << 20
# Every measuring process runs with one intra-op thread (these are set before torch is imported).
SINGLE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                     "TOKENIZERS_PARALLELISM": "false"}
# A fixed threshold turns off glibc's adaptive one: every allocation of 64 KiB or more is its own mapping, returned to
# the kernel when freed, so a worker's RSS tracks its live tensors. glibc reads it at process start.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}


# ---- worker pools ----------------------------------------------------------------------------------------------------

def case_started() -> int:
    return os.getpid()


@contextlib.contextmanager
def environ(values: Dict[str, str]):
    """This process's environment with ``values`` set for a while (processes started meanwhile inherit them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


@contextlib.contextmanager
def stdout_to_stderr():
    """File descriptor 1 sent to stderr for a while (child processes inherit it): the report on stdout stays clean."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


class Pool:
    """A started ``tests.harness.WorkerGroup`` of ``world`` ranks that keeps its topology (TP size ``tp``; None: no
    nxdtp topology) and its cases' module state between calls. ``malloc``: the workers start with ``MALLOC_ENV``."""

    def __init__(self, world: int, tp: Optional[int] = None, env: Optional[Dict[str, str]] = None,
                 backend: str = "gloo", malloc: bool = False):
        self.world, self.tp = world, tp
        self.group = WorkerGroup(world, env={**SINGLE_THREAD_ENV, **(env or {})}, backend=backend, keep_topology=True)
        with environ(MALLOC_ENV if malloc else {}), stdout_to_stderr():
            self.group.run(case_started, tensor_model_parallel_size=None)

    def call(self, case: Callable, **kwargs) -> List[Any]:
        """``case(**kwargs)`` on every rank; the answers by rank."""
        return self.group.run(case, tensor_model_parallel_size=self.tp, **kwargs)

    def close(self) -> None:
        self.group.close()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fresh(case: Callable, world: int = 1, tp: Optional[int] = None, malloc: bool = False,
          env: Optional[Dict[str, str]] = None, **kwargs) -> List[Any]:
    """``case(**kwargs)`` in new processes (a world of ``world``), which end after it: a measurement that needs a
    process of its own (memory baselines, cold imports)."""
    with Pool(world, tp, env=env, malloc=malloc) as pool:
        return pool.call(case, **kwargs)


def rank_and_world() -> tuple:
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def barrier() -> None:
    import torch.distributed as dist

    if dist.get_world_size() > 1:
        dist.barrier()


# ---- machine, statistics, log ----------------------------------------------------------------------------------------

def version(package: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _proc_field(path: str, prefix: str) -> Optional[str]:
    try:
        with open(path) as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(prefix)), None)
    except OSError:
        return None


def machine() -> Dict[str, Any]:
    memory = _proc_field("/proc/meminfo", "MemTotal")
    return {
        "cpu_model": _proc_field("/proc/cpuinfo", "model name") or platform.processor() or "?",
        "logical_cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
        "memory_gib": int(memory.split()[0]) / (1 << 20) if memory else None,
        "platform": platform.platform(), "python": platform.python_version(),
        **{name.replace("-", "_"): version(name) for name in ("torch", "torch-xla", "transformers", "safetensors")},
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "load_average_at_start": list(os.getloadavg()),
    }


def summary(values: Iterable[float]) -> Dict[str, Any]:
    values = list(values)
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def verdict(value: Optional[float], target: float, lower_is_better: bool = True) -> str:
    if value is None:
        return "-"
    met = value <= target if lower_is_better else value >= target
    return "met" if met else f"MISSED by {abs(value - target) / target * 100:.1f} %"


def alternate(variants: Sequence[str], rounds: int, run_one: Callable[[str], Any], warmup: int = 0,
              swap: bool = False, what: str = "") -> Dict[str, List[Any]]:
    """``run_one(variant)`` for each variant in turn, ``warmup + rounds`` times (the order reversed every other round
    when ``swap``, so drift hits every variant alike); the results of the timed rounds by variant."""
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


# ---- memory probes (Linux) -------------------------------------------------------------------------------------------

def proc_status_kib() -> Dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, in KiB."""
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
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def maxrss_kib() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


class RssSampler:
    """The highest RssAnon / RssFile a background thread saw while running (it can miss short spikes)."""

    def __init__(self, interval_s: float = 0.002):
        self.interval_s, self.peak = interval_s, {"RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        status = proc_status_kib()
        self.peak = {k: max(v, status.get(k, 0)) for k, v in self.peak.items()}

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval_s)

    def __enter__(self) -> "RssSampler":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def measure_rss(run: Callable[[], Any]) -> tuple:
    """``(run()'s value, figures)``: wall time and memory (MiB) over the RSS just before the call. The peak is VmHWM
    after resetting it (``ru_maxrss`` where the kernel refuses the reset; it can hold an earlier peak)."""
    import gc

    gc.collect()
    before = proc_status_kib()
    peak_reset = reset_peak_rss()
    start = time.perf_counter()
    with RssSampler() as sampler:
        value = run()
    seconds = time.perf_counter() - start
    after = proc_status_kib()
    peak = after["VmHWM"] if peak_reset else maxrss_kib()
    return value, {
        "seconds": seconds, "baseline_mib": before["VmRSS"] / 1024, "peak_reset": peak_reset, "peak_mib": peak / 1024,
        "increase_mib": (peak - before["VmRSS"]) / 1024, "maxrss_increase_mib": (maxrss_kib() - before["VmRSS"]) / 1024,
        **{f"sampled_peak_{k[3:].lower()}_increase_mib": (sampler.peak[k] - before.get(k, 0)) / 1024
           for k in ("RssAnon", "RssFile")},
        **{f"after_{k[3:].lower()}_increase_mib": (after.get(k, 0) - before.get(k, 0)) / 1024
           for k in ("RssAnon", "RssFile")}}


# ---- the one renderer ------------------------------------------------------------------------------------------------

def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    if abs(n) < 1024:
        return f"{n:,.0f} B"
    if abs(n) < MIB:
        return f"{n / 1024:,.1f} KiB"
    return f"{n / MIB:,.1f} MiB" if abs(n) < (1 << 30) else f"{n / (1 << 30):,.2f} GiB"


def cell(value: Any, spec: str = "") -> str:
    """One table cell: numbers by ``spec`` ("bytes", a format spec, or a readable default), a median/min/max dict as
    "median (min-max)", a list as "a / b", a bool as yes / no, None or NaN as "-"."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return f"{cell(value['median'], spec)} ({cell(value['min'], spec)}-{cell(value['max'], spec)})"
    if isinstance(value, (list, tuple)):
        return " / ".join(cell(v, spec) for v in value)
    if spec == "bytes":
        return fmt_bytes(value)
    if spec:
        return format(value, spec)
    if isinstance(value, int) or abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) >= 0.001 or value == 0 else f"{value:.2e}"


def table(columns: Sequence[str], rows: Iterable[Sequence[Any]], formats: Optional[Dict[str, str]] = None):
    """A table as data: ``formats`` maps a column name to a ``cell`` spec."""
    return {"columns": list(columns), "rows": [list(r) for r in rows], "formats": formats or {}}


def render(blocks: Iterable[Any]) -> str:
    """Markdown of a report: each block is a paragraph (a string) or a ``table``."""
    out = []
    for block in blocks:
        if isinstance(block, str):
            out.append(block)
            continue
        columns = block["columns"]
        specs = [block["formats"].get(c, "") for c in columns]
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(v, s) for v, s in zip(row, specs)) + " |" for row in block["rows"]]
        out.append("\n".join(lines))
    return "\n\n".join(out)

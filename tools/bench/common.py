"""Helpers shared by the benchmark sections: paths, environment, machine description, statistics, formatting, and
long-lived worker processes that answer commands over a pipe."""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

TOOLS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARK_SCRIPT = os.path.join(TOOLS_DIR, "benchmark.py")
MIB = 1 << 20

# Every measuring process runs with one intra-op thread (and these variables set before torch is imported).
SINGLE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                     "TOKENIZERS_PARALLELISM": "false"}


def tool_script(name: str) -> str:
    """The path of one of the CLIs in tools/ (``bench_merge.py``, ...): how a benchmark starts itself as a worker."""
    return os.path.join(TOOLS_DIR, name)


def child_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment of a measuring subprocess: single-threaded, with ``bench`` importable. nxdtp comes from where
    this process found it: the installed package or the inherited PYTHONPATH."""
    env = dict(os.environ)
    env.update(SINGLE_THREAD_ENV)
    env["PYTHONPATH"] = os.pathsep.join([TOOLS_DIR] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra or {})
    return env


def hosted_store(world_size: int, timeout_s: float = 1800):
    """A rendezvous store this process hosts on a port the kernel picks, listening from now on: workers join it with
    ``join_hosted_world``. Keep it until they are done. A port merely found free and bound by a worker seconds later
    can be taken meanwhile (by another benchmark's or test session's world, which would then share the store)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world_size=world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def join_hosted_world(backend: str, rank: int, world: int, port: int, timeout_s: float) -> None:
    """Join the world whose store ``hosted_store`` listens on ``port``: every rank, rank 0 included, as a client of
    it (``env://`` with ``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun, whose agent hosts the store)."""
    import torch.distributed as dist

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "TORCHELASTIC_USE_AGENT_STORE": "True"})
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    del os.environ["TORCHELASTIC_USE_AGENT_STORE"]  # only this rendezvous is the host's


def run_worker_script(worker: str, args: Dict[str, Any], out_path: str, env: Optional[Dict[str, str]] = None,
                      timeout: float = 900, launcher: Sequence[str] = ()) -> Dict[str, Any]:
    """Run ``tools/benchmark.py --worker NAME`` in a fresh process (optionally under a launcher such as torchrun) and
    return the JSON it wrote to ``out_path``."""
    cmd = [sys.executable] + list(launcher) + [BENCHMARK_SCRIPT, "--worker", worker, "--worker-args", json.dumps(args),
                                               "--worker-out", out_path]
    run = subprocess.run(cmd, env=child_env(env), capture_output=True, text=True, timeout=timeout)
    if run.returncode != 0:
        raise RuntimeError(f"worker {worker!r} failed (exit {run.returncode}): {' '.join(cmd)}\n"
                           f"--- stdout ---\n{run.stdout[-4000:]}\n--- stderr ---\n{run.stderr[-8000:]}")
    with open(out_path) as f:
        return json.load(f)


# ---- machine description ---------------------------------------------------------------------------------------------

def _version(package: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _mem_total_gib() -> Optional[float]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return None


def machine() -> Dict[str, Any]:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "memory_gib": _mem_total_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "torch_xla": _version("torch-xla") or _version("torch_xla"),
        "transformers": _version("transformers"),
        "safetensors": _version("safetensors"),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


# ---- statistics and formatting ---------------------------------------------------------------------------------------

def summary(values: Sequence[float]) -> Dict[str, Any]:
    values = list(values)
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def fmt(value: Optional[float], digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def fmt_range(s: Dict[str, Any], digits: int = 3) -> str:
    return f"{fmt(s['median'], digits)} ({fmt(s['min'], digits)}-{fmt(s['max'], digits)})"


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    if abs(n) < 1024:
        return f"{n:,.0f} B"
    if abs(n) < MIB:
        return f"{n / 1024:,.1f} KiB"
    return f"{n / MIB:,.1f} MiB" if abs(n) < (1 << 30) else f"{n / (1 << 30):,.2f} GiB"


def verdict(value: Optional[float], target: float, lower_is_better: bool = True) -> str:
    if value is None:
        return "-"
    met = value <= target if lower_is_better else value >= target
    return "met" if met else f"MISSED by {abs(value - target) / target * 100:.1f} %"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


@contextlib.contextmanager
def stdout_to_stderr():
    """Send file descriptor 1 to stderr for a while (child processes inherit it), so the report on stdout stays
    clean."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def log(message: str) -> None:
    print(f"# [{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- long-lived worker processes -------------------------------------------------------------------------------------

class WorkerError(RuntimeError):
    pass


def serve_in_gloo_world(conn, handlers: Dict[str, Callable], rank: int, world: int, port: int, tp: int,
                        timeout_s: float, before_serving: Optional[Callable[[], None]] = None) -> None:
    """The body of a benchmark worker in a gloo world: one thread, gloo's connection lines to stderr, torch and
    transformers imported, the world joined and nxdtp's groups made (TP size ``tp``), ``before_serving()``, then
    ``serve`` until the driver closes the pipe; the groups destroyed and the process ended without torch's teardown."""
    os.dup2(2, 1)  # gloo's connection lines go to stderr, not into the report
    os.environ.update(SINGLE_THREAD_ENV)
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    import torch.distributed as dist
    import transformers  # noqa: F401

    from nxdtp import parallel_state

    join_hosted_world("gloo", rank, world, port, timeout_s)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        if before_serving is not None:
            before_serving()
        serve(conn, handlers, {"rank": rank, "world": world})
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # everything went back over the pipe; skip torch's slow interpreter teardown


def serve(conn, handlers: Dict[str, Callable], state: Dict[str, Any]) -> None:
    """The command loop of a worker process: receive ``(command, kwargs)``, answer ``("ok", value)`` or
    ``("error", traceback)``; ``"quit"`` ends it."""
    while True:
        try:
            command, kwargs = conn.recv()
        except EOFError:
            return
        if command == "quit":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", handlers[command](state, **kwargs)))
        except BaseException:  # noqa: BLE001 - everything goes back to the driver as text
            conn.send(("error", traceback.format_exc()))


class Worker:
    """One spawned process running ``target(conn, *args)``, which is expected to call :func:`serve`."""

    def __init__(self, name: str, target: Callable, args: tuple):
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child,) + tuple(args), name=name, daemon=True)
        self.process.start()
        child.close()

    def send(self, command: str, **kwargs) -> None:
        self.conn.send((command, kwargs))

    def receive(self, timeout: float = 1800) -> Any:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(1.0):
            if not self.process.is_alive():
                raise WorkerError(f"{self.name} died (exit code {self.process.exitcode})")
            if time.monotonic() > deadline:
                raise WorkerError(f"{self.name}: no answer within {timeout:.0f} s")
        status, value = self.conn.recv()
        if status == "error":
            raise WorkerError(f"{self.name} failed:\n{value}")
        return value

    def close(self, quit_sent: bool = False) -> None:
        if self.process.is_alive():
            try:
                if not quit_sent:
                    self.send("quit")
                self.receive(timeout=60)
            except (WorkerError, OSError, EOFError):
                pass
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)


# A fixed threshold turns off glibc's adaptive one: every allocation of 64 KiB or more is its own mapping, returned to
# the kernel when freed, so a worker's RSS tracks its live tensors instead of what the heap happened to keep.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}


def memory_measuring_workers(name: str, target: Callable, world_size: int, extra_args: tuple = ()) -> "WorkerGroup":
    """A ``WorkerGroup`` whose processes start with ``MALLOC_ENV`` (read by each spawned worker's C library at start),
    for sections that measure RSS; this process's environment is restored after."""
    saved = {k: os.environ.get(k) for k in MALLOC_ENV}
    os.environ.update(MALLOC_ENV)
    try:
        return WorkerGroup(name, target, world_size, extra_args=extra_args)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class WorkerGroup:
    """The ranks of one competitor: every command goes to all of them, and the answers come back as a list by rank."""

    def __init__(self, name: str, target: Callable, world_size: int, extra_args: tuple = ()):
        self._store = hosted_store(world_size)  # the workers' rendezvous, held until they are closed
        port = self._store.port
        self.name = name
        self.world_size = world_size
        self.workers: List[Worker] = [
            Worker(f"{name}[rank {rank}]", target, (name, rank, world_size, port) + tuple(extra_args))
            for rank in range(world_size)]

    def send(self, command: str, **kwargs) -> None:
        for w in self.workers:
            w.send(command, **kwargs)

    def receive(self, timeout: float = 1800) -> List[Any]:
        return [w.receive(timeout) for w in self.workers]

    def call(self, command: str, timeout: float = 1800, **kwargs) -> List[Any]:
        self.send(command, **kwargs)
        return self.receive(timeout)

    def close(self) -> None:
        sent = []
        for w in self.workers:
            try:
                w.send("quit")
                sent.append(True)
            except (OSError, ValueError):
                sent.append(False)
        for w, quit_sent in zip(self.workers, sent):
            w.close(quit_sent=quit_sent)
        self._store = None

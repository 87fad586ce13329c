"""Run many multi-rank test cases on one long-lived group of worker processes.

Starting a process that imports torch costs seconds, so a pool of ``world_size`` gloo workers is started once per pytest
session and runs every case sent to it. A case is a plain module-level function (named ``case_*`` so pytest does not
collect it); each rank calls it with the same keyword arguments after ``initialize_model_parallel(tp)``. What it returns
comes back as a list indexed by rank; an exception on any rank fails the test with that rank's traceback.

A case that hangs (one rank failed before a collective the others wait in) is caught by gloo's timeout; the pool is then
torn down and the next case starts a fresh one, as after any failure but one that every rank shares.

The pool's rendezvous store is a TCPStore that this process opens on a port the kernel picks, before any worker starts,
and keeps until the pool closes; the workers join it as clients, as torchrun's workers join the store of their agent.
No port is chosen first and bound later: a port that is merely free when chosen can be taken in the seconds a worker
needs to start (by another test session's pool, which then shares the store and cross-wires the two worlds' groups, or
by any socket, which leaves rank 0 unable to start).
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import queue
import re
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

COLLECTIVE_TIMEOUT_S = 90
CASE_TIMEOUT_S = 600
# How long a test waits for a process it started to reach a point (its imports alone take ~6 s on a quiet 2-core
# machine and minutes on a loaded one; a 120 s wait once failed there). A process that dies ends the wait at once.
PROCESS_WAIT_S = 600
# How often a waiting test checks that its workers are still alive: a worker that died (at start, or killed inside a
# case) fails the case within this, instead of CASE_TIMEOUT_S later.
LIVENESS_POLL_S = 1.0


# The worlds a pool can be: the default torch.distributed backend its processes start with ("nccl": the benchmark's
# GPU section, tools/bench).
BACKENDS = ("gloo", "xla", "cpu_refusing", "nccl")


def _init_world(backend: str, rank: int, world_size: int, port: int) -> None:
    import torch.distributed as dist

    if backend == "xla":
        import torch_xla
        import torch_xla.distributed.xla_backend  # noqa: F401 - registers the "xla" backend

        # As an XLA program does, take the device before any backward: autograd sizes its per-device queues from the
        # devices known when it first runs, and an XLA backward would otherwise fail on a CPU-first process.
        torch_xla.device()
    elif backend == "cpu_refusing":
        from tests import cpu_refusing_backend

        cpu_refusing_backend.register()
    # env:// as torchrun gives it, which is also how an "xla" world starts on a CPU machine. The store is the pool's
    # (WorkerGroup._start), already listening: every rank joins it as a client, rank 0 included, which is what
    # TORCHELASTIC_USE_AGENT_STORE tells env:// (torchrun sets it when its agent hosts the store).
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "TORCHELASTIC_USE_AGENT_STORE": "True"})
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    # Only this rendezvous is the pool's: a process a case starts (a torchrun launch, a world of its own) must host or
    # find its store as it would anywhere else.
    del os.environ["TORCHELASTIC_USE_AGENT_STORE"]


def _exit_with_parent() -> None:
    """Have the kernel kill this worker when the test session that started it dies (Linux's PR_SET_PDEATHSIG):
    multiprocessing's daemon flag ends workers only when the session exits normally, and a session killed (by the
    OOM killer, a timeout, a user) would leave its pools running and holding their memory."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):   # not Linux: the daemon flag is all there is
        return
    if os.getppid() == 1:   # the session died before the request was made
        os._exit(1)


def _worker_main(rank: int, world_size: int, port: int, tasks, results, sys_path: List[str], env: Dict[str, str],
                 backend: str, keep_topology: bool = False):
    _exit_with_parent()
    os.environ.update(env)
    sys.path[:] = sys_path
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        _init_world(backend, rank, world_size, port)
        from nxdtp import parallel_state
    except BaseException:  # noqa: BLE001 - the test says why its world could not start, at once
        results.put((rank, "dead", "the worker could not start its world:\n" + traceback.format_exc()))
        raise

    while True:
        message = tasks.get()
        if message is None:
            break
        module_name, function_name, tp, kwargs = message
        try:
            function = getattr(importlib.import_module(module_name), function_name)
            if tp is not None and not (keep_topology and parallel_state.model_parallel_is_initialized()):
                parallel_state.initialize_model_parallel(
                    tensor_model_parallel_size=tp, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
            results.put((rank, "ok", function(**kwargs)))
        except BaseException:  # noqa: BLE001 - everything goes back to the test as text
            results.put((rank, "error", traceback.format_exc()))
        finally:
            if not keep_topology:
                parallel_state.destroy_model_parallel()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


class WorkerGroup:
    def __init__(self, world_size: int, env: Optional[Dict[str, str]] = None, backend: str = "gloo",
                 keep_topology: bool = False):
        """``keep_topology``: the topology the first case makes stays, with what the cases keep in their modules'
        globals, until the pool closes (the benchmark's workers keep a model and its optimizer between calls)."""
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
        self.world_size = world_size
        self.backend = backend
        self.keep_topology = keep_topology
        self.env = {"OMP_NUM_THREADS": "1", **(env or {})}
        self._processes: List[mp.Process] = []
        self._store = None

    @property
    def running(self) -> bool:
        """Whether the pool's workers are up (a pool starts them on its first case, and again after a failure)."""
        return bool(self._processes) and all(p.is_alive() for p in self._processes)

    @property
    def store_port(self) -> Optional[int]:
        """The port of the running pool's store (None when no pool is running)."""
        return None if self._store is None else self._store.port

    def _start(self) -> None:
        import torch.distributed as dist

        ctx = mp.get_context("spawn")
        # Port 0: the kernel binds a free port and the store listens on it from now on, so no other process can take it
        # before the workers arrive, and no other pool can be handed it. (A port chosen free here and bound by rank 0
        # seconds later could be handed to another session's pool too; two worlds on one store fail in dist.new_group.)
        self._store = dist.TCPStore("127.0.0.1", 0, world_size=self.world_size, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        port = self._store.port
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._processes = [
            ctx.Process(target=_worker_main, daemon=True,
                        args=(rank, self.world_size, port, self._tasks[rank], self._results, list(sys.path), self.env,
                              self.backend, self.keep_topology))
            for rank in range(self.world_size)
        ]
        for p in self._processes:
            p.start()

    def request_stop(self) -> None:
        """Tell every worker to leave its world and exit, without waiting: pools told together wind down together."""
        for q, p in zip(getattr(self, "_tasks", []), self._processes):
            if p.is_alive():
                q.put(None)

    def close(self) -> None:
        self.request_stop()
        for p in self._processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self._processes = []
        # After the workers: a rank still running must not see its store vanish before it is stopped.
        self._store = None

    def run(self, case: Callable, tensor_model_parallel_size: Optional[int] = 1, **kwargs) -> List[Any]:
        """Run ``case(**kwargs)`` on every rank; return the per-rank results, or raise with the failing ranks'
        tracebacks."""
        if not self.running:
            self.close()
            self._start()
        for q in self._tasks:
            q.put((case.__module__, case.__name__, tensor_model_parallel_size, kwargs))
        outcomes = self._outcomes(case.__name__)
        errors = {r: v for r, (s, v) in outcomes.items() if s == "error"}
        if errors:
            if not _same_failure_on_every_rank(outcomes):
                self.close()   # a rank that failed mid-case may have left peers inside a collective: start clean
            raise AssertionError(f"{case.__name__} failed on ranks {sorted(errors)}" + _format_errors(outcomes))
        return [outcomes[r][1] for r in range(self.world_size)]

    def _dead(self, outcomes: Dict[int, tuple], grace_s: float = 0.0) -> Dict[int, Optional[int]]:
        """The exit codes of the ranks without a result that have died, after waiting up to ``grace_s`` for them."""
        end = time.monotonic() + grace_s
        for rank, process in enumerate(self._processes):
            if rank not in outcomes:
                process.join(timeout=max(0.0, end - time.monotonic()))
        return {r: p.exitcode for r, p in enumerate(self._processes) if r not in outcomes and not p.is_alive()}

    def _outcomes(self, case_name: str) -> Dict[int, tuple]:
        """Every rank's (status, value) for the case just sent; a rank that dies or cannot start fails it at once."""
        outcomes: Dict[int, tuple] = {}
        deadline = time.monotonic() + CASE_TIMEOUT_S
        while len(outcomes) < self.world_size:
            try:
                rank, status, value = self._results.get(timeout=LIVENESS_POLL_S)
            except queue.Empty:
                dead = self._dead(outcomes)
                if dead:
                    dead = self._dead(outcomes, grace_s=LIVENESS_POLL_S)   # the others dying of the same cause too
                    raise _failed(self, f"{case_name}: ranks {sorted(dead)} died (exit codes {dead}) before giving a "
                                        "result", outcomes) from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(outcomes))
                    raise _failed(self, f"{case_name}: ranks {missing} gave no result within {CASE_TIMEOUT_S}s",
                                  outcomes) from None
                continue
            if status == "dead":
                raise _failed(self, f"{case_name}: rank {rank} {value}", outcomes)
            outcomes[rank] = (status, value)
        return outcomes


def _failed(pool: WorkerGroup, message: str, outcomes: Dict[int, tuple]) -> AssertionError:
    pool.close()
    return AssertionError(message + _format_errors(outcomes))


# Errors that say the world itself broke: after one of these the pool is not reused.
_WORLD_FAILURES = ("Timed out", "timed out", "DistBackendError", "DistNetworkError", "Connection", "gloo")
_FRAME = re.compile(r'^  File "(.*)", line (\d+), in (.*)$', re.MULTILINE)


def _same_failure_on_every_rank(outcomes: Dict[int, tuple]) -> bool:
    """Whether every rank raised through the same frames (a test's deliberate bad input: every rank checks it alike)
    and no error is the world's own: the ranks then ran the same collectives before raising, none is left inside one,
    and the pool can run the next case (a restart costs seconds per rank)."""
    texts = [v for s, v in outcomes.values()]
    if any(s != "error" for s, _ in outcomes.values()) or any(w in t for t in texts for w in _WORLD_FAILURES):
        return False
    return len({tuple(_FRAME.findall(t)) for t in texts}) == 1


def _format_errors(outcomes: Dict[int, tuple]) -> str:
    return "".join(f"\n----- rank {r} -----\n{v}" for r, (s, v) in sorted(outcomes.items()) if s == "error")

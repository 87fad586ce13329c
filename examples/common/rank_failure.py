"""What a rank of the example does when it fails: end its process at once, say why, and say which rank failed first.

A rank that raises while its peers wait in a collective with it would leave them waiting until the collective timeout,
and a normal Python exit can itself wait on peers (a process group's teardown, the data loader's thread). So a failing
rank of a multi-rank run prints its error, records it in the job's key-value store, and ends with ``os._exit``: its
sockets close, peers blocked in a gloo collective with it fail at once, and torchrun, seeing a worker exit non-zero,
stops the others (SIGTERM). A rank stopped that way reports too, then exits.

The store is torch.distributed's rendezvous store. Under torchrun it lives in the launcher's agent, so it outlives any
rank; its keys (under ``nxdtp/failure/``) are:

- ``process/<rank>``: "host pid", written at start, to tell a rank that was killed from one that is still running;
- ``reported/<rank>``: this rank's line, written before it exits;
- ``first``: the first failure of the job, set once (compare-and-set) by a rank whose own code failed, or by a peer
  that found a rank gone without a report (killed by SIGKILL or the out-of-memory killer).

A rank whose collective failed (a peer closed its connection, or the collective timed out) is not the cause: it logs
its own line and the recorded first failure, and when none was recorded, the ranks that ended or still run without a
report.

``NXDTP_INJECT_FAULT=RANK:STEP:MODE`` is a fault-injection hook for tests (tests/test_dead_rank.py): rank RANK, at the
start of optimizer step STEP, raises (``raise``), SIGKILLs itself (``kill``) or sleeps forever (``hang``).
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import List, NoReturn, Optional

import torch.distributed as dist

FAULT_ENV = "NXDTP_INJECT_FAULT"
FAULT_MODES = ("raise", "kill", "hang")
KEY_PREFIX = "nxdtp/failure/"
# A failing rank must not wait long on the store: if it is unreachable (its host is down), the line is printed anyway.
STORE_TIMEOUT = datetime.timedelta(seconds=10)
# How long a rank whose collective failed looks for the cause (a recorded failure, a peer process gone).
SETTLE_S = 1.0
EXIT_CODE = 1
SIGTERM_EXIT_CODE = 128 + signal.SIGTERM
# What gloo and NCCL put in the errors of a collective that failed because of a peer: a closed connection, a timeout.
_COLLECTIVE_ERROR_MARKERS = ("third_party/gloo", "Connection closed by peer", "Connection reset by peer",
                             "ProcessGroupNCCL", "NCCL error", "Timed out waiting")


class InjectedFault(RuntimeError):
    """The error the test hook raises."""


def inject_fault_if_requested(rank: int, step: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    parts = spec.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in FAULT_MODES:
        raise ValueError(f"{FAULT_ENV}={spec!r} is not RANK:STEP:MODE with MODE one of {', '.join(FAULT_MODES)}")
    if (int(parts[0]), int(parts[1])) != (rank, step):
        return
    mode = parts[2]
    # The time lets a test measure how long the job took to end after the fault.
    print(f"{FAULT_ENV}: rank {rank} injects {mode!r} at step {step}, time {time.time():.3f}", file=sys.stderr,
          flush=True)
    if mode == "raise":
        raise InjectedFault(f"injected fault ({FAULT_ENV}={spec})")
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # hang: alive, silent, in no collective
        time.sleep(3600)


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` says a collective failed (a peer went away or never came), not this rank's own code."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return any(marker in text for marker in _COLLECTIVE_ERROR_MARKERS)


class RankFailures:
    """One rank's failure reporting for a multi-rank run it started. ``stage`` says where the rank is (the example
    sets "step N"); ``exit`` and SIGTERM end the process."""

    def __init__(self, rank: int, world_size: int, store=None):
        self.rank, self.world_size = rank, world_size
        self.stage = "start-up"
        self._exiting = False
        self._store = store if store is not None else _default_store()
        self._store_call("set", KEY_PREFIX + f"process/{rank}", f"{socket.gethostname()} {os.getpid()}")
        # Python runs signal handlers on the main thread only, and only there can one be installed.
        self._previous_sigterm = None
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    def close(self) -> None:
        """The run ended normally: give SIGTERM back its previous handler."""
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def exit(self, error: BaseException, with_traceback: bool = True) -> NoReturn:
        """Report ``error`` as this rank's failure and end the process with a non-zero status, without teardown."""
        self.report(error, with_traceback)
        os._exit(EXIT_CODE)

    def report(self, error: BaseException, with_traceback: bool = True) -> str:
        """Print (its traceback when this rank's own code failed and ``with_traceback``, then) the failure line, and
        return the line. ``with_traceback=False`` is for errors whose message is the whole story (bad input)."""
        self._exiting = True
        collective = is_collective_failure(error)
        if not collective and with_traceback:
            traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
        line = f"rank {self.rank} failed at {self.stage}: {type(error).__name__}: {_one_line(error)}"
        return self._report(line, own_failure=not collective)

    def _on_sigterm(self, signum, frame) -> None:
        if self._exiting:  # already reporting its own failure: let that finish and exit
            return
        self._exiting = True
        self._report(f"rank {self.rank} stopped by SIGTERM at {self.stage} (torchrun sends it to every rank once one "
                     "has failed)", own_failure=False)
        os._exit(SIGTERM_EXIT_CODE)

    def _report(self, line: str, own_failure: bool) -> str:
        if self._store is not None:
            try:
                self._store.set_timeout(STORE_TIMEOUT)
            except Exception:  # noqa: BLE001 - reporting must never stop the exit
                pass
        # Reported before looking at the others: peers looking at the same moment then see this rank as accounted for.
        self._store_call("set", KEY_PREFIX + f"reported/{self.rank}", line)
        first = self._store_call("compare_set", KEY_PREFIX + "first", "", line) if own_failure else None
        if first is None:
            first = self._first_failure_seen_by_peer()
        if first == line:
            line += " (the first failure in this job)"
        elif first:
            line += f"; first failure in this job: {first}"
        _write_stderr(line)
        return line

    def _first_failure_seen_by_peer(self) -> str:
        """The recorded first failure; else ranks gone without a report (recorded as the first failure); else a note
        of the ranks still running without one (one of them may hang)."""
        if self._store is None:
            return "unknown (no store to read it from)"
        # A killed peer's sockets close before its process is a zombie, and peers that time out together report at
        # about the same time: wait a moment before concluding.
        deadline = time.monotonic() + SETTLE_S
        while True:
            recorded = self._store_get(KEY_PREFIX + "first")
            if recorded:
                return recorded
            gone, running, elsewhere = self._silent_peers()
            if gone or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if gone:
            text = (f"rank(s) {gone} ended without reporting an error (killed: SIGKILL, the out-of-memory killer, or a "
                    "crash in native code)")
            return self._store_call("compare_set", KEY_PREFIX + "first", "", text) or text
        if running:
            return f"none recorded; rank(s) {running} on this host still run without reporting an error (hung?)"
        if elsewhere:
            return f"none recorded; rank(s) {elsewhere} on other hosts reported no error (see their hosts' logs)"
        return "none recorded"

    def _silent_peers(self):
        gone: List[int] = []
        running: List[int] = []
        elsewhere: List[int] = []
        host = socket.gethostname()
        for rank in range(self.world_size):
            if rank == self.rank or self._store_get(KEY_PREFIX + f"reported/{rank}"):
                continue
            process = (self._store_get(KEY_PREFIX + f"process/{rank}") or "").split()
            if len(process) != 2 or process[0] != host:
                elsewhere.append(rank)
            elif _process_exists(int(process[1])):
                running.append(rank)
            else:
                gone.append(rank)
        return gone, running, elsewhere

    def _store_get(self, key: str) -> Optional[str]:
        # check first: get() of a missing key would wait for the store's timeout.
        if not self._store_call("check", [key]):
            return None
        return self._store_call("get", key)

    def _store_call(self, method: str, *args):
        if self._store is None:
            return None
        try:
            value = getattr(self._store, method)(*args)
        except Exception:  # noqa: BLE001 - the store's host may be gone; the report goes on without it
            return None
        return value.decode() if isinstance(value, bytes) else value


def _default_store():
    """The store of the default process group (its rendezvous store), or None when the group has none."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - e.g. a backend that rendezvouses without a store
        return None


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A killed child of torchrun stays a zombie until torchrun reaps it: count a zombie as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _write_stderr(line: str) -> None:
    """Write a line straight to file descriptor 2: from a signal handler, print() could find the stream's buffer in
    use by the code it interrupted."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, RuntimeError, ValueError):
        pass
    os.write(2, (line + "\n").encode(errors="replace"))


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or "(no message)"

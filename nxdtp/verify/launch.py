"""The processes of ``nxdtp verify``: this process hosts the rendezvous store and starts ``tp * dp`` workers
(``python -m nxdtp.verify.launch JOB_FILE RANK PORT``), which join a gloo world on the CPU, run the verification
(``compare.run_in_world``) and leave their result (rank 0) or their error (any rank) beside the job file.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from typing import List, Optional, Tuple

import torch

from ..process_groups import host_rendezvous_store, join_gloo_world, leave_world
from ..topology import destroy_model_parallel, initialize_model_parallel
from .compare import StepFailed, StepRow, run_in_world
from .models import Job

# A collective that waits longer than this has a peer that failed or hangs.
COLLECTIVE_TIMEOUT_S = 120
# After the first worker fails, how long the others get to finish their error reports before they are stopped.
GRACE_S = 10
RESULT_FILE = "result.pkl"


class SetupFailed(ValueError):
    """The model or its plan could not be built or parallelized on the workers (bad input)."""


def launch(job: Job, dense_state: dict, timeout_s: float = 1800) -> Tuple[Optional[List[StepRow]], Optional[str]]:
    """Run ``job`` on ``tp * dp`` new worker processes from ``dense_state`` (the dense model's initial state): (the
    rows, None) when the run completes, (None, the first failed rank's error) when a step raised. Raises
    ``SetupFailed`` when the workers could not build or shard the model, RuntimeError when they died or timed out."""
    world = job.tp * job.dp
    with tempfile.TemporaryDirectory(prefix="nxdtp-verify-") as tmp:
        state_path = os.path.join(tmp, "dense_state.pt")
        torch.save(dense_state, state_path)
        job_path = os.path.join(tmp, "job.pkl")
        with open(job_path, "wb") as f:
            pickle.dump(dataclasses.replace(job, state_path=state_path), f)
        store = host_rendezvous_store(world, timeout_s=COLLECTIVE_TIMEOUT_S)
        workers = [_start(job_path, rank, store.port, tmp, world) for rank in range(world)]
        _wait(workers, timeout_s)
        del store
        return _outcome(tmp, world)


def _start(job_path: str, rank: int, port: int, tmp: str, world: int) -> subprocess.Popen:
    path = [os.getcwd()] + [p for p in sys.path if p and os.path.isdir(p)]
    # The machine's cores shared out: more threads than cores per process would only make the workers wait.
    threads = str(max(1, (os.cpu_count() or 1) // world))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": threads}
    log = open(os.path.join(tmp, f"rank{rank}.log"), "wb")
    try:
        return subprocess.Popen([sys.executable, "-m", "nxdtp.verify.launch", job_path, str(rank), str(port)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    finally:
        log.close()


def _wait(workers: List[subprocess.Popen], timeout_s: float) -> None:
    """Until every worker has exited; the rest are stopped ``GRACE_S`` after the first failure, or at the timeout."""
    deadline, stop_at = time.monotonic() + timeout_s, None
    while any(w.poll() is None for w in workers):
        now = time.monotonic()
        if stop_at is None and any(w.returncode not in (None, 0) for w in workers):
            stop_at = now + GRACE_S
        if now > deadline or (stop_at is not None and now > stop_at):
            for w in workers:
                if w.poll() is None:
                    w.kill()
            for w in workers:
                w.wait()
            if stop_at is None:
                raise RuntimeError(f"nxdtp verify: the workers did not finish within {timeout_s:.0f} s")
            return
        time.sleep(0.2)


def _outcome(tmp: str, world: int) -> Tuple[Optional[List[StepRow]], Optional[str]]:
    result = os.path.join(tmp, RESULT_FILE)
    if os.path.isfile(result):
        with open(result, "rb") as f:
            return pickle.load(f), None
    for rank in range(world):
        error = os.path.join(tmp, f"error{rank}.pkl")
        if os.path.isfile(error):
            with open(error, "rb") as f:
                kind, message = pickle.load(f)
            if kind == "setup":
                raise SetupFailed(f"rank {rank}: {message}")
            return None, f"rank {rank}: {message}"
    with open(os.path.join(tmp, "rank0.log"), "rb") as f:
        tail = f.read()[-3000:].decode(errors="replace")
    raise RuntimeError(f"nxdtp verify: the workers exited without a result; rank 0's output ends:\n{tail}")


def worker_main(argv: List[str]) -> int:
    """One worker: join the world, run the job, leave the result or the error beside the job file."""
    job_path, rank, port = argv[0], int(argv[1]), int(argv[2])
    with open(job_path, "rb") as f:
        job: Job = pickle.load(f)
    tmp = os.path.dirname(job_path)
    join_gloo_world(rank, job.tp * job.dp, "127.0.0.1", port, timeout_s=COLLECTIVE_TIMEOUT_S)
    try:
        initialize_model_parallel(tensor_model_parallel_size=job.tp)
        rows = run_in_world(job)
    except Exception as e:  # noqa: BLE001 - reported to the launching process, which decides the exit status
        traceback.print_exc()
        kind = "step" if isinstance(e, StepFailed) else "setup"
        with open(os.path.join(tmp, f"error{rank}.pkl"), "wb") as f:
            pickle.dump((kind, f"{type(e).__name__}: {e}" if kind == "setup" else str(e)), f)
        sys.stdout.flush()
        os._exit(1)  # peers may be waiting in a collective; leaving the world here could hang
    if rank == 0:
        with open(os.path.join(tmp, RESULT_FILE + ".part"), "wb") as f:
            pickle.dump(rows, f)
        os.replace(os.path.join(tmp, RESULT_FILE + ".part"), os.path.join(tmp, RESULT_FILE))
    destroy_model_parallel()
    leave_world()
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))

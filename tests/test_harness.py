"""The worker-pool harness itself (tests/harness.py): a pool's rendezvous cannot be taken over by another process.

Two mechanisms give the symptom of issue 22, item 5 (a case failing inside ``dist.new_group`` under load, as a new pool
started). The one seen in the failures was in nxdtp (test_parallel_state.py: no rank leaves initialize_model_parallel
while another is making groups). The other was here: the harness picked a free port (bind to port 0, close) and let rank
0 bind it for the store seconds later, once torch was imported. In that window the port could go to another process: to
another test session's pool, handed the same port, whose ranks then shared the store and cross-wired both worlds' gloo
groups (the first new_group of the first case fails: "Connection closed by peer", "timed out connecting"), or to any
other socket, which left rank 0 unable to start. The store now listens before the workers are told its port.
"""

from __future__ import annotations

import errno
import os
import socket
import time

import pytest

from tests.harness import WorkerGroup


def case_ranks_meet_through_the_pools_store(token: str):
    import os

    import torch.distributed as dist

    from nxdtp import parallel_state as ps

    store = ps.get_tcp_store()
    store.set(f"harness_test/{dist.get_rank()}", token)
    tokens = [store.get(f"harness_test/{r}").decode() for r in range(dist.get_world_size())]
    return int(os.environ["MASTER_PORT"]), tokens


def test_the_rendezvous_port_is_taken_before_the_workers_start():
    group = WorkerGroup(2)
    intruder = socket.socket()
    try:
        group._start()
        port = group.store_port
        # What a gloo device of another world does when it listens (SO_REUSEADDR, then listen), the moment the
        # workers have been started, before rank 0 could have imported torch: refused only if the pool holds the port.
        intruder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with pytest.raises(OSError) as refused:
            intruder.bind(("127.0.0.1", port))
            intruder.listen()
        assert refused.value.errno == errno.EADDRINUSE, refused.value
        intruder.close()
        # The world the workers form on that store works, and is the pool's own.
        assert group.run(case_ranks_meet_through_the_pools_store, token="pool-a") == [(port, ["pool-a", "pool-a"])] * 2
    finally:
        intruder.close()
        group.close()
    assert group.store_port is None, "a closed pool still holds its store"


# ---- the pools' footprint --------------------------------------------------------------------------------------------

class _FakePool:
    def __init__(self, world_size: int, running: bool):
        self.world_size, self.running = world_size, running

    def close(self):
        self.running = False


def test_the_least_recently_used_pools_make_room_for_a_new_one(monkeypatch):
    import collections

    from tests import conftest

    monkeypatch.setattr(conftest, "MAX_WORKERS", 8)
    pools = collections.OrderedDict((key, _FakePool(size, True)) for key, size in
                                    [("old-4", 4), ("idle-2", 2), ("recent-2", 2)])
    pools["idle-2"].running = False
    pools["new-4"] = _FakePool(4, False)
    conftest._make_room(pools, "new-4", 4)
    assert [k for k, p in pools.items() if p.running] == ["recent-2"], "only the oldest running pool had to go"
    conftest._make_room(pools, "new-4", 4)
    assert pools["recent-2"].running, "a pool is not closed when the new one fits"


SCRIPT = """
import os, sys
sys.path.insert(0, {root!r})
from tests.harness import WorkerGroup
from tests.test_harness import case_pid
group = WorkerGroup(2)
print("PIDS", *group.run(case_pid, tensor_model_parallel_size=None), flush=True)
os._exit(0)   # as a killed session ends: no atexit, no pool.close()
"""


def case_pid():
    import os

    return os.getpid()


def test_workers_die_with_a_session_that_is_killed(tmp_path):
    import os
    import subprocess
    import sys
    import time

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # Output to a file, not a pipe: workers that outlive the session would keep a pipe open and hang the read.
    with open(tmp_path / "out", "w") as out:
        done = subprocess.run([sys.executable, "-c", SCRIPT.format(root=root)], stdout=out, stderr=subprocess.STDOUT,
                              timeout=300, cwd=root)
    output = (tmp_path / "out").read_text()
    assert done.returncode == 0, output[-3000:]
    pids = [int(p) for line in output.splitlines() if line.startswith("PIDS ") for p in line.split()[1:]]
    assert len(pids) == 2, output[-3000:]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in pids):
        time.sleep(0.2)
    alive = [pid for pid in pids if os.path.exists(f"/proc/{pid}")
             and open(f"/proc/{pid}/stat").read().split()[2] != "Z"]
    assert not alive, f"workers {alive} outlived the session that started them"


def case_exit_at_once(code: int):
    os._exit(code)


def test_a_worker_that_dies_fails_its_case_within_seconds():
    """A dead worker (killed, or unable to start its world, such as an XLA world without torch_xla) never leaves the
    test waiting out the case timeout."""
    from tests.harness import CASE_TIMEOUT_S

    pool = WorkerGroup(2)
    try:
        start = time.monotonic()
        died = r"case_exit_at_once: ranks \[0, 1\] died \(exit codes \{0: 3, 1: 3\}\)"
        with pytest.raises(AssertionError, match=died):
            pool.run(case_exit_at_once, tensor_model_parallel_size=None, code=3)
        assert time.monotonic() - start < CASE_TIMEOUT_S / 10
    finally:
        pool.close()


def case_pid_or_raise(raising_ranks: list):
    import os

    import torch.distributed as dist

    from nxdtp import parallel_state as ps

    ps.get_tensor_model_parallel_group()   # a group made, as a real case's would be
    if dist.get_rank() in raising_ranks:
        raise ValueError("bad input")
    return os.getpid()


def test_a_pool_outlives_a_failure_every_rank_shares_and_restarts_after_any_other():
    """Deliberate bad input fails every rank alike: the pool runs the next case with the same processes (a restart
    costs seconds per rank). A failure on some ranks only, or a dead worker, may leave peers inside a collective: the
    next case gets fresh processes."""
    pool = WorkerGroup(2)
    try:
        pids = pool.run(case_pid_or_raise, tensor_model_parallel_size=2, raising_ranks=[])
        with pytest.raises(AssertionError, match="failed on ranks \\[0, 1\\]"):
            pool.run(case_pid_or_raise, tensor_model_parallel_size=2, raising_ranks=[0, 1])
        assert pool.run(case_pid_or_raise, tensor_model_parallel_size=2, raising_ranks=[]) == pids
        with pytest.raises(AssertionError, match="failed on ranks \\[1\\]"):
            pool.run(case_pid_or_raise, tensor_model_parallel_size=2, raising_ranks=[1])
        fresh = pool.run(case_pid_or_raise, tensor_model_parallel_size=2, raising_ranks=[])
        assert not set(fresh) & set(pids), (fresh, pids)
    finally:
        pool.close()

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
import socket

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

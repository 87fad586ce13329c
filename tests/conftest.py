import pytest

from tests.harness import WorkerGroup


@pytest.fixture(scope="session")
def worlds():
    """``worlds(n)`` gives a shared pool of n gloo ranks; ``worlds(1, "xla-exec")`` a separate single XLA:CPU process.

    Pools are keyed by (size, name) so that processes with different roles never share state: XLA graphs that must not
    execute (simulated topologies) and XLA graphs that execute live in different processes.
    """
    pools = {}

    def get(world_size: int, name: str = "gloo") -> WorkerGroup:
        key = (world_size, name)
        if key not in pools:
            env = {"PJRT_DEVICE": "CPU"} if name.startswith("xla") else {}
            pools[key] = WorkerGroup(world_size, env=env)
        return pools[key]

    yield get
    for pool in pools.values():
        pool.close()

import pytest

from tests.harness import BACKENDS, WorkerGroup


def pytest_report_header(config):
    try:
        import transformers
    except ImportError:
        return "transformers: not installed"
    return f"transformers {transformers.__version__} ({transformers.__file__})"


@pytest.fixture(scope="session")
def worlds():
    """``worlds(n)`` gives a shared pool of n gloo ranks; ``worlds(1, "xla-exec")`` a separate single XLA:CPU process.

    Pools are keyed by (size, name) so that processes with different roles never share state: XLA graphs that must not
    execute (simulated topologies) and XLA graphs that execute live in different processes. The names "xla" and
    "cpu_refusing" give worlds whose default torch.distributed backend is torch_xla's "xla" (XLA:CPU) or a stand-in for
    NCCL that refuses CPU tensors (tests/cpu_refusing_backend.py); every other name is a gloo world.
    """
    pools = {}

    def get(world_size: int, name: str = "gloo") -> WorkerGroup:
        key = (world_size, name)
        if key not in pools:
            env = {"PJRT_DEVICE": "CPU"} if name.startswith("xla") else {}
            backend = name if name in BACKENDS else "gloo"
            pools[key] = WorkerGroup(world_size, env=env, backend=backend)
        return pools[key]

    yield get
    for pool in pools.values():   # every pool's workers exit at once, instead of one pool after another
        pool.request_stop()
    for pool in pools.values():
        pool.close()

import collections
import importlib.util
import os

import pytest

from tests.harness import BACKENDS, WorkerGroup


# Worker processes alive at once, over all pools (each holds about 450 MiB once torch and transformers are imported):
# past it the least recently used pools are closed, and start again when a test asks for them. Every pool kept for
# the whole session would hold about 14 GiB, so two test sessions at once exhausted a 24 GiB machine.
def _max_workers() -> int:
    value = os.environ.get("NXDTP_TEST_MAX_WORKERS", "16")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"NXDTP_TEST_MAX_WORKERS={value!r} must be a positive integer (the default is 16)")
    return int(value)


MAX_WORKERS = _max_workers()


def _make_room(pools, key, needed: int) -> None:
    """Close the least recently used running pools, other than ``key``'s, until ``needed`` more workers fit."""
    for other in list(pools):
        running = sum(pool.world_size for pool in pools.values() if pool.running)
        if running + needed <= MAX_WORKERS:
            return
        if other != key and pools[other].running:
            pools[other].close()


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
    pools = collections.OrderedDict()   # least recently used first

    def get(world_size: int, name: str = "gloo") -> WorkerGroup:
        if name.startswith("xla") and importlib.util.find_spec("torch_xla") is None:
            if os.environ.get("NXDTP_REQUIRE_XLA"):   # CI's pinned stack: a missing torch_xla is a failure there
                pytest.fail("NXDTP_REQUIRE_XLA is set but torch_xla is not installed")
            pytest.skip("needs torch_xla, which is not installed (pip install -e '.[xla]')")
        key = (world_size, name)
        if key not in pools:
            env = {"PJRT_DEVICE": "CPU"} if name.startswith("xla") else {}
            backend = name if name in BACKENDS else "gloo"
            pools[key] = WorkerGroup(world_size, env=env, backend=backend)
        pools.move_to_end(key)
        if not pools[key].running:
            _make_room(pools, key, world_size)
        return pools[key]

    yield get
    for pool in pools.values():   # every pool's workers exit at once, instead of one pool after another
        pool.request_stop()
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="session", autouse=True)
def children_temp_dir(tmp_path_factory):
    """Processes the tests start put their temporary files under pytest's base directory, which pytest prunes:
    torchrun's agent makes a ``torchelastic_*`` directory in the temporary directory for every launch and leaves it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(tmp_path_factory.mktemp("children")))
        yield

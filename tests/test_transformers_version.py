"""Which transformers this session tests. The CI matrix (docs/testing.md) runs the model tests again under older
releases, each in a small environment whose transformers shadows the main one; ``NXDTP_TEST_TRANSFORMERS=<version>``
names the release a run must see. This test proves the shadowing: the main process and every worker process import
that release from the same file (workers are started with the parent's interpreter and ``sys.path``)."""

from __future__ import annotations

import os

import pytest

transformers = pytest.importorskip("transformers")


def case_transformers_release():
    import transformers

    return transformers.__version__, transformers.__file__


def test_workers_import_the_sessions_transformers(worlds, capsys):
    expected = os.environ.get("NXDTP_TEST_TRANSFORMERS")
    if expected is not None:
        assert transformers.__version__ == expected, (transformers.__version__, transformers.__file__)
    results = worlds(2).run(case_transformers_release, tensor_model_parallel_size=None)
    for rank, release in enumerate(results):
        assert release == (transformers.__version__, transformers.__file__), (rank, release)
    with capsys.disabled():
        print(f"\nworkers import transformers {results[0][0]} from {os.path.dirname(results[0][1])}")

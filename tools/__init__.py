"""Command-line tools over nxdtp (merge_checkpoints.py, benchmark.py, bench_*.py) and their benchmark package,
``bench``. The CLIs run as scripts (``python tools/benchmark.py``), which puts this folder on the import path; the
tests import the package as ``tools.bench``."""

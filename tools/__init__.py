"""Command-line tools over nxdtp: merge_checkpoints.py, benchmark.py and ``python -m tools.bench``."""

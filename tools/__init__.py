"""Command-line tools over nxdtp: merge_checkpoints.py (the merge CLI), benchmark.py and the benchmark package
``tools.bench`` (``python -m tools.bench``)."""

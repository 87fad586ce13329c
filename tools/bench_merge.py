#!/usr/bin/env python
"""Wall time and peak host memory of merging a tp=8 BERT-large checkpoint, next to a raw copy of the same bytes.

    python tools/bench_merge.py [--workdir DIR] [--keep] [--rounds 3] [--cache cold|warm|both] [--json OUT]

The measurement is ``bench/merge_timing.py`` (its docstring says what is measured and how); section 5 of
tools/benchmark.py calls it too. This file also runs as its own worker processes (``--worker``).

nxdtp must be importable: installed (``pip install -e .``) or on PYTHONPATH. ``bench`` is found beside this file.
"""

import sys

from bench.merge_timing import main

if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""What the silent-divergence safeguards cost: the input check per forward, the sequence-parallel gradient sum
inside backward, and the replicated-parameter check of ``checkpointing.save`` (two gloo ranks, tp=2).

    python tools/bench_divergence.py [--parts inputs,sp,save] [--rounds 20] [--sp-layers 4] [--workdir DIR]

The measurement is ``bench/divergence.py`` (its docstring says how); docs/performance.md holds the figures.

nxdtp must be importable: installed (``pip install -e .``) or on PYTHONPATH. ``bench`` is found beside this file.
"""

import sys

from bench.divergence import main

if __name__ == "__main__":
    sys.exit(main())

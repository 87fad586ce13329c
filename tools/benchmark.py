#!/usr/bin/env python
"""nxdtp benchmark (issue 6): train-step time, memory, communication, XLA graphs, checkpoint merge, activation
memory, ZeRO-1 and the checkpoint stall, as markdown tables; with ``--json OUT`` every figure goes to a JSON file.

    python tools/benchmark.py [--quick] [--json OUT] [--sections train,memory,...] [--gpu]   (--help: every option)

The sections are modules of the ``bench`` package beside this file (``bench/suite.py`` runs them in order and prints
the report); docs/performance.md says how each is measured.

nxdtp must be importable: installed (``pip install -e .``) or on PYTHONPATH. ``bench`` is found beside this file.
"""

import sys

from bench.suite import main

if __name__ == "__main__":
    sys.exit(main())

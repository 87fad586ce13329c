#!/usr/bin/env python
"""nxdtp benchmark: the suite of ``python -m tools.bench`` (its ``--help`` lists the sections and options).

    python tools/benchmark.py [--quick] [--json OUT] [--sections train,memory,...] [--gpu]

nxdtp must be importable (``pip install -e .`` or PYTHONPATH); the repository root is put on the path for ``tools``.
"""

import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tools.bench.__main__ import main

    sys.exit(main())

#!/usr/bin/env python
"""nxdtp benchmark: ``python tools/benchmark.py [--quick] [--json OUT] [--sections a,b]`` is ``python -m tools.bench``
(its ``--help`` lists the sections and options; docs/performance.md)."""

import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root, for tools
    from tools.bench.__main__ import main

    sys.exit(main())

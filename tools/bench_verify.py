#!/usr/bin/env python
"""What checksum verification costs: merge and load of a BERT-large tp=8 checkpoint with and without it.

    python tools/bench_verify.py --workdir DIR [--rounds 5] [--operations merge,load,load-live] [--load-rank 1]
        [--json OUT]

The measurement is ``bench/verification.py`` (its docstring says how); this file also runs as its worker processes
(``--worker``).

nxdtp must be importable: installed (``pip install -e .``) or on PYTHONPATH. ``bench`` is found beside this file.
"""

import sys

from bench.verification import main

if __name__ == "__main__":
    sys.exit(main())

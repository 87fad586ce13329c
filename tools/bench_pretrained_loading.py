#!/usr/bin/env python
"""Peak host memory of loading a pretrained Hugging Face BERT: nxdtp's per-rank sharded loading vs. plain HF.

    python tools/bench_pretrained_loading.py --config base --tp 4 [--workdir DIR] [--json OUT]

The measurement is ``bench/pretrained_loading.py`` (its docstring says how); this file also runs as its worker
processes (``--worker``).

nxdtp must be importable: installed (``pip install -e .``) or on PYTHONPATH. ``bench`` is found beside this file.
"""

import sys

from bench.pretrained_loading import main

if __name__ == "__main__":
    sys.exit(main())

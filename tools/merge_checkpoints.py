#!/usr/bin/env python
"""Merge a sharded nxdtp checkpoint into a dense Hugging Face checkpoint, reshard it, export it to DCP or import NxD's:
the ``nxdtp-merge`` console script (nxdtp/cli.py; ``--help`` lists every option, docs/checkpoints.md explains them)."""

import sys

try:
    from nxdtp.cli import main
except ModuleNotFoundError as error:
    if error.name != "nxdtp":
        raise
    sys.exit("merge_checkpoints.py: nxdtp is not importable; install it (pip install -e . in the repository) or put "
             "the repository on PYTHONPATH")

if __name__ == "__main__":
    sys.exit(main())

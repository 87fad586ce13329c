#!/usr/bin/env python
"""Merge a sharded nxdtp checkpoint into a dense Hugging Face checkpoint, reshard it to another TP degree, or export
it to torch.distributed.checkpoint (DCP).

    python tools/merge_checkpoints.py CKPT_DIR OUT_DIR [--tag T] [--reshard N] [--format safetensors|bin] [--force]
                                      [--no-progress]
    python tools/merge_checkpoints.py CKPT_DIR OUT_DIR --to dcp [--tag T] [--force] [--no-progress]
    python tools/merge_checkpoints.py NXD_CKPT_DIR OUT_DIR --from-nxd --config CONFIG_JSON [--tag T] [--force]

The same command is installed as the console script ``nxdtp-merge``; the logic lives in nxdtp/cli.py
(``--help`` lists every option). Exit status 2 with a one-line message on bad input. nxdtp must be importable:
installed (``pip install -e .``, as the README's steps do) or on PYTHONPATH.
"""

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

#!/usr/bin/env python
"""Merge a sharded nxdtp checkpoint into a dense Hugging Face checkpoint, reshard it to another TP degree, or export
it to torch.distributed.checkpoint (DCP).

    python tools/merge_checkpoints.py CKPT_DIR OUT_DIR [--tag T] [--reshard N] [--format safetensors|bin] [--force]
                                      [--no-progress]
    python tools/merge_checkpoints.py CKPT_DIR OUT_DIR --to dcp [--tag T] [--force] [--no-progress]
    python tools/merge_checkpoints.py NXD_CKPT_DIR OUT_DIR --from-nxd --config CONFIG_JSON [--tag T] [--force]

The same command is installed as the console script ``nxdtp-merge``; the logic lives in nxdtp/cli.py
(``--help`` lists every option). Exit status 2 with a one-line message on bad input.
"""

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from nxdtp.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

"""examples/tp_ep_mixtral: NxD's Mixtral flow (TP × EP × DP through NxD's trainer API) against the dense model.

The demo runs as a user runs it (torchrun launches of four processes): pretraining at TP=2 × EP=2, a resume of its
checkpoint at TP=2 × EP=1, the merge, plain transformers loading and generating, and the loss-curve check of TP=2 ×
EP=2 (ZeRO-1, sequence parallelism) and TP=1 × EP=4 against dense transformers, which exits non-zero past 1e-4. The
flag checks run in-process.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.test_example_llama import _parse_error, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "tp_ep_mixtral")
CONFIG = os.path.join(EXAMPLE, "configs", "mixtral_tiny")


@pytest.mark.parametrize("extra, message", [
    (["--capacity_factor", "2.0", "--selective_checkpoint_enabled"],
     "--capacity_factor 2.0: the Hugging Face model nxdtp shards routes every token to its experts (dropless)"),
    (["--expert_parallel_size", "2", "--use_zero_1", "--checkpoint_dir", "ckpt", "--checkpoint_freq", "2",
      "--selective_checkpoint_enabled"],
     "--use_zero_1 with --expert_parallel_size 2 and checkpoints: ZeRO-1's expert shards are not checkpointed yet"),
    ([], "a mixture of experts trained with its load-balancing loss cannot recompute whole decoder layers"),
])
def test_bad_flags_are_one_line(tmp_path, capsys, extra, message):
    line = _parse_error(flags(str(tmp_path / "data"), CONFIG, str(tmp_path), 2, 2) + extra, capsys)
    assert ": error: " in line and message in line, line


@pytest.mark.slow
def test_the_demo_runs_resumes_at_another_expert_parallel_size_and_its_curves_agree(tmp_path):
    env = {**os.environ, "NXDTP_DEMO_SKIP_INSTALL": "1", "NXDTP_DEMO_STEPS": "20", "PYTHONPATH": REPO,
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    done = subprocess.run(["bash", os.path.join(EXAMPLE, "demo.sh"), str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "resumed from" in done.stdout and "at step 10" in done.stdout
    assert "tolerance 0.0001: OK" in done.stdout
    assert os.path.isfile(tmp_path / "loss_curve" / "loss_curve.png")
    assert re.search(r"mean next-token loss on \d+ blocks \d\.\d+ \(an untrained model", done.stdout)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    assert model.config.model_type == "mixtral"

"""TRL's trainers on a parallelized model (``tensor_parallel_trainer(SFTTrainer)``, ``(DPOTrainer)``) equal the dense
TRL run: every number TRL logs per step (loss, grad norm, entropy, token accuracy, token count; DPO's rewards, log-probs
and mean logits) and the final weights, at tp2 x dp1 and tp2 x dp2, fp32, within 1e-5. The runs are
tests/trl_runs.py in processes of their own (torchrun for the TP runs), as tests/test_trainer.py runs Trainer.

Without nxdtp's vocab-parallel fused head (nxdtp.models.fused_head) TRL's head takes the softmax over each rank's
vocabulary slice: the first step's loss is then about ln(vocab / tp) instead of ln(vocab), and these tests fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parent.parent
RUNS = str(ROOT / "tests" / "trl_runs.py")
TOL = dict(atol=1e-5, rtol=1e-5)
pytestmark = pytest.mark.slow   # each case is two to three TRL runs in processes of their own


def _run(tmp: Path, kind: str, name: str, *arguments, ranks: int = 0) -> Path:
    out = tmp / name
    env = {**os.environ, "USE_TORCH_XLA": "0", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] \
        if ranks else [sys.executable]
    run = subprocess.run(launcher + [RUNS, kind, "tp" if ranks else "dense", str(out), *arguments],
                         capture_output=True, text=True, env=env, timeout=600, cwd=tmp)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return out


def _weights(directory: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


@pytest.fixture(scope="module", params=["sft", "dpo"])
def dense(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    return request.param, tmp, _run(tmp, request.param, "dense")


@pytest.mark.parametrize("layout", ["tp2", "tp2dp2"])
def test_trl_trainer_equals_dense_trl(dense, layout):
    kind, tmp, dense_out = dense
    arguments = ("--tp", "2") if layout == "tp2" else ("--tp", "2", "--per_device", "1")
    out = _run(tmp, kind, layout, *arguments, ranks=2 if layout == "tp2" else 4)
    expected, got = json.loads((dense_out / "log.json").read_text()), json.loads((out / "log.json").read_text())
    assert [e["step"] for e in got] == [e["step"] for e in expected] == [1, 2, 3], (layout, got)
    for step, reference in zip(got, expected):
        assert sorted(step) == sorted(reference), (kind, layout, sorted(step), sorted(reference))
        for key, value in reference.items():
            torch.testing.assert_close(torch.tensor(step[key], dtype=torch.float64),
                                       torch.tensor(value, dtype=torch.float64), **TOL,
                                       msg=lambda m: f"{kind} {layout} step {step['step']} {key}: {m}")
    dense_weights, weights = _weights(dense_out), _weights(out / "final")
    assert sorted(weights) == sorted(dense_weights), (kind, layout)
    for name, value in dense_weights.items():
        torch.testing.assert_close(weights[name], value, **TOL, msg=lambda m: f"{kind} {layout} {name}: {m}")

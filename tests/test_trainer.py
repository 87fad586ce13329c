"""``nxdtp.models.trainer.TensorParallelTrainer`` against Hugging Face's ``Trainer`` on the dense model.

Each run is a process of its own (tests/trainer_runs.py; TP runs under torchrun with gloo): a tiny Llama (every
parameter randomised, biases included), 4 optimizer steps of SGD with gradient clipping (max_grad_norm 0.5, which
clips every step, so a norm that ignored sharding would change the update), gradient accumulation 2, and a global
batch of 4 (dense: 2 per step x 2; tp2 x dp1: the same; tp2 x dp2: 1 per DP rank x 2 ranks x 2). Trainer's logged loss
and grad norm of every step, and every final weight (the TP run's checkpoint merged with nxdtp-merge), equal the dense
run's within 1e-5. A run saved at step 2 and resumed from its checkpoint-2 ends bit-exactly where the uninterrupted run
ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
RUNS = str(ROOT / "tests" / "trainer_runs.py")
TOL = dict(atol=1e-5, rtol=1e-5)
pytestmark = pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                                reason="TensorParallelTrainer uses transformers 5's Trainer")


def _run(tmp: Path, name: str, *arguments, ranks: int = 0, kind: str = "", expect_failure: bool = False):
    out = tmp / name
    # Trainer takes an XLA device whenever torch_xla is installed, unless told not to before transformers loads.
    env = {**os.environ, "USE_TORCH_XLA": "0", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] \
        if ranks else [sys.executable]
    run = subprocess.run(launcher + [RUNS, kind or ("tp" if ranks else "dense"), str(out), *arguments],
                         capture_output=True, text=True, env=env, timeout=600, cwd=tmp)
    if expect_failure:
        assert run.returncode != 0, run.stdout[-3000:]
        return run.stdout + run.stderr
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return out


def _log(out: Path) -> list:
    return json.loads((out / "log.json").read_text())


def _merged_weights(tag_parent: Path, tmp: Path) -> dict:
    from safetensors.torch import load_file

    from nxdtp.checkpointing.cli import main as merge

    merged = tmp / f"merged-{tag_parent.parent.name}-{tag_parent.name}"
    if not merged.exists():
        assert merge([str(tag_parent), str(merged)]) == 0
    return load_file(str(merged / "model.safetensors"))


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer")
    out = _run(tmp, "dense")
    from safetensors.torch import load_file

    return tmp, _log(out), load_file(str(out / "model.safetensors"))


def _check_equals_dense(out: Path, dense, what: str) -> None:
    tmp, dense_log, dense_weights = dense
    log = _log(out)
    assert [e["step"] for e in log] == [e["step"] for e in dense_log] == [1, 2, 3, 4], (what, log)
    for step, expected in zip(log, dense_log):
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor(step[key]), torch.tensor(expected[key]), **TOL,
                                       msg=lambda m: f"{what} step {step['step']} {key}: {m}")
    weights = _merged_weights(out / "final", tmp)
    assert sorted(weights) == sorted(dense_weights), what
    for name, value in dense_weights.items():
        torch.testing.assert_close(weights[name], value, **TOL, msg=lambda m: f"{what} {name}: {m}")


def test_tp2_equals_dense_trainer(dense):
    _check_equals_dense(_run(dense[0], "tp2", "--tp", "2", ranks=2), dense, "tp2 x dp1")


def test_tp2_dp2_equals_dense_trainer(dense):
    _check_equals_dense(_run(dense[0], "tp2dp2", "--tp", "2", "--per_device", "1", ranks=4), dense, "tp2 x dp2")


def test_save_and_resume_equal_the_uninterrupted_run(dense):
    tmp = dense[0]
    whole = _run(tmp, "saved", "--save_steps", "2", ranks=2)
    checkpoint = whole / "checkpoint-2"
    assert (checkpoint / "nxdtp_training").is_dir() and (checkpoint / "trainer_state.json").is_file()
    resumed = _run(tmp, "resumed", "--resume", str(whole / "checkpoint-2"), ranks=2)
    assert _log(resumed) == _log(whole)
    final, resumed_final = _merged_weights(whole / "final", tmp), _merged_weights(resumed / "final", tmp)
    assert all(torch.equal(resumed_final[name], value) for name, value in final.items())
    _check_equals_dense(resumed, dense, "resumed tp2")


def test_plain_trainer_on_a_tp_model_is_refused_before_it_trains(tmp_path):
    output = _run(tmp_path, "plain", ranks=2, kind="plain", expect_failure=True)
    assert "is tensor-parallel (nxdtp) and is being trained by a multi-process accelerate setup" in output, output
    assert "Use nxdtp.models.trainer.TensorParallelTrainer" in output
    assert not (tmp_path / "plain" / "final").exists()


# ---- what is refused, at construction --------------------------------------------------------------------------------

def case_refusals():
    from nxdtp.models import parallelize_model
    from nxdtp.models.trainer import TensorParallelTrainer

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = parallelize_model(transformers.LlamaForCausalLM(config))
    refused = {}
    for what, args, extra in (
            ("deepspeed", dict(deepspeed="ds.json"), {}),
            ("fsdp", dict(fsdp="full_shard"), {}),
            ("label_smoothing_factor=0.1", dict(label_smoothing_factor=0.1), {}),
            ("load_best_model_at_end=True", dict(load_best_model_at_end=True), {}),
            ("compute_loss_func", {}, dict(compute_loss_func=lambda *a, **k: None)),
            ("compute_metrics", {}, dict(compute_metrics=lambda p: {}))):
        with pytest.raises(ValueError, match="TensorParallelTrainer cannot run this configuration: .*" + what) as e:
            TensorParallelTrainer(model=model, args=types.SimpleNamespace(**args), **extra)
        refused[what] = str(e.value)
    with pytest.raises(TypeError, match="has no tensor-parallel parameter"):
        TensorParallelTrainer(model=transformers.LlamaForCausalLM(config), args=types.SimpleNamespace())
    return sorted(refused)


def test_unsupported_modes_are_refused_at_construction(worlds):
    refused = worlds(2).run(case_refusals, tensor_model_parallel_size=2)
    assert refused[0] == refused[1] and len(refused[0]) == 6

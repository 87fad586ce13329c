"""``nxdtp.models.hf_trainer.TensorParallelTrainer`` against Hugging Face's ``Trainer`` on the dense model.

Each run is a process of its own (tests/trainer_runs.py; TP runs under torchrun with gloo): a tiny Llama (every
parameter randomised, biases included), 4 optimizer steps of SGD with gradient clipping (max_grad_norm 0.5, which
clips every step, so a norm that ignored sharding would change the update), gradient accumulation 2, and a global
batch of 4 (dense: 2 per step x 2; tp2 x dp1: the same; tp2 x dp2: 1 per DP rank x 2 ranks x 2). Trainer's logged loss
and grad norm of every step, and every final weight (from the HF directory trainer.save_model writes), equal the dense
run's within 1e-5. The same runs then evaluate and predict (compute_metrics, preprocess_logits_for_metrics): eval loss,
metrics and full-vocabulary predictions equal dense's, and from_pretrained of save_model's directory reproduces the
predictions. bf16 runs are compared at bf16's precision. A run saved at step 2 and resumed from its checkpoint-2 ends
bit-exactly where the uninterrupted run ends.
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


def _final_weights(out: Path) -> dict:
    """The weights trainer.save_model wrote: an HF directory (the dense run's OUT, the TP runs' OUT/final)."""
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors"))


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer")
    out = _run(tmp, "dense", "--eval")
    return tmp, _log(out), _final_weights(out), out


@pytest.fixture(scope="module")
def tp2(dense):
    return _run(dense[0], "tp2", "--tp", "2", "--eval", ranks=2)


@pytest.fixture(scope="module")
def tp2dp2(dense):
    return _run(dense[0], "tp2dp2", "--tp", "2", "--per_device", "1", "--eval", ranks=4)


def _check_equals_dense(out: Path, dense, what: str, tol: dict = TOL, saved_as: dict = None) -> None:
    """``saved_as``: {name in dense's file: name in the TP run's} for a tensor the two save under different names."""
    _, dense_log, dense_weights, _ = dense
    log = _log(out)
    assert [e["step"] for e in log] == [e["step"] for e in dense_log] == [1, 2, 3, 4], (what, log)
    for step, expected in zip(log, dense_log):
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor(step[key]), torch.tensor(expected[key]), **tol,
                                       msg=lambda m: f"{what} step {step['step']} {key}: {m}")
    weights = _final_weights(out / "final")
    for dense_name, name in (saved_as or {}).items():
        weights[dense_name] = weights.pop(name)
    assert sorted(weights) == sorted(dense_weights), what
    for name, value in dense_weights.items():
        torch.testing.assert_close(weights[name], value, **tol, msg=lambda m: f"{what} {name}: {m}")


def test_tp2_equals_dense_trainer(dense, tp2):
    _check_equals_dense(tp2, dense, "tp2 x dp1")


def test_tp2_dp2_equals_dense_trainer(dense, tp2dp2):
    _check_equals_dense(tp2dp2, dense, "tp2 x dp2")


# ---- bf16 ------------------------------------------------------------------------------------------------------------

BF16_RTOL = 2 ** -8   # bf16 keeps 8 significant bits: one rounding of a logged value is within 2^-9 relative


@pytest.mark.slow   # two more Trainer runs (dense and tp2 in bf16)
def test_bf16_tp2_equals_dense_bf16_trainer(dense):
    """bf16=True (accelerate's bf16 autocast; on CPU too) at tp2 x dp1 against the dense model trained by Trainer with
    bf16=True. TP sums a matmul's partial products in another order and rounds the row-parallel partials to bf16
    before the all-reduce, so the runs agree to bf16's precision, not fp32's: each logged loss and grad norm within
    2^-8 relative; each weight's update (final - initial) within 5e-2 of its norm, and no further from the dense bf16
    update than 3x bf16's own error (the dense bf16 update against the dense fp32 one; measured: TP's deviation
    0.3-1.5x bf16's, 3.5e-3 to 2.9e-2 relative, the largest on the key bias whose exact gradient is ~0). A real
    mistake (a local norm, an unaveraged or missing gradient) moves an update by O(1) of its norm."""
    sys.path.insert(0, str(ROOT / "tests"))
    from trainer_runs import dense_model

    tmp, _, fp32_weights, _ = dense
    dense_bf16 = _run(tmp, "dense-bf16", "--precision", "bf16")
    tp_bf16 = _run(tmp, "tp2-bf16", "--tp", "2", "--precision", "bf16", ranks=2)
    log, expected_log = _log(tp_bf16), _log(dense_bf16)
    assert [e["step"] for e in log] == [e["step"] for e in expected_log] == [1, 2, 3, 4], log
    for step, expected in zip(log, expected_log):
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor(step[key]), torch.tensor(expected[key]), atol=0, rtol=BF16_RTOL,
                                       msg=lambda m: f"bf16 step {step['step']} {key}: {m}")
    initial = {name: value.detach() for name, value in dense_model().state_dict().items()}
    weights, expected_weights = _final_weights(tp_bf16 / "final"), _final_weights(dense_bf16)
    assert sorted(weights) == sorted(expected_weights) == sorted(initial)
    for name, start in initial.items():
        update, expected, fp32 = (w[name] - start for w in (weights, expected_weights, fp32_weights))
        deviation, bf16_error = (update - expected).norm(), (expected - fp32).norm()
        assert deviation <= 5e-2 * expected.norm(), (name, deviation / expected.norm())
        assert deviation <= 3 * bf16_error, (name, deviation, bf16_error)


# ---- evaluate, predict, compute_metrics ------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["tp2", "tp2dp2"])
def test_evaluate_and_predict_equal_dense(dense, layout, request):
    """After training: trainer.evaluate() (compute_metrics on argmax ids from preprocess_logits_for_metrics) gives the
    dense eval loss and metrics over the 8 eval samples; trainer.predict() on 9 samples (not a multiple of the global
    eval batch of 2: the last batch is padded at tp2 x dp2 and cut back) returns the dense full-vocabulary logits, each
    sample once, and the same metrics. The argmax id sum catches argmaxes over a rank's vocabulary shard."""
    import numpy as np

    out, dense_out = request.getfixturevalue(layout), dense[3]
    got, expected = (json.loads((o / "eval.json").read_text()) for o in (out, dense_out))
    for phase, prefix in (("evaluate", "eval"), ("predict", "test")):
        for key in ("counted", "argmax_id_sum"):
            assert got[phase][f"{prefix}_{key}"] == expected[phase][f"{prefix}_{key}"], (layout, phase, key, got)
        # predict's loss is not compared: its incomplete last batch is padded at dp2, and Trainer's loss counts the
        # padding samples there, as it does under DDP (docs/wrapping_hf_models.md).
        for key in ("loss", "accuracy") if phase == "evaluate" else ("accuracy",):
            torch.testing.assert_close(torch.tensor(got[phase][f"{prefix}_{key}"]),
                                       torch.tensor(expected[phase][f"{prefix}_{key}"]), **TOL,
                                       msg=lambda m: f"{layout} {phase} {key}: {m}")
    labels, dense_labels = np.load(out / "label_ids.npy"), np.load(dense_out / "label_ids.npy")
    assert labels.shape == dense_labels.shape == (9, 8) and (labels == dense_labels).all(), layout
    predictions, dense_predictions = np.load(out / "predictions.npy"), np.load(dense_out / "predictions.npy")
    assert predictions.shape == dense_predictions.shape == (9, 8, 67), (layout, predictions.shape)
    torch.testing.assert_close(torch.from_numpy(predictions), torch.from_numpy(dense_predictions), **TOL)


def test_save_model_writes_an_hf_directory_from_pretrained_loads(tp2):
    """trainer.save_model(dir) writes the dense HF directory: from_pretrained gives the TP model's gathered logits
    (what trainer.predict returned after training) on the prediction set."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "tests"))
    from trainer_runs import PREDICT_SAMPLES, Samples

    final = tp2 / "final"
    assert (final / "config.json").is_file() and (final / "training_args.bin").is_file()
    model = transformers.LlamaForCausalLM.from_pretrained(str(final)).eval()
    with torch.no_grad():
        logits = model(input_ids=Samples(PREDICT_SAMPLES, seed=6).ids).logits
    torch.testing.assert_close(logits, torch.from_numpy(np.load(tp2 / "predictions.npy")), **TOL)


@pytest.fixture(scope="module")
def saved(dense):
    """The tp2 run of ``tp2``, saving checkpoint-2 and checkpoint-4."""
    return _run(dense[0], "saved", "--save_steps", "2", ranks=2)


def test_save_and_resume_equal_the_uninterrupted_run(dense, saved):
    tmp, whole = dense[0], saved
    checkpoint = whole / "checkpoint-2"
    assert (checkpoint / "nxdtp_training").is_dir() and (checkpoint / "trainer_state.json").is_file()
    resumed = _run(tmp, "resumed", "--resume", str(whole / "checkpoint-2"), ranks=2)
    assert _log(resumed) == _log(whole)
    # A second run into the same output_dir, not resuming: refused before it trains (it failed at its first save).
    before = sorted(p.name for p in whole.iterdir())
    output = _run(tmp, "saved", "--save_steps", "2", ranks=2, expect_failure=True)
    assert "holds checkpoints of an earlier run (checkpoint-2, checkpoint-4)" in output, output[-3000:]
    assert "resume_from_checkpoint=True" in output and sorted(p.name for p in whole.iterdir()) == before
    final, resumed_final = _final_weights(whole / "final"), _final_weights(resumed / "final")
    assert all(torch.equal(resumed_final[name], value) for name, value in final.items())
    _check_equals_dense(resumed, dense, "resumed tp2")


@pytest.mark.slow   # a Trainer run each
@pytest.mark.parametrize("layout,arguments,ranks", [
    ("tp2dp2", ("--tp", "2", "--per_device", "1"), 4),
    ("tp4", ("--tp", "4"), 4),
    ("tp1dp2-merged", ("--tp", "1", "--per_device", "1"), 2)])
def test_resume_at_another_size_continues_the_uninterrupted_run(dense, saved, layout, arguments, ranks):
    """checkpoint-2 of the tp2 x dp1 run resumed at tp2 x dp2 (the tag as it is), at tp4 (resharded by the trainer into
    its output_dir) and at tp1 x dp2 from what ``nxdtp-merge --reshard 1`` wrote: every step's loss and grad norm and
    the final weights equal the uninterrupted run's, and the dense Trainer's (the global batch is the same)."""
    tmp = dense[0]
    checkpoint = saved / "checkpoint-2"
    if layout.endswith("merged"):
        checkpoint = tmp / "merged-tp1"
        merge = subprocess.run([sys.executable, "-m", "nxdtp.cli", str(saved / "checkpoint-2"), str(checkpoint),
                                "--reshard", "1", "--no-progress"], capture_output=True, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert merge.returncode == 0, merge.stderr[-3000:]
    resumed = _run(tmp, f"resumed-{layout}", *arguments, "--resume", str(checkpoint), ranks=ranks)
    tp = int(arguments[1])
    assert (resumed / f"resharded-tp{tp}-checkpoint-2").is_dir() == (layout == "tp4"), sorted(resumed.iterdir())
    for step, expected in zip(_log(resumed), _log(saved), strict=True):
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor(step[key]), torch.tensor(expected[key]), **TOL,
                                       msg=lambda m: f"{layout} step {step['step']} {key}: {m}")
    final = _final_weights(saved / "final")
    for name, value in _final_weights(resumed / "final").items():
        torch.testing.assert_close(value, final[name], **TOL, msg=lambda m: f"{layout} {name}: {m}")
    _check_equals_dense(resumed, dense, f"resumed at {layout}")


def test_plain_trainer_on_a_tp_model_is_refused_before_it_trains(tmp_path):
    output = _run(tmp_path, "plain", ranks=2, kind="plain", expect_failure=True)
    assert "is tensor-parallel (nxdtp) and is being trained by an accelerate setup that is not" in output, output
    assert "Use nxdtp.models.hf_trainer.TensorParallelTrainer" in output
    assert not (tmp_path / "plain" / "final").exists()


def test_without_use_cpu_on_cpus_both_trainers_refuse_instead_of_training_nothing(tmp_path):
    """torchrun on CPUs without TrainingArguments(use_cpu=True): accelerate does not see the world (one process,
    DistributedType.NO), and Trainer's loss scale num_processes // tp_size is 0: the run logged loss 0.0 and left the
    weights untouched, exiting 0. TensorParallelTrainer refuses at construction, naming use_cpu; plain Trainer is
    refused at its first training forward (each rank would train alone, clipping by its local shards' norm)."""
    output = _run(tmp_path, "no_use_cpu", "--no_use_cpu", ranks=2, expect_failure=True)
    assert "accelerate sees 1 process(es)" in output and "TrainingArguments(use_cpu=True)" in output, output[-3000:]
    output = _run(tmp_path, "plain_no_use_cpu", "--no_use_cpu", ranks=2, kind="plain", expect_failure=True)
    assert "is being trained by an accelerate setup that is not" in output and "1 process(es)" in output, \
        output[-3000:]
    assert not (tmp_path / "no_use_cpu" / "final").exists() and not (tmp_path / "plain_no_use_cpu" / "final").exists()


# ---- LoRA (PEFT) -----------------------------------------------------------------------------------------------------

@pytest.mark.slow  # two torchrun launches (~19 s); TP LoRA equals dense LoRA in process: test_peft
def test_lora_with_tensor_parallel_trainer_equals_dense_lora_trainer(dense):
    """get_peft_model(parallelized model, LoraConfig(...)) trained by TensorParallelTrainer at tp2 x dp2 equals the
    dense LoRA model trained by Trainer: every step's loss and pre-clip grad norm (the adapters' only) within 1e-5, and
    the adapter save_model writes (PEFT's adapter_model.safetensors, dense factors) equal to the dense run's."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    tmp = dense[0]
    dense_lora = _run(tmp, "dense-lora", "--lora")
    tp_lora = _run(tmp, "tp2dp2-lora", "--tp", "2", "--per_device", "1", "--lora", ranks=4)
    log, expected_log = _log(tp_lora), _log(dense_lora)
    assert [e["step"] for e in log] == [e["step"] for e in expected_log] == [1, 2, 3, 4], log
    for step, expected in zip(log, expected_log):
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor(step[key]), torch.tensor(expected[key]), **TOL,
                                       msg=lambda m: f"LoRA step {step['step']} {key}: {m}")
    adapters = load_file(str(tp_lora / "final" / "adapter_model.safetensors"))
    expected_adapters = load_file(str(dense_lora / "adapter_model.safetensors"))
    assert sorted(adapters) == sorted(expected_adapters) and len(adapters) == 2 * 7 * 2, sorted(adapters)
    for name, value in expected_adapters.items():
        torch.testing.assert_close(adapters[name], value, **TOL, msg=lambda m: f"LoRA adapter {name}: {m}")


@pytest.mark.slow   # two more Trainer runs each
@pytest.mark.parametrize("option", ["--custom_loss", "--label_smoothing"])
def test_losses_reading_the_logits_equal_dense(tmp_path, option):
    """Trainer's compute_loss_func, and its label smoother, read ``outputs.logits``: the full-vocabulary logits
    (nxdtp.models.logits), so the run equals the dense one; on vocab-parallel logits their softmax would cover half the
    vocabulary."""
    dense_out = _run(tmp_path, "dense", option)
    dense = (tmp_path, _log(dense_out), _final_weights(dense_out), dense_out)
    _check_equals_dense(_run(tmp_path, "tp2dp2", "--tp", "2", "--per_device", "1", option, ranks=4), dense,
                        f"tp2 x dp2, {option}")


# ---- what is refused, at construction --------------------------------------------------------------------------------

def case_refusals():
    from nxdtp.models import parallelize_model
    from nxdtp.models.hf_trainer import TensorParallelTrainer, tensor_parallel_trainer

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = parallelize_model(transformers.LlamaForCausalLM(config))
    refused = {}
    for what, args, extra in (
            ("deepspeed", dict(deepspeed="ds.json"), {}),
            ("fp16=True", dict(fp16=True), {}),
            ("push_to_hub=True", dict(push_to_hub=True), {}),
            ("fsdp", dict(fsdp="full_shard"), {}),
            ("load_best_model_at_end=True", dict(load_best_model_at_end=True), {}),
            ("precompute_ref_log_probs=True", dict(precompute_ref_log_probs=True), {})):
        with pytest.raises(ValueError, match="TensorParallelTrainer cannot run this configuration: .*" + what) as e:
            TensorParallelTrainer(model=model, args=types.SimpleNamespace(**args), **extra)
        refused[what] = str(e.value)
    with pytest.raises(TypeError, match="has no tensor-parallel parameter"):
        TensorParallelTrainer(model=transformers.LlamaForCausalLM(config), args=types.SimpleNamespace())
    with pytest.raises(TypeError, match="takes a subclass of transformers.Trainer, not <class 'object'>"):
        tensor_parallel_trainer(object)
    import trl  # the test extra's; TRL trainers whose online generation splits batches by process are refused

    for trainer_class in (trl.GRPOTrainer, trl.RLOOTrainer):
        with pytest.raises(ValueError, match=f"TensorParallel{trainer_class.__name__} cannot run this configuration: "
                                             f"{trainer_class.__name__}: it generates completions for every process"):
            tensor_parallel_trainer(trainer_class)(model=model, reward_funcs=lambda **_: [],
                                                   args=types.SimpleNamespace())
    return sorted(refused)


def test_unsupported_modes_are_refused_at_construction(worlds):
    refused = worlds(2).run(case_refusals, tensor_model_parallel_size=2)
    assert refused[0] == refused[1] and len(refused[0]) == 6


@pytest.fixture(scope="module")
def dense_mixtral(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer_mixtral")
    out = _run(tmp, "dense", "--model", "mixtral")
    return tmp, _log(out), _final_weights(out), out


@pytest.mark.slow
def test_mixtral_tp2_ep2_trainer_equals_dense_and_resumes_at_another_expert_parallel_size(dense_mixtral):
    """A mixture of experts through TensorParallelTrainer at tp=2 x ep=2 (4 ranks, one sample per DP rank): the
    logged loss (with the load-balancing loss) and grad norm of every step and the final weights equal the dense
    Trainer's; its checkpoint-2, which holds every expert, resumes at tp=2 x ep=1 to the same end."""
    tmp = dense_mixtral[0]
    whole = _run(tmp, "tp2ep2", "--model", "mixtral", "--ep", "2", "--per_device", "1", "--save_steps", "2", ranks=4)
    _check_equals_dense(whole, dense_mixtral, "mixtral tp2 x ep2")
    resumed = _run(tmp, "resumed", "--model", "mixtral", "--ep", "1", "--per_device", "1",
                   "--resume", str(whole / "checkpoint-2"), ranks=4)
    _check_equals_dense(resumed, dense_mixtral, "mixtral resumed at tp2 x ep1")


# ---- encoders: the masked-LM loss over Trainer's global count -------------------------------------------------------

@pytest.mark.slow   # two Trainer runs each (~30 s under load); the loss itself: test_models_bert.py
@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_masked_lm_tp2_dp2_trainer_equals_the_dense_global_batch_mean(tmp_path, family):
    """BertForMaskedLM / RobertaForMaskedLM through TensorParallelTrainer at tp=2 x dp=2 with gradient accumulation 2
    (one sample per DP rank per micro-batch): the MLM loss is divided by Trainer's ``num_items_in_batch``, as the
    decoder families' loss is, so every step's logged loss and grad norm and the final weights equal the dense Trainer
    on the whole global batch of 4 at once. The dense reference takes no accumulation: HF's dense MLM head ignores
    ``num_items_in_batch`` and returns each micro-batch's mean, which Trainer, believing it normalised, neither
    divides by the accumulation steps nor leaves undivided by DP (it multiplies by the DP size)."""
    dense_out = _run(tmp_path, "dense", "--model", family, "--per_device", "4", "--accumulation", "1")
    dense = (tmp_path, _log(dense_out), _final_weights(dense_out), dense_out)
    tp2dp2 = _run(tmp_path, "tp2dp2", "--model", family, "--tp", "2", "--per_device", "1", ranks=4)
    # nxdtp saves RoBERTa's MLM bias (one tensor under two names) under the name every transformers release loads.
    saved_as = {"lm_head.bias": "lm_head.decoder.bias"} if family == "roberta" else {}
    _check_equals_dense(tp2dp2, dense, f"{family} tp2 x dp2", saved_as=saved_as)

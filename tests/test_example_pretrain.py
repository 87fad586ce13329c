"""examples/tp_dp_bert: the pretraining script against its own dense-equivalent layouts.

Most runs call the script's ``run()`` inside the shared gloo worker pools (tests/harness.py), which saves a process
start per run; the command-line paths (torchrun, XLA:CPU, two nodes) run as real launches. Equality of layouts is the
dense reference here: TP=1 × DP=2 is plain data parallelism over the same global batch, and the layer-level tests
already compare TP with dense modules.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "tp_dp_bert")
COMMON = os.path.join(REPO, "examples", "common")   # runtime, training_log, rank_failure: shared by the examples
SCRIPT = os.path.join(EXAMPLE, "tp_dp_bert_large_hf_pretrain_hdf5.py")
SEQ_LEN, MAX_PRED, VOCAB = 64, 10, 1001   # a vocabulary that TP=2 must pad


def _example_module(name: str):
    for directory in (COMMON, EXAMPLE):
        if directory not in sys.path:
            sys.path.insert(0, directory)
    return __import__(name)


# ---- cases run on every rank of a worker pool ------------------------------------------------------------------------

def case_train(argv):
    script = _example_module("tp_dp_bert_large_hf_pretrain_hdf5")
    return script.run(script.parse_args(argv))


def case_train_with_fault(argv, fault, bad_step, rank, accum, stdout_path):
    """The script's run, with one rank made non-finite at optimizer step ``bad_step``, then restored.

    ``fault="gradient"``: an inf in one gradient element of rank ``rank`` just before the DP all-reduce (the script's
    ``grads`` is swapped for a copy whose allreduce_gradients does it). The DP average spreads it to the DP peers, the
    norm's TP all-reduce to every rank. ``fault="loss"``: the attention bias of that rank's TP group (every TP rank of
    its DP replica, since the ranks of a TP group must get the same inputs, which the model checks) is NaN in every
    micro-batch of the step (the script's ``attention_bias`` is swapped), so its loss is NaN; the DP loss all-reduce
    spreads it."""
    import types

    from nxdtp import parallel_state

    script = _example_module("tp_dp_bert_large_hf_pretrain_hdf5")
    real_grads, real_bias = script.grads, script.attention_bias
    steps, micro_batches = [], []
    poisoned = torch.distributed.get_rank() == rank

    def in_poisoned_tp_group() -> bool:
        # The script installs the topology; TP groups are contiguous ranks.
        tp = parallel_state.get_tensor_model_parallel_size()
        return torch.distributed.get_rank() // tp == rank // tp

    def allreduce_gradients(model, *args, **kwargs):
        steps.append(1)
        if fault == "gradient" and len(steps) == bad_step and poisoned:
            sharded = next(p for p in model.parameters() if getattr(p, "tensor_model_parallel", False))
            sharded.grad.view(-1)[0] = float("inf")
        return real_grads.allreduce_gradients(model, *args, **kwargs)

    def attention_bias(*args, **kwargs):
        micro_batches.append(1)
        bias = real_bias(*args, **kwargs)
        if fault == "loss" and (len(micro_batches) - 1) // accum + 1 == bad_step and in_poisoned_tp_group():
            bias = torch.full_like(bias, float("nan"))
        return bias

    script.grads = types.SimpleNamespace(**{**vars(real_grads), "allreduce_gradients": allreduce_gradients})
    script.attention_bias = attention_bias
    # What the ranks print goes to a file: the pool's processes may predate the test's output capture.
    with open(f"{stdout_path}.{torch.distributed.get_rank()}", "w") as printed, \
            contextlib.redirect_stdout(printed):
        try:
            return script.run(script.parse_args(argv))
        finally:
            script.grads, script.attention_bias = real_grads, real_bias


# ---- fixtures --------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("pretraining_data"))
    builder = _example_module("build_pretraining_data")
    builder.main(["--output_dir", directory, "--synthetic", "--vocab_size", str(VOCAB), "--seq_len", str(SEQ_LEN),
                  "--max_pred_len", str(MAX_PRED), "--num_sequences", "640", "--num_shards", "2", "--seed", "3"])
    return directory


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    from transformers import BertConfig

    directory = str(tmp_path_factory.mktemp("bert_tiny"))
    BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
               max_position_embeddings=SEQ_LEN).save_pretrained(directory)
    return directory


def training_argv(data_dir, model_config, output_dir, tp, dp, global_batch=16, accum=1, steps=20, lr=2e-3,
                  dropout=0.0, *extra):
    argv = ["--data_dir", data_dir, "--output_dir", output_dir, "--metrics_file",
            os.path.join(output_dir, "results.json"), "--model_config", model_config,
            "--tensor_parallel_size", str(tp), "--batch_size", str(global_batch // dp), "--grad_accum_usteps",
            str(accum), "--steps_this_run", str(steps), "--max_steps", str(steps), "--warmup_steps", "2",
            "--lr", str(lr), "--seq_len", str(SEQ_LEN), "--max_pred_len", str(MAX_PRED), "--shards_per_ckpt", "0",
            "--seed", "11", "--device", "cpu", "--print_grad_norm"]
    if dropout is not None:
        argv += ["--dropout", str(dropout)]
    return argv + list(extra)


def step_log(output_dir):
    return _example_module("training_log").read_step_log(output_dir)


def losses(output_dir):
    return [r["loss"] for r in step_log(output_dir)]


def assert_curves_agree(a, b, tolerance):
    assert len(a) == len(b), (len(a), len(b))
    worst = max(abs(x - y) for x, y in zip(a, b))
    assert worst <= tolerance, f"max |loss difference| {worst:.3e} > {tolerance:g}\n{a}\n{b}"


def assert_falls(curve, factor=0.9):
    assert all(map(lambda v: v == v and abs(v) != float("inf"), curve)), curve
    tail = sum(curve[-3:]) / 3
    assert tail < factor * curve[0], f"the loss did not fall: first {curve[0]:.4f}, mean of last 3 {tail:.4f}"


# ---- TP × DP equals DP on the same global batch ----------------------------------------------------------------------

@pytest.mark.parametrize("accum", [1, 2])
def test_tp2_dp1_matches_tp1_dp2_over_20_steps(worlds, data_dir, model_config, tmp_path, accum):
    runs = {}
    for tp, dp in ((2, 1), (1, 2)):
        out = str(tmp_path / f"tp{tp}")
        worlds(2).run(case_train, tensor_model_parallel_size=None,
                      argv=training_argv(data_dir, model_config, out, tp, dp, accum=accum))
        runs[tp] = step_log(out)
    # fp32 sums over a different reduction order (a TP all-reduce vs a DP all-reduce) drift by ~1e-6 per step.
    assert_curves_agree([r["loss"] for r in runs[2]], [r["loss"] for r in runs[1]], 1e-4)
    norms2, norms1 = [r["grad_norm"] for r in runs[2]], [r["grad_norm"] for r in runs[1]]
    assert max(abs(a - b) / b for a, b in zip(norms2, norms1)) < 1e-4, (norms2, norms1)
    assert_falls([r["loss"] for r in runs[2]])
    assert_falls([r["loss"] for r in runs[1]])


def test_lamb_tp2_equals_lamb_without_tp(worlds, data_dir, model_config, tmp_path):
    from safetensors.torch import load_file

    from nxdtp.checkpointing.merge import merge

    merged = {}
    curves = {}
    for tp, dp in ((2, 1), (1, 2)):
        out = str(tmp_path / f"tp{tp}")
        worlds(2).run(case_train, tensor_model_parallel_size=None,
                      argv=training_argv(data_dir, model_config, out, tp, dp, steps=3, lr=5e-3)
                      + ["--optimizer", "LAMB"])
        curves[tp] = losses(out)
        merged[tp] = load_file(merge(out, str(tmp_path / f"merged{tp}"), progress=False))
    assert_curves_agree(curves[2], curves[1], 1e-5)
    assert merged[2].keys() == merged[1].keys()
    for name in merged[1]:
        torch.testing.assert_close(merged[2][name], merged[1][name], rtol=1e-5, atol=1e-5, msg=name)


# ---- the options -----------------------------------------------------------------------------------------------------

def test_sequence_parallel_and_activation_checkpointing_change_nothing(worlds, data_dir, model_config, tmp_path):
    curves = {}
    for name, flags in (("plain", []), ("sp", ["--sequence_parallel"]), ("ac", ["--activation_checkpointing"]),
                        ("sp_ac", ["--sequence_parallel", "--activation_checkpointing"])):
        out = str(tmp_path / name)
        worlds(2).run(case_train, tensor_model_parallel_size=None,
                      argv=training_argv(data_dir, model_config, out, 2, 1, steps=8) + flags)
        curves[name] = losses(out)
    assert_falls(curves["plain"], 0.97)
    for name in ("sp", "ac", "sp_ac"):
        assert_curves_agree(curves[name], curves["plain"], 1e-4)


@pytest.mark.parametrize("flag", ["--bf16", "--enable_pt_autocast"])
def test_bf16_options_train(worlds, data_dir, model_config, tmp_path, flag):
    out = str(tmp_path / "run")
    worlds(2).run(case_train, tensor_model_parallel_size=None,
                  argv=training_argv(data_dir, model_config, out, 2, 1, steps=8) + [flag])
    fp32 = str(tmp_path / "fp32")
    worlds(2).run(case_train, tensor_model_parallel_size=None,
                  argv=training_argv(data_dir, model_config, fp32, 2, 1, steps=8))
    curve = losses(out)
    assert_falls(curve, 0.97)
    # bf16 keeps 8 bits of mantissa: the curve follows fp32's within a few percent, not within fp32 tolerance.
    assert max(abs(a - b) / b for a, b in zip(curve, losses(fp32))) < 0.05


def test_ddp_over_the_dp_group_equals_nxdtp_all_reduce(worlds, data_dir, model_config, tmp_path):
    curves = {}
    for name, flags in (("nxdtp", []), ("ddp", ["--ddp"])):
        out = str(tmp_path / name)
        worlds(4).run(case_train, tensor_model_parallel_size=None,
                      argv=training_argv(data_dir, model_config, out, 2, 2, accum=2, steps=5) + flags)
        curves[name] = [(r["loss"], r["grad_norm"]) for r in step_log(out)]
    for (loss_a, norm_a), (loss_b, norm_b) in zip(curves["ddp"], curves["nxdtp"]):
        assert abs(loss_a - loss_b) < 1e-5 and abs(norm_a - norm_b) < 1e-5 * norm_b, curves


# ---- checkpoints and resuming ----------------------------------------------------------------------------------------

def test_resume_continues_the_loss_curve_exactly(worlds, data_dir, model_config, tmp_path):
    # Dropout on: resuming must restore the RNG states too, not only weights, optimizer, schedule and data position.
    straight = str(tmp_path / "straight")
    worlds(2).run(case_train, tensor_model_parallel_size=None,
                  argv=training_argv(data_dir, model_config, straight, 2, 1, accum=2, steps=10, dropout=0.1))
    split = str(tmp_path / "split")
    first = training_argv(data_dir, model_config, split, 2, 1, accum=2, steps=10, dropout=0.1)
    first[first.index("--steps_this_run") + 1] = "4"
    worlds(2).run(case_train, tensor_model_parallel_size=None, argv=first)
    worlds(2).run(case_train, tensor_model_parallel_size=None,
                  argv=training_argv(data_dir, model_config, split, 2, 1, accum=2, steps=10, dropout=0.1)
                  + ["--resume_ckpt"])
    resumed = step_log(split)
    assert [r["step"] for r in resumed] == list(range(1, 11))
    assert [r["loss"] for r in resumed] == losses(straight)
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in step_log(straight)]
    # Resuming a finished run (a requeued job) is a no-op; resuming an older step next to newer tags is refused.
    again = training_argv(data_dir, model_config, split, 2, 1, accum=2, steps=10, dropout=0.1) + ["--resume_ckpt"]
    summary = worlds(2).run(case_train, tensor_model_parallel_size=None, argv=again)
    assert summary[0]["global_step"] == 10 and summary[0]["final_loss"] is None
    with pytest.raises(AssertionError, match=r"newer checkpoint\(s\) \['step_000010'\]"):
        worlds(2).run(case_train, tensor_model_parallel_size=None, argv=again + ["--resume_step", "4"])


def test_resume_on_another_dp_layout_continues_the_same_curve(worlds, data_dir, model_config, tmp_path):
    # Saved as TP=2 x DP=1, resumed as TP=2 x DP=2 on the same global batch: the data position is re-derived from the
    # consumed sequences, and with dropout off the curve is the uninterrupted one. (The saved RNG states belong to the
    # old layout; the script notes that and continues.)
    straight = str(tmp_path / "straight")
    worlds(2).run(case_train, tensor_model_parallel_size=None,
                  argv=training_argv(data_dir, model_config, straight, 2, 1, steps=6))
    split = str(tmp_path / "split")
    first = training_argv(data_dir, model_config, split, 2, 1, steps=6)
    first[first.index("--steps_this_run") + 1] = "3"
    worlds(2).run(case_train, tensor_model_parallel_size=None, argv=first)
    worlds(4).run(case_train, tensor_model_parallel_size=None,
                  argv=training_argv(data_dir, model_config, split, 2, 2, steps=6) + ["--resume_ckpt"])
    assert [r["step"] for r in step_log(split)] == list(range(1, 7))
    assert_curves_agree(losses(split), losses(straight), 1e-4)


# ---- ZeRO-1 (--use_zero_1, --use_mix_precision) ----------------------------------------------------------------------

def _curve(out):
    return [(r["loss"], r["grad_norm"]) for r in step_log(out)]


def test_zero1_follows_the_plain_curve_and_resumes_bit_exactly(worlds, data_dir, model_config, tmp_path):
    """TP = 2 x DP = 2, 2 accumulation micro-steps, dropout on, a max_norm that clips: --use_zero_1 gives the losses
    and pre-clip norms of the plain DP all-reduce path, and 3 steps + save + resume to 6 equal 6 straight ZeRO-1 steps
    bit for bit (optimizer state, fp32 master shards, scheduler, RNG and data position restored)."""
    from nxdtp import checkpointing

    def argv(out, steps, *flags):
        a = training_argv(data_dir, model_config, out, 2, 2, 16, 2, 6, 2e-3, 0.1, "--max_grad_norm", "0.5", *flags)
        a[a.index("--steps_this_run") + 1] = str(steps)
        return a

    runs = {}
    for name, flags in (("plain", ()), ("zero1", ("--use_zero_1",))):
        out = str(tmp_path / name)
        worlds(4).run(case_train, tensor_model_parallel_size=None, argv=argv(out, 6, *flags))
        runs[name] = _curve(out)
    assert min(norm for _, norm in runs["plain"]) > 0.5  # every step clips
    # The same DP average, by reduce-scatter instead of all-reduce, and the same norm summed in another order (per
    # shard, then over DP): fp32 ulps per step, which clipping and Adam carry on. 1e-5 relative is ~100 ulps.
    for (loss_z, norm_z), (loss_p, norm_p) in zip(runs["zero1"], runs["plain"]):
        assert abs(loss_z - loss_p) <= 1e-5 * loss_p and abs(norm_z - norm_p) <= 1e-5 * norm_p, runs
    assert len(runs["zero1"]) == 6
    split = str(tmp_path / "split")
    worlds(4).run(case_train, tensor_model_parallel_size=None, argv=argv(split, 3, "--use_zero_1"))
    index = checkpointing.CheckpointIndex.read(os.path.join(split, "step_000003"))
    assert index.optimizer["kind"] == "zero1", index.optimizer
    worlds(4).run(case_train, tensor_model_parallel_size=None, argv=argv(split, 6, "--use_zero_1", "--resume_ckpt"))
    assert [r["step"] for r in step_log(split)] == list(range(1, 7))
    assert _curve(split) == runs["zero1"]


@pytest.mark.slow   # two runs of the example with resume; the fp32 ZeRO-1 curve and resume stay in the default set
def test_zero1_mix_precision_trains_and_resumes_bit_exactly(worlds, data_dir, model_config, tmp_path):
    """--use_zero_1 --use_mix_precision at TP = 2 x DP = 2: bf16 weights, fp32 master shards. The curve stays within
    5 % of fp32's (bf16 compute), and a resume continues bit for bit: the bf16 model file alone could not, the fp32
    masters saved with the optimizer do."""
    def argv(out, steps, *flags):
        a = training_argv(data_dir, model_config, out, 2, 2, 16, 2, 6, 2e-3, 0.0, *flags)
        a[a.index("--steps_this_run") + 1] = str(steps)
        return a

    fp32, straight, split = (str(tmp_path / n) for n in ("fp32", "straight", "split"))
    worlds(4).run(case_train, tensor_model_parallel_size=None, argv=argv(fp32, 6))
    mixed = ("--use_zero_1", "--use_mix_precision")
    worlds(4).run(case_train, tensor_model_parallel_size=None, argv=argv(straight, 6, *mixed))
    curve = losses(straight)
    assert max(abs(a - b) / b for a, b in zip(curve, losses(fp32))) < 0.05, (curve, losses(fp32))
    assert_falls(curve, 0.98)  # 6 steps, 2 of them warmup: 7.60 -> 7.38 measured
    worlds(4).run(case_train, tensor_model_parallel_size=None, argv=argv(split, 3, *mixed))
    from safetensors.torch import load_file

    saved = load_file(os.path.join(split, "step_000003", "model", "tp_rank_00.safetensors"))
    # Floating tensors only: transformers 4.x's BERT also saves its int64 position_ids buffer.
    assert {t.dtype for t in saved.values() if t.is_floating_point()} == {torch.bfloat16}
    worlds(4).run(case_train, tensor_model_parallel_size=None, argv=argv(split, 6, *mixed, "--resume_ckpt"))
    assert _curve(split) == _curve(straight)


@pytest.mark.parametrize("flags, message", [
    (["--use_mix_precision"], "--use_mix_precision gives bf16 weights over the fp32 master shards of --use_zero_1"),
    (["--use_zero_1", "--bf16"], "--use_zero_1 shards the fp32 master weights itself: use --use_mix_precision"),
    (["--use_zero_1", "--ddp"], "--use_zero_1 reduce-scatters the gradients over the DP group itself"),
    (["--use_zero_1", "--use_mix_precision", "--enable_pt_autocast"],
     "--use_mix_precision and --enable_pt_autocast are alternatives"),
])
def test_zero1_flag_combinations_that_make_no_sense_are_refused(model_config, capsys, flags, message):
    script = _example_module("tp_dp_bert_large_hf_pretrain_hdf5")
    with pytest.raises(SystemExit):
        script.parse_args(["--model_config", model_config] + flags)
    assert message in capsys.readouterr().err


def test_bad_data_stops_with_a_clear_error(worlds, data_dir, model_config, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(AssertionError, match=re.escape(str(empty))):
        worlds(2).run(case_train, tensor_model_parallel_size=None,
                      argv=training_argv(str(empty), model_config, str(tmp_path / "o1"), 2, 1))
    argv = training_argv(data_dir, model_config, str(tmp_path / "o2"), 2, 1)
    argv[argv.index("--seq_len") + 1] = "128"
    with pytest.raises(AssertionError, match="--seq_len 128"):
        worlds(2).run(case_train, tensor_model_parallel_size=None, argv=argv)
    one_shard = tmp_path / "one_shard"
    one_shard.mkdir()
    source = sorted(f for f in os.listdir(data_dir) if "_training_" in f)[0]
    os.symlink(os.path.join(data_dir, source), one_shard / source)
    with pytest.raises(AssertionError, match="2 data-parallel ranks"):
        worlds(2).run(case_train, tensor_model_parallel_size=None,
                      argv=training_argv(str(one_shard), model_config, str(tmp_path / "o3"), 1, 2))
    # --init_from a directory without a config: named before any rank builds anything.
    argv = training_argv(data_dir, model_config, str(tmp_path / "o4"), 2, 1) + ["--init_from", str(empty)]
    del argv[argv.index("--model_config"):argv.index("--model_config") + 2]
    with pytest.raises(AssertionError, match=re.escape(f"--init_from {empty}: no config.json there")):
        worlds(2).run(case_train, tensor_model_parallel_size=None, argv=argv)


def test_init_from_refuses_debug_shapes(model_config, capsys):
    script = _example_module("tp_dp_bert_large_hf_pretrain_hdf5")
    with pytest.raises(SystemExit):
        script.parse_args(["--init_from", model_config, "--debug"])
    assert "--init_from loads a model's weights; --debug would change its shapes" in capsys.readouterr().err


# ---- real launches ---------------------------------------------------------------------------------------------------

def _launch(command, env_extra=None, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout + done.stderr


LOG_LINE = re.compile(r"^LOG \w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4} - \((\d+), (\d+)\) step_loss : (\d+\.\d{4}) "
                      r"learning_rate : (\d\.\d\de[-+]\d\d) throughput : (\d+\.\d\d) seq/s grad-norm : (\S+)$",
                      re.MULTILINE)


def test_the_nxd_tutorial_flags_run_under_torchrun(data_dir, tmp_path):
    out, metrics = str(tmp_path / "out"), str(tmp_path / "results.json")
    # The tutorial's command, scaled down: --tensor_parallel_size 8 --steps_this_run 10 --batch_size 64
    # --grad_accum_usteps 64 becomes 2 / 3 / 4 / 2, with NxD's --debug model.
    flags = ["--data_dir", data_dir, "--output_dir", out, "--metrics_file", metrics, "--optimizer", "LAMB",
             "--batch_size", "4", "--max_steps", "10", "--steps_this_run", "3", "--shards_per_ckpt", "1",
             "--seed", "5", "--lr", "1e-3", "--seq_len", str(SEQ_LEN), "--debug", "--max_pred_len", str(MAX_PRED),
             "--warmup_steps", "2", "--grad_accum_usteps", "2", "--print_grad_norm", "--test_checkpointing",
             "--tensor_parallel_size", "2", "--model_config", str(tmp_path / "config")]
    from transformers import BertConfig

    BertConfig(vocab_size=VOCAB, max_position_embeddings=SEQ_LEN).save_pretrained(str(tmp_path / "config"))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT]
    output = _launch(torchrun + flags)
    steps = [(int(e), int(s), float(loss)) for e, s, loss, *_ in LOG_LINE.findall(output)]
    assert [s for _, s, _ in steps] == [1, 2, 3], output
    assert "verified: every tensor reloads exactly" in output
    with open(metrics) as f:
        results = json.load(f)["results"]
    assert results["parameters"]["Tensor parallel degree"] == 2
    names = [m["MetricName"] for m in results["metrics"]]
    assert {"Final loss", "Time to train", "Average throughput", "Peak throughput"} <= set(names)
    final = next(m for m in results["metrics"] if m["MetricName"] == "Final loss")["MeasuredValue"]
    assert abs(final - steps[-1][2]) < 1e-4
    # NxD's resume flags: continue from the newest checkpoint to step 5, or from a named step.
    output = _launch(torchrun + flags[:flags.index("--steps_this_run")] + ["--steps_this_run", "5"]
                     + flags[flags.index("--steps_this_run") + 2:] + ["--resume_ckpt", "--resume_step", "3"])
    assert [int(s) for _, s, *_ in LOG_LINE.findall(output)] == [4, 5], output


@pytest.mark.slow  # two torchrun launches of 2 processes: about 40 s on 2 cores
def test_zero1_with_lamb_under_torchrun_follows_the_plain_lamb_curve(data_dir, model_config, tmp_path):
    """--use_zero_1 --optimizer lamb launched by torchrun at DP = 2: LAMB's per-parameter trust ratios over ZeRO-1's
    flat shards give the losses and pre-clip norms of plain LAMB with the DP all-reduce."""
    runs = {}
    for name, flags in (("plain", []), ("zero1", ["--use_zero_1"])):
        out = str(tmp_path / name)
        argv = training_argv(data_dir, model_config, out, 1, 2, 16, 2, 4, 2e-3, 0.1, "--max_grad_norm", "0.5",
                             "--optimizer", "lamb", *flags)
        _launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT] + argv)
        runs[name] = _curve(out)
    assert len(runs["zero1"]) == 4 and min(norm for _, norm in runs["plain"]) > 0.5, runs  # every step clips
    for (loss_z, norm_z), (loss_p, norm_p) in zip(runs["zero1"], runs["plain"]):  # as in the ZeRO-1 test above
        assert abs(loss_z - loss_p) <= 1e-5 * loss_p and abs(norm_z - norm_p) <= 1e-5 * norm_p, runs


@pytest.mark.slow
def test_xla_cpu_runs_one_graph_per_step_and_matches_eager(data_dir, model_config, tmp_path):
    pytest.importorskip("torch_xla")
    runs = {}
    for device in ("xla", "cpu"):
        out = str(tmp_path / device)
        argv = training_argv(data_dir, model_config, out, 1, 1, global_batch=8, steps=6)
        argv[argv.index("--device") + 1] = device
        _launch([sys.executable, SCRIPT] + argv, env_extra={"PJRT_DEVICE": "CPU"})
        runs[device] = step_log(out)
    records = runs["xla"]
    for before, after in zip(records[2:], records[3:]):
        assert after["xla_uncached_compiles"] == before["xla_uncached_compiles"], records
        assert after["xla_executions"] - before["xla_executions"] == 1, records
    # XLA:CPU fuses and reorders fp32 arithmetic: the same math, a few ulps apart per op.
    assert_curves_agree([r["loss"] for r in records], [r["loss"] for r in runs["cpu"]], 1e-4)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_loopback_nodes_match_one_node(data_dir, model_config, tmp_path):
    curves = {}
    one = str(tmp_path / "one_node")
    _launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", SCRIPT]
            + training_argv(data_dir, model_config, one, 2, 2, steps=4))
    curves["one"] = losses(one)
    two = str(tmp_path / "two_nodes")
    port = str(_free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={rank}",
                               "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}", SCRIPT]
                              + training_argv(data_dir, model_config, two, 2, 2, steps=4),
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    curves["two"] = losses(two)
    assert curves["two"] == curves["one"]


@pytest.mark.parametrize("fault, loss_printed, norm_printed", [("gradient", "[0-9.]+", "inf"),
                                                                    ("loss", "nan", "nan")])
def test_a_non_finite_step_is_logged_and_stops_before_saving(worlds, data_dir, model_config, tmp_path, fault,
                                                              loss_printed, norm_printed):
    """An inf gradient, or a NaN loss on one DP rank, at step 3 of a tp2 x dp2 run: every rank stops at step 3 with the
    step named, the LOG line of the step is printed, and only steps 1 and 2 are saved."""
    from nxdtp import checkpointing

    out = str(tmp_path / fault)
    accum = 2
    argv = training_argv(data_dir, model_config, out, 2, 2, 16, accum, steps=5) + ["--save_every_steps", "1"]
    argv.remove("--print_grad_norm")  # the bad step's grad-norm is printed anyway
    with pytest.raises(AssertionError) as failure:
        worlds(4).run(case_train_with_fault, tensor_model_parallel_size=None, argv=argv, fault=fault, bad_step=3,
                      rank=3, accum=accum, stdout_path=str(tmp_path / "stdout"))
    # Every rank stops at step 3, not only the one whose numbers went bad.
    assert "failed on ranks [0, 1, 2, 3]" in str(failure.value), str(failure.value)[-3000:]
    stops = re.findall(rf"NonFiniteStepError: step 3: non-finite step_loss : {loss_printed} grad-norm : "
                       rf"{norm_printed}; stopping without saving step 3 \(last checkpoint: step 2\)",
                       str(failure.value))
    assert len(stops) == 4, str(failure.value)[-3000:]
    records = step_log(out)
    assert [r["step"] for r in records] == [1, 2, 3], records
    assert all(math.isfinite(r[key]) for r in records[:2] for key in ("loss", "grad_norm")), records
    if fault == "gradient":
        assert records[2]["grad_norm"] == float("inf") and math.isfinite(records[2]["loss"]), records
    else:
        assert math.isnan(records[2]["loss"]) and math.isnan(records[2]["grad_norm"]), records
    assert checkpointing.list_tags(out) == ["step_000001", "step_000002"]
    printed = (tmp_path / "stdout.0").read_text()
    assert re.search(rf"LOG .* - \(\d+, 3\) step_loss : {loss_printed} learning_rate : \S+ throughput : \S+ seq/s "
                     rf"grad-norm : {norm_printed}", printed), printed[-3000:]
    assert re.search(r"LOG .* - \(\d+, 3\) ERROR step 3: non-finite", printed), printed[-3000:]
    # The newest saved step holds the finite weights of step 2, not the step-3 update.
    from safetensors.torch import load_file

    for shard in ("tp_rank_00", "tp_rank_01"):
        weights = load_file(os.path.join(out, "step_000002", "model", f"{shard}.safetensors"))
        assert all(torch.isfinite(w).all() for w in weights.values()), shard

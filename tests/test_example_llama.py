"""examples/tp_zero1_llama: NxD's Llama pretraining script, against the dense model.

The reference is examples/tp_zero1_llama/dense_reference.py: Hugging Face's LlamaForCausalLM with torch's AdamW in one
process, no nxdtp. The script runs as real torchrun launches of four processes (TP=2 × DP=2 with ZeRO-1 and sequence
parallelism); its flag and data checks run in-process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from nxdtp.errors import DamagedInputError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "tp_zero1_llama")
COMMON = os.path.join(REPO, "examples", "common")
SCRIPT = os.path.join(EXAMPLE, "tp_zero1_llama_hf_pretrain.py")
SEQ_LEN, VOCAB = 32, 256

# NxD's LOG line (its logger.py), with the grad norm of --print_grad_norm.
LOG_LINE = re.compile(r"^LOG \w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4} - \((\d+), (\d+)\) step_loss : (\d+\.\d{4}) "
                      r"learning_rate : (\d\.\d\de[-+]\d\d) throughput : (\d+\.\d\d) seq/s grad-norm : (\S+)$",
                      re.MULTILINE)
TIME_LINE = re.compile(r"^TIME \((\d+), (\d+)\) forward : \d+\.\d{3} s backward : \d+\.\d{3} s optimizer : "
                       r"\d+\.\d{3} s checkpoint : (\d+\.\d{3}) s step : \d+\.\d{3} s throughput : \d+\.\d tokens/s$",
                       re.MULTILINE)


def _module(name: str):
    for directory in (COMMON, EXAMPLE):
        if directory not in sys.path:
            sys.path.insert(0, directory)
    return __import__(name)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("llama_data"))
    _module("build_llama_data").main(["--output_dir", directory, "--synthetic", "--vocab_size", str(VOCAB),
                                      "--seq_len", str(SEQ_LEN), "--num_blocks", "256", "--seed", "3"])
    return directory


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from transformers import LlamaConfig

    directory = str(tmp_path_factory.mktemp("llama_tiny"))
    # 4 query heads over 2 KV heads; a vocabulary TP=2 divides (the merge test elsewhere covers padding).
    LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=SEQ_LEN, tie_word_embeddings=False,
                ).save_pretrained(directory)
    return directory


def flags(data_dir, model_path, out, tp, batch_size, steps=4, steps_this_run=None, *extra):
    return ["--model_path", model_path, "--data_dir", data_dir, "--output_dir", out,
            "--metrics_file", os.path.join(out, "results.json"), "--tensor_parallel_size", str(tp),
            "--batch_size", str(batch_size), "--grad_accum_usteps", "2", "--max_steps", str(steps),
            "--steps_this_run", str(steps if steps_this_run is None else steps_this_run), "--warmup_steps", "1",
            "--lr", "5e-3", "--seq_len", str(SEQ_LEN), "--seed", "5", "--print_grad_norm", *extra]


def _launch(command, timeout=300, check=True):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "USE_TORCH_XLA": "0", "PJRT_DEVICE": "CPU"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done


def _torchrun(nproc):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", SCRIPT]


# ---- TP=2 x DP=2 with ZeRO-1 equals dense, and a resumed run continues exactly --------------------------------

# Three torchrun launches of 4 ranks (~35 s): slow. ZeRO-1 and SP equal dense in process in test_zero1 and
# test_models_decoders.
@pytest.mark.slow
def test_tp2_dp2_zero1_equals_dense_and_resumes_exactly(data_dir, model_path, tmp_path):
    """Launch 1 trains steps 1-2 of a 4-step schedule and saves; launch 2, with NxD's --loading_step
    latest_if_exists, resumes there and trains steps 3-4. All four step losses must equal the dense reference's
    (one process, plain transformers, global batch 4 x 2 micro-steps): a resume that lost the optimizer state, the
    scheduler or the data position would not. Launch 3, the same again, says there is nothing to train."""
    out, checkpoints = str(tmp_path / "run"), str(tmp_path / "checkpoints")
    layout = ["--use_zero_1", "--sequence_parallel_enabled", "--device", "cpu", "--checkpoint_dir", checkpoints,
              "--checkpoint_freq", "2", "--loading_step", "latest_if_exists"]
    first = _launch(_torchrun(4) + flags(data_dir, model_path, out, 2, 2, 4, 2, *layout))
    assert "resumed" not in first.stdout, "there was no checkpoint to resume from"
    assert "step_2" in os.listdir(checkpoints)
    second = _launch(_torchrun(4) + flags(data_dir, model_path, out, 2, 2, 4, None, *layout))
    assert "at step 2" in second.stdout, second.stdout[-3000:]
    # The same command again: the newest checkpoint is at --max_steps, so there is nothing to train, and the run says
    # so instead of ending quietly with "loss None".
    third = _launch(_torchrun(4) + flags(data_dir, model_path, str(tmp_path / "again"), 2, 2, 4, None, *layout))
    assert "nothing to train: the checkpoint is at step 4 and this run stops at step 4" in third.stdout, \
        third.stdout[-3000:]
    assert not LOG_LINE.findall(third.stdout)

    logged = [(int(e), int(s), float(loss)) for e, s, loss, *_ in LOG_LINE.findall(first.stdout + second.stdout)]
    assert [s for _, s, _ in logged] == [1, 2, 3, 4], first.stdout[-2000:] + second.stdout[-2000:]
    timed = TIME_LINE.findall(first.stdout + second.stdout)
    assert [int(s) for _, s, _ in timed] == [1, 2, 3, 4]
    assert float(timed[1][2]) > 0 and float(timed[0][2]) == 0   # step 2 saved a checkpoint, step 1 did not

    records = _module("training_log").read_step_log(out)
    losses = [r["loss"] for r in records]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    dense_args = _module("tp_zero1_llama_hf_pretrain").parse_args(
        flags(data_dir, model_path, str(tmp_path / "dense"), 1, 4))
    torch.manual_seed(0)
    dense = _module("dense_reference").train(dense_args)
    assert max(abs(a - b) for a, b in zip(losses, dense)) < 1e-5, (losses, dense)
    assert dense[-1] < dense[0]

    with open(os.path.join(out, "results.json")) as f:
        results = json.load(f)["results"]
    assert results["parameters"]["Data parallel degree"] == 2 and results["parameters"]["Model"] == "llama"
    names = {m["MetricName"] for m in results["metrics"]}
    assert {"Final loss", "Time to train", "Average throughput", "Peak throughput", "Loss", "Throughput"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("extra, tolerance", [
    (["--use_zero_1", "--use_mix_precision", "--selective_checkpoint_enabled"], 0.05),   # bf16 weights and compute
    (["--use_meta_device_init", "--no_activation_checkpointing", "--use_flash_attention", "0"], None),
])
def test_precision_and_initialisation_options(data_dir, model_path, tmp_path, extra, tolerance):
    """--use_mix_precision (bf16 with fp32 master shards) stays within bf16 rounding of the dense fp32 curve;
    --use_meta_device_init draws another init (nn.Linear's), so its loss only has to fall."""
    out = str(tmp_path / "run")
    done = _launch(_torchrun(4) + flags(data_dir, model_path, out, 2, 2, 6) + ["--device", "cpu", *extra])
    losses = [r["loss"] for r in _module("training_log").read_step_log(out)]
    assert len(losses) == 6 and all(map(lambda v: abs(v) < float("inf"), losses)), done.stdout[-2000:]
    if tolerance is None:
        assert losses[-1] < losses[0], losses
        return
    dense = _module("dense_reference").train(_module("tp_zero1_llama_hf_pretrain").parse_args(
        flags(data_dir, model_path, str(tmp_path / "dense"), 1, 4, 6)))
    assert max(abs(a - b) for a, b in zip(losses, dense)) < tolerance, (losses, dense)
    assert "bfloat16" in json.load(open(os.path.join(out, "results.json")))["results"]["parameters"]["Data type"]


@pytest.mark.slow
@pytest.mark.xla
def test_xla_cpu_run_equals_dense(data_dir, model_path, tmp_path):
    """One process on XLA:CPU (--device xla; XLA:CPU is one replica per process, so TP=1): the lazy-tensor path (step
    closures, one graph per step, a checkpoint saved after the graph ran) gives the dense curve."""
    pytest.importorskip("torch_xla")
    out = str(tmp_path / "xla")
    done = _launch([sys.executable, SCRIPT] + flags(data_dir, model_path, out, 1, 4)
                   + ["--device", "xla", "--checkpoint_dir", str(tmp_path / "ck"), "--checkpoint_freq", "2"])
    assert "training on xla" in done.stdout, done.stdout[-2000:]
    assert os.path.isdir(tmp_path / "ck" / "step_4")
    losses = [r["loss"] for r in _module("training_log").read_step_log(out)]
    dense = _module("dense_reference").train(_module("tp_zero1_llama_hf_pretrain").parse_args(
        flags(data_dir, model_path, str(tmp_path / "dense"), 1, 4)))
    assert max(abs(a - b) for a, b in zip(losses, dense)) < 1e-4, (losses, dense)


# ---- one clear line for bad flags and bad data ------------------------------------------------------------------

def _parse_error(argv, capsys) -> str:
    script = _module("tp_zero1_llama_hf_pretrain")
    with pytest.raises(SystemExit) as exit_:
        script.parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    return err[-1]


@pytest.mark.parametrize("extra, message", [
    (["--use_mix_precision"], "--use_mix_precision keeps fp32 master weights in the ZeRO-1 optimizer's shards"),
    (["--context_parallel_size", "2"], "--context_parallel_size 2: nxdtp has no context parallelism"),
    (["--loading_step", "newest"], "--loading_step 'newest' must be a step number"),
    (["--loading_step", "latest_if_exists"], "--loading_step and --pretrained_weight load from --checkpoint_dir"),
    (["--kv_replicator", "3", "--tensor_parallel_size", "4"], "--kv_replicator 3: 2 KV heads x 3"),
    (["--use_gpu_compatible_precision", "0", "--device", "cpu"], "--use_gpu_compatible_precision 0 is NxD's"),
    (["--batch_size", "0"], "--batch_size 0 must be >= 1"),
    (["--lr", "inf"], "--lr inf must be a finite number >= 0"),
])
def test_bad_flags_are_one_line(data_dir, model_path, tmp_path, capsys, extra, message):
    line = _parse_error(flags(data_dir, model_path, str(tmp_path), 2, 2) + extra, capsys)
    assert ": error: " in line and message in line, line


def test_a_damaged_config_is_one_line(data_dir, tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 32,')
    line = _parse_error(flags(data_dir, str(tmp_path), str(tmp_path / "out"), 1, 2), capsys)
    assert "config.json" in line, line
    missing = _parse_error(flags(data_dir, str(tmp_path / "nowhere"), str(tmp_path / "out"), 1, 2), capsys)
    assert "no config.json there" in missing, missing


def test_bad_data_is_a_data_error_naming_what_is_wrong(data_dir, tmp_path):
    data = _module("llama_data")
    with pytest.raises(data.DataError, match="does not exist"):
        data.PackedBlocks(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DamagedInputError, match="holds neither packed_blocks.safetensors nor") as error:
        data.PackedBlocks(str(tmp_path / "empty"))
    assert isinstance(error.value, data.DataError)  # nxdtp's one base class for damaged input catches it
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / data.LIGHT_FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(data.DataError, match="not a readable safetensors file"):
        data.PackedBlocks(str(tmp_path / "garbage"))
    blocks = data.PackedBlocks(data_dir)
    with pytest.raises(data.DataError, match=r"token id \d+ at position \d+, outside the model's vocabulary"):
        next(data.MicroBatches(blocks, 2, 1, 0, vocab_size=8))
    with pytest.raises(data.DataError, match="fewer than one global micro-batch"):
        data.MicroBatches(blocks, 200, 2, 0, vocab_size=VOCAB)
    ragged = torch.zeros(4, 3, dtype=torch.int32)
    data.write_light(str(tmp_path / "short"), {"input_ids": ragged[:, :1]})
    with pytest.raises(data.DataError, match="give no next-token target"):
        data.PackedBlocks(str(tmp_path / "short"))


def test_bad_data_ends_the_run_with_one_line(model_path, tmp_path):
    """A dataset whose token ids exceed the model's vocabulary (another tokenizer's): the run stops with one line
    naming the row and the vocabulary, exit status 1, no traceback."""
    wide = str(tmp_path / "wide")
    _module("build_llama_data").main(["--output_dir", wide, "--synthetic", "--vocab_size", str(4 * VOCAB),
                                      "--seq_len", str(SEQ_LEN), "--num_blocks", "32"])
    done = _launch([sys.executable, SCRIPT] + flags(wide, model_path, str(tmp_path / "out"), 1, 2)
                   + ["--device", "cpu"], check=False)
    assert done.returncode == 1, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "DataError" in errors[0] and f"[0, {VOCAB})" in errors[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_a_non_finite_step_stops_the_run_unsaved(data_dir, model_path, tmp_path):
    """--lr 1e30 (0 in step 1's warmup): step 2's update blows the weights up and step 3's gradient norm is NaN. The
    run prints step 3's LOG line with its grad norm, stops with one line, exit status 1, and saves no step 3."""
    out, checkpoints = str(tmp_path / "out"), tmp_path / "ck"
    argv = flags(data_dir, model_path, out, 1, 2) + ["--lr", "1e30", "--device", "cpu", "--checkpoint_dir",
                                                      str(checkpoints), "--checkpoint_freq", "1"]
    done = _launch([sys.executable, SCRIPT] + argv, check=False)
    assert done.returncode == 1, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "NonFiniteStepError: step 3: non-finite" in errors[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert re.search(r"\(0, 3\) step_loss : \S+ .* grad-norm : nan", done.stdout), done.stdout[-2000:]
    assert {"step_1", "step_2"} <= set(os.listdir(checkpoints)) and "step_3" not in os.listdir(checkpoints)


# ---- NxD's data format -----------------------------------------------------------------------------------------------

def test_nxd_datasets_form_reads_as_the_light_form(data_dir, tmp_path):
    """NxD's get_dataset.py writes Dataset.save_to_disk (columns input_ids, attention_mask, labels): the example
    reads it row for row as it reads the light form, and the builder converts it."""
    pytest.importorskip("datasets")
    data, builder = _module("llama_data"), _module("build_llama_data")
    nxd_form, converted = str(tmp_path / "nxd"), str(tmp_path / "converted")
    builder.main(["--output_dir", nxd_form, "--synthetic", "--vocab_size", str(VOCAB), "--seq_len", str(SEQ_LEN),
                  "--num_blocks", "256", "--seed", "3", "--format", "datasets"])
    assert os.path.isfile(os.path.join(nxd_form, "state.json"))
    builder.main(["--output_dir", converted, "--from_hf_dataset", nxd_form])
    light, hf, back = (data.PackedBlocks(d) for d in (data_dir, nxd_form, converted))
    assert (hf.form, light.form, back.form) == ("datasets", "safetensors", "safetensors")
    for other in (hf, back):
        a = next(data.MicroBatches(light, 4, 2, 1, VOCAB))
        b = next(data.MicroBatches(other, 4, 2, 1, VOCAB))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_every_layout_reads_the_same_global_batches(data_dir):
    """NxD's DistributedSampler order: the k-th micro-batches of all DP ranks together are the same rows whatever
    the DP size, for the same global micro-batch."""
    data = _module("llama_data")
    blocks = data.PackedBlocks(data_dir)
    for k in (0, 3, 40):
        rows = {dp: sorted(i for r in range(dp) for i in data.MicroBatches(blocks, 8 // dp, dp, r, VOCAB).indices(k))
                for dp in (1, 2, 4, 8)}
        assert all(v == rows[1] for v in rows.values()), rows
        assert rows[1] == list(range((k % (256 // 8)) * 8, (k % (256 // 8)) * 8 + 8))


# ---- the demo ---------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_demo_runs_and_its_curves_agree(tmp_path):
    """demo.sh in the current environment (no install): pretraining, merge, transformers load and generation, and
    the loss-curve check, which exits non-zero if a curve differs from dense by more than 1e-4."""
    env = {**os.environ, "NXDTP_DEMO_SKIP_INSTALL": "1", "NXDTP_DEMO_STEPS": "20", "PYTHONPATH": REPO,
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    done = subprocess.run(["bash", os.path.join(EXAMPLE, "demo.sh"), str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "tolerance 0.0001: OK" in done.stdout
    assert os.path.isfile(tmp_path / "loss_curve" / "loss_curve.png")
    assert re.search(r"mean next-token loss on \d+ blocks \d\.\d+ \(an untrained model", done.stdout)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    assert model.config.model_type == "llama"

"""``nxdtp verify``: a model's TP run against the dense model, reported per step; PASS on the built-in families and a
tp_plan family, FAIL naming the parameter on a wrong plan, exit status 2 naming the value on bad input.

The fast cases run the verification itself (``run_in_world``) on the shared tp=2 pool: a right plan passes, and a
plan that declares a row-parallel layer column-parallel fails naming that layer's parameter (a run that builds and
steps, only with wrong numbers). The slow cases run the command as a user does, which starts its own two processes
per run: Llama, GPT-2, BERT and Granite (HF's tp_plan), at tp=2 and one at tp=2 x dp=2, and the wrong plan through
``--factory`` / ``--plan``.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from nxdtp.plan import ColumnParallel, Plan, ReplicatedWithGradAllReduce, RowParallel
from nxdtp.verify import Job, StepRow, run_in_world
from nxdtp.verify.cli import main
from nxdtp.verify.compare import failures, worst_parameter
from nxdtp.verify.models import perturb_constant_parameters, tiny_config

PREFIX = "tests.test_verify:"
FACTORY = "tests.test_verify:tiny_mlp"
BATCH = "tests.test_verify:mlp_batch"


class TinyMLP(nn.Module):
    """fc1 then fc2; the loss is the mean square of fc2's output, so a plan that leaves fc2's output split still runs
    (each rank's loss is then the mean over its half)."""

    def __init__(self, d: int = 8, h: int = 16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))).square().mean()


def tiny_mlp() -> nn.Module:
    return TinyMLP()


class Gain(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.full((1,), 1.5))

    def forward(self, x):
        return x * self.weight


class GainedMLP(TinyMLP):
    """A replicated gain between fc1 and fc2 acts on each rank's share of fc1's features: each rank holds part of its
    gradient, which must be summed over TP."""

    def __init__(self):
        super().__init__()
        self.gain = Gain()

    def forward(self, x):
        return self.fc2(self.gain(torch.tanh(self.fc1(x)))).square().mean()


def gained_mlp() -> nn.Module:
    return GainedMLP()


def gained_plan() -> Plan:
    return Plan(styles={"fc1": ColumnParallel(), "gain": ReplicatedWithGradAllReduce(), "fc2": RowParallel()})


def mlp_batch(rows: int, seq_len: int, generator: torch.Generator):
    return {"x": torch.randn(rows, seq_len, 8, generator=generator)}


def right_plan() -> Plan:
    return Plan(styles={"fc1": ColumnParallel(), "fc2": RowParallel()})


# fc2 is row-parallel (it takes fc1's split output); declared column-parallel, it gets fc1's gathered output and
# leaves its own split.
WRONG_PLAN = Plan(styles={"fc1": ColumnParallel(gather_output=True), "fc2": ColumnParallel()})


def case_verify(plan: str, steps: int = 2, factory: str = FACTORY, **options):
    job = Job(tp=2, steps=steps, factory=factory, plan=plan, batch=BATCH, seq_len=4, **options)
    rows = run_in_world(job)
    return [dict(loss=(r.loss_dense, r.loss_tp), grad=r.grad.name, ratio=r.grad.ratio, drift=r.drift)
            for r in rows], failures(rows, job), worst_parameter(rows, job)


def test_a_right_plan_passes(worlds):
    (rows, failed, worst), other = worlds(2).run(case_verify, tensor_model_parallel_size=2,
                                                 plan="tests.test_verify:right_plan")
    assert failed == [] and worst is None, failed
    assert len(rows) == 2 and all(row["ratio"] <= 1 for row in rows)
    assert other[0] == rows   # every rank holds the same report


def test_a_row_parallel_layer_declared_column_parallel_fails_naming_it(worlds):
    (rows, failed, worst), _ = worlds(2).run(case_verify, tensor_model_parallel_size=2,
                                             plan="tests.test_verify:WRONG_PLAN", steps=1)
    assert worst is not None and worst.startswith("fc2."), (worst, failed)
    assert any("loss" in line for line in failed) and any("'fc2." in line for line in failed), failed


def test_a_replicated_parameter_whose_gradient_is_not_summed_drifts_and_is_named(worlds):
    # SGD: AdamW's normalised step would move the copies apart by about lr only, within the tolerance at first.
    (rows, failed, worst), _ = worlds(2).run(case_verify, tensor_model_parallel_size=2, plan=PREFIX + "right_plan",
                                             factory=PREFIX + "gained_mlp", optimizer="sgd", lr=0.1)
    assert worst == "gain.weight", (worst, failed)
    assert "gain.weight" in rows[0]["drift"] and rows[0]["drift"]["gain.weight"] > 1e-4, rows
    assert any("replicated parameter 'gain.weight' differs across TP ranks" in line for line in failed), failed
    (rows, failed, worst), _ = worlds(2).run(case_verify, tensor_model_parallel_size=2, plan=PREFIX + "gained_plan",
                                             factory=PREFIX + "gained_mlp", optimizer="sgd", lr=0.1)
    assert failed == [] and worst is None and rows[-1]["drift"] == {}, failed


def test_the_report_blames_the_first_step_out_of_tolerance():
    from nxdtp.verify.compare import Worst

    job = Job()
    fine, bad = Worst("a.weight", 1e-8, 0.5), Worst("b.weight", 1.0, 1e5)
    rows = [StepRow(0, 1.0, 1.0, 2.0, 2.0, fine, fine, {}), StepRow(1, 1.0, 1.0, 2.0, 2.0, fine, bad, {}),
            StepRow(2, 1.0, 1.0, 2.0, 2.0, fine, fine, {"ln.weight": 1.0})]
    assert worst_parameter(rows, job) == "b.weight"
    assert failures(rows[:1], job) == []
    assert failures(rows[2:], job) == ["step 2: replicated parameter 'ln.weight' differs across TP ranks by 1"]
    assert worst_parameter(rows[2:], job) == "ln.weight"


def test_tiny_config_keeps_the_architecture_and_divides_by_tp():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
                                      intermediate_size=11008, num_hidden_layers=32, vocab_size=32000)
    tiny, notes = tiny_config(config, tp=4, seq_len=16)
    assert type(tiny) is type(config)
    assert (tiny.num_attention_heads, tiny.num_key_value_heads, tiny.hidden_size, tiny.num_hidden_layers) == \
        (8, 4, 64, 2)
    assert tiny.head_dim == 8 and tiny.vocab_size % 4 == 0 and tiny.intermediate_size % 4 == 0
    assert "num_hidden_layers 32 -> 2" in notes and "vocab_size 32000 -> 128" in notes
    gpt2, notes = tiny_config(transformers.GPT2Config(), tp=2, seq_len=16)
    assert (gpt2.n_head, gpt2.n_embd, gpt2.n_layer) == (4, 32, 2) and gpt2.eos_token_id < gpt2.vocab_size


def test_constant_parameters_are_perturbed_and_others_left():
    model = TinyMLP()
    nn.init.zeros_(model.fc1.bias)
    weight = model.fc1.weight.detach().clone()
    assert perturb_constant_parameters(model, seed=0) == ["fc1.bias"]
    assert torch.equal(model.fc1.weight, weight) and model.fc1.bias.abs().min() > 0


@pytest.mark.parametrize("argv, named", [
    (["verify", "llama", "--tp", "0"], "tp=0"),
    (["verify", "no-such-model-type"], "'no-such-model-type'"),
    (["verify", "--factory", "no_such_module:build"], "no_such_module"),
    (["verify", "--factory", "tests.test_verify:no_such_function"], "no_such_function"),
    (["verify", "--factory", FACTORY, "--plan", "tests.test_verify:FACTORY"], "not an nxdtp.Plan"),
    (["verify", "llama", "--factory", FACTORY], "one of them"),
    (["verify", "llama", "--optimizer", "lamb"], "lamb"),
    (["verify", "llama", "--atol", "-1"], "atol=-1"),
    (["verify", "llama", "--seq-len", "4096"], "--seq-len 4096"),
    (["frobnicate"], "frobnicate"),
])
def test_bad_input_exits_2_naming_the_value(argv, named, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("nxdtp: error: ") and named in err and err.count("\n") == 1, err


def test_a_config_file_is_read(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=100).save_pretrained(tmp_path)
    from nxdtp.verify.models import read_hf_config

    config, model_class = read_hf_config(str(tmp_path))
    assert config.vocab_size == 100 and model_class == "LlamaForCausalLM"
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["model_type"] == "llama"
    config, model_class = read_hf_config(str(tmp_path / "config.json"), "LlamaModel")
    assert model_class == "LlamaModel"


# ---- the command, as a user runs it (two processes started per run) -------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("model, extra", [("llama", []), ("gpt2", []), ("bert", []), ("granite", []),
                                          ("llama", ["--dp", "2", "--optimizer", "sgd"])])
def test_the_command_passes_on_the_families(model, extra, capsys):
    pytest.importorskip("transformers")
    status = main(["verify", model, "--tp", "2", "--steps", "2", *extra])
    out = capsys.readouterr().out
    assert status == 0, out
    lines = out.splitlines()
    assert lines[-1] == "PASS" and sum(line.startswith("step ") for line in lines) == 2, out
    assert "replicated parameters drifting across TP ranks: none" in out


@pytest.mark.slow
def test_the_command_fails_on_a_wrong_plan_naming_the_parameter(capsys):
    status = main(["verify", "--factory", FACTORY, "--plan", "tests.test_verify:WRONG_PLAN", "--batch", BATCH,
                   "--seq-len", "4", "--steps", "1"])
    out = capsys.readouterr().out
    assert status == 1, out
    assert out.splitlines()[-1].startswith("FAIL: ") and "worst parameter: fc2." in out.splitlines()[-1], out


@pytest.mark.slow
def test_a_model_nxdtp_cannot_shard_exits_2_naming_it(capsys):
    pytest.importorskip("transformers")
    assert main(["verify", "bert", "--model-class", "BertLMHeadModel", "--steps", "1"]) == 2
    last = capsys.readouterr().err.splitlines()[-1]   # transformers may warn before it
    assert last.startswith("nxdtp: error: rank 0: TypeError: nxdtp cannot shard BertLMHeadModel"), last

"""NxD Mixtral checkpoints, tensor and expert parallel, import into the dense HF Mixtral they were cut from.

The rank files are written here by NxD's rules (release 2.29), restated independently of
``nxdtp.converters.nxd.mixtral`` from NxD's Mixtral training model (``modeling_mixtral_moe_nxd.py``), its MoE layers
(``modules/moe``), ``scripts/checkpoint_converter.py --convert_from_full_state`` and ``trainer.save_checkpoint``:

* attention, vocabulary and norms are NxD's Llama layers (``nxd_decoder_rank_states`` of the Llama import's tests);
* ``mlp.router.linear_router.weight``, a plain ``nn.Linear``, is whole on every TP rank;
* the experts are ``ExpertFusedColumnParallelLinear`` / ``ExpertFusedRowParallelLinear`` weights, one (in, out) matrix
  per expert: ``gate_up_proj.weight`` (experts, hidden, 2 * intermediate) split along dim 2 with stride 2 (TP rank r:
  its slice of the gate columns, then its slice of the up columns), ``down_proj.weight`` (experts, intermediate,
  hidden) split along dim 1. They are built from the per-expert ``w1`` / ``w3`` / ``w2`` the dense model's own
  ``save_pretrained`` writes, stacked as NxD's Mixtral converter stacks them, and transposed to the layers' (in, out);
* expert parallelism cuts dim 0 of the expert tensors into ``ep`` blocks of consecutive experts, one per EP rank, in
  ``model/dp_rank_00_ep_rank_EE_tp_rank_TT_pp_rank_00.pt`` (ep = 1: ``dp_rank_00_tp_rank_TT_pp_rank_00.pt``). The
  converter writes the other tensors into EP rank 0's files only; the trainer without xser writes them into every
  file; the trainer with xser references them in every file but writes their tensor files under EP rank 0's only.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict

import pytest
import torch

from tests.nxd_xser import xser_save
from tests.test_nxd_import_llama import _import, _write_config, nxd_decoder_rank_states, save_v1

# transformers 5 holds Mixtral's experts fused (the tensors the import produces); the MoE plan's range starts there.
pytestmark = pytest.mark.skipif(int(__import__("transformers").__version__.split(".")[0]) < 5,
                                reason="the NxD Mixtral import needs transformers 5 (fused experts)")

EXPERTS = 4
ROUTER = "mlp.router.linear_router.weight"
GATE_UP = "mlp.expert_mlps.mlp_op.gate_up_proj.weight"
DOWN = "mlp.expert_mlps.mlp_op.down_proj.weight"


def _config(**overrides):
    from transformers import MixtralConfig

    kwargs = dict(vocab_size=97, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=EXPERTS, num_experts_per_tok=2,
                  max_position_embeddings=64, tie_word_embeddings=False, sliding_window=None)
    kwargs.update(overrides)
    config = MixtralConfig(**kwargs)
    config.architectures = ["MixtralForCausalLM"]
    return config


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """The randomised dense model (every parameter, router and norms included) and its own save_pretrained."""
    from safetensors.torch import load_file
    from transformers import MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(_config())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    model.eval()
    directory = tmp_path_factory.mktemp("dense")
    model.save_pretrained(str(directory))
    return model, load_file(str(directory / "model.safetensors"))


# ---- NxD's rank files ------------------------------------------------------------------------------------------------

def nxd_mixtral_states(model, saved, tp, ep, attention="gqa"):
    """``states[t][e]``: what TP rank t, EP rank e holds of NxD's Mixtral model, the tensors that are not experts in EP
    rank 0's only (as the converter writes them)."""
    config = model.config
    shared = nxd_decoder_rank_states(model, tp, attention)
    states = [[shared[t]] + [OrderedDict() for _ in range(ep - 1)] for t in range(tp)]
    local = config.num_local_experts // ep
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        expert = [p + f"block_sparse_moe.experts.{e}." for e in range(config.num_local_experts)]
        # NxD's converter stacks the experts (dim 0); NxD's layers hold each as (in, out): the transposes.
        gate, up, down = (torch.stack([saved[name + w] for name in expert]).transpose(1, 2)
                          for w in ("w1.weight", "w3.weight", "w2.weight"))
        for t in range(tp):
            states[t][0][p + ROUTER] = saved[p + "block_sparse_moe.gate.weight"].clone()
            for e in range(ep):
                mine = slice(e * local, (e + 1) * local)
                states[t][e][p + GATE_UP] = torch.cat([gate[mine].chunk(tp, dim=2)[t], up[mine].chunk(tp, dim=2)[t]],
                                                      dim=2).clone()
                states[t][e][p + DOWN] = down[mine].chunk(tp, dim=1)[t].clone()
    return states


def file_name(tp_rank, ep_rank, ep):
    if ep > 1:
        return f"dp_rank_00_ep_rank_{ep_rank:02d}_tp_rank_{tp_rank:02d}_pp_rank_00.pt"
    return f"dp_rank_00_tp_rank_{tp_rank:02d}_pp_rank_00.pt"


def save(states, root, others="absent", xser=False, markers=True):
    """The files under ``root/step_3/model/``; returns ``root``. ``others``: what EP ranks > 0 hold of the tensors
    that are not experts: "absent" (the converter), "copies" (the trainer; with ``xser`` their tensor files are
    written under EP rank 0's only) or "none" (None values). ``markers``: the trainer's ``checkpoint`` and ``done``."""
    model_dir = os.path.join(root, "step_3", "model")
    os.makedirs(model_dir)
    ep = len(states[0])
    for t, row in enumerate(states):
        for e, state in enumerate(row):
            if e > 0 and others != "absent":
                state = OrderedDict(state)
                state.update((k, v.clone() if others == "copies" else None)
                             for k, v in row[0].items() if k not in state)
            path = os.path.join(model_dir, file_name(t, e, ep))
            if not xser:
                torch.save(state, path)
                continue
            xser_save(state, path)
            torch.save({i: {"dtype": v.dtype, "shape": v.shape, "expert_model_parallel": ".expert_mlps." in k}
                        for i, (k, v) in enumerate(state.items())}, path + ".info.pt")
            for i, key in enumerate(state):
                if e > 0 and ".expert_mlps." not in key:  # xser_save numbers the (distinct) tensors in order
                    os.remove(os.path.join(path + ".tensors", f"tensor_{i}.pt"))
    if markers:
        for marker in ("checkpoint", "done"):
            with open(os.path.join(root, "step_3", marker), "w") as f:
                f.write("1")
    return root


# ---- the layout is NxD's ---------------------------------------------------------------------------------------------

def test_rank_pieces_compute_the_dense_experts(dense):
    """The fixture's expert pieces, used as NxD's expert layers use them (``einsum("e...h,ehi->e...i")``, the output
    chunked into gate and up, the down projection's partial sums added over TP), give HF's experts' outputs: so an
    import equal to the dense model is the right answer, not just the inverse of the fixture."""
    model, saved = dense
    tp, ep, p = 2, 2, "model.layers.1."
    states = nxd_mixtral_states(model, saved, tp, ep)
    x = torch.randn(EXPERTS // ep, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    experts = model.model.layers[1].mlp.experts
    for e in range(ep):
        total = 0
        for t in range(tp):
            gate, up = torch.einsum("ech,ehi->eci", x, states[t][e][p + GATE_UP]).chunk(2, dim=-1)
            total = total + torch.einsum("eci,eih->ech", torch.nn.functional.silu(gate) * up, states[t][e][p + DOWN])
        for j in range(EXPERTS // ep):
            index = e * (EXPERTS // ep) + j
            g, u = torch.nn.functional.linear(x[j], experts.gate_up_proj[index]).chunk(2, dim=-1)
            want = torch.nn.functional.linear(torch.nn.functional.silu(g) * u, experts.down_proj[index])
            torch.testing.assert_close(total[j], want, rtol=1e-5, atol=1e-5)


def test_expert_runs_invert_experts_of_rank():
    from nxdtp.spec import ParamSpec

    spec = ParamSpec(full_shape=(6, 4, 8), partition_dim=2, num_partitions=2, stride=2, expert_partitions=3)
    piece = torch.arange(6 * 4 * 4).reshape(6, 4, 4)
    for start in range(6):
        for length in range(1, 7 - start):
            runs = spec.expert_runs(start, length)
            read = torch.cat([spec.experts_of_rank(piece, e).narrow(0, first, rows) for e, first, rows in runs])
            assert torch.equal(read, piece.narrow(0, start, length)), (start, length, runs)
    assert spec.expert_runs(1, 3) == [(0, 1, 1), (1, 0, 2)]


# ---- imports ---------------------------------------------------------------------------------------------------------

def _assert_equals_dense(out, dense):
    from safetensors.torch import load_file
    from transformers import MixtralForCausalLM

    model, saved = dense
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == ["MixtralForCausalLM"]
    written = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(written) == sorted(saved)  # the keys of the model's own save_pretrained: experts one at a time
    for key, value in saved.items():
        assert torch.equal(written[key], value), key
    loaded = MixtralForCausalLM.from_pretrained(str(out)).eval()
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


# (tp, ep, attention form, what EP ranks > 0 hold of the other tensors, xser, CLI or Python API)
CASES = [
    (2, 2, "gqa", "absent", False, "cli"),  # the converter's output
    (2, 1, "separate", "absent", False, "api"),  # no expert parallelism: dp_rank_00_tp_rank_XX_pp_rank_00.pt
    (1, 2, "separate", "copies", True, "api"),  # the trainer with xser: EP rank 1 references tensor files it lacks
    (2, 2, "fused", "copies", False, "api"),  # the trainer without xser
    (2, 4, "separate", "none", False, "api"),  # one expert per EP rank
]


@pytest.mark.parametrize("tp,ep,attention,others,xser,via", CASES,
                         ids=[f"tp{c[0]}-ep{c[1]}-{c[2]}-{c[3]}{'-xser' if c[4] else ''}-{c[5]}" for c in CASES])
def test_import_equals_dense(tmp_path, dense, tp, ep, attention, others, xser, via):
    model, saved = dense
    root = save(nxd_mixtral_states(model, saved, tp, ep, attention), str(tmp_path / "ckpt"), others, xser,
                markers=others != "absent")
    checkpoint = root if others != "absent" else os.path.join(root, "step_3")  # the converter's OUTPUT_DIR
    out = tmp_path / "out"
    _import(checkpoint, _write_config(str(tmp_path / "cfg"), model.config), out, via)
    _assert_equals_dense(str(out), dense)


def test_family_follows_the_config(tmp_path):
    from nxdtp.converters import nxd

    assert nxd.family_of(_config()) is nxd.mixtral
    assert nxd.family_of(_write_config(str(tmp_path / "cfg"), _config())) is nxd.mixtral
    assert "mixtral" in nxd.SUPPORTED_MODEL_TYPES


# ---- errors ----------------------------------------------------------------------------------------------------------

def _bad_checkpoints(tmp_path, dense):
    """name -> (checkpoint dir, config path, error type, regex the message must match)."""
    from transformers import LlamaConfig

    model, saved = dense
    config = _write_config(str(tmp_path / "cfg"), model.config)
    cases = {}

    def files(name, tp=2, ep=2, edit=None, **kwargs):
        states = nxd_mixtral_states(model, saved, tp, ep)
        if edit:
            edit(states)
        return save(states, str(tmp_path / name), **kwargs)

    def model_dir(root):
        return os.path.join(root, "step_3", "model")

    root = files("missing-ep-rank")
    os.remove(os.path.join(model_dir(root), file_name(0, 1, 2)))
    cases["missing ep_rank file"] = (root, config, FileNotFoundError,
                                     r"dp_rank_00_ep_rank_01_tp_rank_00_pp_rank_00\.pt is missing")

    root = files("missing-last-ep-rank")
    for t in range(2):
        os.remove(os.path.join(model_dir(root), file_name(t, 1, 2)))
    cases["missing last EP rank"] = (
        root, config, FileNotFoundError,
        r"holds 2 of the 4 experts, so the checkpoint was saved at ep=2, but only 1 EP rank\(s\) are present.*missing: "
        r"dp_rank_00_ep_rank_01_tp_rank_00_pp_rank_00\.pt, dp_rank_00_ep_rank_01_tp_rank_01_pp_rank_00\.pt")

    cases["experts ep does not divide"] = (
        files("five-experts"), _write_config(str(tmp_path / "cfg5"), _config(num_local_experts=5)), ValueError,
        r"num_local_experts=5 cannot be split over the 2 expert-parallel ranks")

    gate_up = "model.layers.0." + GATE_UP
    cases["intermediate size vs config"] = (
        files("intermediate"), _write_config(str(tmp_path / "cfg-i"), _config(intermediate_size=32)), ValueError,
        rf"ep_rank_00_tp_rank_00_pp_rank_00\.pt: '{gate_up}' has shape \[2, 64, 48\], but the config needs "
        r"\[2, 64, 32\] \(2 of the 4 experts per EP rank, each 64 hidden rows by this TP rank's 16 gate columns")

    cases["expert count vs config"] = (
        files("two-experts"), _write_config(str(tmp_path / "cfg2"), _config(num_local_experts=2)), ValueError,
        r"'model\.layers\.0\.mlp\.router\.linear_router\.weight' has shape \[4, 64\], but the config needs \[2, 64\]")

    def damage_down(states):
        key = "model.layers.1." + DOWN
        states[1][1][key] = states[1][1][key][:, :-1].clone()
    cases["one EP rank's shape"] = (
        files("down-shape", edit=damage_down), config, ValueError,
        r"ep_rank_01_tp_rank_01_pp_rank_00\.pt: 'model\.layers\.1\.mlp\.expert_mlps\.mlp_op\.down_proj\.weight' has "
        r"shape \[2, 23, 64\], but the config needs \[2, 24, 64\]")

    cases["EP rank lacks an expert key"] = (
        files("lacks-key", edit=lambda states: states[0][1].pop("model.layers.1." + DOWN)), config, ValueError,
        r"ep_rank_01_tp_rank_00_pp_rank_00\.pt: its model keys differ.*missing experts "
        r"\['model\.layers\.1\.mlp\.expert_mlps\.mlp_op\.down_proj\.weight'\]")

    def dense_mlp(states):  # NxD's moe_frequency 2: layer 1 a dense LlamaMLP
        for row in states:
            for state in row:
                for key in [k for k in state if k.startswith("model.layers.1.mlp.")]:
                    del state[key]
            row[0]["model.layers.1.mlp.gate_up_proj.weight"] = torch.zeros(48, 64)
    cases["dense MLP layer"] = (files("moe-frequency", edit=dense_mlp), config, ValueError,
                                r"'model\.layers\.1\.mlp\.gate_up_proj\.weight' is a dense MLP.*moe_frequency")

    states = nxd_mixtral_states(model, saved, 2, 2)
    cases["EP with parallel_layers.checkpointing.save"] = (  # one file per TP rank: EP rank 0's experts only
        save_v1([row[0] for row in states], str(tmp_path / "v1-ep")), config, ValueError,
        rf"tp_rank_00_pp_rank_00/checkpoint\.pt: '{gate_up}' holds 2 of the 4 experts: it was saved at ep=2 by "
        r"parallel_layers\.checkpointing\.save")

    llama = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2)
    cases["EP checkpoint, Llama config"] = (
        files("llama"), _write_config(str(tmp_path / "cfg-llama"), llama), ValueError,
        r"is an expert-parallel NxD checkpoint \(dp_rank_00_ep_rank_01_tp_rank_00_pp_rank_00\.pt \.\.\.: ep=2\), but "
        r"LlamaForCausalLM has no experts")
    return cases


def test_bad_inputs_fail_clearly_and_leave_output_untouched(tmp_path, dense):
    from nxdtp.converters.nxd import merge_nxd_checkpoint

    for name, (checkpoint, config, error, message) in _bad_checkpoints(tmp_path, dense).items():
        existing = tmp_path / "outputs" / name.replace(" ", "-")
        existing.mkdir(parents=True)
        (existing / "old.txt").write_text("old")
        with pytest.raises(error, match=message):
            merge_nxd_checkpoint(checkpoint, config, str(existing), force=True, progress=False)
        assert sorted(os.listdir(existing)) == ["old.txt"], name
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir() if p.name.startswith(".")) == []

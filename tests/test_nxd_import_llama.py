"""NxD Llama checkpoints import into a dense HF model equal to the original, tensor for tensor.

The checkpoints are written here the way NxD's Llama training model holds its weights, restated from NxD's layer code
(release 2.29) independently of ``nxdtp.converters.nxd.llama``:

* ``ParallelEmbedding`` and ``ColumnParallelLinear`` (the LM head): contiguous 1/tp row slices of the vocabulary; with
  ``pad=True`` the vocabulary is first padded with zero rows to a multiple of tp.
* ``ColumnParallelLinear(stride=2)`` over ``[gate; up]``: rank r holds its gate slice, then its up slice.
* ``RowParallelLinear`` (``o_proj``, ``down_proj``): 1/tp column slices.
* ``GQAQKVColumnParallelLinear(kv_size_multiplier=m)``: K and V are ``weight.repeat(m, 1)`` cut into tp row slices;
  ``checkpoint_converter.py --convert_from_full_state`` (trn1) gives rank ``p = i * kv_heads + g`` the Q chunk
  ``g * m + i`` (of the Q heads cut into tp chunks), and ``o_proj`` the matching columns, so each rank's Q heads belong
  to its KV head. ``fuse_qkv=True`` stores ``[q; k; v]`` per rank as ``qkv_proj.weight_qkv``.
* ``ColumnParallelLinear(stride=3)`` for equal head counts: rank r holds its Q, K and V slices as ``qkv_proj.weight``.

Layouts: ``parallel_layers.checkpointing.save`` ("v1": ``tp_rank_XX_pp_rank_00/checkpoint.pt`` holding
``{"model": ...}``, or xser) and ``trainer.save_checkpoint`` ("v2": ``TAG/model/dp_rank_00_tp_rank_XX_pp_rank_00.pt``
holding the state dict, or xser, with ``checkpoint`` and ``done`` markers in the tag).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict

import pytest
import torch

from tests.nxd_xser import xser_save

VOCAB = 97  # prime: tp=2 and tp=4 both need NxD's vocabulary padding
MHA_VOCAB = 100  # divisible by 2 and 4: no padding


def _config(kv_heads, vocab=VOCAB, model_type="llama", **overrides):
    from transformers import LlamaConfig, MistralConfig

    kwargs = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=kv_heads, max_position_embeddings=32, tie_word_embeddings=False)
    kwargs.update(overrides)
    return (MistralConfig if model_type == "mistral" else LlamaConfig)(**kwargs)


def _dense(config):
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, config.architectures[0] if config.architectures else "LlamaForCausalLM")(config)
    with torch.no_grad():
        for p in model.parameters():  # HF starts norms at 1: randomise every parameter so no slice can hide
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


_MODELS = {}


def dense(kv_heads, model_type="llama"):
    """One randomised model per (KV heads, model type), shared by the tests of this module."""
    key = (kv_heads, model_type)
    if key not in _MODELS:
        config = _config(kv_heads, MHA_VOCAB if kv_heads == 4 else VOCAB, model_type)
        config.architectures = ["MistralForCausalLM" if model_type == "mistral" else "LlamaForCausalLM"]
        _MODELS[key] = _dense(config)
    return _MODELS[key]


# ---- NxD's per-rank state dicts --------------------------------------------------------------------------------------

def nxd_rank_states(model, tp, attention, inv_freq=False):
    """Each TP rank's ``model.state_dict()`` in NxD's Llama training model. ``attention``: "fused"
    (``qkv_proj.weight_qkv``), "gqa" (``qkv_proj.weight_q/_k/_v``), "separate" (``q_proj/k_proj/v_proj``) or "stride3"
    (``qkv_proj.weight``)."""
    full = model.state_dict()
    states = nxd_decoder_rank_states(model, tp, attention, inv_freq)
    for layer in range(model.config.num_hidden_layers):
        p = f"model.layers.{layer}."
        gate, up = full[p + "mlp.gate_proj.weight"].chunk(tp), full[p + "mlp.up_proj.weight"].chunk(tp)
        down = full[p + "mlp.down_proj.weight"].chunk(tp, dim=1)
        for rank, state in enumerate(states):
            state[p + "mlp.gate_up_proj.weight"] = torch.cat([gate[rank], up[rank]])
            state[p + "mlp.down_proj.weight"] = down[rank].clone()
    return states


def nxd_decoder_rank_states(model, tp, attention, inv_freq=False):
    """Each TP rank's tensors of NxD's Llama training model other than the MLP's, which NxD's Mixtral model holds the
    same way: the vocabulary, attention (``attention`` as in ``nxd_rank_states``) and the norms."""
    config, full = model.config, model.state_dict()
    kv_heads = config.num_key_value_heads
    states = [OrderedDict() for _ in range(tp)]

    def vocab_parallel(key):
        weight = full[key]
        padded = torch.cat([weight, weight.new_zeros((-weight.shape[0]) % tp, weight.shape[1])])
        for rank, piece in enumerate(padded.chunk(tp)):
            states[rank][key] = piece.clone()

    vocab_parallel("model.embed_tokens.weight")
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        q, k, v = (full[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
        o = full[p + "self_attn.o_proj.weight"]
        if attention in ("fused", "gqa"):
            m = max(1, tp // kv_heads)  # NxD's scripts: kv_replicator = TP degree / KV heads
            assert kv_heads * m == tp, "the converter's Q order below assumes one KV head per rank"
            k_parts, v_parts = k.repeat(m, 1).chunk(tp), v.repeat(m, 1).chunk(tp)
            order = [(rank % kv_heads) * m + rank // kv_heads for rank in range(tp)]
            q_parts = [q.chunk(tp)[c] for c in order]
            o_parts = [o.chunk(tp, dim=1)[c] for c in order]
        else:
            q_parts, k_parts, v_parts, o_parts = q.chunk(tp), k.chunk(tp), v.chunk(tp), o.chunk(tp, dim=1)
        for rank, state in enumerate(states):
            a = p + "self_attn."
            if attention == "fused":
                state[a + "qkv_proj.weight_qkv"] = torch.cat([q_parts[rank], k_parts[rank], v_parts[rank]])
            elif attention == "stride3":
                state[a + "qkv_proj.weight"] = torch.cat([q_parts[rank], k_parts[rank], v_parts[rank]])
            elif attention == "gqa":
                for name, part in zip("qkv", (q_parts, k_parts, v_parts)):
                    state[a + f"qkv_proj.weight_{name}"] = part[rank].clone()
            else:
                for name, part in zip("qkv", (q_parts, k_parts, v_parts)):
                    state[a + f"{name}_proj.weight"] = part[rank].clone()
            state[a + "o_proj.weight"] = o_parts[rank].clone()
            if inv_freq:  # older transformers kept the rotary buffer in the state dict
                state[a + "rotary_emb.inv_freq"] = torch.arange(8.0)
            for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                state[p + norm] = full[p + norm].clone()
    for state in states:
        state["model.norm.weight"] = full["model.norm.weight"].clone()
    vocab_parallel("lm_head.weight")
    return states


# ---- NxD's file layouts ----------------------------------------------------------------------------------------------

def save_v1(states, root, xser=False):
    """``parallel_layers.checkpointing.save({"model": ..., ...}, root, save_xser=xser)``."""
    os.makedirs(root)
    for rank, state in enumerate(states):
        data = {"model": state, "optimizer": {"state": {}, "param_groups": [{"lr": 1e-4, "params": []}]},
                "global_step": 3}
        path = os.path.join(root, f"tp_rank_{rank:02d}_pp_rank_00")
        if xser:
            xser_save(data, path)
        else:
            os.makedirs(path)
            torch.save(data, os.path.join(path, "checkpoint.pt"))
    return root


def save_v2(states, root, tag="step_3", xser=False, done=True):
    """``trainer.save_checkpoint(root, tag, model=..., optimizer=..., use_xser=xser)``; returns the root."""
    tag_dir = os.path.join(root, tag)
    os.makedirs(os.path.join(tag_dir, "model"))
    os.makedirs(os.path.join(tag_dir, "optim"))
    with open(os.path.join(tag_dir, "checkpoint"), "w") as f:
        f.write("1")
    for rank, state in enumerate(states):
        name = f"dp_rank_00_tp_rank_{rank:02d}_pp_rank_00.pt"
        path = os.path.join(tag_dir, "model", name)
        if xser:
            xser_save(state, path)
            torch.save({i: {"dtype": t.dtype, "shape": t.shape} for i, t in enumerate(state.values())},
                       path + ".info.pt")
        else:
            torch.save(state, path)
        torch.save({"state": {}, "param_groups": []}, os.path.join(tag_dir, "optim", name))
    torch.save({"last_epoch": 3}, os.path.join(tag_dir, "scheduler.pt"))
    if done:
        with open(os.path.join(tag_dir, "done"), "w") as f:
            f.write("1")
    return root


def _write_config(directory, config) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "config.json")
    with open(path, "w") as f:
        json.dump(config.to_dict(), f)
    return path


# ---- checks ----------------------------------------------------------------------------------------------------------

def _assert_equals_dense(output_dir, model):
    import transformers
    from safetensors import safe_open

    # Tied aliases once, as HF saves: the LM head tied to the embedding is written under the embedding's name only.
    aliases = {"lm_head.weight"} if model.lm_head.weight is model.model.embed_tokens.weight else set()
    with safe_open(os.path.join(output_dir, "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(model.state_dict()) - aliases
    loaded = getattr(transformers, type(model).__name__).from_pretrained(output_dir).eval()
    expected = model.state_dict()
    assert set(loaded.state_dict()) == set(expected)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, expected[key]), key
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def _import(checkpoint, config_path, out, via):
    if via == "cli":
        from nxdtp.cli import main

        assert main([str(checkpoint), str(out), "--from-nxd", "--config", str(config_path), "--no-progress"]) == 0
    else:
        from nxdtp.converters.nxd import merge_nxd_checkpoint

        assert merge_nxd_checkpoint(str(checkpoint), config_path, str(out), progress=False) == str(out)


# (KV heads, tp, attention form, layout, xser, which directory is passed, CLI or Python API)
CASES = [
    (2, 2, "fused", "v2", False, "root", "cli"),  # kv_size_multiplier 1
    (2, 4, "fused", "v2", True, "model", "api"),  # multiplier 2: Q heads regrouped across ranks
    (1, 4, "fused", "v1", False, "root", "api"),  # multiplier 4
    (1, 2, "gqa", "v1", True, "root", "cli"),  # multiplier 2, unfused
    (2, 4, "gqa", "v2", False, "tag", "api"),
    (2, 2, "separate", "v1", False, "root", "api"),
    (4, 2, "stride3", "v2", False, "converter", "api"),
    (4, 4, "stride3", "v1", True, "root", "api"),
]


@pytest.mark.parametrize("kv_heads,tp,attention,layout,xser,where,via", CASES,
                         ids=[f"kv{c[0]}-tp{c[1]}-{c[2]}-{c[3]}{'-xser' if c[4] else ''}-{c[5]}-{c[6]}" for c in CASES])
def test_import_equals_dense(tmp_path, kv_heads, tp, attention, layout, xser, where, via):
    model = dense(kv_heads)
    states = nxd_rank_states(model, tp, attention, inv_freq=(attention == "separate"))
    root = str(tmp_path / "ckpt")
    if layout == "v1":
        checkpoint = save_v1(states, root, xser=xser)
    elif where == "converter":  # checkpoint_converter.py's output: OUTPUT_DIR/model/..., no tag markers
        save_v2(states, root, xser=xser)
        checkpoint = os.path.join(root, "step_3")
        os.remove(os.path.join(checkpoint, "checkpoint"))
        os.remove(os.path.join(checkpoint, "done"))
    else:
        save_v2(states, root, xser=xser)
        checkpoint = {"root": root, "tag": os.path.join(root, "step_3"),
                      "model": os.path.join(root, "step_3", "model")}[where]
    out = tmp_path / "out"
    _import(checkpoint, _write_config(str(tmp_path / "cfg"), model.config), out, via)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    with open(out / "config.json") as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLM"]
    _assert_equals_dense(out, model)


def test_mistral_imports(tmp_path):
    model = dense(2, "mistral")
    checkpoint = save_v2(nxd_rank_states(model, 4, "fused"), str(tmp_path / "ckpt"))
    _import(checkpoint, _write_config(str(tmp_path / "cfg"), model.config), tmp_path / "out", "api")
    _assert_equals_dense(tmp_path / "out", model)


def test_tied_embeddings_are_written_once(tmp_path):
    from safetensors import safe_open

    from nxdtp.converters.nxd import merge_nxd_checkpoint

    config = _config(2, tie_word_embeddings=True)
    config.architectures = ["LlamaForCausalLM"]
    model = _dense(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    config_path = _write_config(str(tmp_path / "cfg"), config)
    states = nxd_rank_states(model, 2, "fused")  # NxD's state dict holds both names
    merge_nxd_checkpoint(save_v1(states, str(tmp_path / "ckpt")), config_path, str(tmp_path / "out"), progress=False)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # as HF's save_pretrained writes a tied pair
    _assert_equals_dense(tmp_path / "out", model)
    for state in states:
        state["lm_head.weight"] = state["lm_head.weight"] + 1
    with pytest.raises(ValueError, match=r"'lm_head\.weight' differs from 'model\.embed_tokens\.weight'.*tie_word"):
        merge_nxd_checkpoint(save_v1(states, str(tmp_path / "untied")), config_path, str(tmp_path / "out2"),
                             progress=False)


def test_regrouped_heads_compute_the_dense_attention():
    """The fixture's rank states (NxD's Q regrouping for kv_size_multiplier > 1) compute what the dense attention does
    when each rank attends with its own heads, as NxD's attention does: so an import equal to the dense model is the
    right answer, not just the inverse of the fixture."""
    model, tp = dense(2), 4
    config, full = model.config, model.state_dict()
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, 16
    x = torch.randn(2, 5, config.hidden_size, generator=torch.Generator().manual_seed(1))

    def attend(x, q_w, k_w, v_w, o_w):
        q = (x @ q_w.T).unflatten(-1, (-1, d)).transpose(1, 2)
        k = (x @ k_w.T).unflatten(-1, (-1, d)).transpose(1, 2)
        v = (x @ v_w.T).unflatten(-1, (-1, d)).transpose(1, 2)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # repeat_kv
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        weights = torch.softmax(q @ k.transpose(-1, -2) / d ** 0.5, dim=-1)
        return (weights @ v).transpose(1, 2).flatten(2) @ o_w.T

    a = "model.layers.0.self_attn."
    expected = attend(x, *(full[a + f"{n}_proj.weight"] for n in "qkvo"))
    states = nxd_rank_states(model, tp, "fused")
    assert heads // tp == 1 and kv_heads * (tp // kv_heads) // tp == 1  # each rank: one Q, one K and one V head
    per_rank = []
    for state in states:
        q, k, v = state[a + "qkv_proj.weight_qkv"].split([d, d, d])
        per_rank.append(attend(x, q, k, v, state[a + "o_proj.weight"]))
    torch.testing.assert_close(sum(per_rank), expected, rtol=1e-5, atol=1e-5)
    # Negative control: with Q split plainly, ranks 1 and 2 would pair their Q head with the wrong KV head.
    plain = []
    for rank, state in enumerate(states):
        _, k, v = state[a + "qkv_proj.weight_qkv"].split([d, d, d])
        q, o = full[a + "q_proj.weight"].chunk(tp)[rank], full[a + "o_proj.weight"].chunk(tp, dim=1)[rank]
        plain.append(attend(x, q, k, v, o))
    assert not torch.allclose(sum(plain), expected, rtol=1e-3, atol=1e-3)


def test_newest_complete_tag_or_the_named_one(tmp_path):
    from nxdtp.cli import main

    model = dense(2)
    root = str(tmp_path / "ckpt")
    old = [{k: v + 1 if k == "model.norm.weight" else v for k, v in s.items()} for s in nxd_rank_states(model, 2,
                                                                                                        "fused")]
    save_v2(old, root, tag="step_1")
    save_v2(nxd_rank_states(model, 2, "fused"), root, tag="step_2")
    save_v2(old, root, tag="step_3", done=False)  # a save that did not finish is never read
    os.utime(os.path.join(root, "step_1", "done"), (1_000, 1_000))
    os.utime(os.path.join(root, "step_2", "done"), (2_000, 2_000))
    config = _write_config(str(tmp_path / "cfg"), model.config)
    _import(root, config, tmp_path / "newest", "cli")
    _assert_equals_dense(tmp_path / "newest", model)
    assert main([root, str(tmp_path / "named"), "--from-nxd", "--config", config, "--tag", "step_1",
                 "--no-progress"]) == 0
    from safetensors.torch import load_file

    named = load_file(str(tmp_path / "named" / "model.safetensors"))
    assert torch.equal(named["model.norm.weight"], model.state_dict()["model.norm.weight"] + 1)


# ---- errors ----------------------------------------------------------------------------------------------------------

def _rewrite_v2(root, rank, edit, tag="step_3"):
    path = os.path.join(root, tag, "model", f"dp_rank_00_tp_rank_{rank:02d}_pp_rank_00.pt")
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)


def _bad_checkpoints(tmp_path):
    """name -> (checkpoint dir, config path, error type, regex the message must match)."""
    model = dense(2)
    config = _write_config(str(tmp_path / "cfg"), model.config)
    cases = {}

    def v2(name, tp=4, attention="fused", **kwargs):
        return save_v2(nxd_rank_states(model, tp, attention), str(tmp_path / name), **kwargs)

    root = v2("missing-rank")
    os.remove(os.path.join(root, "step_3", "model", "dp_rank_00_tp_rank_01_pp_rank_00.pt"))
    cases["missing rank file"] = (root, config, FileNotFoundError, r"dp_rank_00_tp_rank_01_pp_rank_00\.pt is missing")

    root = v2("missing-last-rank")
    os.remove(os.path.join(root, "step_3", "model", "dp_rank_00_tp_rank_03_pp_rank_00.pt"))
    cases["missing last rank"] = (root, config, FileNotFoundError,
                                  r"saved at tp=4, but only 3 rank\(s\).*missing: dp_rank_00_tp_rank_03_pp_rank_00\.pt")

    root = v2("kv-copies")
    key = "model.layers.1.self_attn.qkv_proj.weight_qkv"

    def damage_k(state):  # rank 2 holds the second copy of KV head 0 (rows 16:32 of its fused weight are K)
        state[key][20, 5] += 1.0
    _rewrite_v2(root, 2, damage_k)
    cases["K copies differ"] = (root, config, ValueError,
                                rf"the K weights of KV head 0 in '{key}' differ between TP rank 0 and TP rank 2")

    root = v2("v-copies", attention="gqa")
    key_v = "model.layers.0.self_attn.qkv_proj.weight_v"
    _rewrite_v2(root, 3, lambda state: state[key_v].mul_(2))
    cases["V copies differ"] = (root, config, ValueError,
                                rf"tp_rank_03_pp_rank_00\.pt: the V weights of KV head 1 in '{key_v}' differ between "
                                r"TP rank 1 and TP rank 3")

    root = v2("mlp-config")
    cases["mlp shape vs config"] = (
        root, _write_config(str(tmp_path / "cfg-mlp"), _config(2, intermediate_size=128)), ValueError,
        r"dp_rank_00_tp_rank_00_pp_rank_00\.pt: 'model\.layers\.0\.mlp\.gate_up_proj\.weight' has shape \[48, 64\], "
        r"but the config needs \[64, 64\]")

    root = v2("vocab-config")
    cases["vocab shape vs config"] = (
        root, _write_config(str(tmp_path / "cfg-vocab"), _config(2, vocab=120)), ValueError,
        r"'model\.embed_tokens\.weight' has shape \[25, 64\], but the config needs \[30, 64\] \(its 1/4 slice of the "
        r"120-token vocabulary\)")

    root = v2("qkv-shape")
    _rewrite_v2(root, 0, lambda state: state.__setitem__(key, state[key][:40].clone()))
    cases["qkv shape"] = (root, config, ValueError,
                          rf"'{key}' has shape \[40, 64\], but the config needs \[48, 64\]: 16 Q rows, then 16 K and "
                          r"16 V rows \(kv_size_multiplier 2\)")

    root = v2("stride3-gqa", tp=2, attention="stride3")
    cases["stride-3 QKV with GQA"] = (root, config, ValueError, r"holds equal numbers of query and KV heads")

    root = v2("incomplete", done=False)
    cases["incomplete tag"] = (root, config, ValueError, r"tags \['step_3'\] have no 'done' file")

    root = v2("pipeline", tp=2)
    model_dir = os.path.join(root, "step_3", "model")
    os.rename(os.path.join(model_dir, "dp_rank_00_tp_rank_01_pp_rank_00.pt"),
              os.path.join(model_dir, "dp_rank_00_tp_rank_00_pp_rank_01.pt"))
    cases["pipeline parallel"] = (root, config, ValueError, r"pipeline-parallel.*dp_rank_00_tp_rank_00_pp_rank_01\.pt")

    root = v2("bias", tp=2)
    cases["attention bias"] = (root, _write_config(str(tmp_path / "cfg-bias"), _config(2, attention_bias=True)),
                               ValueError, r"attention_bias=true, but NxD's Llama layers have no biases")

    from transformers import GPT2Config, Qwen2Config

    root = v2("gpt2", tp=2)
    cases["gpt2 config"] = (root, _write_config(str(tmp_path / "cfg-gpt2"), GPT2Config(n_layer=1)), ValueError,
                            r"model_type 'gpt2'; the NxD import reads model_type bert, llama, mistral")
    cases["qwen2 config"] = (root, _write_config(str(tmp_path / "cfg-qwen2"), Qwen2Config(num_hidden_layers=1)),
                             ValueError, r"model_type 'qwen2'; the NxD import reads model_type bert, llama, mistral")
    return cases


def test_bad_inputs_fail_clearly_and_leave_output_untouched(tmp_path):
    from nxdtp.converters.nxd import merge_nxd_checkpoint

    for name, (checkpoint, config, error, message) in _bad_checkpoints(tmp_path).items():
        existing = tmp_path / "outputs" / name.replace(" ", "-")
        existing.mkdir(parents=True)
        (existing / "old.txt").write_text("old")
        with pytest.raises(error, match=message):
            merge_nxd_checkpoint(checkpoint, config, str(existing), force=True, progress=False)
        assert sorted(os.listdir(existing)) == ["old.txt"], name
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir() if p.name.startswith(".")) == []


def test_cli_refuses_unsupported_model_type(tmp_path, capsys):
    from transformers import GPT2Config

    from nxdtp.cli import main

    root = save_v2(nxd_rank_states(dense(2), 2, "fused"), str(tmp_path / "ckpt"))
    config = _write_config(str(tmp_path / "cfg"), GPT2Config(n_layer=1))
    assert main([root, str(tmp_path / "out"), "--from-nxd", "--config", config]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "model_type 'gpt2'" in err and "bert, llama, mistral" in err, err
    assert not (tmp_path / "out").exists()


def test_family_follows_the_config(tmp_path):
    from transformers import BertConfig

    from nxdtp.converters import nxd

    assert nxd.family_of(_write_config(str(tmp_path / "bert"), BertConfig())) is nxd.bert
    assert nxd.family_of(_config(1)) is nxd.llama
    raw = _config(1).to_dict()
    del raw["model_type"]  # a hand-written config: the architecture tells
    raw["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "hand").mkdir()
    (tmp_path / "hand" / "config.json").write_text(json.dumps(raw))
    assert nxd.family_of(str(tmp_path / "hand")) is nxd.llama

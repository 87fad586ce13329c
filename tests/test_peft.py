"""PEFT LoRA on tensor-parallel models (``nxdtp.models.peft_lora``) against dense LoRA on the dense model, on real gloo
ranks.

Each case builds the dense HF model from a seed on every rank and randomises every parameter, shards a deep copy, and
calls ``peft.get_peft_model`` on both with the same LoraConfig. Every adapter parameter of the dense PEFT model is then
randomised too (LoRA B included, which PEFT initialises to zero, so that A's gradient is not trivially zero), and the
TP model's adapters are set to their slices, cut here by the test's own slicing (``_expected_local``), independent of
the library's. Compared within fp32 1e-5: the loss, the gathered logits, every adapter gradient (the dense gradient's
slice), the TP-aware gradient norm, and the same at the adapters a few AdamW steps reach (each step from equal values;
``_step_on_dense_gradients`` says why); the adapter saved by ``save_pretrained`` loads on the dense model with the TP
model's logits; ``merge_and_unload`` gives the dense merged model's logits.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from nxdtp import parallel_state as ps
from nxdtp.grads import allreduce_sequence_parallel_gradients, get_grad_norm
from nxdtp.models import gather_vocab_logits, parallelize_model
from tests.model_helpers import randomised
from tests.test_models_bert import TOL, _expected_local, _specs
from tests.test_random import rank1_of_tp2  # noqa: F401 - a fixture

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SEQ, BATCH = 8, 2
ADAM = dict(lr=1e-2, weight_decay=0.01)
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ---- the models (run inside the workers) -----------------------------------------------------------------------------

def _llama(kv_heads: int):
    config = transformers.LlamaConfig(
        vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=kv_heads, max_position_embeddings=64, rms_norm_eps=1e-6, attention_dropout=0.0,
        attention_bias=True, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config), LLAMA_TARGETS


def _gpt2(kv_heads: int):
    config = transformers.GPT2Config(vocab_size=101, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config), ["c_attn", "c_proj", "c_fc"]


def _bert(kv_heads: int):
    config = transformers.BertConfig(vocab_size=101, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                     num_hidden_layers=2, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(config), ["query", "key", "value", "dense"]


def _qwen2_moe(kv_heads: int):
    """A mixture of experts whose shared expert is a gated MLP: its projections take LoRA; the experts' 3-D weights
    and the router are not linear layers and take none."""
    config = transformers.Qwen2MoeConfig(
        vocab_size=101, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, shared_expert_intermediate_size=24, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=kv_heads, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
    return transformers.Qwen2MoeForCausalLM(config), LLAMA_TARGETS


FAMILIES = {"llama": _llama, "gpt2": _gpt2, "bert": _bert, "qwen2_moe": _qwen2_moe}


def _batch(vocab: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    attention_mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    attention_mask[1, -2:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def _lora_config(targets, **overrides):
    return peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": list(targets),
                              **overrides})


def _trainable(model):
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def _pair(family: str, kv_heads: int, sequence_parallel: bool, seed: int = 5):
    """(dense PEFT model, TP PEFT model, batch, vocabulary size), with equal randomised adapters."""
    torch.manual_seed(seed)
    dense, targets = FAMILIES[family](kv_heads)
    randomised(dense, seed + 1)
    vocab = dense.config.vocab_size
    tp_model = parallelize_model(copy.deepcopy(dense), sequence_parallel=sequence_parallel,
                                 make_vocab_size_divisible_by=8 if sequence_parallel else 1)
    torch.manual_seed(seed + 2)
    dense = peft.get_peft_model(dense, _lora_config(targets))
    torch.manual_seed(seed + 2)
    tp_peft = peft.get_peft_model(tp_model, _lora_config(targets))
    specs = _specs(tp_peft)
    dense_params, tp_params = _trainable(dense), _trainable(tp_peft)
    assert [n for n, _ in dense_params] == [n for n, _ in tp_params], "adapter names differ"
    assert dense_params and all(".lora_" in n for n, _ in dense_params), [n for n, _ in dense_params]
    g = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        for (name, d), (_, t) in zip(dense_params, tp_params):
            assert torch.equal(t, _expected_local(d.detach(), t, specs.get(id(t)), name)), \
                f"{name}: the TP adapter does not start as its slice of dense PEFT's (same seed)"
            d.copy_(0.2 * torch.randn(d.shape, generator=g))
            t.copy_(_expected_local(d.detach(), t, specs.get(id(t)), name))
    return dense, tp_peft, _batch(vocab), vocab


def _logits(model, batch, vocab):
    out = model(**batch)
    return out, gather_vocab_logits(out.logits, vocab)


def _check_adapter_grads(dense, tp_peft, what):
    specs = _specs(tp_peft)
    for (name, d), (_, t) in zip(_trainable(dense), _trainable(tp_peft)):
        assert t.grad is not None and d.grad is not None, f"{what} {name}: no gradient"
        assert d.grad.abs().max() > 0, f"{what} {name}: the dense gradient is zero, the comparison proves nothing"
        expected = _expected_local(d.grad, t, specs.get(id(t)), f"{what} {name}")
        torch.testing.assert_close(t.grad, expected, **TOL, msg=lambda m: f"{what} {name} grad: {m}")
    frozen = [n for n, p in tp_peft.named_parameters() if not p.requires_grad and p.grad is not None]
    assert not frozen, f"{what}: frozen base parameters got gradients {frozen[:3]}"


def _step_on_dense_gradients(dense, tp_peft, dense_opt, tp_opt, what):
    """One AdamW step of each model, the TP one on the dense gradients' slices (its own were compared just before);
    then the stepped adapters are compared.

    The two models' gradients differ by the fp32 rounding of their summation orders (up to ~1e-6 here; run in float64,
    TP and dense agree within 6e-15 after every step, so this is rounding, not a difference in what they compute). AdamW
    scales each element's update by its own gradient's size (lr * m / (sqrt(v) + eps)), so a rounding difference d in
    a gradient element g moves that element's update by about lr * d / |g| (SGD: lr * d), which is large for the small
    elements. Stepped on their own gradients, the models drift apart a little more each step: after 3 steps (lr=1e-2)
    GPT-2's logits differ by 1.2e-5, and the dense fp32 model is itself 5.8e-6 away from the float64 one, so 1e-5 there
    would test the rounding, not the TP model. From equal adapters and equal optimizer state, on equal gradients,
    AdamW's elementwise arithmetic gives equal adapters, so each step's loss, logits, gradients and norm are compared
    from the same values; their largest difference over every case is 2.4e-6 (logits at tp=4), so an error of the TP
    model's forward or backward still fails the 1e-5 comparison, while what the optimizer did is checked here."""
    specs = _specs(tp_peft)
    pairs = list(zip(_trainable(dense), _trainable(tp_peft)))
    with torch.no_grad():
        for (name, d), (_, t) in pairs:
            t.grad.copy_(_expected_local(d.grad, t, specs.get(id(t)), name))
    dense_opt.step(), tp_opt.step()
    dense_opt.zero_grad(), tp_opt.zero_grad()
    for (name, d), (_, t) in pairs:
        expected = _expected_local(d.detach(), t, specs.get(id(t)), f"{what} {name}")
        torch.testing.assert_close(t.detach(), expected, **TOL, msg=lambda m: f"{what} {name} after the step: {m}")


def _dense_norm(dense):
    grads = [p.grad for _, p in _trainable(dense)]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


# ---- cases -----------------------------------------------------------------------------------------------------------

def case_lora_equals_dense(family: str, sequence_parallel: bool, kv_heads: int, steps: int):
    tp = ps.get_tensor_model_parallel_size()
    what = f"{family} tp={tp} kv_heads={kv_heads} sp={sequence_parallel}"
    dense, tp_peft, batch, vocab = _pair(family, kv_heads, sequence_parallel)
    dense_opt = torch.optim.AdamW([p for _, p in _trainable(dense)], **ADAM)
    tp_opt = torch.optim.AdamW([p for _, p in _trainable(tp_peft)], **ADAM)
    losses = []
    for step in range(steps + 1):
        dense_out, dense_logits = _logits(dense, batch, vocab)
        out, logits = _logits(tp_peft, batch, vocab)
        torch.testing.assert_close(out.loss, dense_out.loss, **TOL, msg=lambda m: f"{what} step {step} loss: {m}")
        torch.testing.assert_close(logits, dense_logits, **TOL, msg=lambda m: f"{what} step {step} logits: {m}")
        dense_out.loss.backward()
        out.loss.backward()
        allreduce_sequence_parallel_gradients(tp_peft.parameters())   # what a user calls under SP; no-op for LoRA
        _check_adapter_grads(dense, tp_peft, f"{what} step {step}")
        norm = get_grad_norm([p for _, p in _trainable(tp_peft)])
        torch.testing.assert_close(norm, _dense_norm(dense), **TOL, msg=lambda m: f"{what} step {step} norm: {m}")
        losses.append(out.loss.item())
        if step < steps:
            _step_on_dense_gradients(dense, tp_peft, dense_opt, tp_opt, f"{what} step {step}")
    return losses


def case_lora_on_the_lm_head_gives_full_logits():
    """LoRA on the vocab-parallel LM head too (the head is then PEFT's layer around nxdtp's): the forward still
    returns the dense PEFT model's full-vocabulary logits, padded vocabulary dropped, and the same loss."""
    torch.manual_seed(5)
    dense, targets = _llama(2)
    randomised(dense, 6)
    tp_model = parallelize_model(copy.deepcopy(dense), make_vocab_size_divisible_by=8)
    torch.manual_seed(7)
    dense = peft.get_peft_model(dense, _lora_config([*targets, "lm_head"], init_lora_weights="gaussian"))
    torch.manual_seed(7)
    tp_peft = peft.get_peft_model(tp_model, _lora_config([*targets, "lm_head"], init_lora_weights="gaussian"))
    batch = _batch(dense.config.vocab_size)
    out, expected = tp_peft(**batch), dense(**batch)
    assert out.logits.shape == expected.logits.shape, (tuple(out.logits.shape), tuple(expected.logits.shape))
    torch.testing.assert_close(out.logits, expected.logits, **TOL)
    torch.testing.assert_close(out.loss, expected.loss, **TOL)


def test_lora_on_the_lm_head_gives_full_logits(worlds):
    worlds(2).run(case_lora_on_the_lm_head_gives_full_logits, tensor_model_parallel_size=2)


def case_save_adapter(directory: str, family: str, kv_heads: int):
    """One AdamW step at this TP degree, then PEFT's save_pretrained (global rank 0 writes); the TP model's logits."""
    import torch.distributed as dist

    dense, tp_peft, batch, vocab = _pair(family, kv_heads, sequence_parallel=False)
    optimizer = torch.optim.AdamW([p for _, p in _trainable(tp_peft)], **ADAM)
    tp_peft(**batch).loss.backward()
    optimizer.step()
    tp_peft.save_pretrained(directory, is_main_process=dist.get_rank() == 0)
    dist.barrier()
    # The dense adapter loads into another TP model too (the same base, fresh adapters), each rank keeping its part.
    torch.manual_seed(5)
    base, _ = FAMILIES[family](kv_heads)
    randomised(base, 6)
    loaded = peft.PeftModel.from_pretrained(parallelize_model(base), directory)
    with torch.no_grad():
        return dict(logits=_logits(tp_peft, batch, vocab)[1], loaded=_logits(loaded, batch, vocab)[1])


def case_merge_and_unload(family: str, kv_heads: int):
    dense, tp_peft, batch, vocab = _pair(family, kv_heads, sequence_parallel=False)
    with torch.no_grad():
        adapted = _logits(tp_peft, batch, vocab)[1]
        with tp_peft.disable_adapter(), dense.disable_adapter():
            torch.testing.assert_close(_logits(tp_peft, batch, vocab)[1], dense(**batch).logits, **TOL)
        tp_peft.merge_adapter()
        torch.testing.assert_close(_logits(tp_peft, batch, vocab)[1], adapted, **TOL)
        tp_peft.unmerge_adapter()
        torch.testing.assert_close(_logits(tp_peft, batch, vocab)[1], adapted, **TOL)
        merged_dense = dense.merge_and_unload()
        merged = tp_peft.merge_and_unload()
        assert not any(isinstance(m, peft.tuners.lora.LoraLayer) for m in merged.modules())
        expected = merged_dense(**batch).logits
        torch.testing.assert_close(gather_vocab_logits(merged(**batch).logits, vocab), expected, **TOL)
        torch.testing.assert_close(adapted, expected, **TOL)
    return True


# ---- tests -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,world,sp,kv_heads", [
    pytest.param("llama", 2, False, 2, id="llama-tp2"),
    pytest.param("llama", 2, True, 2, id="llama-tp2-sp"),
    pytest.param("llama", 4, False, 2, id="llama-tp4-kv-repeated"),
    pytest.param("llama", 4, True, 2, id="llama-tp4-kv-repeated-sp"),
    pytest.param("gpt2", 2, False, 0, id="gpt2-tp2"),
    pytest.param("bert", 2, False, 0, id="bert-tp2"),      # intermediate.dense opens its own region
    pytest.param("bert", 2, True, 0, id="bert-tp2-sp"),   # ... and gathers the sequence itself
    pytest.param("qwen2_moe", 2, True, 2, id="qwen2-moe-tp2-sp",
                 marks=pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                                          reason="nxdtp's MoE plan needs transformers 5")),
])
def test_lora_trains_equal_to_dense(worlds, family, world, sp, kv_heads):
    results = worlds(world).run(case_lora_equals_dense, tensor_model_parallel_size=world, family=family,
                                sequence_parallel=sp, kv_heads=kv_heads, steps=3)
    assert all(r == results[0] for r in results), results
    assert results[0][-1] < results[0][0], f"the loss did not fall: {results[0]}"


@pytest.mark.parametrize("family,world,kv_heads", [pytest.param("llama", 2, 2, id="llama-tp2"),
                                                   pytest.param("llama", 4, 2, id="llama-tp4-kv-repeated"),
                                                   pytest.param("gpt2", 2, 0, id="gpt2-tp2")])
def test_saved_adapter_loads_on_the_dense_model(worlds, tmp_path, family, world, kv_heads):
    directory = str(tmp_path / "adapter")
    results = worlds(world).run(case_save_adapter, tensor_model_parallel_size=world, directory=directory,
                                family=family, kv_heads=kv_heads)
    logits = results[0]["logits"]
    for result in results:
        torch.testing.assert_close(result["loaded"], logits, **TOL, msg=lambda m: f"loaded into a TP model: {m}")
    assert sorted(os.listdir(directory)) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    torch.manual_seed(5)
    dense, _ = FAMILIES[family](kv_heads)
    randomised(dense, 6)
    loaded = peft.PeftModel.from_pretrained(dense, directory)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**_batch(dense.config.vocab_size)).logits, logits, **TOL)


@pytest.mark.parametrize("family,world,kv_heads", [pytest.param("llama", 2, 2, id="llama-tp2"),
                                                   pytest.param("llama", 4, 2, id="llama-tp4-kv-repeated"),
                                                   pytest.param("gpt2", 2, 0, id="gpt2-tp2")])
def test_merge_and_unload_equals_dense_merge(worlds, family, world, kv_heads):
    assert all(worlds(world).run(case_merge_and_unload, tensor_model_parallel_size=world, family=family,
                                 kv_heads=kv_heads))


def _simulated_tp_llama():
    model, targets = _llama(2)
    return parallelize_model(model, broadcast_replicated=False), targets


@pytest.mark.parametrize("config,message", [
    (dict(use_dora=True), r"DoRA \(use_dora=True\) is not supported on nxdtp tensor-parallel layers"),
    (dict(init_lora_weights="pissa"), r"init_lora_weights='pissa' is not supported .* valid values are "
                                      r"\[True, False, 'gaussian'\]"),
    (dict(lora_bias=True), r"lora_bias=True \(a bias on lora_B\) is not supported"),
    (dict(bias="all"), r"bias='all' is not supported on an nxdtp tensor-parallel model"),
    (dict(target_modules=["embed_tokens"]), r"LoRA on 'model.embed_tokens' \(ParallelEmbedding\) is not supported"),
])
def test_unsupported_lora_options_are_refused_by_name(config, message):
    with ps.simulated_topology(world_size=2, rank=0, tensor_model_parallel_size=2):
        model, targets = _simulated_tp_llama()
        with pytest.raises(ValueError, match=message):
            peft.get_peft_model(model, _lora_config(targets, **config))
        assert not any(isinstance(m, peft.tuners.tuners_utils.BaseTunerLayer) for m in model.modules())


@pytest.mark.parametrize("method", ["IA3Config", "LoHaConfig", "PromptTuningConfig"])
def test_other_peft_methods_are_refused_by_name(method):
    config = {"IA3Config": lambda: peft.IA3Config(target_modules=["q_proj"], feedforward_modules=[]),
              "LoHaConfig": lambda: peft.LoHaConfig(target_modules=["q_proj"]),
              "PromptTuningConfig": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)}
    name = {"IA3Config": "IA3", "LoHaConfig": "LOHA", "PromptTuningConfig": "PROMPT_TUNING"}[method]
    with ps.simulated_topology(world_size=2, rank=0, tensor_model_parallel_size=2):
        model, _ = _simulated_tp_llama()
        with pytest.raises(ValueError, match=rf"PEFT method {name} is not supported on an nxdtp tensor-parallel "
                                             r"model: nxdtp supports LoRA"):
            peft.get_peft_model(model, config[method]())


# ---- nxdtp checkpoints of a LoRA model -------------------------------------------------------------------------------

def case_checkpoint_save(directory: str):
    """nxdtp.checkpointing.save of the TP PEFT model (frozen base and adapters); the dense adapters and the logits."""
    from nxdtp import checkpointing

    dense, tp_peft, batch, vocab = _pair("llama", 2, sequence_parallel=False)
    checkpointing.save({"model": tp_peft, "global_step": 1}, directory)
    with torch.no_grad():
        logits = _logits(tp_peft, batch, vocab)[1]
    return dict(adapters={n: p.detach().clone() for n, p in _trainable(dense)}, logits=logits)


def case_checkpoint_load(directory: str):
    """A TP PEFT model from other seeds loads the (resharded) checkpoint: the saved model's logits."""
    from nxdtp import checkpointing

    _, tp_peft, batch, vocab = _pair("llama", 2, sequence_parallel=False, seed=11)
    checkpointing.load(directory, model=tp_peft)
    with torch.no_grad():
        return _logits(tp_peft, batch, vocab)[1]


def test_nxdtp_checkpoint_merges_to_dense_adapters_and_reshards(worlds, tmp_path):
    from safetensors.torch import load_file

    from nxdtp.checkpointing.merge import merge, reshard

    saved_dir, merged, resharded = (str(tmp_path / name) for name in ("tp2", "merged", "tp4"))
    saved = worlds(2).run(case_checkpoint_save, tensor_model_parallel_size=2, directory=saved_dir)[0]
    merge(saved_dir, merged, progress=False)
    tensors = load_file(os.path.join(merged, "model.safetensors"))
    for name, dense in saved["adapters"].items():
        torch.testing.assert_close(tensors[name], dense, **TOL, msg=lambda m: f"merged {name}: {m}")
    reshard(saved_dir, resharded, 4, progress=False)
    for logits in worlds(4).run(case_checkpoint_load, tensor_model_parallel_size=4, directory=resharded):
        torch.testing.assert_close(logits, saved["logits"], **TOL)


# ---- dropout on the adapters' inputs ---------------------------------------------------------------------------------

class _RecordingDropout(torch.nn.Dropout):
    def forward(self, x):
        out = super().forward(x)
        self.kept = (out != 0).flatten().to(torch.uint8)
        return out


def case_lora_dropout_masks():
    """Training with lora_dropout and attention dropout (so attention runs inside the RNG fork): the mask on a column
    layer's input (replicated) is the same on every rank, the mask on a row layer's input (this rank's columns) its
    own."""
    import torch.distributed as dist

    from nxdtp.random import model_parallel_xla_manual_seed

    model_parallel_xla_manual_seed(1234)
    torch.manual_seed(5)
    model, targets = _llama(2)
    model.config.attention_dropout = 0.2
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.2
    tp_peft = peft.get_peft_model(parallelize_model(model), _lora_config(targets, lora_dropout=0.3))
    layers = {name: m for name, m in tp_peft.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
    for m in layers.values():
        m.lora_dropout["default"] = _RecordingDropout(0.3)
    tp_peft.train()
    tp_peft(**_batch(101)).loss.backward()
    same = {}
    for name, m in layers.items():
        kept = m.lora_dropout["default"].kept
        gathered = [torch.empty_like(kept) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, kept)
        assert 0 < kept.float().mean() < 1, name
        same[name] = all(torch.equal(g, gathered[0]) for g in gathered)
    return same


def test_lora_dropout_masks_follow_the_input_layout(worlds):
    same = worlds(2).run(case_lora_dropout_masks, tensor_model_parallel_size=2)[0]
    for name, equal in same.items():
        row = name.endswith(("o_proj", "down_proj"))
        assert equal != row, f"{name}: masks {'equal' if equal else 'differ'} across TP ranks"


def test_nested_fork_continues_and_replicated_draws_outside(rank1_of_tp2):  # noqa: F811 - fixtures
    from nxdtp.random import get_rng_state, get_xla_rng_tracker, model_parallel_xla_manual_seed, set_rng_state

    tracker = get_xla_rng_tracker()
    model_parallel_xla_manual_seed(7)
    outside = get_rng_state()
    with tracker.fork():
        expected_sharded = torch.rand(6)
    expected_replicated = torch.rand(3)
    set_rng_state(outside)
    model_parallel_xla_manual_seed(7)
    with tracker.fork():
        first = torch.rand(3)
        with tracker.fork():               # a sharded dropout inside forked attention: the same stream goes on
            second = torch.rand(3)
        with tracker.replicated():         # a replicated input's dropout inside the fork: the default generators
            replicated = torch.rand(3)
    torch.testing.assert_close(torch.cat([first, second]), expected_sharded, rtol=0, atol=0)
    torch.testing.assert_close(replicated, expected_replicated, rtol=0, atol=0)


def test_a_peft_release_outside_the_range_is_refused_by_name(monkeypatch):
    with ps.simulated_topology(world_size=2, rank=0, tensor_model_parallel_size=2):
        model, targets = _simulated_tp_llama()
        monkeypatch.setattr(peft, "__version__", "0.20.0")
        with pytest.raises(ImportError,
                           match=r"peft 0.20.0 is not supported by nxdtp's LoRA on tensor-parallel models: "
                                 r"supported versions are >=0.21.2,<0.22; pip install 'peft>=0.21.2,<0.22'"):
            peft.get_peft_model(model, _lora_config(targets))


def test_all_linear_targets_the_parallel_projections():
    from nxdtp.models.peft_lora import _all_linear_names

    with ps.simulated_topology(world_size=2, rank=0, tensor_model_parallel_size=2):
        model, targets = _simulated_tp_llama()
        assert _all_linear_names(model) == set(targets)   # lm_head, the output layer, is left out as PEFT does


_PEFT_AFTER_NXDTP = """
import sys
import transformers
from nxdtp.models import parallelize_model
from nxdtp.utils import initialize_fallback_parallel_state
assert "peft" not in sys.modules
initialize_fallback_parallel_state()
config = transformers.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2)
model = parallelize_model(transformers.LlamaForCausalLM(config))
import peft
wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
print(type(wrapped.base_model.model.model.layers[0].self_attn.q_proj).__name__)
print(sorted({type(finder).__module__.split(".")[0] for finder in sys.meta_path}))
"""


def test_peft_imported_after_parallelizing_shards_the_adapters():
    """The user's order: parallelize first, import PEFT after. The install happens at the parallelize call (no import
    hook is left on sys.meta_path), and get_peft_model dispatches nxdtp's layers to the sharded LoRA layer."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", _PEFT_AFTER_NXDTP], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": root}, cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    layer, finder_packages = run.stdout.strip().split("\n")[-2:]   # after gloo's own lines
    assert layer == "LoraParallelLinear", run.stdout
    assert "nxdtp" not in finder_packages, finder_packages

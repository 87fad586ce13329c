"""Activation checkpointing of parallelized HF models, by ``nxdtp.models.checkpoint_layers`` and by HF's own switch
(``gradient_checkpointing_enable``, transformers 5's ``activation_checkpointing_enable``; HF Trainer's
``gradient_checkpointing=True`` calls them), against the same parallelized model without checkpointing.

Every family nxdtp plans (BERT, RoBERTa, GPT-2, Llama, Mistral, Qwen2, Qwen3, and a family sharded from HF's tp_plan)
at tp=2, sequence parallelism off and on, in training mode with dropout 0.1, the config's default ``use_cache`` and no
attention mask, as a new user runs them: loss and every gradient within 1e-5 (fp32), the recompute having replayed
the RNG tracker (dropout inside TP regions) and written no KV cache. The same file runs under every transformers
release of the CI matrix (.ci/transformers-matrix); families a release lacks are skipped, and under releases whose
models call torch.utils.checkpoint themselves (4.26's BERT) HF's switch must be refused.
"""

from __future__ import annotations

import copy
import functools
import inspect

import pytest
import torch

from nxdtp import parallel_state as ps
from nxdtp.grads import allreduce_sequence_parallel_gradients, get_grad_norm
from nxdtp.models import checkpoint_layers, parallelize_model
from nxdtp.models.family import DEFAULT_OLDEST_TRANSFORMERS
from nxdtp.models.registry import family_of
from nxdtp.random import model_parallel_xla_manual_seed
from tests.model_helpers import randomised
from tests.test_models_bert import _close

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, DROPOUT = 97, 8, 2, 0.1   # SEQ divisible by tp=2 for sequence parallelism
TOL = dict(atol=1e-5, rtol=1e-5)
DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=32, attention_dropout=DROPOUT, tie_word_embeddings=False)
ENCODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=32, hidden_dropout_prob=DROPOUT, attention_probs_dropout_prob=DROPOUT)
# family: (model class, config class, config options). The config's use_cache is left at its default.
FAMILIES = {
    "bert": ("BertForMaskedLM", "BertConfig", ENCODER),
    "roberta": ("RobertaForMaskedLM", "RobertaConfig", dict(ENCODER, max_position_embeddings=SEQ + 4)),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                                    resid_pdrop=DROPOUT, embd_pdrop=DROPOUT, attn_pdrop=DROPOUT)),
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(DECODER, attention_bias=True, mlp_bias=True)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(DECODER, sliding_window=None)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", DECODER),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(DECODER, head_dim=8, attention_bias=True)),
    "granite (HF tp_plan)": ("GraniteForCausalLM", "GraniteConfig", dict(DECODER, embedding_multiplier=2.0,
                                                                         residual_multiplier=0.5)),
}


def _release() -> tuple:
    return tuple(int(part) for part in transformers.__version__.split(".")[:2])


def _unavailable(family) -> str:
    model_class, config_class, _ = FAMILIES[family]
    if not hasattr(transformers, model_class):
        return f"transformers {transformers.__version__} has no {model_class}"
    registered = family_of(model_class)
    oldest = registered.oldest_transformers if registered is not None else DEFAULT_OLDEST_TRANSFORMERS
    if _release() < oldest:
        return f"nxdtp's {family} plan needs transformers>={'.'.join(map(str, oldest))}"
    if family.endswith("(HF tp_plan)") and not getattr(getattr(transformers, config_class), "base_model_tp_plan", None):
        return f"transformers {transformers.__version__}'s {config_class} has no base_model_tp_plan"
    return ""


def _families():
    return [pytest.param(f, marks=pytest.mark.skipif(bool(_unavailable(f)), reason=_unavailable(f))) for f in FAMILIES]


def _dense(family: str, seed: int):
    model_class, config_class, options = FAMILIES[family]
    config = getattr(transformers, config_class)(**options)
    torch.manual_seed(seed)
    return randomised(getattr(transformers, model_class)(config), seed + 1).train()


def _batch(seed: int) -> dict:
    """Token ids and labels only (no attention mask), as a new user starts; ids from 3 so RoBERTa sees no padding id."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    labels = input_ids.clone()
    labels[0, 2] = -100
    return dict(input_ids=input_ids, labels=labels)


def _hf_switch(**kwargs):
    def enable(model):
        model.gradient_checkpointing_enable(**kwargs)
        return model
    return enable


def _hf_switch_then_off(model):
    model.gradient_checkpointing_enable()
    model.gradient_checkpointing_disable()
    return model


def _activation_checkpointing_every_other_layer(model):
    # transformers 5's name for the switch, with its every_n_layers (Trainer passes both).
    model.activation_checkpointing_enable(every_n_layers=2)
    return model


SWITCHES = {
    "checkpoint_layers": checkpoint_layers,
    "gradient_checkpointing_enable()": _hf_switch(),
    "gradient_checkpointing_enable(use_reentrant=True)": _hf_switch(
        gradient_checkpointing_kwargs={"use_reentrant": True}),
    "gradient_checkpointing_enable(use_reentrant=False)": _hf_switch(
        gradient_checkpointing_kwargs={"use_reentrant": False}),
    "activation_checkpointing_enable(every_n_layers=2)": _activation_checkpointing_every_other_layer,
    "enabled then gradient_checkpointing_disable()": _hf_switch_then_off,
}


def _hf_switch_is_old_format(model) -> bool:
    """transformers before 4.35 (4.26's BERT): the modules call torch.utils.checkpoint themselves."""
    return "value" in inspect.signature(model._set_gradient_checkpointing).parameters


def _returned_cache(out):
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    return cache if hasattr(cache, "get_seq_length") else None


def _step(model, batch) -> dict:
    """One forward and backward from the same RNG states: the loss, the gradients (SP-reduced), the grad norm, how
    many tensors the forward saved for backward outside checkpointed regions, and the tokens its cache holds."""
    torch.manual_seed(1234)
    model_parallel_xla_manual_seed(1234)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t):
        out = model(**batch)
    out.loss.backward()
    allreduce_sequence_parallel_gradients(model.parameters())
    cache = _returned_cache(out)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return dict(loss=out.loss.detach(), grads=grads, norm=get_grad_norm(list(model.parameters())),
                saved=len(saved), cached_tokens=None if cache is None else cache.get_seq_length())


def case_checkpointing_equals_plain(family: str, sequence_parallel: bool, switches: list):
    """The plain parallelized model against the same model under each switch; returns what was compared."""
    dense = _dense(family, seed=31)
    batch = _batch(seed=32)
    plain = _step(parallelize_model(copy.deepcopy(dense), sequence_parallel=sequence_parallel), batch)
    checked = []
    for switch in switches:
        what = f"{family} tp={ps.get_tensor_model_parallel_size()} sp={sequence_parallel} {switch}"
        model = parallelize_model(copy.deepcopy(dense), sequence_parallel=sequence_parallel)
        if switch != "checkpoint_layers" and _hf_switch_is_old_format(model):
            # The old format's gradient_checkpointing_enable takes no arguments; each HF switch is refused there.
            with pytest.raises(NotImplementedError, match=r"call torch\.utils\.checkpoint themselves.*"
                                                          r"nxdtp\.models\.checkpoint_layers"):
                model.gradient_checkpointing_enable()
            checked.append(f"{what}: refused")
            continue
        if switch.startswith("activation_checkpointing") and not hasattr(model, "activation_checkpointing_enable"):
            checked.append(f"{what}: not in transformers {transformers.__version__}")
            continue
        run = _step(SWITCHES[switch](model), batch)
        _close(run["loss"], plain["loss"], f"{what} loss")
        for name, grad in plain["grads"].items():
            torch.testing.assert_close(run["grads"][name], grad, **TOL, msg=functools.partial(
                "{}: gradient of {}: {}".format, what, name))
        _close(run["norm"], plain["norm"], f"{what} grad norm")
        if switch.endswith("disable()"):
            assert run["saved"] == plain["saved"], (what, run["saved"], plain["saved"])
        else:
            assert run["saved"] < plain["saved"], f"{what}: nothing was checkpointed ({run['saved']} tensors saved)"
        if plain["cached_tokens"] is not None:
            # The cache was in play: the plain model filled it, the checkpointed layers must not have written to it.
            assert plain["cached_tokens"] == SEQ, (what, plain["cached_tokens"])
            expected = SEQ if switch.endswith("disable()") else 0
            assert run["cached_tokens"] in (None, expected), (what, run["cached_tokens"])
        checked.append(what)
    return checked


@pytest.mark.parametrize("family,sp", [
    pytest.param(f.values[0], sp, marks=f.marks, id=f"{f.values[0]}-{'sp' if sp else 'tp'}")
    for f in _families() for sp in (False, True)
    if not (sp and f.values[0].endswith("(HF tp_plan)"))])  # HF's plans have no sequence parallelism
def test_checkpointing_gives_the_plain_models_loss_and_gradients(worlds, family, sp):
    results = worlds(2).run(case_checkpointing_equals_plain, tensor_model_parallel_size=2, family=family,
                            sequence_parallel=sp, switches=list(SWITCHES))
    assert results[0] == results[1] and len(results[0]) == len(SWITCHES), results


# ---- caches: recognised by type, wherever they are passed ------------------------------------------------------------

def _cache_class():
    return pytest.importorskip("transformers.cache_utils").DynamicCache


def _filled_cache(tokens: int):
    cache = _cache_class()()
    cache.update(torch.randn(1, 2, tokens, 4), torch.randn(1, 2, tokens, 4), 0)
    return cache


def test_an_empty_cache_is_kept_out_under_any_name_and_position():
    from nxdtp.models.activation_checkpointing import without_kv_caches

    empty, legacy = _cache_class()(), (torch.ones(1), torch.ones(1))
    args, kwargs = without_kv_caches((torch.ones(2), empty, 3), {"a_name_no_release_used": empty, "past": legacy},
                                     "Layer")
    assert args[1] is None and kwargs["a_name_no_release_used"] is None
    # A legacy tuple cache is read, not written, by a layer: the recompute sees what the forward saw, so it stays.
    assert args[2] == 3 and kwargs["past"] is legacy


def test_a_filled_cache_is_refused_naming_it():
    from nxdtp.models.activation_checkpointing import without_kv_caches

    with pytest.raises(ValueError, match=r"LlamaDecoderLayer: its argument 'cache' is a KV cache \(DynamicCache\) "
                                         r"already holding 5 tokens"):
        without_kv_caches((), {"cache": _filled_cache(5)}, "LlamaDecoderLayer")
    with pytest.raises(ValueError, match=r"its argument 1 is a KV cache"):
        without_kv_caches((torch.ones(1), _filled_cache(2)), {}, "Layer")


def case_a_filled_cache_in_a_checkpointed_training_step_is_refused(family: str):
    model_parallel_xla_manual_seed(5)   # training mode with dropout: the tracker must be seeded in this worker
    model = checkpoint_layers(parallelize_model(_dense(family, seed=5)))
    batch = _batch(seed=6)
    with torch.no_grad():   # no backward, so nothing recomputes: the cache fills as usual
        prefix = model(input_ids=batch["input_ids"], use_cache=True)
    cache = _returned_cache(prefix)
    assert cache is not None and cache.get_seq_length() == SEQ
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    try:
        model(input_ids=batch["input_ids"][:, :1], use_cache=True, **{name: cache})
    except ValueError as error:
        assert f"already holding {SEQ} tokens" in str(error), error
        return cache.get_seq_length()
    raise AssertionError("a checkpointed training forward accepted a filled KV cache")


@pytest.mark.parametrize("family", [f for f in _families() if f.values[0] in ("llama", "qwen3")])
def test_a_filled_cache_in_a_checkpointed_training_step_is_refused(worlds, family):
    # Refused before any layer wrote to it.
    assert worlds(2).run(case_a_filled_cache_in_a_checkpointed_training_step_is_refused,
                         tensor_model_parallel_size=2, family=family) == [SEQ, SEQ]


# ---- HF's switch: deepcopy, and turned on before parallelization -----------------------------------------------------

def case_switch_survives_deepcopy():
    # (Not pickling: with the switch on, HF's enable_input_require_grads leaves a local hook on the embedding, which
    # makes the dense model unpicklable too. nxdtp's wrapper itself is a module-level class.)
    model = parallelize_model(_dense("llama", seed=3))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = _batch(seed=4)
    reference = _step(model, batch)
    copied = copy.deepcopy(model)
    copied.zero_grad()
    run = _step(copied, batch)
    _close(run["loss"], reference["loss"], "deepcopy loss")
    for name, grad in reference["grads"].items():
        torch.testing.assert_close(run["grads"][name], grad, **TOL)
    assert run["saved"] == reference["saved"] < _step(parallelize_model(_dense("llama", seed=3)), batch)["saved"]
    return True


@pytest.mark.skipif(bool(_unavailable("llama")), reason=_unavailable("llama") or "-")
def test_hf_switch_survives_deepcopy(worlds):
    assert worlds(2).run(case_switch_survives_deepcopy, tensor_model_parallel_size=2) == [True, True]


def case_switch_turned_on_before_parallelizing():
    dense = _dense("bert", seed=8)
    batch = _batch(seed=9)
    plain = _step(parallelize_model(copy.deepcopy(dense)), batch)
    early = copy.deepcopy(dense)
    early.gradient_checkpointing_enable()
    if _hf_switch_is_old_format(early):
        with pytest.raises(NotImplementedError, match=r"nxdtp\.models\.checkpoint_layers"):
            parallelize_model(early)
        return "refused"
    run = _step(parallelize_model(early), batch)
    _close(run["loss"], plain["loss"], "switched on before parallelize_model: loss")
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(run["grads"][name], grad, **TOL)
    assert run["saved"] < plain["saved"]
    return "replayed"


def test_hf_switch_turned_on_before_parallelizing_replays_too(worlds):
    # Under HF's old checkpointing format (before 4.35) parallelizing a model whose switch is on is refused instead.
    expected = "refused" if _release() < (4, 35) else "replayed"
    assert worlds(2).run(case_switch_turned_on_before_parallelizing, tensor_model_parallel_size=2) == [expected] * 2


def test_checkpoint_refuses_a_container_holding_a_tensor_that_needs_grad():
    from nxdtp.random import checkpoint

    weight = torch.ones(3, requires_grad=True)
    with pytest.raises(TypeError, match=r"argument 'pair' is a tuple holding a tensor that requires grad"):
        checkpoint(lambda x, pair: x * pair[0], torch.ones(3), pair=(weight, 1))

"""``model.generate(...)`` on parallelized causal LMs against the dense HF model, on real gloo ranks.

Each case builds the dense model from a seed on every rank, randomises every parameter (biases and norms included),
deep-copies and shards the copy, and runs HF's ``generate`` on both with the same arguments: greedy, sampling after
``torch.manual_seed`` (the same seed on every rank and for the dense model), and beam search, with the KV cache, on a
left-padded batch whose prompt length TP does not divide (under sequence parallelism the prefill cannot be split, and
every decode step has one token). Every rank must produce the dense model's tokens, and the scores and raw logits
``generate`` returns must be the dense model's full-vocabulary ones (the vocabulary is odd, so TP pads it; the padding
must not show). The training forward keeps returning vocab-parallel logits, before and after ``generate``.
fp32, tolerance 1e-5.
"""

from __future__ import annotations

import copy

import pytest
import torch

from nxdtp import parallel_state as ps
from nxdtp.loss_functions import parallel_cross_entropy
from nxdtp.models import gather_vocab_logits, parallelize_model, vocab_parallel_logits
from tests import test_models_decoders as decoders
from tests import test_models_gpt2 as gpt2
from tests import test_models_hf_tp_plan as hf_tp_plan
from tests.test_models_bert import _close

transformers = pytest.importorskip("transformers")

PROMPT, NEW_TOKENS = 5, 4   # 5: neither tp=2 nor tp=4 divides it
SEED = 1234

MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=20, temperature=0.8),   # top-k over the full vocabulary
    "beam": dict(do_sample=False, num_beams=3, num_return_sequences=2),
}


def _dense(family: str, kv_heads: int):
    """The dense, randomised model and its vocabulary size."""
    if family == "gpt2":
        return gpt2._dense(transformers.GPT2LMHeadModel, seed=21), gpt2.VOCAB
    if family in hf_tp_plan.MODELS:
        return hf_tp_plan._dense(family, seed=22), hf_tp_plan.VOCAB
    return decoders._dense(family, decoders._config(family, kv_heads), seed=len(family)), decoders.VOCAB


def _prompt(vocab: int):
    """Two prompts of PROMPT tokens, the second left-padded by 2 (token 0, masked), the first with the last real id."""
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, vocab, (2, PROMPT), generator=g)
    input_ids[0, 1] = vocab - 1
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :2] = 0
    input_ids[1, :2] = 0
    return dict(input_ids=input_ids, attention_mask=attention_mask)


def _generate(model, prompt, mode: str):
    torch.manual_seed(SEED)   # every rank the same seed: sampling runs on the replicated full logits
    return model.generate(**prompt, **MODES[mode], max_new_tokens=NEW_TOKENS, pad_token_id=0,
                          return_dict_in_generate=True, output_scores=True, output_logits=True)


def _check_same_generation(out, ref, vocab: int, what: str) -> None:
    assert torch.equal(out.sequences, ref.sequences), f"{what}: tokens\n{out.sequences}\n!= dense\n{ref.sequences}"
    for name in ("scores", "logits"):
        got, expected = getattr(out, name), getattr(ref, name)
        assert len(got) == len(expected), (what, name, len(got), len(expected))
        for step, (a, b) in enumerate(zip(got, expected)):
            assert a.shape == b.shape and a.shape[-1] == vocab, \
                f"{what}: {name}[{step}] shape {a.shape}, dense {b.shape}"
            _close(a, b, f"{what} {name}[{step}]")
    if getattr(ref, "sequences_scores", None) is not None:
        _close(out.sequences_scores, ref.sequences_scores, f"{what} sequences_scores")
        assert torch.equal(out.beam_indices, ref.beam_indices), what


def case_generate_equals_dense(families, modes, sequence_parallel: bool, multiple: int, kv_heads: int = 2):
    tp = ps.get_tensor_model_parallel_size()
    tokens = {}
    for family in families:
        dense, vocab = _dense(family, kv_heads)
        dense.eval()
        model = parallelize_model(copy.deepcopy(dense), sequence_parallel=sequence_parallel,
                                           make_vocab_size_divisible_by=multiple).eval()
        prompt = _prompt(vocab)
        for mode in modes:
            what = f"{family} tp={tp} kv_heads={kv_heads} sp={sequence_parallel} divisible_by={multiple} {mode}"
            out = _generate(model, prompt, mode)
            _check_same_generation(out, _generate(dense, prompt, mode), vocab, what)
            tokens[(family, mode)] = out.sequences
    return tokens


def _run_and_check_ranks_agree(worlds, world: int, **kwargs):
    results = worlds(world).run(case_generate_equals_dense, tensor_model_parallel_size=world, **kwargs)
    for rank, result in enumerate(results[1:], 1):
        assert result.keys() == results[0].keys()
        for key, sequences in result.items():
            assert torch.equal(sequences, results[0][key]), (rank, key)
    return results


DECODER_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@pytest.mark.parametrize("world,sp,families,kv_heads", [
    pytest.param(2, False, DECODER_FAMILIES + ("gpt2",), 2, id="tp2"),
    pytest.param(2, True, ("llama", "qwen3", "gpt2"), 2, id="tp2-sp"),
    # 8 query heads over 2 KV heads at tp=4: each KV head repeated on two ranks.
    pytest.param(4, False, ("llama", "qwen3", "gpt2"), 2, id="tp4-gqa"),
    pytest.param(4, True, ("llama", "gpt2"), 2, id="tp4-gqa-sp"),
])
def test_greedy_and_sampling_equal_dense_on_every_rank(worlds, world, sp, families, kv_heads):
    families = tuple(f for f in families if f == "gpt2" or f in decoders.AVAILABLE)
    # Odd vocabularies (101, 99) padded for TP: to a multiple of 1 * tp, or of 8 * tp under SP.
    _run_and_check_ranks_agree(worlds, world, families=families, modes=("greedy", "sample"), sequence_parallel=sp,
                               multiple=8 if sp else 1, kv_heads=kv_heads)


@pytest.mark.parametrize("sp", [pytest.param(False, id="tp2"), pytest.param(True, id="tp2-sp")])
def test_beam_search_equals_dense_on_every_rank(worlds, sp):
    _run_and_check_ranks_agree(worlds, 2, families=("llama", "gpt2"), modes=("beam",), sequence_parallel=sp,
                               multiple=8, kv_heads=2)


def test_model_sharded_from_hf_tp_plan_generates_as_dense(worlds):
    # Granite: HF's tp_plan gathers the LM head's output; nxdtp's keeps it vocab-parallel, so generate must gather.
    _run_and_check_ranks_agree(worlds, 2, families=("GraniteForCausalLM",), modes=("greedy", "sample"),
                               sequence_parallel=False, multiple=8)


def case_static_cache_or_a_clear_refusal():
    """Where transformers sizes static cache layers from the keys they store, a static cache generates as dense; where
    it allocates them for the config's KV heads (4.x), generate refuses the cache by name before it starts."""
    from transformers import cache_utils

    dense, vocab = _dense("llama", kv_heads=2)
    dense.eval()
    model = parallelize_model(copy.deepcopy(dense), sequence_parallel=True, make_vocab_size_divisible_by=8).eval()
    kwargs = dict(**_prompt(vocab), max_new_tokens=NEW_TOKENS, pad_token_id=0, do_sample=False,
                  cache_implementation="static")
    if not hasattr(getattr(cache_utils, "StaticLayer", None), "lazy_initialization"):
        with pytest.raises(NotImplementedError, match=r"cache_implementation='static'.* the config's 2 KV heads.*"
                                                      r"Leave cache_implementation unset"):
            model.generate(**kwargs)
        return None
    tokens = model.generate(**kwargs)
    assert torch.equal(tokens, dense.generate(**kwargs)), (tokens, dense.generate(**kwargs))
    return tokens


def test_static_cache_generates_as_dense_or_is_refused(worlds):
    results = worlds(2).run(case_static_cache_or_a_clear_refusal, tensor_model_parallel_size=2)
    assert (results[0] is None and results[1] is None) or torch.equal(results[0], results[1])


# ---- the training forward is unchanged ------------------------------------------------------------------------------

def _batch(vocab: int):
    g = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, vocab, (2, 8), generator=g)
    return dict(input_ids=input_ids, labels=input_ids)


def case_full_logits_unless_asked_for_shards_around_generate(sequence_parallel: bool):
    """Before and after a generate: the training forward (and the eval forward under no_grad) gives the dense model's
    full-vocabulary logits and loss; inside ``vocab_parallel_logits`` it gives this rank's vocab-parallel logits and
    the same loss; generate, run inside ``vocab_parallel_logits``, still decodes from full logits."""
    tp = ps.get_tensor_model_parallel_size()
    dense, vocab = _dense("llama", kv_heads=2)
    model = parallelize_model(copy.deepcopy(dense), sequence_parallel=sequence_parallel,
                                       make_vocab_size_divisible_by=8)
    local = -(-vocab // (8 * tp)) * 8   # this rank's columns of the padded vocabulary
    batch = _batch(vocab)
    what = f"tp={tp} sp={sequence_parallel}"

    def check_forward(when, training):
        model.train(training)
        dense.train(training)
        with torch.set_grad_enabled(training):
            expected = dense(**batch)
            out = model(**batch)
            assert out.logits.shape == (2, 8, vocab), f"{what} {when}: logits {tuple(out.logits.shape)}"
            _close(out.logits, expected.logits, f"{what} {when}: full logits")
            _close(out.loss, expected.loss, f"{what} {when}: loss")
            with pytest.raises(ValueError, match=r"full-vocabulary logits .*vocab_parallel_logits\(model\)"):
                parallel_cross_entropy(out.logits, batch["labels"])   # an NxD habit, on what is not a shard
            with vocab_parallel_logits(model):
                shards = model(**batch)
            assert shards.logits.shape == (2, 8, local), f"{what} {when}: shard logits {tuple(shards.logits.shape)}"
            _close(gather_vocab_logits(shards.logits, vocab), expected.logits, f"{what} {when}: gathered shards")
            _close(shards.loss, expected.loss, f"{what} {when}: loss on the shards")
        if training:
            (out.loss + shards.loss).backward()   # both paths differentiate
            model.zero_grad()

    for training in (True, False):
        check_forward("before generate", training)
    dense.eval()
    with vocab_parallel_logits(model):
        out = _generate(model, _prompt(vocab), "greedy")
    _check_same_generation(out, _generate(dense, _prompt(vocab), "greedy"), vocab, what)
    for training in (True, False):
        check_forward("after generate", training)
    return out.sequences


@pytest.mark.parametrize("sp", [pytest.param(False, id="tp2"), pytest.param(True, id="tp2-sp")])
def test_forward_gives_full_logits_unless_asked_for_shards(worlds, sp):
    results = worlds(2).run(case_full_logits_unless_asked_for_shards_around_generate, tensor_model_parallel_size=2,
                            sequence_parallel=sp)
    assert torch.equal(results[0], results[1])


# ---- generation_mode: a decoding loop of one's own ----------------------------------------------------------------

def case_generation_mode_decoding_loop(sequence_parallel: bool):
    """Under ``generation_mode``: a forward with labels gives full logits and the dense loss on a sequence TP does not
    divide; a hand-written greedy loop over the KV cache, one token per step, gives the dense logits; outside it the
    forward is the training one again (and under SP refuses that length)."""
    from nxdtp.models import generation_mode

    tp = ps.get_tensor_model_parallel_size()
    dense, vocab = _dense("llama", kv_heads=2)
    model = parallelize_model(copy.deepcopy(dense), sequence_parallel=sequence_parallel,
                                       make_vocab_size_divisible_by=8).eval()
    what = f"tp={tp} sp={sequence_parallel}"
    input_ids = _prompt(vocab)["input_ids"][:1]   # one row, PROMPT tokens
    with torch.no_grad():
        with generation_mode(model):
            out = model(input_ids=input_ids, labels=input_ids)
        expected = dense(input_ids=input_ids, labels=input_ids)
        assert out.logits.shape == (1, PROMPT, vocab), what
        _close(out.logits, expected.logits, f"{what} logits")
        _close(out.loss, expected.loss, f"{what} loss")

        def loop(m):
            cache, ids, logits = None, input_ids, []
            for _ in range(3):
                step = m(input_ids=ids, past_key_values=cache, use_cache=True)
                cache = step.past_key_values
                logits.append(step.logits[:, -1])
                ids = step.logits[:, -1:].argmax(-1)
            return torch.stack(logits)

        with generation_mode(model):
            got = loop(model)
        _close(got, loop(dense), f"{what} decoding loop logits")
        if sequence_parallel:
            with pytest.raises(ValueError, match="pad sequences to a multiple of 2"):
                model(input_ids=input_ids)
        with vocab_parallel_logits(model):
            assert model(input_ids=input_ids[:, :4]).logits.shape[-1] < vocab, f"{what}: shards asked for after"
    if sequence_parallel:
        with generation_mode(model), pytest.raises(RuntimeError, match=r"sequence_parallel=True .*torch\.no_grad"):
            model(input_ids=input_ids)
    with pytest.raises(TypeError, match="generation_mode.. needs a causal language model parallelized by nxdtp.*"
                                        "LlamaForCausalLM is not one"):
        with generation_mode(dense):
            pass
    # DoLa runs the LM head on intermediate hidden states itself: refused before transformers starts.
    with pytest.raises(NotImplementedError, match=r"dola_layers='high'.*Use greedy search, sampling or beam search"):
        model.generate(input_ids=input_ids, max_new_tokens=1, dola_layers="high")
    return got


@pytest.mark.parametrize("sp", [pytest.param(False, id="tp2"), pytest.param(True, id="tp2-sp")])
def test_generation_mode_gives_full_logits_for_any_length(worlds, sp):
    results = worlds(2).run(case_generation_mode_decoding_loop, tensor_model_parallel_size=2, sequence_parallel=sp)
    assert torch.equal(results[0], results[1])


# ---- sequence parallelism is suspended, not approximated -----------------------------------------------------------

def case_sequence_parallel_generation_is_the_plain_tp_model(seed: int):
    """GPT-2 in training mode with dropout: generation with SP (suspended) draws exactly what the same model sharded
    without SP draws, replicated dropouts included (the same mask on every rank), so the ranks stay identical."""
    from nxdtp.random import model_parallel_xla_manual_seed

    dense = gpt2._dense(transformers.GPT2LMHeadModel, seed=21, dropout=0.2)
    sequences, logits = [], []
    for sp in (False, True):
        model = parallelize_model(copy.deepcopy(dense), sequence_parallel=sp, make_vocab_size_divisible_by=8)
        model.train()
        model_parallel_xla_manual_seed(seed)   # the tracker (attention dropout) and the default generator
        out = model.generate(**_prompt(gpt2.VOCAB), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True, output_logits=True)
        sequences.append(out.sequences)
        logits.append(torch.stack(out.logits))
    assert torch.equal(sequences[0], sequences[1]), sequences
    _close(logits[1], logits[0], "SP generation logits against the plain TP model's")
    return sequences[1]


def test_sequence_parallel_generation_with_dropout_is_the_plain_tp_model(worlds):
    results = worlds(2).run(case_sequence_parallel_generation_is_the_plain_tp_model, tensor_model_parallel_size=2,
                            seed=7)
    assert torch.equal(results[0], results[1])

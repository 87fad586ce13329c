"""Models nxdtp has no hand-written plan for, sharded from the tensor-parallel plan transformers ships with them.

At tp=2 against the dense HF model (loss, logits, every gradient slice and the grad norm, every parameter randomised
first; fp32, tolerance 1e-5):

* Granite: ``colwise`` / ``rowwise``, with embedding, residual and attention multipliers and logits scaling (logit
  processing the loss must see);
* Phi3: fused ``qkv_proj`` and ``gate_up_proj`` with ``colwise_gather_output`` / ``rowwise_split_input``;
* Olmo2: gathered Q/K/V for its full-width q/k norms;
* Gemma2: final-logit and attention soft-capping, and (transformers 5) a scaled embedding class tied to the head,
  which stay replicated (converting that class would drop its scaling; in 4.x the embedding is an nn.Embedding, the
  model scales after it, and both are vocab-parallel).

HF's plans gather the LM head's output; nxdtp keeps it vocab-parallel (over a padded vocabulary) and computes the loss
on the shards, after the model's own logit processing.

Older transformers releases ship plans for fewer models (4.48: Granite, not Phi3, Olmo2 or Gemma2): the tests run the
models whose config has a plan in the installed release, and test_model_has_an_hf_tp_plan reports each other one as
skipped.
"""

from __future__ import annotations

import copy

import pytest
import torch

from nxdtp import parallel_state as ps
from nxdtp.grads import get_grad_norm
from nxdtp.models import gather_vocab_logits, parallelize_model, vocab_parallel_logits
from nxdtp.plan import ColumnParallel
from tests.model_helpers import check_checkpoint_round_trip, randomised
from tests.test_models_bert import _check_grads, _check_weights, _close, _dense_grad_norm

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 91, 8, 2
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.0)
# name: (config class, config options, whether the head ends up vocab-parallel; None: see _vocab_parallel_head)
MODELS = {
    "GraniteForCausalLM": ("GraniteConfig", dict(embedding_multiplier=3.0, residual_multiplier=0.5,
                                                 attention_multiplier=0.3, logits_scaling=2.0,
                                                 tie_word_embeddings=False), True),
    "Phi3ForCausalLM": ("Phi3Config", dict(pad_token_id=0, tie_word_embeddings=False), True),
    "Olmo2ForCausalLM": ("Olmo2Config", dict(tie_word_embeddings=False), True),
    "Gemma2ForCausalLM": ("Gemma2Config", dict(head_dim=8, final_logit_softcapping=3.0, attn_logit_softcapping=5.0,
                                               query_pre_attn_scalar=8, sliding_window=4), None),
}


def _vocab_parallel_head(name, dense) -> bool:
    """Gemma2's head is tied to its embedding. In transformers 5 that embedding is a class with a forward of its own
    (it scales), which nxdtp leaves replicated, and the head with it; in 4.x it is an nn.Embedding (the model scales
    after it), which is made vocab-parallel, and the head too."""
    if MODELS[name][2] is not None:
        return MODELS[name][2]
    embedding = dense.get_input_embeddings()
    assert dense.get_output_embeddings().weight is embedding.weight, name
    return type(embedding).forward is torch.nn.Embedding.forward

# The models whose config carries a base_model_tp_plan in the installed transformers.
WITH_PLAN = tuple(name for name, (config_class, _, _) in MODELS.items()
                  if getattr(getattr(transformers, config_class, None), "base_model_tp_plan", None))


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.skipif(
    name not in WITH_PLAN, reason=f"transformers {transformers.__version__}'s {MODELS[name][0]} has no "
                                  "base_model_tp_plan")) for name in MODELS])
def test_model_has_an_hf_tp_plan(name):
    assert getattr(transformers, MODELS[name][0]).base_model_tp_plan, name


def _dense(name, seed, **overrides):
    config_class, extra, _ = MODELS[name]
    config = getattr(transformers, config_class)(**{**COMMON, **extra, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomised(getattr(transformers, name)(config), seed + 1)


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    input_ids[0, 2] = VOCAB - 1
    labels = input_ids.clone()
    labels[1, :3] = -100
    return dict(input_ids=input_ids, labels=labels)


def case_tp_plan_models_equal_dense(names, multiple):
    tp = ps.get_tensor_model_parallel_size()
    checked = []
    for name in names:
        what = f"{name} tp={tp} divisible_by={multiple}"
        dense = _dense(name, seed=17)
        model = parallelize_model(copy.deepcopy(dense), make_vocab_size_divisible_by=multiple)
        _check_equals_dense(model, dense, name, _batch(seed=18), multiple, what)
        checked.append(what)
    return checked


def _check_equals_dense(model, dense, name, batch, multiple, what):
    """Weights, loss, logits (gathered where the head is vocab-parallel), every gradient and the grad norm."""
    tp = ps.get_tensor_model_parallel_size()
    _check_weights(model, dense, what)
    dense_out, out = dense(**batch), model(**batch)
    if _vocab_parallel_head(name, dense):
        _close(out.logits, dense_out.logits, f"{what} logits (full by default)")
        with vocab_parallel_logits(model):
            out = model(**batch)
        padded = out.logits.shape[-1] * tp
        assert padded % (multiple * tp) == 0 and padded > VOCAB, f"{what}: the head's logits are not vocab-parallel"
        logits = gather_vocab_logits(out.logits, VOCAB)
    else:
        logits = out.logits
    _close(out.loss, dense_out.loss, f"{what} loss")
    _close(logits, dense_out.logits, f"{what} logits")
    dense_out.loss.backward()
    out.loss.backward()
    _check_grads(model, dense, what)
    _close(get_grad_norm(list(model.parameters())), torch.tensor(_dense_grad_norm(dense)), f"{what} grad norm")


def test_models_sharded_from_hf_tp_plan_equal_dense(worlds):
    assert "GraniteForCausalLM" in WITH_PLAN  # every supported release has Granite's plan
    results = worlds(2).run(case_tp_plan_models_equal_dense, tensor_model_parallel_size=2, names=WITH_PLAN,
                            multiple=8)
    assert all(len(r) == len(WITH_PLAN) for r in results)


def test_unknown_hf_styles_and_sequence_parallel_are_refused():
    from nxdtp.models import hf_tp_plan

    with ps.simulated_topology(world_size=2, rank=0, tensor_model_parallel_size=2):
        model = _dense("Olmo2ForCausalLM", seed=1)
        model.config.base_model_tp_plan = {"layers.*.self_attn.q_proj": "local_colwise"}
        with pytest.raises(ValueError, match=r"Olmo2ForCausalLM's tp_plan gives 'model.layers.\*.self_attn.q_proj' "
                                             r"the style 'local_colwise', which nxdtp does not map"):
            parallelize_model(model)
        with pytest.raises(ValueError, match="sequence_parallel=True needs a hand-written plan"):
            parallelize_model(_dense("GraniteForCausalLM", seed=1), sequence_parallel=True)
        if "Gemma2ForCausalLM" in WITH_PLAN:
            plan = hf_tp_plan.tp_plan(_dense("Gemma2ForCausalLM", seed=1))
            assert plan.styles["model.layers.*.self_attn.q_proj"] == ColumnParallel()


# ---- checkpoints of a model sharded from HF's tp_plan ----------------------------------------------------------------

def granite_model(seed):
    return _dense("GraniteForCausalLM", seed, num_key_value_heads=4)  # KV heads tp=4 divides


def checkpoint_batch():
    return _batch(seed=19)


def test_save_merge_from_pretrained_and_reshard_resume(worlds, tmp_path):
    check_checkpoint_round_trip(worlds, tmp_path, "tests.test_models_hf_tp_plan:granite_model",
                                "tests.test_models_hf_tp_plan:checkpoint_batch", VOCAB, "AutoModelForCausalLM",
                                "GraniteForCausalLM")


# ---- head counts HF's plan cannot split: KV heads repeated, zero heads -----------------------------------------------

HEAD_CASES = [  # (name, config overrides, what tp=4 needs)
    ("GraniteForCausalLM", dict(num_key_value_heads=2), "each KV head twice"),
    # Zero heads for every supported transformers (Granite has a plan in each), and for Gemma2 where it has one.
    ("GraniteForCausalLM", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2),
     "KV heads twice, query groups padded from 3 to 4"),
    ("Gemma2ForCausalLM", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=8),
     "KV heads twice, query groups padded from 3 to 4"),
]
HEAD_CASES = [case for case in HEAD_CASES if case[0] in WITH_PLAN]


def case_tp_plan_head_counts_equal_dense():
    tp = ps.get_tensor_model_parallel_size()
    checked = []
    for name, overrides, needs in HEAD_CASES:
        what = f"{name} tp={tp} ({needs})"
        dense = _dense(name, seed=23, **overrides)
        model = parallelize_model(copy.deepcopy(dense))
        attention = model.model.layers[0].self_attn
        assert getattr(attention.k_proj.weight, "num_replicas", 1) == 2, f"{what}: KV heads not repeated"
        _check_equals_dense(model, dense, name, _batch(seed=24), 1, what)
        checked.append(what)
    name, overrides, _ = HEAD_CASES[-1]   # zero heads needed
    with pytest.raises(ValueError, match=rf"{name} num_attention_heads=6 \(num_key_value_heads=2\) is not "
                                         r"divisible by tensor_model_parallel_size=4; .*pad_heads=True"):
        parallelize_model(_dense(name, seed=1, **overrides), pad_heads=False)
    return checked


def test_tp_plan_models_get_kv_copies_and_zero_heads(worlds):
    results = worlds(4).run(case_tp_plan_head_counts_equal_dense, tensor_model_parallel_size=4)
    assert all(len(r) == len(HEAD_CASES) for r in results)


def granite_kv2_model(seed):
    return _dense("GraniteForCausalLM", seed, num_key_value_heads=2)  # tp=2 splits the KV heads, tp=4 repeats them


def test_kv_heads_repeated_after_resharding_a_tp_plan_model(worlds, tmp_path):
    check_checkpoint_round_trip(worlds, tmp_path, "tests.test_models_hf_tp_plan:granite_kv2_model",
                                "tests.test_models_hf_tp_plan:checkpoint_batch", VOCAB, "AutoModelForCausalLM",
                                "GraniteForCausalLM")

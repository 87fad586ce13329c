"""RoBERTa through ``nxdtp.models.parallelize_model``, against the dense HF model on real gloo ranks.

RobertaForMaskedLM (tied decoder weight and bias, an odd vocabulary padded for TP, RoBERTa's padding-offset position
ids) and RobertaForSequenceClassification, at tp=2 and tp=4, with and without sequence parallelism: loss, gathered
logits, every gradient slice and the grad norm equal dense, every parameter randomised first. Then the checkpoint
path: save at tp=2, merge, plain ``from_pretrained``, ``from_pretrained_sharded`` and a resharded resume at tp=4.
fp32, tolerance 1e-5.
"""

from __future__ import annotations

import copy

import pytest
import torch

from nxdtp import parallel_state as ps
from nxdtp.grads import allreduce_sequence_parallel_gradients, get_grad_norm
from nxdtp.models import gather_vocab_logits, parallelize_model
from tests.model_helpers import check_checkpoint_round_trip, randomised
from tests.test_models_bert import _check_grads, _check_weights, _close, _dense_grad_norm

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, PAD = 97, 8, 2, 1


def _config(dropout=0.0, hidden_size=32, heads=4):
    return transformers.RobertaConfig(vocab_size=VOCAB, hidden_size=hidden_size, num_attention_heads=heads,
                                      intermediate_size=64,
                                      num_hidden_layers=2, max_position_embeddings=SEQ + PAD + 1, type_vocab_size=1,
                                      hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                                      pad_token_id=PAD, num_labels=3)


def _dense(model_class, seed, **config):
    torch.manual_seed(seed)
    return randomised(model_class(_config(**config)), seed + 1)


def _batch(seed, classification=False):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(PAD + 1, VOCAB, (BATCH, SEQ), generator=g)
    input_ids[0, 2] = VOCAB - 1
    input_ids[1, -2:] = PAD           # padding: no position, no attention, no label
    attention_mask = (input_ids != PAD).long()
    if classification:
        labels = torch.randint(0, 3, (BATCH,), generator=g)
    else:
        labels = torch.full((BATCH, SEQ), -100)
        labels[:, 1::3] = input_ids[:, 1::3]
        labels[0, 2] = VOCAB - 1
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def case_roberta_equals_dense(sequence_parallel: bool, multiple: int, heads: int = 4):
    tp = ps.get_tensor_model_parallel_size()
    checked = []
    for name in ("RobertaForMaskedLM", "RobertaForSequenceClassification"):
        what = f"{name} heads={heads} tp={tp} sp={sequence_parallel} divisible_by={multiple}"
        classification = name.endswith("Classification")
        dense = _dense(getattr(transformers, name), seed=3, hidden_size=8 * heads, heads=heads)
        model = parallelize_model(copy.deepcopy(dense), sequence_parallel=sequence_parallel,
                                  make_vocab_size_divisible_by=multiple)
        _check_weights(model, dense, what)
        batch = _batch(seed=4, classification=classification)
        dense_out, out = dense(**batch), model(**batch)
        _close(out.loss, dense_out.loss, f"{what} loss")
        logits = out.logits if classification else gather_vocab_logits(out.logits, VOCAB)
        _close(logits, dense_out.logits, f"{what} logits")
        if not classification:
            assert model.lm_head.decoder.weight is model.roberta.embeddings.word_embeddings.weight, what
            assert model.lm_head.decoder.bias is model.lm_head.bias, what
        dense_out.loss.backward()
        out.loss.backward()
        if sequence_parallel:
            allreduce_sequence_parallel_gradients(model.parameters())
        _check_grads(model, dense, what)
        _close(get_grad_norm(list(model.parameters())), torch.tensor(_dense_grad_norm(dense)), f"{what} grad norm")
        checked.append(what)
    return checked


@pytest.mark.parametrize("world,tp,sp", [pytest.param(2, 2, False, id="tp2"), pytest.param(4, 4, False, id="tp4"),
                                         pytest.param(2, 2, True, id="tp2-sp")])
def test_roberta_equals_dense(worlds, world, tp, sp):
    results = worlds(world).run(case_roberta_equals_dense, tensor_model_parallel_size=tp, sequence_parallel=sp,
                                multiple=8 if sp else 1)
    assert all(len(r) == 2 for r in results)


def test_heads_tp_does_not_divide_get_zero_heads(worlds):
    # 6 heads at tp=4: 2 zero heads after the real ones.
    results = worlds(4).run(case_roberta_equals_dense, tensor_model_parallel_size=4, sequence_parallel=True,
                            multiple=1, heads=6)
    assert all(len(r) == 2 for r in results)


# ---- checkpoints -----------------------------------------------------------------------------------------------------

def masked_lm(seed):
    return _dense(transformers.RobertaForMaskedLM, seed)


def checkpoint_batch():
    return _batch(seed=6)


def test_save_merge_from_pretrained_and_reshard_resume(worlds, tmp_path):
    check_checkpoint_round_trip(worlds, tmp_path, "tests.test_models_roberta:masked_lm",
                                "tests.test_models_roberta:checkpoint_batch", VOCAB, "AutoModelForMaskedLM",
                                "RobertaForMaskedLM")

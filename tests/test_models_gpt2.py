"""GPT-2 through ``nxdtp.models.parallelize_model``, against the dense HF model on real gloo ranks.

GPT2LMHeadModel and GPT2Model at tp=2 and tp=4: HF's Conv1D weights (``[in, out]``) stay in that layout, the fused
``c_attn`` is split with stride 3, the LM head is vocab-parallel, tied to ``wte``, over an odd padded vocabulary. Loss,
gathered logits, every gradient slice (cut from the dense Conv1D gradients) and the grad norm equal dense, every
parameter randomised first. With dropout on, the replicated activations stay identical across TP ranks (the residual
dropout draws one mask) while attention dropout differs per rank. Then save at tp=2, merge, plain ``from_pretrained``,
``from_pretrained_sharded`` and a resharded resume at tp=4. fp32, tolerance 1e-5.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from nxdtp import comm
from nxdtp import parallel_state as ps
from nxdtp.grads import allreduce_sequence_parallel_gradients, get_grad_norm
from nxdtp.models import gather_vocab_logits, parallelize_model
from nxdtp.random import model_parallel_xla_manual_seed
from tests.model_helpers import check_checkpoint_round_trip, randomised
from tests.test_models_bert import _check_grads, _check_weights, _close, _dense_grad_norm

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 99, 8, 2


def _config(dropout=0.0, heads=4):
    return transformers.GPT2Config(vocab_size=VOCAB, n_embd=8 * heads, n_head=heads, n_layer=2, n_positions=16,
                                   resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)


def _dense(model_class, seed, dropout=0.0, heads=4):
    torch.manual_seed(seed)
    return randomised(model_class(_config(dropout, heads)), seed + 1)


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    input_ids[0, 2] = VOCAB - 1
    attention_mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    attention_mask[1, -2:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def case_gpt2_equals_dense(multiple: int, sequence_parallel: bool = False, heads: int = 4):
    tp = ps.get_tensor_model_parallel_size()
    checked = []
    for name in ("GPT2LMHeadModel", "GPT2Model"):
        what = f"{name} heads={heads} tp={tp} divisible_by={multiple} sp={sequence_parallel}"
        dense = _dense(getattr(transformers, name), seed=11, heads=heads)
        model = parallelize_model(copy.deepcopy(dense), make_vocab_size_divisible_by=multiple,
                                  sequence_parallel=sequence_parallel)
        _check_weights(model, dense, what)
        batch = _batch(seed=12)
        if name == "GPT2LMHeadModel":
            assert model.lm_head.weight is model.transformer.wte.weight, what
            dense_out, out = dense(**batch), model(**batch)
            _close(out.loss, dense_out.loss, f"{what} loss")
            _close(gather_vocab_logits(out.logits, VOCAB), dense_out.logits, f"{what} gathered logits")
            dense_loss, loss = dense_out.loss, out.loss
        else:
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            dense_out, out = dense(**inputs), model(**inputs)
            _close(out.last_hidden_state, dense_out.last_hidden_state, f"{what} hidden states")
            upstream = torch.randn(dense_out.last_hidden_state.shape, generator=torch.Generator().manual_seed(13))
            dense_loss = (dense_out.last_hidden_state * upstream).mean()
            loss = (out.last_hidden_state * upstream).mean()
        dense_loss.backward()
        loss.backward()
        marked = [n for n, p in model.named_parameters() if getattr(p, "sequence_parallel_enabled", False)]
        # Under SP: the LayerNorms (ln_1, ln_2 per block, ln_f) and the row-parallel biases, added on sequence shards.
        expected = [n for n, _ in dense.named_parameters() if re.search(r"(ln_\w+\.(weight|bias)|c_proj\.bias)$", n)]
        assert sorted(marked) == (sorted(expected) if sequence_parallel else []), (what, marked)
        allreduce_sequence_parallel_gradients(model.parameters())
        _check_grads(model, dense, what)
        _close(get_grad_norm(list(model.parameters())), torch.tensor(_dense_grad_norm(dense)), f"{what} grad norm")
        checked.append(what)
    return checked


@pytest.mark.parametrize("world,tp,multiple,sp,heads", [pytest.param(2, 2, 1, False, 4, id="tp2"),
                                                        pytest.param(4, 4, 8, False, 4, id="tp4-padded"),
                                                        pytest.param(2, 2, 1, True, 4, id="tp2-sp"),
                                                        pytest.param(4, 4, 1, True, 6, id="tp4-sp-zero-heads")])
def test_gpt2_equals_dense(worlds, world, tp, multiple, sp, heads):
    # The last case: 6 heads at tp=4, so Q, K and V each get 2 zero heads inside the fused c_attn.
    results = worlds(world).run(case_gpt2_equals_dense, tensor_model_parallel_size=tp, multiple=multiple,
                                sequence_parallel=sp, heads=heads)
    assert all(len(r) == 2 for r in results)


def case_dropout_masks():
    """With dropout on: the block outputs (replicated activations) agree on the TP ranks; the attention output of one
    rank's heads would differ if its dropout masks were shared (checked through a run without the fork)."""
    model = parallelize_model(_dense(transformers.GPT2Model, seed=21, dropout=0.3))
    model.train()
    model_parallel_xla_manual_seed(5)
    batch = _batch(seed=22)
    hidden = model(input_ids=batch["input_ids"]).last_hidden_state.detach()
    gathered = comm.all_gather(hidden.unsqueeze(0), ps.tensor_parallel_group(), dim=0)
    replicated_agree = all(torch.equal(gathered[0], g) for g in gathered)
    with torch.no_grad():
        model.eval()
        eval_hidden = model(input_ids=batch["input_ids"]).last_hidden_state
    return dict(replicated_agree=replicated_agree, dropout_acted=not torch.allclose(hidden, eval_hidden))


def test_dropout_keeps_replicated_activations_identical(worlds):
    for result in worlds(2).run(case_dropout_masks, tensor_model_parallel_size=2):
        assert result == dict(replicated_agree=True, dropout_acted=True), result


# ---- checkpoints -----------------------------------------------------------------------------------------------------

def lm_head_model(seed):
    return _dense(transformers.GPT2LMHeadModel, seed)


def six_heads_lm_head_model(seed):
    return _dense(transformers.GPT2LMHeadModel, seed, heads=6)


def checkpoint_batch():
    return _batch(seed=32)


def test_save_merge_from_pretrained_and_reshard_resume(worlds, tmp_path):
    check_checkpoint_round_trip(worlds, tmp_path, "tests.test_models_gpt2:lm_head_model",
                                "tests.test_models_gpt2:checkpoint_batch", VOCAB, "AutoModelForCausalLM",
                                "GPT2LMHeadModel")
    # The merged file is in Conv1D layout, as HF writes GPT-2.
    from safetensors import safe_open

    with safe_open(str(tmp_path / "merged" / "model.safetensors"), "pt") as f:
        assert tuple(f.get_slice("transformer.h.0.attn.c_attn.weight").get_shape()) == (32, 96)


def test_zero_heads_in_the_fused_projection_round_trip(worlds, tmp_path):
    # 6 heads: split evenly at tp=2, zero heads in each of Q, K, V after resharding to tp=4; merging strips them.
    check_checkpoint_round_trip(worlds, tmp_path, "tests.test_models_gpt2:six_heads_lm_head_model",
                                "tests.test_models_gpt2:checkpoint_batch", VOCAB, "AutoModelForCausalLM",
                                "GPT2LMHeadModel")

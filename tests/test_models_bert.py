"""``parallelize_bert`` against dense Hugging Face BERT, on real gloo ranks.

Every multi-rank case (``case_*``) builds the dense HF model on every rank from one seed, randomises *every* parameter
(a fresh HF model has all-zero biases and all-one LayerNorms, which would hide bias and LayerNorm bugs), deep-copies it
and shards the copy with ``parallelize_bert``. The untouched dense model is the reference: loss, MLM/NSP losses, logits
and the gradient of every parameter (each rank compares its shard with its slice of the dense gradient; padded vocab
rows must have zero gradient). Expected shards are cut by ``_slice`` here, written independently of the library's
``shard_of``, from the parameter's NxD attributes (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``)
and its layer's spec (the padded full shape).

Covered: BertForPreTraining at tp=2 and tp=4 with and without sequence parallelism and with vocab padding (odd vocab,
``make_vocab_size_divisible_by=8``); tp=2 x dp=2 with uneven masked-token counts per DP rank (global-count denominators,
DP all-reduce, grad norm and one AdamW step equal the dense step on the whole batch); dropout (replicated parameters
stay bit-identical across TP ranks over AdamW steps; attention dropout and sequence-parallel hidden dropout masks differ
across TP ranks, replicated hidden dropout masks agree); BertForMaskedLM, BertModel, BertForSequenceClassification; HF's
output layout (``outputs[0]`` is the loss, ``return_dict=False``); argument errors; the per-rank parameter count of
BERT-large at tp=8 on meta.

Tolerance: fp32 1e-5 absolute and relative for everything (values, losses, every gradient, the grad norm, parameters
after AdamW). The worst differences measured are ~3e-6 (BertModel gradients under a random upstream, sums of hundreds of
products whose order TP changes) and ~2e-6 after the AdamW step. One exception, explained where it is made: the AdamW
step of elements whose gradient is at rounding-noise level (below 1e-7: the attention key biases, whose gradient is
zero in exact arithmetic, and a few elements by chance), which Adam turns into steps of arbitrary size.

Under transformers releases without a feature (BERT's SDPA attention in 4.26) the tests that need it are skipped, with
the reason.
"""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nxdtp import parallel_state as ps
from nxdtp.grads import allreduce_sequence_parallel_gradients, bucket_allreduce_gradients, get_grad_norm
from nxdtp.layers import ColumnParallelLinear, LayerNorm, ParallelEmbedding, RowParallelLinear
from nxdtp.models import vocab_parallel_logits
from nxdtp.models.bert import gather_vocab_logits, parallelize_bert
from nxdtp.random import get_xla_rng_tracker, model_parallel_xla_manual_seed
from nxdtp.spec import ShardedModule

transformers = pytest.importorskip("transformers")
from transformers import BertConfig, BertForMaskedLM, BertForPreTraining, BertForSequenceClassification, BertModel  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)
ADAM = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

SEQ = 16  # divisible by tp=2 and tp=4, so sequence parallelism can split it
BATCH = 2


# ---- helpers (they run inside the workers) ---------------------------------------------------------------------------

def _tp():
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_size()


def _config(vocab_size=128, dropout=0.0, **overrides) -> BertConfig:
    kwargs = dict(vocab_size=vocab_size, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                  num_hidden_layers=2, max_position_embeddings=32, type_vocab_size=2,
                  hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    kwargs.update(overrides)
    return BertConfig(**kwargs)


def _dense(model_class, config, seed: int = 0):
    """The dense reference, identical on every rank: HF init under ``seed``, then 0.1 * N(0, 1) added to every parameter
    (biases and LayerNorms included). Tied parameters are one object and get one draw."""
    torch.manual_seed(seed)
    model = model_class(config)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _pair(model_class, config, seed=0, **parallel_kwargs):
    dense = _dense(model_class, config, seed)
    model = parallelize_bert(copy.deepcopy(dense), **parallel_kwargs)
    return dense, model


def _batch(config, batch=BATCH, seq=SEQ, seed=0, masked_per_sequence=None, pad_tail=True):
    """Inputs that exercise the awkward cases: the pad id 0, ids and labels in the last (padded) vocab shard, both token
    types, and (``pad_tail``) attention padding at the end of the first sequence."""
    g = torch.Generator().manual_seed(seed)
    v = config.vocab_size
    input_ids = torch.randint(0, v, (batch, seq), generator=g)
    input_ids[:, 1] = 0  # pad_token_id: its embedding row gets no gradient
    input_ids[:, 2] = v - 1  # the last real id lives next to the vocab padding
    token_type_ids = torch.randint(0, 2, (batch, seq), generator=g)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    if pad_tail:
        attention_mask[0, -3:] = 0
    masked = masked_per_sequence or [3 + i for i in range(batch)]
    labels = torch.full((batch, seq), -100, dtype=torch.long)
    for b, count in enumerate(masked):
        positions = torch.randperm(seq, generator=g)[:count]
        labels[b, positions] = torch.randint(0, v, (count,), generator=g)
    labels[0, 0] = v - 1  # a target in the last shard
    next_sentence_label = torch.randint(0, 2, (batch,), generator=g)
    return dict(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask, labels=labels,
                next_sentence_label=next_sentence_label)


def _without(batch, *keys):
    return {k: v for k, v in batch.items() if k not in keys}


def _slice(full: torch.Tensor, dim: int, rank: int, tp: int, stride: int = 1) -> torch.Tensor:
    """Reference shard, independent of nxdtp.layers.shard_of: ``stride`` blocks along ``dim``, the rank's 1/tp of
    each."""
    blocks = full.chunk(stride, dim=dim) if stride > 1 else (full,)
    return torch.cat([block.chunk(tp, dim=dim)[rank] for block in blocks], dim=dim)


def _specs(model: nn.Module):
    """id(parameter) -> its layer's ParamSpec."""
    return {id(getattr(m, n)): spec for m in model.modules() if isinstance(m, ShardedModule)
            for n, spec in m.param_specs().items() if getattr(m, n, None) is not None}


def _expected_local(dense_tensor: torch.Tensor, param: torch.Tensor, spec, what: str) -> torch.Tensor:
    """This rank's part of a dense tensor (weight, gradient or Adam state), laid out like ``param``: the dense tensor is
    zero-padded to the spec's full shape (padded vocab rows), then cut by the parameter's NxD attributes."""
    rank, tp = _tp()
    if not getattr(param, "tensor_model_parallel", False):
        assert spec is None or not spec.is_sharded, f"{what}: spec says sharded, attributes say replicated"
        return dense_tensor
    assert spec is not None and spec.is_sharded, f"{what}: sharded parameter without a sharded spec"
    assert (param.partition_dim, param.partition_stride) == (spec.partition_dim, spec.stride), what
    assert tuple(dense_tensor.shape) == tuple(spec.unpadded_shape), (
        f"{what}: dense shape {tuple(dense_tensor.shape)} != spec real shape {spec.unpadded_shape}")
    if spec.replicas > 1:
        # Replicated blocks (KV heads): the full tensor repeats each block of `replica_block` rows `replicas` times.
        rows = dense_tensor.reshape((-1, spec.replica_block) + tuple(dense_tensor.shape[1:]))
        full = rows.repeat_interleave(spec.replicas, dim=0).reshape(spec.full_shape)
    elif spec.pad_groups > 1:
        # Grouped zero heads (grouped-query attention): each of the groups along the partition dim gets its own zero
        # rows at its end.
        dim = spec.partition_dim
        pad = list(dense_tensor.shape)
        pad[dim] = (spec.full_shape[dim] - dense_tensor.shape[dim]) // spec.pad_groups
        groups = dense_tensor.chunk(spec.pad_groups, dim=dim)
        full = torch.cat([part for group in groups for part in (group, dense_tensor.new_zeros(pad))], dim=dim)
    else:
        full = dense_tensor.new_zeros(spec.full_shape)
        full[tuple(slice(0, s) for s in dense_tensor.shape)] = dense_tensor
    return _slice(full, param.partition_dim, rank, tp, param.partition_stride)


def _named(model):
    return list(model.named_parameters())  # tied parameters once, under their first name


def _check_tensors(model, dense, get, tol, what, skip=()):
    """Compare ``get(param)`` of every parameter with the matching slice of ``get(dense_param)``."""
    specs = _specs(model)
    names, dense_names = [n for n, _ in _named(model)], [n for n, _ in _named(dense)]
    assert names == dense_names, f"{what}: parameter names differ:\n{names}\n{dense_names}"
    for name, param in _named(model):
        if name in skip:
            continue
        dense_param = dense.get_parameter(name)
        actual, reference = get(param), get(dense_param)
        assert actual is not None and reference is not None, f"{what} {name}: missing ({actual is None=})"
        expected = _expected_local(reference.detach(), param, specs.get(id(param)), f"{what} {name}")
        torch.testing.assert_close(actual.detach(), expected, **tol, msg=lambda m: f"{what} {name}: {m}")


def _check_grads(model, dense, what, tol=TOL):
    _check_tensors(model, dense, lambda p: p.grad, tol, f"{what} grad")


def _check_weights(model, dense, what, tol=TOL):
    _check_tensors(model, dense, lambda p: p, tol, f"{what} weight")


def _close(actual, expected, what, tol=TOL):
    torch.testing.assert_close(actual.detach(), expected.detach(), **tol, msg=lambda m: f"{what}: {m}")


def _dense_grad_norm(dense) -> float:
    grads = [p.grad for p in dense.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()


def _sp_marked(model):
    return sorted(n for n, p in model.named_parameters() if getattr(p, "sequence_parallel_enabled", False))


def _expected_sp_marked(config):
    names = []
    for i in range(config.num_hidden_layers):
        prefix = f"bert.encoder.layer.{i}."
        names += [prefix + s for s in ("attention.output.dense.bias", "attention.output.LayerNorm.weight",
                                       "attention.output.LayerNorm.bias", "output.dense.bias",
                                       "output.LayerNorm.weight", "output.LayerNorm.bias")]
    return sorted(names)


def _check_structure(model, config, sp, what):
    """Layers were converted as the plan says; ties hold; the vocab padding is what was asked for."""
    rank, tp = _tp()
    bert = model.bert
    emb = bert.embeddings.word_embeddings
    assert isinstance(emb, ParallelEmbedding), what
    for layer in bert.encoder.layer:
        for col in (layer.attention.self.query, layer.attention.self.key, layer.attention.self.value,
                    layer.intermediate.dense):
            assert isinstance(col, ColumnParallelLinear) and col.sequence_parallel_enabled == sp, what
        for row in (layer.attention.output.dense, layer.output.dense):
            assert isinstance(row, RowParallelLinear) and row.sequence_parallel_enabled == sp, what
        assert layer.attention.self.num_attention_heads == config.num_attention_heads // tp, what
        assert isinstance(layer.output.LayerNorm, LayerNorm) == sp, what
    assert type(bert.pooler.dense) is nn.Linear if bert.pooler is not None else True, what
    predictions = model.cls.predictions
    assert isinstance(predictions.decoder, ColumnParallelLinear), what
    assert predictions.decoder.weight is emb.weight, f"{what}: decoder weight is not the embedding parameter"
    assert predictions.bias is predictions.decoder.bias, f"{what}: cls.predictions.bias is not decoder.bias"
    assert emb.padded_num_embeddings == predictions.decoder.output_size, what
    return emb.padded_num_embeddings


def _padded(vocab, multiple, tp):
    step = multiple * tp
    return -(-vocab // step) * step


def _check_hf_output_layout(model, dense, batch, out, dense_out, mlm_logits_of, what):
    """HF's positional access works as on the dense model: ``outputs[0]`` is the loss, HF's keys come first in HF's
    order (nxdtp's mlm_loss / nsp_loss after them), and ``return_dict=False`` gives HF's tuple."""
    keys = list(out.keys())
    assert keys[:len(dense_out)] == list(dense_out.keys()), f"{what}: output keys {keys} vs {list(dense_out.keys())}"
    assert set(keys[len(dense_out):]) <= {"mlm_loss", "nsp_loss"}, f"{what}: output keys {keys}"
    _close(out[0], dense_out[0], f"{what} outputs[0]")
    with torch.no_grad():
        as_tuple, dense_tuple = model(**batch, return_dict=False), dense(**batch, return_dict=False)
    assert isinstance(as_tuple, tuple) and len(as_tuple) == len(dense_tuple), f"{what}: return_dict=False gave " \
        f"{type(as_tuple).__name__} of {len(as_tuple) if isinstance(as_tuple, tuple) else '?'}"
    vocab = dense.config.vocab_size
    for i, (a, d) in enumerate(zip(as_tuple, dense_tuple)):
        if a is mlm_logits_of(as_tuple):
            a = gather_vocab_logits(a, vocab)
        _close(a, d, f"{what} return_dict=False [{i}]")


def _dense_pretraining_losses(dense_out, batch, vocab_size):
    mlm = F.cross_entropy(dense_out.prediction_logits.reshape(-1, vocab_size), batch["labels"].reshape(-1))
    nsp = F.cross_entropy(dense_out.seq_relationship_logits.reshape(-1, 2), batch["next_sentence_label"].reshape(-1))
    return mlm, nsp


# ---- 1-3. BertForPreTraining: plain, vocab-padded, sequence-parallel -------------------------------------------------

# (vocab_size, make_vocab_size_divisible_by, sequence_parallel)
PRETRAINING_CONFIGS = [
    (128, 1, False),    # no padding at tp=2 and tp=4
    (1021, 8, False),   # odd vocab, padded to a multiple of 8 * tp
    (1021, 1, True),    # odd vocab with sequence parallelism
    (97, 8, True),      # at tp=4: 128 rows, the last shard holds 1 real row and 31 padded ones
]


def case_pretraining(configs):
    rank, tp = _tp()
    report = []
    for vocab, multiple, sp in configs:
        what = f"BertForPreTraining(vocab={vocab}, divisible_by={multiple}, sp={sp}, tp={tp})"
        config = _config(vocab)
        dense, model = _pair(BertForPreTraining, config, seed=vocab, sequence_parallel=sp,
                             make_vocab_size_divisible_by=multiple)
        padded = _check_structure(model, config, sp, what)
        assert padded == _padded(vocab, multiple, tp), f"{what}: padded vocab {padded}"
        _check_weights(model, dense, what)
        marked = _sp_marked(model)
        assert marked == (_expected_sp_marked(config) if sp else []), f"{what}: SP-marked params {marked}"

        batch = _batch(config, seed=vocab + 1)
        dense_out = dense(**batch)
        with vocab_parallel_logits(model):   # the shards, to see the padding; by default they come gathered
            out = model(**batch)
        _close(model(**batch).prediction_logits, dense_out.prediction_logits, f"{what} MLM logits (full by default)")
        mlm, nsp = _dense_pretraining_losses(dense_out, batch, vocab)
        _close(dense_out.loss, mlm + nsp, f"{what} dense self-check")
        _close(out.loss, dense_out.loss, f"{what} loss")
        _close(out["mlm_loss"], mlm, f"{what} mlm_loss")
        _close(out["nsp_loss"], nsp, f"{what} nsp_loss")
        _close(out.seq_relationship_logits, dense_out.seq_relationship_logits, f"{what} NSP logits")
        _check_hf_output_layout(model, dense, batch, out, dense_out, lambda o: o[1], what)
        # Inside vocab_parallel_logits the MLM logits are this rank's shard; gathering strips the padding.
        assert tuple(out.prediction_logits.shape) == (BATCH, SEQ, padded // tp), what
        logits = gather_vocab_logits(out.prediction_logits, vocab)
        assert tuple(logits.shape) == (BATCH, SEQ, vocab), f"{what}: gathered logits {tuple(logits.shape)}"
        _close(logits, dense_out.prediction_logits, f"{what} gathered MLM logits")
        assert torch.equal(logits.argmax(-1), dense_out.prediction_logits.argmax(-1)), f"{what}: argmax differs"
        if padded > vocab:
            # The padded columns carry logit 0 here (zero weight rows and bias), larger than many real logits: if the
            # loss did not exclude them, its softmax normaliser would differ and the loss checks above would fail.
            full = gather_vocab_logits(out.prediction_logits, padded)
            assert torch.all(full[..., vocab:] == 0), f"{what}: padded logits are not the zero rows"
            assert (logits < 0).any(), what

        dense_out.loss.backward()
        out.loss.backward()
        if sp:
            # The plan sums the SP gradients inside backward (tests/test_silent_divergence.py): whole already, and the
            # NxD call after backward must leave them as they are.
            assert all(getattr(p, "grad_allreduced_in_backward", False) for n, p in model.named_parameters()
                       if n in marked), what
            _check_grads(model, dense, f"{what} before allreduce_sequence_parallel_gradients")
            allreduce_sequence_parallel_gradients(model.parameters())
        _check_grads(model, dense, what)
        emb = model.bert.embeddings.word_embeddings
        local_rows = torch.arange(emb.vocab_start_index, emb.vocab_end_index)
        assert torch.all(emb.weight.grad[local_rows >= vocab] == 0), f"{what}: padded embedding rows got gradient"
        assert torch.all(model.cls.predictions.bias.grad[local_rows >= vocab] == 0), f"{what}: padded bias grad"
        report.append((what, padded, int((local_rows >= vocab).sum())))
    return report


@pytest.mark.parametrize("world,tp", [pytest.param(2, 2, id="tp2"), pytest.param(4, 4, id="tp4")])
def test_pretraining_equals_dense(worlds, world, tp):
    results = worlds(world).run(case_pretraining, tensor_model_parallel_size=tp, configs=PRETRAINING_CONFIGS)
    for what, padded, padded_rows in results[-1]:
        vocab = int(re.search(r"vocab=(\d+)", what).group(1))
        # The last rank holds the padding: prove the padded configurations really were padded.
        assert padded_rows == padded - vocab, (what, padded, padded_rows)
    assert any(rows > 0 for _, _, rows in results[-1])


# ---- 4. tp=2 x dp=2: global-count denominators, DP all-reduce, grad norm, AdamW --------------------------------------

def case_tp_dp():
    rank, tp = _tp()
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_size()
    assert (tp, dp) == (2, 2)
    report = []
    for vocab, multiple, sp in ((1021, 8, False), (1021, 1, True)):
        what = f"tp=2 x dp=2 (vocab={vocab}, divisible_by={multiple}, sp={sp}) dp_rank={dp_rank}"
        config = _config(vocab)
        dense, model = _pair(BertForPreTraining, config, seed=7, sequence_parallel=sp,
                             make_vocab_size_divisible_by=multiple)
        # One global batch of 4 sequences on every rank; DP rank r trains on sequences [2r, 2r + 2). The masked-token
        # counts are uneven: 1 + 2 = 3 on DP rank 0, 5 + 7 = 12 on DP rank 1.
        full = _batch(config, batch=4, seed=11, masked_per_sequence=[1, 2, 5, 7])
        full["labels"][0, 0] = -100  # keep sequence 0 at exactly 1 masked token
        counts = [int((full["labels"][2 * r:2 * r + 2] != -100).sum()) for r in range(dp)]
        assert counts == [3, 12], counts
        local = {k: v[2 * dp_rank:2 * dp_rank + 2] for k, v in full.items()}
        mlm_denominator = sum(counts)
        nsp_denominator = full["next_sentence_label"].numel()

        dense_out = dense(**full)  # HF: mean over all 15 masked tokens + mean NSP over 4 sentences
        mlm, nsp = _dense_pretraining_losses(dense_out, full, vocab)
        _close(dense_out.loss, mlm + nsp, f"{what} dense self-check")
        dense_out.loss.backward()

        def backward_and_reduce(**denominators):
            model.zero_grad(set_to_none=True)
            out = model(**local, **denominators)
            out.loss.backward()
            if sp:
                allreduce_sequence_parallel_gradients(model.parameters())
            bucket_allreduce_gradients([p.grad for p in model.parameters() if p.grad is not None])
            return out

        # Negative control: the mean of per-rank means is not the global mean when counts are uneven.
        out = backward_and_reduce()
        mean_of_means = _dp_mean(out.loss.detach())
        assert abs(mean_of_means - dense_out.loss.item()) > 1e-3, f"{what}: control loss matched ({mean_of_means})"
        specs = _specs(model)
        worst = max((p.grad - _expected_local(dense.get_parameter(n).grad, p, specs.get(id(p)), n)).abs().max().item()
                    for n, p in model.named_parameters())
        assert worst > 1e-3, f"{what}: per-rank means gave the dense gradient (max diff {worst}); the test can't fail"

        out = backward_and_reduce(mlm_denominator=mlm_denominator, nsp_denominator=nsp_denominator)
        # Each rank's loss is its share scaled by dp (the DP all-reduce averages); the DP mean is the global loss.
        _close(torch.tensor(_dp_mean(out.loss.detach())), dense_out.loss, f"{what} DP-mean loss")
        _close(torch.tensor(_dp_mean(out["mlm_loss"].detach())), mlm, f"{what} DP-mean mlm_loss")
        _close(torch.tensor(_dp_mean(out["nsp_loss"].detach())), nsp, f"{what} DP-mean nsp_loss")
        _check_grads(model, dense, what)
        norm = get_grad_norm(model.parameters())
        _close(norm, torch.tensor(_dense_grad_norm(dense)), f"{what} pre-clip grad norm")

        dense_opt = torch.optim.AdamW(dense.parameters(), **ADAM)
        opt = torch.optim.AdamW(model.parameters(), **ADAM)
        # Adam's first step is lr * g / (|g| + eps), which moves by lr * eps * dg / |g|^2 when fp32 rounding moves g by
        # dg (~1e-10 here): beyond the 1e-5 tolerance only for |g| below ~1e-7, where the step is +-lr of a size and
        # sign the rounding decides. The key bias's gradient is exactly zero in exact arithmetic (softmax over keys
        # ignores a shift q . b_k that is the same for every key), and a few other elements are that small by chance
        # (with transformers 4.26's initialisation one weight gradient here is 3e-8). Those gradients were compared
        # above (~0 on both sides); their steps are not comparable and are left out of the comparison below.
        noise = {}
        for n, p in _named(dense):
            if n.endswith("attention.self.key.bias"):
                assert p.grad.abs().max() < 1e-6, f"{what}: {n} gradient is not ~0"
                noise[n] = torch.ones_like(p.grad, dtype=torch.bool)
            else:
                # An exact zero (an unused embedding row) steps exactly.
                noise[n] = (p.grad != 0) & (p.grad.abs() < 1e-7)
        by_chance = sum(int(v.sum()) for n, v in noise.items() if not n.endswith("attention.self.key.bias"))
        total = sum(v.numel() for v in noise.values())
        assert by_chance <= 1e-3 * total, f"{what}: {by_chance} of {total} gradient elements below 1e-7"
        specs = _specs(model)
        noise_of = {id(dense.get_parameter(n)): v for n, v in noise.items()}
        noise_of.update({id(p): _expected_local(noise[n].float(), p, specs.get(id(p)), n).bool()
                         for n, p in _named(model)})
        dense_opt.step()
        opt.step()
        _check_tensors(model, dense, lambda p: p.detach().masked_fill(noise_of[id(p)], 0), TOL,
                       f"{what} after AdamW step")
        report.append((what, norm.item(), counts))
    return report


def _dp_mean(value: torch.Tensor) -> float:
    total = value.detach().clone().reshape(1)
    dist.all_reduce(total, group=ps.data_parallel_group().process_group_for(total.device.type))
    return total.item() / ps.get_data_parallel_size()


def test_tp2_dp2_global_batch_equals_dense(worlds):
    results = worlds(4).run(case_tp_dp, tensor_model_parallel_size=2)
    # The pre-clip norm is one number for the whole model: every rank agrees.
    for i in range(len(results[0])):
        norms = [r[i][1] for r in results]
        assert max(norms) - min(norms) <= 1e-5 * max(norms), norms



def case_masked_lm_num_items_in_batch():
    """BertForMaskedLM at tp=2 x dp=2 given Trainer's ``num_items_in_batch`` (the global masked-token count): each DP
    rank's loss is its sum over that count, as the decoder families' loss is; Trainer multiplies it by the DP size,
    the DP all-reduce averages, and the result is the dense loss and gradient of the whole batch. Without the count
    the loss stays this batch's mean."""
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_size()
    config = _config(1021)
    dense, model = _pair(BertForMaskedLM, config, seed=7)
    full = _batch(config, batch=4, seed=11, masked_per_sequence=[1, 2, 5, 7])
    full.pop("next_sentence_label", None)
    local = {k: v[2 * dp_rank:2 * dp_rank + 2] for k, v in full.items()}
    global_items = (full["labels"] != -100).sum()
    local_items = (local["labels"] != -100).sum()
    assert local_items != global_items / dp, "even counts per DP rank: a per-rank mean would pass too"
    dense_out = dense(**full)
    dense_out.loss.backward()
    out = model(**local, num_items_in_batch=global_items)
    (out.loss * dp).backward()
    bucket_allreduce_gradients([p.grad for p in model.parameters() if p.grad is not None])
    _close(torch.tensor(_dp_mean(out.loss.detach() * dp)), dense_out.loss, "DP-mean loss over num_items_in_batch")
    _check_grads(model, dense, "tp=2 x dp=2 num_items_in_batch")
    _close(get_grad_norm(model.parameters()), torch.tensor(_dense_grad_norm(dense)), "grad norm")
    local_mean = model(**local).loss
    _close(local_mean, local_mean.new_tensor(out.loss.item() * global_items.item() / local_items.item()),
           "without num_items_in_batch: this batch's mean")
    return dp_rank


def test_masked_lm_loss_over_num_items_in_batch_equals_dense(worlds):
    import inspect

    parameters = inspect.signature(transformers.BertForMaskedLM.forward).parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        pytest.skip(f"transformers {transformers.__version__}'s BertForMaskedLM.forward takes no **kwargs, so Trainer "
                    "passes it no num_items_in_batch")
    assert sorted(worlds(4).run(case_masked_lm_num_items_in_batch, tensor_model_parallel_size=2)) == [0, 0, 1, 1]


# ---- 5. dropout: replicated regions in lockstep, TP-sharded regions with their own masks -----------------------------

def case_dropout(attn, steps=3, seed=1234):
    rank, tp = _tp()
    out = []
    for sp in (False, True):
        what = f"dropout(attn={attn}, sp={sp}, tp={tp})"
        config = _config(128, dropout=0.1, attn_implementation=attn)
        dense, model = _pair(BertForPreTraining, config, seed=3, sequence_parallel=sp)
        # transformers 4.26 has eager attention only, and no config._attn_implementation.
        assert getattr(model.config, "_attn_implementation", "eager") == attn, what
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        model.train()
        model_parallel_xla_manual_seed(seed)
        opt = torch.optim.AdamW(model.parameters(), **ADAM)
        masks = []

        def record(module, args, output):
            # Eager attention returns the attention probabilities after dropout: a dropped entry is exactly 0
            # (softmax of these small scores is never 0, and there is no attention padding here).
            if len(output) > 1 and output[1] is not None:
                masks.append((output[1] == 0).detach().clone())

        hooks = [layer.attention.self.register_forward_hook(record) for layer in model.bert.encoder.layer]
        hidden_masks = []

        def record_hidden(name):
            def hook(module, args, output):
                # nn.Dropout zeroes dropped entries and scales the rest; inputs are never exactly 0 here.
                assert not (args[0] == 0).any(), name
                hidden_masks.append((name, tuple(args[0].shape), (output == 0).detach().numpy().copy()))
            return hook

        # The hidden-state dropouts: after the embeddings, after attention's output dense and after each layer's
        # output dense. Not the attention-probability dropout, checked through the probabilities above (its
        # nn.Dropout module runs only in transformers 4.x's eager attention; 5.x and SDPA apply its p directly).
        for name, module in model.named_modules():
            if isinstance(module, nn.Dropout) and (
                    name == "bert.embeddings.dropout" or
                    re.fullmatch(r"bert\.encoder\.layer\.\d+\.(attention\.)?output\.dropout", name)):
                hooks.append(module.register_forward_hook(record_hidden(name)))
        losses, first_logits = [], None
        for step in range(steps):
            batch = _batch(config, seed=100 + step, pad_tail=False)
            opt.zero_grad(set_to_none=True)
            # transformers 4.x returns the probabilities only when asked to; 5.x always does with eager attention.
            output = model(**batch, output_attentions=attn == "eager")
            output.loss.backward()
            if sp:
                allreduce_sequence_parallel_gradients(opt)
            opt.step()
            losses.append(output.loss.item())
            if first_logits is None:
                first_logits = output.prediction_logits.detach()
        for h in hooks:
            h.remove()
        # Dropout really ran: the first step's logits differ from the same model's on the same batch in eval mode (the
        # loss alone can come out close by chance).
        with torch.no_grad():
            eval_model = parallelize_bert(copy.deepcopy(dense), sequence_parallel=sp).eval()
            eval_logits = eval_model(**_batch(config, seed=100, pad_tail=False)).prediction_logits
        change = (eval_logits - first_logits).abs().max().item()
        assert change > 1e-2, f"{what}: dropout had no effect (logits changed by {change})"

        replicated = {n: p.detach().numpy().copy() for n, p in model.named_parameters()
                      if not getattr(p, "tensor_model_parallel", False)}
        for n in replicated:
            assert not torch.equal(model.get_parameter(n).detach(), initial[n]), f"{what}: {n} did not train"
        if attn == "eager":
            assert len(masks) == steps * config.num_hidden_layers, (what, len(masks))
            rate = torch.stack([m.float().mean() for m in masks]).mean().item()
            assert 0.03 < rate < 0.2, f"{what}: attention dropout rate {rate}"
            mask_bytes = [m.numpy().copy() for m in masks]
        else:
            assert not masks, what  # SDPA returns no probabilities; its masks are checked through the params
            mask_bytes = []
        out.append(dict(what=what, replicated=replicated, masks=mask_bytes, losses=losses, hidden=hidden_masks,
                        cpu_rng=torch.get_rng_state().numpy().copy()))
        assert "model-parallel-rng" in get_xla_rng_tracker().get_states(), what  # seeded by the call above
    return out


@pytest.mark.parametrize("attn", ["eager", pytest.param("sdpa", marks=pytest.mark.skipif(
    not getattr(transformers.BertPreTrainedModel, "_supports_sdpa", False),
    reason=f"transformers {transformers.__version__}'s BERT has no SDPA attention"))])
@pytest.mark.parametrize("world,tp", [pytest.param(2, 2, id="tp2"), pytest.param(4, 4, id="tp4")])
def test_dropout_replicas_stay_identical_and_sharded_masks_differ(worlds, world, tp, attn):
    results = worlds(world).run(case_dropout, tensor_model_parallel_size=tp, attn=attn)
    for i, first in enumerate(results[0]):
        what = first["what"]
        names = set(first["replicated"])
        for needed in ("bert.embeddings.position_embeddings.weight", "bert.embeddings.token_type_embeddings.weight",
                       "bert.embeddings.LayerNorm.weight", "bert.encoder.layer.1.output.LayerNorm.bias",
                       "bert.encoder.layer.0.attention.output.LayerNorm.weight", "bert.pooler.dense.weight",
                       "cls.seq_relationship.bias", "cls.predictions.transform.LayerNorm.weight",
                       "bert.encoder.layer.0.output.dense.bias"):
            assert needed in names, f"{what}: {needed} not replicated"
        for r in range(1, tp):
            other = results[r][i]
            assert set(other["replicated"]) == names, what
            for name in names:
                a, b = first["replicated"][name], other["replicated"][name]
                assert a.tobytes() == b.tobytes(), (
                    f"{what}: replicated {name} differs between TP ranks 0 and {r} "
                    f"(max diff {np.abs(a - b).max()})")
            assert other["losses"] == first["losses"], f"{what}: TP ranks saw different losses"
            # Replicated-region dropout draws from the default generator, identically on every rank.
            assert other["cpu_rng"].tobytes() == first["cpu_rng"].tobytes(), f"{what}: default RNG diverged"
        masks = [results[r][i]["masks"] for r in range(tp)]
        for j in range(len(masks[0])):
            for r in range(tp):
                for s in range(r + 1, tp):
                    # Without the tracker's fork every rank would draw this mask from the same default generator.
                    assert not np.array_equal(masks[r][j], masks[s][j]), (
                        f"{what}: attention dropout mask {j} identical on TP ranks {r} and {s}")
        if "eager" in what:
            assert masks[0], what
        # Hidden dropout (nn.Dropout after the embeddings and after each block): replicated activations draw the same
        # mask on every TP rank; with sequence parallelism the blocks' dropout runs on each rank's own sequence shard
        # and must draw its own mask (the embeddings' dropout runs before the split, replicated).
        sp = "sp=True" in what
        hidden = [results[r][i]["hidden"] for r in range(tp)]
        assert len(hidden[0]) == 3 * (1 + 2 * 2), (what, len(hidden[0]))  # steps x (embeddings + 2 per layer)
        for j, (name, shape, mask) in enumerate(hidden[0]):
            sharded = sp and name.startswith("bert.encoder")
            assert shape[1] == (SEQ // tp if sharded else SEQ), (what, name, shape)
            assert 0.03 < mask.mean() < 0.2, (what, name, mask.mean())
            for r in range(1, tp):
                other_name, other_shape, other = hidden[r][j]
                assert (other_name, other_shape) == (name, shape), what
                if sharded:
                    assert not np.array_equal(mask, other), f"{what}: {name} mask repeats on TP ranks 0 and {r}"
                else:
                    assert np.array_equal(mask, other), f"{what}: replicated {name} mask differs on TP rank {r}"


# ---- 6. BertForMaskedLM, BertModel, BertForSequenceClassification ----------------------------------------------------

def case_other_heads():
    rank, tp = _tp()
    for sp in (False, True):
        # BertForMaskedLM: loss and gathered logits; an odd vocab, padded.
        what = f"BertForMaskedLM(sp={sp})"
        config = _config(1021)
        dense, model = _pair(BertForMaskedLM, config, seed=21, sequence_parallel=sp, make_vocab_size_divisible_by=8)
        assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight, what
        assert model.cls.predictions.bias is model.cls.predictions.decoder.bias, what
        batch = _without(_batch(config, seed=22), "next_sentence_label")
        dense_out, out = dense(**batch), model(**batch)
        mlm = F.cross_entropy(dense_out.logits.reshape(-1, config.vocab_size), batch["labels"].reshape(-1))
        _close(dense_out.loss, mlm, f"{what} dense self-check")
        _close(out.loss, dense_out.loss, f"{what} loss")
        _close(out["mlm_loss"], mlm, f"{what} mlm_loss")
        _close(gather_vocab_logits(out.logits, config.vocab_size), dense_out.logits, f"{what} logits")
        _check_hf_output_layout(model, dense, batch, out, dense_out, lambda o: o[1], what)
        dense_out.loss.backward()
        out.loss.backward()
        if sp:
            allreduce_sequence_parallel_gradients(model.parameters())
        _check_grads(model, dense, what)
        # Without labels: no loss, logits still right.
        with torch.no_grad():
            plain = model(**_without(batch, "labels"))
        assert plain.loss is None, what
        _close(gather_vocab_logits(plain.logits, config.vocab_size), dense_out.logits, f"{what} logits (no labels)")

        # BertModel: both outputs, backward from a random upstream gradient on each.
        what = f"BertModel(sp={sp})"
        config = _config(128)
        dense, model = _pair(BertModel, config, seed=23, sequence_parallel=sp)
        batch = _without(_batch(config, seed=24), "labels", "next_sentence_label")
        dense_out, out = dense(**batch), model(**batch)
        _close(out.last_hidden_state, dense_out.last_hidden_state, f"{what} last_hidden_state")
        _close(out.pooler_output, dense_out.pooler_output, f"{what} pooler_output")
        g = torch.Generator().manual_seed(25)
        up_hidden = torch.randn(dense_out.last_hidden_state.shape, generator=g)
        up_pooled = torch.randn(dense_out.pooler_output.shape, generator=g)
        ((dense_out.last_hidden_state * up_hidden).sum() + (dense_out.pooler_output * up_pooled).sum()).backward()
        ((out.last_hidden_state * up_hidden).sum() + (out.pooler_output * up_pooled).sum()).backward()
        if sp:
            allreduce_sequence_parallel_gradients(model.parameters())
        _check_grads(model, dense, what)

        # BertForSequenceClassification: HF's own loss over the replicated classifier.
        what = f"BertForSequenceClassification(sp={sp})"
        config = _config(128, num_labels=3)
        dense, model = _pair(BertForSequenceClassification, config, seed=26, sequence_parallel=sp)
        batch = _without(_batch(config, seed=27), "labels", "next_sentence_label")
        batch["labels"] = torch.tensor([2, 0])
        dense_out, out = dense(**batch), model(**batch)
        _close(out.logits, dense_out.logits, f"{what} logits")
        _close(out.loss, F.cross_entropy(dense_out.logits, batch["labels"]), f"{what} loss")
        dense_out.loss.backward()
        out.loss.backward()
        if sp:
            allreduce_sequence_parallel_gradients(model.parameters())
        _check_grads(model, dense, what)
    return rank


def test_other_bert_heads_equal_dense(worlds):
    assert worlds(2).run(case_other_heads, tensor_model_parallel_size=2) == [0, 1]


# ---- 7. errors (single process, simulated topology: validation runs before anything is converted) --------------------

@pytest.mark.parametrize("build,error,pattern", [
    (lambda: BertModel(_config(intermediate_size=66)), ValueError,
     r"intermediate_size=66.*tensor_model_parallel_size=4"),
    (lambda: transformers.BertForTokenClassification(_config()), TypeError, r"BertForTokenClassification"),
    (lambda: transformers.BertForQuestionAnswering(_config()), TypeError, r"BertForQuestionAnswering"),
    (lambda: nn.Sequential(nn.Linear(4, 4)), TypeError, r"Sequential"),
    (lambda: BertModel(_config(is_decoder=True)), ValueError, r"is_decoder"),
    (lambda: BertForMaskedLM(_config(is_decoder=True, add_cross_attention=True)), ValueError, r"is_decoder"),
], ids=["intermediate", "token-classification", "question-answering", "not-bert", "decoder",
        "cross-attention"])
def test_unsupported_models_are_rejected_before_any_change(build, error, pattern):
    model = build()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    types_before = [type(m) for m in model.modules()]
    with ps.simulated_topology(world_size=4, rank=1, tensor_model_parallel_size=4):
        with pytest.raises(error, match=pattern):
            parallelize_bert(model)
    assert [type(m) for m in model.modules()] == types_before
    after = dict(model.named_parameters())
    assert set(after) == set(before) and all(torch.equal(after[n], before[n]) for n in before)


@pytest.mark.parametrize("version,refused", [("4.25.1", True), ("4.26.0", False), ("4.47.1", False),
                                              ("6.0.0", True)])
def test_the_transformers_range_is_per_family(monkeypatch, version, refused):
    """BERT's plan supports transformers >=4.26,<6, every other family's >=4.48,<6: the plans are refused (an
    ImportError naming the release, the family and the range) when made, before they touch a model."""
    import sys

    from nxdtp.models import bert, gpt2, hf_tp_plan, llama, roberta

    model = BertModel(_config())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # The module nxdtp imports (some transformers releases replace their sys.modules entry after the first import).
    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
    with ps.simulated_topology(world_size=2, rank=0, tensor_model_parallel_size=2):
        if refused:
            with pytest.raises(ImportError, match=rf"transformers {re.escape(version)} is not supported by nxdtp's "
                                                  r"BERT plan: supported versions are >=4\.26,<6 \(the other "
                                                  r"families': >=4\.48,<6\); pip install 'transformers>=4\.26,<6'"):
                parallelize_bert(model)
            assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        else:
            bert.bert_plan()
        for make, family in ((roberta.roberta_plan, "RoBERTa"), (gpt2.gpt2_plan, "GPT-2"),
                             (llama.decoder_plan, "Llama-family")):
            with pytest.raises(ImportError, match=rf"transformers {re.escape(version)} is not supported by nxdtp's "
                                                  rf"{family} plan: supported versions are >=4\.48,<6 \(BERT's "
                                                  r"plan: >=4\.26,<6\)"):
                make()
        with pytest.raises(ImportError, match=r"nxdtp's HF tp_plan plan: supported versions are >=4\.48,<6"):
            hf_tp_plan.tp_plan(model)


def test_zero_heads_refused_on_request_before_any_change():
    model = BertModel(_config(num_attention_heads=6, hidden_size=48))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with ps.simulated_topology(world_size=4, rank=1, tensor_model_parallel_size=4):
        with pytest.raises(ValueError, match=r"BertModel num_attention_heads=6 \(num_key_value_heads=6\) is not "
                                             r"divisible by tensor_model_parallel_size=4; .*pad_heads=True"):
            parallelize_bert(model, pad_heads=False)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def case_zero_heads_equal_dense(sequence_parallel: bool):
    """6 heads at tp=4: 2 zero heads; two SGD steps of BertForPreTraining equal dense (the zero heads stay zero)."""
    config = _config(num_attention_heads=6, hidden_size=48, intermediate_size=64)
    dense, model = _pair(BertForPreTraining, config, seed=31, sequence_parallel=sequence_parallel,
                         make_vocab_size_divisible_by=8)
    what = f"BERT 6 heads tp=4 sp={sequence_parallel}"
    assert model.bert.encoder.layer[0].attention.self.num_attention_heads == 2, what
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, dense)]
    for step in range(2):
        batch = _batch(config, seed=32 + step)
        dense_out, out = dense(**batch), model(**batch)
        _close(out.loss, dense_out.loss, f"{what} step {step} loss")
        dense_out.loss.backward()
        out.loss.backward()
        allreduce_sequence_parallel_gradients(model.parameters())
        _check_grads(model, dense, f"{what} step {step}")
        _close(get_grad_norm(list(model.parameters())), torch.tensor(_dense_grad_norm(dense)),
               f"{what} step {step} grad norm")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    _check_weights(model, dense, what)
    return what


@pytest.mark.parametrize("sp", [False, True], ids=["tp4", "tp4-sp"])
def test_heads_tp_does_not_divide_get_zero_heads(worlds, sp):
    assert len(worlds(4).run(case_zero_heads_equal_dense, tensor_model_parallel_size=4, sequence_parallel=sp)) == 4


def test_divisible_configs_pass_validation_at_tp4():
    # The control for the error cases: the same sizes made divisible convert (on meta: no gloo, no weights).
    with torch.device("meta"):
        model = BertForPreTraining(_config(num_attention_heads=8, hidden_size=32, intermediate_size=68))
    with ps.simulated_topology(world_size=4, rank=1, tensor_model_parallel_size=4):
        parallelize_bert(model, broadcast_replicated=False)
    assert model.bert.encoder.layer[0].attention.self.num_attention_heads == 2
    assert tuple(model.bert.encoder.layer[0].intermediate.dense.weight.shape) == (17, 32)


# ---- 8. BERT-large at tp=8: parameters per rank, built on meta -------------------------------------------------------

def _large_config():
    return BertConfig(vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                      intermediate_size=4096, max_position_embeddings=512)


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


def _expected_rank_count(dense: nn.Module, tp: int, vocab: int) -> int:
    """Independent bookkeeping: which dense parameters the BERT plan splits, and how."""
    padded_rows = -(-vocab // tp)
    total = 0
    for name, p in dense.named_parameters():
        if re.search(r"attention\.self\.(query|key|value)\.(weight|bias)$|intermediate\.dense\.(weight|bias)$", name):
            total += p.numel() // tp  # column-parallel: weight rows and bias split
        elif re.search(r"(attention\.output|layer\.\d+\.output)\.dense\.weight$", name):
            total += p.numel() // tp  # row-parallel: weight columns split, bias replicated
        elif name == "bert.embeddings.word_embeddings.weight":
            total += padded_rows * p.shape[1]  # vocab-parallel, padded; the tied decoder weight is this parameter
        elif name == "cls.predictions.bias":
            total += padded_rows  # decoder bias (tied to cls.predictions.bias), vocab-parallel
        else:
            total += p.numel()
    return total


def test_bert_large_tp8_parameters_per_rank(capsys):
    config = _large_config()
    with torch.device("meta"):
        dense = BertForPreTraining(config)
        model = BertForPreTraining(config)
    dense_count = _count(dense)
    with ps.simulated_topology(world_size=8, rank=3, tensor_model_parallel_size=8):
        # Every tensor is meta: the replicated-state broadcast skips meta tensors, so the default works without any
        # process group (the simulated topology has none: a real collective would raise).
        parallelize_bert(model)
    rank_count = _count(model)
    fraction = rank_count / dense_count
    with capsys.disabled():
        print(f"\nBERT-large BertForPreTraining: dense {dense_count:,} parameters; tp=8 rank 3 holds {rank_count:,} "
              f"({100 * fraction:.2f} %)")
    assert rank_count == _expected_rank_count(dense, 8, config.vocab_size)
    assert all(p.device.type == "meta" for p in model.parameters())
    emb = model.bert.embeddings.word_embeddings
    assert (emb.vocab_start_index, emb.vocab_end_index) == (3 * 3816, 4 * 3816)  # 30522 padded to 30528 = 8 * 3816
    assert model.cls.predictions.decoder.weight is emb.weight
    assert tuple(model.bert.encoder.layer[5].attention.self.query.weight.shape) == (128, 1024)
    assert tuple(model.bert.encoder.layer[5].output.dense.weight.shape) == (1024, 512)
    assert fraction <= 0.133, f"rank holds {100 * fraction:.2f} % of the dense parameters"


def test_a_bad_plan_leaves_the_model_untouched():
    import torch
    from torch import nn

    from nxdtp.parallel_state import simulated_topology
    from nxdtp.plan import ColumnParallel, Plan, parallelize, wrap_forward

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    before = [type(m) for m in model]
    with simulated_topology(world_size=2, rank=0, tensor_model_parallel_size=2):
        with pytest.raises(TypeError, match="ColumnParallel applies to Linear, but '1' is ReLU"):
            parallelize(model, Plan(styles={"0": ColumnParallel(), "1": ColumnParallel()}),
                        broadcast_replicated=False)
    assert [type(m) for m in model] == before
    wrap_forward(model[0], "nxdtp_test_wrapper", lambda forward, *a, **k: forward(*a, **k))
    with pytest.raises(ValueError, match="already used for Linear with another function"):
        wrap_forward(model[2], "nxdtp_test_wrapper", lambda forward, *a, **k: forward(*a, **k) * 2)
    assert torch.equal(model(torch.ones(1, 4)), model(torch.ones(1, 4)))
    # HF reads forward's parameter names (generate's position_ids for left padding, Trainer's dataset columns): a
    # wrapped forward shows the base forward's, not (*args, **kwargs).
    import inspect
    assert inspect.signature(model[0].forward) == inspect.signature(nn.Linear(4, 8).forward)


# ---- training helpers: attention_bias and checkpoint_layers ----------------------------------------------------------

def case_attention_bias_and_checkpoint_layers():
    """attention_bias's mask gives the 2-D mask's loss and gradients; checkpointed layers (dropout on, SP on) give the
    plain model's loss and gradients when both start from the same RNG states."""
    from nxdtp.models.bert import attention_bias, checkpoint_layers

    rank, tp = _tp()
    config = _config(vocab_size=101, dropout=0.1)
    dense = _dense(BertForPreTraining, config, seed=5)
    plain = parallelize_bert(copy.deepcopy(dense), sequence_parallel=True)
    checkpointed = checkpoint_layers(parallelize_bert(copy.deepcopy(dense), sequence_parallel=True))
    batch = _batch(config, seed=6)
    bias_batch = {**batch, "attention_mask": attention_bias(batch["attention_mask"], torch.float32)}
    mask = bias_batch["attention_mask"]
    padded = batch["attention_mask"] == 0
    if hasattr(transformers.PreTrainedModel, "get_extended_attention_mask"):
        # transformers 4 accepts 2-D and 3-D 0/1 masks only, and makes the additive mask itself.
        assert mask.shape == (BATCH, 1, SEQ) and torch.equal(mask[:, 0], batch["attention_mask"].float())
    else:
        # transformers 5 uses a 4-D mask as given: additive.
        assert mask.shape == (BATCH, 1, 1, SEQ)
        assert torch.equal(mask[:, 0, 0][padded], torch.full((int(padded.sum()),), torch.finfo(torch.float32).min))
        assert not mask[:, 0, 0][~padded].any()
    assert padded.any()  # the batch has padding, so the masks' equality below is tested

    def loss_and_grads(model, inputs):
        model_parallel_xla_manual_seed(7)
        model.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        loss.backward()
        allreduce_sequence_parallel_gradients(model.parameters())
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    reference_loss, reference_grads = loss_and_grads(plain, batch)
    for name, model, inputs in (("attention_bias", plain, bias_batch), ("checkpoint_layers", checkpointed, batch),
                                ("both", checkpointed, bias_batch)):
        loss, grads = loss_and_grads(model, inputs)
        _close(loss, reference_loss, f"{name}: loss (tp={tp})")
        for (param_name, _), g, ref in zip(plain.named_parameters(), grads, reference_grads):
            _close(g, ref, f"{name}: grad of {param_name} (tp={tp})")
    # Dropout really was on: a different seed changes the loss, so equal losses above mean equal masks.
    model_parallel_xla_manual_seed(8)
    assert not torch.allclose(plain(**batch).loss, reference_loss, **TOL)
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        attention_bias(bias_batch["attention_mask"], torch.float32)
    with pytest.raises(ValueError, match="found no transformer layer"):
        checkpoint_layers(nn.Linear(2, 2))
    return True


def case_checkpoint_layers_under_autocast():
    """bf16 autocast around the forward, backward outside it (PyTorch's recommended form) and inside it: checkpointed
    layers must give every parameter the gradient the plain model gives. The recompute runs in backward, so it must
    replay the forward's autocast state and must not reuse casts cached during the no-grad forward."""
    from nxdtp.models.bert import checkpoint_layers

    rank, tp = _tp()
    config = _config(vocab_size=101, dropout=0.1)
    dense = _dense(BertForPreTraining, config, seed=9)
    plain = parallelize_bert(copy.deepcopy(dense))
    checkpointed = checkpoint_layers(parallelize_bert(copy.deepcopy(dense)))
    batch = _batch(config, seed=10)

    def grads(model, backward_inside):
        model_parallel_xla_manual_seed(11)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        return {n: p.grad for n, p in model.named_parameters()}

    for backward_inside in (False, True):
        reference, actual = grads(plain, backward_inside), grads(checkpointed, backward_inside)
        missing = sorted(n for n, g in actual.items() if g is None and reference[n] is not None)
        assert not missing, f"tp={tp}, backward inside autocast={backward_inside}: no gradient for {missing[:3]}"
        for name, ref in reference.items():
            # The same bf16 kernels on the same inputs: equal up to fp32 accumulation order.
            _close(actual[name], ref, f"tp={tp}, backward inside autocast={backward_inside}: grad of {name}")
    return True


def test_checkpoint_layers_under_autocast_train_every_parameter(worlds):
    assert worlds(2).run(case_checkpoint_layers_under_autocast, tensor_model_parallel_size=2) == [True, True]


def test_attention_bias_and_checkpoint_layers_change_nothing(worlds):
    assert worlds(2).run(case_attention_bias_and_checkpoint_layers, tensor_model_parallel_size=2) == [True, True]


# ---- pickling: torch.save(model) / torch.load and deepcopy, as for a plain HF model ----------------------------------

def case_pickled_model_equals_original():
    """A parallelized BERT (wrapped forwards, sequence-parallel LayerNorm subclasses, checkpointed layers) survives
    torch.save(model) / torch.load and deepcopy: same classes, same outputs, same gradients; a pickled shard is
    refused under another TP layout."""
    import io
    import pickle

    from nxdtp.models import parallelize_model
    from nxdtp.models.bert import checkpoint_layers
    from nxdtp.plan import wrap_forward

    rank, tp = _tp()
    config = _config(vocab_size=101)
    batch = _batch(config, seed=3)
    for sp in (False, True):
        model = parallelize_model(_dense(BertForPreTraining, config, seed=4), sequence_parallel=sp)
        if sp:
            model = checkpoint_layers(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        copies = {"torch.load": torch.load(buffer, weights_only=False), "deepcopy": copy.deepcopy(model)}
        model.zero_grad()
        out = model(**batch)
        out.loss.backward()
        for how, other in copies.items():
            what = f"tp={tp} rank {rank} sp={sp} {how}"
            assert [type(m) for m in other.modules()] == [type(m) for m in model.modules()], what
            assert other.cls.predictions.decoder.weight is other.bert.embeddings.word_embeddings.weight, what
            other_out = other(**batch)
            other_out.loss.backward()
            _close(other_out.loss, out.loss, f"{what}: loss")
            _close(other_out.prediction_logits, out.prediction_logits, f"{what}: MLM logits")
            grads = dict(other.named_parameters())
            for name, param in model.named_parameters():
                assert param.grad is not None and grads[name].grad is not None, f"{what}: {name} has no gradient"
                _close(grads[name].grad, param.grad, f"{what}: grad of {name}")

    # A TP shard loaded under another layout is refused by name, not run with the wrong slice.
    with ps.simulated_topology(world_size=tp, rank=0, tensor_model_parallel_size=1):
        buffer.seek(0)
        with pytest.raises(RuntimeError, match=f"tensor-parallel rank {rank} of {tp}, but this process is "
                                               f"tensor-parallel rank 0 of 1"):
            torch.load(buffer, weights_only=False)

    # A local (closure) forward wrapper still deep-copies; pickling it names the wrapper.
    def local_wrapper(forward, *args, **kwargs):
        return forward(*args, **kwargs)

    layer = nn.Linear(2, 2)
    wrap_forward(layer, "test_local_wrapper", local_wrapper)
    assert type(copy.deepcopy(layer)) is type(layer)
    with pytest.raises(pickle.PicklingError, match="local_wrapper.*'test_local_wrapper'.*wrapper_factory"):
        pickle.dumps(layer)
    return True


def test_pickled_model_equals_original(worlds):
    assert worlds(2).run(case_pickled_model_equals_original, tensor_model_parallel_size=2) == [True, True]

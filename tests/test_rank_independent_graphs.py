"""One compiled graph for every rank (issue 14, item 1).

(a) The BERT example's train step (its model, the forward's input check, loss with global DP denominators, SP gradient
    all-reduces, DP all-reduce, clipping and optimizer) and the Llama and GPT-2 plans' steps are traced for every rank
    of simulated worlds with ``nxdtp.xla_graphs.trace_every_rank``, SP on and off, dropout on; every phase must hash to
    one graph. They run in the "xla-hlo" worker (graphs never executed).
(b) The data-rank primitives (a rank tensor and an index_select in place of narrow with Python bounds) equal the old
    slicing on the eager gloo path, values and gradients, at tp=2 and 4.
"""

from __future__ import annotations

import copy
import re

import pytest

pytestmark = pytest.mark.xla

SEED = 1234


# ---- helpers that run inside the XLA worker process ------------------------------------------------------------------

def _randomised(model):
    import torch

    with torch.no_grad():
        for p in model.parameters():  # biases and LayerNorms too: fresh ones hide bugs
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _bert(tp: int):
    import torch
    import transformers

    heads = max(2, tp)
    config = transformers.BertConfig(vocab_size=8 * tp * 3 + 5, hidden_size=8 * heads, num_hidden_layers=2,
                                     num_attention_heads=heads, intermediate_size=16 * heads,
                                     max_position_embeddings=32, hidden_dropout_prob=0.1,
                                     attention_probs_dropout_prob=0.1)
    torch.manual_seed(SEED)
    return _randomised(transformers.BertForPreTraining(config))


def _bert_batch(config, seq: int, batch: int):
    import torch

    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq - 3:] = 0
    labels = torch.full((batch, seq), -100)
    labels[:, 1::3] = ids[:, 1::3]
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": (torch.arange(seq) >= seq // 2).long()
            .expand(batch, seq).contiguous(), "labels": labels, "next_sentence_label": torch.arange(batch) % 2}


def _finish_step(model, loss, optimizer, sequence_parallel: bool):
    """The example's step after backward: SP and DP gradient all-reduces, clipping, the optimizer step. The forward's
    input check (its all-gather of the inputs' fingerprints, read after the step) is part of the forward's and the
    step's graphs, as a real step materialises it."""
    from nxdtp import grads
    from nxdtp.agreement import pending_input_checks
    from nxdtp.optimizer import NeuronZero1Optimizer

    if sequence_parallel:
        grads.allreduce_sequence_parallel_gradients(model)
    if isinstance(optimizer, NeuronZero1Optimizer):
        # ZeRO-1: reduce-scatter over DP, the TP x DP norm and clipping, the inner step on the master shards and the
        # all-gather into the parameters; the master shards (made with the rank as data) are part of the state.
        optimizer.step()
        norm = optimizer.grad_norm
        inner = optimizer.base_optimizer
        masters = [s for g in inner.param_groups for s in g["params"]]
    else:
        grads.allreduce_gradients(model)
        norm = grads.clip_grad_norm(model.parameters(), 1.0)
        optimizer.step()
        inner, masters = optimizer, []
    state = masters + [t for s in inner.state.values() for t in s.values() if hasattr(t, "device")
                       and t.device.type == "xla"]
    params = list(model.parameters())
    checks = pending_input_checks(model)
    assert len(checks) == 1, f"the forward left {len(checks)} input checks to read, not 1"
    return {"forward": [loss] + checks, "backward": [p.grad for p in params],
            "step": [loss, norm] + checks + params + state}


def _optimizer(kind: str, params, zero1: bool, zero1_sharding: int = 0):
    """AdamW or LAMB as the examples make them, plain or inside ZeRO-1 (clipping at 1.0, as the plain step), sharded
    over the DP groups or (``zero1_sharding`` k) over each DP group cut into groups of k: hybrid sharding."""
    import torch

    from nxdtp import parallel_state
    from nxdtp.optimizer import Lamb, NeuronZero1Optimizer

    optimizer_class, options = (Lamb, dict(lr=1e-3, trust_clip=True)) if kind == "lamb" else \
        (torch.optim.AdamW, dict(lr=1e-3))
    if zero1:
        groups = (parallel_state.dp_aligned_sharding_examples(parallel_state.get_topology())[zero1_sharding]
                  if zero1_sharding else None)
        return NeuronZero1Optimizer(params, optimizer_class, max_norm=1.0, sharding_groups=groups, **options)
    return optimizer_class(params, **options)


def case_bert_step_graphs(world_size: int, tp: int, sequence_parallel: bool, optimizer: str = "adamw",
                          keep_hlo: bool = False, zero1: bool = False, zero1_sharding: int = 0):
    import torch
    import torch_xla

    from nxdtp import comm, parallel_state
    from nxdtp.models.bert import attention_bias, parallelize_bert
    from nxdtp.random import model_parallel_xla_manual_seed
    from nxdtp.utils import move_model_to_device
    from nxdtp.xla_graphs import trace_every_rank

    device = torch_xla.device()
    dense = _bert(tp)
    seq = 4 * tp
    batch = {k: v for k, v in _bert_batch(dense.config, seq, 2).items()}

    def step():
        model = parallelize_bert(copy.deepcopy(dense), sequence_parallel=sequence_parallel,
                                 broadcast_replicated=False)
        model_parallel_xla_manual_seed(SEED)
        model = move_model_to_device(model, device).train()
        groups = [{"params": [p for n, p in model.named_parameters() if not n.endswith("bias")], "weight_decay": 0.01},
                  {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}]
        opt = _optimizer(optimizer, groups, zero1, zero1_sharding)
        on_device = {k: v.to(device) for k, v in batch.items()}
        # As the example: global counts of masked tokens and sentences over the DP group, as device tensors.
        counts = comm.all_reduce(torch.stack([(on_device["labels"] != -100).sum().float(),
                                              torch.tensor(2.0, device=device)]), parallel_state.data_parallel_group())
        out = model(input_ids=on_device["input_ids"], token_type_ids=on_device["token_type_ids"],
                    attention_mask=attention_bias(on_device["attention_mask"], torch.float32),
                    labels=on_device["labels"], next_sentence_label=on_device["next_sentence_label"],
                    mlm_denominator=counts[0], nsp_denominator=counts[1])
        out.loss.backward()
        return _finish_step(model, out.loss, opt, sequence_parallel)

    graphs = trace_every_rank(step, world_size, tp, keep_hlo=keep_hlo)
    return _report(graphs, keep_hlo)


def _report(graphs, keep_hlo):
    report = {"distinct": {p: graphs.distinct(p) for p in graphs.hashes},
              "classes": {p: graphs.rank_classes(p) for p in graphs.hashes}}
    if keep_hlo:
        report["diff"] = {p: graphs.first_difference(p) for p in graphs.hashes}
        # The step's collectives of the first traced rank: kind and replica groups.
        report["step_collectives"] = sorted(set(re.findall(r"(all-reduce|reduce-scatter|all-gather)\(.*?"
                                                           r"replica_groups=(\{[{}0-9,]*\})", graphs.hlo["step"][0])))
    return report


def _llama(tp: int):
    import torch
    import transformers

    heads = 2 * tp
    config = transformers.LlamaConfig(vocab_size=8 * tp * 3 + 5, hidden_size=8 * heads, intermediate_size=24 * tp,
                                      num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=tp,
                                      max_position_embeddings=64, attention_dropout=0.1)
    torch.manual_seed(SEED)
    return _randomised(transformers.LlamaForCausalLM(config))


def _gpt2(tp: int):
    import torch
    import transformers

    heads = 2 * tp
    config = transformers.GPT2Config(vocab_size=8 * tp * 3 + 5, n_embd=8 * heads, n_head=heads, n_layer=2,
                                     n_positions=64, attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1)
    torch.manual_seed(SEED)
    return _randomised(transformers.GPT2LMHeadModel(config))


DECODERS = {"llama": _llama, "gpt2": _gpt2}


def case_decoder_step_graphs(world_size: int, tp: int, sequence_parallel: bool, optimizer: str = "lamb",
                           keep_hlo: bool = False, family: str = "llama", zero1: bool = False,
                           zero1_sharding: int = 0):
    import torch
    import torch_xla

    from nxdtp.models import parallelize_model
    from nxdtp.random import model_parallel_xla_manual_seed
    from nxdtp.utils import move_model_to_device
    from nxdtp.xla_graphs import trace_every_rank

    device = torch_xla.device()
    dense = DECODERS[family](tp)
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, dense.config.vocab_size, (2, 4 * tp), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100

    def step():
        model = parallelize_model(copy.deepcopy(dense), sequence_parallel=sequence_parallel,
                                  broadcast_replicated=False)
        model_parallel_xla_manual_seed(SEED)
        model = move_model_to_device(model, device).train()
        opt = _optimizer(optimizer, list(model.parameters()), zero1, zero1_sharding)
        out = model(input_ids=ids.to(device), labels=labels.to(device))
        out.loss.backward()
        return _finish_step(model, out.loss, opt, sequence_parallel)

    return _report(trace_every_rank(step, world_size, tp, keep_hlo=keep_hlo), keep_hlo)


def case_token_statistics_graphs():
    """``vocab_parallel_token_statistics`` (TRL's fused head on the shards), forward and backward, with padding in the
    last shards: the rank enters as data, so every rank of a tp=4 world traces one graph."""
    import torch
    import torch_xla

    from nxdtp.loss_functions import vocab_parallel_token_statistics
    from nxdtp.xla_graphs import trace_every_rank

    device = torch_xla.device()
    g = torch.Generator().manual_seed(SEED)
    logits, target = torch.randn(3, 5, 6, generator=g), torch.randint(0, 21, (3, 5), generator=g)

    def step():
        shard = logits.to(device).requires_grad_(True)
        out = vocab_parallel_token_statistics(shard, target.to(device), vocab_size=21)   # 24 columns, 3 of padding
        (out["log_probs"].sum() + out["entropy"].sum()).backward()
        return [out[key] for key in sorted(out)] + [shard.grad]

    return _report(trace_every_rank(step, 4, 4), False)


def _assert_one_graph(result):
    distinct = result["distinct"]
    assert all(n == 1 for n in distinct.values()), f"distinct graphs per phase {distinct}, ranks per graph " \
                                                    f"{result['classes']['step']}"


# ---- (a) one graph for every rank ------------------------------------------------------------------------------------

@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["no_sp", "sp"])
@pytest.mark.parametrize("world_size,tp,optimizer", [(4, 2, "adamw"), (4, 4, "lamb"), (8, 8, "adamw")],
                         ids=["tp2xdp2", "tp4", "tp8"])
def test_bert_example_step_is_one_graph_for_every_rank(worlds, world_size, tp, optimizer, sequence_parallel):
    result, = worlds(1, "xla-hlo").run(case_bert_step_graphs, tensor_model_parallel_size=None, world_size=world_size,
                                       tp=tp, sequence_parallel=sequence_parallel, optimizer=optimizer)
    _assert_one_graph(result)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["no_sp", "sp"])
@pytest.mark.parametrize("world_size,tp,optimizer", [(4, 2, "lamb"), (4, 4, "adamw"), (8, 8, "lamb")],
                         ids=["tp2xdp2", "tp4", "tp8"])
def test_llama_plan_step_is_one_graph_for_every_rank(worlds, world_size, tp, optimizer, sequence_parallel):
    result, = worlds(1, "xla-hlo").run(case_decoder_step_graphs, tensor_model_parallel_size=None, world_size=world_size,
                                       tp=tp, sequence_parallel=sequence_parallel, optimizer=optimizer)
    _assert_one_graph(result)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["no_sp", "sp"])
@pytest.mark.parametrize("world_size,tp", [(4, 2), (4, 4)], ids=["tp2xdp2", "tp4"])
def test_gpt2_plan_step_is_one_graph_for_every_rank(worlds, world_size, tp, sequence_parallel):
    """The second decoder plan (GPT-2: Conv1D weights, fused c_attn, tied LM head) through the same tool."""
    result, = worlds(1, "xla-hlo").run(case_decoder_step_graphs, tensor_model_parallel_size=None, world_size=world_size,
                                       tp=tp, sequence_parallel=sequence_parallel, optimizer="adamw", family="gpt2")
    _assert_one_graph(result)


@pytest.mark.parametrize("world_size,tp,family,optimizer,sequence_parallel",
                         [(4, 2, "bert", "adamw", False), (8, 4, "bert", "lamb", True),
                          (4, 2, "llama", "lamb", True), (8, 4, "llama", "adamw", False)],
                         ids=["tp2xdp2-bert-adamw", "tp4xdp2-bert-lamb-sp", "tp2xdp2-llama-lamb-sp",
                              "tp4xdp2-llama-adamw"])
def test_zero1_step_is_one_graph_for_every_rank(worlds, world_size, tp, family, optimizer, sequence_parallel):
    """The ZeRO-1 step (NeuronZero1Optimizer over AdamW or LAMB): the master shards taken with the rank as data, the
    reduce-scatter over DP, the norm over TP x DP, the inner step and the all-gather trace one graph on every rank."""
    case = case_bert_step_graphs if family == "bert" else case_decoder_step_graphs
    result, = worlds(1, "xla-hlo").run(case, tensor_model_parallel_size=None, world_size=world_size, tp=tp,
                                       sequence_parallel=sequence_parallel, optimizer=optimizer, zero1=True)
    _assert_one_graph(result)


@pytest.mark.parametrize("world_size,tp,family,optimizer,sharding",
                         [(8, 2, "llama", "adamw", 2), (8, 2, "bert", "lamb", 2), (4, 2, "llama", "adamw", 1)],
                         ids=["tp2xdp4-pairs-llama-adamw", "tp2xdp4-pairs-bert-lamb", "tp2xdp2-singles-llama-adamw"])
def test_zero1_hybrid_sharding_step_is_one_graph_for_every_rank(worlds, world_size, tp, family, optimizer, sharding):
    """ZeRO-1 sharded over each DP group cut into groups of k (issue 24): the reduce-scatter over the sharding group,
    the all-reduce over the replica group and the all-gather name every group of their kind, and the shard is taken
    with the sharding rank as data: one graph on every rank."""
    case = case_bert_step_graphs if family == "bert" else case_decoder_step_graphs
    result, = worlds(1, "xla-hlo").run(case, tensor_model_parallel_size=None, world_size=world_size, tp=tp,
                                       sequence_parallel=False, optimizer=optimizer, zero1=True,
                                       zero1_sharding=sharding, keep_hlo=True)
    _assert_one_graph(result)
    # The gradients are reduce-scattered over the sharding groups and all-reduced over the replica groups.
    dp_groups = [list(range(t, world_size, tp)) for t in range(tp)]
    sharding_groups = sorted(g[i:i + sharding] for g in dp_groups for i in range(0, len(g), sharding))
    replica_groups = sorted([r for j, r in enumerate(g) if j % sharding == i] for g in dp_groups
                            for i in range(sharding))

    def hlo(groups):
        return "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}"

    collectives = result["step_collectives"]
    if sharding > 1:
        assert ("reduce-scatter", hlo(sharding_groups)) in collectives, collectives
        assert ("all-gather", hlo(sharding_groups)) in collectives, collectives
    assert ("all-reduce", hlo(replica_groups)) in collectives, collectives


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["no_sp", "sp"])
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_tp8_dp4_world_is_one_graph_for_every_rank(worlds, family, sequence_parallel):
    case = case_bert_step_graphs if family == "bert" else case_decoder_step_graphs
    result, = worlds(1, "xla-hlo").run(case, tensor_model_parallel_size=None, world_size=32, tp=8,
                                       sequence_parallel=sequence_parallel)
    _assert_one_graph(result)


# ---- (b) the data-rank primitives equal the old slicing, eagerly on gloo ---------------------------------------------

def case_split_by_rank_tensor_equals_narrow(seed: int):
    import torch

    from nxdtp import mappings, parallel_state

    group = parallel_state.tensor_parallel_group()
    rank_t = parallel_state.rank_tensor(group, "cpu")
    assert rank_t.tolist() == [group.rank] and rank_t.dtype == torch.long
    assert parallel_state.rank_tensor(group, "cpu") is rank_t, "the rank tensor must be made once per group and device"
    torch.manual_seed(seed)  # the same tensors on every rank
    checked = 0
    for shape in ((8, 3, 4), (2, 8, 5), (3, 2, 16)):
        for dim in range(-3, 3):
            if shape[dim] % group.size:
                continue
            x = torch.randn(shape).transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous input too
            x.requires_grad_()
            chunk = shape[dim] // group.size
            expected = x.detach().narrow(dim, group.rank * chunk, chunk)
            got = mappings.split_along_dim(x.detach(), group, dim)
            assert torch.equal(got, expected) and got.is_contiguous(), (shape, dim)
            # Through the autograd region: forward keeps the slice, backward all-gathers every rank's gradient.
            weight = torch.randn(shape)
            out = mappings.scatter_to_tensor_model_parallel_region(x, partition_dim=dim)
            assert torch.equal(out, expected)
            (out * weight.narrow(dim, group.rank * chunk, chunk)).sum().backward()
            torch.testing.assert_close(x.grad, weight, rtol=0, atol=0)
            # The gather region's backward keeps this rank's slice of a replicated gradient.
            shard = expected.clone().requires_grad_()
            gathered = mappings.gather_from_tensor_model_parallel_region(shard, partition_dim=dim)
            (gathered * weight).sum().backward()
            assert torch.equal(shard.grad, weight.narrow(dim, group.rank * chunk, chunk))
            checked += 1
    return checked


@pytest.mark.parametrize("world,tp", [(2, 2), (4, 4), (4, 2)], ids=["tp2", "tp4", "tp2xdp2"])
def test_split_by_rank_tensor_equals_narrow(worlds, world, tp):
    checked = worlds(world).run(case_split_by_rank_tensor_equals_narrow, tensor_model_parallel_size=tp, seed=3)
    assert checked[0] >= 8 and len(set(checked)) == 1


def case_embedding_padding_row_on_any_shard(seed: int, padding_idx: int):
    """The vocab-parallel embedding with padding_idx on a shard other than rank 0's: equal to nn.Embedding, the padding
    row gets no gradient, in output and in every weight-gradient slice."""
    import torch

    from nxdtp import layers, parallel_state

    group = parallel_state.tensor_parallel_group()
    torch.manual_seed(seed)
    dense = torch.nn.Embedding(16, 6, padding_idx=padding_idx)
    with torch.no_grad():
        dense.weight.add_(torch.randn_like(dense.weight))  # the padding row too: its value is looked up, unchanged
    ids = torch.randint(0, 16, (3, 7))
    ids[0, :4] = padding_idx
    upstream = torch.randn(3, 7, 6)
    embedding = layers.ParallelEmbedding(16, 6, padding_idx=padding_idx)
    rows = 16 // group.size
    with torch.no_grad():
        embedding.weight.copy_(dense.weight[group.rank * rows:(group.rank + 1) * rows])
    out = embedding(ids)
    out.backward(upstream)
    ref = dense(ids)
    ref.backward(upstream)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(embedding.weight.grad, dense.weight.grad[group.rank * rows:(group.rank + 1) * rows],
                               rtol=1e-5, atol=1e-5)
    return float(dense.weight.grad[padding_idx].abs().sum())


@pytest.mark.parametrize("world,tp,padding_idx", [(2, 2, 11), (4, 4, 6), (4, 4, 0)])
def test_embedding_padding_row_on_any_shard(worlds, world, tp, padding_idx):
    pad_grads = worlds(world).run(case_embedding_padding_row_on_any_shard, tensor_model_parallel_size=tp, seed=5,
                                  padding_idx=padding_idx)
    assert pad_grads == [0.0] * world


def test_token_statistics_are_one_graph_for_every_rank(worlds):
    result, = worlds(1, "xla-hlo").run(case_token_statistics_graphs, tensor_model_parallel_size=None)
    _assert_one_graph(result)

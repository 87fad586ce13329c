"""The XLA path, proven on XLA:CPU (docs/testing.md, "What XLA:CPU can and cannot run", lists what was measured).

(a) Lowering: a rank of a simulated world (8 ranks, tp=4, this is rank 5) is traced to HLO text, which is parsed for the
    collectives, their replica groups and their count. These graphs are never executed; they run in their own worker
    process ("xla-hlo"), apart from the graphs that do execute ("xla-exec").
(b) Execution at tp=1 on the XLA:CPU device, compared with eager CPU.
(c) Graph counts per training step from torch_xla.debug.metrics.
"""

from __future__ import annotations

import contextlib
import copy
import re

import pytest

pytestmark = pytest.mark.xla

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter")


# ---- helpers that run inside the XLA worker processes ----------------------------------------------------------------

@contextlib.contextmanager
def _simulated_rank(world_size=8, rank=5, tp=4):
    """Install the topology and make the XLA runtime report it, so xm does not short-circuit collectives as a world
    of 1.

    The patch stays active for backward(), because collectives inside autograd Functions are traced then.
    """
    from nxdtp import comm, parallel_state

    with parallel_state.simulated_topology(world_size, rank, tp), comm.simulated_xla_runtime(world_size, rank):
        yield


def _reset_collective_token():
    # The all-reduce token chains collectives across graphs; reset it so each HLO holds only the region asked for.
    from nxdtp import comm

    comm.clear_xla_collective_token()


def _hlo(tensors) -> str:
    import torch_xla

    return torch_xla._XLAC._get_xla_tensors_hlo(list(tensors))


def _collective_counts(hlo: str) -> dict:
    return {op: len(re.findall(r"\s%s\(" % op, hlo)) for op in COLLECTIVES}


def _replica_groups(hlo: str) -> set:
    return set(re.findall(r"replica_groups=(\{\{[0-9,{}]*\}\})", hlo))


def _grads(module, extra=()):
    return list(extra) + [p.grad for p in module.parameters()]


# ---- (a) lowering under a simulated topology -------------------------------------------------------------------------

def case_mlp_lowering(sequence_parallel: bool):
    import torch
    import torch_xla

    from nxdtp import layers

    device = torch_xla.device()
    with _simulated_rank():
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(
            layers.ColumnParallelLinear(16, 32, gather_output=False, sequence_parallel_enabled=sequence_parallel),
            torch.nn.GELU(),
            layers.RowParallelLinear(32, 16, input_is_parallel=True, sequence_parallel_enabled=sequence_parallel),
        ).to(device)
        # Sequence-parallel input is this rank's sequence shard ([seq/tp, batch, hidden]).
        x = torch.randn(2, 3, 16).to(device).requires_grad_()
        _reset_collective_token()
        y = mlp(x)
        forward = _hlo([y])
        _reset_collective_token()
        y.backward(torch.randn(y.shape).to(device))
        input_grad = _hlo([x.grad])
        # The whole step: the weight gradients' graph holds the forward's collectives and the column layer's re-gather.
        step = _hlo(_grads(mlp, [y, x.grad]))
        _reset_collective_token()
    return {"forward": _collective_counts(forward), "input_grad": _collective_counts(input_grad),
            "step": _collective_counts(step), "groups": sorted(_replica_groups(step)), "out_shape": tuple(y.shape)}


def test_column_row_mlp_lowers_to_one_all_reduce_each_way(worlds):
    result, = worlds(1, "xla-hlo").run(case_mlp_lowering, tensor_model_parallel_size=None, sequence_parallel=False)
    assert result["forward"] == {"all-reduce": 1, "all-gather": 0, "reduce-scatter": 0}
    assert result["input_grad"] == {"all-reduce": 1, "all-gather": 0, "reduce-scatter": 0}
    assert result["step"] == {"all-reduce": 2, "all-gather": 0, "reduce-scatter": 0}
    assert result["groups"] == ["{{0,1,2,3},{4,5,6,7}}"]


def test_sequence_parallel_mlp_lowers_to_native_gather_and_reduce_scatter(worlds):
    result, = worlds(1, "xla-hlo").run(case_mlp_lowering, tensor_model_parallel_size=None, sequence_parallel=True)
    # Forward: all-gather the sequence into the column layer, reduce-scatter out of the row layer; backward mirrors it.
    assert result["forward"] == {"all-reduce": 0, "all-gather": 1, "reduce-scatter": 1}
    # Whole step: forward all-gather + reduce-scatter, their mirrors in backward, and one all-gather more in backward:
    # the column layer keeps only its sequence shard and re-gathers it for the weight gradient (as Megatron-LM). The
    # input-gradient graph alone also holds the forward all-gather, because GELU's backward reads the column output.
    assert result["step"] == {"all-reduce": 0, "all-gather": 3, "reduce-scatter": 2}
    assert result["groups"] == ["{{0,1,2,3},{4,5,6,7}}"]
    assert result["out_shape"] == (2, 3, 16)


def case_embedding_and_dp_lowering():
    import torch
    import torch_xla

    from nxdtp import comm, layers, parallel_state

    device = torch_xla.device()
    with _simulated_rank():
        torch.manual_seed(0)
        embedding = layers.ParallelEmbedding(40, 8).to(device)
        ids = torch.randint(0, 40, (2, 5)).to(device)
        _reset_collective_token()
        vocab_parallel = _hlo([embedding(ids)])
        _reset_collective_token()
        grad = torch.randn(24).to(device)
        dp_sum = _hlo([comm.all_reduce(grad, parallel_state.data_parallel_group())])
        _reset_collective_token()
    return {"embedding": (_collective_counts(vocab_parallel), sorted(_replica_groups(vocab_parallel))),
            "dp": (_collective_counts(dp_sum), sorted(_replica_groups(dp_sum)))}


def test_embedding_and_data_parallel_replica_groups(worlds):
    result, = worlds(1, "xla-hlo").run(case_embedding_and_dp_lowering, tensor_model_parallel_size=None)
    assert result["embedding"] == ({"all-reduce": 1, "all-gather": 0, "reduce-scatter": 0},
                                   ["{{0,1,2,3},{4,5,6,7}}"])
    # DP groups are strided: one rank from each TP group.
    assert result["dp"] == ({"all-reduce": 1, "all-gather": 0, "reduce-scatter": 0}, ["{{0,4},{1,5},{2,6},{3,7}}"])


def case_expert_dispatch_lowering(tp, ep, scatter_gather):
    """NxD's expert regions traced for every rank of a simulated world of 4: one graph for all ranks, an all-to-all
    over the expert-parallel replica groups each way."""
    import torch
    import torch_xla

    from nxdtp import mappings
    from nxdtp.xla_graphs import trace_every_rank

    def step():
        device = torch_xla.device()
        x = torch.randn(2 * ep, 2 * tp, 3).to(device).requires_grad_()
        _reset_collective_token()
        y = mappings.enter_expert_parallel_region(x, scatter_gather)
        out = mappings.exit_expert_parallel_region(y * 2.0, scatter_gather)
        out.backward(torch.ones(out.shape).to(device))
        return {"forward": [y], "step": [out, x.grad]}

    graphs = trace_every_rank(step, 4, tp, keep_hlo=True, expert_model_parallel_size=ep)
    _reset_collective_token()
    step_hlo = graphs.hlo["step"][0]
    return {"distinct": {phase: len(set(h)) for phase, h in graphs.hashes.items()},
            "all_to_all": len(re.findall(r"\sall-to-all\(", step_hlo)),
            "groups": sorted(set(re.findall(r"all-to-all\(.*replica_groups=(\{\{[0-9,{}]*\}\})", step_hlo)))}


@pytest.mark.parametrize("tp,ep,scatter_gather,groups", [(2, 2, True, "{{0,2},{1,3}}"), (1, 2, False, "{{0,1},{2,3}}"),
                                                         (1, 4, False, "{{0,1,2,3}}")])
def test_expert_dispatch_lowers_to_one_graph_with_all_to_alls_over_the_ep_groups(worlds, tp, ep, scatter_gather,
                                                                                groups):
    result, = worlds(1, "xla-hlo").run(case_expert_dispatch_lowering, tensor_model_parallel_size=None, tp=tp, ep=ep,
                                       scatter_gather=scatter_gather)
    assert result["distinct"] == {"forward": 1, "step": 1}, result
    # Forward: enter and exit; backward: the same two, with the dims swapped.
    assert result["all_to_all"] == 4 and result["groups"] == [groups], result


def case_loss_on_a_padding_only_shard_lowers():
    """Rank 5 (TP rank 1 of 4) holds columns 8-15 of a 32-column vocab of 6 real words: only padding. Its loss must
    still trace (XLA cannot reduce over zero columns) with the same two all-reduces as every other rank."""
    import torch
    import torch_xla

    from nxdtp.loss_functions import parallel_cross_entropy

    device = torch_xla.device()
    counts = {}
    with _simulated_rank():
        for smoothing in (0.0, 0.1):
            logits = torch.randn(3, 8, requires_grad=True, device=device)
            target = torch.tensor([1, 5, -100], device=device)
            _reset_collective_token()
            loss = parallel_cross_entropy(logits, target, label_smoothing=smoothing, vocab_size=6)
            forward = _hlo([loss])
            loss.sum().backward()
            backward = _hlo([logits.grad])
            _reset_collective_token()
            counts[smoothing] = (_collective_counts(forward), "ROOT" in backward)
    return counts


def test_loss_lowers_on_a_shard_of_padding_only(worlds):
    result, = worlds(1, "xla-hlo").run(case_loss_on_a_padding_only_shard_lowers, tensor_model_parallel_size=None)
    for smoothing, (forward, backward_traced) in result.items():
        assert forward == {"all-reduce": 2, "all-gather": 0, "reduce-scatter": 0}, (smoothing, forward)
        assert backward_traced, smoothing


def case_runtime_world_mismatch_is_an_error():
    import torch
    import torch_xla

    from nxdtp import comm, parallel_state

    x = torch.ones(4).to(torch_xla.device())
    # The topology says world 2 (tp=2), the XLA:CPU runtime says 1: xm.all_reduce would silently return its input.
    with parallel_state.simulated_topology(world_size=2, rank=0, tensor_model_parallel_size=2):
        for op in (lambda: comm.all_reduce(x, parallel_state.tensor_parallel_group()),
                   lambda: comm.all_gather(x, parallel_state.tensor_parallel_group(), 0),
                   lambda: comm.reduce_scatter(x, parallel_state.tensor_parallel_group(), 0)):
            try:
                op()
            except RuntimeError as e:
                message = str(e)
                assert "XLA runtime world size 1" in message and "world size 2" in message, message
                assert "[[0, 1]]" in message, message
            else:
                raise AssertionError("an XLA collective ran although the runtime world differs from the topology")


def test_comm_refuses_xla_collectives_when_runtime_world_differs(worlds):
    worlds(1, "xla-hlo").run(case_runtime_world_mismatch_is_an_error, tensor_model_parallel_size=None)


# ---- (b) tp=1 on XLA:CPU equals eager --------------------------------------------------------------------------------

def _build_tp1_model(seed):
    import torch

    from nxdtp import layers

    torch.manual_seed(seed)
    model = torch.nn.ModuleDict({
        "embedding": layers.ParallelEmbedding(30, 16, padding_idx=1),
        "norm": layers.LayerNorm(16),
        "column": layers.ColumnParallelLinear(16, 48, stride=3),
        "row": layers.RowParallelLinear(48, 16),
    })
    with torch.no_grad():
        for p in model.parameters():  # randomise everything: fresh LayerNorms and biases hide bugs
            p.add_(torch.randn_like(p) * 0.5)
    return model


def _tp1_forward(model, ids):
    import torch

    h = model["norm"](model["embedding"](ids))
    return model["row"](torch.nn.functional.gelu(model["column"](h)))


def case_tp1_layers_on_xla_equal_eager():
    import torch

    from nxdtp.utils import move_model_to_device

    ids = torch.randint(0, 30, (3, 7))
    upstream = torch.randn(3, 7, 16)

    def run(device):
        model = move_model_to_device(_build_tp1_model(seed=11), device)
        out = _tp1_forward(model, ids.to(device))
        out.backward(upstream.to(device))
        # .to(xla) makes new Parameter objects; move_model_to_device must have put the TP attributes back.
        assert all(hasattr(p, "tensor_model_parallel") for p in model.parameters())
        return [out] + [p.grad for p in model.parameters()]

    return _eager_and_xla_agree(run)


def _eager_and_xla_agree(run) -> int:
    """``run(device)`` on the CPU and on the XLA device: the tensors it returns agree within 1e-5; how many."""
    import torch
    import torch_xla

    results = []
    for device in ("cpu", torch_xla.device()):
        tensors = run(device)
        torch_xla.sync()
        results.append([t.cpu() for t in tensors])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    return len(results[0])


def test_tp1_layers_on_xla_cpu_equal_eager(worlds):
    compared, = worlds(1, "xla-exec").run(case_tp1_layers_on_xla_equal_eager, tensor_model_parallel_size=1)
    assert compared == 1 + 7  # the output and every parameter's gradient


def case_move_to_xla_reties_weights():
    import torch
    import torch_xla

    from nxdtp import layers
    from nxdtp.utils import move_model_to_device

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"embedding": layers.ParallelEmbedding(12, 4), "head": torch.nn.Linear(4, 12)})
    model["head"].weight = model["embedding"].weight
    plain = torch.nn.ModuleDict({"embedding": layers.ParallelEmbedding(12, 4), "head": torch.nn.Linear(4, 12)})
    plain["head"].weight = plain["embedding"].weight
    plain.to(torch_xla.device())
    untied_by_plain_to = plain["head"].weight is not plain["embedding"].weight
    lost_attributes = not hasattr(plain["embedding"].weight, "partition_dim")
    move_model_to_device(model, torch_xla.device())
    assert model["head"].weight is model["embedding"].weight, "move_model_to_device lost the tie"
    assert model["embedding"].weight.device.type == "xla"
    assert model["embedding"].weight.partition_dim == 0 and model["embedding"].weight.tensor_model_parallel is True
    return untied_by_plain_to, lost_attributes


def test_move_model_to_xla_reties_and_reattaches(worlds):
    (untied_by_plain_to, lost_attributes), = worlds(1, "xla-exec").run(case_move_to_xla_reties_weights,
                                                                       tensor_model_parallel_size=1)
    # The fix is needed at all: plain .to(xla) unties shared weights and drops the attributes.
    assert untied_by_plain_to and lost_attributes


# ---- (c) graphs per step ---------------------------------------------------------------------------------------------

def case_graphs_per_step(steps):
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    from nxdtp.utils import move_model_to_device

    device = torch_xla.device()
    model = move_model_to_device(_build_tp1_model(seed=3), device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    ids = torch.randint(0, 30, (3, 7)).to(device)
    torch_xla.sync()
    xm.wait_device_ops()
    met.clear_all()
    per_step = []
    for _ in range(steps):
        before = {k: met.counter_value(k) or 0 for k in ("UncachedCompile", "CachedCompile", "ExecuteComputation")}
        optimizer.zero_grad()
        _tp1_forward(model, ids).square().mean().backward()
        optimizer.step()
        torch_xla.sync()
        xm.wait_device_ops()  # executions are counted when they finish, asynchronously
        per_step.append({k: (met.counter_value(k) or 0) - v for k, v in before.items()})
    return per_step


def test_one_graph_per_step_and_no_recompiles(worlds):
    per_step, = worlds(1, "xla-exec").run(case_graphs_per_step, tensor_model_parallel_size=1, steps=5)
    assert per_step[0]["UncachedCompile"] >= 1
    for step in per_step[2:]:
        assert step == {"UncachedCompile": 0, "CachedCompile": 1, "ExecuteComputation": 1}, per_step


# ---- BERT through the plan -------------------------------------------------------------------------------------------

def _small_bert(model_class_name: str, heads: int):
    import torch
    import transformers

    config = transformers.BertConfig(vocab_size=61, hidden_size=8 * heads, num_hidden_layers=1,
                                     num_attention_heads=heads, intermediate_size=16 * heads,
                                     max_position_embeddings=16, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = getattr(transformers, model_class_name)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def case_bert_layer_lowering():
    import torch
    import torch_xla

    from nxdtp.models.bert import parallelize_bert

    device = torch_xla.device()
    with _simulated_rank(world_size=8, rank=5, tp=8):
        model = parallelize_bert(_small_bert("BertModel", heads=8), broadcast_replicated=False)
        layer = model.encoder.layer[0].to(device)
        hidden = torch.randn(2, 6, 64).to(device).requires_grad_()
        _reset_collective_token()
        out = layer(hidden)
        out = out[0] if isinstance(out, tuple) else out
        forward = _hlo([out])
        _reset_collective_token()
        out.backward(torch.randn(out.shape).to(device))
        step = _hlo(_grads(layer, [out, hidden.grad]))
        _reset_collective_token()
    return {"forward": _collective_counts(forward), "step": _collective_counts(step),
            "groups": sorted(_replica_groups(step))}


def test_bert_layer_lowers_to_megatron_minimum(worlds):
    result, = worlds(1, "xla-hlo").run(case_bert_layer_lowering, tensor_model_parallel_size=None)
    # Forward: attention output and MLP output all-reduce. Backward: one shared entry region for Q/K/V, one for the
    # intermediate layer. The whole step graph holds both; backward's own share is the difference (a gradient graph
    # also contains the forward all-reduces whose outputs LayerNorm's backward reads).
    assert result["forward"] == {"all-reduce": 2, "all-gather": 0, "reduce-scatter": 0}
    assert result["step"] == {"all-reduce": 4, "all-gather": 0, "reduce-scatter": 0}
    assert result["step"]["all-reduce"] - result["forward"]["all-reduce"] == 2
    assert result["groups"] == ["{{0,1,2,3,4,5,6,7}}"]


def case_zero_head_mask_traces_one_graph_for_every_rank():
    """A 6-head, 2-KV-head Llama at tp=4 has zero heads on ranks 1 and 3 only; the output projection's mask is a buffer,
    so every rank traces the same forward and backward graph for it (one all-reduce forward)."""
    import torch
    import torch_xla
    import transformers

    from nxdtp.models import parallelize_model

    device = torch_xla.device()
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=6, num_key_value_heads=2)
    torch.manual_seed(0)
    dense = transformers.LlamaForCausalLM(config)
    graphs, masks, counts = [], [], []
    for rank in range(4):
        with _simulated_rank(world_size=4, rank=rank, tp=4):
            parallel = parallelize_model(copy.deepcopy(dense), broadcast_replicated=False)
            o_proj = parallel.model.layers[0].self_attn.o_proj
            masks.append(o_proj.nxdtp_real_columns.view(-1, 8)[:, 0].tolist())
            o_proj = o_proj.to(device)
            torch.manual_seed(1)
            attended = torch.randn(2, 5, 16).to(device).requires_grad_()
            _reset_collective_token()
            out = o_proj(attended)
            counts.append(_collective_counts(_hlo([out])))
            out.backward(torch.ones(out.shape).to(device))
            graphs.append(_hlo(_grads(o_proj, [out, attended.grad])))
            _reset_collective_token()
    return {"distinct_graphs": len(set(graphs)), "masks": masks, "counts": counts}


def test_zero_head_mask_traces_one_graph_for_every_rank(worlds):
    result, = worlds(1, "xla-hlo").run(case_zero_head_mask_traces_one_graph_for_every_rank,
                                       tensor_model_parallel_size=None)
    assert result["masks"] == [[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 0.0]]
    assert result["distinct_graphs"] == 1
    assert all(c == {"all-reduce": 1, "all-gather": 0, "reduce-scatter": 0} for c in result["counts"])


def case_tp1_bert_on_xla_equals_eager():
    import torch
    import torch_xla

    from nxdtp.models.bert import parallelize_bert
    from nxdtp.utils import move_model_to_device

    ids = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(1))
    labels = torch.full((2, 7), -100)
    labels[:, 3] = ids[:, 3]
    labels[0, 5] = ids[0, 5]
    next_sentence = torch.tensor([0, 1])
    results = {}
    for device in ("cpu", torch_xla.device()):
        model = move_model_to_device(parallelize_bert(_small_bert("BertForPreTraining", heads=2)), device)
        assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
        out = model(ids.to(device), labels=labels.to(device), next_sentence_label=next_sentence.to(device))
        out.loss.backward()
        torch_xla.sync()
        results[str(device)] = [out.loss.cpu(), out.prediction_logits.cpu()] + \
            [p.grad.cpu() for p in model.parameters()]
    eager, xla = results["cpu"], results[str(torch_xla.device())]
    for a, b in zip(eager, xla):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    return len(eager)


def test_tp1_bert_on_xla_cpu_equals_eager(worlds):
    compared, = worlds(1, "xla-exec").run(case_tp1_bert_on_xla_equals_eager, tensor_model_parallel_size=1)
    assert compared > 20


def case_checkpointed_bert_on_xla_equals_eager_and_fences_the_recompute():
    """Both ways of checkpointing a parallelized model (checkpoint_layers, HF's switch with torch.utils.checkpoint): on
    XLA:CPU the loss and gradients equal eager CPU's plain model, and the backward graph holds an optimization barrier
    (without it XLA merges the recompute with the forward and keeps the activations)."""
    import torch
    import torch_xla

    from nxdtp.models import checkpoint_layers
    from nxdtp.models.bert import parallelize_bert
    from nxdtp.utils import move_model_to_device

    ids = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(2))
    switches = {"plain": lambda m: m, "checkpoint_layers": checkpoint_layers,
                "gradient_checkpointing_enable": lambda m: m.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}) or m}
    results, barriers = {}, {}
    for name, switch in switches.items():
        for device in ("cpu", torch_xla.device()):
            model = switch(move_model_to_device(parallelize_bert(_small_bert("BertForMaskedLM", heads=2)), device))
            out = model(ids.to(device), labels=ids.to(device))
            out.loss.backward()
            grads = [p.grad for p in model.parameters()]
            if device != "cpu":
                barriers[name] = "opt-barrier" in _hlo(grads)
                torch_xla.sync()
            results[name, str(device)] = [out.loss.detach().cpu()] + [g.cpu() for g in grads]
    for key, values in results.items():
        for a, b in zip(results["plain", "cpu"], values):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
    return barriers


def test_checkpointed_bert_on_xla_cpu_equals_eager_and_fences_the_recompute(worlds):
    barriers, = worlds(1, "xla-exec").run(case_checkpointed_bert_on_xla_equals_eager_and_fences_the_recompute,
                                          tensor_model_parallel_size=1)
    assert barriers == {"plain": False, "checkpoint_layers": True, "gradient_checkpointing_enable": True}


# ---- checkpoints on XLA: a resumed run traces the uninterrupted run's graph ------------------------------------------

def case_resumed_run_compiles_nothing_new(root: str):
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    from nxdtp.checkpointing import load, save
    from nxdtp.utils import move_model_to_device

    device = torch_xla.device()
    ids = torch.randint(0, 30, (3, 7)).to(device)

    def fresh(seed):
        model = move_model_to_device(_build_tp1_model(seed=seed), device)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    def train(model, optimizer, steps):
        record = []
        for _ in range(steps):
            before = {k: met.counter_value(k) or 0 for k in ("UncachedCompile", "ExecuteComputation")}
            optimizer.zero_grad()
            loss = _tp1_forward(model, ids).square().mean()
            loss.backward()
            optimizer.step()
            torch_xla.sync()
            xm.wait_device_ops()
            record.append({"loss": loss.item(),
                           **{k: (met.counter_value(k) or 0) - v for k, v in before.items()}})
        return record

    model, optimizer = fresh(seed=3)
    train(model, optimizer, 3)
    save({"model": model, "optimizer": optimizer, "global_step": 3}, root)
    saved = {k: v.cpu() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    uninterrupted = train(model, optimizer, 3)

    model, optimizer = fresh(seed=4)
    torch_xla.sync()
    load(root, model=model, optimizer=optimizer)
    resumed = train(model, optimizer, 3)
    # The checkpoint is device-neutral: the one saved from XLA loads into an eager CPU model.
    on_cpu = _build_tp1_model(seed=5)
    load(root, model=on_cpu)
    same_on_cpu = all(torch.equal(v, saved[k]) for k, v in on_cpu.state_dict().items() if k in saved)
    return uninterrupted, resumed, same_on_cpu


def test_a_resumed_run_compiles_nothing_new(worlds, tmp_path):
    (uninterrupted, resumed, same_on_cpu), = worlds(1, "xla-exec").run(
        case_resumed_run_compiles_nothing_new, tensor_model_parallel_size=1, root=str(tmp_path / "ckpt"))
    assert same_on_cpu
    assert [r["loss"] for r in resumed] == [r["loss"] for r in uninterrupted], (resumed, uninterrupted)
    # Every resumed step runs one graph, and it is the uninterrupted run's (already compiled in this process).
    assert all(r["UncachedCompile"] == 0 and r["ExecuteComputation"] == 1 for r in resumed), resumed


def case_reduce_dtype_lowering():
    """A bf16 Column -> Row pair: the forward all-reduce and the input-gradient all-reduce run on f32 operands with
    reduce_dtype=torch.float32 (NxD's default) and on bf16 ones with reduce_dtype=torch.bfloat16."""
    import torch
    import torch_xla

    from nxdtp import layers

    device = torch_xla.device()
    operand_types = {}
    for reduce_dtype in (torch.float32, torch.bfloat16):
        with _simulated_rank():
            col = layers.ColumnParallelLinear(16, 32, gather_output=False, dtype=torch.bfloat16,
                                              reduce_dtype=reduce_dtype).to(device)
            row = layers.RowParallelLinear(32, 16, input_is_parallel=True, dtype=torch.bfloat16,
                                           reduce_dtype=reduce_dtype).to(device)
            x = torch.randn(2, 3, 16, dtype=torch.bfloat16).to(device).requires_grad_()
            _reset_collective_token()
            y = row(col(x))
            forward = _hlo([y])
            _reset_collective_token()
            y.backward(torch.ones_like(y))
            backward = _hlo([x.grad])
            _reset_collective_token()
        operand_types[str(reduce_dtype)] = (re.findall(r"all-reduce\((\w+)\[", forward),
                                            re.findall(r"all-reduce\((\w+)\[", backward), str(y.dtype),
                                            str(x.grad.dtype))
    return operand_types


def test_reduce_dtype_sets_the_all_reduce_operand_type(worlds):
    result = worlds(1, "xla-hlo").run(case_reduce_dtype_lowering, tensor_model_parallel_size=None)[0]
    assert result["torch.float32"][:2] == (["f32"], ["f32"]), result
    assert result["torch.bfloat16"][:2] == (["bf16"], ["bf16"]), result
    assert all(r[2:] == ("torch.bfloat16", "torch.bfloat16") for r in result.values()), result


def case_moe_lowering(tp, ep):
    """An MoE layer (sequence-parallel router, shared experts, a capacity that drops tokens) traced forward and
    backward for every rank of a simulated world of 4: one graph for all ranks."""
    import torch
    import torch_xla

    from nxdtp.modules.moe import ExpertMLPs, MoE, RouterTopK, SharedExperts, load_balancing_loss_func
    from nxdtp.xla_graphs import trace_every_rank

    def step():
        device = torch_xla.device()
        torch.manual_seed(0)
        moe = MoE(RouterTopK(4, 2, 8, sequence_parallel_enabled=True),
                  ExpertMLPs(4, 2, 8, 6, "silu", glu_mlp=True, capacity_factor=1.0, normalize_top_k_affinities=True),
                  SharedExperts(8, 4, 1, "silu"), sequence_parallel_enabled=True, return_router_logits=True).to(device)
        x = torch.randn(4 // tp, 2, 8).to(device).requires_grad_()
        _reset_collective_token()
        out, logits = moe(x)
        loss = out.sum() + load_balancing_loss_func(logits, 4, 2, over_data_parallel_batch=True)
        loss.backward()
        return {"step": [loss, x.grad] + [p.grad for p in moe.parameters()]}

    graphs = trace_every_rank(step, 4, tp, keep_hlo=True, expert_model_parallel_size=ep)
    _reset_collective_token()
    step_hlo = graphs.hlo["step"][0]
    return {"distinct": len(set(graphs.hashes["step"])),
            "all_to_all": len(re.findall(r"\sall-to-all\(", step_hlo)),
            "groups": sorted(set(re.findall(r"all-to-all\(.*replica_groups=(\{\{[0-9,{}]*\}\})", step_hlo)))}


@pytest.mark.parametrize("tp,ep,groups", [(2, 2, "{{0,2},{1,3}}"), (1, 4, "{{0,1,2,3}}")])
def test_moe_lowers_to_one_graph_for_every_rank(worlds, tp, ep, groups):
    result, = worlds(1, "xla-hlo").run(case_moe_lowering, tensor_model_parallel_size=None, tp=tp, ep=ep)
    assert result["distinct"] == 1, result
    # The tokens go to their experts and back in forward, and their gradients the same two ways in backward.
    assert result["all_to_all"] == 4 and result["groups"] == [groups], result


def case_tp1_moe_on_xla_equals_eager():
    """An MoE layer with a capacity that drops tokens and shared experts, run on XLA:CPU at tp=1: output, router
    logits and every gradient equal the eager CPU run."""
    import torch

    from nxdtp.modules.moe import ExpertMLPs, MoE, RouterTopK, SharedExperts, load_balancing_loss_func
    from nxdtp.utils import move_model_to_device

    x = torch.randn(3, 5, 8)

    def run(device):
        torch.manual_seed(0)
        moe = MoE(RouterTopK(4, 2, 8, bias=True),
                  ExpertMLPs(4, 2, 8, 6, "silu", glu_mlp=True, capacity_factor=1.0, normalize_top_k_affinities=True),
                  SharedExperts(8, 4, 1, "silu"), return_router_logits=True)
        moe = move_model_to_device(moe, device)
        out, logits = moe(x.to(device))
        (out.square().sum() + load_balancing_loss_func(logits, 4, 2)).backward()
        return [out, logits] + [p.grad for p in moe.parameters()]

    return _eager_and_xla_agree(run)


def test_tp1_moe_on_xla_cpu_equals_eager(worlds):
    compared, = worlds(1, "xla-exec").run(case_tp1_moe_on_xla_equals_eager, tensor_model_parallel_size=1)
    assert compared == 2 + 7  # output, router logits, every parameter's gradient

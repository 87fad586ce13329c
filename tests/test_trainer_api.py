"""NxD's trainer API (``nxdtp.neuronx_distributed_config``, ``initialize_parallel_model``,
``initialize_parallel_optimizer``, ``NxDModel``, ``NxDOptimizer``) and the parallel layers' re-initialisation methods
NxD's Llama ``init_weights`` calls.

* The config: the dicts NxD 2.29 returns (its ``test/unit_test/wrapper/test_nxd_config.py`` cases, plus no arguments
  and a partial ``model_init_config``), dicts filled in place, and refusals that name the value and what is valid.
* ``init_weight_cpu()`` / ``initialize_weight_biases()`` on tp2 x dp2: every DP replica gets the same values, equal to a
  dense init (``nn.Linear`` / ``nn.Embedding`` under the same seed) sliced by the layout (padding, repeated KV heads).
* Training through the trainer API on tp2 x dp2 (gloo, the pooled harness), a randomised tiny HF Llama (every parameter,
  norms and biases included), sequence parallelism and ``"full"`` activation checkpointing, 3 AdamW steps with
  different micro-batches on the two DP ranks, equals a dense HF Llama trained on the concatenated batch with torch's
  AdamW and ``clip_grad_norm_`` at a ``max_norm`` that clips (checked): losses, pre-clip norms, final parameters, fp32
  1e-5. With ZeRO-1 (NxD's defaults then accumulate in fp32 ``main_grad``) and on NxDOptimizer's own path.
* Meta-device init with a ``param_init_fn`` written as NxD's Llama ``init_weights``: the same model on every DP rank,
  equal to the dense model drawn in the same module order (parameters on meta, and buffers too).
* Also: the config initializes model parallelism; ``pad_model`` (and, without it, a refusal that names it) and
  checkpointing by a list of classes; model_fn's arguments given in include_buffers' place are refused; local ranks
  build in waves of ``sequential_move_factor``; sequence-parallel gradients held in ``main_grad`` are summed over TP;
  ``mixed_precision_config`` and ``max_grad_norm`` reach ZeRO-1.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import nxdtp
from nxdtp import parallel_state as ps
from nxdtp.trainer import trainer as trainer_module

transformers = pytest.importorskip("transformers")

torch_clip_grad_norm_ = torch.nn.utils.clip_grad.clip_grad_norm_
TOL = dict(rtol=1e-5, atol=1e-5)
STEPS = 3
MAX_NORM = 0.5
ADAMW = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-4, weight_decay=0.01)   # eps: see tests/test_zero1.py


# ---- the config ------------------------------------------------------------------------------------------------------

@pytest.fixture
def no_world(monkeypatch):
    """The config alone: as in NxD's unit test, torch.distributed is not up (so no model parallelism is made)."""
    monkeypatch.setattr(trainer_module.dist, "is_initialized", lambda: False)


NXD_DEFAULT = {
    "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "expert_parallel_size": 1, "context_parallel_size": 1,
    "pipeline_config": None,
    "optimizer_config": {"zero_one_enabled": False, "grad_clipping": True, "max_grad_norm": 1.0},
    "activation_checkpoint_config": None, "pad_model": False, "sequence_parallel": False,
    "model_init_config": {"sequential_move_factor": 11, "meta_device_init": False, "param_init_fn": None},
    "lora_config": None,
    "mixed_precision_config": {"use_master_weights": False, "use_fp32_grad_acc": False,
                               "use_master_weights_in_ckpt": False},
    "lnc_size": 1,
}


def test_config_without_arguments_is_nxds_default(no_world):
    assert nxdtp.neuronx_distributed_config() == NXD_DEFAULT
    assert nxdtp.trainer.neuronx_distributed_config is nxdtp.neuronx_distributed_config


def test_config_with_zero_one_fills_nxds_defaults_in_place(no_world, caplog):
    optimizer_config = {"zero_one_enabled": True}
    with caplog.at_level(logging.WARNING, logger=trainer_module.logger.name):
        config = nxdtp.neuronx_distributed_config(tensor_parallel_size=8, optimizer_config=optimizer_config,
                                                  activation_checkpoint_config=torch.nn.Linear)
    assert config["optimizer_config"] is optimizer_config   # filled in place, as NxD
    assert optimizer_config == {"zero_one_enabled": True, "grad_clipping": True, "max_grad_norm": 1.0}
    assert config["mixed_precision_config"] == {"use_master_weights": True, "use_fp32_grad_acc": True,
                                                "use_master_weights_in_ckpt": False}
    assert config == {**NXD_DEFAULT, "tensor_parallel_size": 8, "optimizer_config": optimizer_config,
                      "activation_checkpoint_config": torch.nn.Linear,
                      "mixed_precision_config": config["mixed_precision_config"]}
    assert "grad_clipping is not set" in caplog.text and "max_grad_norm is not set" in caplog.text


def test_config_nxd_unit_test_cases(no_world):
    # test_nxd_config.py's remaining cases (at pipeline size 1, the only one nxdtp has).
    given = {"use_master_weights": True, "use_fp32_grad_acc": True, "use_master_weights_in_ckpt": False}
    assert nxdtp.neuronx_distributed_config(mixed_precision_config=dict(given))["mixed_precision_config"] == given
    config = nxdtp.neuronx_distributed_config(optimizer_config={"zero_one_enabled": False})
    assert config["mixed_precision_config"] == NXD_DEFAULT["mixed_precision_config"]
    assert nxdtp.neuronx_distributed_config(optimizer_config={"grad_clipping": False})["optimizer_config"] == {
        "grad_clipping": False, "zero_one_enabled": False}   # no max_grad_norm without clipping, as NxD
    partial_mp = {"use_fp32_grad_acc": False}
    nxdtp.neuronx_distributed_config(optimizer_config={"zero_one_enabled": True}, mixed_precision_config=partial_mp)
    assert partial_mp == {"use_fp32_grad_acc": False, "use_master_weights": True, "use_master_weights_in_ckpt": False}


def test_config_partial_model_init_config(no_world):
    def init(module, device):
        pass

    model_init_config = {"meta_device_init": True, "param_init_fn": init}
    config = nxdtp.neuronx_distributed_config(model_init_config=model_init_config)
    assert config["model_init_config"] is model_init_config
    assert model_init_config == {"meta_device_init": True, "param_init_fn": init, "sequential_move_factor": 11}
    # Only the missing keys are filled (NxD adds no param_init_fn), with the sequential_move_factor argument.
    other = {"sequential_move_factor": 3}
    assert nxdtp.neuronx_distributed_config(model_init_config=other, sequential_move_factor=5)[
        "model_init_config"] == {"sequential_move_factor": 3, "meta_device_init": False}
    assert nxdtp.neuronx_distributed_config(model_init_config={}, sequential_move_factor=5)[
        "model_init_config"] == {"sequential_move_factor": 5, "meta_device_init": False}


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(pipeline_parallel_size=2), r"pipeline_parallel_size=2 is not supported.*pipeline_parallel_size=1"),
    (dict(expert_parallel_size=0), r"expert_parallel_size=0 must be an int >= 1"),
    (dict(context_parallel_size=2), r"context_parallel_size=2 is not supported.*context_parallel_size=1"),
    (dict(lnc_size=2), r"lnc_size=2 is not supported.*lnc_size=1"),
    (dict(lora_config=object()), r"lora_config=.* is not supported.*peft"),
    (dict(model_init_config={"meta_device_init": True}), r"param_init_fn must be provided"),
    (dict(model_init_config={"meta_device_init": True, "param_init_fn": None}), r"param_init_fn must be provided"),
    (dict(tensor_parallel_size=0), r"tensor_parallel_size=0 must be"),
    (dict(optimizer_config={"zero_one_enabld": True}), r"optimizer_config has keys \['zero_one_enabld'\] that NxD's "
     r"config does not have; its keys are \['zero_one_enabled', 'grad_clipping', 'max_grad_norm'\]; did you mean "
     r"'zero_one_enabled' for 'zero_one_enabld'\?"),
    (dict(mixed_precision_config={"use_master_weights": True, "bf16": True}),
     r"mixed_precision_config has keys \['bf16'\] .*; its keys are \['use_master_weights', 'use_fp32_grad_acc', "
     r"'use_master_weights_in_ckpt'\]$"),
    (dict(model_init_config={"sequential_move": 2}), r"model_init_config has keys \['sequential_move'\] .*did you "
     r"mean 'sequential_move_factor'"),
])
def test_config_refusals_name_the_value(no_world, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        nxdtp.neuronx_distributed_config(**kwargs)


def test_config_refuses_a_non_dict(no_world):
    with pytest.raises(TypeError, match="optimizer_config must be a dict"):
        nxdtp.neuronx_distributed_config(optimizer_config=[("zero_one_enabled", True)])


def test_master_weights_without_zero_one_are_refused(no_world):
    for mp in ({"use_master_weights": True}, {"use_fp32_grad_acc": True}, {"use_master_weights_in_ckpt": True}):
        config = nxdtp.neuronx_distributed_config(mixed_precision_config=dict(mp))
        with pytest.raises(RuntimeError, match="ZeRO-1"):
            nxdtp.initialize_parallel_optimizer(config, torch.optim.AdamW, [torch.nn.Parameter(torch.ones(2))])


def test_include_buffers_given_model_fn_arguments_is_refused(no_world):
    """NxD's usual slip: initialize_parallel_model(nxd_config, get_model, config) takes config for include_buffers
    and would call get_model() without it; refused naming the parameter order, before anything is built."""
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    built = []
    with pytest.raises(TypeError, match=r"include_buffers must be True or False, got a LlamaConfig; it is the third "
                                        r"parameter, as in NxD.*\(nxd_config, model_fn, False"):
        nxdtp.initialize_parallel_model(nxdtp.neuronx_distributed_config(), built.append, config)
    assert built == []


def case_config_initializes_model_parallelism():
    assert not ps.model_parallel_is_initialized()
    nxdtp.neuronx_distributed_config(tensor_parallel_size=2)
    sizes = (ps.get_tensor_model_parallel_size(), ps.get_data_parallel_size())
    nxdtp.neuronx_distributed_config(tensor_parallel_size=2)   # the same size again: kept
    with pytest.raises(ValueError, match="tensor_parallel_size=4 but model parallelism is already initialized"):
        nxdtp.neuronx_distributed_config(tensor_parallel_size=4)
    return sizes


def test_config_initializes_model_parallelism_when_torch_distributed_is_up(worlds):
    # tensor_model_parallel_size=None: the harness leaves model parallelism to the case.
    assert worlds(4).run(case_config_initializes_model_parallelism, tensor_model_parallel_size=None) == [(2, 2)] * 4


# ---- init_weight_cpu / initialize_weight_biases ----------------------------------------------------------------------

def _rows(dense, tp, rank, dim=0):
    return dense.chunk(tp, dim=dim)[rank]


def case_layers_reinitialise_as_dense_slices(seed: int):
    from torch import nn

    from nxdtp.layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
    from nxdtp.modules.qkv_linear import GQAQKVColumnParallelLinear

    tp, rank = ps.get_tensor_model_parallel_size(), ps.get_tensor_model_parallel_rank()
    torch.manual_seed(1000 + ps.get_rank())   # the layers start different on every rank
    column = ColumnParallelLinear(6, 10, gather_output=False)
    padded_column = ColumnParallelLinear(6, 7, gather_output=False, pad=True)
    row = RowParallelLinear(10, 6, input_is_parallel=True, keep_master_weight=True)
    embedding = ParallelEmbedding(11, 4, padding_idx=3, pad=True)
    # 4 query heads, 1 KV head of size 3 repeated for tp=2 (kv_size_multiplier 2).
    qkv = GQAQKVColumnParallelLinear(5, [12, 3], gather_output=False, kv_size_multiplier=2)
    column_bias = column.bias.detach().clone()
    out = {}

    torch.manual_seed(seed)
    column.init_weight_cpu()
    padded_column.init_weight_cpu()
    row.init_weight_cpu()
    embedding.init_weight_cpu()
    qkv.initialize_weight_biases()
    assert torch.equal(column.bias, column_bias), "init_weight_cpu changed the bias (NxD's leaves it)"
    out.update(column=column.weight, padded_column=padded_column.weight, row=row.weight,
               embedding=embedding.weight, **{f"qkv_{n}": getattr(qkv, n) for n in
                                              ("weight_q", "weight_k", "weight_v", "bias_q", "bias_k", "bias_v")})
    out = {k: v.detach().clone() for k, v in out.items()}

    # The dense draws, in the same order under the same seed.
    def linear_weight(out_features, in_features):   # nn.Linear's weight draw (without its bias draw)
        return nn.init.kaiming_uniform_(torch.empty(out_features, in_features), a=5 ** 0.5)

    torch.manual_seed(seed)
    dense_column = linear_weight(10, 6)
    dense_padded = torch.cat([linear_weight(7, 6), torch.zeros(1, 6)])
    dense_row = linear_weight(6, 10)
    dense_embedding = torch.cat([nn.Embedding(11, 4, padding_idx=3).weight, torch.zeros(1, 4)])
    dense_q, dense_k, dense_v = nn.Linear(5, 12), nn.Linear(5, 3), nn.Linear(5, 3)
    expected = dict(column=_rows(dense_column, tp, rank), padded_column=_rows(dense_padded, tp, rank),
                    row=_rows(dense_row, tp, rank, dim=1), embedding=_rows(dense_embedding, tp, rank),
                    qkv_weight_q=_rows(dense_q.weight, tp, rank), qkv_bias_q=_rows(dense_q.bias, tp, rank),
                    # the one KV head is repeated: each rank holds a copy of all of it
                    qkv_weight_k=dense_k.weight, qkv_bias_k=dense_k.bias,
                    qkv_weight_v=dense_v.weight, qkv_bias_v=dense_v.bias)
    for name, value in expected.items():
        torch.testing.assert_close(out[name], value.detach(), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    assert torch.equal(row.master_weight, dense_row.detach()), "keep_master_weight's master is not the new dense one"
    return out


def test_layer_reinitialisation_equals_dense_slices_on_every_dp_replica(worlds):
    results = worlds(4).run(case_layers_reinitialise_as_dense_slices, tensor_model_parallel_size=2, seed=7)
    for name in results[0]:
        for tp_rank in (0, 1):   # global ranks tp_rank and tp_rank + 2 are DP replicas
            assert torch.equal(results[tp_rank][name], results[tp_rank + 2][name]), f"{name}: DP replicas differ"
    assert not torch.equal(results[0]["column"], results[1]["column"])


def case_fresh_layer_is_reproduced():
    from nxdtp.layers import ColumnParallelLinear

    torch.manual_seed(3)
    layer = ColumnParallelLinear(6, 10, gather_output=False)
    before = layer.weight.detach().clone()
    torch.manual_seed(3)
    layer.init_weight_cpu()
    return torch.equal(layer.weight, before)


def test_init_weight_cpu_reproduces_the_constructor_under_its_seed(worlds):
    assert worlds(2).run(case_fresh_layer_is_reproduced, tensor_model_parallel_size=2) == [True, True]


# ---- training through the trainer API equals dense -------------------------------------------------------------------

def _dense_llama():
    from tests.test_models_decoders import _config, _dense

    return _dense("llama", _config("llama", kv_heads=2), seed=5)


def _global_batch(step):
    from tests.test_models_decoders import SEQ, VOCAB

    g = torch.Generator().manual_seed(200 + step)
    input_ids = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    return dict(input_ids=input_ids, labels=input_ids.clone())


def _local(batch):
    """This DP rank's rows: equal row counts and no ignored targets, so the mean of the DP ranks' mean losses is the
    mean over the concatenated batch."""
    rows = batch["input_ids"].shape[0] // ps.get_data_parallel_size()
    start = ps.get_data_parallel_rank() * rows
    return {k: v[start:start + rows] for k, v in batch.items()}


def case_trainer_api_equals_dense(zero_one: bool):
    from nxdtp.models import parallelize_model
    from tests.test_models_bert import _check_weights

    dense = _dense_llama()
    nxd_config = nxdtp.neuronx_distributed_config(
        tensor_parallel_size=2, optimizer_config={"zero_one_enabled": zero_one, "max_grad_norm": MAX_NORM},
        activation_checkpoint_config="full", sequence_parallel=True)
    model = nxdtp.initialize_parallel_model(nxd_config, copy.deepcopy, False, dense)   # model_fn(*args)
    what = f"zero_one={zero_one}"

    # NxDModel: the module's names and keys, attributes falling back to it.
    assert isinstance(model, nxdtp.trainer.NxDModel) and model.training
    reference_keys = list(parallelize_model(copy.deepcopy(dense), sequence_parallel=True).state_dict())
    assert list(model.state_dict()) == reference_keys, "state_dict keys changed"
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in dense.named_parameters()]
    assert model.config is model.module.config and model.dtype == torch.float32
    assert model.lm_head is model.module.lm_head   # __getattr__ falls back to the module
    assert any(getattr(p, "sequence_parallel_enabled", False) for p in model.parameters()), "no sequence parallelism"
    layers = [m for m in model.modules() if isinstance(m, transformers.models.llama.modeling_llama.LlamaDecoderLayer)]
    assert len(layers) == 2
    attention_calls = []
    for layer in layers:
        layer.self_attn.register_forward_pre_hook(lambda *_: attention_calls.append(1))

    optimizer = nxdtp.initialize_parallel_optimizer(nxd_config, torch.optim.AdamW, model.parameters(), **ADAMW)
    assert isinstance(optimizer, nxdtp.trainer.NxDOptimizer)
    assert type(optimizer.optimizer).__name__ == ("NeuronZero1Optimizer" if zero_one else "AdamW")
    assert optimizer.grad_norm is None
    dense_optimizer = torch.optim.AdamW(dense.parameters(), **ADAMW)

    losses, dense_losses = [], []
    for step in range(STEPS):
        batch = _global_batch(step)
        dense_optimizer.zero_grad()
        dense_loss = dense(**batch).loss
        dense_loss.backward()
        dense_norm = torch_clip_grad_norm_(dense.parameters(), MAX_NORM)
        assert dense_norm > 1.5 * MAX_NORM, f"{what}: max_norm {MAX_NORM} does not clip ({dense_norm})"
        dense_optimizer.step()

        optimizer.zero_grad()
        attention_calls.clear()
        loss = model.run_train(**_local(batch))
        # "full" checkpointing: every attention ran twice (forward and the recompute in backward).
        assert len(attention_calls) == 2 * len(layers), f"{what}: {len(attention_calls)} attention calls"
        if zero_one:   # NxD's default mixed precision with ZeRO-1: gradients accumulate in fp32 main_grad
            assert all(p.grad is None and p.main_grad is not None for p in model.parameters())
        optimizer.step()
        torch.testing.assert_close(optimizer.grad_norm, dense_norm, **TOL,
                                   msg=lambda m: f"{what} step {step} grad_norm: {m}")
        losses.append(float(loss))
        dense_losses.append(float(dense_loss))
    optimizer.zero_grad()
    if not zero_one:   # NxD's zero_grad keeps zero gradients
        assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    _check_weights(model.module, dense, what)
    return losses, dense_losses


@pytest.mark.parametrize("zero_one", [True, False], ids=["zero1", "nxd_optimizer"])
def test_trainer_api_tp2_dp2_equals_dense(worlds, zero_one):
    results = worlds(4).run(case_trainer_api_equals_dense, tensor_model_parallel_size=2, zero_one=zero_one)
    dense_losses = results[0][1]
    for step in range(STEPS):
        # TP ranks agree; the DP ranks' losses (their own rows) average to the dense loss of the global batch.
        assert results[0][0][step] == results[1][0][step] and results[2][0][step] == results[3][0][step]
        assert results[0][0][step] != results[2][0][step], "the DP ranks trained on the same rows"
        mean = (results[0][0][step] + results[2][0][step]) / 2
        assert mean == pytest.approx(dense_losses[step], rel=1e-5, abs=1e-5), (step, mean, dense_losses[step])


# ---- meta-device init with param_init_fn -----------------------------------------------------------------------------

def nxd_llama_init_weights(module, device):
    """NxD's Llama ``init_weights`` with random norms: the parallel layers re-draw their dense weights, biases zero."""
    from nxdtp.layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
    from nxdtp.modules.qkv_linear import GQAQKVColumnParallelLinear

    for key, child in module._modules.items():   # NxD's: rotary frequencies made again (meta with include_buffers)
        if type(child).__name__ == "LlamaRotaryEmbedding":
            module._modules[key] = type(child)(child.config)
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ParallelEmbedding)):
        module.init_weight_cpu()
        if getattr(module, "bias", None) is not None:
            module.bias.data.zero_()
    elif isinstance(module, GQAQKVColumnParallelLinear):
        module.initialize_weight_biases()
    elif type(module).__name__ == "LlamaRMSNorm":
        module.weight.data.normal_()


def _dense_drawn_like_init_weights(config):
    torch.manual_seed(11)
    dense = transformers.LlamaForCausalLM(config)
    torch.manual_seed(11)
    with torch.no_grad():
        for module in dense.modules():
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.kaiming_uniform_(module.weight, a=5 ** 0.5)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, torch.nn.Embedding):
                torch.nn.init.normal_(module.weight)
            elif type(module).__name__ == "LlamaRMSNorm":
                module.weight.normal_()
    return dense


def case_meta_init(include_buffers: bool):
    from tests.test_models_bert import _check_weights
    from tests.test_models_decoders import _config

    config = _config("llama", kv_heads=2)
    nxd_config = nxdtp.neuronx_distributed_config(
        tensor_parallel_size=2, model_init_config={"meta_device_init": True,
                                                   "param_init_fn": nxd_llama_init_weights})
    torch.manual_seed(1000 + ps.get_rank())   # model_fn's own draws differ per rank; only param_init_fn's count
    built_on = []

    def model_fn(cfg):
        model = transformers.LlamaForCausalLM(cfg)
        built_on.append((next(model.parameters()).device.type, next(model.buffers()).device.type))
        return model

    torch.manual_seed(11)
    model = nxdtp.initialize_parallel_model(nxd_config, lambda: model_fn(config), include_buffers)
    assert built_on == [("meta", "meta" if include_buffers else "cpu")]
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    dense = _dense_drawn_like_init_weights(config)
    _check_weights(model.module, dense, "meta init")
    batch = _global_batch(0)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).loss, dense(**batch).loss, **TOL)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("include_buffers", [False, True])
def test_meta_device_init_gives_the_same_model_on_every_dp_rank(worlds, include_buffers):
    results = worlds(4).run(case_meta_init, tensor_model_parallel_size=2, include_buffers=include_buffers)
    for name in results[0]:
        assert torch.equal(results[0][name], results[2][name]), f"{name}: DP replicas differ"
        assert torch.equal(results[1][name], results[3][name]), f"{name}: DP replicas differ"


# ---- pad_model, checkpointing by class -------------------------------------------------------------------------------

def case_pad_model_and_checkpoint_classes():
    from tests.test_models_bert import _check_weights

    # 6 heads of 4 (no GQA) on tp=4: TP does not divide the heads, pad_model pads them with zero heads.
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=6, max_position_embeddings=32,
                                      tie_word_embeddings=False)

    def build():
        torch.manual_seed(3)
        return transformers.LlamaForCausalLM(config)

    # The advice is the trainer API's switch, not parallelize_model's pad_heads, which this API does not take.
    with pytest.raises(ValueError, match=r"num_attention_heads=6 .* pass pad_model=True to "
                                         r"neuronx_distributed_config") as refused:
        nxdtp.initialize_parallel_model(nxdtp.neuronx_distributed_config(tensor_parallel_size=4), build)
    assert "pad_heads" not in str(refused.value)
    mlp = transformers.models.llama.modeling_llama.LlamaMLP
    attention = transformers.models.llama.modeling_llama.LlamaAttention
    nxd_config = nxdtp.neuronx_distributed_config(tensor_parallel_size=4, pad_model=True,
                                                  activation_checkpoint_config=[mlp, attention])
    model = nxdtp.initialize_parallel_model(nxd_config, build)
    dense = build()
    calls = []
    for module in model.modules():   # a child of each: the recompute calls the checkpointed module's forward itself
        if isinstance(module, (mlp, attention)):
            (module.down_proj if isinstance(module, mlp) else module.o_proj).register_forward_pre_hook(
                lambda *_: calls.append(1))
    input_ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = model.run_train(input_ids=input_ids, labels=input_ids)
    assert len(calls) == 2 * 4, f"{len(calls)} calls of the 4 checkpointed modules (forward and recompute)"
    dense_loss = dense(input_ids=input_ids, labels=input_ids).loss
    torch.testing.assert_close(loss, dense_loss, **TOL)
    _check_weights(model.module, dense, "pad_model")
    with pytest.raises(RuntimeError, match="_no_split_modules"):
        nxdtp.initialize_parallel_model(nxdtp.neuronx_distributed_config(
            tensor_parallel_size=4, activation_checkpoint_config="full"), lambda: torch.nn.Linear(4, 4))
    return float(loss)


def test_pad_model_and_checkpointing_by_class(worlds):
    losses = worlds(4).run(case_pad_model_and_checkpoint_classes, tensor_model_parallel_size=4)
    assert len(set(losses)) == 1


# ---- sequential_move_factor ------------------------------------------------------------------------------------------

def case_build_in_waves(factor: int):
    import os
    import time

    from nxdtp import comm
    from tests.test_models_bert import _check_weights

    dense = _dense_llama()
    spans = []

    def model_fn():
        start = time.monotonic()
        model = copy.deepcopy(dense)
        time.sleep(0.2)
        spans.append((start, time.monotonic()))
        return model

    os.environ["LOCAL_WORLD_SIZE"] = "4"   # the 4 ranks of the pool share this host
    try:
        nxd_config = nxdtp.neuronx_distributed_config(
            tensor_parallel_size=2, model_init_config={"sequential_move_factor": factor})
        model = nxdtp.initialize_parallel_model(nxd_config, model_fn)
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
    _check_weights(model.module, dense, f"sequential_move_factor={factor}")
    return comm.all_gather_object(spans[0])


@pytest.mark.parametrize("factor", [1, 2])
def test_local_ranks_build_in_waves_of_sequential_move_factor(worlds, factor):
    spans = worlds(4).run(case_build_in_waves, tensor_model_parallel_size=2, factor=factor)[0]
    waves = [spans[w * factor:(w + 1) * factor] for w in range(4 // factor)]
    for earlier, later in zip(waves, waves[1:]):
        assert max(end for _, end in earlier) <= min(start for start, _ in later), f"waves overlap: {spans}"
    if factor == 2:   # the two ranks of a wave build at the same time
        assert all(max(s for s, _ in wave) < min(e for _, e in wave) for wave in waves), spans


# ---- sequence-parallel gradients in main_grad ------------------------------------------------------------------------

def case_sequence_parallel_main_grad_is_summed():
    from nxdtp.layers import LayerNorm

    def rank_input(tp_rank):   # each TP rank's part of the sequence
        return torch.randn(3, 4, generator=torch.Generator().manual_seed(tp_rank))

    def local_grads(layer, x):
        layer.zero_grad()
        layer(x).square().sum().backward()
        return [p.grad.clone() for p in layer.parameters()]

    torch.manual_seed(0)
    norm = LayerNorm(4, sequence_parallel_enabled=True)   # a sequence-parallel layer built by hand: no plan sums it
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    reference = copy.deepcopy(norm)
    expected = [a + b for a, b in zip(local_grads(reference, rank_input(0)), local_grads(reference, rank_input(1)))]
    # ZeRO-1 with NxD's default mixed precision: gradients accumulate in fp32 main_grad, .grad stays None.
    nxd_config = nxdtp.neuronx_distributed_config(tensor_parallel_size=2, sequence_parallel=True,
                                                  optimizer_config={"zero_one_enabled": True})
    optimizer = nxdtp.initialize_parallel_optimizer(nxd_config, torch.optim.SGD, norm.parameters(), lr=0.0)
    norm(rank_input(ps.get_tensor_model_parallel_rank())).square().sum().backward()
    assert all(p.grad is None for p in norm.parameters())
    optimizer.step()
    for p, e in zip(norm.parameters(), expected):
        torch.testing.assert_close(p.main_grad, e, **TOL)
    return True


def test_sequence_parallel_gradients_in_main_grad_are_summed_over_tp(worlds):
    assert worlds(2).run(case_sequence_parallel_main_grad_is_summed, tensor_model_parallel_size=2) == [True, True]


# ---- mixed_precision_config on the ZeRO-1 path -----------------------------------------------------------------------

def case_zero1_options_from_the_config():
    seen = []
    for mixed in (None, {"use_fp32_grad_acc": False, "use_master_weights_in_ckpt": True}):
        nxd_config = nxdtp.neuronx_distributed_config(
            tensor_parallel_size=1, mixed_precision_config=mixed,
            optimizer_config={"zero_one_enabled": True, "max_grad_norm": 0.3})
        layer = torch.nn.Linear(3, 5)
        zero = nxdtp.initialize_parallel_optimizer(nxd_config, torch.optim.SGD, layer.parameters(), lr=0.1).optimizer
        seen.append((zero.use_grad_acc_hook, zero.higher_cc_precision, zero.save_master_weights, zero.max_norm,
                     zero.sharding_groups, str(zero.optimizer_dtype)))
        layer(torch.ones(2, 3)).sum().backward()
        seen.append(layer.weight.grad is None)
    return seen


def test_mixed_precision_config_reaches_zero1(worlds):
    seen = worlds(2).run(case_zero1_options_from_the_config, tensor_model_parallel_size=1)[0]
    assert seen == [(True, True, False, 0.3, [[0, 1]], "torch.float32"), True,   # NxD's defaults with ZeRO-1
                    (False, False, True, 0.3, [[0, 1]], "torch.float32"), False]

"""The one way to shard a model, and the names that left the top level, keep working with a clear warning or error.

``parallelize_model(model, plan)`` is the same call as ``parallelize(model, plan)``; with a plan of its own it refuses
the options that shape a family's plan (they would be ignored). Deprecated paths warn, naming the new path, and return
the same object. Single process, simulated topologies: what a rank of tp=2 holds is compared with the dense module.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import nxdtp
from nxdtp.parallel_state import simulated_topology
from nxdtp.plan import ColumnParallel, Plan, RowParallel, parallelize


def _dense(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


def _plan() -> Plan:
    return Plan(styles={"0": ColumnParallel(), "2": RowParallel()})


@pytest.mark.parametrize("rank", [0, 1])
def test_parallelize_model_with_a_plan_is_parallelize(rank):
    dense = _dense(seed=3)
    with simulated_topology(world_size=2, rank=rank, tensor_model_parallel_size=2):
        by_model = nxdtp.parallelize_model(copy.deepcopy(dense), _plan(), broadcast_replicated=False)
        by_plan = parallelize(copy.deepcopy(dense), _plan(), broadcast_replicated=False)
    assert nxdtp.parallelize is parallelize
    assert [type(m) for m in by_model] == [type(m) for m in by_plan]
    got, expected = dict(by_model.named_parameters()), dict(by_plan.named_parameters())
    assert got.keys() == expected.keys()
    for name, param in got.items():
        assert torch.equal(param, expected[name]), name
    # Rank r holds rows (column layer) and columns (row layer) r of 2 of the dense weights; the row bias is whole.
    rows = slice(4 * rank, 4 * rank + 4)
    assert torch.equal(got["0.weight"], dense[0].weight[rows]) and torch.equal(got["0.bias"], dense[0].bias[rows])
    assert torch.equal(got["2.weight"], dense[2].weight[:, rows]) and torch.equal(got["2.bias"], dense[2].bias)


@pytest.mark.parametrize("options,named", [
    (dict(sequence_parallel=True), "sequence_parallel=True"),
    (dict(make_vocab_size_divisible_by=8), "make_vocab_size_divisible_by=8"),
    (dict(pad_heads=False, sequence_parallel=True), "pad_heads=False, sequence_parallel=True"),
])
def test_parallelize_model_refuses_options_a_given_plan_would_ignore(options, named):
    model = _dense(seed=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with simulated_topology(world_size=2, rank=0, tensor_model_parallel_size=2):
        with pytest.raises(ValueError, match=rf"parallelize_model: {named} shape a model family's plan and would be "
                                             rf"ignored with plan= given"):
            nxdtp.parallelize_model(model, _plan(), **options)
        with pytest.raises(TypeError, match=r"plan=\{'0': 'column'\} is not an nxdtp.Plan"):
            nxdtp.parallelize_model(model, {"0": "column"})
    assert all(type(m) in (nn.Linear, nn.ReLU) for m in model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_options_after_the_model_are_keyword_only():
    with pytest.raises(TypeError):
        nxdtp.parallelize_model(_dense(seed=5), None, True)


def test_names_that_left_the_top_level_warn_and_still_work():
    from nxdtp.random import checkpoint

    with pytest.warns(DeprecationWarning, match=r"nxdtp.checkpoint is deprecated .* use nxdtp.random.checkpoint"):
        assert nxdtp.checkpoint is checkpoint
    assert "checkpoint" not in nxdtp.__all__ and "checkpointing" not in nxdtp.__all__
    with pytest.raises(AttributeError, match="module 'nxdtp' has no attribute 'no_such_name'"):
        nxdtp.no_such_name  # noqa: B018
    for name in nxdtp.__all__:
        assert getattr(nxdtp, name) is not None, name


def case_bert_alias_loads_what_the_generic_call_loads(directory: str) -> bool:
    import warnings

    import transformers

    from nxdtp.models import bert, from_pretrained_sharded

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        by_alias = bert.from_pretrained_sharded(directory)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any("call nxdtp.models.from_pretrained_sharded(model_dir, model_class=...)" in m for m in messages), messages
    by_name = from_pretrained_sharded(directory, model_class=transformers.BertForPreTraining)
    assert type(by_alias) is type(by_name) and isinstance(by_alias, transformers.BertForPreTraining)
    expected = dict(by_name.named_parameters())
    for name, param in by_alias.named_parameters():
        assert torch.equal(param, expected[name]), name
    return True


@pytest.mark.parametrize("world,tp", [(2, 2)])
def test_bert_from_pretrained_sharded_is_a_deprecated_alias(worlds, tmp_path, world, tp):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=16, max_position_embeddings=16)
    torch.manual_seed(6)
    transformers.BertForPreTraining(config).save_pretrained(tmp_path)
    assert all(worlds(world).run(case_bert_alias_loads_what_the_generic_call_loads, tensor_model_parallel_size=tp,
                                 directory=str(tmp_path)))


def test_the_hf_trainer_module_has_a_name_unlike_nxd_trainer_api():
    import importlib
    import sys

    pytest.importorskip("transformers")
    from nxdtp.models.hf_trainer import TensorParallelTrainer

    sys.modules.pop("nxdtp.models.trainer", None)
    with pytest.warns(DeprecationWarning, match="import TensorParallelTrainer from nxdtp.models.hf_trainer"):
        old = importlib.import_module("nxdtp.models.trainer")
    assert old.TensorParallelTrainer is TensorParallelTrainer

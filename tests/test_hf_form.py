"""nxdtp.checkpointing.hf_form: the form transformers saves a model's tensors in, where it differs from what the model
holds (transformers 5's weight conversions, reversed one held tensor at a time)."""

from __future__ import annotations

import pytest
import torch

from nxdtp.checkpointing.dense import dense_layout
from nxdtp.checkpointing.hf_form import SavedForm
from nxdtp.checkpointing.index import split_state_dict

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                                reason="transformers 4 saves tensors as its models hold them")


def _meta(model_class, config):
    with torch.device("meta"):
        return model_class(config)


def _layout(model):
    return dense_layout(split_state_dict(model.state_dict(), 1)[1])


def test_a_mixture_of_experts_is_saved_one_expert_at_a_time_as_transformers_saves_it():
    config = transformers.MixtralConfig(vocab_size=50, hidden_size=16, intermediate_size=8, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=3)
    model = _meta(transformers.MixtralForCausalLM, config)
    form = SavedForm.of_model(model, _layout(model))
    assert form is not None and form.converts("model.layers.0.mlp.experts.gate_up_proj")
    assert not form.converts("model.layers.0.self_attn.q_proj.weight")
    gate_up = torch.randn(3, 16, 16)
    parts = form.tensors("model.layers.0.mlp.experts.gate_up_proj", gate_up)
    # gate rows then up rows of each expert: HF's w1 (gate) and w3 (up)
    assert torch.equal(parts["model.layers.0.block_sparse_moe.experts.1.w1.weight"], gate_up[1, :8])
    assert torch.equal(parts["model.layers.0.block_sparse_moe.experts.2.w3.weight"], gate_up[2, 8:])
    real = transformers.MixtralForCausalLM(config)
    expected_in_order = transformers.core_model_loading.revert_weight_conversion(real, real.state_dict())
    assert {name for name, _, _ in form.layout()} == set(expected_in_order)
    assert [name for name, _, _ in form.save_order()] == list(expected_in_order)


def test_models_saved_as_they_are_held_have_no_form():
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=8, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = _meta(transformers.LlamaForCausalLM, config)
    assert SavedForm.of_model(model, _layout(model)) is None
    assert SavedForm.of_model(torch.nn.Linear(2, 2), [("weight", torch.float32, (2, 2))]) is None


def test_a_conversion_that_joins_held_tensors_is_written_as_held():
    """Dinov2's SwiGLU FFN holds gate and up projections that transformers saves as one ``weights_in``: no held
    tensor alone gives a saved one, so the form declines and the tensors are written as held (which transformers
    reads too)."""
    config = transformers.Dinov2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=32, use_swiglu_ffn=True, image_size=8, patch_size=4)
    model = _meta(transformers.Dinov2Model, config)
    assert any(key.endswith("gate_proj.weight") for key, _, _ in _layout(model))
    assert SavedForm.of_model(model, _layout(model)) is None

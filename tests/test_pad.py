"""NxD's head-padding helpers (nxdtp.pad) and the head layout they share with the plans (nxdtp.heads).

generate_padding_mask is checked against the examples NxD's documentation works through and against the mask the
Llama plan actually installs; pad_model against the unpadded module's outputs and gradients, and its specs against the
dense weights merging must give back.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

from nxdtp import parallel_state as ps
from nxdtp.layers import ColumnParallelLinear, RowParallelLinear
from nxdtp.models import parallelize_model
from nxdtp.pad import generate_padding_mask, get_number_of_extra_heads, pad_model
from tests.model_helpers import randomised


@pytest.mark.parametrize("heads,tp", [(8, 4), (6, 4), (25, 8), (1, 2), (48, 32), (7, 1)])
def test_extra_heads(heads, tp):
    extra = get_number_of_extra_heads(heads, tp)
    assert 0 <= extra < tp and (heads + extra) % tp == 0


def test_mask_for_nxds_trn2_example():
    # NxD's example: 48 query heads, 8 KV heads at TP 32: padded to 64 heads, each KV head on 4 adjacent ranks with 2
    # query heads each; the group of 6 real heads per KV head fills the first 3 copies, the 4th copy holds 2 zero heads.
    for rank in range(32):
        mask = generate_padding_mask(48, 64, 8, 32, rank)
        expected = [False, False] if rank % 4 == 3 else [True, True]
        assert mask.dtype == torch.bool and mask.tolist() == expected, (rank, mask)


def test_mask_for_nxds_trn1_example():
    # NxD's example: 56 query heads, 8 KV heads at TP 32, copies tiled (K0..K7, K0..K7, ...): the last round of copies
    # (ranks 24-31) holds one real and one zero head each.
    for rank in range(32):
        mask = generate_padding_mask(56, 64, 8, 32, rank, hardware_type="trn1")
        assert mask.tolist() == ([True, False] if rank >= 24 else [True, True]), (rank, mask)


def test_mask_without_grouped_heads_marks_the_last_heads():
    masks = [generate_padding_mask(6, 8, 6, 4, rank).tolist() for rank in range(4)]
    assert masks == [[True, True], [True, True], [True, True], [False, False]]


def test_mask_refuses_bad_arguments():
    with pytest.raises(ValueError, match=r"num_heads_with_pad=7 is not the padding nxdtp uses .*: 8"):
        generate_padding_mask(6, 7, 6, 4, 0)
    with pytest.raises(ValueError, match=r"tp_rank=4 is outside tensor parallel degree 4"):
        generate_padding_mask(6, 8, 6, 4, 4)
    with pytest.raises(ValueError, match=r"hardware_type='trn9' is not supported"):
        generate_padding_mask(6, 8, 6, 4, 0, hardware_type="trn9")


@pytest.mark.parametrize("kv_heads", [2, 6])
def test_mask_matches_the_plans_masked_columns(kv_heads):
    # The Llama plan masks the output projection's input columns of zero heads; per head, that is the NxD mask.
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=6, num_key_value_heads=kv_heads)
    dense = transformers.LlamaForCausalLM(config)
    for rank in range(4):
        with ps.simulated_topology(world_size=4, rank=rank, tensor_model_parallel_size=4):
            model = parallelize_model(copy.deepcopy(dense), broadcast_replicated=False)
        columns = model.model.layers[0].self_attn.o_proj.nxdtp_real_columns.view(-1, 8)
        assert (columns == columns[:, :1]).all()
        assert columns[:, 0].bool().tolist() == generate_padding_mask(6, 8, kv_heads, 4, rank).tolist(), rank


class _Attention(nn.Module):
    """A hand-built attention block from nxdtp's layers, as an NxD user writes one (heads of 4 dims)."""

    def __init__(self, heads: int, head_dim: int = 4):
        super().__init__()
        hidden = heads * head_dim
        self.heads, self.head_dim = heads, head_dim
        self.q, self.k, self.v = (ColumnParallelLinear(hidden, hidden, gather_output=False) for _ in range(3))
        self.o = RowParallelLinear(hidden, hidden, input_is_parallel=True)

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = (layer(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for layer in (self.q, self.k, self.v))
        attended = torch.softmax(q @ k.transpose(-1, -2) / self.head_dim ** 0.5, dim=-1) @ v
        return self.o(attended.transpose(1, 2).reshape(batch, seq, -1))


def test_pad_model_keeps_what_the_module_computes():
    with ps.simulated_topology(world_size=1, rank=0, tensor_model_parallel_size=1):
        _check_pad_model_keeps_what_the_module_computes()


def _check_pad_model_keeps_what_the_module_computes():
    torch.manual_seed(0)
    block = randomised(_Attention(heads=3), seed=1)
    padded = copy.deepcopy(block)
    seen = []

    def hook(module, ratio):
        seen.append(type(module).__name__)
        if isinstance(module, _Attention):
            module.heads = int(module.heads * ratio)

    assert pad_model(padded, tp_degree=2, n_heads=3, wrapped_classes=(_Attention,), pad_hook_fn=hook) is padded
    assert padded.heads == 4 and "_Attention" in seen
    assert tuple(padded.q.weight.shape) == (16, 12) and tuple(padded.o.weight.shape) == (12, 16)
    assert padded.q.output_size_per_partition == 16 and padded.o.input_size_per_partition == 16
    x = torch.randn(2, 5, 12, requires_grad=True)
    x_padded = x.detach().clone().requires_grad_()
    torch.testing.assert_close(padded(x_padded), block(x), atol=1e-6, rtol=1e-5)
    block(x).square().sum().backward()
    padded(x_padded).square().sum().backward()
    torch.testing.assert_close(x_padded.grad, x.grad, atol=1e-6, rtol=1e-5)
    for name in ("q", "k", "v", "o"):
        layer, original = getattr(padded, name), getattr(block, name)
        spec = layer.param_specs()["weight"]
        # Merging strips the zero heads: the dense weight and its gradient are the unpadded module's.
        torch.testing.assert_close(spec.dense_from_full(layer.weight.detach()), original.weight.detach(), atol=0,
                                   rtol=0)
        torch.testing.assert_close(spec.dense_from_full(layer.weight.grad), original.weight.grad, atol=1e-6,
                                   rtol=1e-5)


def test_pad_model_pads_each_ranks_shard_and_merges_back():
    # At TP 2 every rank's shard grows by the same ratio; the specs strip each rank's zero rows on merge.
    dense_q = torch.randn(24, 8)
    shards = []
    for rank in range(2):
        with ps.simulated_topology(world_size=2, rank=rank, tensor_model_parallel_size=2):
            layer = ColumnParallelLinear(8, 24, bias=True, gather_output=False)
            with torch.no_grad():
                layer.weight.copy_(dense_q[rank * 12:(rank + 1) * 12])
            pad_model(layer, tp_degree=4, n_heads=6)
        assert tuple(layer.weight.shape) == (16, 8) and tuple(layer.bias.shape) == (16,)
        assert torch.equal(layer.weight[12:], torch.zeros(4, 8))
        shards.append(layer.weight.detach())
    spec = layer.param_specs()["weight"]
    assert spec.full_shape == (32, 8) and spec.unpadded_shape == (24, 8) and spec.pad_groups == 2
    assert torch.equal(spec.dense_from_full(torch.cat(shards)), dense_q)
    assert torch.equal(spec.full_from_dense(dense_q), torch.cat(shards))


def test_pad_model_with_divisible_heads_changes_nothing_and_refuses_fused_layers():
    with ps.simulated_topology(world_size=1, rank=0, tensor_model_parallel_size=1):
        block = _Attention(heads=4)
        before = {k: v.clone() for k, v in block.state_dict().items() if isinstance(v, torch.Tensor)}
        pad_model(block, tp_degree=2, n_heads=4)
        assert all(torch.equal(block.state_dict()[k], v) for k, v in before.items())
        fused = ColumnParallelLinear(8, 24, stride=3, gather_output=False)
        with pytest.raises(ValueError, match=r"pad_model cannot pad ColumnParallelLinear with stride=3"):
            pad_model(fused, tp_degree=4, n_heads=6)
        with pytest.raises(ValueError, match=r"positive n_heads and tp_degree, got n_heads=0"):
            pad_model(fused, tp_degree=4, n_heads=0)

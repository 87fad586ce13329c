"""NxD's head-padding helpers (nxdtp.pad) and the head layout they share with the plans (nxdtp.heads).

generate_padding_mask is checked against masks cut from the whole model's padded heads as NxD lays them out (NxD's
documented cases, a user's, and random ones, on Trainium1 and Trainium2), for NxD's masks outside its layouts, its
error types, and against the mask the Llama plan actually installs; pad_model against the unpadded module's outputs
and gradients, and its specs against the dense weights merging must give back.
"""

from __future__ import annotations

import copy
import enum
import re

import pytest
import torch
import transformers
from torch import nn

from nxdtp import parallel_state as ps
from nxdtp.layers import ColumnParallelLinear, RowParallelLinear
from nxdtp.models import parallelize_model
from nxdtp.pad import generate_padding_mask, get_number_of_extra_heads, pad_model
from nxdtp.utils import hardware
from tests.model_helpers import randomised


@pytest.mark.parametrize("heads,tp", [(8, 4), (6, 4), (25, 8), (1, 2), (48, 32), (7, 1)])
def test_extra_heads(heads, tp):
    extra = get_number_of_extra_heads(heads, tp)
    assert 0 <= extra < tp and (heads + extra) % tp == 0


def _dense_masks(heads, heads_with_pad, kv_heads, tp, hardware_type):
    """Every rank's mask, cut from the whole model's padded query heads as NxD lays them out.

    Each KV head's query heads come in HF order with the real ones first. On Trainium2 the copies of a KV head sit on
    adjacent ranks: a block of max(tp / kv, 1) ranks shares the block's KV heads, its query heads are the block's real
    ones then zeros, and the blocks follow one another, so rank r's mask is chunk r of the concatenation. On Trainium1
    the copies are tiled (K0..Kn, K0..Kn, ...): rank r holds copy r // kv of KV head r % kv, that is slice r // kv of
    the head's padded query group. NxD's Trainium1 rule gives each rank one KV head (rank r's head is r % kv, copy
    r // kv of max(tp / kv, 1)), also when tp < kv."""
    per_rank, group = heads_with_pad // tp, heads // kv_heads
    if hardware_type == "trn1":
        copies = max(tp // kv_heads, 1)
        padded_groups = [torch.arange(per_rank * copies) < group for _ in range(kv_heads)]
        return [padded_groups[rank % kv_heads].chunk(copies)[rank // kv_heads] for rank in range(tp)]
    block_ranks = max(tp // kv_heads, 1)
    block_kv_heads = kv_heads * block_ranks // tp
    block = torch.arange(per_rank * block_ranks) < group * block_kv_heads
    return list(block.repeat(tp // block_ranks).chunk(tp))


def _masks(heads, heads_with_pad, kv_heads, tp, hardware_type):
    return [generate_padding_mask(heads, heads_with_pad, kv_heads, tp, rank, hardware_type=hardware_type)
            for rank in range(tp)]


def _assert_masks(actual, expected, what):
    assert len(actual) == len(expected), what
    for rank, (mask, want) in enumerate(zip(actual, expected)):
        assert mask.dtype == torch.bool and not mask.requires_grad, (what, rank)
        assert torch.equal(mask, want), (what, rank, mask, want)


# NxD's documented cases (its docstring, the comments of its Trainium1 / Trainium2 branches and its unit tests), and the
# case a user reported: 24 query heads padded to 32 at TP 4 with 8 KV heads (two KV heads on each rank).
NXD_CASES = [(48, 64, 8, 32, "trn1"), (48, 64, 8, 32, "trn2"), (56, 64, 8, 32, "trn1"), (200, 224, 8, 32, "trn1"),
             (200, 224, 8, 32, "trn2"), (24, 32, 8, 4, "trn2")]


@pytest.mark.parametrize("heads,heads_with_pad,kv_heads,tp,hardware_type", NXD_CASES, ids=str)
def test_masks_of_nxds_cases(heads, heads_with_pad, kv_heads, tp, hardware_type):
    what = (heads, heads_with_pad, kv_heads, tp, hardware_type)
    expected = _dense_masks(heads, heads_with_pad, kv_heads, tp, hardware_type)
    _assert_masks(_masks(heads, heads_with_pad, kv_heads, tp, hardware_type), expected, what)
    # NxD's enum members and nxdtp's copy of them give the same masks as the names.
    enum_member = hardware(hardware_type)
    _assert_masks(_masks(heads, heads_with_pad, kv_heads, tp, enum_member), expected, what)
    assert sum(int(m.sum()) for m in expected) == heads, what   # the layouts keep every real head


def test_users_case_pads_heads_6_and_7_of_every_rank():
    for rank, mask in enumerate(_masks(24, 32, 8, 4, hardware.TRN2)):
        assert (~mask).nonzero().flatten().tolist() == [6, 7], rank


@pytest.mark.parametrize("seed", range(6))
def test_masks_of_random_layouts(seed):
    # Random layouts NxD's rules describe: tp a multiple of the KV heads (both hardware types) or, on Trainium2, the KV
    # heads a multiple of tp; any group size, and any padding that keeps a whole number of heads per rank.
    g = torch.Generator().manual_seed(seed)
    draw = lambda low, high: int(torch.randint(low, high + 1, (1,), generator=g))  # noqa: E731
    for _ in range(20):
        small, factor = draw(1, 4), draw(1, 4)
        hardware_type = ("trn1", "trn2")[draw(0, 1)]
        kv_heads, tp = (small, small * factor) if hardware_type == "trn1" or draw(0, 1) else (small * factor, small)
        heads = kv_heads * draw(1, 7)
        heads_with_pad = tp * (-(-heads // tp) + draw(0, 2))
        what = (heads, heads_with_pad, kv_heads, tp, hardware_type)
        expected = _dense_masks(heads, heads_with_pad, kv_heads, tp, hardware_type)
        assert sum(int(m.sum()) for m in expected) == heads, what
        _assert_masks(_masks(heads, heads_with_pad, kv_heads, tp, hardware_type), expected, what)


def test_none_and_names_mean_what_nxd_means():
    # NxD's None asks torch_neuronx for the platform; nxdtp has none to ask and uses Trainium2's rule (its layers'
    # layout). Platform names work as NxD's hardware(...) reads them; an enum from elsewhere (NxD's own) by its value.
    class OtherHardware(enum.Enum):
        TRN1 = "trn1"
        TRN2 = "trn2"

    trn1, trn2 = _dense_masks(48, 64, 8, 32, "trn1"), _dense_masks(48, 64, 8, 32, "trn2")
    assert not all(torch.equal(a, b) for a, b in zip(trn1, trn2))
    for hardware_type, expected in [(None, trn2), (OtherHardware.TRN2, trn2), (OtherHardware.TRN1, trn1),
                                    ("trn1n", trn1), ("inf2", trn1)]:
        _assert_masks(_masks(48, 64, 8, 32, hardware_type), expected, hardware_type)


@pytest.mark.parametrize("heads,heads_with_pad,kv_heads,tp,hardware_type", [
    (6, 8, 6, 4, "trn2"),      # heads without grouping, not divisible by tp: NxD gives each rank one real head
    (8, 12, 4, 6, "trn2"),     # neither tp nor the KV heads divide the other: NxD's rule marks every head padding
    (24, 32, 8, 4, "trn1"),    # Trainium1's rule assumes one KV head per rank
])
def test_nxds_masks_outside_its_layouts_are_kept_with_a_warning(heads, heads_with_pad, kv_heads, tp, hardware_type):
    # NxD returns these masks though they do not mark num_heads real heads; nxdtp returns the same (a model trained
    # with NxD's mask keeps its behaviour) and says so.
    what = (heads, heads_with_pad, kv_heads, tp, hardware_type)
    with pytest.warns(UserWarning, match=rf"num_kv_heads={kv_heads} .* tp_degree={tp}"):
        masks = _masks(heads, heads_with_pad, kv_heads, tp, hardware_type)
    expected = _dense_masks(heads, heads_with_pad, kv_heads, tp, hardware_type)
    assert sum(int(m.sum()) for m in expected) != heads, what
    _assert_masks(masks, expected, what)


@pytest.mark.parametrize("hardware_type", ["trn999", "trn3", hardware.TRN3, hardware.CUSTOM, 2])
def test_unknown_hardware_type_raises_what_nxd_and_nxdtp_callers_catch(hardware_type):
    # NxD raises RuntimeError("Unexpected hardware_type ..."); nxdtp raised ValueError before: both are caught.
    for caught in (RuntimeError, ValueError):
        with pytest.raises(caught, match=rf"Unexpected hardware_type {re.escape(repr(hardware_type))}.*"
                                         r"hardware\.TRN1 or 'trn1'.*hardware\.TRN2, 'trn2' or None"):
            generate_padding_mask(48, 64, 8, 32, 0, hardware_type=hardware_type)


def test_zero_divisors_raise_what_nxd_raises():
    # NxD divides by tp_degree and num_kv_heads (and pad_model by n_heads): zero raises ZeroDivisionError there.
    for caught in (ZeroDivisionError, ValueError):
        with pytest.raises(caught, match=r"tp_degree=0 must be a positive int"):
            generate_padding_mask(6, 8, 2, 0, 0)
        with pytest.raises(caught, match=r"num_kv_heads=0 must be a positive int"):
            generate_padding_mask(6, 8, 0, 4, 0)
        with pytest.raises(caught, match=r"tp_degree=0 must be a positive int"):
            get_number_of_extra_heads(6, 0)
        with pytest.raises(caught, match=r"n_heads=0 must be a positive int"):
            pad_model(nn.Linear(2, 2), tp_degree=4, n_heads=0)
        with pytest.raises(caught, match=r"tp_degree=0 must be a positive int"):
            pad_model(nn.Linear(2, 2), tp_degree=0, n_heads=4)


def test_arguments_that_describe_no_model_are_named():
    for args, message in [((6, 8, 6, 4, 4), r"tp_rank=4 is outside tensor parallel degree 4: use 0 to 3"),
                          ((6, 8, 6, 4, -1), r"tp_rank=-1 is outside tensor parallel degree 4"),
                          ((6, 7, 6, 4, 0), r"num_heads_with_pad=7 is not a multiple of tp_degree=4"),
                          ((6, 4, 6, 4, 0), r"num_heads_with_pad=4 is fewer than num_heads=6"),
                          ((6, 8, 4, 4, 0), r"num_heads=6 is not a multiple of num_kv_heads=4"),
                          ((-6, 8, 6, 4, 0), r"num_heads=-6 must be a positive int"),
                          ((6, 8, 6, -4, 0), r"tp_degree=-4 must be a positive int"),
                          ((0, 8, 6, 4, 0), r"num_heads=0 must be a positive int")]:
        with pytest.raises(ValueError, match=message) as raised:
            generate_padding_mask(*args)
        assert not isinstance(raised.value, ZeroDivisionError), args   # NxD divides by neither


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_mask_matches_the_plans_masked_columns(kv_heads):
    # The Llama plan masks the output projection's input columns of zero heads; per head, that is the NxD mask where
    # tp is a multiple of the KV heads (for 3 or 6 KV heads at tp 4 NxD's rule describes no layout, see above).
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
        with pytest.raises(ValueError, match=r"pad_model: n_heads=0 must be a positive int"):
            pad_model(fused, tp_degree=4, n_heads=0)

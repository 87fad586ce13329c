"""A tensor-parallel rank holds only its shards: memory counted as distinct storage bytes, never ``numel``.

A shard cut from a dense tensor as a view keeps the whole dense storage alive, while its ``numel`` says it holds 1/tp.
So every check here counts the bytes of the distinct storages behind a rank's parameters (``nxdtp.storage.held_bytes``)
and compares them with:

* the parameters' own bytes: at most 1.02x (a rank holds nothing beside its parameters' values);
* the dense model's: after ``parallelize_model`` a rank holds 1/tp of the dense bytes of every tensor it shards, plus
  the replicated ones whole, within 2% (the vocabularies here need no padding at tp 2 and 4);
* the dense Parameter objects a plan replaced are freed (weak references), so nothing of nxdtp keeps them.

Per layer (every NxD layer family, on CPU and meta) and per plan (Llama, BERT, GPT-2, a model sharded by the tp_plan
transformers ships), each at several ranks of a simulated topology in this process
(building a layer or a plan runs no collective once ``broadcast_replicated=False``); then the user's real calls in a
gloo world of two ranks: ``parallelize_model`` with its broadcast, ``from_pretrained_sharded``, NxD's
``initialize_parallel_model``, ``checkpointing.load`` of parameters and AdamW state, and PEFT's LoRA (its adapters
are made with a collective).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from nxdtp import parallel_state as ps
from nxdtp.conv import InputChannelParallelConv2d, OutputChannelParallelConv2d
from nxdtp.layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
from nxdtp.models import parallelize_model
from nxdtp.modules.qkv_linear import GQAQKVColumnParallelLinear
from nxdtp.spec import ShardedModule
from nxdtp.storage import held_bytes, owning, owns_its_storage
from tests.model_helpers import randomised

transformers = pytest.importorskip("transformers")

SLACK = 1.02   # the bound; a view of the dense tensor would be 1/tp-fold over it
RANKS = [pytest.param(2, 0, id="tp2-rank0"), pytest.param(2, 1, id="tp2-rank1"), pytest.param(4, 3, id="tp4-rank3")]


def _params(module: nn.Module):
    return list(dict.fromkeys(module.parameters()))   # each tied parameter once


def _own_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _check_holds_only_its_parameters(module: nn.Module, what: str) -> None:
    params = _params(module)
    held, own = held_bytes(params), _own_bytes(params)
    assert held <= SLACK * own, f"{what}: the parameters hold {held} bytes of storage for {own} bytes of values " \
                                f"({held / own:.2f}x): a shard is a view of a larger tensor"


# ---- the measure itself ----------------------------------------------------------------------------------------------

def test_held_bytes_counts_each_storage_once_and_whole():
    dense = torch.zeros(8, 4)
    view = dense[:2]
    assert held_bytes([view]) == dense.numel() * 4, "a view holds its base's storage"
    assert held_bytes([dense, view, dense]) == dense.numel() * 4, "one storage counted once"
    assert held_bytes([dense, torch.zeros(3)]) == (32 + 3) * 4
    meta = [torch.empty(4, device="meta"), torch.empty(4, device="meta")]
    assert held_bytes(meta) == 2 * 16, "meta storages are told apart although every data_ptr is 0"


def test_owning_copies_only_views_of_more():
    dense = torch.arange(12.0).reshape(4, 3)
    assert owning(dense) is dense and owns_its_storage(dense)
    for piece in (dense[1:3], dense[:, :1], dense.t(), dense[:2]):
        owned = owning(piece)
        assert torch.equal(owned, piece) and owns_its_storage(owned), piece.shape
        assert owned.untyped_storage().nbytes() == piece.numel() * 4


# ---- every layer family ----------------------------------------------------------------------------------------------

LAYERS = {
    "column": lambda device: ColumnParallelLinear(16, 24, bias=True, gather_output=False, device=device),
    "column-padded": lambda device: ColumnParallelLinear(16, 22, bias=True, gather_output=False, pad=True,
                                                         device=device),
    "column-stride3": lambda device: ColumnParallelLinear(16, 24, bias=True, gather_output=False, stride=3,
                                                          device=device),
    "column-keep-master": lambda device: ColumnParallelLinear(16, 24, gather_output=False, keep_master_weight=True,
                                                              device=device),
    "row": lambda device: RowParallelLinear(24, 16, bias=True, input_is_parallel=True, device=device),
    "embedding": lambda device: ParallelEmbedding(40, 16, device=device),
    "embedding-across-dim": lambda device: ParallelEmbedding(40, 16, shard_across_embedding=True, device=device),
    "qkv": lambda device: GQAQKVColumnParallelLinear(16, [8 * 4, 4 * 4], bias=True, gather_output=False,
                                                     device=device),
    "qkv-fused-kv-copies": lambda device: GQAQKVColumnParallelLinear(
        16, [8 * 4, 2 * 4], bias=True, gather_output=False, fuse_qkv=True, kv_size_multiplier=2, device=device),
    "conv-out": lambda device: OutputChannelParallelConv2d(3, 8, 3, bias=True, gather_output=False, device=device),
    "conv-in": lambda device: InputChannelParallelConv2d(8, 4, 3, bias=True, input_is_parallel=True, device=device),
}


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("tp,rank", RANKS)
@pytest.mark.parametrize("layer", LAYERS)
def test_a_layer_holds_only_its_shards(layer, tp, rank, device):
    with ps.simulated_topology(world_size=tp, rank=rank, tensor_model_parallel_size=tp):
        module = LAYERS[layer](device)
    what = f"{layer} tp={tp} rank={rank} {device}"
    assert any(s.is_sharded for s in module.param_specs().values()), what
    for name, spec in module.param_specs().items():
        assert tuple(getattr(module, name).shape) == spec.local_shape(), f"{what} {name}"
    _check_holds_only_its_parameters(module, what)


# ---- the plans -------------------------------------------------------------------------------------------------------

def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32, attention_bias=True, tie_word_embeddings=False))


def _bert():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=128, hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2,
        max_position_embeddings=32))


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2,
                                                                n_head=4))


def _granite():
    """A model nxdtp has no plan for: sharded by the tp_plan transformers ships with it."""
    return transformers.GraniteForCausalLM(transformers.GraniteConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32, tie_word_embeddings=False))


PLANS = {"llama": _llama, "bert": _bert, "gpt2": _gpt2, "tp_plan-granite": _granite}


def _dense_bytes(model: nn.Module):
    """name -> bytes of every parameter of the dense model (a tied one under each of its names)."""
    return {name: p.numel() * p.element_size() for name, p in model.named_parameters(remove_duplicate=False)}


def _is_sharded(module: nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    layer = module.get_submodule(owner)
    return isinstance(layer, ShardedModule) and leaf in layer.param_specs() and layer.param_specs()[leaf].is_sharded


def _check_plan_memory(model: nn.Module, dense_bytes, tp: int, what: str) -> None:
    """``model``'s parameters hold only themselves, and 1/tp of each sharded tensor's dense bytes plus the replicated
    ones whole."""
    _check_holds_only_its_parameters(model, what)
    named = dict(model.named_parameters())   # each tied parameter under one name
    sharded = [n for n in named if _is_sharded(model, n)]
    assert sharded, f"{what}: nothing is sharded"
    expected = sum(dense_bytes[n] / tp if n in sharded else dense_bytes[n] for n in named)
    held = held_bytes(named.values())
    assert abs(held - expected) <= (SLACK - 1) * expected, \
        f"{what}: the rank holds {held} bytes, 1/tp of the sharded tensors plus the replicated ones is {expected:.0f}" \
        f" ({held / sum(dense_bytes[n] for n in named):.3f} of the dense model)"


def _parallelized_dense_freed(build, what: str, **options):
    """Parallelize a randomised dense model in place; return it with the dense model's bytes, after checking that the
    dense Parameter objects the plan replaced are gone."""
    dense = randomised(build(), seed=3)
    dense_bytes = _dense_bytes(dense)
    before = {name: weakref.ref(p) for name, p in dense.named_parameters()}
    model = parallelize_model(dense, broadcast_replicated=False, **options)
    del dense
    gc.collect()
    kept = [name for name, ref in before.items() if ref() is not None and _is_sharded(model, name)
            and model.get_parameter(name) is not ref()]
    assert not kept, f"{what}: dense parameters still alive after parallelize_model: {kept}"
    return model, dense_bytes


@pytest.mark.parametrize("tp,rank", RANKS)
@pytest.mark.parametrize("plan", PLANS)
def test_a_parallelized_model_holds_its_shards_and_frees_the_dense_ones(plan, tp, rank):
    what = f"{plan} tp={tp} rank={rank}"
    with ps.simulated_topology(world_size=tp, rank=rank, tensor_model_parallel_size=tp):
        model, dense_bytes = _parallelized_dense_freed(PLANS[plan], what)
    _check_plan_memory(model, dense_bytes, tp, what)


# ---- the user's calls in a real world --------------------------------------------------------------------------------

def case_real_world_calls(directory: str):
    """parallelize_model as users call it (replicated tensors broadcast), from_pretrained_sharded of the same model,
    NxD's initialize_parallel_model, checkpointing.load of the model and its AdamW state, and PEFT's LoRA on a
    parallelized model: each holds its shards."""
    import nxdtp
    from nxdtp import checkpointing
    from nxdtp.models import from_pretrained_sharded

    tp = ps.get_tensor_model_parallel_size()
    dense = randomised(_llama(), seed=3)
    dense_bytes = _dense_bytes(dense)
    if ps.get_tensor_model_parallel_rank() == 0:
        dense.save_pretrained(f"{directory}/dense", safe_serialization=True)
    torch.distributed.barrier()
    parallelized = parallelize_model(_dense_copy(dense))
    _check_plan_memory(parallelized, dense_bytes, tp, "parallelize_model with its broadcast")
    _check_plan_memory(from_pretrained_sharded(f"{directory}/dense"), dense_bytes, tp, "from_pretrained_sharded")
    nxd_model = nxdtp.initialize_parallel_model(nxdtp.neuronx_distributed_config(tensor_parallel_size=tp),
                                                _dense_copy, False, dense)
    _check_plan_memory(nxd_model.module, dense_bytes, tp, "initialize_parallel_model")

    optimizer = torch.optim.AdamW(parallelized.parameters(), lr=1e-3)
    parallelized(input_ids=torch.arange(8).reshape(1, 8) % 128, labels=torch.arange(8).reshape(1, 8)).loss.backward()
    optimizer.step()
    checkpointing.save({"model": parallelized, "optimizer": optimizer}, f"{directory}/ckpt")
    loaded = parallelize_model(_llama())
    fresh = torch.optim.AdamW(loaded.parameters(), lr=1e-3)
    checkpointing.load(f"{directory}/ckpt", model=loaded, optimizer=fresh)
    _check_plan_memory(loaded, dense_bytes, tp, "checkpointing.load")
    state = [t for s in fresh.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()]
    assert state and held_bytes(state) <= SLACK * _own_bytes(state), "the loaded AdamW state holds more than itself"
    _check_peft_memory(parallelize_model(_dense_copy(dense)), "llama + LoRA")
    return held_bytes(_params(loaded))


def _check_peft_memory(model: nn.Module, what: str) -> None:
    """PEFT's LoRA on a parallelized model: every factor owns its storage, and the base layers hold what they held."""
    peft = pytest.importorskip("peft")
    base_bytes = held_bytes(_params(model))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    wrapped = peft.get_peft_model(model, config)
    adapters = [p for n, p in wrapped.named_parameters() if ".lora_" in n]
    assert adapters and all(p.requires_grad for p in adapters), what
    _check_holds_only_its_parameters(wrapped, what)
    assert held_bytes(adapters) == _own_bytes(adapters), f"{what}: a LoRA factor is a view of a larger tensor"
    sharded = [n for n, _ in wrapped.named_parameters() if ".lora_" in n and _is_sharded(wrapped, n)]
    assert sharded, f"{what}: no LoRA factor is sharded"
    base = [p for n, p in wrapped.named_parameters() if ".lora_" not in n]
    assert held_bytes(base) == base_bytes, f"{what}: LoRA changed what the base layers hold"


def _dense_copy(dense: nn.Module) -> nn.Module:
    copy = _llama()
    copy.load_state_dict(dense.state_dict())
    return copy


def test_the_users_calls_hold_only_shards(worlds, tmp_path):
    held = worlds(2).run(case_real_world_calls, tensor_model_parallel_size=2, directory=str(tmp_path))
    assert held[0] == held[1], held

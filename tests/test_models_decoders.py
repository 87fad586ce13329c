"""``nxdtp.models.parallelize_model`` on the Llama family of HF decoders (Llama, Mistral, Qwen2, Qwen3) against the
dense HF model, on real gloo ranks.

Each case builds the dense model from a seed on every rank, randomises every parameter (norms and Qwen2's Q/K/V biases
included), deep-copies it and shards the copy. The dense model is the reference for the loss (shifted labels, ignored
positions, and the vocab-parallel loss on an odd vocabulary padded for TP), the gathered logits, every parameter's
gradient slice and the TP-aware gradient norm. Configurations use grouped-query attention (fewer KV heads than query
heads) with KV heads divisible by TP. Tolerance: fp32, 1e-5 absolute and relative.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from nxdtp import move_model_to_device
from nxdtp import parallel_state as ps
from nxdtp.grads import allreduce_sequence_parallel_gradients, get_grad_norm
from nxdtp.models import gather_vocab_logits, parallelize_model
from tests.model_helpers import check_checkpoint_round_trip, check_saved_at_tp4_merges_and_reshards_to_tp2, randomised
from tests.test_models_bert import TOL, _check_grads, _check_weights, _close, _dense_grad_norm

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 101, 8, 2   # an odd vocabulary: TP pads it; SEQ divisible by tp=2 and 4 for sequence parallelism

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),   # Q/K/V biases of its own
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8, attention_bias=True)),  # q_norm / k_norm
}
# Families the installed transformers has (Qwen3 arrived in 4.51): tests of several families run those, and each
# missing one is reported as skipped by test_family_is_available.
AVAILABLE = tuple(f for f in FAMILIES if hasattr(transformers, FAMILIES[f][1]))


def _available(*families):
    return tuple(f for f in families if f in AVAILABLE)


def _needs(family):
    """A parameter of ``family`` that is skipped, with the reason, when the installed transformers lacks it."""
    return pytest.param(family, marks=pytest.mark.skipif(
        family not in AVAILABLE, reason=f"transformers {transformers.__version__} has no {FAMILIES[family][1]}"))


@pytest.mark.parametrize("family", [_needs(f) for f in FAMILIES])
def test_family_is_available(family):
    assert hasattr(transformers, FAMILIES[family][0]), family


def _config(family: str, kv_heads: int):
    config_class, _, extra = FAMILIES[family]
    return getattr(transformers, config_class)(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=kv_heads, max_position_embeddings=64, rms_norm_eps=1e-6, attention_dropout=0.0,
        **{"tie_word_embeddings": False, **extra})


def _dense(family: str, config, seed: int):
    torch.manual_seed(seed)
    return randomised(getattr(transformers, FAMILIES[family][1])(config), seed + 1)


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    input_ids[0, 3] = VOCAB - 1  # an id and a target next to the vocabulary padding
    attention_mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    attention_mask[1, -2:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[0, 5] = -100
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def case_decoder_equals_dense(families, sequence_parallel: bool, multiple: int, kv_heads=None, device="cpu"):
    """``device``: where both models run once sharded (tests/test_cuda.py runs this case on a GPU)."""
    tp = ps.get_tensor_model_parallel_size()
    report = []
    for family in families:
        kv = kv_heads or tp
        what = f"{family} tp={tp} kv_heads={kv} sp={sequence_parallel} divisible_by={multiple}"
        config = _config(family, kv)
        dense = _dense(family, config, seed=len(family))
        model = parallelize_model(copy.deepcopy(dense), sequence_parallel=sequence_parallel,
                                  make_vocab_size_divisible_by=multiple)
        dense.to(device)
        move_model_to_device(model, device)
        _check_weights(model, dense, what)
        if config.tie_word_embeddings:
            assert model.lm_head.weight is model.model.embed_tokens.weight, f"{what}: the tie was lost"
        batch = {k: v.to(device) for k, v in _batch(seed=len(family) + 1).items()}
        dense_out, out = dense(**batch), model(**batch)
        _close(out.loss, dense_out.loss, f"{what} loss")
        logits = gather_vocab_logits(out.logits, VOCAB)
        _close(logits, dense_out.logits, f"{what} gathered logits")
        dense_out.loss.backward()
        out.loss.backward()
        marked = [n for n, p in model.named_parameters() if getattr(p, "sequence_parallel_enabled", False)]
        assert bool(marked) == sequence_parallel, f"{what}: sequence-parallel parameters {marked}"
        if sequence_parallel:
            # The plan sums the SP gradients inside backward (tests/test_silent_divergence.py); the NxD call after it
            # must leave them as they are.
            assert all(getattr(model.get_parameter(n), "grad_allreduced_in_backward", False) for n in marked), what
            _check_grads(model, dense, f"{what} before allreduce_sequence_parallel_gradients")
            allreduce_sequence_parallel_gradients(model.parameters())
        _check_grads(model, dense, what)
        norm = get_grad_norm(list(model.parameters()))
        _close(norm, torch.tensor(_dense_grad_norm(dense), device=norm.device), f"{what} grad norm")
        report.append(what)
    return report


ALL = tuple(FAMILIES)


@pytest.mark.parametrize("world,tp,sp", [pytest.param(2, 2, False, id="tp2"), pytest.param(4, 4, False, id="tp4"),
                                         pytest.param(2, 2, True, id="tp2-sp"), pytest.param(4, 4, True, id="tp4-sp")])
def test_decoders_equal_dense(worlds, world, tp, sp):
    families = _available(*ALL) if not sp else _available("llama", "qwen3")
    results = worlds(world).run(case_decoder_equals_dense, tensor_model_parallel_size=tp, families=families,
                                sequence_parallel=sp, multiple=8 if sp else 1)
    assert all(len(r) == len(families) for r in results)


@pytest.mark.parametrize("world,tp,sp", [pytest.param(4, 4, False, id="tp4"), pytest.param(4, 4, True, id="tp4-sp")])
def test_kv_heads_fewer_than_tp_are_replicated(worlds, world, tp, sp):
    # num_key_value_heads=2 at tp=4: every KV head twice; K/V gradients (summed over the copies) and the grad norm
    # (each copy counted once) equal dense.
    families = _available("llama", "qwen3")
    results = worlds(world).run(case_decoder_equals_dense, tensor_model_parallel_size=tp, families=families,
                                sequence_parallel=sp, multiple=1, kv_heads=2)
    assert all(len(r) == len(families) for r in results)


@pytest.mark.slow
def test_kv_heads_repeated_four_times_at_tp8(worlds):
    # 8 ranks on a 2-core machine: slow. Each of 2 KV heads is repeated 4 times, one copy per rank.
    results = worlds(8).run(case_decoder_equals_dense, tensor_model_parallel_size=8, families=("llama",),
                            sequence_parallel=False, multiple=1, kv_heads=2)
    assert all(len(r) == 1 for r in results)


def test_unsupported_models_are_named():
    from nxdtp.models import supported_models

    with ps.simulated_topology(world_size=2, rank=0, tensor_model_parallel_size=2):
        gpt_neo = transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
            vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, attention_types=[[["global"], 1]]))
        with pytest.raises(TypeError, match=r"nxdtp cannot shard GPTNeoForCausalLM: it has no hand-written plan .*"
                                            r"'LlamaForCausalLM'"):
            parallelize_model(gpt_neo)
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=24, intermediate_size=32, num_hidden_layers=1, num_attention_heads=3,
            num_key_value_heads=3))
        with pytest.raises(ValueError, match=r"num_attention_heads=3 \(num_key_value_heads=3\) is not divisible by "
                                             r"tensor_model_parallel_size=2; .*or pass pad_heads=True"):
            parallelize_model(llama, pad_heads=False)
        uneven = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=24, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=3))
        with pytest.raises(ValueError, match=r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"):
            parallelize_model(uneven)
    assert "Qwen3ForCausalLM" in supported_models()


# ---- checkpoints: save at tp=2, merge to HF, load sharded at tp=4, reshard and resume --------------------------------

KV_HEADS = 4   # divides both tp=2 and tp=4


def _round_trip_model(family):
    return lambda seed: _dense(family, _config(family, KV_HEADS), seed=seed)


llama_model, mistral_model, qwen2_model, qwen3_model = (_round_trip_model(f) for f in
                                                        ("llama", "mistral", "qwen2", "qwen3"))


def llama_kv2_model(seed):
    return _dense("llama", _config("llama", 2), seed=seed)   # tp=2 splits the KV heads, tp=4 repeats them


def checkpoint_batch():
    return _batch(seed=8)


def test_kv_heads_repeated_after_resharding_round_trip(worlds, tmp_path):
    check_checkpoint_round_trip(worlds, tmp_path, "tests.test_models_decoders:llama_kv2_model",
                                "tests.test_models_decoders:checkpoint_batch", VOCAB, "AutoModelForCausalLM",
                                "LlamaForCausalLM")


@pytest.mark.parametrize("family", [_needs(f) for f in ("llama", "mistral", "qwen2", "qwen3")])  # untied/tied heads,
# biases, q/k norms
def test_save_merge_from_pretrained_and_reshard_resume(worlds, tmp_path, family):
    check_checkpoint_round_trip(worlds, tmp_path, f"tests.test_models_decoders:{family}_model",
                                "tests.test_models_decoders:checkpoint_batch", VOCAB, "AutoModelForCausalLM",
                                FAMILIES[family][1])


# ---- the guide's quick-start examples --------------------------------------------------------------------------------

def _run_guide_example(name, tmp_path):
    """Run the python block of docs/wrapping_hf_models.md that starts with ``# <name>: run with ...`` under torchrun
    at 2 ranks, as its comment says; returns its stdout."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "wrapping_hf_models.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if b.startswith(f"# {name}: run with")]
    assert len(blocks) == 1, f"{len(blocks)} blocks of the guide start with '# {name}: run with'"
    script = tmp_path / name
    script.write_text(blocks[0])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script)], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_the_fine_tuning_example_runs(tmp_path):
    import re

    stdout = _run_guide_example("finetune_llama.py", tmp_path)
    differences = re.findall(r"rank (\d): \|TP - dense\| loss = ([0-9.e+-]+)", stdout)
    assert sorted(r for r, _ in differences) == ["0", "1"] and all(float(d) < 1e-5 for _, d in differences), stdout
    for rank in "01":
        losses = [float(x) for x in re.findall(rf"rank {rank}: step \d loss ([0-9.]+)", stdout)]
        assert len(losses) == 5 and losses[-1] < losses[0], stdout
    steps = re.findall(r"rank \d: (step \d loss [0-9.]+ grad norm [0-9.]+)", stdout)
    assert len(set(steps)) == 5, stdout   # both ranks print the same loss and norm at every step


def test_the_load_pretrained_example_runs_and_equals_dense(tmp_path):
    import re

    stdout = _run_guide_example("load_pretrained.py", tmp_path)
    differences = re.findall(r"rank (\d): max \|TP - dense\| = ([0-9.e+-]+)", stdout)
    assert sorted(r for r, _ in differences) == ["0", "1"] and all(float(d) < 1e-5 for _, d in differences), stdout


# ---- memory: a Llama 1B-shaped model at tp=8, on meta ----------------------------------------------------------------

def test_llama_1b_tp8_parameters_per_rank(capsys):
    # Llama 3.2 1B's shapes (tied embeddings), with 8 KV heads so tp=8 needs no KV replication.
    config = transformers.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                      num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                      tie_word_embeddings=True)
    with torch.device("meta"):
        dense = transformers.LlamaForCausalLM(config)
        model = transformers.LlamaForCausalLM(config)
    dense_count = sum(p.numel() for p in dense.parameters())
    norms = sum(p.numel() for n, p in dense.named_parameters() if n.endswith("norm.weight"))
    with ps.simulated_topology(world_size=8, rank=5, tensor_model_parallel_size=8):
        parallelize_model(model)
    rank_count = sum(p.numel() for p in model.parameters())
    with capsys.disabled():
        print(f"\nLlama-1B-shaped LlamaForCausalLM: dense {dense_count:,} parameters; tp=8 rank 5 holds {rank_count:,} "
              f"({100 * rank_count / dense_count:.2f} %; replicated norms {norms:,})")
    # Everything but the norms is split 8 ways (the vocabulary divides by 8, so no padding).
    assert rank_count == (dense_count - norms) // 8 + norms
    assert rank_count <= 0.125 * dense_count + norms
    assert model.lm_head.weight is model.model.embed_tokens.weight


# ---- TP x DP: the global batch ---------------------------------------------------------------------------------------

def case_tp_dp_equals_dense(family: str):
    """tp=2 x dp=2: each DP rank takes half of the global batch, the vocab-parallel loss sums over its targets and
    divides by the global count (num_items_in_batch), the DP all-reduce averages: the dense gradient of the whole
    batch."""
    from nxdtp import comm
    from nxdtp.grads import allreduce_gradients

    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_size()
    if family == "gpt2":
        from tests.test_models_gpt2 import _dense as gpt2_dense

        dense = gpt2_dense(transformers.GPT2LMHeadModel, seed=3)
    else:
        dense = _dense(family, _config(family, 2), seed=3)
    model = parallelize_model(copy.deepcopy(dense))
    g = torch.Generator().manual_seed(4)
    input_ids = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    labels = input_ids.clone()
    labels[0, :5] = -100   # uneven target counts on the two DP ranks
    global_items = (labels[:, 1:] != -100).sum()
    dense_out = dense(input_ids=input_ids, labels=labels)
    dense_out.loss.backward()
    rows = slice(2 * dp_rank, 2 * dp_rank + 2)
    out = model(input_ids=input_ids[rows], labels=labels[rows], num_items_in_batch=global_items)
    (out.loss * dp).backward()   # the DP average divides by dp: scale so it averages to the global mean's gradient
    allreduce_gradients(model)
    loss = comm.all_reduce(out.loss.detach(), ps.data_parallel_group())
    _close(loss, dense_out.loss, f"{family} tp2xdp2 global loss")
    _check_grads(model, dense, f"{family} tp2xdp2")
    _close(get_grad_norm(list(model.parameters())), torch.tensor(_dense_grad_norm(dense)), f"{family} grad norm")
    return family


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_tp2_dp2_global_batch_equals_dense(worlds, family):
    assert worlds(4).run(case_tp_dp_equals_dense, tensor_model_parallel_size=2, family=family) == [family] * 4


def test_an_unsupported_transformers_release_is_refused(monkeypatch):
    import sys

    with ps.simulated_topology(world_size=2, rank=0, tensor_model_parallel_size=2):
        model = _dense("llama", _config("llama", 2), seed=0)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        for version in ("4.46.3", "6.0.0"):
            # The module nxdtp imports: some transformers releases replace their sys.modules entry when a modeling
            # module is first imported, so the module this file imported may no longer be it.
            monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
            with pytest.raises(ImportError, match=rf"transformers {re.escape(version)} is not supported by nxdtp's "
                                                  r"Llama-family plan: supported versions are >=4\.48,<6 "
                                                  r"\(BERT's plan: >=4\.26,<6\); pip install 'transformers>=4\.48,<6'"):
                parallelize_model(model)
        # Refused before anything changed.
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear


# ---- activation checkpointing of decoder layers ----------------------------------------------------------------------

def case_checkpointed_decoder_layers(family: str, sequence_parallel: bool):
    from nxdtp.models import checkpoint_layers

    dense = _dense(family, _config(family, 2), seed=9)
    plain = parallelize_model(copy.deepcopy(dense), sequence_parallel=sequence_parallel)
    checkpointed = checkpoint_layers(parallelize_model(copy.deepcopy(dense), sequence_parallel=sequence_parallel))
    batch = _batch(seed=10)
    losses = []
    for model in (plain, checkpointed):
        loss = model(**batch).loss
        loss.backward()
        allreduce_sequence_parallel_gradients(model.parameters())
        losses.append(loss)
    _close(losses[1], losses[0], f"{family} checkpointed loss")
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **TOL, msg=lambda m: f"{family} checkpointed grad {name}: {m}")
    return family


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_checkpoint_layers_on_decoders_changes_nothing(worlds, sp):
    # Qwen3 for its q/k norms where transformers has it. The models are in training mode with HF's default
    # use_cache=True, so transformers 4.x hands each layer a KV cache that the recompute must not append to again.
    family = _available("qwen3", "llama")[0]
    assert worlds(2).run(case_checkpointed_decoder_layers, tensor_model_parallel_size=2, family=family,
                         sequence_parallel=sp) == [family] * 2


def test_a_checkpoint_with_repeated_kv_heads_merges_and_reshards_back(worlds, tmp_path):
    """Saved at tp=4 with each of 2 KV heads repeated twice: the merge holds the dense projections and resharding to
    tp=2 drops the copies."""
    dense = check_saved_at_tp4_merges_and_reshards_to_tp2(
        worlds, tmp_path, "tests.test_models_decoders:llama_kv2_model", "tests.test_models_decoders:checkpoint_batch",
        VOCAB, "LlamaForCausalLM")
    assert tuple(dense.model.layers[0].self_attn.k_proj.weight.shape) == (2 * 4, 32)  # 2 KV heads of 4 dims


# ---- head counts TP does not divide: zero heads ----------------------------------------------------------------------

def _six_heads(seed, kv_heads=6):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=kv_heads, max_position_embeddings=64,
                                      attention_bias=True, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return randomised(transformers.LlamaForCausalLM(config), seed + 1)


six_heads_model = _six_heads


def six_heads_two_kv_model(seed):
    # At tp=4: each of the 2 KV heads twice, and each group of 3 query heads padded to 4, split over the 2 copies.
    return _six_heads(seed, kv_heads=2)


def case_padded_heads_equal_dense(sequence_parallel: bool, kv_heads: int, padded_q_rows: int):
    tp = ps.get_tensor_model_parallel_size()
    what = f"llama 6 heads kv_heads={kv_heads} tp={tp} sp={sequence_parallel}"
    dense = _six_heads(seed=21, kv_heads=kv_heads)
    model = parallelize_model(copy.deepcopy(dense), sequence_parallel=sequence_parallel)
    q = model.model.layers[0].self_attn.q_proj
    assert tuple(q.weight.shape) == (padded_q_rows // tp, 48), (what, tuple(q.weight.shape))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    dense_optimizer = torch.optim.SGD(dense.parameters(), lr=0.5)
    # Two steps: after the first update, the zero heads must still be zero (else the second step would differ).
    for step in range(2):
        batch = _batch(seed=22 + step)
        dense_out, out = dense(**batch), model(**batch)
        _close(out.loss, dense_out.loss, f"{what} step {step} loss")
        _close(gather_vocab_logits(out.logits, VOCAB), dense_out.logits, f"{what} step {step} logits")
        dense_out.loss.backward()
        out.loss.backward()
        allreduce_sequence_parallel_gradients(model.parameters())
        _check_grads(model, dense, f"{what} step {step}")   # the padded heads' rows and columns: zero gradient
        _close(get_grad_norm(list(model.parameters())), torch.tensor(_dense_grad_norm(dense)),
               f"{what} step {step} grad norm")
        for opt in (optimizer, dense_optimizer):
            opt.step()
            opt.zero_grad()
    _check_weights(model, dense, what)
    with pytest.raises(ValueError, match=rf"num_attention_heads=6 \(num_key_value_heads={kv_heads}\) is not "
                                         r"divisible by tensor_model_parallel_size=4; .*pad_heads=True"):
        parallelize_model(copy.deepcopy(dense), pad_heads=False)
    return what


@pytest.mark.parametrize("sp", [False, True], ids=["tp4", "tp4-sp"])
def test_heads_tp_does_not_divide_are_padded(worlds, sp):
    # 6 heads at tp=4: 2 zero heads after the real ones, in Q, K and V alike.
    assert len(worlds(4).run(case_padded_heads_equal_dense, tensor_model_parallel_size=4, sequence_parallel=sp,
                             kv_heads=6, padded_q_rows=8 * 8)) == 4


@pytest.mark.parametrize("sp", [False, True], ids=["tp4", "tp4-sp"])
def test_grouped_query_heads_tp_does_not_divide_are_padded(worlds, sp):
    # 6 query heads over 2 KV heads at tp=4: KV heads repeated, each query group padded from 3 to 4 heads; the zero
    # query heads attend with a real KV head, so only the output projection's mask keeps them out.
    assert len(worlds(4).run(case_padded_heads_equal_dense, tensor_model_parallel_size=4, sequence_parallel=sp,
                             kv_heads=2, padded_q_rows=8 * 8)) == 4


def test_padded_heads_round_trip(worlds, tmp_path):
    # Saved at tp=2 (6 heads split evenly), resumed at tp=4 with 2 zero heads; from_pretrained_sharded pads too.
    check_checkpoint_round_trip(worlds, tmp_path, "tests.test_models_decoders:six_heads_model",
                                "tests.test_models_decoders:checkpoint_batch", VOCAB, "AutoModelForCausalLM",
                                "LlamaForCausalLM")



def test_a_checkpoint_with_zero_heads_merges_and_reshards_back(worlds, tmp_path):
    dense = check_saved_at_tp4_merges_and_reshards_to_tp2(
        worlds, tmp_path, "tests.test_models_decoders:six_heads_model", "tests.test_models_decoders:checkpoint_batch",
        VOCAB, "LlamaForCausalLM")
    assert tuple(dense.model.layers[0].self_attn.q_proj.weight.shape) == (6 * 8, 48)  # the zero heads are stripped
    assert tuple(dense.model.layers[0].self_attn.o_proj.weight.shape) == (48, 6 * 8)


def test_grouped_query_padded_heads_round_trip(worlds, tmp_path):
    # Saved at tp=2 (no zero heads), resumed at tp=4 (grouped zero heads); from_pretrained_sharded pads too.
    check_checkpoint_round_trip(worlds, tmp_path, "tests.test_models_decoders:six_heads_two_kv_model",
                                "tests.test_models_decoders:checkpoint_batch", VOCAB, "AutoModelForCausalLM",
                                "LlamaForCausalLM")


def test_a_checkpoint_with_grouped_zero_heads_merges_and_reshards_back(worlds, tmp_path):
    dense = check_saved_at_tp4_merges_and_reshards_to_tp2(worlds, tmp_path,
                                                          "tests.test_models_decoders:six_heads_two_kv_model",
                                                          "tests.test_models_decoders:checkpoint_batch", VOCAB,
                                                          "LlamaForCausalLM")
    attention = dense.model.layers[0].self_attn
    assert tuple(attention.q_proj.weight.shape) == (6 * 8, 48) and tuple(attention.o_proj.weight.shape) == (48, 6 * 8)
    assert tuple(attention.k_proj.weight.shape) == (2 * 8, 48)


# ---- pickling: torch.save(model) / torch.load, as for a plain HF model -----------------------------------------------

def _pickling_model(family: str, sequence_parallel: bool):
    if family == "gpt2":
        from tests.test_models_gpt2 import _dense as gpt2_dense

        dense = gpt2_dense(transformers.GPT2LMHeadModel, seed=5)
    else:
        dense = _dense(family, _config(family, 2), seed=5)
    return dense, parallelize_model(copy.deepcopy(dense), sequence_parallel=sequence_parallel)


def case_pickled_decoder_equals_original(family: str, sequence_parallel: bool, path: str):
    """``torch.save(model)`` of a parallelized decoder, loaded back in this process, has the same classes, outputs and
    gradients; the file, and this rank's parameters for the fresh-process check, are written to ``path``."""
    rank = ps.get_tensor_model_parallel_rank()
    what = f"{family} sp={sequence_parallel} rank {rank}"
    _, model = _pickling_model(family, sequence_parallel)
    torch.save(model, f"{path}.rank{rank}.pt")
    torch.save({"state": {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)},
                "classes": [f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()]},
               f"{path}.rank{rank}.expected.pt")
    other = torch.load(f"{path}.rank{rank}.pt", weights_only=False)
    assert [type(m) for m in other.modules()] == [type(m) for m in model.modules()], what
    batch = _batch(seed=6)
    out, other_out = model(**batch), other(**batch)
    out.loss.backward()
    other_out.loss.backward()
    _close(other_out.loss, out.loss, f"{what}: loss")
    _close(other_out.logits, out.logits, f"{what}: logits")
    grads = dict(other.named_parameters())
    for name, param in model.named_parameters():
        _close(grads[name].grad, param.grad, f"{what}: grad of {name}")
    return True


FRESH_PROCESS_LOAD = r"""
import sys, torch
from nxdtp import parallel_state as ps
path, tp = sys.argv[1], int(sys.argv[2])
for rank in range(tp):
    with ps.simulated_topology(world_size=tp, rank=rank, tensor_model_parallel_size=tp):
        model = torch.load(f"{path}.rank{rank}.pt", weights_only=False)
        state = model.state_dict()
    expected = torch.load(f"{path}.rank{rank}.expected.pt", weights_only=True)
    classes = [f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()]
    assert classes == expected["classes"], (rank, classes, expected["classes"])
    for key, value in expected["state"].items():
        assert torch.equal(state[key], value), (rank, key)
    print("rank", rank, "loaded", len(expected["state"]), "tensors")
"""


@pytest.mark.parametrize("family, sp", [pytest.param("llama", True, id="llama-sp"),
                                        pytest.param("gpt2", False, id="gpt2")])
def test_pickled_decoder_equals_original_and_loads_in_a_fresh_process(worlds, tmp_path, family, sp):
    """A wrapped decoder pickles like a plain HF model; a new Python process, which never built or parallelized a
    model, loads each rank's file (the wrapper classes are rebuilt from their recipes) with every tensor bit-exact."""
    import subprocess
    import sys

    path = str(tmp_path / family)
    assert worlds(2).run(case_pickled_decoder_equals_original, tensor_model_parallel_size=2, family=family,
                         sequence_parallel=sp, path=path) == [True, True]
    loaded = subprocess.run([sys.executable, "-c", FRESH_PROCESS_LOAD, path, "2"], capture_output=True, text=True,
                            timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.count("loaded") == 2, loaded.stdout

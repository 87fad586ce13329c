"""``parallelize_model`` on Hugging Face mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE) against the dense
model on the global batch, on 4 gloo ranks at tp=2, ep=2 and tp=2 x ep=2.

Every parameter is randomised, router and norms included. Each DP rank takes its own micro-batch (padding in each);
the dense model runs on their concatenation with ``output_router_logits=True``. Each rank's loss is its cross-entropy
over the global target count plus the load-balancing loss counted over the DP batch; after NxD's two gradient passes
every rank's gradients must be its slices of the dense gradients (experts: its experts, its TP share), and the DP
means of the losses the dense ones, and so must the weights after one AdamW step; greedy generation gives the
dense model's tokens. fp32, 1e-5.
"""

from __future__ import annotations

import copy

import pytest
import torch

from nxdtp import comm, grads
from nxdtp import parallel_state as ps
from nxdtp.models import gather_vocab_logits, parallelize_model
from nxdtp.spec import split_along
from nxdtp.storage import held_bytes
from tests.model_helpers import check_checkpoint_round_trip, gathered_logits, randomised
from tests.test_models_bert import TOL, _close, _expected_local, _specs

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                                reason="nxdtp's MoE plan needs transformers 5 (one experts module per layer)")

VOCAB, SEQ, BATCH, EXPERTS = 101, 8, 2, 4
# eps=1e-4, as tests/test_zero1.py explains: Adam's first step is lr * g / (|g| + eps), which turns last-bit noise in a
# near-zero gradient into an lr-sized difference when eps is tiny.
ADAMW = dict(lr=0.02, eps=1e-4, weight_decay=0.1)
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-6, attention_dropout=0.0, tie_word_embeddings=False,
              num_experts_per_tok=2, router_aux_loss_coef=0.3, output_router_logits=True)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=EXPERTS, intermediate_size=16)),
    # A dense MLP layer (mlp_only_layers) beside a sparse one; per-head q_norm / k_norm
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=EXPERTS, moe_intermediate_size=16, intermediate_size=24, mlp_only_layers=[1],
                       norm_topk_prob=True, head_dim=8)),
    # A shared expert with its sigmoid gate; top-k weights not renormalised
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=EXPERTS, moe_intermediate_size=16, intermediate_size=24,
                       shared_expert_intermediate_size=24, norm_topk_prob=False)),
    # No hand-written plan: sharded from HF's tp_plan (moe_tp_experts); sigmoid router with a correction bias, a
    # dense first layer, shared experts, no load-balancing loss
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(n_routed_experts=EXPERTS, moe_intermediate_size=16, intermediate_size=24, first_k_dense_replace=1,
                      n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True, attention_bias=True)),
    # Also from HF's tp_plan: Q/K norms over every head (Q, K, V gathered, the output split on entry)
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=EXPERTS, intermediate_size=16, norm_topk_prob=False)),
}


def dense_model(family: str, seed: int):
    config_class, model_class, extra = FAMILIES[family]
    config = getattr(transformers, config_class)(**COMMON, **extra)
    torch.manual_seed(seed)
    return randomised(getattr(transformers, model_class)(config), seed + 1)


def micro_batch(seed: int, dp_rank: int):
    g = torch.Generator().manual_seed(seed * 100 + dp_rank)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    attention_mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    attention_mask[1, -2 - dp_rank % 2:] = 0     # padding, a different amount on alternate DP ranks
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def _global_batch(seed: int, dp: int):
    parts = [micro_batch(seed, d) for d in range(dp)]
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}


def _expected_gradient(name, param, dense_grad, specs):
    """This rank's slice of a dense tensor laid out like ``param`` (its experts, then its TP piece)."""
    if not getattr(param, "expert_model_parallel", False):
        return _expected_local(dense_grad, param, specs.get(id(param)), name)
    ep, tp = ps.expert_parallel_group(), ps.tensor_parallel_group()
    local = dense_grad.shape[0] // ep.size
    mine = dense_grad.narrow(0, ep.rank * local, local)
    return split_along(mine, param.partition_dim, tp.rank, tp.size, param.partition_stride)


def _check_router_outputs_and_backward(model, out, dense_out, what):
    """Router logits and the losses against the dense model's, then backward and NxD's two gradient passes. The rank's
    cross-entropy is its share of the global mean: scaled by dp, the DP average of the gradients is the dense one. The
    load-balancing loss is already each rank's share of the dense one."""
    dp, dp_rank, data = ps.get_data_parallel_size(), ps.get_data_parallel_rank(), ps.data_parallel_group()
    tokens = slice(dp_rank * BATCH * SEQ, (dp_rank + 1) * BATCH * SEQ)
    for layer, (mine, theirs) in enumerate(zip(out.router_logits or (), dense_out.router_logits or ())):
        _close(mine, theirs[tokens], f"{what} router logits of layer {layer}")
    aux = getattr(out, "aux_loss", None)
    coef = model.router_aux_loss_coef if aux is not None else 0.0
    (dp * out.loss - (dp - 1) * coef * (aux if aux is not None else 0.0)).backward()
    grads.allreduce_gradients(model)   # NxD's two passes: experts over the expert data-parallel group
    cross_entropy = comm.all_reduce((out.loss - coef * (aux if aux is not None else 0.0)).detach(), data)
    if aux is not None:
        _close(comm.all_reduce(aux.detach(), data) / dp, dense_out.aux_loss, f"{what} aux loss")
        cross_entropy = cross_entropy + coef * dense_out.aux_loss
    _close(cross_entropy, dense_out.loss, f"{what} loss")


def case_moe_decoder_equals_dense(families, tp, ep, sequence_parallel=False):
    ps.initialize_model_parallel(tp, expert_model_parallel_size=ep)
    try:
        dp, dp_rank = ps.get_data_parallel_size(), ps.get_data_parallel_rank()
        for family in families:
            what = f"{family} tp={tp} ep={ep} sp={sequence_parallel}"
            dense = dense_model(family, seed=len(family))
            model = parallelize_model(copy.deepcopy(dense), sequence_parallel=sequence_parallel)
            full = _global_batch(seed=3, dp=dp)
            global_items = (full["labels"][:, 1:] != -100).sum()
            dense_out = dense(**full)
            dense_out.loss.backward()
            out = model(**micro_batch(3, dp_rank), num_items_in_batch=global_items)
            rows = slice(dp_rank * BATCH, (dp_rank + 1) * BATCH)
            _close(gather_vocab_logits(out.logits, VOCAB), dense_out.logits[rows], f"{what} logits")
            _check_router_outputs_and_backward(model, out, dense_out, what)
            specs = _specs(model)
            for name, param in model.named_parameters():
                expected = _expected_gradient(name, param, dense.get_parameter(name).grad, specs)
                torch.testing.assert_close(param.grad, expected, **TOL, msg=lambda m: f"{what} {name} grad: {m}")
            dense_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in dense.parameters()]))
            _close(grads.get_grad_norm(model), dense_norm, f"{what} grad norm")
            torch.optim.AdamW(model.parameters(), **ADAMW).step()
            torch.optim.AdamW(dense.parameters(), **ADAMW).step()
            for name, param in model.named_parameters():
                expected = _expected_gradient(name, param, dense.get_parameter(name).detach(), specs)
                torch.testing.assert_close(param.detach(), expected, **TOL, msg=lambda m: f"{what} {name} step: {m}")
            copied = copy.deepcopy(model)   # new Parameter objects keep NxD's expert mark
            assert all(getattr(p, "expert_model_parallel", False) == (".experts." in n)
                       for n, p in copied.named_parameters()), what
            experts = [p for n, p in model.named_parameters() if ".experts." in n]
            dense_experts = [p for n, p in dense.named_parameters() if ".experts." in n]
            assert held_bytes(experts) * tp * ep == held_bytes(dense_experts), what
            # Each DP rank its own prompt, of its own length: the expert-parallel ranks keep stepping together.
            prompt = micro_batch(5, dp_rank)["input_ids"][:1, :3 + dp_rank % 2]
            with torch.no_grad():
                generated = model.generate(prompt, max_new_tokens=3, do_sample=False)
                assert torch.equal(generated, dense.generate(prompt, max_new_tokens=3, do_sample=False)), what
                # Evaluation keeps HF's per-rank load-balancing loss: no rank waits for another.
                local = micro_batch(3, dp_rank)
                evaluated = model(input_ids=local["input_ids"], attention_mask=local["attention_mask"])
                expected = dense(input_ids=local["input_ids"], attention_mask=local["attention_mask"])
                if expected.aux_loss is not None:
                    _close(evaluated.aux_loss, expected.aux_loss, f"{what} evaluation aux loss")
        return families
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2), (2, 2)])
def test_moe_decoders_equal_dense_on_the_global_batch(worlds, tp, ep):
    families = list(FAMILIES)
    assert worlds(4).run(case_moe_decoder_equals_dense, tensor_model_parallel_size=None, families=families, tp=tp,
                         ep=ep) == [families] * 4


def test_hand_written_moe_plans_with_sequence_parallelism_equal_dense(worlds):
    families = ["mixtral", "qwen3_moe", "qwen2_moe"]
    assert worlds(4).run(case_moe_decoder_equals_dense, tensor_model_parallel_size=None, families=families, tp=2,
                         ep=2, sequence_parallel=True) == [families] * 4


@pytest.mark.slow
@pytest.mark.parametrize("world_name", ["cpu_refusing", "xla"])
def test_mixtral_tp2_ep2_on_worlds_whose_default_backend_is_not_gloo(worlds, world_name):
    assert worlds(4, world_name).run(case_moe_decoder_equals_dense, tensor_model_parallel_size=None,
                                     families=["mixtral"], tp=2, ep=2) == [["mixtral"]] * 4


def test_sequence_parallelism_from_hf_tp_plan_is_refused_by_name():
    with ps.simulated_topology(world_size=2, rank=0, tensor_model_parallel_size=2):
        with pytest.raises(ValueError, match=r"sequence_parallel=True needs a hand-written plan; Glm4MoeForCausalLM"):
            parallelize_model(dense_model("glm4_moe", 0), sequence_parallel=True)


def test_activation_checkpointed_moe_layers_are_refused_before_the_aux_loss_trains_nothing():
    """transformers records router logits inside the decoder layers; recomputed in backward, their forward ran without
    gradients, so the load-balancing loss would have none."""
    from nxdtp.models.activation_checkpointing import checkpoint_layers

    with ps.simulated_topology(world_size=1, rank=0, tensor_model_parallel_size=1):
        model = checkpoint_layers(parallelize_model(dense_model("mixtral", 0)))
        with pytest.raises(RuntimeError, match=r"the router logits of MoE layer 0 carry no gradient although its "
                                               r"router trains, so router_aux_loss_coef=0.3 would train nothing"):
            model(**micro_batch(1, 0))
        # Frozen routers (fine-tuning the head alone, or adapters past them): logits without a gradient are right.
        model.requires_grad_(False)
        model.lm_head.requires_grad_(True)
        model(**micro_batch(1, 0)).loss.backward()
        assert model.lm_head.weight.grad is not None


def test_an_expert_count_the_expert_parallel_size_does_not_divide_is_refused():
    with ps.simulated_topology(world_size=8, rank=1, tensor_model_parallel_size=1, expert_model_parallel_size=8):
        with pytest.raises(ValueError, match=r"num_experts=4 is not divisible by expert_model_parallel_size=8; valid "
                                             r"expert-parallel sizes for 4 experts: \[1, 2, 4\]"):
            parallelize_model(dense_model("mixtral", 0))


# ---- checkpoints at expert-parallel size 1 ---------------------------------------------------------------------------

def mixtral_model(seed):
    return dense_model("mixtral", seed)


def qwen2_moe_model(seed):
    return dense_model("qwen2_moe", seed)


def checkpoint_batch():
    return micro_batch(8, 0)


def case_hf_saved_directory_loads(directory: str, family: str):
    """transformers' own save_pretrained writes Mixtral's experts one by one (block_sparse_moe.experts.N.w1/w3/w2)
    and the Qwen models' as experts.N.gate_proj/up_proj/down_proj: from_pretrained_sharded reads each rank's slices of
    those into the fused experts module, and the model computes the dense model's logits."""
    from nxdtp.models import from_pretrained_sharded

    dense = dense_model(family, seed=4)
    model = from_pretrained_sharded(directory)
    batch = micro_batch(6, 0)
    with torch.no_grad():
        _close(gather_vocab_logits(model(**batch).logits, VOCAB), dense(**batch).logits, f"{family} logits")
    return family


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_hf_saved_experts_one_by_one_load_into_the_fused_module(worlds, tmp_path, family):
    dense_model(family, seed=4).save_pretrained(str(tmp_path))
    assert worlds(2).run(case_hf_saved_directory_loads, tensor_model_parallel_size=2, directory=str(tmp_path),
                         family=family) == [family] * 2


def case_sharded_save_pretrained(directory: str, family: str) -> str:
    parallelize_model(dense_model(family, seed=4)).save_pretrained(directory, max_shard_size="40KB")
    return family


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_sharded_save_pretrained_puts_each_expert_in_the_file_transformers_would(worlds, tmp_path, family):
    """A save in several files: the experts one by one under transformers' own names, each tensor in the file
    transformers' save_pretrained puts it in, and equal to the dense model's."""
    import json

    from safetensors.torch import load_file

    dense_dir, tp_dir = tmp_path / "dense", tmp_path / "tp"
    dense_model(family, seed=4).save_pretrained(str(dense_dir), max_shard_size="40KB")
    assert worlds(2).run(case_sharded_save_pretrained, tensor_model_parallel_size=2, directory=str(tp_dir),
                         family=family) == [family] * 2
    maps = [json.loads((d / "model.safetensors.index.json").read_text())["weight_map"] for d in (dense_dir, tp_dir)]
    assert maps[0] == maps[1] and len(set(maps[0].values())) > 2
    for name in set(maps[0].values()):
        dense, ours = load_file(str(dense_dir / name)), load_file(str(tp_dir / name))
        assert dense.keys() == ours.keys() and all(torch.equal(dense[k], ours[k]) for k in dense), name


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_save_merge_from_pretrained_and_reshard_resume(worlds, tmp_path, family):
    """Saved at tp=2 (experts split along their intermediate dimension), merged: plain transformers loads it with the
    same logits; resharded to tp=4 it resumes with the same next loss, and from_pretrained_sharded reads the merge."""
    check_checkpoint_round_trip(worlds, tmp_path, f"tests.test_models_moe:{family}_model",
                                "tests.test_models_moe:checkpoint_batch", VOCAB, "AutoModelForCausalLM",
                                FAMILIES[family][1])


# ---- checkpoints at expert-parallel size > 1 -------------------------------------------------------------------------

def _train_step(model, optimizer, batch) -> None:
    model(**batch).loss.backward()
    grads.allreduce_gradients(model)
    optimizer.step()
    optimizer.zero_grad()


def _logits_then_step(model, optimizer) -> dict:
    """The logits on one batch; then one AdamW step on that batch on every DP rank (so the step is the same at any DP
    size) and the logits after it: equal only if the weights and the optimizer state were restored."""
    batch = checkpoint_batch()
    before = gathered_logits(model, batch, VOCAB)
    _train_step(model, optimizer, batch)
    return dict(logits=before, stepped=gathered_logits(model, batch, VOCAB))


def case_save_at_expert_parallel(directory: str, pretrained: str, tp: int, ep: int) -> dict:
    """One AdamW step on DP-distinct micro-batches at tp x ep, then ``save`` (model, optimizer) and
    ``save_pretrained``, each expert tensor gathered over the expert-parallel group."""
    from nxdtp import checkpointing

    ps.initialize_model_parallel(tp, expert_model_parallel_size=ep)
    try:
        model = parallelize_model(mixtral_model(seed=7))
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
        _train_step(model, optimizer, micro_batch(30, ps.get_data_parallel_rank()))
        checkpointing.save({"model": model, "optimizer": optimizer, "global_step": 1}, directory)
        model.save_pretrained(pretrained)
        return _logits_then_step(model, optimizer)
    finally:
        ps.destroy_model_parallel()


def case_resume_at(directory: str, merged: str, tp: int, ep: int) -> dict:
    """A model from another seed resumes the checkpoint at tp x ep; ``from_pretrained_sharded`` reads the merge."""
    from nxdtp import checkpointing
    from nxdtp.models import from_pretrained_sharded

    ps.initialize_model_parallel(tp, expert_model_parallel_size=ep)
    try:
        model = parallelize_model(mixtral_model(seed=99))
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
        step = checkpointing.load(directory, model=model, optimizer=optimizer)["global_step"]
        pretrained = gathered_logits(from_pretrained_sharded(merged), checkpoint_batch(), VOCAB)
        return dict(step=step, pretrained=pretrained, **_logits_then_step(model, optimizer))
    finally:
        ps.destroy_model_parallel()


@pytest.mark.slow
def test_saved_at_tp2_ep2_loads_at_other_tensor_and_expert_parallel_sizes(worlds, tmp_path):
    """Saved at tp=2 x ep=2 (files hold every expert): merged, exported to DCP and saved with save_pretrained, plain
    transformers and torch.distributed.checkpoint give the saved logits; resumed at tp=2 x ep=2, at tp=4 x ep=1 and
    at tp=1 x ep=4 (resharded over TP), the weights and the AdamW state are those saved: the same logits, and the
    same logits after one more step."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from nxdtp.checkpointing.dcp_export import export_dcp
    from nxdtp.checkpointing.merge import merge, reshard

    saved_dir, merged, pretrained = (str(tmp_path / name) for name in ("saved", "merged", "pretrained"))
    saved = worlds(4).run(case_save_at_expert_parallel, tensor_model_parallel_size=None, directory=saved_dir,
                          pretrained=pretrained, tp=2, ep=2)
    assert all(torch.equal(s["stepped"], saved[0]["stepped"]) for s in saved)
    saved = saved[0]
    merge(saved_dir, merged, progress=False)
    # Both directories hold the experts one by one, as transformers' own save_pretrained writes them.
    mixtral_model(seed=0).save_pretrained(str(tmp_path / "hf"))
    keys = [set(load_file(f"{directory}/model.safetensors")) for directory in (merged, pretrained, tmp_path / "hf")]
    assert keys[0] == keys[1] == keys[2] and "model.layers.0.block_sparse_moe.experts.3.w2.weight" in keys[0]
    for directory in (merged, pretrained):
        with torch.no_grad():
            logits = transformers.AutoModelForCausalLM.from_pretrained(directory)(**checkpoint_batch()).logits
        torch.testing.assert_close(logits, saved["logits"], **TOL, msg=lambda m: f"{directory}: {m}")
    # DCP holds the tensors as the model does (fused experts): torchtitan's and DCP users' names.
    export_dcp(saved_dir, str(tmp_path / "dcp"), progress=False)
    weights = transformers.AutoModelForCausalLM.from_pretrained(merged).state_dict()
    exported = {key: torch.zeros_like(value) for key, value in weights.items()}
    dcp.load(exported, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert all(torch.equal(exported[key], value) for key, value in weights.items())
    for tp, ep in [(2, 2), (4, 1), (1, 4)]:
        directory = saved_dir if tp == 2 else str(tmp_path / f"tp{tp}")
        if tp != 2:
            reshard(saved_dir, directory, tp, progress=False)
        for rank, result in enumerate(worlds(4).run(case_resume_at, tensor_model_parallel_size=None,
                                                    directory=directory, merged=merged, tp=tp, ep=ep)):
            what = f"tp={tp} ep={ep} rank {rank}"
            assert result["step"] == 1, what
            for key, expected in (("logits", "logits"), ("pretrained", "logits"), ("stepped", "stepped")):
                torch.testing.assert_close(result[key], saved[expected], **TOL, msg=lambda m: f"{what} {key}: {m}")


# ---- NxD's trainer API -----------------------------------------------------------------------------------------------

MAX_NORM = 0.5


def _unpadded(batch):
    """Every position a target: equal target counts on the DP ranks, so the mean of their mean losses is the mean over
    the global batch (NxD's trainer averages per-rank mean losses)."""
    return dict(input_ids=batch["input_ids"], labels=batch["input_ids"].clone())


def case_trainer_api_equals_dense(zero_one: bool):
    """``neuronx_distributed_config(tensor_parallel_size=2, expert_parallel_size=2)``, a plain HF Mixtral through
    ``initialize_parallel_model``, NxD's optimizer (or ZeRO-1): two clipped AdamW steps on DP-distinct micro-batches
    equal the dense steps on the global batch, grad norm included."""
    import nxdtp

    dense = dense_model("mixtral", seed=11)
    nxd_config = nxdtp.neuronx_distributed_config(
        tensor_parallel_size=2, expert_parallel_size=2,
        optimizer_config={"zero_one_enabled": zero_one, "max_grad_norm": MAX_NORM})
    try:
        model = nxdtp.initialize_parallel_model(nxd_config, copy.deepcopy, False, dense)
        optimizer = nxdtp.initialize_parallel_optimizer(nxd_config, torch.optim.AdamW, model.parameters(), **ADAMW)
        dense_optimizer = torch.optim.AdamW(dense.parameters(), **ADAMW)
        dp, dp_rank = ps.get_data_parallel_size(), ps.get_data_parallel_rank()
        for step in range(2):
            dense_optimizer.zero_grad()
            full = _unpadded(_global_batch(seed=20 + step, dp=dp))
            dense(**full).loss.backward()
            dense_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), MAX_NORM)
            assert dense_norm > 1.5 * MAX_NORM, "max_norm does not clip"
            dense_optimizer.step()
            optimizer.zero_grad()
            local = _unpadded(micro_batch(20 + step, dp_rank))
            model.run_train(**local)
            optimizer.step()
            _close(optimizer.grad_norm, dense_norm, f"zero_one={zero_one} step {step} grad norm")
        specs = _specs(model.module)
        for name, param in model.module.named_parameters():
            expected = _expected_gradient(name, param, dense.get_parameter(name).detach(), specs)
            torch.testing.assert_close(param.detach(), expected, **TOL, msg=lambda m: f"{name} after 2 steps: {m}")
        return zero_one
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("zero_one", [False, True], ids=["nxd_optimizer", "zero1"])
def test_trainer_api_tp2_ep2_equals_dense(worlds, zero_one):
    assert worlds(4).run(case_trainer_api_equals_dense, tensor_model_parallel_size=None,
                         zero_one=zero_one) == [zero_one] * 4

"""ZeRO-1 checkpoints (issue 24, item 2): ``nxdtp.checkpointing.save/load`` and ``nxdtp-merge --reshard`` with a
``NeuronZero1Optimizer``, on gloo ranks.

The model is test_zero1's tiny Llama (every parameter randomised, biases included; odd vocabulary padded for TP;
grouped-query attention with 2 KV heads, so tp=4 repeats them), trained with ZeRO-1 AdamW in two param groups, clipping
at a max_norm that clips, and a LambdaLR on the wrapper; each DP rank takes its own rows of a global batch of 8. A
checkpoint is saved at tp2 x dp2 after 2 steps; the third step is the one compared:

* resumed at tp2 x dp2 (from a model whose weights were moved off the saved ones first): every parameter equals the
  uninterrupted run's bit for bit, and so do the re-saved shards;
* resumed at tp2 x dp1 and tp2 x dp4 directly (the flat shards re-cut to the new DP size), and at tp1 x dp4 and
  tp4 x dp1 after ``nxdtp-merge --reshard``: every parameter equals the dense model trained 3 steps on the global batch
  with torch AdamW and ``clip_grad_norm_`` (fp32 1e-5), as the uninterrupted ZeRO-1 run does (test_zero1);
* a ZeRO-1 checkpoint loaded into a plain AdamW (DP all-reduce and nxdtp's clipping) and a plain checkpoint loaded
  into ZeRO-1 both continue as the dense run;
* kill -9 at a seeded moment of a ZeRO-1 save (tp1 x dp2) leaves the previous tag or the new one, bit-exactly
  (the harness of test_checkpoint_durability);
* the index describes each shard (TP-local shape, flat layout, TP spec); errors name the offending value.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from nxdtp import parallel_state as ps
from nxdtp.optimizer import NeuronZero1Optimizer

transformers = pytest.importorskip("transformers")

from tests.test_zero1 import _apply_lr_scale, _groups, _llama, _llama_batches, _parallelize, torch_clip_grad_norm_  # noqa: E402

MAX_NORM = 0.5
ADAMW = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-4, weight_decay=0.01)
SAVED_STEPS = 2   # steps before the save; the next one (step 2) is compared


def _schedule(step):
    return 1.0 / (1.0 + step)


def _sharding_groups(sharding: int = 0):
    """ZeRO-1's ``sharding_groups``: None (the DP groups) for 0, else each DP group cut into groups of ``sharding``
    consecutive members (hybrid sharding, test_zero1_groups)."""
    if not sharding:
        return None
    return ps.dp_aligned_sharding_examples(ps.get_topology())[sharding]


def _build(kind: str = "zero1", dense=None, sharding: int = 0):
    model = _parallelize("llama", dense if dense is not None else _llama())
    groups = _apply_lr_scale(_groups(model.named_parameters()), ADAMW["lr"])
    if kind == "zero1":
        opt = NeuronZero1Optimizer(groups, torch.optim.AdamW, max_norm=MAX_NORM,
                                   sharding_groups=_sharding_groups(sharding), **ADAMW)
    else:
        opt = torch.optim.AdamW(groups, **ADAMW)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, _schedule)


def _train(model, opt, sched, steps, kind: str = "zero1"):
    from nxdtp.grads import allreduce_gradients, clip_grad_norm

    dp = ps.get_data_parallel_size()
    for step in steps:
        _, micro, scale = _llama_batches(step, dp, 1)
        opt.zero_grad(set_to_none=True)
        (model(**micro[0]).loss * scale).backward()
        if kind != "zero1":
            allreduce_gradients(model)
            clip_grad_norm(model.parameters(), MAX_NORM)
        opt.step()
        sched.step()


def _dense_adamw(dense):
    return torch.optim.AdamW(_apply_lr_scale(_groups(dense.named_parameters()), ADAMW["lr"]), **ADAMW)


def _dense_train(dense, opt, sched, steps):
    for step in steps:
        full, _, _ = _llama_batches(step, 1, 1)
        opt.zero_grad()
        dense(**full).loss.backward()
        torch_clip_grad_norm_(dense.parameters(), MAX_NORM)
        opt.step()
        sched.step()


def _dense_run(steps: int):
    """The dense model trained ``steps`` steps on the global batches, as test_zero1's reference; its optimizer and
    scheduler."""
    dense = _llama()
    opt = _dense_adamw(dense)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    _dense_train(dense, opt, sched, range(steps))
    return dense, opt, sched


def _dense_after(steps: int):
    return _dense_run(steps)[0]


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _moved_off(model):
    """Move every weight away from anything saved: only the checkpoint can bring them back."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)


# ---- cases (run on every rank) ---------------------------------------------------------------------------------------

def case_save(directory: str, kind: str = "zero1", sharding: int = 0):
    """Train 2 steps, save, train the third; return this rank's parameters after it (the uninterrupted run)."""
    from nxdtp.checkpointing import save

    model, opt, sched = _build(kind, sharding=sharding)
    _train(model, opt, sched, range(SAVED_STEPS), kind)
    save({"model": model, "optimizer": opt, "scheduler": sched, "global_step": SAVED_STEPS}, directory)
    _train(model, opt, sched, [SAVED_STEPS], kind)
    return _params(model)


def case_resume(directory: str, kind: str = "zero1", check_dense: bool = True, sharding: int = 0):
    """Build afresh (weights moved off), load, train the third step; check it against the dense run; return the
    parameters."""
    from nxdtp.checkpointing import load
    from tests.test_models_bert import _check_weights

    model, opt, sched = _build(kind, sharding=sharding)
    _moved_off(model)
    state = load(directory, model=model, optimizer=opt, scheduler=sched)
    assert state["global_step"] == SAVED_STEPS, state
    _train(model, opt, sched, [SAVED_STEPS], kind)
    what = (f"{kind} resumed at tp={ps.get_tensor_model_parallel_size()} dp={ps.get_data_parallel_size()} from "
            f"{directory}")
    if check_dense:
        _check_weights(model, _dense_after(SAVED_STEPS + 1), what)
    return _params(model)


def case_resave(directory: str, again: str, sharding: int = 0):
    """Load a ZeRO-1 checkpoint at its own layout and save it again: the shards must come back bit for bit."""
    from nxdtp.checkpointing import load, save

    model, opt, sched = _build("zero1", sharding=sharding)
    _moved_off(model)
    load(directory, model=model, optimizer=opt, scheduler=sched)
    save({"model": model, "optimizer": opt, "scheduler": sched, "global_step": SAVED_STEPS}, again)


# ---- helpers (test process) ------------------------------------------------------------------------------------------

def _tag(directory: str) -> str:
    with open(os.path.join(directory, "newest")) as f:
        return os.path.join(directory, f.read().strip())


def _index(directory: str) -> dict:
    with open(os.path.join(_tag(directory), "nxdtp_index.json")) as f:
        return json.load(f)


def _same(a: dict, b: dict) -> list:
    return sorted(k for k in set(a) | set(b) if k not in a or k not in b or not torch.equal(a[k], b[k]))


@pytest.fixture(scope="module")
def saved(worlds, tmp_path_factory):
    """A ZeRO-1 checkpoint saved at tp2 x dp2 after 2 steps, and each rank's parameters after the third."""
    directory = str(tmp_path_factory.mktemp("zero1") / "ckpt")
    after = worlds(4).run(case_save, tensor_model_parallel_size=2, directory=directory)
    return directory, after


# ---- tests -----------------------------------------------------------------------------------------------------------

def test_index_and_files_describe_every_shard(saved):
    from safetensors import safe_open

    from nxdtp.spec import FlatShardLayout

    directory, _ = saved
    tag_dir, index = _tag(directory), _index(directory)
    optimizer = index["optimizer"]
    assert optimizer["kind"] == "zero1" and optimizer["keyed_by"] == "name", {k: optimizer[k] for k in optimizer
                                                                                if k != "params"}
    assert optimizer["zero1"] == {"layout": "flat", "sharding_group_size": 2, "optimizer_dtype": "float32"}
    files = sorted(f for f in index["files"] if f.startswith("optim/"))
    assert files == ["optim/state.json"] + [f"optim/tp_rank_{t:02d}_dp_rank_{d:02d}.safetensors"
                                            for t in range(2) for d in range(2)], files
    # Every optimizer file's tensors are checksummed like the model's.
    assert all(f in index["tensor_checksums"] for f in files if f.endswith(".safetensors"))
    name = "model.embed_tokens.weight"
    info = optimizer["params"][name]
    layout = FlatShardLayout.from_dict(info["layout"])
    assert info["spec"] == index["tensors"][name]["spec"] and info["spec"]["partition_dim"] == 0
    assert info["shape"] == list(layout.shape) and layout.group_size == 2
    assert sorted(info["tensors"]) == ["exp_avg", "exp_avg_sq", "step"] and sorted(info["flat"]) == ["exp_avg",
                                                                                                      "exp_avg_sq"]
    with safe_open(os.path.join(tag_dir, "optim/tp_rank_01_dp_rank_01.safetensors"), "pt") as f:
        assert tuple(f.get_slice(f"{name}/exp_avg").get_shape()) == (layout.shard_numel,)
        assert tuple(f.get_slice(f"{name}/zero1_master").get_shape()) == (layout.shard_numel,)
        assert tuple(f.get_slice(f"{name}/step").get_shape()) == ()


def test_resume_at_the_saved_layout_is_bit_exact(saved, worlds, tmp_path):
    directory, after = saved
    resumed = worlds(4).run(case_resume, tensor_model_parallel_size=2, directory=directory)
    for rank, (a, b) in enumerate(zip(after, resumed)):
        assert _same(a, b) == [], f"rank {rank}: resumed parameters differ from the uninterrupted run"
    # Loading and saving again writes the same shards (the DP layout is not touched on the way).
    again = str(tmp_path / "again")
    worlds(4).run(case_resave, tensor_model_parallel_size=2, directory=directory, again=again)
    from safetensors.torch import load_file

    for t in range(2):
        for d in range(2):
            relative = f"optim/tp_rank_{t:02d}_dp_rank_{d:02d}.safetensors"
            first, second = (load_file(os.path.join(_tag(x), relative)) for x in (directory, again))
            assert _same(first, second) == [], relative


# tp2 x dp4 is a world of 8 processes: in the slow set, to keep the README's command within its time.
@pytest.mark.parametrize("world,tp", [(2, 2), pytest.param(8, 2, marks=pytest.mark.slow)], ids=["tp2xdp1", "tp2xdp4"])
def test_resume_at_another_dp_size(saved, worlds, world, tp):
    directory, _ = saved
    worlds(world).run(case_resume, tensor_model_parallel_size=tp, directory=directory)


@pytest.mark.parametrize("new_tp,world", [(1, 4), (4, 4)], ids=["tp1xdp4", "tp4xdp1"])
def test_resume_at_another_tp_size_after_reshard(saved, worlds, tmp_path, new_tp, world):
    from nxdtp.cli import main

    directory, _ = saved
    out = str(tmp_path / f"tp{new_tp}")
    assert main([directory, out, "--reshard", str(new_tp)]) in (0, None)
    index = _index(out)
    assert index["tensor_model_parallel_size"] == new_tp and index["optimizer"]["kind"] == "zero1"
    assert sorted(f for f in index["files"] if f.startswith("optim/tp_rank")) == [
        f"optim/tp_rank_{t:02d}_dp_rank_{d:02d}.safetensors" for t in range(new_tp) for d in range(2)]
    worlds(world).run(case_resume, tensor_model_parallel_size=new_tp, directory=out)


def test_zero1_checkpoint_into_a_plain_optimizer(saved, worlds):
    directory, _ = saved
    worlds(4).run(case_resume, tensor_model_parallel_size=2, directory=directory, kind="plain")


def test_plain_checkpoint_into_zero1(worlds, tmp_path):
    directory = str(tmp_path / "plain")
    worlds(4).run(case_save, tensor_model_parallel_size=2, directory=directory, kind="plain")
    assert "kind" not in _index(directory)["optimizer"]
    worlds(4).run(case_resume, tensor_model_parallel_size=2, directory=directory, kind="zero1")
    worlds(2).run(case_resume, tensor_model_parallel_size=2, directory=directory, kind="zero1")


# ---- a plain merge writes the dense model's optimizer state ----------------------------------------------------------

def case_merged_optimizer_continues(out: str, kind: str):
    """(A world of 1: the batches read the DP rank.) Load the merged model and optimizer state into torch AdamW:
    every state tensor equals the dense run's after the same steps, and the next step equals the dense run's."""
    from nxdtp.checkpointing import load_dense_optimizer_state

    merged = transformers.LlamaForCausalLM.from_pretrained(out)
    opt = _dense_adamw(merged)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)  # before loading: the loaded groups keep initial_lr
    state = load_dense_optimizer_state(out, merged, opt)
    assert state["global_step"] == SAVED_STEPS
    sched.load_state_dict(state["scheduler"])

    reference, ref_opt, ref_sched = _dense_run(SAVED_STEPS)
    ref_params = dict(reference.named_parameters())
    tol = dict(rtol=1e-5, atol=1e-5)
    for name, p in merged.named_parameters():
        expected = ref_opt.state[ref_params[name]]
        assert sorted(opt.state[p]) == sorted(expected), name
        for field, value in expected.items():
            torch.testing.assert_close(opt.state[p][field], value, **tol, msg=lambda m: f"{name} {field}: {m}")
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]

    _dense_train(merged, opt, sched, [SAVED_STEPS])
    _dense_train(reference, ref_opt, ref_sched, [SAVED_STEPS])
    for name, p in merged.named_parameters():
        torch.testing.assert_close(p, ref_params[name], **tol, msg=lambda m: f"{name} after the next step: {m}")

    moved = transformers.LlamaForCausalLM.from_pretrained(out)
    _moved_off(moved)
    if kind == "zero1":  # the master shards, reassembled, are the weights (fp32 parameters here)
        load_dense_optimizer_state(out, moved, _dense_adamw(moved), load_master_weights=True)
        at_save = dict(_dense_after(SAVED_STEPS).named_parameters())
        for name, p in moved.named_parameters():
            torch.testing.assert_close(p, at_save[name], **tol, msg=lambda m: f"{name}'s master weight: {m}")
    else:
        with pytest.raises(ValueError, match="holds no master weights: it was merged from a plain optimizer"):
            load_dense_optimizer_state(out, moved, _dense_adamw(moved), load_master_weights=True)


@pytest.mark.parametrize("kind", ["zero1", "plain"])
def test_merge_writes_the_dense_optimizer_state(saved, worlds, tmp_path, kind):
    """``nxdtp-merge CKPT OUT`` of a tp2 x dp2 checkpoint (ZeRO-1, or plain AdamW) puts the optimizer state beside the
    HF model as the dense model's torch AdamW holds it (case above)."""
    from nxdtp.cli import main

    if kind == "zero1":
        directory, _ = saved
    else:
        directory = str(tmp_path / "plain")
        worlds(4).run(case_save, tensor_model_parallel_size=2, directory=directory, kind="plain")
    out = str(tmp_path / "dense")
    assert main([directory, out, "--no-progress"]) == 0
    worlds(1).run(case_merged_optimizer_continues, out=out, kind=kind)


def case_dcp_export_loads(out: str):
    """(A world of 1.) ``dcp.load`` of the export into a dense model and torch AdamW, as a native job does it: the
    weights and every optimizer state tensor equal the dense run's after the same steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model = _llama()
    _moved_off(model)
    opt = _dense_adamw(model)
    state = {**model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt, options=options)}
    dcp.load(state, checkpoint_id=out, no_dist=True)
    model.load_state_dict({k: v for k, v in state.items() if k != "optimizer"})
    set_optimizer_state_dict(model, opt, state["optimizer"], options=options)
    reference, ref_opt, _ = _dense_run(SAVED_STEPS)
    ref_params = dict(reference.named_parameters())
    tol = dict(rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, ref_params[name], **tol, msg=lambda m: f"{name}: {m}")
        for field, value in ref_opt.state[ref_params[name]].items():
            torch.testing.assert_close(opt.state[p][field], value, **tol, msg=lambda m: f"{name} {field}: {m}")


@pytest.mark.parametrize("chunk_bytes", [None, 256])
def test_dcp_export_of_zero1_state_loads_into_dense_adamw(saved, worlds, tmp_path, monkeypatch, chunk_bytes):
    """Also with the export's chunks cut to 256 bytes: ZeRO-1 state is then read one TP piece at a time and written
    as many row ranges per tensor, and still loads exactly."""
    from nxdtp.checkpointing import dcp_export
    from nxdtp.cli import main

    if chunk_bytes is not None:
        monkeypatch.setattr(dcp_export, "CHUNK_BYTES", chunk_bytes)
    directory, _ = saved
    out = str(tmp_path / "dcp")
    assert main([directory, out, "--to", "dcp", "--no-progress"]) == 0
    if chunk_bytes is not None:
        import torch.distributed.checkpoint as dcp

        metadata = dcp.FileSystemReader(out).read_metadata().state_dict_metadata
        moments = [meta for key, meta in metadata.items() if key.endswith(".exp_avg")]
        assert moments and max(len(meta.chunks) for meta in moments) > 4  # more chunks than TP pieces
    worlds(1).run(case_dcp_export_loads, out=out)


def test_dense_optimizer_state_refuses_another_model(saved, tmp_path):
    from nxdtp.checkpointing import load_dense_optimizer_state
    from nxdtp.cli import main

    directory, _ = saved
    out = str(tmp_path / "dense")
    assert main([directory, out, "--no-progress", "--no-optimizer"]) == 0
    merged = transformers.LlamaForCausalLM.from_pretrained(out)
    with pytest.raises(FileNotFoundError, match="optimizer.json is missing"):
        load_dense_optimizer_state(out, merged, _dense_adamw(merged))
    assert main([directory, out, "--no-progress", "--force"]) == 0
    other = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match=r"no entry for parameters \['weight', 'bias'\]"):
        load_dense_optimizer_state(out, other, torch.optim.AdamW(other.parameters()))


# ---- crash during a ZeRO-1 save --------------------------------------------------------------------------------------

def test_kill_9_during_a_zero1_save_leaves_the_previous_or_the_new_tag(worlds, tmp_path):
    from tests.test_checkpoint_durability import _kill_run

    _, _, outcomes = _kill_run(worlds, tmp_path, world=2, moments=2, seed=31, hidden=256, calibrations=1, zero1=True)
    assert all(o in ("A", "B") for o in outcomes), outcomes


@pytest.mark.slow
def test_kill_9_at_20_random_moments_of_a_zero1_save(worlds, tmp_path):
    from tests.test_checkpoint_durability import _kill_run

    duration, delays, outcomes = _kill_run(worlds, tmp_path, world=2, moments=20, seed=2025, hidden=512,
                                           calibrations=2, zero1=True)
    print(f"save {duration:.3f} s; kills at {[round(d, 3) for d in delays]}; outcomes {outcomes}")
    assert "A" in outcomes and "B" in outcomes, (duration, delays, outcomes)


# ---- refusals --------------------------------------------------------------------------------------------------------

def _refusal_loading_into_zero1(directory: str):
    """The ValueError's message when ``directory`` is loaded into a fresh ZeRO-1 model and optimizer, else None."""
    from nxdtp.checkpointing import load

    model, opt, _ = _build("zero1")
    try:
        load(directory, model=model, optimizer=opt)
    except ValueError as e:
        return str(e)
    return None


def case_index_keyed_plain_into_zero1(directory: str):
    """NxD's form (state dicts: state keyed by parameter index) cannot give a ZeRO-1 optimizer its master weights."""
    from nxdtp.checkpointing import save

    model, opt, sched = _build("plain")
    _train(model, opt, sched, [0], "plain")
    save({"model": model.state_dict(), "optimizer": opt.state_dict(), "global_step": 1}, directory)
    return _refusal_loading_into_zero1(directory)


def test_plain_state_keyed_by_index_into_zero1_is_refused_naming_both_kinds(worlds, tmp_path):
    messages = worlds(2).run(case_index_keyed_plain_into_zero1, tensor_model_parallel_size=1,
                             directory=str(tmp_path / "nxd_form"))
    for message in messages:
        assert message is not None and "a non-ZeRO optimizer keyed by parameter index" in message, message
        assert "a ZeRO-1 optimizer (NeuronZero1Optimizer)" in message, message


def case_load_at_another_tp(directory: str):
    return _refusal_loading_into_zero1(directory)


def test_zero1_checkpoint_at_another_tp_names_the_reshard(saved, worlds):
    directory, _ = saved
    for message in worlds(4).run(case_load_at_another_tp, tensor_model_parallel_size=1, directory=directory):
        assert "tensor_model_parallel_size=2" in message and "--reshard 1" in message, message


def test_flat_shard_recut_between_group_sizes():
    from nxdtp.spec import FlatShardLayout

    for shape in [(7, 3), (1,), (5,), ()]:
        full = torch.arange(float(torch.Size(shape).numel())).reshape(shape) + 1
        for old in (1, 2, 3, 4, 8):
            source = FlatShardLayout(shape, old)
            shards = [source.shard_of(full, k) for k in range(old)]
            for new in (1, 2, 3, 4, 8):
                target = FlatShardLayout(shape, new)
                for rank in range(new):
                    read = []
                    got = target.shard_from(source, lambda k: read.append(k) or shards[k], rank, torch.float32)
                    assert torch.equal(got, target.shard_of(full, rank)), (shape, old, new, rank)
                    assert read == list(target.source_ranks(source, rank)), (shape, old, new, rank, read)
    with pytest.raises(ValueError, match=r"cannot re-cut a tensor of shape \(7, 3\) into the layout of shape "
                                         r"\(3, 7\)"):
        FlatShardLayout((3, 7), 2).shard_from(FlatShardLayout((7, 3), 2), lambda k: None, 0, torch.float32)


# ---- bf16 parameters: the fp32 master shards are what resumes --------------------------------------------------------

def _bf16_model_and_optimizer(seed: int):
    from tests.test_checkpoint_durability import _Model

    model = _Model(seed, hidden=16).to(torch.bfloat16)
    opt = NeuronZero1Optimizer(model.parameters(), torch.optim.SGD, grad_clipping=False, lr=1e-3, momentum=0.9)
    return model, opt


def _bf16_step(model, opt, step):
    tp_rank = ps.get_tensor_model_parallel_rank()
    for i, p in enumerate(model.parameters()):   # the same on every DP rank; per TP rank for sharded parameters
        sharded = getattr(p, "tensor_model_parallel", False)
        g = torch.Generator().manual_seed(700 + 10 * step + i + (100 * (tp_rank + 1) if sharded else 0))
        p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
    opt.step()


def _bf16_result(model, opt):
    masters = {i: s.clone() for i, s in opt.state_dict()["sharded_master_weights"].items()}
    return _params(model), masters


def case_bf16_save(directory: str):
    from nxdtp.checkpointing import save

    model, opt = _bf16_model_and_optimizer(seed=3)
    for step in range(3):
        _bf16_step(model, opt, step)
    save({"model": model, "optimizer": opt, "global_step": 3}, directory)
    _bf16_step(model, opt, 3)
    return _bf16_result(model, opt)


def case_bf16_resume(directory: str):
    from nxdtp.checkpointing import load

    model, opt = _bf16_model_and_optimizer(seed=4)
    load(directory, model=model, optimizer=opt)
    _bf16_step(model, opt, 3)
    return _bf16_result(model, opt)


def test_bf16_parameters_resume_from_the_fp32_master_shards_bit_exactly(worlds, tmp_path):
    # SGD steps of ~1e-3 on bf16 weights of ~1 (neighbours 2^-8 apart): the bf16 model file cannot hold what the fp32
    # masters accumulated, so a resume that rebuilt its masters from the loaded weights would differ.
    directory = str(tmp_path / "bf16")
    after = worlds(4).run(case_bf16_save, tensor_model_parallel_size=2, directory=directory)
    resumed = worlds(4).run(case_bf16_resume, tensor_model_parallel_size=2, directory=directory)
    for rank, ((params, masters), (params2, masters2)) in enumerate(zip(after, resumed)):
        assert _same(masters, masters2) == [], f"rank {rank}: master shards differ from the uninterrupted run"
        assert _same(params, params2) == [], f"rank {rank}: parameters differ from the uninterrupted run"
        assert all(m.dtype == torch.float32 for m in masters.values())

"""Sharded checkpoints (``nxdtp.checkpointing``) on real gloo ranks: exact resume, NxD's call form, crash safety, tags,
bad input, bf16 storage and the index.

A "new process" for resume means a later case call: the first call trains, saves and returns; the second rebuilds the
model, optimizer and scheduler from scratch (from a *different* seed, so weights that load() failed to restore would
show) and gets everything else from disk. Every parameter is randomised, biases and LayerNorms included (``_dense`` from
test_models_bert; ``_Tiny`` below), so a tensor restored from the wrong place cannot pass for a fresh one.

Error cases never let an exception escape a case function (that would restart the pool); each rank returns what it
raised, and the test checks that *every* rank raised and that the message names the file or the values at fault.

Tolerance: resume and reload are compared bitwise (``torch.equal`` / ``np.array_equal``, losses with ``==``): a
checkpoint stores the exact bits. The one exception is ``down_cast_bf16``, which must give exactly ``x.bfloat16()``
(checked bitwise) and so lies within bf16's relative rounding error 2**-8 of the fp32 value.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import shutil

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from nxdtp import comm
from nxdtp import parallel_state as ps
from nxdtp.checkpointing import FORMAT_VERSION, list_tags, load, newest_tag, save, save_load
from nxdtp.checkpointing import tags as checkpoint_tags
from nxdtp.checkpointing.durable import write_bytes_durably
from nxdtp.grads import bucket_allreduce_gradients
from nxdtp.layers import ColumnParallelLinear, RowParallelLinear
from nxdtp.random import MODEL_PARALLEL_RNG, get_xla_rng_tracker, model_parallel_xla_manual_seed

transformers = pytest.importorskip("transformers")
from transformers import BertForPreTraining  # noqa: E402

from tests.test_models_bert import _batch, _config, _dense  # noqa: E402

SEED = 1234  # model_parallel_xla_manual_seed for training
VOCAB = 1021  # odd: padded to 1024 (make_vocab_size_divisible_by=8) or 1022 (divisible_by=1) at tp=2


# ---- helpers (they run inside the workers) ---------------------------------------------------------------------------

def _error(fn) -> str | None:
    """What ``fn()`` raised, as 'Type: message', or None; the case goes on either way."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return f"{type(e).__name__}: {e}"
    return None


def _bert(dropout: float, seed: int, multiple: int = 8):
    """A randomised BertForPreTraining, sharded, with AdamW and a linear-decay LambdaLR."""
    from nxdtp.models.bert import parallelize_bert

    config = _config(VOCAB, dropout=dropout)
    model = parallelize_bert(_dense(BertForPreTraining, config, seed), make_vocab_size_divisible_by=multiple)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / 10)
    return config, model, opt, sched


def _train_step(config, model, opt, sched, step: int) -> float:
    """One TP x DP step: each DP rank its own batch, gradients averaged over DP, AdamW, scheduler."""
    batch = _batch(config, seed=1000 + 10 * step + ps.get_data_parallel_rank())
    opt.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    bucket_allreduce_gradients([p.grad for p in model.parameters() if p.grad is not None])
    opt.step()
    if sched is not None:
        sched.step()
    return loss.item()


def _params(model):
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def _optimizer_state(model, opt):
    """Optimizer state by parameter name (so two optimizers over two models compare), plus the groups."""
    names = {id(p): n for n, p in model.named_parameters()}
    state = {}
    for p, fields in opt.state.items():
        state[names[id(p)]] = {k: v.detach().numpy().copy() if isinstance(v, torch.Tensor) else v
                               for k, v in fields.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return state, groups


def _snapshot(model, opt, sched):
    state, groups = _optimizer_state(model, opt)
    return dict(params=_params(model), opt=state, groups=groups,
                sched=None if sched is None else sched.state_dict())


def _same_arrays(a, b) -> list:
    """Names whose arrays differ (bitwise) or exist on one side only."""
    return sorted(k for k in set(a) | set(b) if k not in a or k not in b or not np.array_equal(a[k], b[k]))


def _same_opt(a, b) -> list:
    bad = sorted(set(a) ^ set(b))
    for name in set(a) & set(b):
        if set(a[name]) != set(b[name]):
            bad.append(name)
            continue
        for field, value in a[name].items():
            other = b[name][field]
            equal = np.array_equal(value, other) if isinstance(value, np.ndarray) else value == other
            if not equal:
                bad.append(f"{name}/{field}")
    return bad


class _Tiny(nn.Module):
    """Column (stride 2) -> Row -> LayerNorm, every parameter randomised; replicated ones equal on all TP ranks."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.up = ColumnParallelLinear(8, 16, stride=2, gather_output=False)
        self.down = RowParallelLinear(16, 8, input_is_parallel=True)
        self.norm = nn.LayerNorm(8)
        tp_rank = ps.get_tensor_model_parallel_rank()
        with torch.no_grad():
            for i, (name, p) in enumerate(self.named_parameters()):
                sharded = getattr(p, "tensor_model_parallel", False)
                g = torch.Generator().manual_seed(seed * 100 + i + (50 * (tp_rank + 1) if sharded else 0))
                p.add_(torch.randn(p.shape, generator=g))

    def forward(self, x):
        return self.norm(self.down(self.up(x)))


def _tiny(seed: int, steps: int = 1):
    model = _Tiny(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return model, opt


def _files(tag_dir: str) -> list:
    return sorted(os.path.relpath(os.path.join(d, f), tag_dir) for d, _, fs in os.walk(tag_dir) for f in fs)


def _digests(tag_dir: str) -> dict:
    out = {}
    for relative in _files(tag_dir):
        with open(os.path.join(tag_dir, relative), "rb") as f:
            out[relative] = hashlib.sha256(f.read()).hexdigest()
    return out


# ---- 1. exact resume: tp=2 and tp=2 x dp=2, dropout off and on -------------------------------------------------------

DROPOUTS = (0.0, 0.1)
SAVE_AFTER, STEPS = 2, 4


def case_resume_first_run(root: str):
    """Per dropout: steps 1-4 uninterrupted (the reference), then a second run of steps 1-2 that saves and stops."""
    out = {}
    for dropout in DROPOUTS:
        config, model, opt, sched = _bert(dropout, seed=5)
        model_parallel_xla_manual_seed(SEED)
        losses = [_train_step(config, model, opt, sched, s) for s in range(1, STEPS + 1)]
        reference = dict(losses=losses, **_snapshot(model, opt, sched))

        config, model, opt, sched = _bert(dropout, seed=5)
        model_parallel_xla_manual_seed(SEED)
        first = [_train_step(config, model, opt, sched, s) for s in range(1, SAVE_AFTER + 1)]
        tag_dir = save({"model": model, "optimizer": opt, "scheduler": sched, "global_step": SAVE_AFTER, "epoch": 0},
                       os.path.join(root, f"dropout{dropout}"))
        out[dropout] = dict(reference=reference, first=first, tag_dir=tag_dir, saved=_params(model))
    return out


def case_resume_second_run(root: str):
    """Per dropout, rebuilt from another seed: load everything, RNG states restored or not, then steps 3-4."""
    out = {}
    for dropout in DROPOUTS:
        for restore in (True, False):
            config, model, opt, sched = _bert(dropout, seed=99)
            fresh = _params(model)
            # Without restore_rng_states a user would re-seed as at the start; with it, the seed must not matter.
            model_parallel_xla_manual_seed(SEED if not restore else 777)
            trainer = load(os.path.join(root, f"dropout{dropout}"), model=model, optimizer=opt, scheduler=sched,
                           restore_rng_states=restore)
            loaded = _params(model)
            losses = [_train_step(config, model, opt, sched, s) for s in range(SAVE_AFTER + 1, STEPS + 1)]
            out[(dropout, restore)] = dict(trainer=trainer, fresh=fresh, loaded=loaded, losses=losses,
                                           **_snapshot(model, opt, sched))
    return out


@pytest.mark.parametrize("world", [pytest.param(2, id="tp2"), pytest.param(4, id="tp2xdp2")])
def test_resume_is_exact_with_optimizer_scheduler_and_rng(worlds, tmp_path, world):
    first = worlds(world).run(case_resume_first_run, tensor_model_parallel_size=2, root=str(tmp_path))
    second = worlds(world).run(case_resume_second_run, tensor_model_parallel_size=2, root=str(tmp_path))
    for rank in range(world):
        for dropout in DROPOUTS:
            what = f"world={world} rank={rank} dropout={dropout}"
            ref, saved = first[rank][dropout]["reference"], first[rank][dropout]["saved"]
            assert first[rank][dropout]["first"] == ref["losses"][:SAVE_AFTER], f"{what}: runs are not deterministic"
            for restore in (True, False):
                got = second[rank][(dropout, restore)]
                label = f"{what} restore_rng_states={restore}"
                assert got["trainer"]["global_step"] == SAVE_AFTER and got["trainer"]["epoch"] == 0, label
                # The rebuilt model really started elsewhere, and load() put back every saved parameter exactly.
                assert len(_same_arrays(got["fresh"], saved)) == len(saved), f"{label}: rebuilt model equals the saved"
                assert _same_arrays(got["loaded"], saved) == [], label
                exact = restore or dropout == 0.0  # without dropout no RNG is drawn, so restoring it changes nothing
                if exact:
                    assert got["losses"] == ref["losses"][SAVE_AFTER:], (label, got["losses"], ref["losses"])
                    assert _same_arrays(got["params"], ref["params"]) == [], label
                    assert _same_opt(got["opt"], ref["opt"]) == [], label
                    assert got["groups"] == ref["groups"], label
                    assert got["sched"] == ref["sched"], label
                else:
                    # The control: re-seeding as at step 1 draws step-1 masks at step 3, so the run differs.
                    assert got["losses"][0] != ref["losses"][SAVE_AFTER], (label, got["losses"], ref["losses"])
                    assert _same_arrays(got["params"], ref["params"]), f"{label}: params equal without the RNG states"
        # DP replicas (same TP rank) hold identical parameters: DP rank 1 loaded the file DP rank 0 wrote.
        if world == 4 and rank >= 2:
            for restore in (True, False):
                assert _same_arrays(second[rank][(0.1, restore)]["params"],
                                    second[rank - 2][(0.1, restore)]["params"]) == [], rank


# ---- 2. NxD's call form: state dicts in, load(dir, model) and load(dir, optimizer) -----------------------------------

def case_nxd_form(root: str):
    config, model, opt, sched = _bert(0.0, seed=5)
    model_parallel_xla_manual_seed(SEED)
    for step in (1, 2):
        _train_step(config, model, opt, None, step)
    save({"model": model.state_dict(), "optimizer": opt.state_dict(), "global_step": 2}, root)
    with open(os.path.join(root, "step_000002", "nxdtp_index.json")) as f:
        keyed_by = json.load(f)["optimizer"]["keyed_by"]

    config, model2, opt2, _ = _bert(0.0, seed=99)
    before = _params(model2)
    trainer = load(root, model2)
    load(root, opt2)
    original_sd, loaded_sd = opt.state_dict(), opt2.state_dict()
    state_diff = [f"{i}/{k}" for i in original_sd["state"] for k, v in original_sd["state"][i].items()
                  if not torch.equal(v, loaded_sd["state"][i][k])]
    same_keys = original_sd["state"].keys() == loaded_sd["state"].keys()
    # One more step on both: identical, so nothing the step reads (lr, betas, step counts) was lost.
    loss1 = _train_step(config, model, opt, None, 3)
    loss2 = _train_step(config, model2, opt2, None, 3)
    return dict(keyed_by=keyed_by, trainer=trainer, changed=len(_same_arrays(before, _params(model2))),
                state_diff=state_diff, same_keys=same_keys, groups=(original_sd["param_groups"],
                                                                    loaded_sd["param_groups"]),
                after=_same_arrays(_params(model), _params(model2)), losses=(loss1, loss2),
                opt_after=_same_opt(_optimizer_state(model, opt)[0], _optimizer_state(model2, opt2)[0]))


def test_nxd_call_form_reloads_model_and_optimizer_exactly(worlds, tmp_path):
    for rank, r in enumerate(worlds(2).run(case_nxd_form, tensor_model_parallel_size=2, root=str(tmp_path))):
        assert r["keyed_by"] == "index", r["keyed_by"]  # a bare optimizer state dict has no parameter names
        assert r["trainer"] == {"global_step": 2}, r["trainer"]
        assert r["changed"] > 0, rank
        assert r["same_keys"] and r["state_diff"] == [], (rank, r["state_diff"])
        assert r["groups"][0] == r["groups"][1], (rank, r["groups"])  # betas stay a tuple, lr exact
        assert r["after"] == [] and r["opt_after"] == [] and r["losses"][0] == r["losses"][1], (rank, r)


# ---- 3. crash safety -------------------------------------------------------------------------------------------------

class _Killed(Exception):
    pass


def case_crash(root: str):
    rank = dist.get_rank()
    model, opt = _tiny(seed=3)
    save({"model": model, "optimizer": opt, "global_step": 1}, root)
    step1 = _params(model)
    model, opt = _tiny(seed=3, steps=2)

    # The save of step 2 dies after every data file is written, just before 'done' (rank 0 writes it).
    original = checkpoint_tags.mark_done

    def killed(tag_dir, *_):
        raise _Killed(f"simulated kill before marking {tag_dir} done")

    checkpoint_tags.mark_done = killed
    try:
        crash = _error(lambda: save({"model": model, "optimizer": opt, "global_step": 2}, root))
    finally:
        checkpoint_tags.mark_done = original
    comm.barrier()
    partial_files = _files(os.path.join(root, "step_000002"))
    newest_after_crash = newest_tag(root)

    # A second partial tag, written by hand: model files only.
    if rank == 0:
        os.makedirs(os.path.join(root, "step_000003", "model"))
        shutil.copy(os.path.join(root, "step_000001", "model", "tp_rank_00.safetensors"),
                    os.path.join(root, "step_000003", "model"))
    comm.barrier()

    fresh, _ = _tiny(seed=50)
    trainer = load(root, fresh)
    loaded_newest = _same_arrays(_params(fresh), step1)
    errors = {tag: _error(lambda: load(root, _tiny(seed=50)[0], tag=tag)) for tag in ("step_000002", "step_000003")}
    # The tag directory itself (what save returns and the training log prints) loads as its checkpoint directory does;
    # an incomplete one is refused with what it lacks.
    by_tag_dir, _ = _tiny(seed=51)
    load(os.path.join(root, "step_000001"), by_tag_dir)
    loaded_by_tag_dir = _same_arrays(_params(by_tag_dir), step1)
    errors["tag directory step_000002"] = _error(lambda: load(os.path.join(root, "step_000002"), _tiny(seed=50)[0]))
    tags_listed = list_tags(root)

    # Saving the crashed tag again completes it (the leftovers of the dead save are overwritten).
    save({"model": model, "optimizer": opt, "global_step": 2}, root)
    fresh, _ = _tiny(seed=50)
    load(root, fresh, tag="step_000002")
    return dict(crash=crash, partial_files=partial_files, newest_after_crash=newest_after_crash, trainer=trainer,
                loaded_newest=loaded_newest, loaded_by_tag_dir=loaded_by_tag_dir, errors=errors, tags=tags_listed,
                newest_final=newest_tag(root),
                retried=_same_arrays(_params(fresh), _params(model)))


def test_crash_mid_save_leaves_the_previous_checkpoint_loadable(worlds, tmp_path):
    results = worlds(2).run(case_crash, tensor_model_parallel_size=2, root=str(tmp_path))
    for rank, r in enumerate(results):
        # Every rank learns that the save failed, not only rank 0 (which was killed).
        assert r["crash"] is not None and "simulated kill" in r["crash"], (rank, r["crash"])
        assert "model/tp_rank_00.safetensors" in r["partial_files"] and "done" not in r["partial_files"], r
        assert "model/tp_rank_01.safetensors" in r["partial_files"] and "nxdtp_index.json" in r["partial_files"], r
        assert r["newest_after_crash"] == "step_000001", r
        assert r["trainer"]["global_step"] == 1 and r["loaded_newest"] == [] and r["loaded_by_tag_dir"] == [], (rank, r)
        tag_dir_error = r["errors"].pop("tag directory step_000002")
        assert tag_dir_error is not None and "incomplete" in tag_dir_error and "no 'done'" in tag_dir_error, \
            tag_dir_error
        for tag, message in r["errors"].items():
            assert message is not None and "incomplete" in message and tag in message, (rank, tag, message)
            assert "step_000001" in message, message  # it lists what can be loaded instead
        assert r["tags"] == ["step_000001"], r["tags"]
        assert r["newest_final"] == "step_000002" and r["retried"] == [], (rank, r)


# ---- 4. tags: names, keep_last, no overwriting -----------------------------------------------------------------------

def case_tags(root: str):
    rank = dist.get_rank()
    model, opt = _tiny(seed=4)
    listed, dirs = [], []
    for step in (1, 2, 3, 4):
        save({"model": model, "optimizer": opt, "global_step": step}, root, keep_last=2)
        listed.append(list_tags(root))
        dirs.append(sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))))
    before = _digests(os.path.join(root, "step_000004"))
    other, _ = _tiny(seed=77)
    again = _error(lambda: save({"model": other, "global_step": 4}, root, keep_last=2))
    comm.barrier()  # every rank is past the refused save before the files are compared
    after = _digests(os.path.join(root, "step_000004"))
    bad_keep = _error(lambda: save({"model": model, "global_step": 5}, root, keep_last=0))
    named = save({"model": model}, root, tag="before-eval.v2")
    return dict(listed=listed, dirs=dirs, again=again, unchanged=before == after, bad_keep=bad_keep,
                named=os.path.basename(named), newest=newest_tag(root), rank=rank)


def test_keep_last_tag_names_and_no_overwrite(worlds, tmp_path):
    for r in worlds(2).run(case_tags, tensor_model_parallel_size=2, root=str(tmp_path)):
        assert r["listed"] == [["step_000001"], ["step_000001", "step_000002"], ["step_000002", "step_000003"],
                               ["step_000003", "step_000004"]], r["listed"]
        assert r["dirs"][-1] == ["step_000003", "step_000004"], r["dirs"]
        assert r["again"] is not None and "step_000004" in r["again"] and "already exists" in r["again"], r
        assert r["unchanged"], f"rank {r['rank']}: a refused save changed the complete tag's files"
        assert r["bad_keep"] is not None and "keep_last=0" in r["bad_keep"], r["bad_keep"]
        assert r["named"] == "before-eval.v2" and r["newest"] == "before-eval.v2", r


# ---- 5. bad input: every rank raises, naming the file or the values --------------------------------------------------

def _damage(tag_dir: str, scenario: str) -> None:
    def path(*parts):
        return os.path.join(tag_dir, *parts)

    if scenario == "missing rank file":
        os.remove(path("model", "tp_rank_01.safetensors"))
    elif scenario == "truncated data":
        with open(path("model", "tp_rank_01.safetensors"), "r+b") as f:
            f.truncate(os.path.getsize(f.name) - 16)
    elif scenario == "truncated header":
        with open(path("model", "tp_rank_01.safetensors"), "r+b") as f:
            f.truncate(20)
    elif scenario == "damaged index":
        with open(path("nxdtp_index.json"), "r+") as f:
            text = f.read()
        with open(path("nxdtp_index.json"), "w") as f:
            f.write(text[: len(text) // 2])
    elif scenario == "format version":
        with open(path("nxdtp_index.json")) as f:
            index = json.load(f)
        index["format_version"] = FORMAT_VERSION + 98
        # A checkpoint of a future nxdtp: its 'done' records this index, so the index passes its checksum.
        checkpoint_tags.mark_done(tag_dir, write_bytes_durably(path("nxdtp_index.json"), json.dumps(index).encode()))
    elif scenario == "no newest":
        os.remove(os.path.join(os.path.dirname(tag_dir), "newest"))
    elif scenario == "missing optimizer file":
        os.remove(path("optim", "tp_rank_01.safetensors"))
    elif scenario == "missing rng file":
        os.remove(path("rng", "rank_00001.json"))
    elif scenario not in ("optimizer not saved", "optimizer without its model"):
        raise ValueError(scenario)


SCENARIOS = {
    # scenario: (what load() gets, strings every rank's message must contain)
    "missing rank file": ("model", ["model/tp_rank_01.safetensors", "missing"]),
    "truncated data": ("model", ["model/tp_rank_01.safetensors", "truncated"]),
    "truncated header": ("model", ["model/tp_rank_01.safetensors", "truncated"]),
    "damaged index": ("model", ["nxdtp_index.json", "damaged"]),
    "format version": ("model", ["nxdtp_index.json", f"format_version={FORMAT_VERSION + 98}",
                                 f"format version {FORMAT_VERSION}"]),
    "no newest": ("model", ["'newest'", "no complete checkpoint"]),
    "missing optimizer file": ("model+optimizer", ["optim/tp_rank_01.safetensors", "missing"]),
    "missing rng file": ("rng", ["rng/rank_00001.json", "missing"]),
    "optimizer not saved": ("optimizer", ["holds no optimizer state"]),
    "optimizer without its model": ("optimizer", ["keyed by parameter name", "pass the model"]),
}


def case_bad_input(root: str):
    rank = dist.get_rank()
    model, opt = _tiny(seed=6)
    save({"model": model, "optimizer": opt, "global_step": 1}, os.path.join(root, "with_opt"))
    save({"model": model, "global_step": 1}, os.path.join(root, "without_opt"))
    out = {}
    for scenario, (target, _) in SCENARIOS.items():
        base = "without_opt" if scenario == "optimizer not saved" else "with_opt"
        directory = os.path.join(root, scenario.replace(" ", "_"))
        if rank == 0:
            shutil.copytree(os.path.join(root, base), directory)
            _damage(os.path.join(directory, "step_000001"), scenario)
        comm.barrier()
        fresh, fresh_opt = _tiny(seed=60)
        kwargs = {"model": dict(model=fresh), "optimizer": dict(optimizer=fresh_opt),
                  "model+optimizer": dict(model=fresh, optimizer=fresh_opt),
                  "rng": dict(model=fresh, restore_rng_states=True)}[target]
        out[scenario] = _error(lambda: load(directory, **kwargs))
        comm.barrier()
    out["no such directory"] = _error(lambda: load(os.path.join(root, "nowhere"), model))
    # A checkpoint saved at tp=2 and loaded at tp=1 is handled by case_other_tp_degree (it needs another topology).
    return out


def case_other_tp_degree(root: str):
    fresh, _ = _tiny(seed=60)
    return _error(lambda: load(os.path.join(root, "with_opt"), fresh))


def test_bad_input_names_the_problem_on_every_rank(worlds, tmp_path):
    results = worlds(2).run(case_bad_input, tensor_model_parallel_size=2, root=str(tmp_path))
    for rank, r in enumerate(results):
        for scenario, (_, needles) in SCENARIOS.items():
            message = r[scenario]
            assert message is not None, f"rank {rank}: {scenario}: load() succeeded"
            for needle in needles:
                assert needle in message, f"rank {rank}: {scenario}: {needle!r} not in {message!r}"
        assert r["no such directory"] is not None and "nowhere" in r["no such directory"], r["no such directory"]
    other = worlds(2).run(case_other_tp_degree, tensor_model_parallel_size=1, root=str(tmp_path))
    for message in other:
        assert message is not None, "a tp=2 checkpoint loaded at tp=1"
        for needle in ("tensor_model_parallel_size=2", "tensor_model_parallel_size=1", "tools/merge_checkpoints.py",
                       "--reshard 1", os.path.join(str(tmp_path), "with_opt")):
            assert needle in message, (needle, message)


# ---- 6. down_cast_bf16 -----------------------------------------------------------------------------------------------

def case_bf16(root: str):
    from safetensors import safe_open

    config, model, opt, _ = _bert(0.0, seed=8)
    _train_step(config, model, opt, None, 1)
    tag_dir = save({"model": model, "optimizer": opt, "global_step": 1}, root, down_cast_bf16=True)
    tp_rank = ps.get_tensor_model_parallel_rank()
    with safe_open(os.path.join(tag_dir, "model", f"tp_rank_{tp_rank:02d}.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k).dtype for k in f.keys()}
    with safe_open(os.path.join(tag_dir, "optim", f"tp_rank_{tp_rank:02d}.safetensors"), "pt") as f:
        optim_dtypes = sorted({str(f.get_tensor(k).dtype) for k in f.keys()})
    with open(os.path.join(tag_dir, "nxdtp_index.json")) as f:
        index_dtypes = {k: e["dtype"] for k, e in json.load(f)["tensors"].items()}
    _, fresh, fresh_opt, _ = _bert(0.0, seed=80)
    load(root, model=fresh, optimizer=fresh_opt)
    original = dict(model.named_parameters())
    not_rounded = [n for n, p in fresh.named_parameters()
                   if p.dtype != torch.float32 or not torch.equal(p, original[n].detach().bfloat16().float())]
    worst = max(((p - original[n]).abs() / original[n].abs().clamp_min(1e-6)).max().item()
                for n, p in fresh.named_parameters())
    changed = sum(not torch.equal(p, original[n]) for n, p in fresh.named_parameters())
    opt_exact = _same_opt(_optimizer_state(model, opt)[0], _optimizer_state(fresh, fresh_opt)[0])
    return dict(stored=sorted(set(map(str, stored.values()))), index=sorted(set(index_dtypes.values())),
                not_rounded=not_rounded, worst=worst, changed=changed, optim_dtypes=optim_dtypes, opt_exact=opt_exact)


def test_down_cast_bf16_stores_bf16_and_loads_back(worlds, tmp_path):
    for r in worlds(2).run(case_bf16, tensor_model_parallel_size=2, root=str(tmp_path)):
        # Floating tensors only: an integer buffer in the state dict (transformers 4.26's BERT position_ids) keeps
        # its dtype.
        assert [d for d in r["stored"] if d != "torch.int64"] == ["torch.bfloat16"], r
        assert [d for d in r["index"] if d != "int64"] == ["bfloat16"], r
        assert r["not_rounded"] == [], r["not_rounded"]
        assert r["worst"] <= 2 ** -8 and r["changed"] > 0, r  # really rounded, within bf16's relative precision
        # The optimizer keeps full precision.
        assert r["optim_dtypes"] == ["torch.float32"] and r["opt_exact"] == [], (r["optim_dtypes"], r["opt_exact"])


# ---- 7. the index and who writes what (tp=2 x dp=2) ------------------------------------------------------------------

def case_index(root: str):
    from safetensors import safe_open

    rank, tp_rank, dp_rank = dist.get_rank(), ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
    config, model, opt, _ = _bert(0.0, seed=9, multiple=1)
    model_parallel_xla_manual_seed(SEED)
    _train_step(config, model, opt, None, 1)
    tiny, tiny_opt = _tiny(seed=10)

    wrote = []
    spied = {name: getattr(save_load, name) for name in ("_write_tensors",)}  # model and optimizer rank files

    def spy(name):
        def write(path, *args, **kwargs):
            wrote.append(os.path.relpath(path, root))
            return spied[name](path, *args, **kwargs)
        return write

    for name in spied:
        setattr(save_load, name, spy(name))
    try:
        bert_dir = save({"model": model, "optimizer": opt, "global_step": 1}, os.path.join(root, "bert"))
        tiny_dir = save({"model": tiny, "optimizer": tiny_opt, "global_step": 1}, os.path.join(root, "tiny"))
    finally:
        for name, function in spied.items():
            setattr(save_load, name, function)
    rng_now = (torch.get_rng_state(), get_xla_rng_tracker().get_states()[MODEL_PARALLEL_RNG]["cpu"])

    # This rank's file holds exactly its local pieces (and, on TP rank 0, the replicated tensors).
    local = model.state_dict()
    mismatched = []
    with safe_open(os.path.join(bert_dir, "model", f"tp_rank_{tp_rank:02d}.safetensors"), "pt") as f:
        file_keys = sorted(f.keys())
        for key in file_keys:
            if not torch.equal(f.get_tensor(key), local[key]):
                mismatched.append(key)

    with open(os.path.join(bert_dir, "rng", f"rank_{rank:05d}.json")) as f:
        rng = json.load(f)

    def decode(entry):
        return torch.load(io.BytesIO(base64.b64decode(entry["tensor"])), weights_only=True)

    rng_matches = (torch.equal(decode(rng["default"]["cpu"]), rng_now[0]),
                   torch.equal(decode(rng["tracker"][MODEL_PARALLEL_RNG]["cpu"]), rng_now[1]))
    names = [n for n, _ in model.named_parameters()]
    return dict(wrote=sorted(wrote), file_keys=file_keys, mismatched=mismatched, rng_matches=rng_matches,
                tp_rank=tp_rank, dp_rank=dp_rank, state_keys=sorted(k for k in local if not k.endswith("_extra_state")),
                names=names, bert_dir=bert_dir, tiny_dir=tiny_dir,
                sharded={n for n, p in model.named_parameters() if getattr(p, "tensor_model_parallel", False)})


def test_index_records_shapes_specs_aliases_and_writers(worlds, tmp_path):
    results = worlds(4).run(case_index, tensor_model_parallel_size=2, root=str(tmp_path))
    bert_dir, tiny_dir = results[0]["bert_dir"], results[0]["tiny_dir"]
    with open(os.path.join(bert_dir, "nxdtp_index.json")) as f:
        index = json.load(f)
    assert (index["format_version"], index["tensor_model_parallel_size"], index["data_parallel_size"]) == \
        (FORMAT_VERSION, 2, 2)
    tensors = index["tensors"]

    def spec(key):
        return tensors[key]["spec"]

    # Odd vocab at tp=2 with make_vocab_size_divisible_by=1: padded to 1022 rows, the real 1021 recorded too, and
    # the padding rule (a vocabulary padded to a multiple of 1 * tp) that a reshard follows.
    word = "bert.embeddings.word_embeddings.weight"
    assert spec(word) == dict(full_shape=[1022, 32], real_shape=[VOCAB, 32], partition_dim=0, stride=1,
                              num_partitions=2, sequence_parallel=False, pad_to_multiple_of=1,
                              vocabulary=True), spec(word)
    bias = spec("cls.predictions.bias")
    assert (bias["full_shape"], bias["real_shape"], bias["partition_dim"]) == ([1022], [VOCAB], 0), bias
    # Tied weights are stored once, under the embedding's key, with the decoder's names as aliases.
    assert tensors[word]["aliases"] == ["cls.predictions.decoder.weight"], tensors[word]
    assert tensors["cls.predictions.bias"]["aliases"] == ["cls.predictions.decoder.bias"]
    aliases = {a for e in tensors.values() for a in e["aliases"]}
    assert aliases == {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}, aliases
    assert not aliases & set(tensors)
    # Every state-dict tensor is accounted for exactly once: as a stored key or as an alias.
    state_keys = results[0]["state_keys"]
    assert sorted(set(tensors) | aliases) == state_keys and len(tensors) + len(aliases) == len(state_keys)
    layer = "bert.encoder.layer.1."
    for key, dim in ((layer + "attention.self.query.weight", 0), (layer + "attention.self.key.bias", 0),
                     (layer + "attention.output.dense.weight", 1), (layer + "intermediate.dense.weight", 0),
                     (layer + "output.dense.weight", 1)):
        assert (spec(key)["partition_dim"], spec(key)["stride"], spec(key)["num_partitions"]) == (dim, 1, 2), key
    for key in (layer + "output.dense.bias", layer + "output.LayerNorm.weight", layer + "output.LayerNorm.bias",
                "bert.pooler.dense.weight", "cls.seq_relationship.bias"):
        assert spec(key)["partition_dim"] is None, key
    sharded = results[0]["sharded"]
    assert {k for k, e in tensors.items() if e["spec"]["partition_dim"] is not None} == \
        {n for n in sharded if n in tensors}
    # Optimizer tensors are keyed by the parameter names (live optimizer + live model), one entry per parameter.
    assert index["optimizer"]["keyed_by"] == "name"
    assert list(index["optimizer"]["params"]) == results[0]["names"]
    assert index["optimizer"]["params"][word]["tensors"] == ["step", "exp_avg", "exp_avg_sq"]

    with open(os.path.join(tiny_dir, "nxdtp_index.json")) as f:
        tiny = json.load(f)["tensors"]
    assert tiny["up.weight"]["spec"] == dict(full_shape=[16, 8], real_shape=[16, 8], partition_dim=0, stride=2,
                                             num_partitions=2, sequence_parallel=False), tiny["up.weight"]
    assert (tiny["down.weight"]["spec"]["partition_dim"], tiny["norm.weight"]["spec"]["partition_dim"]) == (1, None)

    # Files: model and optimizer files only from DP rank 0 (ranks 0 and 1), an RNG file from every rank.
    assert _files(bert_dir) == sorted(
        ["nxdtp_index.json", "trainer_state.json", "config.json", "done", "optim/state.json"]
        + [f"model/tp_rank_0{t}.safetensors" for t in range(2)] + [f"optim/tp_rank_0{t}.safetensors" for t in range(2)]
        + [f"rng/rank_0000{r}.json" for r in range(4)])
    with open(os.path.join(bert_dir, "config.json")) as f:
        assert json.load(f)["vocab_size"] == VOCAB
    for r in results:
        expected = [] if r["dp_rank"] else sorted(
            f"{name}/{kind}/tp_rank_0{r['tp_rank']}.safetensors" for name in (os.path.join("bert", "step_000001"),
                                                                              os.path.join("tiny", "step_000001"))
            for kind in ("model", "optim"))
        assert r["wrote"] == expected, (r["tp_rank"], r["dp_rank"], r["wrote"])
        assert r["mismatched"] == [], r["mismatched"]
        assert r["rng_matches"] == (True, True), r
    # Replicated tensors live in TP rank 0's file only; TP rank 1's file holds only its sharded pieces.
    stored_sharded = sorted(k for k in tensors if spec(k)["partition_dim"] is not None)
    assert results[1]["file_keys"] == stored_sharded
    assert results[0]["file_keys"] == sorted(tensors)
    # The tracker's per-TP-rank states differ, so the RNG files of TP ranks 0 and 1 differ too.
    with open(os.path.join(bert_dir, "rng", "rank_00000.json")) as f0, \
            open(os.path.join(bert_dir, "rng", "rank_00001.json")) as f1, \
            open(os.path.join(bert_dir, "rng", "rank_00002.json")) as f2:
        r0, r1, r2 = json.load(f0), json.load(f1), json.load(f2)
    assert r0["tracker"] != r1["tracker"] and r0["default"] == r1["default"] and r0 == r2


def test_a_state_dict_without_specs_is_refused_at_tp_above_one():
    """Filtered of its '_extra_state' entries, a state dict would record every shard as replicated and lose the
    shards of TP ranks > 0; save refuses it instead."""
    import torch

    from nxdtp.checkpointing.index import split_state_dict

    with pytest.raises(ValueError, match="carries no nxdtp sharding specs .* tensor_model_parallel_size=2"):
        split_state_dict({"encoder.weight": torch.zeros(4, 2)}, tp=2)
    tensors, entries = split_state_dict({"encoder.weight": torch.zeros(4, 2)}, tp=1)
    assert not entries["encoder.weight"].spec.is_sharded


# ---- 8. NxD's get_sharded_model_dict, load(sharded=False), ensure_directory_exists, save/load's NxD parameters -------

class _Full(nn.Module):
    """Every kind of TP tensor: a padded vocab embedding with a tied head, a strided column, a row, grouped KV heads
    repeated over the ranks, a parameter with hand-set NxD attributes, and a replicated LayerNorm."""

    def __init__(self, seed: int):
        super().__init__()
        from nxdtp.layers import ParallelEmbedding
        from nxdtp.modules.qkv_linear import GQAQKVColumnParallelLinear
        from nxdtp.utils import set_tensor_model_parallel_attributes

        tp, rank = ps.get_tensor_model_parallel_size(), ps.get_tensor_model_parallel_rank()
        torch.manual_seed(seed)
        self.embed = ParallelEmbedding(11, 8, pad=True)          # 11 words: padded to 12 at tp=2
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight                      # tied
        torch.manual_seed(seed + 1)
        self.up = ColumnParallelLinear(8, 16, stride=2, gather_output=False)
        torch.manual_seed(seed + 2)
        self.down = RowParallelLinear(16, 8, input_is_parallel=True)
        torch.manual_seed(seed + 3)
        # 4 query heads and 1 KV head of size 2: at tp=2 each rank holds a copy of the KV head.
        self.qkv = GQAQKVColumnParallelLinear(8, [8, 2], gather_output=False, kv_size_multiplier=tp)
        dense = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed + 4))
        self.extra = nn.Parameter(dense.chunk(tp, dim=1)[rank].clone())
        set_tensor_model_parallel_attributes(self.extra, True, 1, 1, tp)
        self.norm = nn.LayerNorm(8)
        g = torch.Generator().manual_seed(seed + 5)
        with torch.no_grad():
            self.norm.weight.copy_(torch.randn(8, generator=g))
            self.norm.bias.copy_(torch.randn(8, generator=g))


def _state_diff(a: dict, b: dict) -> list:
    if a.keys() != b.keys():
        return [f"keys: {sorted(set(a) ^ set(b))}"]
    return [k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k])]


class _Hooked(nn.Module):
    """NxD's preshard_hook: the full state dict names this layer's weight 'legacy'."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(31)
        self.proj = ColumnParallelLinear(4, 8, bias=False, gather_output=False)
        self.proj.preshard_hook = self._rename
        self.calls = []

    def _rename(self, state_dict, key):
        self.calls.append(key)
        state_dict[key] = state_dict.pop(key.replace("weight", "legacy"))


def case_sharded_model_dict(root: str):
    from nxdtp.checkpointing import get_sharded_model_dict

    seed = 40
    model = _Full(seed)
    local = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in model.state_dict().items()}
    # The full state dict: the same model at TP=1 (a TP=1 layer holds the dense tensor; the tests of nxdtp.layers
    # check that against torch.nn), specs included.
    with ps.simulated_topology(world_size=1, rank=0, tensor_model_parallel_size=1):
        full = _Full(seed).state_dict()
    shapes = {k: tuple(v.shape) for k, v in full.items() if isinstance(v, torch.Tensor)}
    out = {"dense_shapes": shapes}
    sharded = get_sharded_model_dict(model, full)
    out["same_object"] = sharded is full
    out["diff"] = _state_diff(sharded, local)
    # A fresh model (another seed) takes the sharded dict with strict=True and ends equal to the original.
    fresh = _Full(seed + 100)
    out["fresh_differs"] = len(_state_diff(fresh.state_dict(), local))
    fresh.load_state_dict(sharded, strict=True)
    out["fresh_diff"] = _state_diff(fresh.state_dict(), local)
    # Without specs (a torch.nn model's state dict has none), and with the padded full tensor of the embedding.
    with ps.simulated_topology(world_size=1, rank=0, tensor_model_parallel_size=1):
        plain = {k: v for k, v in _Full(seed).state_dict().items() if not k.endswith("_extra_state")}
    plain["embed.weight"] = torch.cat([plain["embed.weight"], torch.zeros(1, 8)])   # 12 rows: the padded shape
    plain["head.weight"] = plain["embed.weight"]
    out["plain_diff"] = _state_diff(get_sharded_model_dict(model, plain),
                                    {k: v for k, v in local.items() if not k.endswith("_extra_state")})
    # Wrong shapes name the key and both accepted shapes; a dict that is sharded already says so.
    out["wrong"] = _error(lambda: get_sharded_model_dict(model, {"up.weight": torch.zeros(5, 8)}))
    out["twice"] = _error(lambda: get_sharded_model_dict(model, {"up.weight": local["up.weight"].clone()}))
    hooked = _Hooked()
    with ps.simulated_topology(world_size=1, rank=0, tensor_model_parallel_size=1):
        dense_proj = _Hooked().proj.weight.detach().clone()
    renamed = get_sharded_model_dict(hooked, {"proj.legacy": dense_proj})
    out["hook"] = (hooked.calls, sorted(renamed), torch.equal(renamed["proj.weight"], hooked.proj.weight.detach()))

    # load(path, model, sharded=False): NxD's full-checkpoint form, every rank reading the one file.
    path = os.path.join(root, "full", "checkpoint.pt")
    if dist.get_rank() == 0:
        with ps.simulated_topology(world_size=1, rank=0, tensor_model_parallel_size=1):
            payload = {"model": _Full(seed).state_dict(), "global_step": 7}
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(payload, path)
    comm.barrier()
    fresh = _Full(seed + 200)
    out["rest"] = load(path, fresh, sharded=False)
    out["load_diff"] = _state_diff(fresh.state_dict(), local)
    fresh = _Full(seed + 300)
    out["by_keyword"] = load(path, model_or_optimizer=fresh, model_key="model", sharded=False)
    out["by_keyword_diff"] = _state_diff(fresh.state_dict(), local)
    out["missing_key"] = _error(lambda: load(path, _Full(seed), model_key="weights", sharded=False))
    out["tag_on_file"] = _error(lambda: load(path, _Full(seed), sharded=False, tag="step_000001"))
    return out


@pytest.mark.parametrize("world", [pytest.param(2, id="tp2"), pytest.param(4, id="tp2xdp2")])
def test_get_sharded_model_dict_gives_each_rank_its_own_state(worlds, tmp_path, world):
    results = worlds(world).run(case_sharded_model_dict, tensor_model_parallel_size=2, root=str(tmp_path))
    for rank, r in enumerate(results):
        # The full dict really is full: dense vocab (11 rows), dense KV head (2 rows), whole strided and row weights.
        assert r["dense_shapes"]["embed.weight"] == (11, 8) and r["dense_shapes"]["qkv.weight_k"] == (2, 8), r
        assert r["dense_shapes"]["up.weight"] == (16, 8) and r["dense_shapes"]["extra"] == (4, 6), r
        assert r["same_object"], "NxD's function fills in and returns the dict it was given"
        assert r["diff"] == [] and r["plain_diff"] == [], (rank, r["diff"], r["plain_diff"])
        assert r["fresh_differs"] > 0 and r["fresh_diff"] == [], (rank, r["fresh_differs"], r["fresh_diff"])
        assert r["wrong"] == ("ValueError: get_sharded_model_dict: 'up.weight' has shape [5, 8], but a full tensor of "
                              "it has the dense shape [16, 8] or the padded shape [16, 8]."), r["wrong"]
        assert "It has this rank's shard shape: is the state dict sharded already?" in r["twice"], r["twice"]
        assert r["hook"] == (["proj.weight"], ["proj.weight"], True), r["hook"]
        assert r["rest"] == {"global_step": 7} and r["load_diff"] == [], (rank, r["rest"], r["load_diff"])
        assert r["by_keyword"] == {"global_step": 7} and r["by_keyword_diff"] == [], rank
        assert "no model_key='weights' entry" in r["missing_key"] and "global_step" in r["missing_key"], r
        assert "tag= applies to nxdtp's sharded checkpoint directories" in r["tag_on_file"], r["tag_on_file"]


def test_ensure_directory_exists(tmp_path, monkeypatch):
    from nxdtp.checkpointing import ensure_directory_exists

    target = tmp_path / "a" / "b" / "checkpoint.pt"
    ensure_directory_exists(str(target))
    assert (tmp_path / "a" / "b").is_dir() and not target.exists()
    ensure_directory_exists(str(target))            # already there: nothing to do
    monkeypatch.chdir(tmp_path)
    ensure_directory_exists("checkpoint.pt")         # no directory part (NxD's makedirs("") would raise)
    assert sorted(os.listdir(tmp_path)) == ["a"]


@pytest.mark.parametrize("call,error,message", [
    (lambda: save({"model": {}}, "d", True, True), ValueError,
     "save(): save_xser=True is not supported by nxdtp, only save_xser=False: nxdtp writes its own"),
    (lambda: save({"model": {}}, "d", master_dp_only=False), ValueError,
     "save(): master_dp_only=False is not supported by nxdtp, only master_dp_only=True: the DP replicas"),
    (lambda: save({"model": {}}, "d", "step_1"), TypeError,
     "save_serially='step_1' must be True or False (it is NxD's third parameter; pass tag= and keep_last= by keyword)"),
    (lambda: load("d", None, None, "model", True), ValueError,
     "load(): load_xser=True is not supported by nxdtp, only load_xser=False: nxdtp checkpoints are safetensors"),
    (lambda: load("d", master_dp_only=False), ValueError,
     "load(): master_dp_only=False is not supported by nxdtp, only master_dp_only=True"),
    (lambda: load("d", sharded="no"), TypeError, "sharded='no' must be True or False"),
    (lambda: load("d", model_key="weights"), ValueError,
     "model_key='weights' is not supported; nxdtp checkpoints store the model as 'model'"),
    (lambda: load("d", nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1),
                  optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)), ValueError,
     "load() got two optimizers: model_or_optimizer= and optimizer="),
    (lambda: load("d", nn.Linear(2, 2), nn.Linear(2, 2)), ValueError, "load() got two models"),
    (lambda: load("d", "model"), TypeError, "model must be an nn.Module or an optimizer, got str"),
])
def test_nxd_parameters_of_save_and_load_are_checked(call, error, message):
    """NxD's positional parameters: values nxdtp does not implement are refused before anything is read or written."""
    with pytest.raises(error) as info:
        call()
    assert message in str(info.value), str(info.value)


def test_signatures_are_nxds():
    from nxdtp import checkpointing
    from tests.test_utils import REQUIRED, check_nxd_signature

    check_nxd_signature(checkpointing.ensure_directory_exists, [("filename", REQUIRED)])
    check_nxd_signature(checkpointing.get_sharded_model_dict, [("model", REQUIRED), ("model_state_dict", REQUIRED)])
    check_nxd_signature(checkpointing.save, [("checkpoint", REQUIRED), ("output_dir", REQUIRED),
                                             ("save_serially", True), ("save_xser", False), ("down_cast_bf16", False),
                                             ("master_dp_only", True)])
    check_nxd_signature(checkpointing.load, [("chkpt_path", REQUIRED), ("model", None), ("model_or_optimizer", None),
                                             ("model_key", "model"), ("load_xser", False), ("sharded", True),
                                             ("strict", True), ("master_dp_only", True), ("weights_only", False)])

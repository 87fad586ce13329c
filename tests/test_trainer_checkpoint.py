"""NxD's trainer checkpoint API (``nxdtp.trainer.checkpoint``, issue 25 item 1) on gloo ranks.

* Resume: test_zero1_checkpoints' tiny randomised Llama at tp2 x dp2 with ZeRO-1 AdamW (two param groups, clipping) and
  a LambdaLR trains 2 steps, ``save_checkpoint`` (NxD's positional call; or ``async_save=True`` through NxD-like
  wrappers, with the third step run while the writer is still busy and user_content changed before
  ``finalize_checkpoint``), then the third step. A fresh model (weights moved off) and optimizer take
  ``load_checkpoint(dir, tag=None, ...)``, which returns the user_content as saved (tuples, integer keys, tensors), and
  their third step equals the uninterrupted one bit for bit: parameters, ZeRO-1 state and master shards, LR.
* bf16 parameters with ZeRO-1: an async save and a resume continue bit-exactly (the fp32 masters come from the file).
* ``num_kept_ckpts``, ``has_checkpoint``, one save at a time (the second waits for the first), a writer's error raised
  by ``finalize_checkpoint`` on every rank, and bad input (missing directory, unknown tag, user_content that
  ``torch.load(weights_only=True)`` could not rebuild, NxD values nxdtp refuses, a directory in NxD's layout).
* kill -9 while the background writer is mid-file (and the training loop has run collectives since the call
  returned) leaves the previous tag the one that loads (test_checkpoint_durability's harness and model).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from nxdtp import parallel_state as ps
from nxdtp.checkpointing import safetensors_stream, tags
from nxdtp.trainer import finalize_checkpoint, has_checkpoint, load_checkpoint, save_checkpoint
from nxdtp.trainer.checkpoint import check_user_content, unwrap_model, unwrap_optimizer
from tests.harness import PROCESS_WAIT_S
from tests.test_checkpoint_durability import (
    REPO_ROOT,
    _files,
    _free_port,
    _model_and_optimizer,
    _optimizer_arrays,
    _which,
)

SAVED_STEPS = 2


# ---- NxD-like wrappers: they own no tensor and delegate, as NxDModel and NxDOptimizer do -----------------------------

class _NxDModelLike(nn.Module):
    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class _NxDOptimizerLike(torch.optim.Optimizer):
    def __init__(self, optimizer):  # no Optimizer.__init__: everything is the inner optimizer's
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def step(self, closure=None):
        return self.optimizer.step(closure)


@contextlib.contextmanager
def _slow_writes(seconds: float, fail_on_rank=None):
    """Every tensor write of this process takes ``seconds`` longer (so a step surely overlaps the writer), or raises
    on rank ``fail_on_rank``; the writer is restored afterwards (pool processes run other cases next)."""
    original = safetensors_stream.StreamingSafetensorsWriter.write
    rank = ps.get_topology().rank

    def slow(self, name, tensor):
        if rank == fail_on_rank:
            raise OSError("no space left on device (injected by the test)")
        time.sleep(seconds)
        return original(self, name, tensor)

    safetensors_stream.StreamingSafetensorsWriter.write = slow
    try:
        yield
    finally:
        safetensors_stream.StreamingSafetensorsWriter.write = original


def _forward(model) -> torch.Tensor:
    """test_checkpoint_durability's model: column-parallel, row-parallel (a TP all-reduce), LayerNorm."""
    return model.norm(model.down(model.up(torch.randn(2, 16)))).sum()


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return f"{type(e).__name__}: {e}"
    return "no error"


# ---- resume at tp2 x dp2 (ZeRO-1 Llama) ------------------------------------------------------------------------------

def _user_content():
    return {"global_step": SAVED_STEPS, "epoch": (0, 1), 3: torch.arange(3), "cli_args": {"lr": 1e-3, "tag": None},
            "seen": {1, 2}}


def _state(model, opt, sched):
    from tests.test_zero1_checkpoints import _params

    return {"params": _params(model), "optimizer": _optimizer_arrays(model, opt), "lr": sched.get_last_lr(),
            "group_lrs": [g["lr"] for g in opt.param_groups]}


def case_save_and_continue(directory: str, mode: str):
    """Train 2 steps, save (``mode``: "sync" in NxD's positional form, or "async" through wrappers, the third step run
    while the writer works), train the third; return the state after it and what was seen during the async save."""
    from tests.test_zero1_checkpoints import _build, _train

    model, opt, sched = _build("zero1")
    _train(model, opt, sched, range(SAVED_STEPS))
    tag = f"step_{SAVED_STEPS}"
    seen = {}
    if mode == "sync":
        save_checkpoint(directory, tag, model, opt, sched, _user_content(), 8, True, None)
        _train(model, opt, sched, [SAVED_STEPS])
    else:
        user_content = _user_content()
        with _slow_writes(0.02):
            started = time.perf_counter()
            save_checkpoint(directory, tag, model=_NxDModelLike(model), optimizer=_NxDOptimizerLike(opt),
                            scheduler=sched, user_content=user_content, async_save=True)
            seen["returned_s"] = time.perf_counter() - started
            # The loop goes on: its step changes the weights, the ZeRO-1 shards and the LR in place, and the caller's
            # user_content changes too, while the tag is still being written.
            _train(model, opt, sched, [SAVED_STEPS])
            user_content["global_step"] = 999
            user_content[3].add_(100)
            seen["complete_after_step"] = tags.is_complete(os.path.join(directory, tag))
            started = time.perf_counter()
            finalize_checkpoint()
            seen["finalize_s"] = time.perf_counter() - started
        seen["complete_after_finalize"] = tags.is_complete(os.path.join(directory, tag))
    return _state(model, opt, sched), seen


def case_resume(directory: str, wrapped: bool):
    from tests.test_zero1_checkpoints import _build, _moved_off, _train

    model, opt, sched = _build("zero1")
    _moved_off(model)
    targets = (_NxDModelLike(model), _NxDOptimizerLike(opt)) if wrapped else (model, opt)
    user_content = load_checkpoint(directory, tag=None, model=targets[0], optimizer=targets[1], scheduler=sched)
    _train(model, opt, sched, [SAVED_STEPS])
    return _state(model, opt, sched), user_content


def _assert_same_state(after, resumed):
    for rank, (a, b) in enumerate(zip(after, resumed)):
        different = sorted(k for k in a["params"] if not torch.equal(a["params"][k], b["params"][k]))
        assert not different, f"rank {rank}: parameters differ from the uninterrupted run: {different}"
        assert sorted(a["optimizer"]) == sorted(b["optimizer"]), rank
        different = sorted(k for k in a["optimizer"] if not (a["optimizer"][k] == b["optimizer"][k]).all()
                           or a["optimizer"][k].dtype != b["optimizer"][k].dtype)
        assert not different, f"rank {rank}: optimizer state differs from the uninterrupted run: {different}"
        assert a["lr"] == b["lr"] and a["group_lrs"] == b["group_lrs"], (rank, a["lr"], b["lr"])


def _assert_user_content(user_content):
    expected = _user_content()
    assert set(user_content) == set(expected), user_content
    assert user_content["epoch"] == (0, 1) and isinstance(user_content["epoch"], tuple)
    assert torch.equal(user_content[3], torch.arange(3))
    assert user_content["global_step"] == SAVED_STEPS and user_content["cli_args"] == expected["cli_args"]
    assert user_content["seen"] == {1, 2}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_with_zero1_at_tp2_dp2_equals_the_uninterrupted_run(worlds, tmp_path, mode):
    directory = str(tmp_path / "ckpt")
    results = worlds(4).run(case_save_and_continue, tensor_model_parallel_size=2, directory=directory, mode=mode)
    after = [state for state, _ in results]
    if mode == "async":
        for rank, (_, seen) in enumerate(results):
            # The call returned before the files were written: the step ran while the writer was busy.
            assert seen["complete_after_step"] is False, (rank, seen)
            assert seen["complete_after_finalize"] is True, (rank, seen)
    assert has_checkpoint(directory)
    index = json.load(open(os.path.join(directory, "step_2", "nxdtp_index.json")))
    assert index["optimizer"]["kind"] == "zero1" and index["data_parallel_size"] == 2
    resumed = worlds(4).run(case_resume, tensor_model_parallel_size=2, directory=directory, wrapped=mode == "async")
    for _, user_content in resumed:
        _assert_user_content(user_content)
    _assert_same_state(after, [state for state, _ in resumed])


# ---- bf16 parameters with ZeRO-1 -------------------------------------------------------------------------------------

def case_bf16_async_save(directory: str):
    from tests.test_zero1_checkpoints import _bf16_model_and_optimizer, _bf16_result, _bf16_step

    model, opt = _bf16_model_and_optimizer(seed=3)
    for step in range(3):
        _bf16_step(model, opt, step)
    save_checkpoint(directory, "step_3", model, opt, None, {"global_step": 3}, async_save=True)
    _bf16_step(model, opt, 3)
    finalize_checkpoint()
    return _bf16_result(model, opt)


def case_bf16_resume(directory: str):
    from tests.test_zero1_checkpoints import _bf16_model_and_optimizer, _bf16_result, _bf16_step

    model, opt = _bf16_model_and_optimizer(seed=4)
    assert load_checkpoint(directory, model=model, optimizer=opt) == {"global_step": 3}
    _bf16_step(model, opt, 3)
    return _bf16_result(model, opt)


def test_bf16_parameters_with_zero1_resume_bit_exactly_after_an_async_save(worlds, tmp_path):
    # The bf16 model file cannot hold what the fp32 masters accumulated (SGD steps of ~1e-3 on weights of ~1): the
    # resume is exact only because the masters come from the checkpoint, after the model is loaded.
    directory = str(tmp_path / "bf16")
    after = worlds(4).run(case_bf16_async_save, tensor_model_parallel_size=2, directory=directory)
    resumed = worlds(4).run(case_bf16_resume, tensor_model_parallel_size=2, directory=directory)
    for rank, ((params, masters), (params2, masters2)) in enumerate(zip(after, resumed)):
        assert all(p.dtype == torch.bfloat16 for p in params.values())
        assert [k for k in masters if not torch.equal(masters[k], masters2[k])] == [], rank
        assert [k for k in params if not torch.equal(params[k], params2[k])] == [], rank


# ---- tags: num_kept_ckpts, has_checkpoint, one save at a time, writer errors -----------------------------------------

def case_keep_and_order(directory: str):
    model, opt = _model_and_optimizer(seed=1)
    out = {"before": has_checkpoint(directory)}
    for step in range(1, 5):
        save_checkpoint(directory, f"step_{step}", model, opt, user_content={"global_step": step},
                        num_kept_ckpts=2, async_save=step % 2 == 0)
        out[f"tags_after_{step}"] = tags.complete_tags(directory)
    finalize_checkpoint()
    out["tags_end"] = tags.complete_tags(directory)
    out["loaded"] = load_checkpoint(directory, model=model, optimizer=opt)
    out["loaded_3"] = load_checkpoint(directory, tag="step_3", model=model, optimizer=opt)
    # One save at a time: the second asynchronous call returns only after the first one's tag is complete.
    with _slow_writes(0.05):
        save_checkpoint(directory, "w1", model, opt, async_save=True, num_kept_ckpts=-1)
        out["w1_complete_when_first_returned"] = tags.is_complete(os.path.join(directory, "w1"))
        save_checkpoint(directory, "w2", model, opt, async_save=True)
        out["w1_complete_when_second_returned"] = tags.is_complete(os.path.join(directory, "w1"))
        finalize_checkpoint()
    out["newest"] = tags.newest_tag(directory)
    out["tags_final"] = tags.complete_tags(directory)
    return out


def test_num_kept_ckpts_has_checkpoint_and_one_save_at_a_time(worlds, tmp_path):
    directory = str(tmp_path / "ckpt")
    out = worlds(2).run(case_keep_and_order, tensor_model_parallel_size=2, directory=directory)[0]
    assert out["before"] is False
    # The tag being written is never deleted, and the newest complete one stays: 2 complete tags at most.
    assert out["tags_after_1"] == ["step_1"] and out["tags_after_2"] in (["step_1"], ["step_1", "step_2"]), out
    assert out["tags_after_3"] == ["step_2", "step_3"], out
    assert out["tags_end"] == ["step_3", "step_4"], out
    assert out["loaded"] == {"global_step": 4} and out["loaded_3"] == {"global_step": 3}
    assert out["w1_complete_when_first_returned"] is False, "the async save wrote its files before returning"
    assert out["w1_complete_when_second_returned"] is True, "the second save did not wait for the first"
    # num_kept_ckpts=-1 and None keep every tag.
    assert out["newest"] == "w2" and out["tags_final"] == ["step_3", "step_4", "w1", "w2"], out
    assert has_checkpoint(directory) and not has_checkpoint(str(tmp_path / "nothing"))


def case_writer_error(directory: str):
    model, opt = _model_and_optimizer(seed=1)
    save_checkpoint(directory, "good", model, opt, user_content={"global_step": 1})
    with _slow_writes(0.0, fail_on_rank=1):
        save_checkpoint(directory, "bad", model, opt, user_content={"global_step": 2}, async_save=True)
        _forward(model).backward()  # training goes on: TP collectives in forward and backward
        error = _error(finalize_checkpoint)
    return {"error": error, "again": _error(finalize_checkpoint), "complete": tags.complete_tags(directory),
            "lock_left": os.path.exists(os.path.join(directory, "bad.lock")),
            "loaded": load_checkpoint(directory, model=model, optimizer=opt)}


def test_a_writer_error_is_raised_by_finalize_on_every_rank(worlds, tmp_path):
    directory = str(tmp_path / "ckpt")
    out = worlds(2).run(case_writer_error, tensor_model_parallel_size=2, directory=directory)
    assert out[1]["error"].startswith("OSError: no space left on device (injected"), out[1]["error"]
    assert out[0]["error"].startswith("RuntimeError: saving ") and "bad failed on rank(s) [1]" in \
        out[0]["error"] and "no space left" in out[0]["error"], out[0]["error"]
    for rank_out in out:
        assert rank_out["again"] == "no error"  # raised once
        assert rank_out["complete"] == ["good"] and rank_out["lock_left"] is False
        assert rank_out["loaded"] == {"global_step": 1}


# ---- bad input -------------------------------------------------------------------------------------------------------

def case_bad_input(directory: str, nxd_directory: str):
    model, opt = _model_and_optimizer(seed=1)
    rank = ps.get_topology().rank
    save_checkpoint(directory, "step_1", model, opt)
    return {
        "missing_dir": _error(lambda: load_checkpoint(directory + "_missing", model=model)),
        "unknown_tag": _error(lambda: load_checkpoint(directory, tag="step_7", model=model)),
        "namespace": _error(lambda: save_checkpoint(directory, "ns", model, opt,
                                                    user_content={"args": argparse.Namespace(lr=1.0)})),
        "one_rank": _error(lambda: save_checkpoint(
            directory, "dt", model, opt, user_content={"when": [1, datetime.datetime(2025, 1, 1)] if rank else 1})),
        "model_none": _error(lambda: save_checkpoint(directory, "none", None, opt)),
        "keep_zero": _error(lambda: save_checkpoint(directory, "k", model, num_kept_ckpts=0)),
        "dcp_and_avoid": _error(lambda: save_checkpoint(directory, "d", model, use_zero1_dcp=True,
                                                        avoid_saving_lower_precision_weights=True)),
        "again": _error(lambda: save_checkpoint(directory, "step_1", model, opt)),
        "dict_optimizer": _error(lambda: load_checkpoint(directory, model=model, optimizer=opt.state_dict())),
        "nxd_layout": _error(lambda: load_checkpoint(nxd_directory, model=model)),
        "tags": sorted(os.listdir(directory)),
    }


def test_bad_input_gets_one_clear_error(worlds, tmp_path):
    directory, nxd_directory = str(tmp_path / "ckpt"), tmp_path / "nxd"
    for name in ("done", "checkpoint", "model/dp_rank_00_tp_rank_00_pp_rank_00.pt",
                 "model/dp_rank_00_tp_rank_01_pp_rank_00.pt"):   # NxD's layout (the files' contents do not matter)
        (nxd_directory / "step_5" / name).parent.mkdir(parents=True, exist_ok=True)
        (nxd_directory / "step_5" / name).write_text("1")
    out = worlds(2).run(case_bad_input, tensor_model_parallel_size=2, directory=directory,
                        nxd_directory=str(nxd_directory))
    for rank, errors in enumerate(out):
        assert errors["missing_dir"] == f"FileNotFoundError: load_checkpoint(): checkpoint directory {directory}" \
                                        "_missing does not exist", errors["missing_dir"]
        assert f"checkpoint tag {directory}/step_7 does not exist; complete tags: ['step_1']" in \
            errors["unknown_tag"], errors["unknown_tag"]
        assert errors["namespace"].startswith("TypeError: save_checkpoint(): user_content['args'] is a "
                                              "argparse.Namespace, which nxdtp does not store"), errors["namespace"]
        assert "weights_only=True" in errors["namespace"] and "vars(user_content['args'])" in errors["namespace"]
        assert "model=None" in errors["model_none"] and errors["model_none"].startswith("ValueError")
        assert errors["keep_zero"].startswith("ValueError: save_checkpoint(): num_kept_ckpts=0 must be"), errors
        assert errors["dcp_and_avoid"].startswith("ValueError: save_checkpoint(): use_zero1_dcp=True and "), errors
        assert "already exists and is complete" in errors["again"], errors["again"]
        assert errors["dict_optimizer"].startswith("TypeError: load_checkpoint(): optimizer must be"), errors
        assert errors["nxd_layout"].startswith(f"ValueError: load_checkpoint(): {nxd_directory} holds checkpoints of "
                                               "NxD's save_checkpoint (tags ['step_5']"), errors["nxd_layout"]
        assert f"nxdtp-merge {nxd_directory} OUT_DIR --from-nxd" in errors["nxd_layout"]
        # Nothing was written for a refused save: only the one good tag (and 'newest').
        assert errors["tags"] == ["newest", "step_1"], errors["tags"]
    assert out[0]["unknown_tag"].startswith("FileNotFoundError"), out[0]["unknown_tag"]
    assert out[1]["unknown_tag"].startswith("RuntimeError: loading ") and "rank(s) [0]" in out[1]["unknown_tag"]
    # user_content that only rank 1 cannot store: rank 1 names it, rank 0 names rank 1.
    assert out[1]["one_rank"].startswith("TypeError: save_checkpoint(): user_content['when'][1] is a "
                                         "datetime.datetime"), out[1]["one_rank"]
    assert out[0]["one_rank"].startswith("RuntimeError: saving ") and "rank(s) [1]" in out[0]["one_rank"], out[0]


def test_user_content_types_round_trip_with_weights_only_and_others_are_refused_by_path():
    # Everything check_user_content accepts, torch.load(weights_only=True) rebuilds (with this torch).
    accepted = {"none": None, "bool": True, "int": 1, "float": 1.5, "inf": float("inf"), "complex": 1 + 2j,
                "str": "s", "bytes": b"b", "bytearray": bytearray(b"x"), "size": torch.Size([2, 3]),
                "dtype": torch.bfloat16, "device": torch.device("cpu"), "tensor": torch.arange(4.0),
                "param": nn.Parameter(torch.ones(2)), "list": [1, (2, 3)], "set": {1, 2}, 7: "int key",
                "ordered": collections.OrderedDict(a=1)}
    check_user_content(accepted)
    buffer = io.BytesIO()
    torch.save(accepted, buffer)
    buffer.seek(0)
    back = torch.load(buffer, weights_only=True)
    assert set(back) == set(accepted) and back["list"] == [1, (2, 3)] and back["dtype"] is torch.bfloat16
    for value, path in [({"a": [argparse.Namespace()]}, "user_content['a'][0]"),
                        ({"a": frozenset([1])}, "user_content['a']"),
                        ({object(): 1}, "a key of user_content"),
                        ([lambda: 0], "user_content[0]")]:
        with pytest.raises(TypeError, match=r"save_checkpoint\(\): " + path.replace("[", r"\[").replace("(", r"\(")
                           + " is a "):
            check_user_content(value)
    with pytest.raises(Exception, match="Weights only load failed"):  # what a load would have met
        torch.load(io.BytesIO(_saved(frozenset([1]))), weights_only=True)


def _saved(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def test_wrappers_are_unwrapped_only_when_they_own_nothing():
    inner = nn.Linear(2, 2)
    assert unwrap_model(_NxDModelLike(_NxDModelLike(inner))) is inner
    owner = _NxDModelLike(inner)
    owner.extra = nn.Parameter(torch.zeros(1))   # owns a tensor: it is the model
    assert unwrap_model(owner) is owner
    opt = torch.optim.SGD(inner.parameters(), lr=0.1)
    assert unwrap_optimizer(_NxDOptimizerLike(opt)) is opt
    assert unwrap_optimizer(opt) is opt


# ---- kill -9 during an asynchronous save -----------------------------------------------------------------------------

KILL_ASYNC_WORKER = """
import datetime, os, sys, time
import torch
import torch.distributed as dist
sys.path.insert(0, {repo!r})
torch.set_num_threads(1)
from nxdtp import comm
from nxdtp import parallel_state as ps
from nxdtp.checkpointing import safetensors_stream
from nxdtp.trainer import save_checkpoint
root, gate = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
ps.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
from tests.test_checkpoint_durability import _model_and_optimizer
model, opt = _model_and_optimizer(seed=2, hidden=16)
rank = dist.get_rank()
original = safetensors_stream.StreamingSafetensorsWriter.write
def stuck(self, name, tensor):  # the background writer, mid-file: it says so, then waits for the kill
    if os.path.basename(self.path).startswith("tp_rank"):
        open(os.path.join(gate, f"writing_{{rank}}"), "w").close()
        while True:
            time.sleep(0.01)
    return original(self, name, tensor)
safetensors_stream.StreamingSafetensorsWriter.write = stuck
save_checkpoint(root, "step_000002", model, opt, None, {{"global_step": 2}}, async_save=True)
open(os.path.join(gate, f"returned_{{rank}}"), "w").close()
for step in range(3):  # the training loop goes on, collectives included, while the writer is stuck
    model.norm(model.down(model.up(torch.randn(2, 16)))).sum().backward()
    comm.all_reduce(torch.ones(1), ps.tensor_parallel_group())
open(os.path.join(gate, f"trained_{{rank}}"), "w").close()
while True:
    time.sleep(0.01)
"""


def case_save_a(directory: str):
    model, opt = _model_and_optimizer(seed=1, hidden=16)
    save_checkpoint(directory, "step_000001", model, opt, None, {"global_step": 1})


def case_load_after_kill(directory: str):
    model, opt = _model_and_optimizer(seed=50, hidden=16)
    user_content = load_checkpoint(directory, model=model, optimizer=opt)
    return _which(model, opt, user_content["global_step"], {"A": (1, 16, 1), "B": (2, 16, 2)})


def test_kill_9_during_an_async_save_leaves_the_previous_tag_loadable(worlds, tmp_path):
    directory, gate, world = str(tmp_path / "ckpt"), tmp_path / "gate", 2
    worlds(2).run(case_save_a, tensor_model_parallel_size=world, directory=directory)
    gate.mkdir()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1")
    script = KILL_ASYNC_WORKER.format(repo=REPO_ROOT)
    processes = [subprocess.Popen([sys.executable, "-c", script, directory, str(gate)], cwd=REPO_ROOT,
                                  env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), start_new_session=True)
                 for r in range(world)]
    try:
        wanted = [f"{what}_{r}" for what in ("writing", "returned", "trained") for r in range(world)]
        deadline = time.time() + PROCESS_WAIT_S
        while not all((gate / name).exists() for name in wanted):
            assert time.time() < deadline, f"workers did not get there: {sorted(os.listdir(gate))}"
            assert all(p.poll() is None for p in processes), "a worker ended"
            time.sleep(0.01)
        for p in processes:
            p.send_signal(signal.SIGKILL)
        for p in processes:
            p.wait(timeout=60)
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    # Killed mid-file: tag B is there, without 'done'; 'newest' still names A, which loads bit-exactly.
    tag_b = os.path.join(directory, "step_000002")
    assert os.path.isdir(tag_b) and not tags.is_complete(tag_b), _files(directory)
    assert tags.newest_tag(directory) == "step_000001"
    loaded = worlds(2).run(case_load_after_kill, tensor_model_parallel_size=world, directory=directory)
    assert loaded == ["A", "A"], loaded

"""The seams of issue 25: NxD's trainer API objects (``NxDModel``, ``NxDOptimizer``) through NxD's trainer checkpoint
functions, on tp2 x dp2 gloo ranks (the pooled harness), as NxD's Llama script uses them.

A randomised tiny HF Llama (every parameter, biases included; GQA, odd vocabulary padded for TP) is built by
``initialize_parallel_model`` from ``neuronx_distributed_config(tensor_parallel_size=2,
optimizer_config={"zero_one_enabled": True, ...}, sequence_parallel=True, activation_checkpoint_config="full")``;
``initialize_parallel_optimizer(AdamW)`` in two param groups (no decay on biases and norms), a LambdaLR on the
``NxDOptimizer``, clipping at a max_norm that clips. Each DP rank trains on its own rows.

* 2 steps, ``save_checkpoint(dir, tag, model, optimizer, scheduler, user_content)`` (the wrappers themselves, as NxD's
  script passes them), a third step. A fresh ``initialize_parallel_model`` / ``initialize_parallel_optimizer`` (its
  weights moved off the saved ones) takes ``load_checkpoint(dir, tag=None, model=..., optimizer=..., scheduler=...)``,
  which returns the user_content, and its third step equals the uninterrupted run's bit for bit: the loss, the
  pre-clip grad norm, every parameter, the ZeRO-1 Adam moments and fp32 master shards, the LR.
* The same with ``async_save=True``: the third step runs (and the user_content changes) while the writer is still busy
  (checked: the tag is not complete after the step), then ``finalize_checkpoint()``.
* Without ZeRO-1 (NxDOptimizer's own DP averaging and clipping around torch's AdamW), async: the same.
* bf16 parameters (the model built in bf16) with ZeRO-1 and NxD's default mixed precision (fp32 masters, fp32
  ``main_grad`` accumulation): the resume is bit-exact only because the masters come from the checkpoint.
"""

from __future__ import annotations

import os

import pytest
import torch

import nxdtp
from nxdtp import parallel_state as ps
from nxdtp.checkpointing import tags

transformers = pytest.importorskip("transformers")

ADAMW = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-4, weight_decay=0.01)
MAX_NORM = 0.5
SAVED_STEPS = 2
TAG = f"step_{SAVED_STEPS}"


def _dense_llama():
    from tests.test_models_decoders import _config, _dense

    return _dense("llama", _config("llama", kv_heads=2), seed=5)


def _batch(step):
    """This DP rank's rows of the global batch of ``step`` (4 rows, no ignored targets)."""
    from tests.test_models_decoders import SEQ, VOCAB

    g = torch.Generator().manual_seed(300 + step)
    input_ids = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    rows = 4 // ps.get_data_parallel_size()
    local = input_ids[ps.get_data_parallel_rank() * rows:][:rows]
    return dict(input_ids=local, labels=local.clone())


def _build(dtype: torch.dtype, zero_one: bool = True):
    """NxD's three calls, as its Llama script makes them; a LambdaLR on the NxDOptimizer."""
    nxd_config = nxdtp.neuronx_distributed_config(
        tensor_parallel_size=2, optimizer_config={"zero_one_enabled": zero_one, "grad_clipping": True,
                                                  "max_grad_norm": MAX_NORM},
        sequence_parallel=True, activation_checkpoint_config="full")
    model = nxdtp.initialize_parallel_model(nxd_config, lambda: _dense_llama().to(dtype))
    no_decay = [p for n, p in model.named_parameters() if "bias" in n or "norm" in n]
    decay = [p for n, p in model.named_parameters() if not ("bias" in n or "norm" in n)]
    groups = [{"params": decay, "weight_decay": ADAMW["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = nxdtp.initialize_parallel_optimizer(nxd_config, torch.optim.AdamW, groups, **ADAMW)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))
    assert isinstance(model, nxdtp.trainer.NxDModel) and isinstance(optimizer, nxdtp.trainer.NxDOptimizer)
    assert type(optimizer.optimizer).__name__ == ("NeuronZero1Optimizer" if zero_one else "AdamW")
    return model, optimizer, scheduler


def _step(model, optimizer, scheduler, step):
    optimizer.zero_grad()
    loss = model.run_train(**_batch(step))
    optimizer.step()
    scheduler.step()
    return {"loss": loss.detach().clone(), "grad_norm": optimizer.grad_norm.detach().clone()}


def _state(model, optimizer, scheduler, record):
    inner = optimizer.optimizer.state_dict()
    if "base_state" in inner:   # ZeRO-1: this rank's shards of the Adam moments, and its fp32 master shards
        moments, masters = inner["base_state"], inner["sharded_master_weights"]
    else:                       # NxDOptimizer's own path: torch's AdamW, whole (TP-local) moments, no masters
        moments, masters = inner["state"], {}
    return {
        "record": record,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "moments": {f"{i}/{k}": v.clone() for i, fields in moments.items() for k, v in fields.items()},
        "masters": {i: v.clone() for i, v in masters.items()},
        "lr": scheduler.get_last_lr(),
        "group_lrs": [g["lr"] for g in optimizer.param_groups],
    }


def _user_content():
    return {"global_step": SAVED_STEPS, "epoch": 0, "batch_idx": (1, 2), "cli_args": {"lr": ADAMW["lr"]}}


def case_train_save_and_continue(directory: str, async_save: bool, dtype: str, zero_one: bool = True):
    from tests.test_trainer_checkpoint import _slow_writes

    model, optimizer, scheduler = _build(getattr(torch, dtype), zero_one)
    assert all(p.dtype == getattr(torch, dtype) for p in model.parameters())
    for step in range(SAVED_STEPS):
        _step(model, optimizer, scheduler, step)
    seen = {}
    user_content = _user_content()
    if not async_save:
        nxdtp.save_checkpoint(directory, TAG, model, optimizer, scheduler, user_content)
        record = _step(model, optimizer, scheduler, SAVED_STEPS)
    else:
        with _slow_writes(0.02):
            nxdtp.save_checkpoint(directory, TAG, model, optimizer, scheduler, user_content, async_save=True)
            # Training goes on while the writer works: the step changes the weights, shards, moments and LR in place,
            # and the caller's user_content changes too.
            record = _step(model, optimizer, scheduler, SAVED_STEPS)
            user_content["global_step"] = 999
            seen["complete_after_step"] = tags.is_complete(os.path.join(directory, TAG))
            nxdtp.finalize_checkpoint()
        seen["complete_after_finalize"] = tags.is_complete(os.path.join(directory, TAG))
    return _state(model, optimizer, scheduler, record), seen


def case_load_and_continue(directory: str, dtype: str, zero_one: bool = True):
    model, optimizer, scheduler = _build(getattr(torch, dtype), zero_one)
    with torch.no_grad():   # only the checkpoint can bring the weights back
        for p in model.parameters():
            p.add_(1.0)
    user_content = nxdtp.load_checkpoint(directory, tag=None, model=model, optimizer=optimizer, scheduler=scheduler)
    assert scheduler.last_epoch == SAVED_STEPS, scheduler.last_epoch
    record = _step(model, optimizer, scheduler, SAVED_STEPS)
    return _state(model, optimizer, scheduler, record), user_content


def _differences(a, b):
    out = []
    for part in ("params", "moments", "masters"):
        assert sorted(a[part]) == sorted(b[part]), part
        out += [f"{part}/{k}" for k in a[part] if a[part][k].dtype != b[part][k].dtype
                or not torch.equal(a[part][k], b[part][k])]
    out += [k for k in ("loss", "grad_norm") if not torch.equal(a["record"][k], b["record"][k])]
    out += [k for k in ("lr", "group_lrs") if a[k] != b[k]]
    return out


@pytest.mark.parametrize("async_save,dtype,zero_one", [(False, "float32", True), (True, "float32", True),
                                                       (True, "bfloat16", True), (True, "float32", False)],
                         ids=["sync", "async", "bf16_async", "nxd_optimizer_async"])
def test_trainer_api_objects_resume_bit_exactly_at_tp2_dp2(worlds, tmp_path, async_save, dtype, zero_one):
    directory = str(tmp_path / "ckpt")
    results = worlds(4).run(case_train_save_and_continue, tensor_model_parallel_size=2, directory=directory,
                            async_save=async_save, dtype=dtype, zero_one=zero_one)
    after = [state for state, _ in results]
    for rank, (state, seen) in enumerate(results):
        if async_save:   # the call returned before the files were written, and the step ran meanwhile
            assert seen == {"complete_after_step": False, "complete_after_finalize": True}, (rank, seen)
        assert all(m.dtype == torch.float32 for m in state["masters"].values())
        assert state["moments"] and bool(state["masters"]) == zero_one, rank
    # TP ranks agree on the loss; the DP ranks trained on different rows.
    assert torch.equal(after[0]["record"]["loss"], after[1]["record"]["loss"])
    assert not torch.equal(after[0]["record"]["loss"], after[2]["record"]["loss"])
    assert float(after[0]["record"]["grad_norm"]) > MAX_NORM, "max_norm does not clip"
    assert nxdtp.has_checkpoint(directory)

    resumed = worlds(4).run(case_load_and_continue, tensor_model_parallel_size=2, directory=directory, dtype=dtype,
                            zero_one=zero_one)
    for rank, ((state, user_content), before) in enumerate(zip(resumed, after)):
        assert user_content == _user_content(), (rank, user_content)
        assert isinstance(user_content["batch_idx"], tuple)
        different = _differences(before, state)
        assert not different, f"rank {rank}: the resumed step differs from the uninterrupted one: {different}"


def case_wrappers_unwrap_to_what_nxdtp_checkpointing_saves(directory: str):
    """The wrappers reach nxdtp's writer as the module and the ZeRO-1 optimizer: the same keys and files as
    ``nxdtp.checkpointing.save`` of the unwrapped objects."""
    import json

    from nxdtp.checkpointing import save
    from nxdtp.trainer.checkpoint import unwrap_model, unwrap_optimizer

    model, optimizer, scheduler = _build(torch.float32)
    assert unwrap_model(model) is model.module
    assert unwrap_optimizer(optimizer) is optimizer.optimizer
    _step(model, optimizer, scheduler, 0)
    nxdtp.save_checkpoint(os.path.join(directory, "trainer"), "t", model, optimizer, scheduler)
    save({"model": model.module, "optimizer": optimizer.optimizer, "scheduler": scheduler},
         os.path.join(directory, "core"), tag="t")
    index = [json.load(open(os.path.join(directory, kind, "t", "nxdtp_index.json"))) for kind in ("trainer", "core")]
    return [(i["optimizer"]["kind"], sorted(i["tensors"]), sorted(i["files"])) for i in index]


def test_wrappers_save_what_the_core_saves(worlds, tmp_path):
    results = worlds(4).run(case_wrappers_unwrap_to_what_nxdtp_checkpointing_saves, tensor_model_parallel_size=2,
                            directory=str(tmp_path))
    trainer, core = results[0]
    assert trainer == core and trainer[0] == "zero1"
    assert not any(k.startswith("module.") for k in trainer[1])


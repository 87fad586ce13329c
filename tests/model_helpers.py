"""Helpers the per-family model tests share: randomised dense references, a training step, gathered logits, and the
checkpoint round trip every family must pass (train at tp=2 and save; merge and load with plain transformers;
``from_pretrained_sharded`` and a resharded resume at tp=4).

A family's test names its model builder and batch builder as ``"module:function"`` strings, so the round trip's cases
(module-level functions run by the worker pools) can call them on every rank.
"""

from __future__ import annotations

import importlib
import os

import torch

from nxdtp.models import from_pretrained_sharded, gather_vocab_logits, parallelize_model

TOL = dict(atol=1e-5, rtol=1e-5)


def randomised(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Add 0.1 * N(0, 1) to every parameter (biases and norms included: fresh HF models have zero biases and unit
    norms, which would hide bugs in them). Tied parameters are one object and get one draw."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def train_step(model, optimizer, batch) -> float:
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def gathered_logits(model, batch, vocab_size: int) -> torch.Tensor:
    with torch.no_grad():
        return gather_vocab_logits(model(**batch).logits, vocab_size)


def _resolve(spec: str):
    module, function = spec.split(":")
    return getattr(importlib.import_module(module), function)


# ---- the checkpoint round trip ---------------------------------------------------------------------------------------

LR = 1e-3


def case_train_and_save(directory: str, build: str, batch: str, vocab_size: int):
    """Two AdamW steps at this TP degree, save; return the logits then, and the loss of a third step."""
    from nxdtp import checkpointing

    model = parallelize_model(_resolve(build)(seed=7))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    inputs = _resolve(batch)()
    for _ in range(2):
        train_step(model, optimizer, inputs)
    checkpointing.save({"model": model, "optimizer": optimizer, "global_step": 2}, directory)
    return dict(logits=gathered_logits(model, inputs, vocab_size), next_loss=train_step(model, optimizer, inputs))


def case_load_resharded(resharded: str, merged: str, build: str, batch: str, vocab_size: int):
    """A model built from another seed resumes the resharded checkpoint; the merged directory is read back by
    from_pretrained_sharded, each rank its slices."""
    from nxdtp import checkpointing

    model = parallelize_model(_resolve(build)(seed=99))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR * 10)   # the checkpoint's param groups win
    state = checkpointing.load(resharded, model=model, optimizer=optimizer)
    inputs = _resolve(batch)()
    return dict(step=state["global_step"], logits=gathered_logits(model, inputs, vocab_size),
                next_loss=train_step(model, optimizer, inputs),
                pretrained_logits=gathered_logits(from_pretrained_sharded(merged), inputs, vocab_size))


def check_checkpoint_round_trip(worlds, root, build: str, batch: str, vocab_size: int, auto_class: str,
                                class_name: str) -> None:
    """Save at tp=2; merge, and ``auto_class.from_pretrained`` gives the TP model's logits; at tp=4 the resharded
    checkpoint resumes with the tp=2 run's next loss and ``from_pretrained_sharded`` of the merge gives the logits."""
    import transformers

    from nxdtp.checkpointing.merge import merge, reshard

    saved_dir, merged, resharded = (os.path.join(str(root), name) for name in ("tp2", "merged", "tp4"))
    saved = worlds(2).run(case_train_and_save, tensor_model_parallel_size=2, directory=saved_dir, build=build,
                          batch=batch, vocab_size=vocab_size)[0]
    merge(saved_dir, merged, progress=False)
    reshard(saved_dir, resharded, 4, progress=False)
    dense = getattr(transformers, auto_class).from_pretrained(merged)
    assert type(dense).__name__ == class_name, type(dense).__name__
    with torch.no_grad():
        torch.testing.assert_close(dense(**_resolve(batch)()).logits, saved["logits"], **TOL,
                                   msg=lambda m: f"{class_name} merged: {m}")
    results = worlds(4).run(case_load_resharded, tensor_model_parallel_size=4, resharded=resharded, merged=merged,
                            build=build, batch=batch, vocab_size=vocab_size)
    for rank, result in enumerate(results):
        what = f"{class_name} rank {rank}"
        assert result["step"] == 2, what
        for key in ("logits", "pretrained_logits"):
            torch.testing.assert_close(result[key], saved["logits"], **TOL, msg=lambda m: f"{what} {key}: {m}")
        assert abs(result["next_loss"] - saved["next_loss"]) <= 1e-5, (what, result["next_loss"], saved["next_loss"])


def check_saved_at_tp4_merges_and_reshards_to_tp2(worlds, root, build: str, batch: str, vocab_size: int,
                                                  class_name: str):
    """The other direction, for layouts that only the larger degree has (repeated KV heads, zero heads): saved at tp=4,
    the merge is the dense model (plain transformers computes the same logits) and the checkpoint resharded to tp=2
    resumes with the same next loss."""
    import transformers

    from nxdtp.checkpointing.merge import merge, reshard

    saved_dir, merged, resharded = (os.path.join(str(root), name) for name in ("tp4", "merged", "tp2"))
    saved = worlds(4).run(case_train_and_save, tensor_model_parallel_size=4, directory=saved_dir, build=build,
                          batch=batch, vocab_size=vocab_size)[0]
    merge(saved_dir, merged, progress=False)
    reshard(saved_dir, resharded, 2, progress=False)
    dense = transformers.AutoModelForCausalLM.from_pretrained(merged)
    assert type(dense).__name__ == class_name, type(dense).__name__
    with torch.no_grad():
        torch.testing.assert_close(dense(**_resolve(batch)()).logits, saved["logits"], **TOL)
    for result in worlds(2).run(case_load_resharded, tensor_model_parallel_size=2, resharded=resharded, merged=merged,
                                build=build, batch=batch, vocab_size=vocab_size):
        torch.testing.assert_close(result["logits"], saved["logits"], **TOL)
        torch.testing.assert_close(result["pretrained_logits"], saved["logits"], **TOL)
        assert abs(result["next_loss"] - saved["next_loss"]) <= 1e-5, (result["next_loss"], saved["next_loss"])
    return dense

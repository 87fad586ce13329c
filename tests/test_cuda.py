"""nxdtp with CUDA tensors against the dense model on the same GPU. Skipped where torch sees no GPU: CI has none;
docs/performance.md (section GPU) records the runs on one.

NCCL refuses two ranks on one GPU, so the worlds of 2 are gloo worlds whose ranks share ``cuda:0`` (gloo copies CUDA
tensors through the host): they check sharding, the layers and the vocab-parallel loss with CUDA kernels. A world of 1
whose default backend is NCCL checks a GPU cluster's path: CUDA tensors over NCCL, CPU tensors (the model's build, the
checkpoint's metadata) over the gloo twin. The dense-equality cases are the gloo suite's, given ``device="cuda"``;
fp32 with TF32 off, tolerance 1e-5 as there. The checkpoint case saves a model trained with dropout on the GPU, loads it
into one built from another seed and continues: losses, parameters and optimizer state equal the uninterrupted run
exactly (the CUDA generator's state is part of the checkpoint).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from tests.test_models_decoders import _available, case_decoder_equals_dense
from tests.test_zero1 import case_zero1_equals_dense

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _exact_fp32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def case_decoders_on_cuda(sequence_parallel: bool):
    _exact_fp32()
    return case_decoder_equals_dense(_available("llama", "qwen3"), sequence_parallel, multiple=8 if sequence_parallel
                                     else 1, device="cuda")


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_decoders_on_cuda_equal_dense(worlds, sp):
    results = worlds(2).run(case_decoders_on_cuda, tensor_model_parallel_size=2, sequence_parallel=sp)
    assert all(len(r) == len(_available("llama", "qwen3")) for r in results)


def test_decoders_over_nccl_equal_dense(worlds):
    results = worlds(1, "nccl").run(case_decoders_on_cuda, tensor_model_parallel_size=1, sequence_parallel=False)
    assert len(results[0]) == len(_available("llama", "qwen3"))


def case_zero1_on_cuda():
    _exact_fp32()
    return case_zero1_equals_dense("llama", "adamw", 2.0, "hook", 0.5, device="cuda")


def test_zero1_on_cuda_equals_dense(worlds):
    norms = worlds(2).run(case_zero1_on_cuda, tensor_model_parallel_size=1)
    assert norms[0] == norms[1]


def _llama_with_dropout(seed: int):
    from nxdtp import move_model_to_device
    from nxdtp.models import parallelize_model
    from tests.test_models_decoders import _config, _dense

    config = _config("llama", kv_heads=2)
    config.attention_dropout = 0.2
    config._attn_implementation = "eager"   # deterministic backward: the resumed run must repeat the first bit for bit
    model = parallelize_model(copy.deepcopy(_dense("llama", config, seed=seed)))
    return move_model_to_device(model, "cuda").train()


def _steps(model, optimizer, first: int, count: int) -> list:
    from tests.test_models_decoders import _batch

    losses = []
    for step in range(first, first + count):
        batch = {k: v.cuda() for k, v in _batch(seed=step).items()}
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _state(model, optimizer) -> list:
    tensors = list(model.state_dict().values())
    tensors += [v for s in optimizer.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v)]
    return [t.detach().cpu() for t in tensors if torch.is_tensor(t)]


def case_checkpoint_on_cuda(root: str):
    from nxdtp import checkpointing
    from nxdtp.random import model_parallel_xla_manual_seed

    _exact_fp32()
    model = _llama_with_dropout(seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    model_parallel_xla_manual_seed(1234)
    _steps(model, optimizer, first=0, count=2)
    checkpointing.save({"model": model, "optimizer": optimizer, "global_step": 2}, root)
    reference = _steps(model, optimizer, first=2, count=2)

    resumed = _llama_with_dropout(seed=40)
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-3, eps=1e-4)
    model_parallel_xla_manual_seed(999)   # restore_rng_states must make the seed irrelevant
    checkpointing.load(root, model=resumed, optimizer=resumed_optimizer, restore_rng_states=True)
    losses = _steps(resumed, resumed_optimizer, first=2, count=2)
    assert losses == reference, (losses, reference)
    mismatched = [i for i, (a, b) in enumerate(zip(_state(resumed, resumed_optimizer), _state(model, optimizer)))
                  if not torch.equal(a, b)]
    assert not mismatched, f"tensors {mismatched} differ after the resumed steps"
    return reference


@pytest.mark.parametrize("world,backend", [(2, "gloo"), (1, "nccl")], ids=["tp2-gloo", "tp1-nccl"])
def test_checkpoint_on_cuda_resumes_exactly(worlds, tmp_path, world, backend):
    losses = worlds(world, backend).run(case_checkpoint_on_cuda, tensor_model_parallel_size=world,
                                        root=os.fspath(tmp_path))
    assert all(loss == losses[0] for loss in losses)

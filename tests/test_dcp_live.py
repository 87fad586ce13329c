"""DCP inside a running nxdtp job (issue 27, item 3): ``nxdtp.checkpointing.dcp_state.get_state_dict`` /
``set_state_dict`` with torch's own ``dcp.save`` / ``dcp.load``.

* A tp=2 × dp=2 Llama (one KV head, so repeated on both TP ranks; vocabulary 101 padded by
  ``make_vocab_size_divisible_by``; every parameter randomised) takes one AdamW step and ``dcp.save``s
  ``get_state_dict(model, optimizer, lr_scheduler=..., step=1)`` in a gloo world of 4. Then (a) a dense HF model and
  torch AdamW ``dcp.load`` it in this process (``no_dist=True``): the logits of the nxdtp model, the moments of a dense
  reference step; the checkpoint's keys, global shapes and dtypes are those ``nxdtp-merge --to dcp`` writes from an
  nxdtp checkpoint of the same job, and every chunk was written by DP rank 0 (the replicated tensors and the repeated KV
  head by TP rank 0 only); (b) nxdtp at tp=4 loads it with ``dcp.load`` + ``set_state_dict``: the saved logits, step and
  scheduler epoch, and its next step equals the dense run's next step. And the other way: nxdtp at tp=2 x dp=2 loads a
  DTensor TP=2 job's own ``dcp.save``.
* The same save in worlds whose default backend refuses CPU tensors (the NCCL stand-in, and torch_xla's "xla"
  backend), through ``process_group=dcp_process_group()``: the same checkpoint.
* GPT-2 with 6 heads at tp=4: its fused Q|K|V ``c_attn`` is split with stride 3 and padded with zero heads per part.
  Saved live, it loads into the dense model (the logits) and back into nxdtp at tp=2 × dp=2 (the logits).
* The layout algebra: each rank's kept runs and copy runs cover every non-padding row of its piece once.
* ZeRO-1 (tp=2 x dp=2): its flat shards save as the dense optimizer's state (a dense AdamW loads the moments of a
  dense step), and ZeRO-1 at tp=1 x dp=4 loads them and steps as the dense run does. The layout algebra's map from a
  flat shard to dense chunks covers every dense element once. Hybrid ZeRO-1 (each shard on two replicas) writes each
  shard once.
* Bad input: a model nxdtp did not parallelize, an optimizer of another model, a ZeRO-1 optimizer without its shards
  (lazy_init), a state dict of another model, a missing key, an operation on a DenseView: one clear error each.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.test_dcp_bridge import (
    LLAMA_VOCAB,
    LR,
    _cli,
    _close,
    _flat_options,
    _llama,
    _llama_batch,
    _logits,
    _metadata,
    _native_state,
    _specs,
    _step,
    check_next_adam_step,
)

transformers = pytest.importorskip("transformers")

MULTIPLE = 4  # make_vocab_size_divisible_by: 101 rows padded to 104


def _nxdtp_step(model, optimizer, batch):
    from nxdtp.grads import allreduce_gradients

    model(**batch).loss.backward()
    allreduce_gradients(model)  # every DP rank trains on the same batch: the average is the dense gradient
    optimizer.step()
    optimizer.zero_grad()


def _constant_schedule(optimizer):
    """A schedule whose learning rate stays LR (the dense reference has none), to carry last_epoch."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def _nxdtp_llama(seed):
    from nxdtp.models import parallelize_model

    return parallelize_model(_llama(seed), make_vocab_size_divisible_by=MULTIPLE)


# ---- the layout algebra: what a rank writes and what it reads --------------------------------------------------------

@pytest.mark.parametrize("name", list(_specs()))
def test_kept_and_copy_runs_cover_each_piece(name):
    """``dense_runs_of_piece`` + ``copy_runs_of_piece`` of a rank: every row of its piece that holds a dense value
    exactly once (padding rows never), each mapped to the dense row whose value it holds."""
    from nxdtp.layers import shard_of

    spec = _specs()[name]
    dense = torch.randn(spec.unpadded_shape)
    full = spec.full_from_dense(dense)
    dim = spec.partition_dim
    dense_rows = torch.zeros(dense.shape[dim], dtype=torch.long)
    for rank in range(spec.num_partitions):
        piece = shard_of(full, dim, rank, spec.num_partitions, spec.stride)
        # Padding rows are zeros in `full` and `dense` is random: a piece row is a dense value iff it is non-zero.
        holds_value = piece.ne(0).movedim(dim, 0).flatten(1).any(1)
        covered = torch.zeros(piece.shape[dim], dtype=torch.long)
        kept = spec.dense_runs_of_piece(rank)
        for start, length, dense_start in kept + spec.copy_runs_of_piece(rank):
            torch.testing.assert_close(piece.narrow(dim, start, length), dense.narrow(dim, dense_start, length),
                                       rtol=0, atol=0)
            covered[start:start + length] += 1
        for start, length, dense_start in kept:
            dense_rows[dense_start:dense_start + length] += 1
        assert torch.equal(covered, holds_value.long()), (name, rank, covered, holds_value)
    assert torch.equal(dense_rows, torch.ones_like(dense_rows)), (name, dense_rows)


@pytest.mark.parametrize("name", list(_specs()) + ["replicated", "3-d, dim 1"])
@pytest.mark.parametrize("group_size", [1, 2, 3, 7])
def test_zero1_flat_shards_map_to_dense_chunks(name, group_size):
    """``dense_chunks_of_flat_shard``: over every TP rank and ZeRO-1 shard rank the kept chunks cover each dense
    element once, and every chunk (kept or copy) read from the flat shard is that part of the dense tensor."""
    from nxdtp.layers import shard_of
    from nxdtp.spec import FlatShardLayout, ParamSpec, dense_chunks_of_flat_shard

    spec = {**_specs(), "replicated": ParamSpec(full_shape=(3, 5)),
            "3-d, dim 1": ParamSpec(full_shape=(4, 3, 5), partition_dim=1, num_partitions=3)}[name]
    dense = torch.randn(spec.unpadded_shape)
    full = spec.full_from_dense(dense)
    seen = torch.zeros(dense.shape, dtype=torch.long)
    for tp_rank in range(spec.num_partitions if spec.is_sharded else 2):
        piece = shard_of(full, spec.partition_dim, tp_rank, spec.num_partitions, spec.stride) if spec.is_sharded \
            else full
        layout = FlatShardLayout(tuple(piece.shape), group_size)
        for shard_rank in range(group_size):
            shard = layout.shard_of(piece, shard_rank)
            for copies in (False, True):
                for start, box, narrow, offsets, sizes in dense_chunks_of_flat_shard(spec, layout, tp_rank,
                                                                                     shard_rank, copies):
                    chunk = shard[start:start + torch.Size(box).numel()].view(box)
                    chunk = chunk if narrow is None else chunk.narrow(*narrow)
                    where = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
                    assert torch.equal(chunk, dense[where]), (name, tp_rank, shard_rank, offsets)
                    if not copies:
                        seen[where] += 1
    assert torch.equal(seen, torch.ones_like(seen)), (name, seen)


# ---- a tp=2 x dp=2 Llama saves live ----------------------------------------------------------------------------------

def case_live_save(checkpoint: str, nxdtp_root: str = ""):
    """One AdamW step, then dcp.save(get_state_dict(model, optimizer)) (and, for the comparison with the export, the
    same state with nxdtp.checkpointing.save). Returns the gathered logits after the step."""
    import torch.distributed.checkpoint as dcp

    from nxdtp import checkpointing
    from nxdtp.checkpointing.dcp_state import dcp_process_group, get_state_dict
    from nxdtp.parallel_state import data_parallel_group, tensor_parallel_group

    model = _nxdtp_llama(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    scheduler = _constant_schedule(optimizer)
    _nxdtp_step(model, optimizer, _llama_batch())
    scheduler.step()
    dcp.save(get_state_dict(model, optimizer, lr_scheduler=scheduler, step=1), checkpoint_id=checkpoint,
             process_group=dcp_process_group())
    if nxdtp_root:
        checkpointing.save({"model": model, "optimizer": optimizer, "scheduler": scheduler, "global_step": 1},
                           nxdtp_root)
    return {"logits": _logits(model, _llama_batch(), LLAMA_VOCAB)[0], "tp_rank": tensor_parallel_group().rank,
            "dp_rank": data_parallel_group().rank,
            "k_replicas": model.model.layers[0].self_attn.k_proj.param_specs()["weight"].replicas}


@pytest.fixture(scope="module")
def live_llama(worlds, tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    checkpoint, nxdtp_root = str(root / "dcp"), str(root / "nxdtp")
    results = worlds(4).run(case_live_save, tensor_model_parallel_size=2, checkpoint=checkpoint,
                            nxdtp_root=nxdtp_root)
    return checkpoint, nxdtp_root, results


def _dense_reference():
    reference = _llama(seed=0)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
    _step(reference, optimizer, _llama_batch())
    return reference, optimizer


def _load_dense(checkpoint):
    """A dense Llama and AdamW with other weights and hyperparameters, loaded with plain dcp.load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    model = _llama(seed=99)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR * 10, weight_decay=0.5)
    state = _native_state(model, optimizer)
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    model.load_state_dict({k: v for k, v in state.items() if k != "optimizer"})
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=_flat_options())
    return model, optimizer


def test_live_save_loads_into_dense_model_and_adamw(live_llama):
    checkpoint, _, results = live_llama
    assert results[0]["k_replicas"] == 2  # the trap is there: the KV head is repeated on both TP ranks
    model, optimizer = _load_dense(checkpoint)
    for rank, result in enumerate(results):
        _close(_logits(model, _llama_batch())[0], result["logits"], f"dense logits vs nxdtp rank {rank}")
    reference, reference_optimizer = _dense_reference()
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        mine, theirs = optimizer.state[param], reference_optimizer.state[reference_params[name]]
        assert sorted(mine) == sorted(theirs), name
        for field in theirs:
            _close(mine[field], theirs[field], f"{name} {field}")
    for group in optimizer.param_groups:
        assert group["lr"] == LR and group["weight_decay"] == 0.01, group


def test_live_save_is_the_export_of_the_same_state(live_llama, tmp_path, capsys):
    """Keys, global shapes, dtypes and kinds equal those of nxdtp-merge --to dcp of the nxdtp checkpoint the job saved
    at the same point; every chunk comes from DP rank 0, and TP-replicated tensors from TP rank 0."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    checkpoint, nxdtp_root, results = live_llama
    status, _, err = _cli([nxdtp_root, tmp_path / "export", "--to", "dcp"], capsys)
    assert status == 0, err
    live, export = _metadata(checkpoint), _metadata(tmp_path / "export")
    assert sorted(live) == sorted(export)
    for key, meta in export.items():
        assert type(live[key]) is type(meta), key
        if isinstance(meta, TensorStorageMetadata):
            assert live[key].size == meta.size and live[key].properties.dtype == meta.properties.dtype, key
            assert sorted(c.offsets for c in live[key].chunks) == sorted(c.offsets for c in meta.chunks), key

    import torch.distributed.checkpoint as dcp

    # Tensor chunks only: the hyperparameters (bytes, the same on every rank) are deduplicated by DCP itself.
    storage = dcp.FileSystemReader(checkpoint).read_metadata().storage_data
    writer_of = {index.fqn: set() for index in storage if isinstance(live[index.fqn], TensorStorageMetadata)}
    for index, info in storage.items():
        if index.fqn in writer_of:
            writer_of[index.fqn].add(int(info.relative_path.split("_")[2]))  # __<rank>_<n>.distcp
    by_rank = {rank: (r["tp_rank"], r["dp_rank"]) for rank, r in enumerate(results)}
    assert all(by_rank[rank][1] == 0 for ranks in writer_of.values() for rank in ranks), writer_of
    for key in ("model.norm.weight", "model.layers.0.self_attn.k_proj.weight", "optimizer.state.model.norm.weight.step",
                "optimizer.state.model.layers.0.self_attn.k_proj.weight.exp_avg"):
        assert {by_rank[rank][0] for rank in writer_of[key]} == {0}, (key, writer_of[key])
    assert {by_rank[rank][0] for rank in writer_of["lm_head.weight"]} == {0, 1}


def case_live_load(checkpoint: str):
    """nxdtp at this world's TP size, other weights and hyperparameters, loads the live checkpoint with dcp.load and
    set_state_dict; its next step must equal the dense run's next step. Returns the logits after loading."""
    import torch.distributed.checkpoint as dcp

    from nxdtp.checkpointing.dcp_state import dcp_process_group, get_state_dict, set_state_dict
    from tests.test_models_bert import _check_weights

    model = _nxdtp_llama(seed=99)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR * 10, weight_decay=0.5)
    scheduler = _constant_schedule(optimizer)
    state = get_state_dict(model, optimizer, lr_scheduler=scheduler, step=0)
    dcp.load(state, checkpoint_id=checkpoint, process_group=dcp_process_group())
    train_state = set_state_dict(model, optimizer, state, lr_scheduler=scheduler)
    assert train_state == {"step": 1, "ntokens_seen": 0} and scheduler.last_epoch == 1, (train_state, scheduler)
    assert all(g["lr"] == LR and g["weight_decay"] == 0.01 for g in optimizer.param_groups), optimizer.param_groups
    logits = _logits(model, _llama_batch(), LLAMA_VOCAB)[0]
    _nxdtp_step(model, optimizer, _llama_batch())
    # The dense run: a dense model and AdamW loaded from the same checkpoint (test (a) checks them against a dense
    # first step), one step on the same batch.
    reference, reference_optimizer = _load_dense(checkpoint)
    _step(reference, reference_optimizer, _llama_batch())
    _check_weights(model, reference, "nxdtp tp=4 step after loading the live tp=2 checkpoint")
    return logits


def test_nxdtp_at_tp4_loads_the_live_tp2_save_and_steps_as_dense(worlds, live_llama):
    checkpoint, _, results = live_llama
    for rank, logits in enumerate(worlds(4).run(case_live_load, tensor_model_parallel_size=4, checkpoint=checkpoint)):
        _close(logits, results[0]["logits"], f"nxdtp tp=4 rank {rank} logits after loading")


def case_load_native_job(checkpoint: str):
    """nxdtp loads a DTensor TP job's own dcp.save with dcp.load + set_state_dict; its next step equals two dense
    steps (Adam's second step depends on the moments). Returns the logits after loading."""
    import torch.distributed.checkpoint as dcp

    from nxdtp.checkpointing.dcp_state import dcp_process_group, get_state_dict, set_state_dict

    model = _nxdtp_llama(seed=99)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR * 10, weight_decay=0.5)
    state = get_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=checkpoint, process_group=dcp_process_group())
    set_state_dict(model, optimizer, state)
    logits = _logits(model, _llama_batch(), LLAMA_VOCAB)[0]
    check_next_adam_step(model, optimizer, *_dense_reference(), _llama_batch(),
                         "nxdtp's step after loading the DTensor job's checkpoint")
    return logits


def test_nxdtp_loads_a_native_dtensor_jobs_checkpoint(worlds, tmp_path):
    """The other way: a DTensor TP=2 job's dcp.save (model and flattened AdamW state), loaded live by nxdtp at
    tp=2 x dp=2 (the KV head repeated on both TP ranks, the vocabulary padded): the job's logits, and the next step."""
    from tests.test_dcp_bridge import case_dtensor_job_saves

    checkpoint = str(tmp_path / "native")
    job_logits = worlds(2).run(case_dtensor_job_saves, tensor_model_parallel_size=None, checkpoint=checkpoint)[0]
    for rank, logits in enumerate(worlds(4).run(case_load_native_job, tensor_model_parallel_size=2,
                                                checkpoint=checkpoint)):
        _close(logits, job_logits, f"nxdtp tp=2 x dp=2 rank {rank} logits after loading the DTensor job's save")


@pytest.mark.parametrize("backend", ["cpu_refusing", "xla"])
def test_live_save_on_a_world_that_refuses_cpu_tensors(worlds, live_llama, tmp_path, backend):
    """A default backend that refuses CPU tensors, as NCCL's does (the stand-in) and torch_xla's "xla" does: DCP's plan
    exchange goes over nxdtp's gloo group; the same checkpoint."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    checkpoint, _, results = live_llama
    refusing = str(tmp_path / "dcp")
    worlds(4, backend).run(case_live_save, tensor_model_parallel_size=2, checkpoint=refusing)
    ours, gloo = _metadata(refusing), _metadata(checkpoint)
    assert sorted(ours) == sorted(gloo)
    for key, meta in gloo.items():
        if isinstance(meta, TensorStorageMetadata):
            assert ours[key].size == meta.size and ours[key].chunks == meta.chunks, key
    model, _ = _load_dense(refusing)
    _close(_logits(model, _llama_batch())[0], results[0]["logits"], f"dense logits from the {backend} world's save")


# ---- ZeRO-1: the flat shards over DP of each TP piece ----------------------------------------------------------------

def _zero1(model, sharding_groups=None, **hyperparameters):
    from nxdtp.optimizer import NeuronZero1Optimizer

    # No clipping: the dense reference does not clip either.
    return NeuronZero1Optimizer(model.parameters(), torch.optim.AdamW, grad_clipping=False,
                                sharding_groups=sharding_groups, **hyperparameters)


def _zero1_step(model, optimizer, batch):
    model(**batch).loss.backward()  # ZeRO-1 averages the gradients over DP (reduce-scatter)
    optimizer.step()
    optimizer.zero_grad()


def case_zero1_save(checkpoint: str, sharding_groups=None):
    import torch.distributed.checkpoint as dcp

    from nxdtp.checkpointing.dcp_state import dcp_process_group, get_state_dict

    model = _nxdtp_llama(seed=0)
    optimizer = _zero1(model, sharding_groups, lr=LR, weight_decay=0.01)
    _zero1_step(model, optimizer, _llama_batch())
    dcp.save(get_state_dict(model, optimizer), checkpoint_id=checkpoint, process_group=dcp_process_group())
    return {"logits": _logits(model, _llama_batch(), LLAMA_VOCAB)[0], "replica_rank": optimizer.replica_group.rank,
            "sharding_size": optimizer.sharding_group.size}


def _check_dense_moments(checkpoint, saved_logits, what):
    """A dense Llama and AdamW load the checkpoint: the saved logits, and the moments of a dense step."""
    model, optimizer = _load_dense(checkpoint)
    _close(_logits(model, _llama_batch())[0], saved_logits, f"dense logits from the {what} save")
    reference, reference_optimizer = _dense_reference()
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        for field, value in reference_optimizer.state[reference_params[name]].items():
            _close(optimizer.state[param][field], value, f"{what} {name} {field}")


def test_zero1_hybrid_sharding_saves_each_shard_once(worlds, tmp_path):
    """Hybrid ZeRO-1 (tp=1, DP 4 cut into sharding groups of 2, each shard on 2 replicas): the flat state is written
    by the first replica of each shard only, and a dense AdamW loads the moments of a dense step."""
    import torch.distributed.checkpoint as dcp

    checkpoint = str(tmp_path / "hybrid")
    saved = worlds(4).run(case_zero1_save, tensor_model_parallel_size=1, checkpoint=checkpoint,
                          sharding_groups=[[0, 1], [2, 3]])
    assert [r["sharding_size"] for r in saved] == [2] * 4 and [r["replica_rank"] for r in saved] == [0, 0, 1, 1]
    storage = dcp.FileSystemReader(checkpoint).read_metadata().storage_data
    writers = {int(info.relative_path.split("_")[2]) for index, info in storage.items()
               if index.fqn.endswith(".exp_avg")}
    assert writers == {0, 1}, writers
    _check_dense_moments(checkpoint, saved[0]["logits"], "hybrid ZeRO-1")


def case_zero1_load(checkpoint: str):
    """ZeRO-1 at this world's layout, other weights and hyperparameters, loads the checkpoint; its next step must
    equal the dense run's next step. Returns the logits after loading."""
    import torch.distributed.checkpoint as dcp

    from nxdtp.checkpointing.dcp_state import dcp_process_group, get_state_dict, set_state_dict
    from tests.test_models_bert import _check_weights

    model = _nxdtp_llama(seed=99)
    optimizer = _zero1(model, lr=LR * 10, weight_decay=0.5)
    state = get_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=checkpoint, process_group=dcp_process_group())
    set_state_dict(model, optimizer, state)
    logits = _logits(model, _llama_batch(), LLAMA_VOCAB)[0]
    _zero1_step(model, optimizer, _llama_batch())
    reference, reference_optimizer = _load_dense(checkpoint)
    _step(reference, reference_optimizer, _llama_batch())
    _check_weights(model, reference, "ZeRO-1 step after loading the live ZeRO-1 checkpoint")
    return logits


def test_zero1_live_save_loads_dense_and_into_zero1_at_another_layout(worlds, live_llama, tmp_path):
    """ZeRO-1 at tp=2 x dp=2 saves live: a dense AdamW loads its moments (equal to a dense step's), the keys and
    global shapes are the plain optimizer's save's; ZeRO-1 at tp=1 x dp=4 loads it and steps as dense."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    plain, _, _ = live_llama
    checkpoint = str(tmp_path / "zero1")
    saved = worlds(4).run(case_zero1_save, tensor_model_parallel_size=2, checkpoint=checkpoint)[0]["logits"]
    ours, theirs = _metadata(checkpoint), _metadata(plain)
    # The plain save also holds the scheduler's epoch, its groups' initial_lr and the step: this one has no scheduler.
    theirs = {k: v for k, v in theirs.items()
              if not k.startswith(("lr_scheduler.", "train_state.")) and not k.endswith(".initial_lr")}
    assert sorted(ours) == sorted(theirs)
    for key, meta in theirs.items():
        if isinstance(meta, TensorStorageMetadata):
            assert ours[key].size == meta.size and ours[key].properties.dtype == meta.properties.dtype, key
    _check_dense_moments(checkpoint, saved, "ZeRO-1")
    for rank, logits in enumerate(worlds(4).run(case_zero1_load, tensor_model_parallel_size=1,
                                                checkpoint=checkpoint)):
        _close(logits, saved, f"ZeRO-1 tp=1 x dp=4 rank {rank} logits after loading")


# ---- a fused, strided, zero-padded weight: GPT-2's c_attn with 6 heads at tp=4 ---------------------------------------

def case_gpt2_save(checkpoint: str):
    import torch.distributed.checkpoint as dcp

    from nxdtp.checkpointing.dcp_state import dcp_process_group, get_state_dict
    from nxdtp.models import parallelize_model
    from tests.test_models_gpt2 import VOCAB, checkpoint_batch, six_heads_lm_head_model

    model = parallelize_model(six_heads_lm_head_model(seed=0), make_vocab_size_divisible_by=MULTIPLE)
    spec = model.transformer.h[0].attn.c_attn.param_specs()["weight"]
    dcp.save(get_state_dict(model), checkpoint_id=checkpoint, process_group=dcp_process_group())
    return {"stride": spec.stride, "pad_groups": spec.pad_groups,
            "logits": _logits(model, checkpoint_batch(), VOCAB)[0]}


def case_gpt2_load(checkpoint: str):
    import torch.distributed.checkpoint as dcp

    from nxdtp.checkpointing.dcp_state import dcp_process_group, get_state_dict, set_state_dict
    from nxdtp.models import parallelize_model
    from tests.test_models_gpt2 import VOCAB, checkpoint_batch, six_heads_lm_head_model

    model = parallelize_model(six_heads_lm_head_model(seed=7), make_vocab_size_divisible_by=MULTIPLE)
    state = get_state_dict(model)
    dcp.load(state, checkpoint_id=checkpoint, process_group=dcp_process_group())
    set_state_dict(model, None, state)
    return _logits(model, checkpoint_batch(), VOCAB)[0]


def test_fused_strided_zero_padded_weight_round_trips(worlds, tmp_path):
    import torch.distributed.checkpoint as dcp

    from tests.test_models_gpt2 import checkpoint_batch, six_heads_lm_head_model

    checkpoint = str(tmp_path / "gpt2")
    saved = worlds(4).run(case_gpt2_save, tensor_model_parallel_size=4, checkpoint=checkpoint)
    assert saved[0]["stride"] == 3 and saved[0]["pad_groups"] == 3, saved[0]  # 6 heads padded to 8, per Q|K|V part
    meta = _metadata(checkpoint)["transformer.h.0.attn.c_attn.weight"]
    assert tuple(meta.size) == (48, 144)  # dense: no zero heads
    assert len(meta.chunks) > 4  # a rank's piece is several runs of the dense columns
    dense = six_heads_lm_head_model(seed=5)
    state = dense.state_dict()
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    dense.load_state_dict(state)
    _close(_logits(dense, checkpoint_batch())[0], saved[0]["logits"], "dense GPT-2 from the live tp=4 save")
    for rank, logits in enumerate(worlds(4).run(case_gpt2_load, tensor_model_parallel_size=2,
                                                checkpoint=checkpoint)):
        _close(logits, saved[0]["logits"], f"nxdtp tp=2 rank {rank} GPT-2 logits from the tp=4 save")


# ---- bad input -------------------------------------------------------------------------------------------------------

def case_bad_input():
    from nxdtp.checkpointing.dcp_state import DenseView, get_state_dict, set_state_dict
    from nxdtp.optimizer import NeuronZero1Optimizer

    def error(call):
        try:
            call()
        except (ValueError, TypeError, KeyError, NotImplementedError) as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    model, plain = _nxdtp_llama(seed=0), _llama(seed=1)
    other = _nxdtp_llama(seed=2)
    errors = {
        "plain model": error(lambda: get_state_dict(plain)),
        "plain model's optimizer": error(lambda: get_state_dict(model, torch.optim.AdamW(plain.parameters()))),
        "zero1 not made": error(lambda: get_state_dict(model, NeuronZero1Optimizer(
            model.parameters(), torch.optim.AdamW, lazy_init=True, lr=LR))),
        "another model's state": error(lambda: set_state_dict(model, None, get_state_dict(other))),
        "missing key": error(lambda: set_state_dict(model, None, {k: v for k, v in get_state_dict(model).items()
                                                                  if k != "lm_head.weight"})),
        "op on a view": error(lambda: get_state_dict(model)["lm_head.weight"] + 1),
    }
    view = get_state_dict(model)["lm_head.weight"]
    assert isinstance(view, DenseView) and tuple(view.shape) == (LLAMA_VOCAB, 32), view
    return errors


def test_bad_input_gives_one_clear_error(worlds):
    errors = worlds(4).run(case_bad_input, tensor_model_parallel_size=2)[0]
    assert "not parallelized by nxdtp" in errors["plain model"], errors
    assert "belongs to another model" in errors["plain model's optimizer"], errors
    assert "lazy_init=True" in errors["zero1 not made"] and "init_zero()" in errors["zero1 not made"], errors
    assert "DenseView of another tensor" in errors["another model's state"], errors
    assert "missing ['lm_head.weight']" in errors["missing key"], errors
    assert errors["op on a view"].startswith("NotImplementedError"), errors
    assert all("\n" not in message for message in errors.values()), errors


def test_docs_name_the_api():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for doc, needle in (("docs/checkpoints.md", "### DCP in a running job"),
                        ("docs/api.md", "### nxdtp.checkpointing.dcp_state.get_state_dict(")):
        with open(os.path.join(root, doc)) as f:
            text = f.read()
        assert needle in text and "set_state_dict" in text and "dcp_process_group" in text, doc

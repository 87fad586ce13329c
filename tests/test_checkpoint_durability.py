"""Crash consistency, integrity and tag locks of nxdtp checkpoints (docs/checkpoints.md, "Crash consistency",
"Integrity", "Tag locks").

* The fsync/rename order of one save (tp=2, both ranks' os calls recorded) matches the documented protocol.
* kill -9 at seeded random moments across a save: a fresh load gives the previous tag or the new one, bit-exactly.
* Flipped bytes in every kind of file: load, merge and reshard raise ``CheckpointIntegrityError`` naming the file; an
  unnamed damaged newest tag is skipped with a warning, a named one raises; ``verify=False`` lets flipped data through.
* Two jobs saving one tag at once: one wins, the other's error names the owner; stale locks are broken with a warning.

Comparisons are bitwise (``np.array_equal``): a checkpoint stores exact bits.
"""

from __future__ import annotations

import builtins
import datetime
import json
import multiprocessing
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from nxdtp import comm
from nxdtp import parallel_state as ps
from nxdtp.checkpointing import load, newest_tag, save
from nxdtp.checkpointing.lock import CheckpointLockedError, TagLock, lock_path
from nxdtp.checkpointing.tags import CheckpointIntegrityError
from nxdtp.layers import ColumnParallelLinear, RowParallelLinear
from tests.harness import PROCESS_WAIT_S

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Helpers of their own, not tests.test_checkpointing's: the processes this file starts import it, and should not pay
# for transformers.
def _error(fn):
    """What ``fn()`` raised, as 'Type: message', or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return f"{type(e).__name__}: {e}"
    return None


def _files(tag_dir: str) -> list:
    return sorted(os.path.relpath(os.path.join(d, f), tag_dir) for d, _, fs in os.walk(tag_dir) for f in fs)


def _params(model) -> dict:
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def _same_arrays(a: dict, b: dict) -> list:
    """Names whose arrays differ (bitwise) or exist on one side only."""
    return sorted(k for k in set(a) | set(b) if k not in a or k not in b or not np.array_equal(a[k], b[k]))


def _optimizer_arrays(model, opt) -> dict:
    if hasattr(opt, "base_optimizer"):  # ZeRO-1: this rank's shards of the inner state, and its master shards
        state = opt.state_dict()
        arrays = {f"{i}/{k}": v.detach().numpy().copy() for i, fields in state["base_state"].items()
                  for k, v in fields.items()}
        arrays.update({f"{i}/master": v.detach().numpy().copy() for i, v in state["sharded_master_weights"].items()})
        return arrays
    names = {id(p): n for n, p in model.named_parameters()}
    return {f"{names[id(p)]}/{k}": v.detach().numpy().copy() for p, fields in opt.state.items()
            for k, v in fields.items()}


class _Model(nn.Module):
    """Column -> Row -> LayerNorm of width ``hidden``; every parameter drawn from ``seed`` (replicated ones equal on
    every TP rank), so two processes building it with one seed hold the same bits."""

    def __init__(self, seed: int, hidden: int = 16):
        super().__init__()
        self.up = ColumnParallelLinear(hidden, 2 * hidden, gather_output=False)
        self.down = RowParallelLinear(2 * hidden, hidden, input_is_parallel=True)
        self.norm = nn.LayerNorm(hidden)
        tp_rank = ps.get_tensor_model_parallel_rank()
        with torch.no_grad():
            for i, (_, p) in enumerate(self.named_parameters()):
                sharded = getattr(p, "tensor_model_parallel", False)
                g = torch.Generator().manual_seed(seed * 1000 + i + (100 * (tp_rank + 1) if sharded else 0))
                p.copy_(torch.randn(p.shape, generator=g))


def _model_and_optimizer(seed: int, hidden: int = 16, zero1: bool = False):
    """A model and an AdamW after one step on seeded gradients (no collective: any process can build it alone), or
    with ``zero1`` a ``NeuronZero1Optimizer`` over AdamW (its step is collective over DP: every rank builds it)."""
    model = _Model(seed, hidden)
    if zero1:
        from nxdtp.optimizer import NeuronZero1Optimizer

        opt = NeuronZero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tp_rank = ps.get_tensor_model_parallel_rank()
    for i, p in enumerate(model.parameters()):
        # Replicated parameters get the same gradient on every TP rank, so they stay equal (the checkpoint holds
        # TP rank 0's copy).
        sharded = getattr(p, "tensor_model_parallel", False)
        g = torch.Generator().manual_seed(seed * 1000 + 500 + i + (100 * (tp_rank + 1) if sharded else 0))
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    return model, opt


def _which(model, opt, step, candidates, zero1: bool = False) -> str:
    """The candidate (seed by name) whose model and optimizer state the loaded ones equal bitwise, or 'mix'."""
    for name, (seed, hidden, saved_step) in candidates.items():
        ref_model, ref_opt = _model_and_optimizer(seed, hidden, zero1)
        if (step == saved_step and _same_arrays(_params(model), _params(ref_model)) == []
                and _same_arrays(_optimizer_arrays(model, opt), _optimizer_arrays(ref_model, ref_opt)) == []):
            return name
    return "mix"


# ---- 1. the order of fsync / rename / mkdir calls of one save --------------------------------------------------------

def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def case_record_save(root: str):
    """Save once (model, optimizer, an extra entry) with the os layer recorded; return this rank's events."""
    model, opt = _model_and_optimizer(seed=1)
    events = []
    originals = {name: getattr(os, name) for name in ("fsync", "replace", "rename", "mkdir")}
    original_open = builtins.open

    def record(op, *paths):
        events.append((time.time_ns(), op) + tuple(os.path.abspath(os.fspath(p)) for p in paths))

    def fsync(fd):
        record("fsync", _fd_path(fd))
        return originals["fsync"](fd)

    def replace(src, dst, *a, **k):
        result = originals["replace"](src, dst, *a, **k)
        record("rename", src, dst)
        return result

    def rename(src, dst, *a, **k):
        result = originals["rename"](src, dst, *a, **k)
        record("rename", src, dst)
        return result

    def mkdir(path, *a, **k):
        result = originals["mkdir"](path, *a, **k)
        record("create", path)
        return result

    def opener(file, mode="r", *a, **k):
        if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax"):
            record("create", file)
        return original_open(file, mode, *a, **k)

    comm.barrier()
    os.fsync, os.replace, os.rename, os.mkdir = fsync, replace, rename, mkdir
    builtins.open = opener
    try:
        tag_dir = save({"model": model, "optimizer": opt, "global_step": 1, "loss": torch.tensor(1.5)}, root)
    finally:
        for name, function in originals.items():
            setattr(os, name, function)
        builtins.open = original_open
    return dict(events=events, tag_dir=os.path.abspath(tag_dir), files=_files(tag_dir))


def test_save_fsyncs_every_file_and_directory_before_done_then_renames_newest(worlds, tmp_path):
    root = str(tmp_path / "ckpt")
    results = worlds(2).run(case_record_save, tensor_model_parallel_size=2, root=root)
    events = sorted(e for r in results for e in r["events"])  # one host: time_ns orders both ranks' calls
    tag_dir, files = results[0]["tag_dir"], results[0]["files"]
    root = os.path.abspath(root)
    done, newest = os.path.join(tag_dir, "done"), os.path.join(root, "newest")

    def times(op, path):
        return [e[0] for e in events if e[1] == op and e[-1] == path]

    (done_at,) = times("rename", done)  # 'done' appears by one rename, of a temporary file in the tag directory
    done_source = next(e[2] for e in events if e[1] == "rename" and e[-1] == done)
    assert os.path.dirname(done_source) == tag_dir and any(t < done_at for t in times("fsync", done_source)), events
    (newest_at,) = times("rename", newest)
    newest_source = next(e[2] for e in events if e[1] == "rename" and e[-1] == newest)
    assert os.path.dirname(newest_source) == root and any(t < newest_at for t in times("fsync", newest_source))
    assert done_at < newest_at
    # Every file of the tag (either rank's) was fsynced after it was last created and before 'done' appeared.
    data_files = [f for f in files if f != "done"]
    assert {"model/tp_rank_01.safetensors", "optim/tp_rank_00.safetensors", "rng/rank_00001.json",
            "extra/tp_rank_01.pt", "nxdtp_index.json", "trainer_state.json"} <= set(data_files), data_files
    for relative in data_files:
        path = os.path.join(tag_dir, relative)
        created = max(times("create", path))
        assert any(created < t < done_at for t in times("fsync", path)), f"{relative} not fsynced before 'done'"
    # Every directory: fsynced after its last entry appeared, and before 'done' (the tag directory after 'done' too,
    # the checkpoint directory after 'newest').
    directories = {tag_dir} | {os.path.dirname(os.path.join(tag_dir, f)) for f in files}
    for directory in sorted(directories) + [root]:
        entries = [e[0] for e in events if e[1] in ("create", "rename") and os.path.dirname(e[-1]) == directory
                   and e[0] < done_at and e[-1] != done_source]  # done's temporary file is part of the rename
        assert any(max(entries) < t < done_at for t in times("fsync", directory)), f"{directory} not fsynced"
    assert any(t > done_at for t in times("fsync", tag_dir)), "the tag directory is not fsynced after 'done'"
    assert any(t > newest_at for t in times("fsync", root)), "the checkpoint directory is not fsynced after 'newest'"
    assert not os.path.exists(lock_path(root, os.path.basename(tag_dir))), "the tag lock was not released"


# ---- 2. checksums: flipped bytes in every kind of file ---------------------------------------------------------------

def _flip(path: str, from_end: int = 5) -> None:
    """Flip every bit of one byte near the end (tensor data in a safetensors file, a value in a JSON file)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - from_end)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


FLIPPED = ("model/tp_rank_01.safetensors", "optim/tp_rank_00.safetensors", "rng/rank_00001.json",
           "trainer_state.json", "nxdtp_index.json", "extra/tp_rank_00.pt")


def case_flipped_bytes(root: str):
    rank = dist.get_rank()
    step1 = _model_and_optimizer(seed=1)
    step2 = _model_and_optimizer(seed=2)
    pristine = os.path.join(root, "pristine")
    save({"model": step1[0], "optimizer": step1[1], "global_step": 1, "loss": torch.tensor(1.0)}, pristine)
    save({"model": step2[0], "optimizer": step2[1], "global_step": 2, "loss": torch.tensor(2.0)}, pristine)
    candidates = {"step1": (1, 16, 1), "step2": (2, 16, 2)}
    out = {}
    for relative in FLIPPED:
        directory = os.path.join(root, relative.replace("/", "_"))
        if rank == 0:
            shutil.copytree(pristine, directory)
            _flip(os.path.join(directory, "step_000002", relative))
        comm.barrier()
        model, opt = _model_and_optimizer(seed=50)
        named = _error(lambda: load(directory, model=model, optimizer=opt, tag="step_000002",
                                    restore_rng_states=True))
        model, opt = _model_and_optimizer(seed=50)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = load(directory, model=model, optimizer=opt, restore_rng_states=True)
        out[relative] = dict(named=named, unnamed=_which(model, opt, state["global_step"], candidates),
                             warnings=[str(w.message) for w in caught])
        comm.barrier()
    # verify=False: flipped tensor data loads as it is on disk (the flag really turns verification off).
    model, opt = _model_and_optimizer(seed=50)
    directory = os.path.join(root, "model_tp_rank_01.safetensors")
    load(directory, model=model, optimizer=opt, tag="step_000002", verify=False)
    out["unverified_differs"] = _same_arrays(_params(model), _params(step2[0]))
    return out


def test_flipped_bytes_are_named_and_an_unnamed_damaged_tag_is_skipped(worlds, tmp_path):
    from nxdtp.checkpointing.merge import merge, reshard

    results = worlds(2).run(case_flipped_bytes, tensor_model_parallel_size=2, root=str(tmp_path))
    for rank, r in enumerate(results):
        for relative in FLIPPED:
            outcome = r[relative]
            # Who reads the file: rank 1 reads model/tp_rank_01 and rng/rank_00001; rank 0 optim/tp_rank_00 and
            # extra/tp_rank_00; every rank the index and trainer state. The other ranks name it via the agreement.
            assert outcome["named"] is not None and relative in outcome["named"], (rank, relative, outcome)
            assert "checksum" in outcome["named"], (rank, relative, outcome)
            assert outcome["unnamed"] == "step1", (rank, relative, outcome)
            if rank == 0:
                assert any("step_000002" in w and "damaged, skipped" in w and relative in w
                           for w in outcome["warnings"]), (relative, outcome["warnings"])
        # Only rank 1 holds TP rank 1's shards, where the byte was flipped.
        assert r["unverified_differs"] == (["down.weight"] if rank == 1 else []), (rank, r["unverified_differs"])

    # The merge tool and reshard, on the same damaged copies.
    for relative in ("model/tp_rank_01.safetensors", "nxdtp_index.json", "optim/tp_rank_00.safetensors"):
        directory = tmp_path / relative.replace("/", "_")
        runs = {"merge": lambda out, **k: merge(directory, out, progress=False, **k),
                "reshard": lambda out, **k: reshard(directory, out, 1, progress=False, **k)}
        for what, run in runs.items():
            if relative.startswith("optim") and what == "merge":
                continue  # a merge reads the model files only
            with pytest.raises(CheckpointIntegrityError, match=relative):
                run(str(tmp_path / "out"), tag="step_000002")
            assert not (tmp_path / "out").exists()
            with pytest.warns(UserWarning, match="step_000002 is damaged, skipped"):
                run(str(tmp_path / "out"))
            shutil.rmtree(tmp_path / "out")
    # Unverified, the flipped model byte merges (and differs from the verified merge of the intact tag).
    merge(tmp_path / "model_tp_rank_01.safetensors", str(tmp_path / "raw"), tag="step_000002", progress=False,
          verify=False)
    merge(tmp_path / "pristine", str(tmp_path / "good"), tag="step_000002", progress=False)
    assert (tmp_path / "raw" / "model.safetensors").read_bytes() != \
        (tmp_path / "good" / "model.safetensors").read_bytes()
    # The reshard output records its own checksums: a flipped byte in it is caught when it is read.
    reshard(tmp_path / "pristine", str(tmp_path / "tp1"), 1, progress=False)
    _flip(str(tmp_path / "tp1" / "step_000002" / "model" / "tp_rank_00.safetensors"))
    with pytest.raises(CheckpointIntegrityError, match="tp_rank_00.safetensors fails its checksum"):
        merge(tmp_path / "tp1", str(tmp_path / "out"), tag="step_000002", progress=False)


# ---- 2b. per-tensor checksums: what a rank loads, and only that, is verified as it is read ---------------------------

def _tensor_range(path: str, key: str):
    """(first byte, end) of tensor ``key``'s data in the safetensors file at ``path``, and the header's length."""
    with open(path, "rb") as f:
        length = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(length))
    begin, end = header[key]["data_offsets"]
    return 8 + length + begin, 8 + length + end, length


def _flip_at(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def _retype_in_header(path: str, key: str) -> None:
    """Rewrite ``key``'s dtype F32 as I32 in the file's header: same length, same element size, still valid JSON, so
    only a checksum of the header tells the tensor would be read as the wrong type."""
    data = bytearray(open(path, "rb").read())
    length = struct.unpack("<Q", data[:8])[0]
    entry = data.index(f'"{key}":'.encode(), 8, 8 + length)
    dtype = data.index(b'"F32"', entry, 8 + length)
    data[dtype + 1] = ord("I")
    with open(path, "wb") as f:
        f.write(data)


REPLICATED_DAMAGE = ("replicated tensor data", "replicated tensor dtype in the header")


def case_replicated_tensor_damage(root: str):
    """TP rank 0's file holds every replicated tensor; TP rank 1 reads those (and only those) from it. Damage there
    must be caught by rank 1's own read."""
    rank = dist.get_rank()
    pristine = os.path.join(root, "pristine")
    step1, step2 = _model_and_optimizer(seed=1), _model_and_optimizer(seed=2)
    save({"model": step1[0], "optimizer": step1[1], "global_step": 1}, pristine)
    save({"model": step2[0], "optimizer": step2[1], "global_step": 2}, pristine)
    candidates = {"step1": (1, 16, 1), "step2": (2, 16, 2)}
    out = {}
    for damage in REPLICATED_DAMAGE:
        directory = os.path.join(root, damage.replace(" ", "_").replace(",", ""))
        rank0_file = os.path.join(directory, "step_000002", "model", "tp_rank_00.safetensors")
        if rank == 0:
            shutil.copytree(pristine, directory)
            if "header" in damage:
                _retype_in_header(rank0_file, "down.bias")
            else:
                begin, end, _ = _tensor_range(rank0_file, "norm.weight")
                _flip_at(rank0_file, (begin + end) // 2)
        comm.barrier()
        model, opt = _model_and_optimizer(seed=50)
        try:
            load(directory, model=model, optimizer=opt, tag="step_000002")
            named = None
        except Exception as e:  # noqa: BLE001 - a failed rank raises its own error (the others a RuntimeError)
            named = (type(e).__name__, str(e))
        model, opt = _model_and_optimizer(seed=50)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = load(directory, model=model, optimizer=opt)
        unnamed = _which(model, opt, state["global_step"], candidates)
        # Unverified, the damaged bytes reach this rank's model: the damage lies in what rank 1 loads.
        model, opt = _model_and_optimizer(seed=50)
        try:
            load(directory, model=model, optimizer=opt, tag="step_000002", verify=False)
            unverified = _same_arrays(_params(model), _params(step2[0]))
        except Exception as e:  # noqa: BLE001
            unverified = f"{type(e).__name__}: {e}"
        out[damage] = dict(named=named, unnamed=unnamed, unverified=unverified,
                           warnings=[str(w.message) for w in caught])
        comm.barrier()
    return out


def test_damage_in_a_replicated_tensor_of_tp_rank_0s_file_is_caught_by_tp_rank_1(worlds, tmp_path):
    results = worlds(2).run(case_replicated_tensor_damage, tensor_model_parallel_size=2, root=str(tmp_path))
    for rank, r in enumerate(results):
        for damage in REPLICATED_DAMAGE:
            outcome = r[damage]
            # Each rank's own error (the agreement makes a rank that found nothing raise a RuntimeError instead).
            assert outcome["named"] is not None, (rank, damage, "loaded without an error", outcome)
            kind, message = outcome["named"]
            assert kind == "CheckpointIntegrityError", (rank, damage, outcome)
            assert "model/tp_rank_00.safetensors" in message and "fails its checksum" in message, (rank, message)
            if damage == "replicated tensor data":
                assert "tensor 'norm.weight'" in message, message
            elif "header" in damage:
                assert "safetensors header" in message, message
            assert outcome["unnamed"] == "step1", (rank, damage, outcome)
            if rank == 0:
                assert any("step_000002 is damaged, skipped" in w and "tp_rank_00.safetensors" in w
                           for w in outcome["warnings"]), (damage, outcome["warnings"])
        assert r["replicated tensor data"]["unverified"] == ["norm.weight"], r["replicated tensor data"]
        assert r["replicated tensor dtype in the header"]["unverified"] == ["down.bias"], r


def case_save(root: str):
    model, opt = _model_and_optimizer(seed=1)
    save({"model": model, "optimizer": opt, "global_step": 1}, root)


def test_index_records_every_tensor_and_header_of_each_rank_file(tmp_path, worlds):
    """The records load checks against are those of the bytes on disk: recomputed from the files, they agree."""
    import xxhash

    from nxdtp.checkpointing import CheckpointIndex

    worlds(2).run(case_save, tensor_model_parallel_size=2, root=str(tmp_path))
    tag_dir = str(tmp_path / "step_000001")
    index = CheckpointIndex.read(tag_dir)
    assert sorted(index.tensor_checksums) == ["model/tp_rank_00.safetensors", "model/tp_rank_01.safetensors",
                                              "optim/tp_rank_00.safetensors", "optim/tp_rank_01.safetensors"]
    for relative, record in index.tensor_checksums.items():
        data = open(os.path.join(tag_dir, relative), "rb").read()
        length = struct.unpack("<Q", data[:8])[0]
        assert record["header"] == {"size": 8 + length, "xxh3_64": xxhash.xxh3_64_hexdigest(data[:8 + length])}
        header = json.loads(data[8:8 + length])
        assert sorted(record["tensors"]) == sorted(header)
        for key, digest in record["tensors"].items():
            begin, end = header[key]["data_offsets"]
            assert digest == xxhash.xxh3_64_hexdigest(data[8 + length + begin:8 + length + end]), (relative, key)


def _read_as_load_does(tag_dir: str, tp_rank: int) -> dict:
    """What ``load`` reads of the model on ``tp_rank``, with its checks, in their order (no world needed)."""
    from nxdtp.checkpointing import integrity
    from nxdtp.checkpointing.index import model_file
    from nxdtp.checkpointing.save_load import read_model_shard

    index = integrity.read_index(tag_dir)
    integrity.verify_files(tag_dir, index, sorted({model_file(tp_rank), model_file(0)}), tensors_as_read=True)
    return {k: v.clone().numpy() for k, v in read_model_shard(tag_dir, index, tp_rank, verify=True).items()}


def test_any_flipped_byte_a_rank_reads_is_caught_and_no_other_changes_what_it_loads(tmp_path, worlds):
    """Seeded single-byte damage anywhere in either model file (headers included): each TP rank's read either raises
    CheckpointIntegrityError naming the damaged file, or, when the byte is one it does not read (TP rank 1 reads only
    the replicated tensors of TP rank 0's file), gives exactly the pristine tensors."""
    from nxdtp.checkpointing import CheckpointIndex

    worlds(2).run(case_save, tensor_model_parallel_size=2, root=str(tmp_path))
    tag_dir = str(tmp_path / "step_000001")
    pristine = {r: _read_as_load_does(tag_dir, r) for r in (0, 1)}
    index = CheckpointIndex.read(tag_dir)
    replicated = {key for key, entry in index.tensors.items() if not entry.spec.is_sharded}
    first = "model/tp_rank_00.safetensors"
    rng = random.Random(13)
    caught_unread = {0: 0, 1: 0}
    for case in range(120):
        relative = rng.choice(["model/tp_rank_00.safetensors", "model/tp_rank_01.safetensors"])
        path = os.path.join(tag_dir, relative)
        data = open(path, "rb").read()
        length = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8:8 + length])
        # Half the cases in the header (where the offsets, dtypes and shapes are), half in the tensor data.
        offset = rng.randrange(8 + length) if case % 2 else rng.randrange(8 + length, len(data))
        damaged = bytearray(data)
        damaged[offset] ^= rng.randrange(1, 256)
        with open(path, "wb") as f:
            f.write(damaged)
        try:
            for tp_rank in (0, 1):
                in_tensor = [k for k, v in header.items() if k != "__metadata__"
                             and 8 + length + v["data_offsets"][0] <= offset < 8 + length + v["data_offsets"][1]]
                read = relative == first or tp_rank == 1  # TP rank 0 never opens TP rank 1's file
                reads_byte = read and (relative != first or tp_rank == 0 or offset < 8 + length
                                       or any(k in replicated for k in in_tensor))
                try:
                    loaded = _read_as_load_does(tag_dir, tp_rank)
                except CheckpointIntegrityError as e:
                    assert relative in str(e), (case, offset, tp_rank, str(e))
                    assert read, (case, offset, tp_rank, "an error for a file this rank does not read", str(e))
                    caught_unread[tp_rank] += not reads_byte
                    continue
                assert not reads_byte, (case, relative, offset, tp_rank, in_tensor, "loaded without an error")
                assert _same_arrays(loaded, pristine[tp_rank]) == [], (case, relative, offset, tp_rank)
        finally:
            with open(path, "wb") as f:
                f.write(data)
    assert caught_unread == {0: 0, 1: 0}, caught_unread  # nothing a rank does not read stops it


def test_nxdtp_merge_no_verify_flag(tmp_path, worlds, capsys):
    from nxdtp.cli import main

    worlds(2).run(case_flipped_bytes_small, tensor_model_parallel_size=2, root=str(tmp_path))
    directory = str(tmp_path / "ckpt")
    assert main([directory, str(tmp_path / "out"), "--tag", "step_000001", "--no-progress"]) == 2
    assert "tp_rank_01.safetensors fails its checksum" in capsys.readouterr().err
    assert main([directory, str(tmp_path / "out"), "--tag", "step_000001", "--no-progress", "--no-verify"]) == 0


def case_flipped_bytes_small(root: str):
    model, opt = _model_and_optimizer(seed=1)
    save({"model": model, "global_step": 1}, os.path.join(root, "ckpt"))
    if dist.get_rank() == 0:
        _flip(os.path.join(root, "ckpt", "step_000001", "model", "tp_rank_01.safetensors"))
    comm.barrier()


# ---- 3. tag locks --------------------------------------------------------------------------------------------------

def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _write_lock(path, **owner) -> None:
    with open(path, "w") as f:
        json.dump({"host": socket.gethostname(), "started": "2020-01-01T00:00:00+00:00", "token": "x", **owner}, f)


def test_a_held_lock_names_its_owner_and_a_stale_one_is_broken(tmp_path):
    path = lock_path(str(tmp_path), "step_000001")
    _write_lock(path, pid=os.getpid())  # a live owner on this host
    with pytest.raises(CheckpointLockedError, match=rf"host '{socket.gethostname()}', pid {os.getpid()}.*{path}"):
        TagLock(str(tmp_path), "step_000001").acquire()
    _write_lock(path, pid=1, host="elsewhere.example")  # another host: cannot be checked, so not broken
    with pytest.raises(CheckpointLockedError, match=r"'elsewhere.example', pid 1.*no longer running, delete"):
        TagLock(str(tmp_path), "step_000001").acquire()
    dead = _dead_pid()
    _write_lock(path, pid=dead)
    lock = TagLock(str(tmp_path), "step_000001")
    with pytest.warns(UserWarning, match=rf"broke the stale lock {path} .*pid {dead}"):
        lock.acquire()
    with open(path) as f:
        assert json.load(f)["pid"] == os.getpid()
    lock.release()
    assert not os.path.exists(path)


def case_save_under_locks(root: str, live_pid: int, dead_pid: int):
    model, _ = _model_and_optimizer(seed=3)
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        _write_lock(lock_path(root, "step_000001"), pid=live_pid)
        _write_lock(lock_path(root, "step_000002"), pid=dead_pid)
    comm.barrier()
    held = _error(lambda: save({"model": model, "global_step": 1}, root))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save({"model": model, "global_step": 2}, root)
    return dict(held=held, warnings=[str(w.message) for w in caught], newest=newest_tag(root),
                step1_exists=os.path.exists(os.path.join(root, "step_000001", "done")),
                locks=sorted(f for f in os.listdir(root) if f.endswith(".lock")))


def test_save_refuses_a_held_tag_on_every_rank_and_breaks_a_stale_lock(worlds, tmp_path):
    results = worlds(2).run(case_save_under_locks, tensor_model_parallel_size=2, root=str(tmp_path / "ckpt"),
                            live_pid=os.getpid(), dead_pid=_dead_pid())
    for rank, r in enumerate(results):
        assert r["held"] is not None and "being saved by another job" in r["held"], (rank, r)
        assert f"pid {os.getpid()}" in r["held"] and "step_000001.lock" in r["held"], (rank, r)
        assert not r["step1_exists"] and r["newest"] == "step_000002", (rank, r)
        assert r["locks"] == ["step_000001.lock"], r  # the foreign one stays; the stale one was broken and released
    assert any("broke the stale lock" in w for w in results[0]["warnings"]), results[0]["warnings"]


# Two single-process jobs saving one tag at once. The one holding the lock blocks in its first tensor write until the
# test has seen the other fail, so the two saves overlap for certain.
JOB_SCRIPT = """
import json, os, sys, time
import torch
sys.path.insert(0, {repo!r})
from nxdtp import parallel_state as ps
from nxdtp.checkpointing import save
from nxdtp.checkpointing import safetensors_stream
torch.set_num_threads(1)
ps.initialize_single_process_world()
ps.initialize_model_parallel(tensor_model_parallel_size=1)
from tests.test_checkpoint_durability import _model_and_optimizer
job, root, gate = int(sys.argv[1]), sys.argv[2], sys.argv[3]
model, opt = _model_and_optimizer(seed=10 + job)
original = safetensors_stream.StreamingSafetensorsWriter.write
def held(self, name, tensor):
    while not os.path.exists(os.path.join(gate, "release")):
        time.sleep(0.01)
    return original(self, name, tensor)
safetensors_stream.StreamingSafetensorsWriter.write = held
open(os.path.join(gate, f"ready_{{job}}"), "w").close()
while not all(os.path.exists(os.path.join(gate, f"ready_{{j}}")) for j in (0, 1)):
    time.sleep(0.001)
try:
    save({{"model": model, "optimizer": opt, "global_step": 1}}, root, tag="shared")
    result = {{"ok": True}}
except Exception as e:
    result = {{"error": f"{{type(e).__name__}}: {{e}}"}}
with open(os.path.join(gate, f"result_{{job}}.json"), "w") as f:
    json.dump(result, f)
"""


def case_load_which(directory: str, candidates: dict, tag=None, zero1: bool = False):
    model, opt = _model_and_optimizer(seed=50, hidden=next(iter(candidates.values()))[1], zero1=zero1)
    state = load(directory, model=model, optimizer=opt, tag=tag)
    return _which(model, opt, state["global_step"], candidates, zero1)


def test_two_jobs_saving_one_tag_at_once_one_wins_the_other_names_it(worlds, tmp_path):
    root, gate = tmp_path / "ckpt", tmp_path / "gate"
    gate.mkdir()
    script = JOB_SCRIPT.format(repo=REPO_ROOT)
    jobs = [subprocess.Popen([sys.executable, "-c", script, str(j), str(root), str(gate)], cwd=REPO_ROOT)
            for j in (0, 1)]
    try:
        deadline = time.time() + PROCESS_WAIT_S
        while not any((gate / f"result_{j}.json").exists() for j in (0, 1)):
            assert time.time() < deadline and all(p.poll() is None for p in jobs), "neither job finished its refusal"
            time.sleep(0.05)
        (gate / "release").touch()
        for p in jobs:
            assert p.wait(timeout=PROCESS_WAIT_S) == 0
    finally:
        for p in jobs:
            if p.poll() is None:
                p.kill()
    results = [json.loads((gate / f"result_{j}.json").read_text()) for j in (0, 1)]
    winners = [j for j, r in enumerate(results) if r.get("ok")]
    assert len(winners) == 1, results
    winner, loser = winners[0], 1 - winners[0]
    message = results[loser]["error"]
    assert "CheckpointLockedError" in message and "being saved by another job" in message, message
    assert f"pid {jobs[winner].pid}" in message and socket.gethostname() in message, message
    assert "shared.lock" in message and "save started" in message, message
    # The tag loads, bit-exactly the winner's (on a 2-rank world at tp=1: both ranks read the one shard).
    loaded = worlds(2).run(case_load_which, tensor_model_parallel_size=1, directory=str(root),
                           candidates={"job0": (10, 16, 1), "job1": (11, 16, 1)})
    assert loaded == [f"job{winner}"] * 2, (loaded, winner)


# ---- 4. kill -9 at random moments of a save --------------------------------------------------------------------------

# The saving processes are forked from a server that imported torch and nxdtp once (multiprocessing's forkserver), so
# a kill moment costs a fork and a gloo rendezvous, not two interpreter starts (about 3 s a moment, 54 moments in all).
# torch._dynamo too: an optimizer's first step imports it (about 0.8 s). They are real processes all the same: SIGKILL
# ends each one wherever its save is.
SAVERS = multiprocessing.get_context("forkserver")
SAVERS.set_forkserver_preload(["torch", "torch._dynamo", "nxdtp.checkpointing", "tests.test_checkpoint_durability"])


def saver_process(root: str, gate: str, hidden: int, zero1: bool, rank: int, world: int, port: int) -> None:
    """One rank saving tag B (seed 2) into ``root`` once the file ``gate``/go appears; ``gate``/ready_RANK says it
    is waiting, ``gate``/finished_RANK holds the save's duration."""
    torch.set_num_threads(1)
    if world == 1:
        ps.initialize_single_process_world()
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
    # ZeRO-1 shards over DP: its ranks are DP ranks (tp=1); the plain case puts them all in TP.
    ps.initialize_model_parallel(tensor_model_parallel_size=1 if zero1 else world)
    model, opt = _model_and_optimizer(seed=2, hidden=hidden, zero1=zero1)
    open(os.path.join(gate, f"ready_{rank}"), "w").close()
    while not os.path.exists(os.path.join(gate, "go")):
        time.sleep(0.0005)
    start = time.perf_counter()
    save({"model": model, "optimizer": opt, "global_step": 2}, root)
    with open(os.path.join(gate, f"finished_{rank}"), "w") as f:
        f.write(str(time.perf_counter() - start))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _pristine(worlds, directory: str, world: int, hidden: int, zero1: bool = False) -> None:
    """A checkpoint directory holding tag A (step 1, seed 1), saved by the pool at the kill test's degree."""
    worlds(2).run(case_save_a, tensor_model_parallel_size=1 if zero1 else world, directory=directory, hidden=hidden,
                  zero1=zero1)


def case_save_a(directory: str, hidden: int, zero1: bool = False):
    model, opt = _model_and_optimizer(seed=1, hidden=hidden, zero1=zero1)
    save({"model": model, "optimizer": opt, "global_step": 1}, directory)


def _save_b_killed(directory: str, gate: str, world: int, hidden: int, delay, zero1: bool = False) -> float:
    """Start ``world`` processes saving tag B into ``directory``; SIGKILL them all ``delay`` seconds after the go
    (None: let them finish). Returns the save's duration as rank 0 measured it, or -1 when killed."""
    os.makedirs(gate)
    port = _free_port()
    processes = [SAVERS.Process(target=saver_process, args=(directory, gate, hidden, zero1, r, world, port))
                 for r in range(world)]
    for p in processes:
        p.start()
    try:
        deadline = time.time() + PROCESS_WAIT_S
        while not all(os.path.exists(os.path.join(gate, f"ready_{r}")) for r in range(world)):
            assert time.time() < deadline and all(p.is_alive() for p in processes), "a worker did not start"
            time.sleep(0.01)
        open(os.path.join(gate, "go"), "w").close()
        if delay is None:
            for p in processes:
                p.join(timeout=PROCESS_WAIT_S)
                assert p.exitcode == 0, p.exitcode
            with open(os.path.join(gate, "finished_0")) as f:
                return float(f.read())
        time.sleep(delay)
        for p in processes:
            p.kill()
        for p in processes:
            p.join(timeout=60)
        return -1.0
    finally:
        for p in processes:
            if p.is_alive():
                p.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def case_load_each(directories: list, candidates: dict, zero1: bool = False):
    """Which tag each directory loads (every rank raises together if one fails: the error is the outcome)."""
    out = []
    for directory in directories:
        try:
            out.append(case_load_which(directory, candidates, zero1=zero1))
        except Exception as e:  # noqa: BLE001 - the test reports it
            out.append(f"{type(e).__name__}: {e}")
    return out


def _kill_run(worlds, tmp_path, world: int, moments: int, seed: int, hidden: int, calibrations: int,
              zero1: bool = False):
    """kill -9 at ``moments`` seeded moments of saving tag B over tag A. ``zero1``: a NeuronZero1Optimizer at tp=1 x
    dp=``world``, so every rank writes its own optimizer shards."""
    pristine = str(tmp_path / "pristine")
    _pristine(worlds, pristine, world, hidden, zero1)
    # The duration of an undisturbed save sets the range of the kill moments (the longest of ``calibrations``).
    durations = []
    for attempt in range(calibrations):
        directory = str(tmp_path / f"calibrate{attempt}")
        shutil.copytree(pristine, directory)
        durations.append(_save_b_killed(directory, str(tmp_path / f"gate_c{attempt}"), world, hidden, None, zero1))
    duration = max(durations)
    rng = random.Random(seed)
    # Twice the calibrated duration: a killed save can run slower than the calibration (fsync and scheduling vary most
    # on a quiet machine, where a save takes tens of milliseconds), and the kills must land on both sides of the end.
    delays = sorted(rng.uniform(0.0, 2.0 * duration) for _ in range(moments))
    directories = []
    for i, delay in enumerate(delays):
        directory = str(tmp_path / f"killed{i}")
        shutil.copytree(pristine, directory)
        _save_b_killed(directory, str(tmp_path / f"gate{i}"), world, hidden, delay, zero1)
        directories.append(directory)
    candidates = {"A": (1, hidden, 1), "B": (2, hidden, 2)}
    results = worlds(2).run(case_load_each, tensor_model_parallel_size=1 if zero1 else world,
                            directories=directories, candidates=candidates, zero1=zero1)
    outcomes = results[0]
    assert results[1] == outcomes, results
    for delay, directory, outcome in zip(delays, directories, outcomes):
        assert outcome in ("A", "B"), (f"killed {delay:.4f} s into a {duration:.4f} s save: {outcome}",
                                       _files(directory))
    return duration, delays, outcomes


def test_kill_9_during_a_save_leaves_a_loadable_tag_single_process(worlds, tmp_path):
    duration, delays, outcomes = _kill_run(worlds, tmp_path, world=1, moments=2, seed=13, hidden=256,
                                           calibrations=1)
    assert outcomes[-1] in ("A", "B")


@pytest.mark.slow
def test_kill_9_at_30_random_moments_of_a_tp2_save_gives_the_old_or_new_tag_bit_exactly(worlds, tmp_path):
    duration, delays, outcomes = _kill_run(worlds, tmp_path, world=2, moments=30, seed=2024, hidden=512,
                                           calibrations=2)
    # The moments span the save: some kills came before 'newest' changed, and some after.
    print(f"save {duration:.3f} s; kills at {[round(d, 3) for d in delays]}; outcomes {outcomes}")
    assert "A" in outcomes and "B" in outcomes, (duration, delays, outcomes)

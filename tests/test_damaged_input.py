"""Seeded fuzz test: every reader of outside input turns a truncated file, flipped bytes or a structurally wrong file
into its one named error, with the damaged file's name in the message; never a raw library error, never a hang, never
a wrong tensor loaded silently.

Each *target* (``TARGETS``) is one reader: how to build a valid input into an empty directory, which files of it to
damage (with their byte ranges of headers and structure, where flips are aimed half of the time), the reader itself,
its error class, and structured damage (a dropped key, a changed dtype or shape). The valid inputs are built once per
module; each case damages a copy. A case passes when the reader raises the target's error naming the damaged file, or
returns exactly what it returns for the undamaged input (a flip in a byte nothing reads, e.g. a zip timestamp). To add
a reader (e.g. nxdtp's own index and rank files, once they carry checksums), write a ``Target`` and ``register`` it.

Formats without checksums cannot show that their data bytes were flipped; those targets aim flips at their headers
and structure only (``Site.data_checked=False``: safetensors, config files, whose values may change to other valid
values), or are not flipped at all (``Target.flips=False``: uncompressed HDF5, which has no checksum even on its
metadata). See docs/troubleshooting.md, "Damaged input".

``FAST_CASES`` cases in all run by default, ``SLOW_CASES`` under the slow marker; ``NXDTP_FUZZ_CASES`` overrides the
slow count (``NXDTP_FUZZ_CASES=5000 pytest -m slow tests/test_damaged_input.py``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import shutil
import sys
import tempfile
import zipfile
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.nxd_xser import xser_save

FAST_CASES = 100  # in all, over every target: the default run
SLOW_CASES = int(os.environ.get("NXDTP_FUZZ_CASES", "1200"))  # in all, under the slow marker
CASE_TIME_LIMIT_S = 60  # a reader that takes longer is hung: the run is aborted with every thread's traceback
EXAMPLE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "tp_dp_bert")


# ---- the registry ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Site:
    """One damageable file of a target (``path`` relative to the target's directory). ``hot`` are the byte ranges of
    its headers and structure; ``data_checked`` says whether the format detects flips outside them."""

    path: str
    hot: Tuple[Tuple[int, int], ...]
    data_checked: bool = True


@dataclass(frozen=True)
class Target:
    name: str
    build: Callable[[str], None]  # write a valid input into an empty directory
    sites: Callable[[str], List[Site]]  # the damageable files of a built directory
    read: Callable[[str, Any], Any]  # (directory, pytest's worlds) -> a comparable result, or raise ``error``
    error: str  # the class name of the reader's error
    # structured damage: name -> (edit the built directory in place; return the file the error must name)
    mutations: Dict[str, Callable[[str], str]] = field(default_factory=dict)
    flips: bool = True  # False: the format can detect no flipped byte anywhere, so flips are not tried
    build_needs_worlds: bool = False  # build(directory, worlds): the input is written by ranks of a world


TARGETS: Dict[str, Target] = {}


def register(target: Target) -> Target:
    TARGETS[target.name] = target
    return target


def same(a: Any, b: Any) -> bool:
    """Bit-exact equality of nested results (tensors, arrays, dicts, lists, scalars)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# ---- NxD checkpoints (nxdtp-merge --from-nxd) ------------------------------------------------------------------------

NXD_TP = 2
QUERY = "bert.encoder.layer.0.attention.self.query.weight"


def _bert_config(**overrides):
    from transformers import BertConfig

    kwargs = dict(vocab_size=53, hidden_size=16, num_hidden_layers=1, num_attention_heads=4, intermediate_size=32,
                  max_position_embeddings=16, architectures=["BertForPreTraining"])
    kwargs.update(overrides)
    return BertConfig(**kwargs)


def _dense_bert():
    from transformers import BertForPreTraining

    torch.manual_seed(0)
    model = BertForPreTraining(_bert_config())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


def _nxd_states(model) -> List[Dict[str, torch.Tensor]]:
    """Each TP rank's state dict as NxD's BERT example holds it (attention sharded, the rest whole)."""
    ranks = []
    for rank in range(NXD_TP):
        state = OrderedDict()
        for key, value in model.state_dict().items():
            if key.endswith(("query.weight", "query.bias", "key.weight", "key.bias", "value.weight", "value.bias")):
                value = value.chunk(NXD_TP, dim=0)[rank]
            elif key.endswith("attention.output.dense.weight"):
                value = value.chunk(NXD_TP, dim=1)[rank]
            state[key] = value.clone()
        ranks.append(state)
    return ranks


def _nxd_file(rank: int, xser: bool) -> str:
    return f"ckpt/tp_rank_{rank:02d}_pp_rank_00" + ("" if xser else "/checkpoint.pt")


def _build_nxd(directory: str, xser: bool) -> None:
    _bert_config().to_json_file(os.path.join(directory, "config.json"))
    for rank, state in enumerate(_nxd_states(_dense_bert())):
        path = os.path.join(directory, _nxd_file(rank, xser))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        extras = {"optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4)}}}, "epoch": 1}
        if xser:
            xser_save({"model": state, **extras}, path)
        else:
            torch.save({"model": state, **extras}, path)


def _zip_structure(path: str) -> Tuple[Tuple[int, int], ...]:
    """The byte ranges of a zip archive that are not tensor data: local headers, the pickle, the central directory."""
    with zipfile.ZipFile(path) as archive:
        entries = archive.infolist()
        central = archive.start_dir
    ranges = []
    with open(path, "rb") as f:
        for entry in entries:
            f.seek(entry.header_offset + 26)
            name_length, extra_length = np.frombuffer(f.read(4), dtype="<u2")
            data_start = entry.header_offset + 30 + int(name_length) + int(extra_length)
            ranges.append((entry.header_offset, data_start))
            if not entry.filename.split("/", 1)[-1].startswith("data/"):
                ranges.append((data_start, data_start + entry.compress_size))
    return tuple(ranges) + ((central, os.path.getsize(path)),)


def _nxd_sites(directory: str, xser: bool) -> List[Site]:
    files = []
    for rank in range(NXD_TP):
        files.append(_nxd_file(rank, xser))
        if xser:
            tensors = _nxd_file(rank, xser) + ".tensors"
            files += [f"{tensors}/{name}" for name in sorted(os.listdir(os.path.join(directory, tensors)))[:3]]
    return [Site(f, _zip_structure(os.path.join(directory, f))) for f in files]


def _read_nxd(directory: str, worlds=None) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from nxdtp.converters.nxd import merge_nxd_checkpoint

    output = os.path.join(directory, "merged")
    merge_nxd_checkpoint(os.path.join(directory, "ckpt"), os.path.join(directory, "config.json"), output,
                         progress=False)
    return load_file(os.path.join(output, "model.safetensors"))


def _rewrite_nxd_rank(directory: str, xser: bool, rank: int, edit: Callable[[Dict[str, torch.Tensor]], None]) -> str:
    """Rewrite one rank's file (valid, with fresh CRCs) after ``edit`` changed its model state dict."""
    path = os.path.join(directory, _nxd_file(rank, xser))
    state = _nxd_states(_dense_bert())[rank]
    edit(state)
    if xser:
        os.remove(path)
        shutil.rmtree(path + ".tensors")
        xser_save({"model": state}, path)
    else:
        torch.save({"model": state}, path)
    return path


def _nxd_mutations(xser: bool) -> Dict[str, Callable[[str], str]]:
    def drop(state):
        del state[QUERY]

    def dtype(state):
        state[QUERY] = state[QUERY].half()

    def shape(state):
        state[QUERY] = state[QUERY][:-1]

    def mutation(edit):
        def apply(directory: str) -> str:
            path = _rewrite_nxd_rank(directory, xser, 1, edit)
            if xser and edit is not drop:  # the error names the tensor's own file
                return path + ".tensors"
            return path
        return apply

    return {"drop a key": mutation(drop), "change a dtype": mutation(dtype), "change a shape": mutation(shape)}


for _xser in (False, True):
    register(Target(f"nxd-{'xser' if _xser else 'pt'}", lambda d, x=_xser: _build_nxd(d, x),
                    lambda d, x=_xser: _nxd_sites(d, x), _read_nxd, "NxdCheckpointError", _nxd_mutations(_xser)))


# ---- wikicorpus HDF5 shards (the example's data) ---------------------------------------------------------------------

SHARD = "x_training_0.hdf5"
VOCAB = 100


def _shard_arrays() -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    rows, seq, pred = 6, 8, 3
    return {
        "input_ids": rng.integers(1, VOCAB, (rows, seq)).astype(np.int32),
        "input_mask": np.ones((rows, seq), dtype=np.int8),
        "segment_ids": (np.arange(seq) >= seq // 2).astype(np.int8)[None].repeat(rows, 0),
        "masked_lm_positions": np.tile(np.arange(1, 1 + pred, dtype=np.int32), (rows, 1)),
        "masked_lm_ids": rng.integers(1, VOCAB, (rows, pred)).astype(np.int32),
        "next_sentence_labels": (np.arange(rows) % 2).astype(np.int8),
    }


def _write_shard(path: str, arrays: Dict[str, np.ndarray], gzip: bool) -> str:
    import h5py

    with h5py.File(path, "w") as f:
        for key, value in arrays.items():
            f.create_dataset(key, data=value, **({"compression": "gzip"} if gzip else {}))
    return path


def _shard_sites(directory: str, gzip: bool) -> List[Site]:
    """Flips are aimed outside the datasets' raw bytes; uncompressed data has no check, so flips stay out of it."""
    import h5py

    path = os.path.join(directory, SHARD)
    data = []
    with h5py.File(path, "r") as f:
        for key in f:
            dataset = f[key].id
            if gzip:
                data += [(c.byte_offset, c.byte_offset + c.size)
                         for c in (dataset.get_chunk_info(i) for i in range(dataset.get_num_chunks()))]
            else:
                data.append((dataset.get_offset(), dataset.get_offset() + dataset.get_storage_size()))
    hot, start = [], 0
    for begin, end in sorted(data):
        if begin > start:
            hot.append((start, begin))
        start = max(start, end)
    hot.append((start, os.path.getsize(path)))
    return [Site(SHARD, tuple(hot), data_checked=gzip)]


def _read_shard(directory: str, worlds=None):
    sys.path.insert(0, EXAMPLE_DIR)
    import pretraining_data

    path = os.path.join(directory, SHARD)
    rows = pretraining_data.count_rows(path)
    shard = pretraining_data.PretrainingShard(path, max_pred_len=3, seq_len=8, vocab_size=VOCAB)
    return [rows] + shard.batch(range(len(shard)))


def _shard_mutations(gzip: bool) -> Dict[str, Callable[[str], str]]:
    def mutation(edit):
        def apply(directory: str) -> str:
            arrays = _shard_arrays()
            edit(arrays)
            return _write_shard(os.path.join(directory, SHARD), arrays, gzip)
        return apply

    def out_of_vocab(a):
        a["input_ids"][2, 3] = VOCAB

    return {"drop a dataset": mutation(lambda a: a.pop("segment_ids")),
            "change a dtype": mutation(lambda a: a.update(input_ids=a["input_ids"].astype(np.float32))),
            "change a shape": mutation(lambda a: a.update(input_mask=a["input_mask"][:, :-1])),
            "id beyond the vocabulary": mutation(out_of_vocab)}


# NVIDIA's shards are gzip-compressed: zlib's checksum catches flipped data, and a flipped address lands in garbage
# that does not inflate. Uncompressed shards (build_pretraining_data.py's) have no checksum anywhere: HDF5's original
# object headers carry none, so a flipped data address reads neighbouring bytes as valid values; only truncation and
# structural damage can be detected there.
for _gzip in (True, False):
    register(Target(f"hdf5-{'gzip' if _gzip else 'plain'}",
                    lambda d, g=_gzip: _write_shard(os.path.join(d, SHARD), _shard_arrays(), g) and None,
                    lambda d, g=_gzip: _shard_sites(d, g), _read_shard, "DataError", _shard_mutations(_gzip),
                    flips=_gzip))


# ---- HF directories read by from_pretrained_sharded ------------------------------------------------------------------

def _build_hf(directory: str, sharded: bool) -> None:
    _dense_bert().save_pretrained(directory, **({"max_shard_size": "20KB"} if sharded else {}))


def _safetensors_header(path: str) -> Tuple[Tuple[int, int], ...]:
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
    return ((0, 8 + length),)


def _hf_sites(directory: str) -> List[Site]:
    sites = [Site("config.json", ((0, os.path.getsize(os.path.join(directory, "config.json"))),))]
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.endswith(".safetensors"):
            sites.append(Site(name, _safetensors_header(path), data_checked=False))
        elif name.endswith(".index.json"):
            sites.append(Site(name, ((0, os.path.getsize(path)),)))
    return sites


def case_read_hf(directory: str):
    """In a world of one: the loaded model's state dict, or the error's class name and message."""
    from nxdtp.models import from_pretrained_sharded

    try:
        model = from_pretrained_sharded(directory)
    except Exception as error:  # noqa: BLE001 - the test judges it
        return "error", type(error).__name__, str(error)
    return "ok", {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


class ReaderError(Exception):
    """An error a reader raised in a worker process, rebuilt here under its class name."""


def _read_hf(directory: str, worlds):
    outcome = worlds(1).run(case_read_hf, tensor_model_parallel_size=1, directory=directory)[0]
    if outcome[0] == "error":
        raise type(outcome[1], (ReaderError,), {})(outcome[2])
    return outcome[1]


def _rewrite_safetensors(directory: str, edit: Callable[[Dict[str, torch.Tensor]], None]) -> str:
    from safetensors.torch import load_file, save_file

    name = next(n for n in sorted(os.listdir(directory)) if n.endswith(".safetensors")
                and QUERY in load_file(os.path.join(directory, n)))
    path = os.path.join(directory, name)
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return path


def _hf_mutations() -> Dict[str, Callable[[str], str]]:
    def config(edit):
        return lambda directory: _edit_json_file(os.path.join(directory, "config.json"), edit)

    return {
        "drop a weight": lambda d: _rewrite_safetensors(d, lambda t: t.pop(QUERY)),
        "integer weight": lambda d: _rewrite_safetensors(d, lambda t: t.update({QUERY: t[QUERY].int()})),
        "change a shape": lambda d: _rewrite_safetensors(d, lambda t: t.update({QUERY: t[QUERY][:-1]})),
        "config value of the wrong type": config(lambda c: c.update(hidden_size="16")),
        "config size changed": config(lambda c: c.update(intermediate_size=64)),
        "config without model_type": config(lambda c: c.pop("model_type")),
    }


for _sharded in (False, True):
    register(Target(f"hf-{'sharded' if _sharded else 'single'}", lambda d, s=_sharded: _build_hf(d, s), _hf_sites,
                    _read_hf, "PretrainedDirectoryError", _hf_mutations()))


# ---- the example's --model_config ------------------------------------------------------------------------------------

def _json_structure(path: str) -> Tuple[Tuple[int, int], ...]:
    """Keys, quotes, colons, commas and braces: a value changed to another valid value cannot be detected (the file
    has no checksum), but a damaged key or structure must be."""
    text = open(path, "rb").read()
    ranges, position = [], 0
    while position < len(text):
        end = position + 1
        if text[position:position + 1] == b'"':
            end = text.index(b'"', position + 1) + 1
            if not text[end:].lstrip().startswith(b":"):  # a string value: not structure
                position = end
                continue
        elif text[position:position + 1] not in b"{}[],:":
            position = end
            continue
        ranges.append((position, end))
        position = end
    return tuple(ranges)


def _read_example_config(directory: str, worlds=None):
    import argparse

    sys.path.insert(0, EXAMPLE_DIR)
    import tp_dp_bert_large_hf_pretrain_hdf5 as example

    args = argparse.Namespace(model_config=os.path.join(directory, "config.json"), init_from=None, debug=False,
                              dropout=None)
    return example.load_config(args).to_dict()


register(Target(
    "example-config", lambda d: shutil.copy(os.path.join(EXAMPLE_DIR, "configs", "bert_mini", "config.json"), d),
    lambda d: [Site("config.json", _json_structure(os.path.join(d, "config.json")), data_checked=False)],
    _read_example_config, "PretrainedDirectoryError",
    {"misspelt key": lambda d: _edit_json(d, lambda c: c.update(hiden_size=c.pop("hidden_size"))),
     "value of the wrong type": lambda d: _edit_json(d, lambda c: c.update(num_hidden_layers=4.5)),
     "zero size": lambda d: _edit_json(d, lambda c: c.update(num_attention_heads=0)),
     "not an object": lambda d: _write(d, "[1, 2]")}))


def _edit_json(directory: str, edit) -> str:
    return _edit_json_file(os.path.join(directory, "config.json"), edit)


def _edit_json_file(path: str, edit) -> str:
    """Load the JSON file, let ``edit`` change the object in place, write it back; return the path."""
    with open(path) as f:
        raw = json.load(f)
    edit(raw)
    with open(path, "w") as f:
        json.dump(raw, f)
    return path


def _write(directory: str, text: str) -> str:
    path = os.path.join(directory, "config.json")
    with open(path, "w") as f:
        f.write(text)
    return path


# ---- nxdtp's own checkpoints (index, rank files, done): reshard reads and verifies every file of a tag ---------------

NXDTP_TAG = "step_000007"


def case_save_nxdtp_checkpoint(directory: str):
    """tp=2: a randomised BERT with AdamW state, saved as the training loop saves it."""
    from nxdtp.checkpointing import save
    from nxdtp.models import parallelize_model
    from nxdtp.random import model_parallel_xla_manual_seed
    from tests.model_helpers import randomised

    model_parallel_xla_manual_seed(5)  # dropout draws from the tracker's states, which the save stores too
    model = parallelize_model(randomised(_dense_bert(), 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.tensor([[1, 2, 3, 4]])
    model(input_ids=ids, labels=ids, next_sentence_label=torch.tensor([1])).loss.backward()
    optimizer.step()
    save({"model": model, "optimizer": optimizer, "global_step": 7}, os.path.join(directory, "ckpt"))
    return True


def _build_nxdtp(directory: str, worlds) -> None:
    assert worlds(2).run(case_save_nxdtp_checkpoint, tensor_model_parallel_size=2, directory=directory) == [True] * 2


def _nxdtp_sites(directory: str) -> List[Site]:
    tag = os.path.join(directory, "ckpt", NXDTP_TAG)
    sites = []
    for root, _, names in os.walk(tag):
        for name in sorted(names):
            path = os.path.join(root, name)
            hot = _safetensors_header(path) if name.endswith(".safetensors") else ((0, os.path.getsize(path)),)
            sites.append(Site(os.path.relpath(path, directory), hot))  # every byte is checksummed
    return sites


def _read_nxdtp(directory: str, worlds=None) -> Dict[str, Any]:
    """Reshard the named tag to tp=1 (it verifies every file of the tag first) and read what it wrote."""
    from safetensors.torch import load_file

    from nxdtp.checkpointing.merge import reshard

    out = os.path.join(directory, "merged")
    tag_dir = reshard(os.path.join(directory, "ckpt"), out, 1, tag=NXDTP_TAG, progress=False)
    return {name: load_file(os.path.join(tag_dir, name))
            for name in ("model/tp_rank_00.safetensors", "optim/tp_rank_00.safetensors")}


def _rewrite_nxdtp_model_file(directory: str, edit: Callable[[Dict[str, torch.Tensor]], None]) -> str:
    from safetensors.torch import load_file, save_file

    path = os.path.join(directory, "ckpt", NXDTP_TAG, "model", "tp_rank_01.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    return path


def _edit_nxdtp_index(directory: str, edit) -> str:
    return _edit_json_file(os.path.join(directory, "ckpt", NXDTP_TAG, "nxdtp_index.json"), edit)


register(Target(
    "nxdtp-checkpoint", _build_nxdtp, _nxdtp_sites, _read_nxdtp, "CheckpointIntegrityError",
    {"drop a tensor from a rank file": lambda d: _rewrite_nxdtp_model_file(d, lambda t: t.pop(QUERY)),
     "a rank file's tensor in another dtype": lambda d: _rewrite_nxdtp_model_file(
         d, lambda t: t.update({QUERY: t[QUERY].double()})),
     "a rank file's tensor in another shape": lambda d: _rewrite_nxdtp_model_file(
         d, lambda t: t.update({QUERY: t[QUERY][:-1]})),
     "index dtype changed": lambda d: _edit_nxdtp_index(d, lambda i: i["tensors"][QUERY].update(dtype="float16")),
     "index loses a tensor": lambda d: _edit_nxdtp_index(d, lambda i: i["tensors"].pop(QUERY))},
    build_needs_worlds=True))


# ---- the damage ------------------------------------------------------------------------------------------------------

def _flip(path: str, offsets: List[int], masks: List[int]) -> None:
    data = bytearray(open(path, "rb").read())
    for offset, mask in zip(offsets, masks):
        data[offset] ^= mask
    with open(path, "wb") as f:
        f.write(data)


def damage(draw, target: Target, sites: List[Site], directory: str) -> Tuple[str, str]:
    """Apply one drawn damage to ``directory``; return (its description, the file the error must name)."""
    kinds = (["flip", "flip"] if target.flips else []) + ["truncate"] + (["mutate"] if target.mutations else [])
    kind = draw(st.sampled_from(kinds), label="kind")
    if kind == "mutate":
        name = draw(st.sampled_from(sorted(target.mutations)), label="mutation")
        return f"mutation {name!r}", target.mutations[name](directory)
    site = draw(st.sampled_from(sites), label="file")
    path = os.path.join(directory, site.path)
    size = os.path.getsize(path)
    if kind == "truncate":
        length = draw(st.integers(0, size - 1), label="length")
        with open(path, "r+b") as f:
            f.truncate(length)
        return f"{site.path} truncated to {length} of {size} bytes", path
    offsets, masks = [], []
    for _ in range(draw(st.integers(1, 4), label="flips")):
        aimed = not site.data_checked or draw(st.booleans(), label="aimed at structure")
        if aimed:
            start, end = draw(st.sampled_from(site.hot), label="range")
            offsets.append(draw(st.integers(start, end - 1), label="offset"))
        else:
            offsets.append(draw(st.integers(0, size - 1), label="offset"))
        masks.append(draw(st.integers(1, 255), label="xor mask"))
    _flip(path, offsets, masks)
    return f"{site.path}: bytes {offsets} xor {masks}", path


@contextlib.contextmanager
def time_bound(seconds: int):
    """A reader that hangs (even inside C code) aborts the run with every thread's traceback."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


# ---- the tests -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def valid_inputs(tmp_path_factory, worlds):
    """target name -> (built directory, its damageable sites, the reader's result on it)."""
    built = {}
    for name, target in TARGETS.items():
        directory = str(tmp_path_factory.mktemp(name))
        target.build(directory, worlds) if target.build_needs_worlds else target.build(directory)
        built[name] = (directory, target.sites(directory), target.read(directory, worlds))
        shutil.rmtree(os.path.join(directory, "merged"), ignore_errors=True)
    return built


def check_case(target: Target, valid_inputs, worlds, draw) -> None:
    directory, sites, expected = valid_inputs[target.name]
    with tempfile.TemporaryDirectory() as scratch:
        copy = os.path.join(scratch, "input")
        shutil.copytree(directory, copy)
        what, file = damage(draw, target, sites, copy)
        with time_bound(CASE_TIME_LIMIT_S):
            try:
                result = target.read(copy, worlds)
            except Exception as error:  # noqa: BLE001 - judged below
                names = [type(error).__name__] + [c.__name__ for c in type(error).__mro__]
                assert target.error in names, f"{target.name}, {what}: raw {type(error).__name__}: {error}"
                # The message names the damaged file (or, for a file inside a directory, that directory).
                assert file in str(error) or os.path.dirname(file) in str(error), \
                    f"{target.name}, {what}: the error does not name {file}: {error}"
                return
        assert same(result, expected), f"{target.name}, {what}: loaded without an error, but the result differs"


def _per_target(total: int) -> int:
    return max(1, total // len(TARGETS))


FUZZ_SETTINGS = dict(derandomize=True, database=None, deadline=None, print_blob=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("name", sorted(TARGETS))
@settings(max_examples=_per_target(FAST_CASES), **FUZZ_SETTINGS)
@given(data=st.data())
def test_damaged_input_fails_clearly(name, valid_inputs, worlds, data):
    check_case(TARGETS[name], valid_inputs, worlds, data.draw)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TARGETS))
@settings(max_examples=_per_target(SLOW_CASES), **FUZZ_SETTINGS)
@given(data=st.data())
def test_damaged_input_fails_clearly_many(name, valid_inputs, worlds, data):
    check_case(TARGETS[name], valid_inputs, worlds, data.draw)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_mutation_is_an_error(name, valid_inputs, worlds):
    """Each structured damage of each target, once: always the named error (never a silently different result)."""
    target = TARGETS[name]
    directory, _, _ = valid_inputs[name]
    for mutation, apply in target.mutations.items():
        with tempfile.TemporaryDirectory() as scratch:
            copy = os.path.join(scratch, "input")
            shutil.copytree(directory, copy)
            file = apply(copy)
            with pytest.raises(Exception) as raised:
                target.read(copy, worlds)
            names = [c.__name__ for c in type(raised.value).__mro__]
            assert target.error in names, f"{name}, {mutation}: raw {type(raised.value).__name__}: {raised.value}"
            assert file in str(raised.value) or os.path.dirname(file) in str(raised.value), (name, mutation,
                                                                                              raised.value)


def test_nxd_flipped_tensor_data_is_caught_by_the_zip_crc(valid_inputs, tmp_path):
    """torch.load does not check the CRCs torch.save records, so without the check a flipped data byte would load
    as a wrong weight; with it, the merge names the file and the entry."""
    from nxdtp.converters.nxd import NxdCheckpointError, merge_nxd_checkpoint

    directory = str(tmp_path / "input")
    shutil.copytree(valid_inputs["nxd-pt"][0], directory)
    path = os.path.join(directory, _nxd_file(0, False))  # rank 0: its copies of replicated tensors are the ones used
    weight = _nxd_states(_dense_bert())[0]["bert.pooler.dense.weight"].numpy().tobytes()
    offset = open(path, "rb").read().index(weight)
    _flip(path, [offset + 2], [0x40])
    args = (os.path.join(directory, "ckpt"), os.path.join(directory, "config.json"))
    with pytest.raises(NxdCheckpointError, match=rf"{path}: a tensor storage of \d+ bytes fails its CRC-32 check"):
        merge_nxd_checkpoint(*args, str(tmp_path / "out"), progress=False)
    # The check is what catches it: without it the merge "succeeds" with a changed tensor.
    merge_nxd_checkpoint(*args, str(tmp_path / "unchecked"), progress=False, verify_checksums=False)
    from safetensors.torch import load_file

    assert not same(load_file(str(tmp_path / "unchecked" / "model.safetensors")), valid_inputs["nxd-pt"][2])


def test_example_refuses_a_bad_model_config_in_one_line(tmp_path, capsys):
    sys.path.insert(0, EXAMPLE_DIR)
    import tp_dp_bert_large_hf_pretrain_hdf5 as example

    path = tmp_path / "config.json"
    path.write_text('{"hidden_size": 16,')
    with pytest.raises(SystemExit) as exit_:
        example.parse_args(["--model_config", str(path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {path}: not valid JSON" in err and "Traceback" not in err


def test_every_damaged_input_error_is_one_base_class_and_still_a_value_error():
    """One base class for damaged-input errors (``nxdtp.errors.DamagedInputError``); each reader's named error stays
    importable where it was and catchable as the ValueError it always was."""
    from nxdtp.checkpointing import CheckpointIntegrityError
    from nxdtp.converters.nxd import NxdCheckpointError
    from nxdtp.errors import DamagedInputError
    from nxdtp.models.hf_loading import PretrainedDirectoryError

    for error in (CheckpointIntegrityError, PretrainedDirectoryError, NxdCheckpointError):
        assert issubclass(error, DamagedInputError) and issubclass(error, ValueError), error
        with pytest.raises(DamagedInputError, match="damaged.bin"):
            raise error("damaged.bin: truncated")

"""merge_nxd_checkpoint: an NxD BERT checkpoint (plain and xser forms, tp=2 and tp=4) merges into a dense HF directory
whose model equals the original; bad inputs fail with errors that name the file, and leave the output as it was.

The fixtures are written the way NxD writes them, sliced here independently of the module's plan: NxD's BERT example
shards attention only (Q/K/V weight and bias along dim 0, attention output weight along dim 1), and
``parallel_layers.checkpointing.save`` writes ``torch.save({"model": ..., "optimizer": ..., ...})`` to
``tp_rank_XX_pp_rank_00/checkpoint.pt``, or with ``save_xser=True`` hands the dict to
``torch_xla.utils.serialization.save`` at ``tp_rank_XX_pp_rank_00`` (tensors under ``tp_rank_XX_pp_rank_00.tensors``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections import OrderedDict

import pytest
import torch

from tests.nxd_xser import xser_save

VOCAB = 53
ATTENTION_ROWS = (".attention.self.query.weight", ".attention.self.query.bias", ".attention.self.key.weight",
                  ".attention.self.key.bias", ".attention.self.value.weight", ".attention.self.value.bias")
ATTENTION_COLUMNS = (".attention.output.dense.weight",)


def _config(**overrides):
    from transformers import BertConfig

    kwargs = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
                  max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    kwargs.update(overrides)
    return BertConfig(**kwargs)


@pytest.fixture(scope="module")
def dense():
    from transformers import BertForPreTraining

    torch.manual_seed(0)
    model = BertForPreTraining(_config())
    with torch.no_grad():
        for p in model.parameters():  # HF starts biases at 0 and LayerNorms at 1: that would hide bugs
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def _write_config(directory, config=None) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "config.json")
    with open(path, "w") as f:
        json.dump((config or _config()).to_dict(), f)
    return path


def _nxd_state_dicts(model, tp):
    """What each TP rank's ``model.state_dict()`` holds in NxD's BERT example (transformers 4.26: with position_ids;
    the decoder weight and bias share storage with the embedding and the MLM bias)."""
    full = model.state_dict()
    ranks = []
    for rank in range(tp):
        state, by_storage = OrderedDict(), {}
        for key, value in full.items():
            if key.endswith(ATTENTION_ROWS):
                state[key] = value.chunk(tp, dim=0)[rank].clone()
            elif key.endswith(ATTENTION_COLUMNS):
                state[key] = value.chunk(tp, dim=1)[rank].clone()
            else:
                pointer = value.data_ptr()
                if pointer not in by_storage:
                    by_storage[pointer] = value.clone()
                state[key] = by_storage[pointer]  # tied tensors stay one tensor, as in the live model
        state["bert.embeddings.position_ids"] = torch.arange(16).unsqueeze(0)
        ranks.append(state)
    return ranks


def _training_extras(state):
    """Optimizer and scheduler state as in NxD's example checkpoint dict."""
    names = [n for n in state if state[n].is_floating_point()][:3]   # not transformers 4.26's position_ids
    return {
        "optimizer": {"state": {i: {"step": torch.tensor(3.0), "exp_avg": torch.randn_like(state[n]),
                                    "exp_avg_sq": torch.rand_like(state[n])} for i, n in enumerate(names)},
                      "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.01,
                                        "params": list(range(len(names)))}]},
        "scheduler": {"base_lrs": [1e-4], "last_epoch": 3, "_step_count": 4, "lr_lambdas": [None]},
        "global_step": 3,
        "epoch": 1,
    }


def _save_plain(model, root, tp, skip=()):
    for rank, state in enumerate(_nxd_state_dicts(model, tp)):
        if rank in skip:
            continue
        directory = os.path.join(root, f"tp_rank_{rank:02d}_pp_rank_00")
        os.makedirs(directory)
        torch.save({"model": state, **_training_extras(state)}, os.path.join(directory, "checkpoint.pt"))
    return root


def _save_xser(model, root, tp, in_directory=False):
    os.makedirs(root, exist_ok=True)
    for rank, state in enumerate(_nxd_state_dicts(model, tp)):
        path = os.path.join(root, f"tp_rank_{rank:02d}_pp_rank_00")
        if in_directory:
            os.makedirs(path)
            path = os.path.join(path, "checkpoint.pt")
        xser_save({"model": state, **_training_extras(state)}, path)
    return root


# ---- checks ----------------------------------------------------------------------------------------------------------

def _assert_equals_dense(output_dir, dense):
    from transformers import BertForPreTraining

    loaded = BertForPreTraining.from_pretrained(output_dir).eval()
    expected = dense.state_dict()
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    types_ = torch.randint(0, 2, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out, ref = loaded(ids, token_type_ids=types_), dense(ids, token_type_ids=types_)
    torch.testing.assert_close(out.prediction_logits, ref.prediction_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.seq_relationship_logits, ref.seq_relationship_logits, rtol=1e-5, atol=1e-5)


def _snapshot(directory):
    """Every path under ``directory`` with its bytes: to prove an error left it as it was."""
    if not os.path.exists(directory):
        return None
    result = {}
    for base, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                result[os.path.relpath(path, directory)] = f.read()
    return result


def _no_leftovers(parent, allowed):
    assert sorted(os.listdir(parent)) == sorted(allowed), "temporary files left behind"


# ---- tests -----------------------------------------------------------------------------------------------------------

def test_plan_is_nxd_attention_only():
    from nxdtp.converters.nxd.bert import NXD_ATTENTION_ONLY_PLAN, nxd_partition_dim

    assert isinstance(NXD_ATTENTION_ONLY_PLAN, dict)
    layer = "bert.encoder.layer.11."
    for suffix in ATTENTION_ROWS:
        assert nxd_partition_dim(layer + suffix[1:]) == 0, suffix
    assert nxd_partition_dim(layer + "attention.output.dense.weight") == 1
    for replicated in ("attention.output.dense.bias", "intermediate.dense.weight", "output.dense.weight",
                       "output.dense.bias", "attention.output.LayerNorm.weight"):
        assert nxd_partition_dim(layer + replicated) is None, replicated
    for replicated in ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight",
                       "cls.predictions.bias", "bert.pooler.dense.weight"):
        assert nxd_partition_dim(replicated) is None, replicated


@pytest.mark.parametrize("tp", [2, 4])
def test_plain_checkpoint_merges_to_dense(tmp_path, dense, tp):
    from safetensors import safe_open

    from nxdtp.converters.nxd.bert import merge_nxd_checkpoint

    checkpoint = _save_plain(dense, str(tmp_path / "ckpt"), tp)
    config = _write_config(str(tmp_path / "cfg"))
    out = str(tmp_path / "out")
    assert merge_nxd_checkpoint(checkpoint, config, out, progress=False) == out
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.metadata()["format"] == "pt"
    # as HF's save_pretrained: tied aliases once, no position_ids buffer
    assert "cls.predictions.decoder.weight" not in keys and "bert.embeddings.position_ids" not in keys
    assert "bert.embeddings.word_embeddings.weight" in keys
    _assert_equals_dense(out, dense)
    _no_leftovers(str(tmp_path), ["ckpt", "cfg", "out"])


@pytest.mark.parametrize("in_directory", [False, True], ids=["nxd-file", "checkpoint.pt-in-dir"])
def test_xser_checkpoint_merges_to_dense(tmp_path, dense, in_directory):
    from nxdtp.converters.nxd.bert import merge_nxd_checkpoint

    checkpoint = _save_xser(dense, str(tmp_path / "ckpt"), 2, in_directory=in_directory)
    entries = sorted(os.listdir(checkpoint))
    if in_directory:
        assert entries == ["tp_rank_00_pp_rank_00", "tp_rank_01_pp_rank_00"]
        assert os.path.isdir(os.path.join(checkpoint, entries[0], "checkpoint.pt.tensors"))
    else:
        assert entries == ["tp_rank_00_pp_rank_00", "tp_rank_00_pp_rank_00.tensors",
                           "tp_rank_01_pp_rank_00", "tp_rank_01_pp_rank_00.tensors"]
    out = str(tmp_path / "out")
    merge_nxd_checkpoint(checkpoint, _write_config(str(tmp_path / "cfg")), out, progress=False)
    _assert_equals_dense(out, dense)


def case_write_with_torch_xla(shard_files):
    """Runs in the XLA:CPU worker: each rank's dict, its tensors moved to the XLA device, through xser.save."""
    import torch_xla.core.xla_model as xm
    import torch_xla.utils.serialization as xser

    device = xm.xla_device()
    for source, target in shard_files:
        data = torch.load(source, weights_only=True)
        tensors = {}

        def to_xla(t):  # keep ties: one XLA tensor per CPU tensor
            if id(t) not in tensors:
                tensors[id(t)] = t.to(device)
            return tensors[id(t)]

        data["model"] = {k: to_xla(v) for k, v in data["model"].items()}
        os.makedirs(os.path.dirname(target), exist_ok=True)
        xser.save(data, target, master_only=False)
    return sorted(os.listdir(os.path.dirname(target)))


@pytest.mark.xla
def test_xser_written_by_torch_xla_merges_to_dense(tmp_path, dense, worlds):
    pytest.importorskip("torch_xla")
    from nxdtp.converters.nxd.bert import merge_nxd_checkpoint

    plain = _save_plain(dense, str(tmp_path / "plain"), 2)
    checkpoint = tmp_path / "xser"
    files = [(os.path.join(plain, f"tp_rank_{r:02d}_pp_rank_00", "checkpoint.pt"),
              str(checkpoint / f"tp_rank_{r:02d}_pp_rank_00")) for r in range(2)]
    listing, = worlds(1, "xla-exec").run(case_write_with_torch_xla, tensor_model_parallel_size=1, shard_files=files)
    assert listing == ["tp_rank_00_pp_rank_00", "tp_rank_00_pp_rank_00.tensors",
                       "tp_rank_01_pp_rank_00", "tp_rank_01_pp_rank_00.tensors"]
    out = str(tmp_path / "out")
    merge_nxd_checkpoint(str(checkpoint), _write_config(str(tmp_path / "cfg")), out, progress=False)
    _assert_equals_dense(out, dense)


def test_output_exists_needs_force(tmp_path, dense):
    from nxdtp.converters.nxd.bert import merge_nxd_checkpoint

    checkpoint = _save_plain(dense, str(tmp_path / "ckpt"), 2)
    config = _write_config(str(tmp_path / "cfg"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    before = _snapshot(str(out))
    with pytest.raises(FileExistsError, match="not empty.*force"):
        merge_nxd_checkpoint(checkpoint, config, str(out), progress=False)
    assert _snapshot(str(out)) == before
    merge_nxd_checkpoint(checkpoint, config, str(out), force=True, progress=False)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    _assert_equals_dense(str(out), dense)
    _no_leftovers(str(tmp_path), ["ckpt", "cfg", "out"])
    # An empty output directory is fine without force.
    empty = tmp_path / "empty"
    empty.mkdir()
    merge_nxd_checkpoint(checkpoint, config, str(empty), progress=False)
    with pytest.raises(ValueError, match="contains the input checkpoint directory"):
        merge_nxd_checkpoint(checkpoint, config, str(tmp_path), force=True, progress=False)


class _Payload:
    """An arbitrary object in a checkpoint: weights_only must refuse it, and never run its code."""

    ran = False

    def __setstate__(self, state):
        type(self).ran = True
        self.__dict__.update(state)


def _bad_checkpoints(tmp_path, dense):
    """name -> (checkpoint dir, config path, expected error type, regex the message must match)."""
    cases = {}
    config = _write_config(str(tmp_path / "cfg"))

    root = _save_plain(dense, str(tmp_path / "missing-rank"), 4, skip=(1,))
    cases["missing rank dir"] = (root, config, FileNotFoundError, r"tp_rank_01_pp_rank_00 is missing")

    root = _save_plain(dense, str(tmp_path / "missing-last-rank"), 4, skip=(3,))
    cases["missing last rank"] = (root, config, FileNotFoundError, r"tp=4.*tp_rank_03_pp_rank_00")

    root = _save_plain(dense, str(tmp_path / "empty-rank-dir"), 2)
    os.remove(os.path.join(root, "tp_rank_01_pp_rank_00", "checkpoint.pt"))
    cases["rank dir without checkpoint.pt"] = (root, config, FileNotFoundError,
                                               r"tp_rank_01_pp_rank_00/checkpoint.pt is missing")

    root = _save_plain(dense, str(tmp_path / "pickle"), 2)
    path = os.path.join(root, "tp_rank_01_pp_rank_00", "checkpoint.pt")
    data = torch.load(path, weights_only=True)
    payload = _Payload()
    payload.note = "not a tensor"
    data["optimizer"]["extra"] = payload
    torch.save(data, path)
    cases["disallowed global"] = (root, config, ValueError, r"(?s)pickle/tp_rank_01_pp_rank_00/checkpoint.pt: "
                                                            r"refused .*weights_only=True.*_Payload")

    root = _save_plain(dense, str(tmp_path / "config-mismatch"), 2)
    cases["shape vs config"] = (root, _write_config(str(tmp_path / "cfg-big"), _config(intermediate_size=64)),
                                ValueError, r"tp_rank_00_pp_rank_00/checkpoint.pt: 'bert.encoder.layer.0.intermediate"
                                            r"\.dense\.bias' has shape \[32\], but the config needs \[64\]")

    root = _save_plain(dense, str(tmp_path / "bad-slice"), 2)
    path = os.path.join(root, "tp_rank_01_pp_rank_00", "checkpoint.pt")
    data = torch.load(path, weights_only=True)
    key = "bert.encoder.layer.1.attention.self.key.weight"
    data["model"][key] = data["model"][key][:, :12].clone()
    torch.save(data, path)
    cases["slice shape"] = (root, config, ValueError,
                            r"tp_rank_01_pp_rank_00/checkpoint.pt: 'bert.encoder.layer.1.attention.self.key.weight' "
                            r"has shape \[8, 12\], but the config needs \[8, 16\] \(its 1/2 slice along dim 0")

    root = _save_plain(dense, str(tmp_path / "missing-key"), 2)
    for rank in range(2):
        path = os.path.join(root, f"tp_rank_{rank:02d}_pp_rank_00", "checkpoint.pt")
        data = torch.load(path, weights_only=True)
        del data["model"]["cls.seq_relationship.bias"]
        torch.save(data, path)
    cases["missing key"] = (root, config, ValueError, r"'cls.seq_relationship.bias' .* is missing")

    root = _save_plain(dense, str(tmp_path / "pipeline"), 2)
    shutil.copytree(os.path.join(root, "tp_rank_00_pp_rank_00"), os.path.join(root, "tp_rank_00_pp_rank_01"))
    cases["pipeline parallel"] = (root, config, ValueError, r"pipeline-parallel.*tp_rank_00_pp_rank_01")

    root = _save_xser(dense, str(tmp_path / "xser-missing-tensor"), 2)
    os.remove(os.path.join(root, "tp_rank_01_pp_rank_00.tensors", "tensor_5.pt"))
    cases["xser tensor file"] = (root, config, FileNotFoundError,
                                 r"tp_rank_01_pp_rank_00.tensors/tensor_5.pt is missing")

    root = _save_plain(dense, str(tmp_path / "untied"), 2)
    for rank in range(2):
        path = os.path.join(root, f"tp_rank_{rank:02d}_pp_rank_00", "checkpoint.pt")
        data = torch.load(path, weights_only=True)
        data["model"]["cls.predictions.decoder.weight"] = data["model"]["cls.predictions.decoder.weight"] + 1
        torch.save(data, path)
    cases["tied pair differs"] = (root, config, ValueError, r"'cls.predictions.decoder.weight' differs.*tie_word")
    return cases


def test_bad_inputs_fail_clearly_and_leave_output_untouched(tmp_path, dense):
    from nxdtp.converters.nxd.bert import merge_nxd_checkpoint

    cases = _bad_checkpoints(tmp_path, dense)
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    for name, (checkpoint, config, error, message) in cases.items():
        fresh = outputs / (name.replace(" ", "-") + "-fresh")
        with pytest.raises(error, match=message):
            merge_nxd_checkpoint(checkpoint, config, str(fresh), progress=False)
        assert not fresh.exists(), name
        # With force over an existing output: the error leaves the old contents in place.
        existing = outputs / (name.replace(" ", "-") + "-existing")
        existing.mkdir()
        (existing / "old.txt").write_text("old")
        with pytest.raises(error, match=message):
            merge_nxd_checkpoint(checkpoint, config, str(existing), force=True, progress=False)
        assert _snapshot(str(existing)) == {"old.txt": b"old"}, name
    assert not _Payload.ran, "the refused pickle ran code"
    _no_leftovers(str(outputs), [p.name for p in outputs.iterdir() if not p.name.startswith(".")])
    assert not [p for p in outputs.iterdir() if p.name.startswith(".")]

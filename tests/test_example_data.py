"""The BERT example's pretraining data: the shard builder (synthetic and text) and the per-rank reader."""

import json
import math
import os
import random
import sys
from collections import Counter

import h5py
import numpy as np
import pytest
import torch

from nxdtp.errors import DamagedInputError

EXAMPLE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "tp_dp_bert")
sys.path.insert(0, EXAMPLE_DIR)

import build_pretraining_data as builder  # noqa: E402
import pretraining_data as data  # noqa: E402

PAD, UNK, CLS, SEP, MASK = 0, 100, 101, 102, 103  # synthetic data uses BERT-uncased ids
SPECIAL = (PAD, UNK, CLS, SEP, MASK)


def load_dir(directory):
    """All shards of a directory concatenated in file order, as numpy arrays."""
    files = sorted(f for f in os.listdir(directory) if f.endswith(".hdf5"))
    parts = []
    for name in files:
        with h5py.File(os.path.join(directory, name), "r") as f:
            parts.append({k: f[k][()] for k in data.KEYS})
    return {k: np.concatenate([p[k] for p in parts]) for k in data.KEYS}


def original_tokens(arrays):
    """input_ids with the masked positions restored from masked_lm_ids (0 in positions pads the list)."""
    tokens = arrays["input_ids"].astype(np.int64).copy()
    for row, (positions, ids) in enumerate(zip(arrays["masked_lm_positions"], arrays["masked_lm_ids"])):
        n = int((positions > 0).sum())
        tokens[row, positions[:n]] = ids[:n]
    return tokens


def synthetic(directory, *extra):
    builder.main(["--output_dir", str(directory), "--synthetic", *extra])
    return load_dir(directory)


@pytest.fixture(scope="module")
def synthetic_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("synthetic")
    builder.main(["--output_dir", str(directory), "--synthetic", "--seed", "7"])  # 2048 x 128, as the defaults
    return directory


# ---------------------------------------------------------------------------------------------------------------------
# Synthetic build


def test_synthetic_files_shapes_and_dtypes(synthetic_dir, capsys):
    assert sorted(os.listdir(synthetic_dir)) == ["data_info.json", "synthetic_training_0.hdf5",
                                                 "synthetic_training_1.hdf5", "vocab.txt"]
    expected = {"input_ids": (np.int32, (1024, 128)), "input_mask": (np.int8, (1024, 128)),
                "segment_ids": (np.int8, (1024, 128)), "masked_lm_positions": (np.int32, (1024, 20)),
                "masked_lm_ids": (np.int32, (1024, 20)), "next_sentence_labels": (np.int8, (1024,))}
    for i in range(2):
        with h5py.File(synthetic_dir / f"synthetic_training_{i}.hdf5", "r") as f:
            assert sorted(f.keys()) == sorted(expected)
            for key, (dtype, shape) in expected.items():
                assert (f[key].dtype, f[key].shape) == (dtype, shape), key

    info = json.loads((synthetic_dir / "data_info.json").read_text())
    assert info["mode"] == "synthetic" and info["seed"] == 7
    assert (info["vocab_size"], info["seq_len"], info["max_pred_len"]) == (30522, 128, 20)
    assert info["sequences_per_shard"] == [1024, 1024] and info["num_sequences"] == 2048
    assert info["special_token_ids"] == {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}
    vocab = (synthetic_dir / "vocab.txt").read_text().splitlines()
    assert len(vocab) == 30522 and vocab[5] == "tok5" and vocab[30521] == "tok30521"
    assert [vocab[i] for i in SPECIAL] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def test_synthetic_layout_and_special_tokens(synthetic_dir):
    a = load_dir(synthetic_dir)
    tokens, mask, segments = original_tokens(a), a["input_mask"], a["segment_ids"]
    rows, seq = tokens.shape
    n_real = mask.sum(axis=1)
    pos = np.arange(seq)[None, :]
    assert (mask == (pos < n_real[:, None])).all(), "input_mask must be ones on a prefix"
    assert (n_real < seq).sum() > 0.05 * rows, "some sequences should be short (padding must be exercised)"
    assert (n_real >= 5).all()

    is_sep = tokens == SEP
    assert (is_sep.sum(axis=1) == 2).all() and (tokens[:, 0] == CLS).all() and ((tokens == CLS).sum(axis=1) == 1).all()
    first_sep = np.argmax(is_sep, axis=1)
    assert (tokens[np.arange(rows), n_real - 1] == SEP).all()
    assert (first_sep >= 2).all() and (first_sep <= n_real - 3).all(), "A and B must both be non-empty"
    # Segment 0: [CLS] A [SEP]; segment 1: B [SEP]; padding 0.
    expected_segments = (pos > first_sep[:, None]) & (pos < n_real[:, None])
    assert (segments == expected_segments).all()
    assert (tokens[mask == 0] == PAD).all()
    body = (mask == 1) & (pos > 0) & ~is_sep
    assert not np.isin(tokens[body], SPECIAL).any(), "only [CLS] and [SEP] may be special in the original text"


def test_synthetic_masking_statistics(synthetic_dir):
    a = load_dir(synthetic_dir)
    tokens, corrupted = original_tokens(a), a["input_ids"]
    positions, lm_ids = a["masked_lm_positions"], a["masked_lm_ids"]
    n_real = a["input_mask"].sum(axis=1)

    # Per row: exactly round(0.15 * real tokens) positions, ascending, padded with 0, on non-special tokens.
    n_masked = (positions > 0).sum(axis=1)
    assert (n_masked == [min(20, max(1, round(0.15 * n))) for n in n_real]).all()
    for row in range(len(tokens)):
        p = positions[row, :n_masked[row]]
        assert (np.diff(p) > 0).all() and (positions[row, n_masked[row]:] == 0).all()
        assert (lm_ids[row, n_masked[row]:] == 0).all()
    chosen = np.zeros(tokens.shape, dtype=bool)
    for row in range(len(tokens)):
        chosen[row, positions[row, :n_masked[row]]] = True
    assert not np.isin(tokens[chosen], SPECIAL).any()
    assert (corrupted[~chosen] == tokens[~chosen]).all(), "only chosen positions may change"

    # About 2048 * 19 = 39k chosen positions: the binomial standard deviation of a share near 0.1 is 0.0015 and near
    # 0.8 is 0.002, so +-0.01 is 5 sigma or more. The data is fixed by the seed, so this never flakes; it fails when
    # the 80/10/10 rule is broken.
    candidates = (a["input_mask"] == 1) & ~np.isin(tokens, SPECIAL)
    assert chosen.sum() / candidates.sum() == pytest.approx(0.15, abs=0.01)
    total = chosen.sum()
    assert total > 35000
    as_mask = corrupted[chosen] == MASK
    unchanged = corrupted[chosen] == tokens[chosen]
    replaced = ~as_mask & ~unchanged
    assert as_mask.mean() == pytest.approx(0.8, abs=0.01)
    assert replaced.mean() == pytest.approx(0.1, abs=0.01)
    assert unchanged.mean() == pytest.approx(0.1, abs=0.01)
    assert not np.isin(corrupted[chosen][replaced], SPECIAL).any(), "random replacements must be ordinary tokens"

    # 2048 labels: standard deviation 0.011, so +-0.05 is 4.5 sigma.
    nsp = a["next_sentence_labels"]
    assert set(np.unique(nsp)) == {0, 1}
    assert nsp.mean() == pytest.approx(0.5, abs=0.05)


def next_token_entropy(tokens):
    """Empirical entropy (nats) of a token given the one before it, over pairs of ordinary tokens."""
    left, right = tokens[:, 1:-1].ravel(), tokens[:, 2:].ravel()
    keep = ~np.isin(left, SPECIAL) & ~np.isin(right, SPECIAL)
    bigrams = Counter(zip(left[keep].tolist(), right[keep].tolist()))
    firsts = Counter(left[keep].tolist())
    return -sum(c * math.log(c / firsts[x]) for (x, _), c in bigrams.items()) / keep.sum()


def test_synthetic_corpus_has_learnable_structure(synthetic_dir):
    """Tokens are far from uniform and the previous token predicts the next: what makes the MLM loss fall fast."""
    tokens = original_tokens(load_dir(synthetic_dir))
    ordinary = ~np.isin(tokens, SPECIAL)
    p = np.unique(tokens[ordinary], return_counts=True)[1] / ordinary.sum()
    assert -(p * np.log(p)).sum() < 0.8 * math.log(30522)  # uniform tokens would give about log(30522)

    # The same tokens in random order are the baseline: the plug-in estimate is biased low for sparse counts, and
    # shuffling keeps that bias while destroying the order (here about 1.5 against 4.6 nats).
    shuffled = tokens.copy()
    shuffled[ordinary] = np.random.default_rng(0).permutation(tokens[ordinary])
    assert next_token_entropy(tokens) < next_token_entropy(shuffled) - 2.0


def test_synthetic_is_deterministic_per_seed(tmp_path):
    args = ["--num_sequences", "256", "--vocab_size", "500", "--seq_len", "32", "--num_shards", "1"]
    first = synthetic(tmp_path / "a", "--seed", "1", *args)
    again = synthetic(tmp_path / "b", "--seed", "1", *args)
    other = synthetic(tmp_path / "c", "--seed", "2", *args)
    for key in data.KEYS:
        assert np.array_equal(first[key], again[key]), key
    assert not np.array_equal(first["input_ids"], other["input_ids"])
    assert not np.array_equal(first["masked_lm_positions"], other["masked_lm_positions"])
    assert first["input_ids"].max() < 500


def test_synthetic_build_prints_progress(tmp_path, capsys):
    synthetic(tmp_path, "--num_sequences", "64", "--num_shards", "3", "--vocab_size", "300")
    out = capsys.readouterr().out
    for i, n in enumerate([22, 21, 21]):
        assert f"wrote {tmp_path}/synthetic_training_{i}.hdf5: {n} sequences" in out
    assert "built 64 sequences" in out


# ---------------------------------------------------------------------------------------------------------------------
# Text build


def write_corpus(path, seed=0, documents=40):
    """Made-up sentences of made-up words, one per line, a blank line between documents."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ren", "tu", "sha", "vel", "or", "qui", "zan", "pe", "dor", "fi", "gla", "nu"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(150)]
    lines = []
    for _ in range(documents):
        for _ in range(rng.randint(3, 12)):
            lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 14))).capitalize() + ".")
        lines.append("")
    path.write_text("\n".join(lines))
    return lines


def document_streams(lines, tokenizer):
    """Per document, the comma-joined token ids of its sentences in order (for contiguous-run searches)."""
    streams, current = [], []
    for line in lines + [""]:
        if line:
            current.extend(tokenizer.encode(line, add_special_tokens=False).ids)
        elif current:
            streams.append("," + ",".join(map(str, current)) + ",")
            current = []
    return streams


def as_key(ids):
    return "," + ",".join(map(str, ids)) + ","


def test_text_build_round_trip(tmp_path, capsys):
    from tokenizers import BertWordPieceTokenizer

    corpus = tmp_path / "corpus.txt"
    lines = write_corpus(corpus)
    out = tmp_path / "out"
    builder.main(["--output_dir", str(out), "--input_files", str(corpus), "--vocab_size", "200", "--seq_len", "32",
                  "--max_pred_len", "6", "--num_shards", "2", "--seed", "3", "--dupe_factor", "2"])
    assert "wrote" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["data_info.json", "vocab.txt", "wikicorpus_en_training_0.hdf5",
                                       "wikicorpus_en_training_1.hdf5"]
    info = json.loads((out / "data_info.json").read_text())
    special = info["special_token_ids"]
    vocab = (out / "vocab.txt").read_text().splitlines()
    assert info["vocab_size"] == len(vocab) and len(vocab) <= 200 and info["mode"] == "text"
    assert all(vocab[i] == token for token, i in special.items())
    assert any(token.startswith("##") for token in vocab), "the vocab should split words into pieces"

    a = load_dir(out)
    assert len(a["input_ids"]) == info["num_sequences"] == sum(info["sequences_per_shard"]) > 50
    tokenizer = BertWordPieceTokenizer(str(out / "vocab.txt"), lowercase=True)
    streams = document_streams(lines, tokenizer)
    tokens = original_tokens(a)
    words = {w.strip(".").lower() for line in lines for w in line.split()}
    for row in range(len(tokens)):
        n_real = int(a["input_mask"][row].sum())
        seps = np.flatnonzero(tokens[row, :n_real] == special["[SEP]"])
        assert tokens[row, 0] == special["[CLS]"] and len(seps) == 2 and seps[1] == n_real - 1
        seg_a, seg_b = tokens[row, 1:seps[0]].tolist(), tokens[row, seps[0] + 1:seps[1]].tolist()
        assert seg_a and seg_b
        # The unmasked tokens and the restored masked ones are runs of the text's own tokens.
        assert any(as_key(seg_a) in s for s in streams), f"row {row}: A is not a run of any document"
        assert any(as_key(seg_b) in s for s in streams), f"row {row}: B is not a run of any document"
        if a["next_sentence_labels"][row] == 0:
            assert any(as_key(seg_a + seg_b) in s for s in streams), f"row {row}: label 0 but B does not follow A"
        for segment in (seg_a, seg_b):  # whole words inside a segment decode to words of the text
            inner = tokenizer.decode(segment).replace(".", " ").split()[1:-1]
            assert set(inner) <= words, (row, inner)
    assert 0.3 < a["next_sentence_labels"].mean() < 0.7
    assert (a["input_ids"] == special["[MASK]"]).sum() > 0

    # The written vocab can be given back with --vocab_file and gives the same vocab.
    again = tmp_path / "again"
    builder.main(["--output_dir", str(again), "--input_files", str(corpus), "--vocab_file", str(out / "vocab.txt"),
                  "--seq_len", "32", "--max_pred_len", "6", "--num_shards", "1", "--seed", "3"])
    assert (again / "vocab.txt").read_text() == (out / "vocab.txt").read_text()
    assert load_dir(again)["input_ids"].max() < len(vocab)


# ---------------------------------------------------------------------------------------------------------------------
# Builder refusals


@pytest.mark.parametrize("args, message", [
    (["--synthetic", "--seq_len", "7"], "--seq_len must be at least 8"),
    (["--synthetic", "--num_shards", "0"], "--num_shards must be at least 1"),
    (["--synthetic", "--masked_lm_prob", "0"], "--masked_lm_prob must lie strictly between 0 and 1"),
    (["--synthetic", "--masked_lm_prob", "1.0"], "--masked_lm_prob must lie strictly between 0 and 1"),
    (["--input_files", "/nonexistent/corpus.txt"], "input file /nonexistent/corpus.txt does not exist"),
    (["--synthetic", "--vocab_file", "v.txt"], "--vocab_file"),
    ([], "one of the arguments --synthetic --input_files is required"),
])
def test_builder_refuses_bad_arguments(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        builder.main(["--output_dir", str(tmp_path / "out"), *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_builder_refuses_existing_shards_unless_forced(tmp_path, capsys):
    small = ["--num_sequences", "32", "--vocab_size", "200", "--seq_len", "16"]
    synthetic(tmp_path, "--num_shards", "3", *small)
    (tmp_path / "notes.txt").write_text("kept")
    with pytest.raises(SystemExit) as exit_info:
        synthetic(tmp_path, *small)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "already holds 3 training shard(s)" in err and "--force" in err

    synthetic(tmp_path, "--force", "--num_shards", "2", *small)
    # The third shard of the earlier build is gone: it would otherwise be read as part of the new data.
    assert sorted(os.listdir(tmp_path)) == ["data_info.json", "notes.txt", "synthetic_training_0.hdf5",
                                            "synthetic_training_1.hdf5", "vocab.txt"]


# ---------------------------------------------------------------------------------------------------------------------
# Reader: one shard


def write_shard(path, rows=4, seq=8, pred=3, drop=(), **override):
    """A valid shard whose row r has input_ids [CLS, r + 10, ...]; ``override`` replaces whole datasets."""
    ids = np.full((rows, seq), 5, dtype=np.int32)
    ids[:, 0] = 1
    ids[:, 1] = np.arange(rows) + 10
    arrays = {
        "input_ids": ids,
        "input_mask": np.ones((rows, seq), dtype=np.int8),
        "segment_ids": np.zeros((rows, seq), dtype=np.int8),
        "masked_lm_positions": np.tile(np.arange(2, 2 + pred, dtype=np.int32), (rows, 1)),
        "masked_lm_ids": np.full((rows, pred), 7, dtype=np.int32),
        "next_sentence_labels": (np.arange(rows) % 2).astype(np.int8),
    }
    arrays.update(override)
    with h5py.File(path, "w") as f:
        for key, value in arrays.items():
            if key not in drop:
                f.create_dataset(key, data=value)
    return str(path)


def test_shard_items_and_masked_lm_labels(tmp_path):
    path = write_shard(tmp_path / "x_training_0.hdf5", rows=2, pred=4,
                       input_ids=np.array([[101, 11, 103, 13, 103, 15, 102, 0],
                                           [101, 21, 22, 103, 24, 25, 26, 102]], dtype=np.int32),
                       input_mask=np.array([[1, 1, 1, 1, 1, 1, 1, 0], [1] * 8], dtype=np.int8),
                       segment_ids=np.array([[0, 0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 1, 1, 1]], dtype=np.int8),
                       masked_lm_positions=np.array([[2, 4, 0, 0], [1, 3, 5, 6]], dtype=np.int32),
                       masked_lm_ids=np.array([[12, 14, 0, 0], [21, 23, 25, 26]], dtype=np.int32),
                       next_sentence_labels=np.array([[1], [0]], dtype=np.int8))  # [N, 1] is accepted
    shard = data.PretrainingShard(path, max_pred_len=4, seq_len=8, vocab_size=200)
    assert len(shard) == 2 and shard.sequence_length == 8

    input_ids, segment_ids, input_mask, labels, nsp = shard[0]
    assert all(t.dtype == torch.int64 for t in shard[0])
    assert input_ids.tolist() == [101, 11, 103, 13, 103, 15, 102, 0]
    assert segment_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 0] and input_mask.tolist() == [1, 1, 1, 1, 1, 1, 1, 0]
    # Fewer masked positions than max_pred_len: the zeros after them are padding, not position 0.
    assert labels.tolist() == [-100, -100, 12, -100, 14, -100, -100, -100]
    assert nsp.shape == () and nsp.item() == 1
    assert shard[1][3].tolist() == [-100, 21, -100, 23, -100, 25, 26, -100]
    assert shard[1][4].item() == 0

    batch = shard.batch([1, 0])
    for got, items in zip(batch, zip(shard[1], shard[0])):
        assert torch.equal(got, torch.stack(items))


@pytest.mark.parametrize("case, kwargs, override, expected", [
    ("missing key", {}, {"drop": ("segment_ids",)}, ["'segment_ids'", "found keys", "input_ids"]),
    ("wrong seq_len", {"seq_len": 64}, {}, ["--seq_len 64 does not match the sequence length 8 of"]),
    ("P > max_pred_len", {"max_pred_len": 2}, {}, ["P=3", "--max_pred_len is 2"]),
    ("id >= vocab", {"vocab_size": 12}, {}, ["'input_ids'", "token id 13", "vocab size is 12"]),
    ("masked id >= vocab", {"vocab_size": 50},
     {"masked_lm_ids": np.full((4, 3), 50, dtype=np.int32)}, ["'masked_lm_ids'", "token id 50", "vocab size is 50"]),
    ("row counts", {}, {"next_sentence_labels": np.zeros(3, dtype=np.int8)}, ["next_sentence_labels", "3", "4"]),
    ("zero rows", {}, {"rows": 0}, ["no sequences"]),
    ("mask shape", {}, {"input_mask": np.ones((4, 9), dtype=np.int8)}, ["'input_mask'", "(4, 9)", "(4, 8)"]),
    ("nsp shape", {}, {"next_sentence_labels": np.zeros((4, 2), dtype=np.int8)}, ["'next_sentence_labels'", "(4, 2)"]),
    ("nsp value", {}, {"next_sentence_labels": np.full(4, 2, dtype=np.int8)}, ["'next_sentence_labels'", "holds 2"]),
    ("position out of range", {}, {"masked_lm_positions": np.full((4, 3), 8, dtype=np.int32)},
     ["'masked_lm_positions'", "holds 8"]),
    ("float ids", {}, {"input_ids": np.ones((4, 8), dtype=np.float32)}, ["'input_ids'", "float32"]),
])
def test_shard_rejects_bad_data(tmp_path, case, kwargs, override, expected):
    path = write_shard(tmp_path / "bad_training_0.hdf5", **override)
    options = {"max_pred_len": 3, **kwargs}
    with pytest.raises(data.DataError) as error:
        data.PretrainingShard(path, **options)
    message = str(error.value)
    assert path in message, case
    for part in expected:
        assert part in message, (case, message)


def test_shard_rejects_a_file_that_is_not_hdf5(tmp_path):
    path = tmp_path / "x_training_0.hdf5"
    path.write_text("not hdf5")
    # nxdtp's one base class for damaged input catches the example's data errors too
    with pytest.raises(DamagedInputError, match="cannot read as HDF5") as error:
        data.PretrainingShard(str(path), max_pred_len=3)
    assert isinstance(error.value, data.DataError)


# ---------------------------------------------------------------------------------------------------------------------
# Reader: listing shards


def test_list_training_shards(tmp_path):
    for name in ["b_training_10.hdf5", "b_training_2.hdf5", "a_training_0.hdf5", "readme.txt", "b_test_0.hdf5"]:
        (tmp_path / name).write_text("")
    names = [os.path.basename(p) for p in data.list_training_shards(str(tmp_path), 3)]
    assert names == ["a_training_0.hdf5", "b_training_10.hdf5", "b_training_2.hdf5"]


def test_list_training_shards_errors(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(data.DataError, match=f"data_dir {missing} does not exist"):
        data.list_training_shards(str(missing), 1)

    (tmp_path / "file").write_text("")
    with pytest.raises(data.DataError, match="is not a directory"):
        data.list_training_shards(str(tmp_path / "file"), 1)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(data.DataError) as error:
        data.list_training_shards(str(empty), 1)
    assert str(empty) in str(error.value) and "*_training_*.hdf5" in str(error.value)
    assert "empty" in str(error.value)

    other = tmp_path / "other"
    other.mkdir()
    for i in range(7):
        (other / f"part_{i}.txt").write_text("")
    with pytest.raises(data.DataError) as error:
        data.list_training_shards(str(other), 1)
    assert "part_0.txt" in str(error.value) and "and 2 more" in str(error.value)

    (other / "x_training_0.hdf5").write_text("")
    with pytest.raises(data.DataError) as error:
        data.list_training_shards(str(other), 2)
    assert (f"data_dir {other} holds 1 training shard(s) but there are 2 data-parallel ranks"
            in str(error.value)) and "at least 2" in str(error.value)


# ---------------------------------------------------------------------------------------------------------------------
# Reader: batches over files and epochs


def make_files(directory, sizes, seq=6):
    """Shards whose rows carry a unique id in input_ids[:, 1] (file index * 1000 + row)."""
    paths = []
    for f, rows in enumerate(sizes):
        ids = np.zeros((rows, seq), dtype=np.int32)
        ids[:, 1] = f * 1000 + np.arange(rows)
        ids[:, 2:] = np.random.default_rng(f).integers(5, 60, size=(rows, seq - 2))
        paths.append(write_shard(directory / f"d_training_{f}.hdf5", rows=rows, seq=seq, pred=2, input_ids=ids))
    return paths


def take(iterable, n):
    iterator = iter(iterable)
    return [next(iterator) for _ in range(n)]


def row_ids(batch):
    return batch[0][:, 1].tolist()


def test_data_parallel_ranks_together_equal_one_rank_with_double_batch(tmp_path):
    files = make_files(tmp_path, [8, 12, 4, 16])  # every size a multiple of 2 * batch_size
    per_epoch = (8 + 12 + 4 + 16) // 4
    dense = take(data.PretrainingBatches(files, 4, 2, 1, 0, seed=5), 2 * per_epoch)
    ranks = [take(data.PretrainingBatches(files, 2, 2, 2, r, seed=5), 2 * per_epoch) for r in range(2)]
    for k in range(2 * per_epoch):
        together = [torch.cat(tensors) for tensors in zip(ranks[0][k], ranks[1][k])]
        order = torch.argsort(together[0][:, 1])
        dense_order = torch.argsort(dense[k][0][:, 1])
        for got, want in zip(together, dense[k]):
            assert torch.equal(got[order], want[dense_order]), k
    # Each epoch of the dense run sees every row once, in a different order from the other epoch.
    epochs = [[i for b in dense[e * per_epoch:(e + 1) * per_epoch] for i in row_ids(b)] for e in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == sorted(f * 1000 + r for f, n in enumerate([8, 12, 4, 16])
                                                              for r in range(n))
    assert epochs[0] != epochs[1]


def test_skip_batches_gives_the_tail_of_the_full_sequence(tmp_path, monkeypatch):
    # 13 rows: the sampler pads to 14 and rank 1 drops an incomplete batch; 1 row: no batch at all for a rank.
    files = make_files(tmp_path, [8, 13, 4, 1, 6])
    def make(skip, log=None):
        return data.PretrainingBatches(files, 2, 2, 2, 1, seed=9, skip_batches=skip, log=log)

    per_epoch = 2 + 3 + 1 + 0 + 1
    assert make(0).batches_per_epoch == per_epoch
    total = 3 * per_epoch
    reference = take(make(0), total)
    for skip in range(2 * per_epoch + 2):  # every file boundary of two epochs, and into the third
        tail = take(make(skip), total - skip)
        for k, (got, want) in enumerate(zip(tail, reference[skip:])):
            for g, w in zip(got, want):
                assert torch.equal(g, w), (skip, k)

    # Skipped files are not read: resuming at epoch 1 loads only the current file and the prefetched next one.
    loaded = []

    class Recording(data.PretrainingShard):
        def __init__(self, path, *args, **kwargs):
            loaded.append(path)
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(data, "PretrainingShard", Recording)
    take(make(per_epoch), 1)
    assert len(loaded) <= 2
    assert loaded[0] == next(p for p in make(0).file_order(1) if not p.endswith("_3.hdf5"))  # _3: no batches


def test_epoch_at_position_at_and_log_lines(tmp_path):
    files = make_files(tmp_path, [8, 13, 4, 1, 6])
    lines = []
    batches = data.PretrainingBatches(files, 2, 2, 2, 0, seed=9, log=lines.append)
    per_epoch = batches.batches_per_epoch
    assert [batches.epoch_at(k) for k in (0, per_epoch - 1, per_epoch, 3 * per_epoch + 1)] == [0, 0, 1, 3]

    iterator = iter(batches)
    for k in range(2 * per_epoch + 1):
        next(iterator)
        # The latest "file starts" line names the epoch that epoch_at gives for this batch.
        started = [line for line in lines if "batches for this rank" in line][-1]
        assert started.startswith(f"epoch {batches.epoch_at(k)} file ")
        epoch, index = batches.position_at(k)
        assert epoch == batches.epoch_at(k) and started.startswith(f"epoch {epoch} file {index + 1}/5 ")
    assert any(line.startswith("epoch 0 file ") and "d_training_0.hdf5 (8 sequences, 2 batches for this rank)"
               in line for line in lines)
    assert any("d_training_3.hdf5: skipped" in line and "1 sequences" in line for line in lines)
    assert sum(line.startswith("epoch 1 file ") for line in lines) == len(files)

    other_rank = data.PretrainingBatches(files, 2, 2, 2, 1, seed=9)
    assert all(other_rank.position_at(k) == batches.position_at(k) for k in range(3 * per_epoch))

    # Resume one batch into the first file of epoch 1 that has two or more batches for rank 0.
    rank_batches = {path: -(-rows // 2) // 2 for path, rows in zip(files, [8, 13, 4, 1, 6])}
    before = 0
    for i, path in enumerate(batches.file_order(1)):
        if rank_batches[path] >= 2:
            break
        before += rank_batches[path]
    resumed = []
    take(data.PretrainingBatches(files, 2, 2, 2, 0, seed=9, skip_batches=per_epoch + before + 1,
                                 log=resumed.append), 1)
    assert resumed[-1].startswith(f"epoch 1 file {i + 1}/5 {os.path.basename(path)} (")
    assert resumed[-1].endswith("resuming at batch 1)")


def test_batches_report_bad_files_and_oversized_batches(tmp_path):
    files = make_files(tmp_path, [4, 4])
    with pytest.raises(data.DataError) as error:
        data.PretrainingBatches(files, 3, 2, 2, 0, seed=1)
    assert "batch size 3 is too big for the shard sizes" in str(error.value) and "4 sequences" in str(error.value)

    with pytest.raises(data.DataError, match="--seq_len 32 does not match the sequence length 6 of"):
        next(iter(data.PretrainingBatches(files, 2, 2, 1, 0, seed=1, seq_len=32)))

    # A broken file surfaces when the iterator reaches it (it loads in the background thread).
    bad = write_shard(tmp_path / "e_training_9.hdf5", rows=4, seq=6, pred=2, drop=("masked_lm_ids",))
    iterator = iter(data.PretrainingBatches(files + [bad], 2, 2, 1, 0, seed=1))
    with pytest.raises(data.DataError) as error:
        for _ in range(7):
            next(iterator)
    assert bad in str(error.value) and "'masked_lm_ids'" in str(error.value)

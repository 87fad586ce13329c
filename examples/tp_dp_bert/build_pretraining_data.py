"""Write BERT pretraining shards (MLM + NSP) in the NVIDIA wikicorpus HDF5 format that pretraining_data.py reads.

    python examples/tp_dp_bert/build_pretraining_data.py --output_dir DIR --synthetic
    python examples/tp_dp_bert/build_pretraining_data.py --output_dir DIR --input_files a.txt b.txt

Output: DIR/<name>_training_<i>.hdf5 (name "synthetic" or "wikicorpus_en"), DIR/vocab.txt and DIR/data_info.json.
Each row is ``[CLS] A [SEP] B [SEP]`` plus zero padding. B follows A in the source (next_sentence_labels 0, as in
Hugging Face BERT) or comes from another document (label 1), half and half. Of the non-special tokens,
round(masked_lm_prob * real tokens) are chosen for prediction (at least 1, at most --max_pred_len); 80 % of those
become [MASK], 10 % a random token, 10 % stay as they are.

Text mode: one sentence per line, a blank line between documents; WordPiece vocab from --vocab_file, or trained
offline on the input files. --synthetic: a Markov-chain corpus that a small BERT learns within a few steps, built in
seconds, for tests and smoke runs.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sys
import time
from dataclasses import dataclass

import h5py
import numpy as np

SHARD_PATTERN = "*_training_*.hdf5"  # what pretraining_data.list_training_shards looks for
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# Where BERT's uncased vocab keeps them, so synthetic data uses the ids a real checkpoint expects.
BERT_UNCASED_SPECIAL_IDS = {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}

SHORT_SEQ_PROB = 0.1  # share of sequences with a shorter target length, so that models also see padding
MASK_TOKEN_PROB, RANDOM_TOKEN_PROB = 0.8, 0.1  # of the chosen positions; the rest keep their token

# Synthetic corpus: every token has a few likely successors, so context predicts masked tokens; documents belong to
# topics that use the vocab in different orders, so a random B usually looks unlike A (learnable NSP).
SYNTHETIC_SUCCESSORS = 6
SYNTHETIC_TOPICS = 4
SYNTHETIC_PAIRS_PER_DOC = 8


@dataclass(frozen=True)
class SpecialIds:
    pad: int
    unk: int
    cls: int
    sep: int
    mask: int

    def as_dict(self) -> dict[str, int]:
        return dict(zip(SPECIAL_TOKENS, (self.pad, self.unk, self.cls, self.sep, self.mask)))


# ---------------------------------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output_dir", required=True)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--synthetic", action="store_true", help="Markov-chain corpus, no input needed")
    source.add_argument("--input_files", nargs="+", metavar="F",
                        help="text, one sentence per line, a blank line between documents")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--max_pred_len", type=int, default=20, help="most masked positions per sequence")
    p.add_argument("--masked_lm_prob", type=float, default=0.15)
    p.add_argument("--num_shards", type=int, default=2, help="at least the number of data-parallel ranks")
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--force", action="store_true", help="replace shards already in --output_dir")
    # Defaults of the mode-specific options are applied in check_args, so that options of the other mode are noticed.
    p.add_argument("--num_sequences", type=int, help="synthetic only (default 2048)")
    p.add_argument("--vocab_size", type=int,
                   help="synthetic: vocab size; text: size of the WordPiece vocab to train (default 30522)")
    p.add_argument("--vocab_file", help="text only: an existing WordPiece vocab.txt (instead of training one)")
    p.add_argument("--dupe_factor", type=int, help="text only: passes over the corpus, each masked anew (default 1)")
    p.add_argument("--lower_case", dest="lower_case", action="store_true", default=None,
                   help="text only: lowercase and strip accents (default)")
    p.add_argument("--no_lower_case", dest="lower_case", action="store_false")
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject bad values with parser.error (exit code 2) before any work is done; fill in mode-specific defaults."""
    if args.seq_len < 8:
        parser.error(f"--seq_len must be at least 8 (room for [CLS] A [SEP] B [SEP]), got {args.seq_len}")
    if args.max_pred_len < 1:
        parser.error(f"--max_pred_len must be at least 1, got {args.max_pred_len}")
    if not 0.0 < args.masked_lm_prob < 1.0:
        parser.error(f"--masked_lm_prob must lie strictly between 0 and 1, got {args.masked_lm_prob}")
    if args.num_shards < 1:
        parser.error(f"--num_shards must be at least 1, got {args.num_shards}")
    if args.synthetic:
        _check_synthetic_args(parser, args)
    else:
        _check_text_args(parser, args)
    _check_output_dir(parser, args.output_dir, args.force)


def _check_synthetic_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    text_only = {"--vocab_file": args.vocab_file, "--dupe_factor": args.dupe_factor, "--lower_case": args.lower_case}
    given = [name for name, value in text_only.items() if value is not None]
    if given:
        parser.error(f"{', '.join(given)} only apply to text input (--input_files), not to --synthetic")
    args.num_sequences = 2048 if args.num_sequences is None else args.num_sequences
    args.vocab_size = 30522 if args.vocab_size is None else args.vocab_size
    lowest = max(BERT_UNCASED_SPECIAL_IDS.values()) + 1 + SYNTHETIC_SUCCESSORS
    if args.vocab_size < lowest:
        parser.error(f"--vocab_size must be at least {lowest} for --synthetic ([MASK] is id 103 as in BERT), "
                     f"got {args.vocab_size}")
    if args.num_sequences < args.num_shards:
        parser.error(f"--num_sequences {args.num_sequences} is fewer than --num_shards {args.num_shards}; "
                     f"every shard needs at least one sequence")


def _check_text_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.num_sequences is not None:
        parser.error("--num_sequences only applies to --synthetic; text input gives as many sequences as it holds")
    if args.vocab_file is not None and args.vocab_size is not None:
        parser.error("give either --vocab_file (use that vocab) or --vocab_size (train one), not both")
    for path in args.input_files:
        if not os.path.isfile(path):
            parser.error(f"input file {path} does not exist or is not a file")
    if args.vocab_file is not None and not os.path.isfile(args.vocab_file):
        parser.error(f"--vocab_file {args.vocab_file} does not exist or is not a file")
    if args.vocab_file is None:
        args.vocab_size = 30522 if args.vocab_size is None else args.vocab_size
        if args.vocab_size <= len(SPECIAL_TOKENS):
            parser.error(f"--vocab_size must be larger than the {len(SPECIAL_TOKENS)} special tokens, "
                         f"got {args.vocab_size}")
    args.dupe_factor = 1 if args.dupe_factor is None else args.dupe_factor
    if args.dupe_factor < 1:
        parser.error(f"--dupe_factor must be at least 1, got {args.dupe_factor}")
    args.lower_case = True if args.lower_case is None else args.lower_case


def _check_output_dir(parser: argparse.ArgumentParser, output_dir: str, force: bool) -> None:
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        parser.error(f"--output_dir {output_dir} exists and is not a directory")
    existing = sorted(glob.glob(os.path.join(output_dir, SHARD_PATTERN)))
    if existing and not force:
        parser.error(f"--output_dir {output_dir} already holds {len(existing)} training shard(s) "
                     f"({os.path.basename(existing[0])}, ...); pass --force to replace them or choose another "
                     f"directory")


# ---------------------------------------------------------------------------------------------------------------------
# Shared by both modes: layout, masking and writing


def layout(a_len: np.ndarray, b_len: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """segment_ids and input_mask of rows ``[CLS] A [SEP] B [SEP] 0...`` with the given segment lengths."""
    pos = np.arange(seq_len)[None, :]
    real_end = (a_len + b_len + 3)[:, None]  # one past the final [SEP]
    input_mask = pos < real_end
    segment_ids = (pos >= (a_len + 2)[:, None]) & input_mask  # B and its [SEP]
    return segment_ids.astype(np.int8), input_mask.astype(np.int8)


def mask_tokens(input_ids: np.ndarray, input_mask: np.ndarray, special: SpecialIds, replacements: np.ndarray,
                masked_lm_prob: float, max_pred_len: int,
                rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Choose and corrupt prediction positions for all rows at once.

    Returns (corrupted input_ids, masked_lm_positions, masked_lm_ids); positions ascending, both padded with 0.
    """
    rows, seq_len = input_ids.shape
    candidates = (input_mask == 1) & ~np.isin(input_ids, list(special.as_dict().values()))
    n_real = input_mask.sum(axis=1)
    n_chosen = np.clip(np.rint(masked_lm_prob * n_real).astype(np.int64), 1, max_pred_len)
    n_chosen = np.minimum(n_chosen, candidates.sum(axis=1))

    # A uniformly random subset of n_chosen candidates per row: the candidates with the smallest random keys.
    keys = np.where(candidates, rng.random((rows, seq_len)), 2.0)
    key_rank = np.argsort(np.argsort(keys, axis=1), axis=1)
    chosen = key_rank < n_chosen[:, None]

    action = rng.random((rows, seq_len))
    to_mask = chosen & (action < MASK_TOKEN_PROB)
    to_random = chosen & (action >= MASK_TOKEN_PROB) & (action < MASK_TOKEN_PROB + RANDOM_TOKEN_PROB)
    random_tokens = replacements[rng.integers(len(replacements), size=(rows, seq_len))]
    corrupted = np.where(to_mask, special.mask, np.where(to_random, random_tokens, input_ids))

    # Positions ascending: sort the chosen column numbers, unchosen ones pushed to the end as seq_len.
    pred_len = max_pred_len if max_pred_len <= seq_len else seq_len
    columns = np.sort(np.where(chosen, np.arange(seq_len)[None, :], seq_len), axis=1)[:, :pred_len]
    valid = columns < seq_len
    positions = np.zeros((rows, max_pred_len), dtype=np.int64)
    positions[:, :pred_len] = np.where(valid, columns, 0)
    lm_ids = np.zeros((rows, max_pred_len), dtype=np.int64)
    lm_ids[:, :pred_len] = np.where(valid, np.take_along_axis(input_ids, np.where(valid, columns, 0), axis=1), 0)
    return corrupted, positions, lm_ids


def finish_rows(tokens: np.ndarray, a_len: np.ndarray, b_len: np.ndarray, nsp: np.ndarray, special: SpecialIds,
                replacements: np.ndarray, args: argparse.Namespace, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Mask the laid-out rows, shuffle them, and return the six datasets in the file's dtypes."""
    segment_ids, input_mask = layout(a_len, b_len, args.seq_len)
    input_ids, positions, lm_ids = mask_tokens(tokens, input_mask, special, replacements, args.masked_lm_prob,
                                               args.max_pred_len, rng)
    # Rows of one document are built next to each other; shuffling spreads them over the shards.
    order = rng.permutation(len(tokens))
    return {
        "input_ids": input_ids[order].astype(np.int32),
        "input_mask": input_mask[order],
        "segment_ids": segment_ids[order],
        "masked_lm_positions": positions[order].astype(np.int32),
        "masked_lm_ids": lm_ids[order].astype(np.int32),
        "next_sentence_labels": nsp[order].astype(np.int8),
    }


def write_atomically(path: str, write) -> None:
    """Call ``write(temporary_path)``, sync, then rename: readers never see a half-written file under ``path``."""
    directory, name = os.path.split(path)
    # A leading dot and a suffix keep the temporary name out of the shard glob.
    temporary = os.path.join(directory, f".{name}.tmp{os.getpid()}")
    try:
        write(temporary)
        with open(temporary, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    dir_fd = os.open(directory or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_shard(path: str, arrays: dict[str, np.ndarray]) -> None:
    def write(temporary: str) -> None:
        with h5py.File(temporary, "w") as f:
            for key, value in arrays.items():
                f.create_dataset(key, data=value)
    write_atomically(path, write)


def write_text(path: str, text: str) -> None:
    def write(temporary: str) -> None:
        with open(temporary, "w", encoding="utf-8") as f:
            f.write(text)
    write_atomically(path, write)


def write_outputs(args: argparse.Namespace, name: str, arrays: dict[str, np.ndarray], vocab: list[str],
                  special: SpecialIds, extra_info: dict) -> list[int]:
    """Shards, vocab.txt and data_info.json; returns the number of sequences per shard."""
    os.makedirs(args.output_dir, exist_ok=True)
    # With --force, old shards go first: a leftover shard of a bigger earlier build would otherwise be trained on.
    for old in glob.glob(os.path.join(args.output_dir, SHARD_PATTERN)):
        os.remove(old)
    sizes = []
    for i, rows in enumerate(np.array_split(np.arange(len(arrays["input_ids"])), args.num_shards)):
        path = os.path.join(args.output_dir, f"{name}_training_{i}.hdf5")
        write_shard(path, {key: value[rows] for key, value in arrays.items()})
        sizes.append(len(rows))
        print(f"wrote {path}: {len(rows)} sequences", flush=True)
    write_text(os.path.join(args.output_dir, "vocab.txt"), "".join(token + "\n" for token in vocab))
    info = {
        "mode": "synthetic" if args.synthetic else "text",
        "seed": args.seed,
        "vocab_size": len(vocab),
        "seq_len": args.seq_len,
        "max_pred_len": args.max_pred_len,
        "masked_lm_prob": args.masked_lm_prob,
        "num_sequences": int(sum(sizes)),
        "sequences_per_shard": sizes,
        "special_token_ids": special.as_dict(),
        **extra_info,
    }
    write_text(os.path.join(args.output_dir, "data_info.json"), json.dumps(info, indent=2) + "\n")
    return sizes


def replacement_pool(vocab: list[str]) -> np.ndarray:
    """Ids a masked token may be replaced by: all but bracketed tokens ([PAD], [unused0], ...)."""
    pool = [i for i, token in enumerate(vocab) if not (token.startswith("[") and token.endswith("]"))]
    return np.asarray(pool, dtype=np.int64)


# ---------------------------------------------------------------------------------------------------------------------
# Synthetic corpus


def synthetic_vocab(vocab_size: int) -> list[str]:
    vocab = [f"tok{i}" for i in range(vocab_size)]
    for token, i in BERT_UNCASED_SPECIAL_IDS.items():
        vocab[i] = token
    return vocab


def zipf(n: int) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1)
    return weights / weights.sum()


def markov_documents(n_docs: int, length: int, token_ids: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """[n_docs, length] token ids, each row a Markov chain in the vocab order of the document's topic.

    The chain runs over frequency ranks: rank 0 is the most likely start and successor, so the corpus has a Zipfian
    unigram distribution, and each rank has SYNTHETIC_SUCCESSORS likely successors with Zipfian weights.
    """
    n = len(token_ids)
    rank_p = zipf(n)
    successors = rng.choice(n, size=(n, SYNTHETIC_SUCCESSORS), p=rank_p)
    picks = rng.choice(SYNTHETIC_SUCCESSORS, size=(length, n_docs), p=zipf(SYNTHETIC_SUCCESSORS))
    ranks = np.empty((n_docs, length), dtype=np.int64)
    state = rng.choice(n, size=n_docs, p=rank_p)
    for t in range(length):  # sequential in time, vectorised over documents
        ranks[:, t] = state
        state = successors[state, picks[t]]
    topic_orders = np.stack([rng.permutation(token_ids) for _ in range(SYNTHETIC_TOPICS)])
    topic = rng.integers(SYNTHETIC_TOPICS, size=n_docs)
    return topic_orders[topic[:, None], ranks]


def build_synthetic(args: argparse.Namespace) -> tuple[dict[str, np.ndarray], list[str], SpecialIds, dict]:
    rng = np.random.default_rng(args.seed)
    vocab = synthetic_vocab(args.vocab_size)
    special = SpecialIds(**{k.strip("[]").lower(): v for k, v in BERT_UNCASED_SPECIAL_IDS.items()})
    ordinary = replacement_pool(vocab)
    rows, span = args.num_sequences, args.seq_len - 3  # span: tokens of A and B together

    # Documents of SYNTHETIC_PAIRS_PER_DOC consecutive spans; row i is built from span i (of document i // per_doc).
    per_doc = min(SYNTHETIC_PAIRS_PER_DOC, max(1, rows // 2))
    n_docs = max(2, -(-rows // per_doc))  # at least two, so that a random B can come from another document
    spans = markov_documents(n_docs, per_doc * span, ordinary, rng).reshape(n_docs * per_doc, span)

    total = np.where(rng.random(rows) < SHORT_SEQ_PROB, rng.integers(2, span + 1, size=rows), span)
    a_len = rng.integers(1, total)  # in [1, total - 1]: both segments non-empty
    b_len = total - a_len
    nsp = (rng.random(rows) < 0.5).astype(np.int64)  # 1: B is random

    # A random B: a stretch of a span of another document, at a random offset.
    own_doc = np.arange(rows) // per_doc
    other_doc = (own_doc + rng.integers(1, n_docs, size=rows)) % n_docs
    other_span = other_doc * per_doc + rng.integers(per_doc, size=rows)
    other_start = rng.integers(0, span - b_len + 1)

    pos = np.arange(args.seq_len)[None, :]
    a, b = a_len[:, None], b_len[:, None]
    random_b = nsp[:, None] == 1
    in_a = (pos >= 1) & (pos <= a)
    in_b = (pos >= a + 2) & (pos < a + 2 + b)
    b_offset = pos - a - 2
    source_span = np.where(in_b & random_b, other_span[:, None], np.arange(rows)[:, None])
    source_column = np.where(in_a, pos - 1, np.where(random_b, other_start[:, None] + b_offset, a + b_offset))
    tokens = spans[source_span, np.clip(source_column, 0, span - 1)]
    tokens = np.where(in_a | in_b, tokens, 0)
    tokens[:, 0] = special.cls
    tokens[np.arange(rows), a_len + 1] = special.sep
    tokens[np.arange(rows), a_len + b_len + 2] = special.sep

    arrays = finish_rows(tokens, a_len, b_len, nsp, special, ordinary, args, rng)
    return arrays, vocab, special, {"markov_successors": SYNTHETIC_SUCCESSORS, "topics": SYNTHETIC_TOPICS}


# ---------------------------------------------------------------------------------------------------------------------
# Text corpus


def read_documents(paths: list[str]) -> list[list[str]]:
    """Documents as lists of sentences: one sentence per line, a blank line or the end of a file ends a document."""
    documents: list[list[str]] = []
    for path in paths:
        current: list[str] = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    current.append(line)
                elif current:
                    documents.append(current)
                    current = []
        if current:
            documents.append(current)
    return documents


def make_tokenizer(args: argparse.Namespace):
    """A WordPiece tokenizer from --vocab_file, or one trained on the input files (offline, nothing downloaded)."""
    from tokenizers import BertWordPieceTokenizer

    options = {"lowercase": args.lower_case, "strip_accents": args.lower_case}
    if args.vocab_file is not None:
        return BertWordPieceTokenizer(args.vocab_file, **options)
    tokenizer = BertWordPieceTokenizer(**options)
    tokenizer.train(args.input_files, vocab_size=args.vocab_size, special_tokens=list(SPECIAL_TOKENS),
                    show_progress=False)
    return tokenizer


def vocab_list(tokenizer) -> list[str]:
    by_id = sorted((i, token) for token, i in tokenizer.get_vocab().items())
    if [i for i, _ in by_id] != list(range(len(by_id))):
        raise SystemExit("error: the WordPiece vocab has gaps in its ids; cannot write vocab.txt")
    return [token for _, token in by_id]


def tokenize_documents(documents: list[list[str]], tokenizer) -> list[list[list[int]]]:
    sentences = [s for doc in documents for s in doc]
    encoded = iter(tokenizer.encode_batch(sentences, add_special_tokens=False))
    tokenized = []
    for doc in documents:
        ids = [next(encoded).ids for _ in doc]
        ids = [s for s in ids if s]  # a line of only ignored characters gives no tokens
        if ids:
            tokenized.append(ids)
    return tokenized


def truncate_pair(a: list[int], b: list[int], limit: int) -> tuple[list[int], list[int]]:
    """Shorten the longer segment until both fit: A loses its start, B its end, so that A's end still joins B."""
    la, lb = len(a), len(b)
    while la + lb > limit:
        if la > lb:
            la -= 1
        else:
            lb -= 1
    return a[len(a) - la:], b[:lb]


def random_segment(documents: list[list[list[int]]], exclude: int, length: int, rng: random.Random) -> list[int]:
    """At least ``length`` tokens (when the document has them) of consecutive sentences of another document."""
    d = rng.randrange(len(documents) - 1)
    doc = documents[d if d < exclude else d + 1]
    segment: list[int] = []
    for sentence in doc[rng.randrange(len(doc)):]:
        segment.extend(sentence)
        if len(segment) >= length:
            break
    return segment


def document_pairs(documents: list[list[list[int]]], d: int, max_tokens: int,
                   rng: random.Random) -> list[tuple[list[int], list[int], int]]:
    """(A, B, label) pairs from document d: greedy chunks of consecutive sentences up to a target length."""
    doc, pairs = documents[d], []
    i, chunk = 0, []
    target = max_tokens if rng.random() >= SHORT_SEQ_PROB else rng.randint(2, max_tokens)
    while i < len(doc):
        chunk.append(doc[i])
        i += 1
        if i < len(doc) and sum(map(len, chunk)) < target:
            continue
        if len(chunk) >= 2:
            cut = rng.randint(1, len(chunk) - 1)
            a = [t for s in chunk[:cut] for t in s]
            b = [t for s in chunk[cut:] for t in s]
        else:  # one sentence: split it, so that it still gives a pair
            cut = rng.randint(1, len(chunk[0]) - 1) if len(chunk[0]) >= 2 else 0
            a, b = chunk[0][:cut], chunk[0][cut:]
        if a and b:
            label = int(rng.random() < 0.5)
            if label == 1:
                b = random_segment(documents, d, max_tokens - len(a), rng)
                if len(chunk) >= 2:
                    i -= len(chunk) - cut  # the unused B sentences start the next chunk
            a, b = truncate_pair(a, b, max_tokens)
            pairs.append((a, b, label))
        chunk = []
        target = max_tokens if rng.random() >= SHORT_SEQ_PROB else rng.randint(2, max_tokens)
    return pairs


def build_text(args: argparse.Namespace) -> tuple[dict[str, np.ndarray], list[str], SpecialIds, dict]:
    documents = read_documents(args.input_files)
    tokenizer = make_tokenizer(args)
    vocab = vocab_list(tokenizer)
    source = args.vocab_file or f"trained on the input ({len(vocab)} tokens, {args.vocab_size} asked)"
    print(f"read {len(documents)} documents, {sum(map(len, documents))} sentences from {len(args.input_files)} "
          f"file(s); vocab {source}", flush=True)
    missing = [t for t in SPECIAL_TOKENS if tokenizer.token_to_id(t) is None]
    if missing:
        raise SystemExit(f"error: the vocab lacks the special token(s) {missing}")
    special = SpecialIds(*(tokenizer.token_to_id(t) for t in SPECIAL_TOKENS))
    tokenized = tokenize_documents(documents, tokenizer)
    if len(tokenized) < 2:
        raise SystemExit(f"error: the input holds {len(tokenized)} non-empty document(s); next-sentence pairs need "
                         f"at least 2 (separate documents by blank lines)")

    rng = random.Random(args.seed)
    pairs = [pair for _ in range(args.dupe_factor) for d in range(len(tokenized))
             for pair in document_pairs(tokenized, d, args.seq_len - 3, rng)]
    if len(pairs) < args.num_shards:
        raise SystemExit(f"error: the input gives {len(pairs)} sequences, fewer than --num_shards {args.num_shards}")

    tokens = np.zeros((len(pairs), args.seq_len), dtype=np.int64)
    for row, (a, b, _) in enumerate(pairs):
        line = [special.cls, *a, special.sep, *b, special.sep]
        tokens[row, :len(line)] = line
    a_len = np.array([len(a) for a, _, _ in pairs])
    b_len = np.array([len(b) for _, b, _ in pairs])
    nsp = np.array([label for _, _, label in pairs])
    arrays = finish_rows(tokens, a_len, b_len, nsp, special, replacement_pool(vocab), args,
                         np.random.default_rng(args.seed))
    info = {"input_files": [os.path.abspath(p) for p in args.input_files], "dupe_factor": args.dupe_factor,
            "lower_case": args.lower_case, "vocab_file": args.vocab_file and os.path.abspath(args.vocab_file)}
    return arrays, vocab, special, info


# ---------------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    started = time.perf_counter()
    if args.synthetic:
        name, (arrays, vocab, special, info) = "synthetic", build_synthetic(args)
    else:
        name, (arrays, vocab, special, info) = "wikicorpus_en", build_text(args)
    sizes = write_outputs(args, name, arrays, vocab, special, info)
    nsp_random = float(arrays["next_sentence_labels"].mean())
    masked = int((arrays["masked_lm_positions"] > 0).sum())
    real = int(arrays["input_mask"].sum())
    print(f"built {sum(sizes)} sequences of {args.seq_len} tokens in {len(sizes)} shard(s) in {args.output_dir} in "
          f"{time.perf_counter() - started:.1f} s: vocab {len(vocab)} tokens, {masked / real:.1%} of real tokens "
          f"masked, {nsp_random:.1%} random-B pairs", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

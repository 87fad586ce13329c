"""Write a tokenized, packed causal-LM dataset for the Llama example, offline.

    python examples/tp_zero1_llama/build_llama_data.py --output_dir DIR --synthetic \\
        [--vocab_size 1024] [--seq_len 128] [--num_blocks 2048] [--seed 0] [--format safetensors|datasets]
    python examples/tp_zero1_llama/build_llama_data.py --output_dir DIR --from_hf_dataset NXD_DATA_DIR

``--synthetic`` draws token streams from a fixed random Markov chain (each token has a few likely successors, so a
model can learn it and its loss falls well below log(vocab)) and packs them into blocks, the way NxD's
``get_dataset.py`` packs tokenized text: ``input_ids``, ``attention_mask`` (ones) and ``labels`` (a copy of
``input_ids``). ``--format datasets`` writes NxD's own form (``Dataset.save_to_disk``; needs ``pip install
datasets``), the default the light safetensors form (see llama_data.py). ``--from_hf_dataset`` converts NxD's form to
the light one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import llama_data  # noqa: E402

SUCCESSORS = 4   # likely next tokens per token in the synthetic chain


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--output_dir", required=True)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--synthetic", action="store_true", help="draw blocks from a random Markov chain")
    source.add_argument("--from_hf_dataset", default=None,
                        help="convert a datasets save_to_disk directory (NxD's get_dataset.py output) to the "
                             "light form")
    p.add_argument("--vocab_size", type=int, default=1024)
    p.add_argument("--seq_len", type=int, default=128, help="tokens per packed block")
    p.add_argument("--num_blocks", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", choices=("safetensors", "datasets"), default="safetensors",
                   help="safetensors: the light form; datasets: NxD's save_to_disk form (needs the datasets package)")
    args = p.parse_args(argv)
    for name in ("vocab_size", "num_blocks"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)} must be >= 1")
    if args.seq_len < 2:
        p.error(f"--seq_len {args.seq_len} must be >= 2 (a block needs a next token to predict)")
    if args.vocab_size < SUCCESSORS + 1:
        p.error(f"--vocab_size {args.vocab_size} must be > {SUCCESSORS}")
    return args


def synthetic_blocks(vocab_size: int, seq_len: int, num_blocks: int, seed: int) -> torch.Tensor:
    """[num_blocks, seq_len] int32 token ids, one walk of the same random Markov chain per block (vectorised over
    the blocks)."""
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab_size, (vocab_size, SUCCESSORS), generator=generator)
    weights = torch.tensor([0.55, 0.25, 0.12, 0.08])
    choices = torch.multinomial(weights, num_blocks * seq_len, replacement=True, generator=generator)
    choices = choices.view(num_blocks, seq_len)
    blocks = torch.empty(num_blocks, seq_len, dtype=torch.long)
    current = torch.randint(0, vocab_size, (num_blocks,), generator=generator)
    for position in range(seq_len):
        current = successors[current, choices[:, position]]
        blocks[:, position] = current
    return blocks.to(torch.int32)


def write(args: argparse.Namespace, columns, info: dict) -> str:
    if args.format == "safetensors":
        return llama_data.write_light(args.output_dir, columns, info)
    try:
        import datasets
    except ImportError:
        raise SystemExit("error: --format datasets needs the datasets package: pip install datasets") from None
    import pyarrow

    arrow = pyarrow.Table.from_pydict({name: tensor.tolist() for name, tensor in columns.items()})
    # A fingerprint of our own: datasets would otherwise hash the whole table (with dill, slow and, with some pyarrow
    # versions, failing).
    table = datasets.Dataset(datasets.table.InMemoryTable(arrow), fingerprint=f"nxdtp-{info.get('seed', 0)}")
    table.save_to_disk(args.output_dir)
    with open(os.path.join(args.output_dir, "nxdtp_data_info.json"), "w") as f:
        json.dump(info, f, indent=1)
    return args.output_dir


def main(argv: Optional[List[str]] = None) -> str:
    args = parse_args(argv)
    if args.from_hf_dataset:
        try:
            source = llama_data.PackedBlocks(args.from_hf_dataset)
        except llama_data.DataError as error:
            raise SystemExit(f"error: {error}") from None
        if source.form != "datasets":
            raise SystemExit(f"error: --from_hf_dataset {args.from_hf_dataset} is already in the light form")
        columns = source.rows(list(range(source.num_rows)))
        columns = {k: v.to(torch.int32) if v.abs().max() < 2 ** 31 else v for k, v in columns.items()}
        info = {"source": os.path.abspath(args.from_hf_dataset), "rows": source.num_rows, "seq_len": source.seq_len}
        args.format = "safetensors"
    else:
        ids = synthetic_blocks(args.vocab_size, args.seq_len, args.num_blocks, args.seed)
        columns = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        info = {"synthetic": True, "vocab_size": args.vocab_size, "seq_len": args.seq_len,
                "num_blocks": args.num_blocks, "seed": args.seed, "successors_per_token": SUCCESSORS}
    path = write(args, columns, info)
    rows, seq_len = columns["input_ids"].shape
    print(f"wrote {rows} blocks of {seq_len} tokens ({args.format} form) to {path}", flush=True)
    return path


if __name__ == "__main__":
    main()

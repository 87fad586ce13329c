"""Load a merged Llama checkpoint with plain transformers, score it on the data, and generate a few tokens.

    python examples/tp_zero1_llama/generate_merged.py MERGED_DIR --data_dir DATA [--blocks 16] [--new_tokens 16]

``MERGED_DIR`` is what ``nxdtp-merge CHECKPOINT_DIR MERGED_DIR`` wrote (config.json and model.safetensors): it loads
with ``AutoModelForCausalLM.from_pretrained`` and nothing from nxdtp. The trained model's mean next-token loss on the
first blocks of the data is compared with that of an untrained model of the same config (the script exits 1 if
training did not lower it), then the model continues the first block's opening tokens greedily, and the script counts
how many of the generated token pairs (each token and the one before it) occur anywhere in the data: a model that
learned the data's statistics produces pairs the data has.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import llama_data  # noqa: E402


@torch.no_grad()
def mean_loss(model, input_ids: torch.Tensor) -> float:
    return float(model(input_ids=input_ids, labels=input_ids).loss)


def data_pairs(data, vocab_size: int, blocks: int = 1024) -> set:
    """Every (token, next token) pair of the data's first ``blocks`` blocks, as ``token * vocab_size + next``."""
    ids = data.rows(list(range(min(blocks, data.num_rows))))["input_ids"]
    return set((ids[:, :-1] * vocab_size + ids[:, 1:]).unique().tolist())


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("merged_dir")
    p.add_argument("--data_dir", required=True)
    p.add_argument("--blocks", type=int, default=16, help="data blocks to score")
    p.add_argument("--prompt_tokens", type=int, default=8)
    p.add_argument("--new_tokens", type=int, default=16)
    args = p.parse_args(argv)

    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.merged_dir).eval()
    data = llama_data.PackedBlocks(args.data_dir)
    ids = data.rows(list(range(min(args.blocks, data.num_rows))))["input_ids"]
    torch.manual_seed(0)
    untrained = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.merged_dir)).eval()
    trained_loss, untrained_loss = mean_loss(model, ids), mean_loss(untrained, ids)
    print(f"{type(model).__name__} from {args.merged_dir}: mean next-token loss on {len(ids)} blocks "
          f"{trained_loss:.4f} (an untrained model of the same config: {untrained_loss:.4f})", flush=True)
    prompt = ids[:1, :args.prompt_tokens]
    out = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False,
                         pad_token_id=model.config.eos_token_id)
    generated = out[0, args.prompt_tokens:]
    seen = data_pairs(data, model.config.vocab_size)
    pairs = out[0, args.prompt_tokens - 1:]
    found = sum(int(a) * model.config.vocab_size + int(b) in seen for a, b in zip(pairs[:-1], pairs[1:]))
    print(f"prompt    {prompt[0].tolist()}\ngenerated {generated.tolist()}\n"
          f"{found} of {len(generated)} generated token pairs occur in the data", flush=True)
    if not trained_loss < untrained_loss:
        print("error: the trained model scores no better than an untrained one", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

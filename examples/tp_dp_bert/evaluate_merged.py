"""Load a merged checkpoint with plain transformers and score it on pretraining data.

    python examples/tp_dp_bert/evaluate_merged.py MERGED_DIR --data_dir DATA [--batches 4]

Prints the MLM + NSP loss of the merged model next to that of a freshly initialised model of the same config, on the
same batches: training shows as the gap. No nxdtp code is involved in loading: this is what a user's downstream job
sees.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pretraining_data  # noqa: E402


def mean_loss(model, batches) -> float:
    model.eval()
    losses = []
    with torch.no_grad():
        for input_ids, segment_ids, input_mask, labels, nsp_labels in batches:
            out = model(input_ids=input_ids, attention_mask=input_mask, token_type_ids=segment_ids, labels=labels,
                        next_sentence_label=nsp_labels)
            losses.append(out.loss.item())
    return sum(losses) / len(losses)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("merged_dir")
    p.add_argument("--data_dir", required=True)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--max_pred_len", type=int, default=20, help="as for the training script")
    args = p.parse_args(argv)

    from transformers import BertConfig, BertForPreTraining

    merged = BertForPreTraining.from_pretrained(args.merged_dir)
    config = BertConfig.from_pretrained(args.merged_dir)
    torch.manual_seed(0)
    untrained = BertForPreTraining(config)
    files = pretraining_data.list_training_shards(args.data_dir, 1)
    stream = iter(pretraining_data.PretrainingBatches(files, args.batch_size, max_pred_len=args.max_pred_len,
                                                      data_parallel_size=1, data_parallel_rank=0, seed=0,
                                                      vocab_size=config.vocab_size))
    batches = [next(stream) for _ in range(args.batches)]
    trained_loss, untrained_loss = mean_loss(merged, batches), mean_loss(untrained, batches)
    parameters = sum(p.numel() for p in merged.parameters())
    print(f"transformers loaded {args.merged_dir}: BertForPreTraining, {parameters:,} parameters\n"
          f"loss on {args.batches} batches of {args.data_dir}: merged checkpoint {trained_loss:.4f}, "
          f"untrained model {untrained_loss:.4f}", flush=True)
    return 0 if trained_loss < untrained_loss else 1


if __name__ == "__main__":
    sys.exit(main())

"""The dense reference for the Llama example: the same training, with plain transformers and torch in one process.

No nxdtp anywhere: Hugging Face's ``LlamaForCausalLM`` (or the config's family: ``MixtralForCausalLM`` for
examples/tp_ep_mixtral, whose micro-batch loss adds its load-balancing loss) built from the same config and seed,
torch's AdamW with the script's hyper-parameters and weight-decay groups, the same warmup-then-linear schedule,
gradient clipping at 1.0, and the global batches the script's data-parallel ranks read together (rows
``[k G, (k + 1) G)`` of micro-batch k).
Its step losses are what every TP × DP layout of the script must reproduce.

    python examples/tp_zero1_llama/dense_reference.py --output_dir OUT SCRIPT_FLAGS...

takes the training script's flags (``--batch_size`` is then the *global* micro-batch) and writes the same
``train_log.jsonl`` the script writes.
"""

from __future__ import annotations

import json
import os
import sys
from typing import List, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "common"))

import llama_data  # noqa: E402
import tp_zero1_llama_hf_pretrain as script  # noqa: E402
from training_log import STEP_LOG_FILE  # noqa: E402


def train(args) -> List[float]:
    """Step losses of the dense run of ``args`` (the script's parsed flags, ``batch_size`` the global micro-batch)."""
    from transformers import set_seed

    set_seed(args.seed)
    model = script.dense_model(script.load_config(args))
    model.train()
    decay = [p for n, p in model.named_parameters() if not any(nd in n for nd in ("bias", "norm"))]
    no_decay = [p for n, p in model.named_parameters() if any(nd in n for nd in ("bias", "norm"))]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr,
                                  betas=(args.beta1, args.beta2), eps=1e-6, weight_decay=args.weight_decay)
    scheduler = script.linear_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)
    data = llama_data.PackedBlocks(args.data_dir)
    batches = llama_data.MicroBatches(data, args.batch_size, 1, 0, model.config.vocab_size)
    losses = []
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, STEP_LOG_FILE), "w") as log:
        for step in range(1, args.steps_this_run + 1):
            micro_batches = [next(batches) for _ in range(args.grad_accum_usteps)]
            count = sum((b["labels"][:, 1:] != llama_data.IGNORE_INDEX).sum() for b in micro_batches)
            total = 0.0
            for b in micro_batches:
                outputs = model(input_ids=b["input_ids"], attention_mask=b.get("attention_mask"))
                logits = outputs.logits.float()
                loss = torch.nn.functional.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]), b["labels"][:, 1:].reshape(-1),
                    ignore_index=llama_data.IGNORE_INDEX, reduction="sum") / count
                if getattr(outputs, "aux_loss", None) is not None:   # a mixture of experts' load-balancing loss
                    loss = loss + model.config.router_aux_loss_coef * outputs.aux_loss
                loss.backward()
                total += loss.item()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            losses.append(total)
            log.write(json.dumps({"step": step, "loss": total, "grad_norm": float(grad_norm)}) + "\n")
            print(f"dense step {step}: loss {total:.6f} grad-norm {float(grad_norm):.6f}", flush=True)
    return losses


def main(argv: Optional[List[str]] = None) -> List[float]:
    return train(script.parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()

"""The loss-curve claim for Mixtral: tensor, expert and sequence parallelism change how the model is computed, not
what it computes.

Trains the same Mixtral from the same seed on the same global batches three times: TP=2 × EP=2 (DP=2) with ZeRO-1 and
sequence parallelism, and TP=1 × EP=4 (DP=4), each a torchrun launch of four processes, and the dense reference
(plain transformers and torch in one process; its loss adds the load-balancing loss, as HF's Mixtral does). Writes
the curves to a PNG and the losses to JSON, prints the largest difference from the dense curve, and exits with
status 1 if it exceeds --tolerance.

    python examples/tp_ep_mixtral/loss_curve.py --data_dir DATA --output_dir OUT [--steps 12] [-- MORE_FLAGS]
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tp_zero1_llama"))

import loss_curve as llama_loss_curve  # noqa: E402

LAYOUTS = (("TP=2 x EP=2 (DP=2), ZeRO-1, SP", 2,
            ["--expert_parallel_size", "2", "--use_zero_1", "--sequence_parallel_enabled"]),
           ("TP=1 x EP=4 (DP=4)", 1, ["--expert_parallel_size", "4"]))
# Every layout and the dense reference take these (the dense reference ignores them): whole decoder layers of a
# mixture of experts are not recomputed (tp_zero1_llama_hf_pretrain.py says why).
FLAGS = ["--selective_checkpoint_enabled"]


def main(argv=None) -> int:
    args = llama_loss_curve.parse_args(argv, __doc__, os.path.join(HERE, "configs", "mixtral_tiny"))
    args.extra = FLAGS + args.extra
    return llama_loss_curve.main(layouts=LAYOUTS, model="Mixtral (4 experts, top 2)", args=args,
                                 script=os.path.join(HERE, "tp_ep_mixtral_pretrain.py"))


if __name__ == "__main__":
    sys.exit(main())

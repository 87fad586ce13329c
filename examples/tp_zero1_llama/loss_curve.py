"""The loss-curve claim for Llama: tensor parallelism, sequence parallelism and ZeRO-1 change how the model is
computed, not what it computes.

Trains the same model from the same seed on the same global batches three times: TP=2 × DP=2 with ZeRO-1 and
sequence parallelism, and TP=1 × DP=4 (each a torchrun launch of four processes), and the dense reference (plain
transformers and torch in one process, dense_reference.py). Writes the curves to a PNG and the losses to JSON, prints
the largest difference from the dense curve, and exits with status 1 if it exceeds --tolerance.

    python examples/tp_zero1_llama/loss_curve.py --data_dir DATA --output_dir OUT [--steps 12] [-- MORE_FLAGS]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "common"))

from loss_curves import largest_gap, plot, python_launch, run_layout  # noqa: E402

SCRIPT = os.path.join(HERE, "tp_zero1_llama_hf_pretrain.py")
DENSE = os.path.join(HERE, "dense_reference.py")
PROCESSES = 4
# (label, tensor_parallel_size, extra flags) on 4 processes; the dense run is the reference.
LAYOUTS = (("TP=2 x DP=2, ZeRO-1, SP", 2, ["--use_zero_1", "--sequence_parallel_enabled"]),
           ("TP=1 x DP=4", 1, []))
DENSE_LABEL = "dense (transformers + torch, 1 process)"


def parse_args(argv=None, description: str = __doc__, model_path: str = os.path.join(HERE, "configs", "llama_tiny")
               ) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description.split("\n\n")[0])
    p.add_argument("--data_dir", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--global_batch", type=int, default=8, help="sequences per micro-step over all processes")
    p.add_argument("--grad_accum_usteps", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--model_path", default=model_path)
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.add_argument("extra", nargs="*", help="more flags for the training script (after --)")
    args = p.parse_args(argv)
    if args.global_batch % PROCESSES:
        p.error(f"--global_batch {args.global_batch} must be a multiple of {PROCESSES}: TP=1 x DP=4 splits it")
    return args


def common_flags(args: argparse.Namespace, run_dir: str, batch_size: int) -> List[str]:
    return ["--model_path", args.model_path, "--data_dir", args.data_dir, "--output_dir", run_dir,
            "--metrics_file", os.path.join(run_dir, "results.json"), "--batch_size", str(batch_size),
            "--grad_accum_usteps", str(args.grad_accum_usteps), "--max_steps", str(args.steps),
            "--steps_this_run", str(args.steps), "--warmup_steps", str(max(1, args.steps // 6)), "--lr", str(args.lr),
            "--seq_len", str(args.seq_len), "--seed", "7", *args.extra]


def train(args: argparse.Namespace, label: str, tp: int, flags: List[str], script: str = SCRIPT) -> List[Dict]:
    run_dir = os.path.join(args.output_dir, f"tp{tp}_dp{PROCESSES // tp}")   # each layout its own TP size
    dp = PROCESSES // tp
    command = [*python_launch(PROCESSES), script, *common_flags(args, run_dir, args.global_batch // dp),
               "--tensor_parallel_size", str(tp), "--device", "cpu", "--checkpoint_freq", "0", *flags]
    return run_layout(command, run_dir, args.steps, label)


def dense(args: argparse.Namespace) -> List[Dict]:
    run_dir = os.path.join(args.output_dir, "dense")
    command = [sys.executable, DENSE, *common_flags(args, run_dir, args.global_batch), "--tensor_parallel_size", "1"]
    return run_layout(command, run_dir, args.steps, DENSE_LABEL)


def main(argv=None, layouts=LAYOUTS, model: str = "Llama", args: Optional[argparse.Namespace] = None,
         script: str = SCRIPT) -> int:
    """Train ``layouts`` (``(label, tensor_parallel_size, flags)`` on 4 processes of ``script``) and the dense
    reference, plot, compare; ``model`` names the model in the plot's title."""
    args = args or parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    curves = {DENSE_LABEL: dense(args)}
    curves.update({label: train(args, label, tp, flags, script) for label, tp, flags in layouts})
    reference = curves[DENSE_LABEL]
    gaps = {label: largest_gap(records, reference) for label, records in curves.items() if label != DENSE_LABEL}
    worst = max(gaps.values())
    png = os.path.join(args.output_dir, "loss_curve.png")
    plot(curves, png, f"{model}, same seed, global batch {args.global_batch} x {args.grad_accum_usteps} micro-steps: "
                      f"max |diff| from dense {worst:.1e}", ylabel="training loss (next-token cross entropy)")
    with open(os.path.join(args.output_dir, "loss_curve.json"), "w") as f:
        json.dump({**{label: [r["loss"] for r in records] for label, records in curves.items()},
                   "max_abs_diff_from_dense": gaps}, f, indent=1)
    ok = worst <= args.tolerance
    for label, gap in gaps.items():
        print(f"{label} vs dense: max |loss difference| over {len(reference)} steps = {gap:.2e}", flush=True)
    print(f"first loss {reference[0]['loss']:.4f}, last {reference[-1]['loss']:.4f}; tolerance {args.tolerance:g}: "
          f"{'OK' if ok else 'FAILED'}\nplot: {png}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The loss-curve claim: tensor parallelism changes how the model is computed, not what it computes.

Trains the same model from the same seed on the same global batches twice, as TP=2 × DP=1 and as TP=1 × DP=2 (each
a torchrun launch of two processes), with dropout off so that every step is deterministic. Writes both curves to a
PNG and the step losses to JSON, prints the largest difference, and exits with status 1 if it exceeds --tolerance.

    python examples/tp_dp_bert/loss_curve.py --data_dir DATA --output_dir OUT [--steps 20] [--grad_accum_usteps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "common"))

from loss_curves import largest_gap, plot, python_launch, run_layout  # noqa: E402

SCRIPT = os.path.join(HERE, "tp_dp_bert_large_hf_pretrain_hdf5.py")
LAYOUTS = (("TP=2 x DP=1", 2), ("TP=1 x DP=2", 1))   # (label, tensor_parallel_size) on 2 processes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data_dir", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--global_batch", type=int, default=16, help="sequences per micro-step over both processes")
    p.add_argument("--grad_accum_usteps", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--model_config", default=os.path.join(HERE, "configs", "bert_mini"))
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.add_argument("extra", nargs="*", help="more flags for the training script (after --)")
    args = p.parse_args(argv)
    if args.global_batch % 2:
        p.error(f"--global_batch {args.global_batch} must be even: TP=1 x DP=2 gives each rank half")
    return args


def train(args: argparse.Namespace, label: str, tp: int) -> List[Dict]:
    run_dir = os.path.join(args.output_dir, label.replace(" ", "").replace("=", ""))
    dp = 2 // tp
    command = [*python_launch(2), SCRIPT,
               "--data_dir", args.data_dir, "--output_dir", run_dir,
               "--metrics_file", os.path.join(run_dir, "results.json"), "--model_config", args.model_config,
               "--tensor_parallel_size", str(tp), "--batch_size", str(args.global_batch // dp),
               "--grad_accum_usteps", str(args.grad_accum_usteps), "--steps_this_run", str(args.steps),
               "--max_steps", str(args.steps), "--warmup_steps", str(max(1, args.steps // 10)), "--lr", str(args.lr),
               "--dropout", "0", "--shards_per_ckpt", "0", "--device", "cpu", *args.extra]
    return run_layout(command, run_dir, args.steps, label)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    curves = {label: train(args, label, tp) for label, tp in LAYOUTS}
    (label_a, a), (label_b, b) = curves.items()
    gap = largest_gap(a, b)
    png = os.path.join(args.output_dir, "loss_curve.png")
    plot(curves, png, f"same seed, global batch {args.global_batch} x {args.grad_accum_usteps} micro-steps: "
                      f"max |diff| {gap:.1e}", ylabel="training loss (MLM + NSP)")
    with open(os.path.join(args.output_dir, "loss_curve.json"), "w") as f:
        json.dump({label: [r["loss"] for r in records] for label, records in curves.items()} | {"max_abs_diff": gap},
                  f, indent=1)
    ok = gap <= args.tolerance
    print(f"{label_a} vs {label_b}: first loss {a[0]['loss']:.4f}, last {a[-1]['loss']:.4f}; "
          f"max |loss difference| over {len(a)} steps = {gap:.2e} (tolerance {args.tolerance:g}): "
          f"{'OK' if ok else 'FAILED'}\nplot: {png}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

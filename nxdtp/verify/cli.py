"""The ``nxdtp`` command; its subcommand ``verify`` checks that a model's tensor-parallel run equals the dense model.

    nxdtp verify MODEL [--tp N] [--dp N] [--steps N] [--full-size] [--model-class CLASS] [--plan MODULE:ATTR] ...
    nxdtp verify --factory MODULE:FUNCTION [--plan MODULE:ATTR] [--batch MODULE:FUNCTION] ...

MODEL is a Hugging Face model directory, a config.json or a model type ('llama', 'gpt2', 'bert'). Prints one line per
step, the drift of replicated parameters, then PASS or FAIL. Exit status: 0 PASS; 1 FAIL (a value out of tolerance,
naming the worst parameter, or a step that raised); 2 bad input, with one line naming the value.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

PROG = "nxdtp"
EXIT_FAIL = 1
EXIT_BAD_INPUT = 2


class _BadUsage(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block
        raise _BadUsage(f"{message} (see {self.prog} --help)")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="nxdtp's command line.")
    commands = parser.add_subparsers(dest="command", parser_class=_Parser)
    v = commands.add_parser("verify", help="check that a model's TP (x DP) run equals the dense model, on CPU "
                                           "processes, before spending accelerator hours on it")
    v.add_argument("model", nargs="?", metavar="MODEL",
                   help="a Hugging Face model directory, a config.json, or a model type such as 'llama'")
    v.add_argument("--factory", metavar="MODULE:FUNCTION", help="a function returning the model (instead of MODEL)")
    v.add_argument("--plan", metavar="MODULE:ATTR",
                   help="an nxdtp.Plan, or a function returning one (default: the model family's plan, or HF's "
                        "tp_plan)")
    v.add_argument("--batch", metavar="MODULE:FUNCTION",
                   help="function(rows, seq_len, generator) -> dict of the global batch's tensors (default: token ids "
                        "as input_ids and labels)")
    v.add_argument("--model-class", metavar="CLASS", help="the transformers class to build from the config")
    v.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    v.add_argument("--dp", type=int, default=1, help="data-parallel size (default 1)")
    v.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    v.add_argument("--full-size", action="store_true", help="keep the config's sizes (default: a tiny config of the "
                                                            "same architecture)")
    v.add_argument("--batch-size", type=int, default=2, help="rows per DP rank (default 2)")
    v.add_argument("--seq-len", type=int, default=16, help="sequence length (default 16)")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance (default 1e-5, fp32)")
    v.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance (default 1e-5)")
    v.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                   help="AdamW (eps 1e-4) or plain SGD (default adamw)")
    v.add_argument("--lr", type=float, default=1e-3)
    v.add_argument("--timeout", type=float, default=1800, help="seconds the workers may take (default 1800)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command line; return the exit status (0 PASS, 1 FAIL, 2 bad input)."""
    from . import verify
    from .launch import SetupFailed

    try:
        args = _parser().parse_args(argv)
        if args.command != "verify":
            raise _BadUsage("give a command: verify")
        if (args.model is None) == (args.factory is None):
            raise _BadUsage("give MODEL or --factory MODULE:FUNCTION (one of them)")
        report = verify(args.model, factory=args.factory, plan=args.plan, batch=args.batch,
                        model_class=args.model_class, tp=args.tp, dp=args.dp, steps=args.steps,
                        full_size=args.full_size, seed=args.seed, batch_size=args.batch_size, seq_len=args.seq_len,
                        atol=args.atol, rtol=args.rtol, optimizer=args.optimizer, lr=args.lr,
                        timeout_s=args.timeout)
    except (_BadUsage, SetupFailed, ValueError, TypeError, OSError) as e:
        print(f"{PROG}: error: {e}".splitlines()[0], file=sys.stderr)
        return EXIT_BAD_INPUT
    for line in report.lines():
        print(line)
    return 0 if report.passed else EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())

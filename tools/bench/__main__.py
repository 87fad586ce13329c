"""nxdtp benchmark: ``python -m tools.bench [SECTION ...] [--quick] [--json OUT]`` runs sections of the suite and
prints them as markdown (``python tools/benchmark.py --sections a,b`` is the same); ``python -m tools.bench TOOL
[...]`` runs a measurement with options of its own (``TOOL --help``). docs/performance.md says how each measures."""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib
import math
import os
import sys
import time
import types
from typing import Any, Callable, Dict

from . import common

# section: (its key in the JSON, its title in the report)
SECTIONS = {"train": ("train_step", "1. Train step, CPU"), "memory": ("memory", "2. Memory per rank, BERT-large"),
            "comm": ("communication", "3. Communication per BERT layer"),
            "xla": ("xla_graphs", "4. XLA graphs per step"), "merge": ("checkpoint_merge", "5. Checkpoint merge"),
            "actmem": ("activation_memory", "6. Activation memory per rank, BERT-large layers"),
            "zero1": ("zero1", "7. ZeRO-1: bytes per parameter, peak RSS, step time"),
            "async_save": ("async_save", "8. Checkpoint stall: save_checkpoint, sync against async_save"),
            "moe": ("moe", "9. Mixture of experts: TP x EP"),
            "logits": ("logits", "10. Full-vocabulary logits: what they cost"),
            "gpu": ("gpu_train_step", "GPU: train step, dense vs nxdtp tp=1")}
KEYS, TITLES = ({k: v[i] for k, v in SECTIONS.items()} for i in (0, 1))
# the function that runs a section: "module.function", by default its JSON key's module's run
RUNNERS = {**{k: f"{v}.run" for k, v in KEYS.items()}, "merge": "merge_timing.run",
           "async_save": "zero1.run_async_save", "gpu": "train_step.run_gpu"}
TOOLS = {"merge_timing": "merge_timing", "verify": "verification", "divergence": "divergence"}  # name: module
EPILOG = "\n".join(["Suite sections (gpu only when named, or --gpu):", *(f"  {k:<11} {t}" for k, t in TITLES.items()),
                    f"Tools: {', '.join(TOOLS)}. Progress goes to stderr, the report to stdout."])


def _arguments(argv) -> tuple:
    """The options, and the sections they name, in the report's order."""
    parser = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    parser.add_argument("section", nargs="*", help="suite sections to run (default: all but gpu)")
    parser.add_argument("--sections", help="the same, comma-separated (tools/benchmark.py's form)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats: checks that all works")
    parser.add_argument("--json", metavar="OUT", help="write every figure to this JSON file")
    parser.add_argument("--rounds", type=int, help="timed alternating rounds of section 1 (default 10, --quick 3)")
    parser.add_argument("--warmup", type=int, help="warm-up steps per competitor of section 1 (default 2)")
    parser.add_argument("--nxdtp-vocab-multiple", dest="vocab_multiple", type=int, default=128, metavar="N",
                        help="section 1: make_vocab_size_divisible_by for nxdtp (default 128, as the example uses)")
    parser.add_argument("--profile", action="store_true", help="section 1: also profile one step of each competitor")
    parser.add_argument("--gpu", action="store_true", help="also run the gpu section")
    parser.add_argument("--gpu-device", default="cuda:0", help=argparse.SUPPRESS)  # "cpu" checks that code path
    parser.add_argument("--merge-rounds", type=int, help="rounds of section 5 (default 3, --quick 1)")
    parser.add_argument("--merge-workdir", help="where section 5 keeps its checkpoint (reused when present)")
    args = parser.parse_args(argv)
    named = list(args.section) + [s.strip() for s in (args.sections or "").split(",") if s.strip()]
    sections = (named or [s for s in SECTIONS if s != "gpu"]) + (["gpu"] if args.gpu else [])
    if set(sections) - set(KEYS):
        parser.error(f"unknown sections {sorted(set(sections) - set(KEYS))}; choose from {list(KEYS)}, or a tool of "
                     f"{list(TOOLS)}")
    return args, [s for s in KEYS if s in sections]


def _runners(ctx, background) -> Dict[str, Callable[[], Any]]:
    """Under --quick the XLA parts (processes of their own) start at once, beside section 1, to use both cores; a full
    run does everything one after the other, so nothing disturbs the timed sections."""
    module = {k: importlib.import_module(f".{r.split('.')[0]}", __package__) for k, r in RUNNERS.items()}
    runners = {k: (lambda k=k: getattr(module[k], RUNNERS[k].split(".")[1])(ctx)) for k in RUNNERS}
    spec = module["train"].QUICK if ctx.quick else module["train"].FULL
    early = {k: background.submit(fn).result for k, fn in (("comm", lambda: module["comm"].trace_hlo(spec)),
                                                            ("xla", runners["xla"]))
             if background and k in ctx.sections}
    return {**runners, "xla": early.get("xla", runners["xla"]),
            "comm": lambda: module["comm"].run(ctx, early["comm"]() if "comm" in early else None)}


def run_suite(args, sections) -> Dict[str, Any]:
    from .train_step import Competitors

    ctx = types.SimpleNamespace(**{**vars(args), "sections": sections, "competitors": Competitors()})
    results, seconds = {}, {}
    # Sections 1, gpu and 3 share the competitors' workers; the others start worlds of their own after those end.
    shared = ("train", "gpu", "comm")
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as background, contextlib.closing(ctx.competitors):
        runners = _runners(ctx, background if args.quick else None)
        for name in [s for s in shared if s in sections] + [s for s in sections if s not in shared]:
            if name not in shared:
                ctx.competitors.close()
            started = time.perf_counter()
            results[KEYS[name]] = runners[name]()
            seconds[name] = time.perf_counter() - started
            common.log(f"{TITLES[name]}: done in {seconds[name]:.1f} s")
    return {"sections": results, "section_wall_s": seconds}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    with common.report_on_stdout():
        if argv and argv[0] in TOOLS:
            return importlib.import_module(f".{TOOLS[argv[0]]}", __package__).main(argv[1:])
        return _suite(argv)


def _suite(argv) -> int:
    args, sections = _arguments(argv)
    started, machine = time.perf_counter(), common.machine()
    out = run_suite(args, sections)
    machine["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    wall, command = time.perf_counter() - started, " ".join(["python -m tools.bench", *argv])
    problems = {KEYS[n]: bad for n in sections if (bad := [k for k, v in out["sections"][KEYS[n]]["numbers"].items()
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)])}
    tables = [b for n in sections for b in (f"## {TITLES[n]}", *out["sections"][KEYS[n]]["tables"])]
    common.emit([f"# nxdtp benchmark{' (--quick: tiny sizes, not for comparison)' if args.quick else ''}",
                 f"{machine['date_utc']}; {machine['cpu_model']}, {machine['logical_cpus']} logical CPUs "
                 f"({machine['usable_cpus']} usable), {common.cell(machine['memory_gib'], '.1f')} GiB; "
                 f"{machine['platform']}; Python {machine['python']}, torch {machine['torch']}, torch-xla "
                 f"{machine['torch_xla']}, transformers {machine['transformers']}; load average at start "
                 f"{machine['load_average_at_start']}, at end {machine['load_average_at_end']}. Command: `{command}`; "
                 f"{wall:.0f} s.", *tables],
                {"command": command, "quick": args.quick, "sections_run": sections, "machine": machine, "wall_s": wall,
                 **out, "non_finite_numbers": problems}, args.json)
    if problems:
        common.log(f"sections with missing or non-finite numbers: {problems}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""``tools/benchmark.py --quick`` runs end to end: every section reports its numbers (present and finite), and the
three train-step competitors (dense, nxdtp TP=2, DTensor TP=2) end at the same loss.

No timing is asserted: --quick uses tiny models and shares the machine with the rest of the suite. The benchmark runs
once per session, as a subprocess, like a user would run it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
HAS_XLA = importlib.util.find_spec("torch_xla") is not None
SECTIONS = {"train": "train_step", "memory": "memory", "comm": "communication", "xla": "xla_graphs",
            "merge": "checkpoint_merge"}
# Without torch_xla, the two XLA parts cannot run: the HLO count of section 3 and section 4.
RUN = [s for s in SECTIONS if HAS_XLA or s not in ("comm", "xla")]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("benchmark") / "quick.json"
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "benchmark.py"), "--quick", "--json", str(out),
                          "--sections", ",".join(RUN)],
                         capture_output=True, text=True, timeout=900, cwd=ROOT, env=dict(os.environ))
    assert run.returncode == 0, f"stdout:\n{run.stdout[-5000:]}\nstderr:\n{run.stderr[-10000:]}"
    return json.loads(out.read_text()), run.stdout


def test_every_section_reports_finite_numbers(quick):
    report, _ = quick
    assert report["quick"] is True
    assert report["non_finite_numbers"] == {}
    for section in RUN:
        numbers = report["sections"][SECTIONS[section]]["numbers"]
        assert numbers, section
        bad = {k: v for k, v in numbers.items()
               if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)}
        assert not bad, f"{section}: {bad}"
    assert report["machine"]["cpu_model"] and report["machine"]["torch"]


def test_train_step_losses_agree(quick):
    report, _ = quick
    train = report["sections"]["train_step"]
    losses = train["loss_agreement"]["losses"]
    assert set(losses) == {"dense", "nxdtp", "dtensor"}
    reference = losses["dense"]
    for kind, loss in losses.items():
        assert math.isfinite(loss)
        assert abs(loss - reference) <= train["loss_agreement"]["rtol"] * abs(reference), (kind, losses)
    assert train["loss_agreement"]["agree"] is True
    # Every timed round of every competitor produced a step time, and both ranks of a TP run reported the same loss.
    for kind, competitor in train["competitors"].items():
        assert len(competitor["step_s_per_round"]) == train["rounds"], kind
        assert competitor["last_loss_ranks_equal"], kind


def test_report_has_a_table_per_section(quick):
    _, stdout = quick
    titles = {"train": "## 1. Train step, CPU", "memory": "## 2. Memory per rank", "comm": "## 3. Communication",
              "xla": "## 4. XLA graphs", "merge": "## 5. Checkpoint merge"}
    for section in RUN:
        assert titles[section] in stdout, section
    assert stdout.count("|---|") >= len(RUN)

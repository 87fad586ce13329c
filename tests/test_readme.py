"""The README's example runs as written, under torchrun with 2 ranks, and its TP output equals the dense one."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## A tensor-parallel MLP"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_tp_example_runs_under_torchrun(tmp_path):
    script = tmp_path / "tp_mlp.py"
    script.write_text(_readme_example())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script)], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    # The ranks' lines may interleave on the shared stdout, so match the numbers tightly.
    differences = re.findall(r"rank (\d): max \|TP - dense\| = ([0-9.e+-]+), grad norm ([0-9]+\.[0-9]{4})", run.stdout)
    assert sorted(r for r, _, _ in differences) == ["0", "1"], run.stdout
    assert all(float(d) < 1e-5 for _, d, _ in differences), run.stdout
    # Both ranks compute the same TP-wide gradient norm.
    assert len({n for _, _, n in differences}) == 1, run.stdout

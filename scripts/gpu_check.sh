#!/usr/bin/env bash
# The CUDA runner's check on a machine with an NVIDIA GPU, torch with CUDA, triton and pytest installed; nothing is
# downloaded. Under 8 minutes on an H100 (each part has its own time limit):
#   1. the Triton kernel tests compiled for the GPU (tests/test_triton_kernels.py, fp16 tolerance 2e-2);
#   2. the runner tests on the GPU (tests/test_cuda_runner.py: against the reference engine, quantized weights, CUDA
#      graphs, fp8 KV or its refusal below sm_89, a 60-turn dialogue at a fixed budget whose memory never grows);
#      they build tiny engines, so they need the project's dependencies (tokenizers, jinja2, gguf, llguidance, ...):
#      where one is missing the part fails and the log says which;
#   3. benchmarks/gpu_check.py: random weights at Llama-3.2-3B's, the default model's and Qwen3-4B's shapes (in that
#      order): logits against transformers on the same weights (fp16), decode tok/s with fp16, int8 and fp8 KV at 512,
#      4,096 and 16,384 tokens from CUDA graphs (and eagerly at 4,096), the fraction of the GPU's read bandwidth,
#      prefill tok/s, TTFT of turn 10 with and without reuse, transformers' generate (static cache, eager and compiled)
#      as the peer, peak GPU memory against the planner's memory model. Results are written after each measurement, so
#      a part cut by its time limit keeps what it measured.
# Writes into $OUT (default: a new temporary folder): env.txt, kernel_tests.txt, runner_tests.txt, gpu_check.json,
# gpu_check.txt, summary.json. Usage: OUT=/some/folder scripts/gpu_check.sh   (PYTHON=... to pick the interpreter)
# Parts 2 and 3 import the project's dependencies; a machine without network that lacks some (env.txt lists the
# missing ones) takes them as wheels: WHEELS=folder, filled beforehand where there is network with
#   pip download -d folder --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       --platform manylinux_2_28_x86_64 gguf llguidance jsonschema fastapi uvicorn pydantic
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
# cabinllm.<folder> maps the repository's folders (pyproject.toml's package-dir), without installing anything
PKG=$(mktemp -d)
mkdir -p "$PKG/cabinllm"
for folder in runtime calibration builders server cli benchmarks; do ln -s "$ROOT/$folder" "$PKG/cabinllm/$folder"; done
export PYTHONPATH="$PKG" CABIN_NATIVE_KERNELS=0
unset TRITON_INTERPRET
cd "$ROOT"
if [ -n "${WHEELS:-}" ]; then
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" gguf llguidance jsonschema fastapi uvicorn pydantic \
        > "$OUT/wheels.txt" 2>&1 || echo "installing the wheels failed: $OUT/wheels.txt"
fi

"$PY" - > "$OUT/env.txt" 2>&1 <<'PYEOF'
import torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
print(torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA GPU",
      torch.cuda.get_device_capability() if torch.cuda.is_available() else "")
import importlib.util
missing = [m for m in ("gguf", "llguidance", "jsonschema", "fastapi", "uvicorn", "pydantic", "pytest")
           if importlib.util.find_spec(m) is None]
print("missing:", " ".join(missing) or "none")
PYEOF
cat "$OUT/env.txt"

timeout 60 "$PY" -m pytest -q -p no:cacheprovider --noconftest tests/test_triton_kernels.py > "$OUT/kernel_tests.txt" 2>&1
kernels=$?
tail -3 "$OUT/kernel_tests.txt"
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda_runner.py > "$OUT/runner_tests.txt" 2>&1
runner=$?
tail -3 "$OUT/runner_tests.txt"
timeout 290 "$PY" -m cabinllm.benchmarks.gpu_check --out "$OUT"
bench=$?

printf '{"kernel_tests_rc": %d, "runner_tests_rc": %d, "gpu_check_rc": %d}\n' "$kernels" "$runner" "$bench" \
    > "$OUT/summary.json"
cat "$OUT/summary.json"
echo "results in $OUT"
[ "$kernels" -eq 0 ] && [ "$runner" -eq 0 ] && [ "$bench" -eq 0 ]

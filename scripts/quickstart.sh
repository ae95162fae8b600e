#!/usr/bin/env bash
# The main job on the embedded default model (SmolLM2-135M-Instruct): set up if needed,
# build an INT8-KV engine, then play a short scripted dialogue with FP16 and with INT8 KV.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BIN="${CABIN_VENV:-.venv}/bin"
ENGINE="${CABIN_ENGINE:-engines/smollm2-135m-int8}"
if [ ! -f "$ENGINE/manifest.json" ]; then
    "$BIN/cabin-build" --model default --output "$ENGINE" --kv-cache int8
fi
for MODE in fp16 int8; do
    echo
    echo "=== scripted dialogue, $MODE KV cache ==="
    "$BIN/cabin-chat" --engine "$ENGINE" --script scripts/demo_dialogue.jsonl --kv-cache "$MODE" \
        --kv-budget-mb 32 --max-new-tokens 48
done

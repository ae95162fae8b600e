#!/usr/bin/env bash
# The main job on the embedded default model (SmolLM2-135M-Instruct), end to end:
# set up if needed, calibrate KV scales on the built-in cockpit dialogues, plan memory for a
# Jetson Orin Nano, build an INT8-KV engine with equalization, play a scripted dialogue with
# FP16 and with INT8 KV (memory used), call the car's functions under a grammar, speak a command that
# becomes a call, and measure INT8 quality against full precision.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BIN="${CABIN_VENV:-.venv}/bin"
OUT="${CABIN_OUT:-out}"
ENGINE="${CABIN_ENGINE:-engines/smollm2-135m-int8-eq}"
SCALES="$OUT/kv_scales.json"
mkdir -p "$OUT"

echo "=== 1. calibrate INT8 KV scales on built-in cockpit dialogues ==="
if [ ! -f "$SCALES" ]; then
    "$BIN/cabin-calibrate" --model default --data builtin --output "$SCALES" --report "$OUT/calibration_report"
fi

echo; echo "=== 2. memory plan for orin-nano-8gb ==="
"$BIN/cabin-plan" --model default --target orin-nano-8gb

echo; echo "=== 3. build the INT8-KV engine (equalized weights; a no-op when already built) ==="
"$BIN/cabin-build" --model default --target cpu --kv-cache int8 --scales "$SCALES" --equalize --output "$ENGINE"

for MODE in fp16 int8; do
    echo; echo "=== 4. scripted dialogue, $MODE KV cache ==="
    "$BIN/cabin-chat" --engine "$ENGINE" --script scripts/demo_dialogue.jsonl --kv-cache "$MODE" \
        --kv-budget-mb 32 --max-new-tokens 48
done

echo; echo "=== 5. the assistant acts on the car: replies constrained to calls of the car's functions ==="
"$BIN/cabin-chat" --engine "$ENGINE" --script scripts/demo_tools.jsonl --tools builtin --tool-choice required \
    --kv-budget-mb 32 --max-new-tokens 128

echo; echo "=== 6. a spoken command becomes a tool call (espeak-ng speaks it, Whisper tiny.en hears it) ==="
if command -v espeak-ng >/dev/null && command -v sox >/dev/null; then
    CABIN_ENGINE="$ENGINE" bash scripts/demo_voice.sh
else
    echo "skipped: needs espeak-ng and sox to make the speech (apt-get install espeak-ng sox)"
fi

echo; echo "=== 7. quality of INT8 KV against full precision (held-out built-in dialogues) ==="
# Evaluated on the original weights: int8-eq applies the same equalization the engine carries.
"$BIN/cabin-eval" --model default --data builtin --kv-cache fp16,int8,int8-eq,int8-dynamic \
    --scales "$SCALES" --num-dialogues 6 --max-tokens 1024 --output "$OUT/eval"

echo; echo "=== next: chat with the engine you built ==="
echo "    $BIN/cabin-chat --engine $ENGINE"

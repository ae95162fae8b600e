#!/usr/bin/env bash
# A spoken command acts on the car: espeak-ng says "turn the temperature up to twenty two degrees" into a WAV,
# cabin-chat hears it (Whisper tiny.en through the speech front end) on the default model (SmolLM2-135M-Instruct)
# with the car's functions, and prints what it heard and the call the model made. Then the same speech as a raw
# PCM stream (what a microphone gives) through --listen -.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${CABIN_VENV:-.venv}/bin"
ENGINE="${CABIN_ENGINE:-engines/smollm2-int8}"
SAY="${1:-turn the temperature up to twenty two degrees}"
for tool in espeak-ng sox; do
    command -v "$tool" >/dev/null || { echo "demo_voice: needs $tool (apt-get install espeak-ng sox)" >&2; exit 1; }
done
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

if [ ! -f "$ENGINE/manifest.json" ]; then
    echo "=== 0. build the default engine ($ENGINE) ==="
    "$BIN/cabin-build" --model default --output "$ENGINE"
fi

echo "=== 1. speak the command: \"$SAY\" (espeak-ng, 22.05 kHz WAV: cabin-chat resamples it) ==="
espeak-ng -v en-us -w "$WORK/command.wav" "$SAY"
echo '{"role": "user", "audio": "command.wav"}' > "$WORK/spoken.jsonl"

echo; echo "=== 2. cabin-chat hears the script's spoken line and calls the car's function ==="
"$BIN/cabin-chat" --engine "$ENGINE" --script "$WORK/spoken.jsonl" --tools builtin --tool-choice required \
    --temperature 0 --kv-budget-mb 32 --max-new-tokens 64

echo; echo "=== 3. the same command as a live stream: raw 16-bit 16 kHz mono PCM on stdin (as arecord gives) ==="
sox "$WORK/command.wav" -t raw -r 16000 -c 1 -b 16 -e signed-integer -L - pad 0.5 1.5 \
    | "$BIN/cabin-chat" --engine "$ENGINE" --listen - --tools builtin --tool-choice required \
        --temperature 0 --kv-budget-mb 32 --max-new-tokens 64

#!/usr/bin/env bash
# The long schema-fuzzing run: start cabin-serve on an engine (behind an API key, on a free loopback port), run
# Schemathesis over its /openapi.json with the checks of tests/test_serve_fuzz.py, stop the server, and say whether
# its log holds a traceback. Usage: scripts/fuzz_server.sh [ENGINE] [EXAMPLES_PER_OPERATION] (defaults: the
# quickstart's engine, 1000).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${CABIN_VENV:-.venv}/bin"
ENGINE="${1:-engines/smollm2-135m-int8-eq}"
EXAMPLES="${2:-1000}"
[ -d "$ENGINE" ] || { echo "fuzz_server: no engine folder $ENGINE; build one (scripts/quickstart.sh) or name one" >&2; exit 2; }
KEY="fuzz-$RANDOM$RANDOM"
PORT="$("$BIN/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
LOG="$(mktemp)"
CABIN_API_KEY="$KEY" "$BIN/cabin-serve" --engine "$ENGINE" --port "$PORT" --max-tokens 16 2> "$LOG" &
SERVER=$!
trap 'kill "$SERVER" 2> /dev/null || true; wait "$SERVER" 2> /dev/null || true' EXIT
for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    sleep 0.5
done
status=0
"$BIN/st" run "http://127.0.0.1:$PORT/openapi.json" -H "Authorization: Bearer $KEY" --max-examples "$EXAMPLES" \
    --seed "${CABIN_FUZZ_SEED:-0}" --checks not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,response_headers_conformance,negative_data_rejection \
    || status=$?
kill -TERM "$SERVER"; wait "$SERVER" || status=$?
trap - EXIT
if grep -q Traceback "$LOG"; then echo "fuzz_server: the server log holds a traceback: $LOG" >&2; status=1; fi
echo "fuzz_server: server log $LOG ($(wc -l < "$LOG") lines)"
exit "$status"

#!/usr/bin/env bash
# Set up if needed, then run the test suite (CPU only, offline). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${CABIN_VENV:-.venv}/bin/python" -m pytest -q "$@"

#!/usr/bin/env bash
# Install what the book and the tests need into the current Python environment.
# Keeps an existing torch (a CUDA build stays); installs torch==2.13.0 only if none is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "setup: no torch found, installing torch==2.13.0"
  "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -r requirements.txt
"$PY" -m pip install -q --no-deps -e .
"$PY" -c "import fa_lab; fa_lab.banner()"

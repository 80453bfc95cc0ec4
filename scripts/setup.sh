#!/usr/bin/env bash
# Install what the book and the tests need into the current Python environment: fa_lab from this
# clone (editable, so the notebooks and `fa-lab grade` see your changes) with its book and test extras.
# Keeps an existing torch (a CUDA build stays); installs torch==2.13.0 only if none is there: the CPU
# build on Linux without an NVIDIA driver (PyPI's Linux torch is the CUDA build, several GB more).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  if [ "$(uname -s)" = Linux ] && ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "setup: no torch and no NVIDIA GPU found, installing the CPU build of torch==2.13.0"
    # the CPU index where it can be reached; otherwise the default index (which some mirrors serve as CPU)
    "$PY" -m pip install -q --retries 1 --timeout 20 torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
      || { echo "setup: the CPU index is out of reach, installing torch==2.13.0 from the default index";
           "$PY" -m pip install -q torch==2.13.0; }
  else
    echo "setup: no torch found, installing torch==2.13.0"
    "$PY" -m pip install -q torch==2.13.0
  fi
fi
# the installed torch satisfies pyproject's torch>=2.4, so pip leaves it alone
"$PY" -m pip install -q -e ".[book,test]"
# tests/test_book_browser.py drives Debian's Chromium (never a downloaded browser); it skips without one.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing Debian's chromium and chromium-driver for the browser test"
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; } >/dev/null \
      || echo "setup: could not install chromium: the browser test will be skipped"
  else
    echo "setup: no chromium/chromedriver and not root: the browser test will be skipped"
  fi
fi
"$PY" -c "import fa_lab; fa_lab.banner()"

#!/usr/bin/env bash
# The full GPU run: every notebook of the book at full size, then the whole test suite, on a CUDA GPU.
#
#   bash scripts/gpu_run_notebooks.sh [OUTDIR]          (OUTDIR defaults to $OUT, else _build/gpu_run)
#
# Leaves in OUTDIR: gpu_notebooks.json (copy it to fa_lab/data/: the book's status page shows it),
# executed.tar.gz (the executed notebooks), pytest.log and gpu_run.log.
# Knobs: NB_BUDGET (seconds after which no further notebook starts, default 330), NB_TIMEOUT (seconds
# after which the notebook run is killed, default 420), CELL_TIMEOUT (default 300), TEST_TIMEOUT
# (seconds for the test suite, default 150), NBVAL_BOOK=1 (also run book/ under nbval: the notebooks
# above already ran every cell of it).
#
# A machine without jupyter (the lent GPU machines have torch/triton/numba but no nbclient,
# ipykernel or nbval) gets them from wheels in .whl/notebooks/, made on the developer's machine:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl/notebooks nbclient nbformat jupyter_client jupyter_core ipykernel ipython nbval ...
# (the full list, with versions, is in the closing note of issue 9).
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-${OUT:-_build/gpu_run}}
[ $# -gt 0 ] && shift  # the rest goes to gpu_run_notebooks.py (e.g. --allow-cpu for a dry run here)
PY=${PYTHON:-python3}
mkdir -p "$OUTDIR"
exec > >(tee "$OUTDIR/gpu_run.log") 2>&1

if ! "$PY" -c "import nbclient, ipykernel, nbval" >/dev/null 2>&1; then
  if compgen -G ".whl/notebooks/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/fa_lab_site .whl/notebooks/*.whl || exit 1
    export PYTHONPATH=/tmp/fa_lab_site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "gpu_run: nbclient/ipykernel/nbval are missing and .whl/notebooks/ holds no wheels"; exit 1
  fi
fi
# fa_lab from this checkout, installed or not; the notebooks' kernels inherit this too
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

t0=$(date +%s)
timeout "${NB_TIMEOUT:-420}" "$PY" scripts/gpu_run_notebooks.py --out "$OUTDIR" --budget "${NB_BUDGET:-330}" \
  --cell-timeout "${CELL_TIMEOUT:-300}" "$@"
nb_rc=$?
echo "gpu_run: notebooks took $(( $(date +%s) - t0 )) s (exit $nb_rc)"

t1=$(date +%s)
targets=(tests exercises)
[ "${NBVAL_BOOK:-0}" = 1 ] && targets+=(book)
# pytest-timeout >= 2.3 stops the session itself and still prints the summary line
stop=()
"$PY" -m pytest --help 2>/dev/null | grep -q -- --session-timeout && stop=(--session-timeout "${TEST_TIMEOUT:-150}")
timeout $(( ${TEST_TIMEOUT:-150} + 30 )) "$PY" -m pytest "${targets[@]}" --nbval-lax --nbval-current-env -q \
  "${stop[@]}" >"$OUTDIR/pytest.log" 2>&1
test_rc=$?
tail -n 25 "$OUTDIR/pytest.log"
summary=$(grep -E "^=*.*( passed| failed| error)" "$OUTDIR/pytest.log" | tail -n 1 | tr -d '=' | xargs)
[ "$test_rc" = 124 ] && summary="stopped after ${TEST_TIMEOUT:-150} s: $summary"
summary="pytest ${targets[*]} --nbval-lax: ${summary:-no summary (exit $test_rc)}; $(( $(date +%s) - t1 )) s"
echo "gpu_run: $summary"
SUMMARY="$summary" "$PY" - "$OUTDIR/gpu_notebooks.json" <<'PY'
import json, os, sys
path = sys.argv[1]
if os.path.exists(path):
    blob = json.load(open(path))
    blob["meta"]["tests"] = os.environ["SUMMARY"]
    json.dump(blob, open(path, "w"), indent=1)
PY

# the executed notebooks as one file (the device tool brings back few files)
if [ -d "$OUTDIR/executed" ]; then
  tar -czf "$OUTDIR/executed.tar.gz" -C "$OUTDIR" executed && rm -rf "$OUTDIR/executed"
fi
[ "$nb_rc" = 0 ] && [ "$test_rc" = 0 ]

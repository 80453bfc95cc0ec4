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
# above already ran every cell of it), PARTS (default "notebooks tests"; "grade" grades the exercises'
# model answers at full size into the record's meta; one part alone splits the run into calls), WORKERS (pytest-xdist processes for the tests, default 1: compiling the kernels is
# most of a GPU test run, and the GPU machines have 16 cores), NOTEBOOKS (only these notebooks, their
# records merged into fa_lab/data/gpu_notebooks.json's).
#
# A machine without jupyter (GPU machines that have torch/triton/numba/pytest but no nbclient,
# ipykernel, nbval or hypothesis) gets them from wheels in .whl/notebooks/ (git-ignored), fetched beforehand on a
# machine with pip and a network by `bash scripts/gpu_run_notebooks.sh --fetch-wheels` (CPython 3.12).
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS="asttokens==3.0.1 comm==0.2.3 debugpy==1.8.22 decorator==5.2.1 executing==2.2.1 fastjsonschema==2.22.3
  ipykernel==7.4.0 ipython==8.18.1 jedi==0.20.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
  jupyter-client==8.10.0 jupyter-core==5.9.1 matplotlib-inline==0.2.2 nbclient==0.11.0 nbformat==5.11.1
  nbval==0.11.0 nest-asyncio2==1.7.4 parso==0.8.7 pexpect==4.8.0 platformdirs==4.14.7 prompt-toolkit==3.0.52
  ptyprocess==0.7.0 pure-eval==0.2.3 pyzmq==27.3.0 referencing==0.37.0 rpds-py==0.30.0 stack-data==0.6.3
  tornado==6.6.1 traitlets==5.15.0 wcwidth==0.7.0 execnet==2.1.2 pytest-xdist==3.8.0
  hypothesis==6.170.15 sortedcontainers==2.4.0"
if [ "${1:-}" = --fetch-wheels ]; then
  exec "${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl/notebooks $WHEELS
fi
OUTDIR=${1:-${OUT:-_build/gpu_run}}
[ $# -gt 0 ] && shift  # the rest goes to gpu_run_notebooks.py (e.g. --allow-cpu for a dry run here)
PY=${PYTHON:-python3}
mkdir -p "$OUTDIR"
exec > >(tee "$OUTDIR/gpu_run.log") 2>&1

if ! "$PY" -c "import nbclient, ipykernel, nbval, xdist, hypothesis" >/dev/null 2>&1; then
  if compgen -G ".whl/notebooks/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/fa_lab_site .whl/notebooks/*.whl || exit 1
    export PYTHONPATH=/tmp/fa_lab_site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "gpu_run: nbclient/ipykernel/nbval/xdist/hypothesis are missing and .whl/notebooks/ holds no wheels"; exit 1
  fi
fi
# fa_lab from this checkout, installed or not; the notebooks' kernels inherit this too
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

PARTS=${PARTS:-notebooks tests}
nb_rc=0
test_rc=0
if [[ " $PARTS " == *" notebooks "* ]]; then
t0=$(date +%s)
only=()
[ -n "${NOTEBOOKS:-}" ] && only=(--update fa_lab/data/gpu_notebooks.json $NOTEBOOKS)
timeout "${NB_TIMEOUT:-420}" "$PY" scripts/gpu_run_notebooks.py --out "$OUTDIR" --budget "${NB_BUDGET:-330}" \
  --cell-timeout "${CELL_TIMEOUT:-300}" "$@" "${only[@]}"
nb_rc=$?
echo "gpu_run: notebooks took $(( $(date +%s) - t0 )) s (exit $nb_rc)"
fi

if [[ " $PARTS " == *" tests "* ]]; then

t1=$(date +%s)
targets=(tests exercises)
[ "${NBVAL_BOOK:-0}" = 1 ] && targets+=(book)
# pytest-timeout >= 2.3 stops the session itself and still prints the summary line
stop=()
"$PY" -m pytest --help 2>/dev/null | grep -q -- --session-timeout && stop=(--session-timeout "${TEST_TIMEOUT:-150}")
# several workers: each notebook stays whole on one of them (its cells share one kernel)
xdist=()
[ "${WORKERS:-1}" -gt 1 ] && xdist=(-n "$WORKERS" --dist loadfile)
timeout $(( ${TEST_TIMEOUT:-150} + 30 )) "$PY" -m pytest "${targets[@]}" --nbval-lax --nbval-current-env -q \
  "${stop[@]}" "${xdist[@]}" >"$OUTDIR/pytest.log" 2>&1
test_rc=$?
tail -n 25 "$OUTDIR/pytest.log"
# the summary line, or (a run cut off at its limit prints none) the count of its progress marks
PREFIX="pytest ${targets[*]} --nbval-lax ${xdist[*]}" SECONDS_TAKEN=$(( $(date +%s) - t1 )) \
"$PY" - "$OUTDIR/gpu_notebooks.json" "$OUTDIR/pytest.log" <<'PY'
import json, os, re, sys
path, log = sys.argv[1:3]
lines = open(log, errors="replace").read().splitlines()
final = [ln.strip("= ") for ln in lines if re.search(r"\d+ (passed|failed|errors?)\b", ln)]
if final:
    summary = final[-1]
else:
    marks = "".join(re.sub(r"\s*\[.*", "", ln) for ln in lines if re.fullmatch(r"[.FEsxX]+\s*(\[\s*\d+%\])?", ln.strip()))
    summary = (f"cut off at its time limit: {marks.count('.')} passed, {marks.count('F')} failed, "
               f"{marks.count('E')} errors, {marks.count('s')} skipped so far")
summary = f"{os.environ['PREFIX']}: {summary} ({os.environ['SECONDS_TAKEN']} s)"
print("gpu_run:", summary)
if os.path.exists(path):
    blob = json.load(open(path))
    blob["meta"]["tests"] = summary
    json.dump(blob, open(path, "w"), indent=1)
PY
fi

grade_rc=0
if [[ " $PARTS " == *" grade "* ]]; then
# the exercises' model answers graded at full size (kernel exercises included), into the record's meta
t2=$(date +%s)
"$PY" -m fa_lab.cli grade exercises --solutions --require-full --json >"$OUTDIR/grade_solutions.json"
grade_rc=$?
SECONDS_TAKEN=$(( $(date +%s) - t2 )) RC=$grade_rc \
"$PY" - "$OUTDIR/gpu_notebooks.json" "$OUTDIR/grade_solutions.json" <<'PY'
import datetime, json, os, sys
path, graded = sys.argv[1:3]
book = json.load(open(graded))
summary = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command="fa-lab grade exercises --solutions --require-full", exit=int(os.environ["RC"]),
               seconds=int(os.environ["SECONDS_TAKEN"]), score=book["score"], max_score=book["max_score"],
               notebooks=[dict(notebook=n["notebook"], score=n["score"], max_score=n["max_score"],
                               seconds=n["seconds"], errors=n["errors"],
                               exercises={e["name"]: f"{e['score']}/{e['max_score']}" for e in n["exercises"]})
                          for n in book["notebooks"]])
print("gpu_run: model answers graded:", summary["score"], "/", summary["max_score"], "in", summary["seconds"], "s")
blob = json.load(open(path)) if os.path.exists(path) else json.load(open("fa_lab/data/gpu_notebooks.json"))
blob["meta"]["exercise_solutions"] = summary
from fa_lab.bench import records
records.write(path, blob["records"], blob["meta"])
PY
fi

# the executed notebooks as one file (the device tool brings back few files)
if [ -d "$OUTDIR/executed" ]; then
  tar -czf "$OUTDIR/executed.tar.gz" -C "$OUTDIR" executed && rm -rf "$OUTDIR/executed"
fi
[ "$nb_rc" = 0 ] && [ "$test_rc" = 0 ] && [ "$grade_rc" = 0 ]

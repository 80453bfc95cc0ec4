#!/usr/bin/env bash
# Run flash-attn's own test file (tests/test_flash_attn.py of flash-attn 2.7) against fa_lab.flash_attn.
#
#   scripts/run_flash_attn_tests.sh PATH/test_flash_attn.py [--ids FILE] [pytest args...]
#   scripts/run_flash_attn_tests.sh .flash_attn_tests/test_flash_attn.py -k "test_flash_attn_output and 0.0-"
#
# --ids FILE runs only the tests FILE names, one a line as pytest ids them
# (test_flash_attn_output[0.0-0.0-113-203-59-False-False-False-False-mha-dtype0-True]).
#
# The file is flash-attn's, unchanged: tests/flash_attn_compat/flash_attn stands in for the flash_attn
# package (it re-exports fa_lab.flash_attn) by going first on PYTHONPATH.  The file needs a CUDA GPU
# (it asks for the device capability when imported) and einops.  Its full grid is tens of thousands of
# cases: pass -k / --maxfail to run part of it.  Cases that fa_lab refuses on purpose (dropout,
# cache_leftpad, a paged k/v in flash_attn_varlen_func) fail with NotImplementedError; the summary
# counts them apart from real failures.  scripts/sample_flash_attn_tests.py picks a seeded sample of
# the collected cases, the same number from each test function, for --ids.
#
# Writes into ${FLASH_ATTN_TESTS_OUT:-_build/flash_attn_tests}: junit.xml, pytest.log and summary.txt.
# Exits with pytest's status.
set -uo pipefail

if [ $# -lt 1 ] || [ ! -f "$1" ]; then
    echo "usage: $0 PATH/test_flash_attn.py [--ids FILE] [pytest args...]   (got: ${1:-nothing})" >&2
    exit 2
fi
TEST_FILE=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
shift
TARGETS=("$TEST_FILE")
if [ "${1:-}" = "--ids" ]; then
    if [ ! -f "${2:-}" ]; then
        echo "--ids needs a file of test ids, one a line (got: ${2:-nothing})" >&2
        exit 2
    fi
    TARGETS=()
    while IFS= read -r name; do
        [ -n "$name" ] && TARGETS+=("$TEST_FILE::$name")
    done < "$2"
    shift 2
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${FLASH_ATTN_TESTS_OUT:-$ROOT/_build/flash_attn_tests}
PYTHON=${PYTHON:-python}
mkdir -p "$OUT"
cd "$ROOT" || exit 2

if ! "$PYTHON" -c "import einops" 2>/dev/null; then
    echo "flash-attn's test file imports einops, which this Python lacks: pip install einops" >&2
    exit 2
fi
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "flash-attn's test file needs a CUDA GPU (it calls torch.cuda.get_device_capability at import)" >&2
    exit 2
fi

# the shim first, then the repository (for fa_lab); tests run the shipped or default launch
# configurations rather than tuning every new shape (as tests/conftest.py does for fa_lab's own tests)
export PYTHONPATH="$ROOT/tests/flash_attn_compat:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export FA_LAB_TRITON_AUTOTUNE=${FA_LAB_TRITON_AUTOTUNE:-0}

"$PYTHON" -m pytest "${TARGETS[@]}" --rootdir "$ROOT" -p no:cacheprovider -q -rN \
    --junitxml "$OUT/junit.xml" "$@" 2>&1 | tee "$OUT/pytest.log"
status=${PIPESTATUS[0]}

"$PYTHON" - "$OUT/junit.xml" "$OUT/summary.txt" <<'EOF'
"""Count the junit report: passed, skipped, refused on purpose (NotImplementedError) and failed."""
import collections
import sys
import xml.etree.ElementTree as ET

report, summary = sys.argv[1], sys.argv[2]
try:
    cases = ET.parse(report).getroot().iter("testcase")
except (OSError, ET.ParseError) as e:
    sys.exit(f"no junit report to summarise ({e})")
counts = collections.Counter()
failures = collections.Counter()
for case in cases:
    problem = case.find("failure")
    if problem is None:
        problem = case.find("error")
    if case.find("skipped") is not None:
        counts["skipped"] += 1
    elif problem is None:
        counts["passed"] += 1
    elif "NotImplementedError" in (problem.get("message") or "") + (problem.text or ""):
        counts["not implemented (on purpose)"] += 1
        message = (problem.get("message") or "").split(":", 1)[-1].strip()
        failures[f"NotImplementedError: {message.split(';')[0][:90]}"] += 1
    else:
        counts["failed"] += 1
        failures[f"{case.get('name', '?').split('[')[0]}: {(problem.get('message') or '')[:90]}"] += 1
lines = [f"{n} {what}" for what, n in counts.most_common()]
lines += ["", "by test and message:"] + [f"  {n:6d}  {what}" for what, n in failures.most_common(40)]
open(summary, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
exit "$status"

#!/usr/bin/env bash
# The GPU check: run on the device machine from the repo root (nothing to install there):
#
#     bash scripts/gpu-check.sh            # full GPU suite, demo, all benchmarks
#     QUICK=1 bash scripts/gpu-check.sh    # shorter benchmarks and demo
#     ONLY="tests/core/test_context_gpu.py" BENCH="context" bash scripts/gpu-check.sh
#     ONLY=none BENCH="pipeline" BENCH_ARGS_pipeline="--no-sweep" bash scripts/gpu-check.sh
#
# ONLY=none skips the tests; BENCH_ARGS_<name> adds arguments to benchmarks/bench_<name>.py.
#
# Logs go to $OUT (the device tool's output folder) or /tmp/ctxkit-gpu-check; the last lines
# are a summary table: test counts, demo status, and every benchmark's SUMMARY line.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export CTXKIT_CACHE_DIR="${CTXKIT_CACHE_DIR:-/tmp/ctxkit-cache}"
OUT="${OUT:-/tmp/ctxkit-gpu-check}"
mkdir -p "$OUT"
QUICK_FLAG=""
[ -n "${QUICK:-}" ] && QUICK_FLAG="--quick"
# The GPU suite only: the CPU tests run in CI, and some of them swap in a fake driver, which
# must never share a process with the real one.
TESTS="${ONLY:-tests -m gpu}"

echo "== ctxkit info"
python3 -m ctxkit info 2>&1 | tee "$OUT/info.log"

test_rc="skipped"
if [ "$TESTS" != none ]; then
    echo "== pytest $TESTS"
    # shellcheck disable=SC2086
    python3 -m pytest $TESTS -q -p no:cacheprovider --timeout=600 -o addopts="" -rfE \
        --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/pytest.log"
    test_rc=${PIPESTATUS[0]}
fi

demo_rc="skipped"
if [ -z "${ONLY:-}" ] || [ -n "${DEMO:-}" ]; then
    echo "== python -m ctxkit demo $QUICK_FLAG"
    python3 -m ctxkit demo $QUICK_FLAG --trace "$OUT/demo-trace.json" 2>&1 | tee "$OUT/demo.log"
    demo_rc=${PIPESTATUS[0]}
fi

: > "$OUT/bench.log"
for b in benchmarks/bench_*.py; do
    name=$(basename "$b" .py); name=${name#bench_}
    if [ -n "${BENCH:-}" ] && ! echo " $BENCH " | grep -q " $name "; then continue; fi
    args_var="BENCH_ARGS_$name"
    echo "== benchmark $name ${!args_var:-}"
    # shellcheck disable=SC2086
    timeout 900 python3 "$b" $QUICK_FLAG ${!args_var:-} 2>&1 | tee -a "$OUT/bench.log"
    echo "SUMMARY-RC bench_$name ${PIPESTATUS[0]}" >> "$OUT/bench.log"
done

echo
echo "================ ctxkit GPU check summary ================"
python3 - "$OUT" "$test_rc" "$demo_rc" <<'PY'
import sys, xml.etree.ElementTree as ET
out, test_rc, demo_rc = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    if test_rc == "skipped":
        raise RuntimeError("tests skipped (ONLY=none)")
    r = ET.parse(f"{out}/junit.xml").getroot()
    s = r if r.tag == "testsuite" else r.find("testsuite")
    total, fail, err, skip = (int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    print(f"tests      : {total - fail - err - skip} passed, {fail + err} failed, {skip} skipped (rc {test_rc})")
except Exception as exc:
    print(f"tests      : no junit report ({exc}); rc {test_rc}")
print(f"demo       : rc {demo_rc}")
for line in open(f"{out}/bench.log", errors="replace"):
    if line.startswith("SUMMARY "):
        print("bench      : " + line[len("SUMMARY "):].rstrip())
    elif line.startswith("SUMMARY-RC ") and not line.rstrip().endswith(" 0"):
        print("bench      : " + line[len("SUMMARY-RC "):].rstrip() + " (non-zero exit)")
PY
{ [ "$test_rc" = 0 ] || [ "$test_rc" = skipped ]; } && { [ "$demo_rc" = 0 ] || [ "$demo_rc" = skipped ]; }

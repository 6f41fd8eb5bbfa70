#!/usr/bin/env bash
# ctxkit under compute-sanitizer: memcheck (with leak check) and racecheck.
#
#     bash scripts/sanitizer.sh                          # the core workload (scripts/sanitizer_workload.py)
#     TESTS="tests/core/test_context_gpu.py" bash scripts/sanitizer.sh   # ... and these pytest targets
#     TOOLS="memcheck" bash scripts/sanitizer.sh          # one tool only
#     BACKTRACE=yes TOOLS=memcheck bash scripts/sanitizer.sh   # host backtraces (see run_tool)
#
# Run from anywhere on the GPU machine; PYTHONPATH is set to the repo root. One log per tool and
# target goes to $OUT (or /tmp/ctxkit-sanitizer); the last lines are each run's SUMMARY lines.
# API calls that fail on purpose (ctxkit probes pointers, peer access) are not reported
# (--report-api-errors no): the summaries count memory errors, leaks and races only.
# Exit code: 0 clean, 1 a tool reported errors (or the program failed), 2 no GPU / no sanitizer.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export CTXKIT_CACHE_DIR="${CTXKIT_CACHE_DIR:-/tmp/ctxkit-cache}"
OUT="${OUT:-/tmp/ctxkit-sanitizer}"
mkdir -p "$OUT"

if ! python3 -c 'import sys, ctxkit; sys.exit(0 if ctxkit.device_count() else 2)'; then
    echo "no GPU: sanitizer.sh needs an NVIDIA GPU and driver" >&2
    exit 2
fi
SAN="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}"
if [ ! -x "$SAN" ]; then
    echo "compute-sanitizer not found (looked for $SAN); set COMPUTE_SANITIZER=/path/to/it" >&2
    exit 2
fi

TOOLS="${TOOLS:-memcheck racecheck}"
worst=0
summaries=()

run_tool() {  # run_tool TOOL NAME COMMAND...
    local tool=$1 name=$2
    shift 2
    local log="$OUT/sanitizer-$tool-$name.log" extra=()
    # Host backtraces off for memcheck: to print them, compute-sanitizer keeps a reference to
    # the Python frames of every allocation call, so their locals (pinned arrays among them)
    # can never be freed and are then reported as leaked. BACKTRACE=yes shows them anyway.
    [ "$tool" = memcheck ] && extra=(--leak-check full --show-backtrace "${BACKTRACE:-device}")
    echo "== compute-sanitizer --tool $tool: $name"
    "$SAN" --tool "$tool" ${extra[@]+"${extra[@]}"} --target-processes all --report-api-errors no \
        --print-limit 100 --error-exitcode 99 "$@" >"$log" 2>&1
    local rc=$?
    grep -E "^=========" "$log" | grep -v -E "SUMMARY" | head -n 40
    local summary
    summary=$(grep -E "(ERROR|LEAK|RACECHECK) SUMMARY" "$log" | sed 's/^========= //' | sort | uniq -c |
        sed 's/^ *//' | paste -sd ';' -)
    [ "$rc" != 0 ] && worst=1
    summaries+=("SUMMARY sanitizer.$tool.$name rc=$rc ${summary:-no summary (see $log)}")
    if [ "$rc" != 0 ]; then
        echo "-- last lines of $log:"
        tail -n 30 "$log"
    fi
}

for tool in $TOOLS; do
    run_tool "$tool" workload python3 scripts/sanitizer_workload.py
    if [ -n "${TESTS:-}" ]; then
        # shellcheck disable=SC2086
        run_tool "$tool" tests python3 -m pytest $TESTS -q -p no:cacheprovider -o addopts="" -x
    fi
done

echo
echo "================ compute-sanitizer summary ================"
printf '%s\n' "${summaries[@]}"
exit "$worst"

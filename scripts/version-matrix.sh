#!/usr/bin/env bash
# The GPU suite under one toolchain configuration per invocation (run on the GPU machine):
#
#     bash scripts/version-matrix.sh installed            # (a) the cuda-bindings 13.x installed there
#     bash scripts/version-matrix.sh cu12 .whl            # (b) cuda-bindings 12.9 + NVRTC (+ nvJitLink) 12.9
#     bash scripts/version-matrix.sh nvrtc-new .whl       # (c) an NVRTC newer than the driver (13.5)
#
# WHEEL_DIR holds what travels with the working tree (`carry: [".whl"]`, 64 MiB in all, so carry
# one configuration's files per call): *.whl files, installed with
# `pip install --no-index --no-deps --target /tmp/site`, and *.tar.xz files, unpacked into
# /tmp/site (slimmed wheels, see below). /tmp/site goes first on PYTHONPATH; its NVIDIA
# libraries are preloaded (LD_PRELOAD) so cuda-pathfinder picks them over the installed ones,
# and the script checks that it did (a configuration that silently ran the installed
# toolchain fails with exit code 3).
#
# Each configuration prints the versions in use, proves that target="auto" (cubin) compiles,
# loads and computes on the device (and, when NVRTC is newer than the driver, that PTX from it
# is refused with a clear error while cubin is not), then runs the GPU suite without the slow
# reliability tests (TESTS / PYTEST_ARGS override). Logs and a junit file go to $OUT.
#
# The NVRTC 12.9 wheel (85 MiB) does not fit the carry limit; on the development machine,
#     bash scripts/version-matrix.sh slim .whl WHEEL...
# repacks wheels as .tar.xz without what ctxkit never loads (the duplicate *.alt.so libraries,
# Cython sources): NVRTC 12.9 shrinks to ~29 MiB.
#
# Exit codes: 0 suite passed, 1 tests failed, 2 usage / no GPU / no wheels, 3 wrong toolchain.
set -u
ORIG_PWD=$PWD
cd "$(dirname "$0")/.."

abspath() {  # a path given on the command line, relative to where the script was started
    case "$1" in /*) echo "$1" ;; *) echo "$ORIG_PWD/$1" ;; esac
}

usage() {
    echo "usage: bash scripts/version-matrix.sh {installed | cu12 WHEEL_DIR | nvrtc-new WHEEL_DIR}" >&2
    echo "       bash scripts/version-matrix.sh slim OUT_DIR WHEEL..." >&2
    exit 2
}

slim() {  # slim OUT_DIR WHEEL...
    [ $# -gt 1 ] || usage
    local out args=()
    out=$(abspath "$1")
    shift
    for w in "$@"; do args+=("$(abspath "$w")"); done
    mkdir -p "$out"
    python3 - "$out" "${args[@]}" <<'PY'
import io, lzma, os, sys, tarfile, zipfile
out, wheels = sys.argv[1], sys.argv[2:]
drop = (".pyx", ".pxd", ".pyx.in", ".pxd.in", ".cpp")
for whl in wheels:
    name = os.path.basename(whl)[: -len(".whl")]
    dest = os.path.join(out, name + ".tar.xz")
    with zipfile.ZipFile(whl) as z, tarfile.open(dest, "w:xz", preset=9 | lzma.PRESET_EXTREME) as t:
        for info in z.infolist():
            base = os.path.basename(info.filename)
            if info.is_dir() or ".alt.so" in base or base.endswith(drop):
                continue
            data = z.read(info)
            ti = tarfile.TarInfo(info.filename)
            ti.size = len(data)
            ti.mode = 0o755 if ".so" in base else 0o644
            t.addfile(ti, io.BytesIO(data))
    print(f"{dest}: {os.path.getsize(dest) / 2**20:.1f} MiB (wheel {os.path.getsize(whl) / 2**20:.1f} MiB)")
PY
}

CONFIG="${1:-}"
case "$CONFIG" in
    slim) shift; slim "$@"; exit $? ;;
    installed) WHEELS="" ;;
    cu12 | nvrtc-new)
        [ -n "${2:-}" ] || usage
        WHEELS=$(abspath "$2")
        ;;
    *) usage ;;
esac

export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/ctxkit-version-matrix}"
mkdir -p "$OUT"
export CTXKIT_CACHE_DIR="/tmp/ctxkit-cache-$CONFIG"
SITE=/tmp/site

if [ -n "$WHEELS" ]; then
    shopt -s nullglob
    whls=("$WHEELS"/*.whl)
    tars=("$WHEELS"/*.tar.xz)
    shopt -u nullglob
    if [ ${#whls[@]} -eq 0 ] && [ ${#tars[@]} -eq 0 ]; then
        echo "version-matrix: no wheels (*.whl or *.tar.xz) in $WHEELS" >&2
        exit 2
    fi
    rm -rf "$SITE" && mkdir -p "$SITE"
    if [ ${#whls[@]} -gt 0 ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "${whls[@]}" || exit 2
    fi
    for t in ${tars[@]+"${tars[@]}"}; do
        python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
            "$t" "$SITE" || exit 2
    done
    export PYTHONPATH="$SITE:$PWD"
    libdirs=$(find "$SITE/nvidia" -maxdepth 3 -type d -name lib 2>/dev/null | paste -sd: -)
    preload=$(find "$SITE/nvidia" -maxdepth 3 \( -name 'libnvrtc.so.*' -o -name 'libnvJitLink.so.*' \) \
        ! -name '*builtins*' 2>/dev/null | paste -sd: -)
    [ -n "$libdirs" ] && export LD_LIBRARY_PATH="$libdirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    [ -n "$preload" ] && export LD_PRELOAD="$preload${LD_PRELOAD:+:$LD_PRELOAD}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

echo "== configuration $CONFIG"
python3 - "$CONFIG" <<'PY' 2>&1 | tee "$OUT/version-matrix-$CONFIG-check.log"
import sys, warnings
import numpy as np
import cuda.bindings
import ctxkit as ck
from ctxkit import _driver, compiler

cfg = sys.argv[1]
if ck.device_count() == 0:
    print("no GPU: version-matrix.sh needs an NVIDIA GPU and driver", file=sys.stderr)
    sys.exit(2)
bindings, nvrtc, drv = _driver.BINDINGS_VERSION, compiler.nvrtc_version(), _driver.driver_version()
try:
    from cuda.bindings import nvjitlink
    jit = ".".join(map(str, nvjitlink.version()))
except Exception as exc:
    jit = f"unavailable ({type(exc).__name__})"
print(f"cuda-bindings {cuda.bindings.__version__} ({cuda.bindings.__file__})")
print(f"NVRTC {nvrtc[0]}.{nvrtc[1]}; nvJitLink {jit}; driver CUDA {drv[0]}.{drv[1]}")
wrong = {
    "installed": bindings[0] < 13 and "cuda-bindings 13.x expected",
    "cu12": (bindings[0] != 12 or nvrtc[0] != 12) and "cuda-bindings 12.x and NVRTC 12.x expected",
    "nvrtc-new": nvrtc <= drv and "an NVRTC newer than the driver expected",
}[cfg]
if wrong:
    print(f"WRONG TOOLCHAIN for {cfg}: {wrong}; the carried files were not picked up", file=sys.stderr)
    sys.exit(3)

src = compiler.kernel_source("vector_add.cu")
n = 1 << 20
a, b = np.random.rand(n).astype(np.float32), np.random.rand(n).astype(np.float32)
with ck.bind(0):
    obj = ck.compile(src, name="vector_add.cu", cache=False)
    k = ck.Module.load(obj).function("vector_add")
    da, db, dc = (ck.DeviceBuffer(n * 4) for _ in range(3))
    da.copy_from_host(a)
    db.copy_from_host(b)
    k.launch((n + 255) // 256, 256, da, db, dc, n)
    ok = np.array_equal(dc.copy_to_host(np.empty(n, np.float32)), a + b)
    print(f"target='auto' -> {obj.target} for {obj.arch}: loaded and computed "
          f"{'correctly' if ok else 'WRONG VALUES'}")
    if not ok:
        sys.exit(1)
    if nvrtc > drv:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ptx = ck.compile(src, name="vector_add.cu", target="ptx", cache=False)
        warned = any(issubclass(w.category, compiler.PtxVersionWarning) for w in caught)
        print(f"target='ptx': PtxVersionWarning {'given' if warned else 'MISSING'}")
        try:
            kp = ck.Module.load(ptx).function("vector_add")
            kp.launch((n + 255) // 256, 256, da, db, dc, n)
            ck.current_context().synchronize()
            print("note: this driver JIT-compiled PTX from the newer NVRTC")
        except ck.CompileError as exc:
            print(f"PTX from NVRTC {nvrtc[0]}.{nvrtc[1]} refused as expected: {exc.name}")
        if not warned:
            sys.exit(1)
PY
check_rc=${PIPESTATUS[0]}
[ "$check_rc" = 0 ] || exit "$check_rc"

TESTS="${TESTS:-tests -m gpu}"
if [ -n "${PYTEST_ARGS:-}" ]; then
    # shellcheck disable=SC2206
    args=($PYTEST_ARGS)
elif [ "$CONFIG" = installed ]; then
    args=(-m "not slow")
else
    # The preloaded NVRTC serves every library in the process: CuPy (built for CUDA 13) then
    # compiles its own kernels against CUDA 13 headers with this NVRTC and fails. That
    # combination is not one a user can have, so the tests of CuPy interop stay out here.
    args=(-m "not slow" -k "not cupy")
fi
echo "== pytest $TESTS ${args[*]} (configuration $CONFIG)"
# shellcheck disable=SC2086
python3 -m pytest $TESTS -q -p no:cacheprovider -o addopts="" --timeout=600 -rfE "${args[@]}" \
    --junitxml="$OUT/version-matrix-$CONFIG.xml" 2>&1 | tee "$OUT/version-matrix-$CONFIG.log"
rc=${PIPESTATUS[0]}
echo "SUMMARY version-matrix.$CONFIG pytest rc=$rc"
[ "$rc" = 0 ] || exit 1

#!/usr/bin/env bash
# Builds the CPU library with ASan + UBSan (CMake, -DPOSS_SANITIZE=ON) and runs the op and fuzz
# tests against it. Exits non-zero on a test failure or on any sanitizer finding.
#
#   scripts/sanitize_check.sh [extra pytest args]
#
# Environment: PYTHON (default: python), BUILD_DIR (default: build/asan), MAX_JOBS (default: 2).
# Needs cmake, a C++ compiler with libasan, and pybind11 in the Python environment.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
python=$(command -v "${PYTHON:-python}")
build=${BUILD_DIR:-build/asan}

cmake -S . -B "$build" -DPython3_EXECUTABLE="$python" -DPOSS_CUDA=OFF -DPOSS_SANITIZE=ON \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build "$build" -j "${MAX_JOBS:-2}"

# An importable poss_ext made of the sanitized _C (built into $build/poss_ext) and the source
# tree's Python files, so the tests import that build and not an in-place or installed one.
pkg="$root/$build/poss_ext"
shopt -s nullglob
libs=("$pkg"/_C*.so)
[ "${#libs[@]}" -eq 1 ] || { echo "sanitize_check: expected one $build/poss_ext/_C*.so" >&2; exit 1; }
rm -f "$pkg"/_build_info.json
for f in "$root"/poss_ext/*.py; do ln -sf "$f" "$pkg/"; done

cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$build/CMakeCache.txt")
libasan=$("${cxx:-c++}" -print-file-name=libasan.so)
libstdcxx=$("${cxx:-c++}" -print-file-name=libstdc++.so.6)
for lib in "$libasan" "$libstdcxx"; do
  [ -f "$lib" ] || { echo "sanitize_check: $lib not found" >&2; exit 1; }
done

# libasan first (Python is not instrumented); libstdc++ with it, or ASan's __cxa_throw interceptor
# finds no real __cxa_throw (python does not link libstdc++) and aborts at the first C++ throw.
export LD_PRELOAD="$libasan:$libstdcxx${LD_PRELOAD:+:$LD_PRELOAD}"
# Python and torch leak by design at exit; any other finding aborts the run.
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
export PYTHONPATH="$root/$build:$root/python"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# -P: the working directory (whose poss_ext/ may hold an unsanitized _C) stays off sys.path.
"$python" -P -c "import poss_ext, sys; f = poss_ext._C.__file__; print('testing', f); \
sys.exit(0 if f.startswith('$pkg/') else 'sanitize_check: imported the wrong poss_ext._C')"

# The op tests (kernels against the references, bad input) and the malformed-input fuzz tests.
"$python" -P -m pytest -q -p no:cacheprovider \
  tests/ops/test_tree_verify.py tests/ops/test_tree_verify_errors.py tests/ops/test_sampling_exact.py \
  tests/ops/test_build_tree.py tests/ops/test_tree_attention.py tests/ops/test_kv_compact.py \
  tests/ops/test_layer_ops.py tests/ops/test_linear.py tests/ops/test_qlinear.py tests/ops/test_qlinear_int8.py \
  tests/ops/test_qlinear_rows8.py tests/ops/test_qdecoder_layer.py "$@"
echo "sanitize_check: clean"

#!/usr/bin/env bash
# One prepared run for a lent GPU machine (no network there): build the CUDA kernels in place against
# the machine's own torch, run the CUDA tests (the ops, then the whole loop: greedy against HF and
# exact sampling), the end-to-end loop in Llama-3-8B shapes, the kernel benchmarks, the loop again through
# torch.compile, and the CUDA op tests under compute-sanitizer. Stages run in that order, most
# important first, each under its own time limit, so a hang or a failure in one still leaves the
# others' results. At most 8 files land in $out: build.log, tests.log, e2e.log, bench.log, 4 JSON.
# Without a GPU visible to torch it stops at once (exit 2) with a message.
#   bash scripts/gpu_check.sh            (writes logs and JSON under ${OUT:-out}/)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
export POSS_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}" PYTHONUNBUFFERED=1
export PYTHONPATH=.:python
start=$SECONDS
stamp() { echo "== [$((SECONDS - start)) s] $*"; }
# The files that hold tests marked `cuda` (collecting the whole suite would import the serving stack,
# whose packages a bare GPU image may lack).
cuda_tests="tests/ops/test_linear.py tests/ops/test_tree_attention.py tests/ops/test_layer_ops.py
  tests/ops/test_kv_compact.py tests/ops/test_build_tree.py tests/ops/test_tree_verify.py tests/ops/test_tree_verify_split.py
  tests/ops/test_triton_attention.py tests/decode/test_loop_devices.py"
per_test=""
python3 -c "import pytest_timeout" 2>/dev/null && per_test="--timeout=120"

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader || true
# Everything below builds and runs CUDA code: without a GPU it would spend minutes on a CUDA build and
# then skip or fail every stage. Say so and stop.
if ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check.sh: no GPU visible to torch (torch.cuda.is_available() is False; nvidia-smi above says" \
    "what the driver sees). This check is for a CUDA machine; on a CPU-only machine run the test suite:" \
    "pytest tests/" >&2
  exit 2
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), 'triton', triton.__version__)"

stamp "build (in place, sm_${TORCH_CUDA_ARCH_LIST/./})"
python3 setup.py build_ext --inplace >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
python3 -c "import poss_ext; print(poss_ext.build_info())"
# A copy of libstdc++'s stream code inside _C, bound locally, crashed the first error message that
# formats an integer on one image (setup.py link_flags): say whether the build holds one.
echo "libstdc++ ostream functions defined in _C: $(nm -C --defined-only poss_ext/_C*.so 2>/dev/null | grep -c 'std::ostream::_M_insert')"

stamp "CUDA tests: ops, then the loop (one process per file: a crash in one leaves the others' results)"
: >"$out/tests.log"
for f in $cuda_tests; do
  # shellcheck disable=SC2086
  timeout 150 python3 -m pytest "$f" -q -p no:cacheprovider -m cuda -rfE $per_test >"$out/one.log" 2>&1
  rc=$?
  { echo "=== $f (exit $rc)"; cat "$out/one.log"; } >>"$out/tests.log"
  echo "$f: exit $rc, $(grep -E '^[0-9]+ (passed|failed)|passed|failed|Fatal Python error' "$out/one.log" | tail -1)"
  grep -E "^(FAILED|ERROR) " "$out/one.log" | head -10
done
rm -f "$out/one.log"

stamp "end-to-end loop, synthetic Llama-3-8B shapes (random weights, bf16)"
timeout 150 python3 bench/bench_gpu_e2e.py --json "$out/e2e_llama3_8b.json" 2>&1 | tee "$out/e2e.log" | grep -v "^Loading"

stamp "CUDA benchmarks: tree_verify"
POSS_BENCH_DEVICE=cuda timeout 100 python3 -m pytest bench/bench_tree_verify.py -q -p no:cacheprovider --benchmark-only \
  -k "not reference" --benchmark-max-time=0.2 --benchmark-min-rounds=10 \
  --benchmark-json="$out/tree_verify_cuda.json" >"$out/bench.log" 2>&1 || tail -30 "$out/bench.log"
[ -f "$out/tree_verify_cuda.json" ] && python3 bench/report.py "$out/tree_verify_cuda.json"

stamp "Triton tree_attention against the CUDA kernel, verify shapes"
timeout 60 python3 -m pytest bench/bench_triton_attention.py -q -p no:cacheprovider --benchmark-only \
  --benchmark-max-time=0.2 --benchmark-min-rounds=10 \
  --benchmark-json="$out/triton_attention_cuda.json" >>"$out/bench.log" 2>&1 || tail -30 "$out/bench.log"
[ -f "$out/triton_attention_cuda.json" ] && python3 bench/report.py "$out/triton_attention_cuda.json"

stamp "end-to-end loop again, steps through torch.compile (mode reduce-overhead: CUDA graphs)"
timeout 180 python3 bench/bench_gpu_e2e.py --compile --json "$out/e2e_llama3_8b_compiled.json" >"$out/one.log" 2>&1
grep -E "^(decode step|60/6 round|ratios|total|Traceback|[A-Za-z]*Error)|skipping cudagraphs" "$out/one.log" | tail -8
{ echo "=== compiled"; cat "$out/one.log"; } >>"$out/e2e.log" && rm "$out/one.log"
if command -v compute-sanitizer >/dev/null; then
  stamp "compute-sanitizer memcheck: the CUDA op tests of tree_verify, tree_attention and kv_compact"
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest tests/ops/test_tree_verify.py \
    tests/ops/test_tree_verify_split.py::test_greedy_ties_across_chunks_go_to_the_lowest_id \
    tests/ops/test_tree_verify_split.py::test_thresholds_with_ties_across_chunks \
    tests/ops/test_tree_attention.py tests/ops/test_kv_compact.py -q -p no:cacheprovider -m cuda -x >"$out/memcheck.log" 2>&1
  echo "memcheck exit $? (9: errors found; 124: time limit)"
  grep -E "ERROR SUMMARY|Invalid|passed|failed" "$out/memcheck.log" | tail -8
  { echo "=== compute-sanitizer memcheck"; cat "$out/memcheck.log"; } >>"$out/tests.log" && rm "$out/memcheck.log"
fi
stamp "done"

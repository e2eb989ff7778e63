#!/usr/bin/env bash
# One prepared run for a lent GPU machine (no network there): build the CUDA kernels in place against
# the machine's own torch, run the CUDA tests, time the CUDA kernels, and print one table.
#   bash scripts/gpu_check.sh            (writes logs and JSON under ${OUT:-out}/)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
export POSS_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}" PYTHONUNBUFFERED=1
export PYTHONPATH=.:python
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

echo "== build (in place)"
python3 setup.py build_ext --inplace >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
python3 -c "import poss_ext; print(poss_ext.build_info())"

echo "== CUDA tests"
python3 -m pytest tests -q -p no:cacheprovider -m cuda -x 2>&1 | tee "$out/tests.log" | tail -15

echo "== CUDA benchmarks"
POSS_BENCH_DEVICE=cuda python3 -m pytest bench/bench_tree_verify.py -q -p no:cacheprovider --benchmark-only \
  -k "not reference" --benchmark-json="$out/tree_verify_cuda.json" >"$out/bench.log" 2>&1 || tail -30 "$out/bench.log"
python3 bench/report.py "$out/tree_verify_cuda.json"

echo "== Triton tree_attention vs the CUDA kernel (tests, then verify-shape timings)"
if python3 -c "import triton" 2>/dev/null; then
  python3 -m pytest tests/test_triton_attention.py -q -p no:cacheprovider -m cuda 2>&1 | tee "$out/triton_tests.log" | tail -5
  python3 -m pytest bench/bench_triton_attention.py -q -p no:cacheprovider --benchmark-only \
    --benchmark-json="$out/triton_attention_cuda.json" >"$out/triton_bench.log" 2>&1 || tail -30 "$out/triton_bench.log"
  python3 bench/report.py "$out/triton_attention_cuda.json"
else
  echo "triton is not installed: skipped"
fi

echo "== end-to-end loop, synthetic Llama-3-8B shapes (random weights, bf16)"
timeout 420 python3 scripts/gpu_e2e.py --json "$out/e2e_llama3_8b.json" 2>&1 | tee "$out/e2e.log" | grep -v "^Loading"

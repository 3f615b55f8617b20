#!/usr/bin/env bash
# FP8 check on one GPU (H100/H200/B200; under 8 minutes): our Triton kernels against the PyTorch reference on
# real FP8 hardware, then quantisation GB/s vs torchao and FP8 GEMM TFLOP/s vs bf16 torch.matmul.
# Usage: bash benchmarks/fp8_gpu.sh [--quick]      (PYTHON=... to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."

# The project's .venv may hold a CPU-only torch; fall back to the system python when it cannot see a GPU.
pick_python() {
  for py in "${PYTHON:-}" .venv/bin/python python3 python; do
    [ -n "$py" ] && command -v "$py" >/dev/null 2>&1 || continue
    if "$py" -c "import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
      echo "$py"; return 0
    fi
  done
  return 1
}
PY=$(pick_python) || { echo "no python with CUDA torch and triton found; set PYTHON=..." >&2; exit 2; }

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1
exec timeout 470 "$PY" benchmarks/fp8_gpu.py "$@"

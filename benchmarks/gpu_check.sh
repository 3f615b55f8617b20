#!/usr/bin/env bash
# One prepared GPU check (benchmarks/gpu_check.py): correctness of the CUDA paths, training MFU, FP8 speed and
# decode speed, under a hard limit of 8 minutes, writing OUT_DIR/report.json, log.txt and summary.txt.
# Without CUDA it runs reduced on the CPU (what CI runs). Needs no network and none of megatron-core, torchao,
# zstandard or s3fs.
# Usage: bash benchmarks/gpu_check.sh OUT_DIR [--reduced] [--parts a,b] [--pretrain-run DIR]   (PYTHON=... to choose)
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: bash benchmarks/gpu_check.sh OUT_DIR [gpu_check.py options]" >&2; exit 2; }
OUT_DIR=$1; shift
cd "$(dirname "$0")/.."

# The project's .venv may hold a CPU-only torch: prefer an interpreter that sees a GPU, else the first with torch.
pick_python() {
  local fallback=""
  for py in "${PYTHON:-}" .venv/bin/python python3 python; do
    [ -n "$py" ] && command -v "$py" >/dev/null 2>&1 || continue
    if "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
      echo "$py"; return 0
    fi
    [ -z "$fallback" ] && "$py" -c "import torch" 2>/dev/null && fallback=$py
  done
  [ -n "$fallback" ] && { echo "$fallback"; return 0; }
  return 1
}
PY=$(pick_python) || { echo "no python with torch found; set PYTHON=..." >&2; exit 2; }
command -v nvidia-smi >/dev/null \
  && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout -k 10 480 "$PY" benchmarks/gpu_check.py "$OUT_DIR" --limit 465 "$@"

#!/usr/bin/env bash
# Follow-up of bench/gpu_check.sh on 2026-11-27 (not kept in the repo): the fp32
# two-level sum, the NCCL collective-device fix (fidelity), and bench/compile.py --quick at world 1.
set -uo pipefail
O="$OUT"; cd "$(dirname "$0")/.."
step() { local name=$1 cap=$2; shift 2; local s=$(date +%s)
  timeout -s INT -k 5 "$cap" bash -c "$*" > "$O/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - s ))s cap=$cap" | tee -a "$O/summary.txt"; tail -n 4 "$O/$name.log"; }
step build 90 "OSDP_SKIP_CUDA=0 python -m pip install --no-build-isolation --no-deps -e ."
step kernels_fp32 50 "python -m pytest -m gpu -q -rs -p no:cacheprovider tests/kernels/test_kernels_gpu.py -k float32 --tb=short"
step fp32_speed 30 "python .gpu2/fp32_speed.py"

step compile 150 "cd bench && PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=16 python compile.py --quick --world-size 1 --budget loose --steps 5 --out '$O/compile_gpu_quick.csv'"
cat "$O/summary.txt"

#!/usr/bin/env bash
# One call on a GPU machine: build the CUDA kernels, run the gpu-marked tests, the kernel
# benchmark (split kernels against cuBLAS, same run), the fidelity benchmark (predicted vs
# measured step time and allocator peak), the torch.compile benchmark on one rank (N&D,
# OSDP and FSDP2 eager vs compiled, graph-break reasons) and the AOT compile report (--quick: the configs
# a launch autotunes over; the full report's 240 compiles do not fit its cap), and keep
# everything under one folder. Sized to finish within 9 minutes on one H100.
#
#   bench/gpu_check.sh [--dry-run] [OUT_DIR]
#
# OUT_DIR: the argument, else $OUT, else bench/results/gpu_<date>. It receives
#   summary.txt (step, exit status, seconds, cap), env.txt, nvidia-smi*.txt, build.log,
#   gpu_tests.log + gpu_tests.xml, kernels.log + kernels_<gpu>.csv, fidelity.log +
#   fidelity_<gpu>.csv, compile.log + compile_gpu_quick.csv, aot.log + aot.json.
# The device tool returns at most 8 files: everything is also packed into all.tgz.
# Time: GPU_CHECK_BUDGET_S (default 520 s) for the whole run; each step also has its own
#   cap (below; on an H200, 2026-11-27: build 46-61 s, gpu tests 173 s cold for 58 tests
#   (a 170 s cap cut the last one), kernels 20-24 s, fidelity 19-40 s, compile 49-72 s,
#   aot 21-23 s) and is stopped (SIGINT, then SIGKILL) when it reaches it; the benchmarks
#   get budgets of their own so they stop starting new shapes in time. Compile's cap is
#   105 s: the compile bench compiles FSDP2 cold too (fresh_cache per peer), and OSDP at
#   its default scope ("model": all 12 layers traced; "blocks" as well would not fit),
#   running the eager plan compiled (--compiled-plan eager: compiled auto mode's two
#   finalist compiles would not fit either);
#   kernels' is 45 s (its own budget 40 s), build's 85 s.
# Fails fast, before building anything, when no NVIDIA GPU is visible (nvidia-smi, or
#   the program named by $NVIDIA_SMI, missing or listing no GPU).
# Exit status: 0 every step passed, 1 some step failed or timed out, 2 no GPU / bad usage.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

DRY_RUN=0
OUT_ARG=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $arg (use --dry-run or an output folder)" >&2; exit 2 ;;
    *) OUT_ARG="$arg" ;;
  esac
done
OUT_DIR="${OUT_ARG:-${OUT:-$ROOT/bench/results/gpu_$(date +%Y%m%d_%H%M%S)}}"
PYTHON="${PYTHON:-python}"
NVIDIA_SMI="${NVIDIA_SMI:-nvidia-smi}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-520}"
AOT_CACHE="${OSDP_AOT_CACHE:-${TMPDIR:-/tmp}/osdp-aot-cache}"
JOBS="$(nproc 2>/dev/null || echo 4)"; JOBS=$(( JOBS > 8 ? 8 : JOBS ))

# name | cap seconds | command (run from the repository root; $OUT_DIR is the folder).
# The fidelity bench runs one rank per GPU (NCCL cannot put two ranks on one device).
define_steps() {
  local world=$1
  STEPS=(
    "build|85|OSDP_SKIP_CUDA=0 $PYTHON -m pip install -e '.[test]' || { echo '--- offline retry: no build isolation, no dependency resolution'; OSDP_SKIP_CUDA=0 $PYTHON -m pip install --no-build-isolation --no-deps -e .; }"
    "cuda_visible|20|$PYTHON -c \"import torch, osdp_kernels as K; ok = torch.cuda.is_available(); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'device', torch.cuda.get_device_name() if ok else None, 'osdp_kernels._cuda built:', K.cuda_available()); raise SystemExit(0 if ok else 'torch sees no CUDA device (CPU-only torch build?): the gpu tests would all skip')\""
    "gpu_tests|200|$PYTHON -m pytest -m gpu -n 0 -q -rs -p no:cacheprovider --junitxml='$OUT_DIR/gpu_tests.xml'"
    "kernels|45|$PYTHON bench/kernels.py --quick --budget-s 40 --repeats 10 --out-dir '$OUT_DIR'"
    "fidelity|50|$PYTHON bench/fidelity.py --quick --world-size $world --budget-s 20 --out-dir '$OUT_DIR'"
    "compile|105|cd bench && TORCH_LOGS=graph_breaks TORCHINDUCTOR_COMPILE_THREADS=$JOBS $PYTHON compile.py --quick --world-size 1 --budget loose --steps 5 --osdp-scopes model --compiled-plan eager --out '$OUT_DIR/compile_gpu_quick.csv'"
    "aot|30|env -u TRITON_INTERPRET $PYTHON -m osdp_kernels.aot --arch sm_80,sm_90 --quick --jobs $JOBS --cache-dir '$AOT_CACHE' --json '$OUT_DIR/aot.json'"
  )
}

if [[ $DRY_RUN == 1 ]]; then
  define_steps 1
  echo "gpu_check.sh --dry-run: would write into $OUT_DIR (budget ${BUDGET_S} s)"
  echo "  0. check a GPU is visible: $NVIDIA_SMI -L (stop here if not); save nvidia-smi, nvidia-smi -q, env.txt"
  echo "     (fidelity --world-size: min(2, GPUs listed); 1 shown here)"
  i=1
  for step in "${STEPS[@]}"; do
    IFS='|' read -r name cap cmd <<<"$step"
    printf '  %d. %-12s (cap %3s s) %s  > %s.log\n' "$i" "$name" "$cap" "$cmd" "$name"
    i=$((i + 1))
  done
  echo "  $i. nvidia-smi again (after), summary.txt"
  exit 0
fi

# --- fail fast without a GPU ---------------------------------------------------------
if ! command -v "$NVIDIA_SMI" >/dev/null 2>&1; then
  echo "gpu_check.sh: no NVIDIA GPU here: '$NVIDIA_SMI' not found. This script measures on a GPU;" \
       "run it on the GPU machine (or see the steps with --dry-run). Nothing was built or written." >&2
  exit 2
fi
if ! GPU_LIST="$("$NVIDIA_SMI" -L 2>&1)" || ! grep -q '^GPU [0-9]' <<<"$GPU_LIST"; then
  echo "gpu_check.sh: no NVIDIA GPU here: '$NVIDIA_SMI -L' lists none (${GPU_LIST:-no output})." \
       "Run it on the GPU machine (or see the steps with --dry-run). Nothing was built or written." >&2
  exit 2
fi

NGPU=$(grep -c '^GPU [0-9]' <<<"$GPU_LIST")
define_steps $(( NGPU >= 2 ? 2 : 1 ))
mkdir -p "$OUT_DIR"
START=$(date +%s)
echo "$GPU_LIST" > "$OUT_DIR/nvidia-smi-L.txt"
"$NVIDIA_SMI" > "$OUT_DIR/nvidia-smi.txt" 2>&1
"$NVIDIA_SMI" -q > "$OUT_DIR/nvidia-smi-q.txt" 2>&1
{
  echo "date: $(date -Is)"; echo "host: $(hostname)"; echo "kernel: $(uname -a)"
  echo "git: $(git rev-parse HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | wc -l) changed paths"
  echo "budget_s: $BUDGET_S  jobs: $JOBS  aot_cache: $AOT_CACHE"
  echo "--- nvcc"; nvcc --version 2>&1 || echo "nvcc not found"
  echo "--- python"; "$PYTHON" --version 2>&1
  "$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda); print('triton', triton.__version__)" 2>&1
  echo "--- pip freeze"; "$PYTHON" -m pip freeze 2>&1
  echo "--- environment (CUDA/TRITON/OSDP/PATH)"; env | grep -E '^(CUDA|TRITON|OSDP|NVIDIA|PATH|LD_LIBRARY_PATH)' | sort
} > "$OUT_DIR/env.txt" 2>&1
printf '%-12s %4s %6s %5s\n' step rc seconds cap > "$OUT_DIR/summary.txt"

FAILED=0
for step in "${STEPS[@]}"; do
  IFS='|' read -r name cap cmd <<<"$step"
  left=$(( BUDGET_S - ($(date +%s) - START) ))
  if (( left < 10 )); then
    echo "== $name: skipped, the ${BUDGET_S} s budget is spent" | tee -a "$OUT_DIR/$name.log"
    printf '%-12s %4s %6s %5s\n' "$name" skip 0 "$cap" >> "$OUT_DIR/summary.txt"
    FAILED=1
    continue
  fi
  (( cap > left )) && cap=$left
  echo "== $name (cap ${cap} s): $cmd"
  t0=$(date +%s)
  timeout -s INT -k 10 "$cap" bash -c "$cmd" > "$OUT_DIR/$name.log" 2>&1
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  (( rc == 124 || rc == 137 )) && echo "== $name: stopped at its cap of ${cap} s" >> "$OUT_DIR/$name.log"
  tail -n 5 "$OUT_DIR/$name.log" | sed 's/^/   /'
  printf '%-12s %4s %6s %5s\n' "$name" "$rc" "$dt" "$cap" >> "$OUT_DIR/summary.txt"
  (( rc != 0 )) && FAILED=1
  if [[ $name == cuda_visible && $rc != 0 ]]; then
    echo "== torch sees no GPU; the remaining GPU steps would measure nothing: stopping" | tee -a "$OUT_DIR/summary.txt"
    break
  fi
done

"$NVIDIA_SMI" > "$OUT_DIR/nvidia-smi-after.txt" 2>&1
echo "total_s $(( $(date +%s) - START ))" >> "$OUT_DIR/summary.txt"
(cd "$OUT_DIR" && tar czf all.tgz --exclude=all.tgz ./*)
echo "== summary ($OUT_DIR)"; cat "$OUT_DIR/summary.txt"
exit $FAILED

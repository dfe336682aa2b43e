#!/usr/bin/env bash
# The GPU suite, for an H200 machine with no network (torch, triton, nvcc and ninja preinstalled).
# Runs the `gpu` tests, measures the copy bandwidth and runs the full grid up to N=16384, V=151936,
# writing everything under $OUT (default bench/results/h200/). Budget: at most ~9 minutes, by the
# timeouts below (CUDA build 150 s, gpu tests 120 s, verify 60 s, grid 200 s); run it with timeout_s 560.
#   bash bench/gpu_suite.sh            # on the GPU machine
#   DRY_RUN=1 bash bench/gpu_suite.sh  # here: the CPU-runnable parts at tiny sizes
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/h200}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # no install needed: nothing can be downloaded there
PY=${PYTHON:-python}
log() { echo "[gpu_suite $(date +%H:%M:%S)] $*" | tee -a "$OUT/suite.log"; }
status=0

log "environment"
"$PY" - <<'PY' 2>&1 | tee "$OUT/env.txt"
import torch, platform
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
try:
    import triton; print("triton", triton.__version__)
except ImportError:
    print("triton missing")
PY
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv >> "$OUT/env.txt" 2>/dev/null || true

if [ -n "${DRY_RUN:-}" ]; then
  log "dry run: tests marked gpu (skipped without a GPU) and a tiny bench grid"
  timeout 120 "$PY" -m pytest -q -m gpu tests 2>&1 | tail -3 | tee "$OUT/gpu_tests.txt"
  timeout 300 "$PY" -m fused_is.bench --n 64 --vocab 32000 --dtypes bf16 --reps 2 --out "$OUT" 2>&1 \
    | tee "$OUT/bench.txt" || status=1
  exit $status
fi

log "build the CUDA extension (csrc/, cached in ~/.cache/fused_is)"
timeout 150 "$PY" -m fused_is.cli build cuda 2>&1 | tail -5 | tee "$OUT/build_cuda.txt" || status=1
log "gpu tests"
TRITON_INTERPRET=0 timeout 120 "$PY" -m pytest -q -m gpu tests 2>&1 | tail -20 | tee "$OUT/gpu_tests.txt" \
  || status=1
log "verify"
TRITON_INTERPRET=0 timeout 60 "$PY" -m fused_is.cli verify 2>&1 | tail -3 | tee "$OUT/verify.txt" || status=1
log "bench grid"
TRITON_INTERPRET=0 timeout 200 "$PY" -m fused_is.bench --full --n 1024 4096 16384 --vocab 32000 151936 \
  --dtypes bf16 fp32 --reps 10 --out "$OUT" 2>&1 | tee "$OUT/bench.txt" || status=1
log "done (status $status)"
exit $status

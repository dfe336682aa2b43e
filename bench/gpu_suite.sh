#!/usr/bin/env bash
# The GPU suite, run rarely on a lent H200 or H100 machine: no network; python3 with torch, triton, nvcc, ninja,
# pytest, pytest-timeout and pytest-xdist preinstalled; this working tree copied there (not installed), build/wheels
# carried with it. Results go to $OUT (default bench/results/h200 or h100, the GPU's): 8 flat files, because only
# those come back. The static model predicts the GPU it runs on (MODEL_GPU=h200|h100 overrides; the dry run: h200).
#   bash bench/gpu_suite.sh             # on the GPU machine: ONE call, at most BUDGET=540 s (the call's limit is 600)
#   bash bench/gpu_suite.sh --dry-run   # (or DRY_RUN=1) the same steps on the CPU in under a minute: Triton under
#                                       # its interpreter, gpu tests at tiny shapes, no CUDA build (default OUT:
#                                       # build/gpu_suite_dry_run, never the committed results)
# Steps, in order, each with a timeout (cap) that leaves the steps after it their least share:
#   install, environment (from build/wheels/, offline: Liger-Kernel, and pytest-xdist where the image lacks it)
#   build_cuda      120 s  the CUDA extension for sm_90 (40-80 s); meanwhile the static model's prediction
#                          (bench/gpu/gpu_perf_report.py, in place and --separate-gradient) in the background
#   headline        150 s  N=16384, V=151936, bf16, sequences of 1024: the case the model predicts first
#                          (triton_inplace_forward, cuda_inplace_forward, cuda_cluster_inplace_forward), then liger,
#                          then the separate-gradient triton and cuda, the one-read probes (token_logprobs), eager
#   summary                summary.md: predicted against measured, the probe, the clocks (again at the end)
#   l2_hints         40 s  triton and triton_inplace_forward with the Triton kernel's L2 eviction hints forced off
#                          (the headline ran them as launched: on, on sm_90), at the headline size
#   triton_configs   90 s  BLOCK x warps [@ programs per SM] of the Triton kernel at the headline size
#   gpu_tests       180 s  then verify 90 s
#   linear 60 s, linear_long 120 s (V = 248320, packed sequences of 32K tokens, 0 and 75% masked rows),
#   grid (the rest), compile 120 s (torch.compile last: a cold inductor takes minutes)
# Least shares kept for later steps: headline 60, triton_configs 30, gpu_tests 90, verify 45, compile 45; the last
# step ends by BUDGET plus a 10 s kill grace. The GPU's SM and memory clocks are sampled all along (clocks.csv,
# bench/gpu/clocks.py), each sample tagged with the step. A failing step is logged and the suite goes on; the last
# line of the log says what failed. Every measurement is appended to bench.jsonl as it is taken.
#   STEPS=gpu_tests,verify bash bench/gpu_suite.sh   # a rerun of some steps (headline, l2_hints, triton_configs,
#                                       # gpu_tests, verify, linear, linear_long, grid, compile): install, environment,
#                                       # the CUDA build and the summary always run; the earlier run's files in
#                                       # $OUT are kept
set -uo pipefail
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1
case "${DRY_RUN:-0}" in 0 | "") DRY=0 ;; *) DRY=1 ;; esac
[ -n "${OUT:-}" ] && mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)   # relative to the caller, before the cd
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# the machine the static model predicts (bench/gpu/gpu_perf_report.py --gpu): the GPU's name, H200 when it is neither
if [ -z "${MODEL_GPU:-}" ] && [ "$DRY" = 0 ]; then
  MODEL_GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | grep -oiE 'h100|h200' \
    | tr '[:upper:]' '[:lower:]')
fi
MODEL_GPU=${MODEL_GPU:-h200}
case "$MODEL_GPU" in h100 | h200) ;; *) echo "gpu_suite: MODEL_GPU must be h100 or h200, got '$MODEL_GPU'" >&2; exit 2 ;; esac
if [ "$DRY" = 1 ]; then OUT=${OUT:-$PWD/build/gpu_suite_dry_run}; else OUT=${OUT:-$PWD/bench/results/$MODEL_GPU}; fi
BUDGET=${BUDGET:-540}   # seconds: 15 minutes of device time per task hold one machine start and one call of 600 s
# The dry run's timeouts are the GPU run's times SLACK: the interpreter's times say nothing about the GPU's, and the CI
# runs the dry run beside other tests on its 2 cores (its gpu tests alone took 177 s of the 180 there)
if [ "$DRY" = 1 ]; then SLACK=${SLACK:-3}; else SLACK=1; fi
SELECTABLE=(headline l2_hints triton_configs gpu_tests verify linear linear_long grid compile)
STEPS=${STEPS:-}
for name in ${STEPS//,/ }; do
  [[ " ${SELECTABLE[*]} " == *" $name "* ]] || { echo "gpu_suite: STEPS: unknown step '$name'; one of: ${SELECTABLE[*]}" >&2; exit 2; }
done
# the files that come back as they are (with extra.tar.gz: 8); everything else is packed into extra.tar.gz
KEEP=(suite.log summary.md bench.jsonl bench.json clocks.csv gpu_tests.txt verify.txt)
mkdir -p "$OUT"
if [ -z "${STEPS:-}" ]; then   # a rerun of some steps keeps what the earlier run wrote
  rm -rf "${KEEP[@]/#/$OUT/}" "$OUT"/{bench.csv,bench.png,build_cuda.txt,triton_configs.json,linear.jsonl,linear.md} \
    "$OUT"/{extra.tar.gz,prediction,linear_long,grid,compile}
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_suite.XXXXXX")
CLOCKS_PID=
trap '[ -z "$CLOCKS_PID" ] || kill "$CLOCKS_PID" 2>/dev/null; rm -rf "$WORK"' EXIT
FAILED=()
# least shares of the later steps (seconds), reserved out of the budget by the steps before them
HEADLINE_MIN=60 CONFIGS_MIN=30 TESTS_MIN=90 VERIFY_MIN=45 COMPILE_MIN=45

log() { echo "[gpu_suite ${SECONDS}s] $*" | tee -a "$OUT/suite.log"; }

# step NAME CAP RESERVE FILE CMD...: run CMD under a timeout of CAP seconds, less when the steps after it need
# RESERVE seconds of the budget. Output goes to $OUT/FILE (and to stdout when FILE is the log itself, else its
# last $TAIL lines). A non-zero exit, a timeout or a skip marks the step failed, except with PARTIAL=1 (the grid:
# what it measured before its timeout is kept, and that is all it can do). The clock samples carry NAME.
step() {
  local name=$1 cap=$2 reserve=$3 file=$4 rc
  shift 4
  if [ -n "${STEPS:-}" ] && [[ " ${SELECTABLE[*]} " == *" $name "* ]] && [[ ",$STEPS," != *",$name,"* ]]; then
    log "$name: not selected (STEPS=$STEPS)"
    return 0
  fi
  cap=$((cap * SLACK)) reserve=$((reserve * SLACK))
  local t=$((BUDGET * SLACK - SECONDS - reserve))
  ((t > cap)) && t=$cap
  if ((t < 5)); then
    log "$name: SKIPPED, the budget is spent"
    [ -n "${PARTIAL:-}" ] || FAILED+=("$name")
    return 1
  fi
  local cmd=${*//$'\n'/ }
  log "$name (timeout ${t}s): ${cmd:0:200}"
  echo "$name" >"$WORK/step"
  if [ "$file" = suite.log ]; then
    timeout -k 10 "$t" "$@" 2>&1 | tee -a "$OUT/suite.log"
    rc=${PIPESTATUS[0]}
  else
    timeout -s "${SIGNAL:-TERM}" -k 10 "$t" "$@" >>"$OUT/$file" 2>&1
    rc=$?
    tail -n "${TAIL:-4}" "$OUT/$file" | sed 's/^/    /' | tee -a "$OUT/suite.log"
  fi
  echo "-" >"$WORK/step"
  case $rc in
    0) return 0 ;;
    124 | 137 | 130) log "$name: TIMED OUT after ${t}s"
      [ -n "${PARTIAL:-}" ] && return 0 ;;
    *) log "$name: FAILED (exit $rc)" ;;
  esac
  FAILED+=("$name")
  return 1
}

export PYTHONUNBUFFERED=1   # a step killed by its timeout keeps every line it printed
export TQDM_DISABLE=1       # no progress bars in the log
export PYTHONSAFEPATH=1     # `python -m` must not put the tree's fused_is/ ahead of the installed copy
# The headline, the case the model predicts first; in the dry run the same command line at a tiny size (the cuda
# providers are skipped there with the reason; cpu stand-ins at the end run the C++ kernels' path)
HEADLINE_PROVIDERS=(triton_inplace_forward cuda_inplace_forward cuda_cluster_inplace_forward liger triton cuda
  triton_token_logprobs cuda_token_logprobs eager)
GRID_PROVIDERS=(triton_inplace cuda_inplace triton_inplace_forward cuda_inplace_forward cuda_cluster_inplace_forward
  triton cuda liger torch torch_inplace eager)
if [ "$DRY" = 1 ]; then
  export TRITON_INTERPRET=1 FUSED_IS_GPU_DRY_RUN=1   # Triton on the CPU; tests/conftest.py runs gpu tests tiny
  # liger: Liger-Kernel's Triton kernels run under the interpreter too (skipped, not failed, where not installed)
  SIZE=(--n 8 --seq-len 4 --vocab 1000 --dtypes bf16)
  HEADLINE=("${SIZE[@]}" --providers "${HEADLINE_PROVIDERS[@]}" cpu_inplace_forward cpu_token_logprobs --reps 1
    --warmup 0)
  GRID=(--n 4 --vocab 1000 --dtypes bf16 --reps 1 --providers "${GRID_PROVIDERS[@]}" cpu_inplace cpu_inplace_forward)
  COMPILE=()   # inductor's C++ compile takes minutes on a CPU
  CPU_ONLY=(--in-process --triton-interpreter)   # the GPU's code path (one process); Triton allowed on the CPU
  VERIFY=(--vocab 128 --dtypes fp32)   # every preset and backend; one dtype keeps it inside its cap
  # V = 9000: next_pow2 16384, so BLOCK 1024 to 8192 each launch as themselves (the interpreter ignores num_warps)
  CONFIG_SIZE=(--n 4 --vocab 9000 --dtypes bf16 --reps 1 --warmup 0)
  HINTS_SIZE=("${SIZE[@]}" --reps 1 --warmup 0)
else
  export TRITON_INTERPRET=0   # tests/conftest.py would default it to 1
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}   # build for the H200 only
  SIZE=(--n 16384 --seq-len 1024 --vocab 151936 --dtypes bf16)
  HEADLINE=("${SIZE[@]}" --providers "${HEADLINE_PROVIDERS[@]}" --reps 10)
  GRID=(--n 16384 4096 1024 --vocab 151936 32000 --dtypes bf16 fp32 --reps 5 --providers "${GRID_PROVIDERS[@]}")
  COMPILE=("${SIZE[@]}" --providers compile --reps 3)
  CPU_ONLY=() VERIFY=(--dtypes bf16)   # every preset and backend at bf16: half the Triton JIT of both dtypes
  CONFIG_SIZE=(--n 16384 --vocab 151936 --dtypes bf16 --reps 5)
  HINTS_SIZE=("${SIZE[@]}" --reps 10)   # the headline's size and layout
fi
# BLOCK x num_warps [@ programs per SM] of the Triton kernel, the default first (a timeout cuts the tail). Without
# '@' the launcher's L2 rule decides: one program per SM at V = 151936 (rows in flight within 3/4 of the L2). With
# it ($FUSED_IS_TRITON_PROGRAMS_PER_SM) 1024 threads per SM at 64 registers each, as the default: 1, 2, 4 rows per SM
# (40, 80, 160 MB in flight) at the same threads, and 8192x16 and 4096x8 at two numbers of rows. None spill on sm_90
# (tests/test_triton_configs.py compiles each).
TRITON_CONFIGS=(16384x32 8192x16@2 4096x8@4 8192x16 4096x8@2 8192x32)
log "$([ "$DRY" = 1 ] && echo "DRY RUN on the CPU" || echo "GPU run"): out $OUT, python $PY, budget ${BUDGET}s, \
model $MODEL_GPU"

# 1. Install offline, without dependencies (the image's torch and triton stay as they are), into a folder of its
# own (an existing editable install stays intact; PYTHONPATH comes before it). The build works on a copy of the
# package's files, so a stale build/ in the tree cannot leak old modules into the wheel.
mkdir -p "$WORK/src" && cp -r pyproject.toml setup.py README.md fused_is triton_kernels csrc "$WORK/src/"
if step install 60 0 suite.log "$PY" -m pip install -q --no-deps --no-build-isolation --no-index \
  --target "$WORK/site" "$WORK/src"; then
  INSTALL="installed copy"
  export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
else
  INSTALL="source tree (the install failed)"   # fused_is/backends/triton.py registers triton_kernels/ itself
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

# Liger-Kernel (the bench's `liger` provider and the fused-linear bench's): the GPU machine has no network, so from a
# wheel in build/wheels/ (scripts/dev.sh setup downloads it), offline and without dependencies, into a folder of the
# suite's own that goes first on PYTHONPATH. No wheel: the image's liger-kernel if it has one, else the bench skips
# liger with the reason. pytest-xdist and execnet (the gpu tests in parallel) likewise, on the GPU only and only where
# the image lacks them: the dry run's tests record their Triton launches into one file, which workers would overwrite.
LIGER_WHEEL=$(ls build/wheels/liger_kernel-*.whl 2>/dev/null | sort -V | tail -n 1)
XDIST_WHEELS=()
if [ "$DRY" = 0 ] && ! "$PY" -c "import xdist" 2>/dev/null; then
  mapfile -t XDIST_WHEELS < <(ls build/wheels/pytest_xdist-*.whl build/wheels/execnet-*.whl 2>/dev/null)
fi
if [ -n "$LIGER_WHEEL" ] || [ ${#XDIST_WHEELS[@]} -gt 0 ]; then
  step wheels_install 60 0 suite.log "$PY" -m pip install -q --no-deps --no-index --target "$WORK/deps" \
    ${LIGER_WHEEL:+"$LIGER_WHEEL"} "${XDIST_WHEELS[@]}" && export PYTHONPATH=$WORK/deps:$PYTHONPATH
fi
if [ -n "$LIGER_WHEEL" ]; then
  log "liger_install: $LIGER_WHEEL"
else
  log "liger_install: no liger_kernel-*.whl in build/wheels/ ($("$PY" -c 'import importlib.metadata as m
print("the image has liger-kernel " + m.version("liger-kernel"))' 2>/dev/null || echo "nor in the image: the bench skips liger"))"
fi
log "fused_is runs from the $INSTALL: PYTHONPATH=$PYTHONPATH"

# 2. Environment, and which files the imports resolve to.
step environment 60 0 suite.log "$PY" -c '
import importlib.util, platform, torch, fused_is
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
if torch.cuda.is_available():  # what the static model assumes (bench/gpu/gpu_perf_report.py GPU), read from the device
    props = torch.cuda.get_device_properties(0)
    print("device properties: SMs", props.multi_processor_count, "L2 bytes", getattr(props, "L2_cache_size", "?"),
          "memory bytes", props.total_memory, "capability", f"{props.major}.{props.minor}")
print("fused_is imported from", fused_is.__file__)
import os, fused_is.benchmarks.main as bench  # a package of the install (an editable one elsewhere must not lend it)
print("fused_is.benchmarks imported from", bench.__file__)
if not bench.__file__.startswith(os.path.dirname(fused_is.__file__)):
    raise SystemExit("fused_is.benchmarks is not from the imported fused_is package")
try:
    import triton
    from fused_is.backends.triton import kernels
    print("triton", triton.__version__, "kernels imported from", kernels().__file__)
except Exception as exc:
    print("triton kernels unavailable:", type(exc).__name__, exc)
for name in ("pytest_timeout", "xdist", "pynvml"):
    print(name, "yes" if importlib.util.find_spec(name) else "MISSING")
try:
    import importlib.metadata, liger_kernel
    print("liger-kernel", importlib.metadata.version("liger-kernel"), "imported from", liger_kernel.__file__)
except Exception as exc:
    print("liger-kernel unavailable:", type(exc).__name__, exc)'
log "git: $(git rev-parse --short HEAD 2>/dev/null || echo "no git checkout here") $(git status --porcelain \
  2>/dev/null | grep -qv '^??' && echo "(with changes not committed)")"
if [ "$DRY" = 0 ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit --format=csv 2>&1 \
    | tee -a "$OUT/suite.log"
  nvidia-smi -q -d CLOCK 2>&1 | grep -iE 'clocks|sm|memory|graphics' | head -n 24 | tee -a "$OUT/suite.log"
fi
# The clocks, all along: one row per 0.2 s with the step running (a stub's zeros in the dry run)
echo "-" >"$WORK/step"
"$PY" bench/gpu/clocks.py --out "$OUT/clocks.csv" --step-file "$WORK/step" --interval 0.2 \
  $([ "$DRY" = 1 ] && echo --stub) 2>>"$OUT/suite.log" &
CLOCKS_PID=$!

# 3. The static model's prediction of the headline (bench/gpu/gpu_perf_report.py: the kernels compiled for sm_90
# with the image's Triton and nvcc), in place and with a separate gradient, in the background while the CUDA
# extension builds (a few of the 16 cores). The dry run takes build/gpu_perf_report.json where scripts/dev.sh test
# left one (PREDICT=1 runs the model there too). The summary puts its ms beside the measured ones.
PREDICTION=$OUT/prediction
PREDICT_PIDS=()
DEVICE_L2=
if [ "$DRY" = 0 ]; then   # the model's L2 is the device's (its grid rule and hit rates), not the machine's datasheet
  DEVICE_L2=$("$PY" -c 'import torch; print(int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0)))' \
    2>/dev/null | tail -n 1 | grep -E '^[1-9][0-9]*$')
fi
if [ "$DRY" = 0 ] || [ "${PREDICT:-0}" = 1 ]; then
  mkdir -p "$PREDICTION"
  for case in inplace separate; do
    (timeout -k 5 100 env -u TRITON_INTERPRET "$PY" bench/gpu/gpu_perf_report.py --out-dir "$PREDICTION/$case" \
      --gpu "$MODEL_GPU" ${DEVICE_L2:+--l2-bytes "$DEVICE_L2"} $([ "$case" = separate ] && echo --separate-gradient) \
      >"$PREDICTION/$case.txt" 2>&1) &
    PREDICT_PIDS+=($!)
  done
  log "prediction: bench/gpu/gpu_perf_report.py --gpu $MODEL_GPU${DEVICE_L2:+ --l2-bytes $DEVICE_L2} in the \
background (in place and --separate-gradient)"
fi

# 4. The CUDA extension, its full time. After a failed build the bench leaves cuda out (each use would rebuild), and a
# lock left by a killed build is removed (torch's loader would wait on it forever).
if [ "$DRY" = 1 ]; then
  log "build_cuda: skipped in the dry run (no nvcc or CUDA torch here)" | tee "$OUT/build_cuda.txt"
elif ! TAIL=6 step build_cuda 120 $((HEADLINE_MIN + CONFIGS_MIN + TESTS_MIN + VERIFY_MIN)) build_cuda.txt \
  "$PY" -m fused_is.cli build cuda --verbose; then
  rm -f "${FUSED_IS_CACHE:-$HOME/.cache/fused_is}"/fused_is_cuda_*/lock
  export FUSED_IS_NO_BUILD=1   # the tests and verify see backend "cuda" unavailable (a skip with the reason), no rebuild
  mapfile -t HEADLINE < <(printf '%s\n' "${HEADLINE[@]}" | grep -v '^cuda')
  mapfile -t GRID < <(printf '%s\n' "${GRID[@]}" | grep -v '^cuda')
fi
if [ ${#PREDICT_PIDS[@]} -gt 0 ]; then
  wait "${PREDICT_PIDS[@]}"
  for case in inplace separate; do
    log "prediction ($case): $(tail -n 1 "$PREDICTION/$case.txt" 2>/dev/null)"
  done
fi
PRED_INPLACE=$PREDICTION/inplace/gpu_perf_report.json PRED_SEPARATE=$PREDICTION/separate/gpu_perf_report.json
if [ ! -f "$PRED_INPLACE" ] && [ -f build/gpu_perf_report.json ]; then
  mkdir -p "$PREDICTION/inplace" && cp build/gpu_perf_report.json "$PRED_INPLACE"
  log "prediction: build/gpu_perf_report.json (carried; scripts/dev.sh test wrote it)"
fi
SUMMARY=("$PY" bench/gpu/suite_summary.py "$OUT" --prediction "$PRED_INPLACE" --prediction-separate "$PRED_SEPARATE")

# 5. The headline, the case the model predicts first, in the trainer's layout (--seq-len: 16 sequences of 1024
# tokens, the model's [B, L + 1, V] output, one advantage per sequence; Liger's own: no provider copies the logits):
# copy bandwidth, then each provider's full call, its own kernels by name (profiler) and the GPU's busy time.
BENCH=("$PY" -m fused_is.benchmarks.main --jsonl "$OUT/bench.jsonl" "${CPU_ONLY[@]}")
step headline 150 $((CONFIGS_MIN + TESTS_MIN + VERIFY_MIN)) suite.log "${BENCH[@]}" --out "$OUT" "${HEADLINE[@]}" \
  --no-plot
step summary 30 0 suite.log "${SUMMARY[@]}" --note "written after the headline"

# The model says the hints make a separate gradient as fast as in place (without them 0.57 ms slower): the same two
# Triton providers at the headline's size and layout with them off, records of kind triton_config (configuration
# 16384x32-nohints) in bench.jsonl.
PARTIAL=1 step l2_hints 40 $((CONFIGS_MIN + TESTS_MIN + VERIFY_MIN)) suite.log "${BENCH[@]}" --out "$OUT/l2_hints" \
  --no-plot --triton-configs 16384x32-nohints --providers triton triton_inplace_forward "${HINTS_SIZE[@]}"

# 6. The Triton launch configurations at the headline size: records of kind triton_config in bench.jsonl as they are
# taken (a timeout keeps what ran), triton_configs.json.
PARTIAL=1 step triton_configs 90 $((TESTS_MIN + VERIFY_MIN)) suite.log "${BENCH[@]}" --out "$OUT" \
  --triton-configs "${TRITON_CONFIGS[@]}" --providers triton_inplace_forward "${CONFIG_SIZE[@]}"

# 7. The gpu tests (pytest-timeout bounds each one), then every backend and preset against float64.
PER_TEST=()
if "$PY" -c "import pytest_timeout" 2>/dev/null; then PER_TEST=(--timeout=$((60 * SLACK))); else log "no pytest-timeout: no per-test timeout"; fi
# Triton launch record (tests/conftest.py): none unless SUITE_TRITON_LAUNCHES names a file. Inside CI's pytest
# (tests/test_gpu_suite.py) it does, a file of its own, so the dry run's launches (the gpu tests' layouts) join
# the GPU build check without overwriting the outer run's record.
# tests/test_gpu.py first (the kernels at real sizes), then every other gpu test; in 4 processes when pytest-xdist is
# there (the Triton JIT of ~100 specialisations is the bulk of the time); SIGINT at the timeout, so pytest still
# prints which tests failed and which did not run.
PARALLEL=()
if [ "$DRY" = 0 ] && "$PY" -c "import xdist" 2>/dev/null; then PARALLEL=(-n 4 --dist loadfile)
else log "gpu tests in one process ($([ "$DRY" = 1 ] && echo "the dry run" || echo "no pytest-xdist"))"; fi
SIGNAL=INT TAIL=15 step gpu_tests 180 $VERIFY_MIN gpu_tests.txt env FUSED_IS_TRITON_LAUNCHES="${SUITE_TRITON_LAUNCHES:-}" \
  "$PY" -m pytest -q -rfE -m gpu tests/test_gpu.py tests -p no:cacheprovider "${PER_TEST[@]}" "${PARALLEL[@]}"
# TRITON_INTERPRET=0: on the CPU the interpreter would take a minute here (the gpu tests cover Triton there)
TAIL=2 step verify 90 0 verify.txt env TRITON_INTERPRET=0 "$PY" -m fused_is.cli verify "${VERIFY[@]}"

# 8. With what is left: the fused-linear bench (fused_is/benchmarks/linear.py: hidden states and the lm_head weight
# against eager and Liger), the grid (every provider, packed layout, the largest sizes first; its bench.json in
# grid/), and torch.compile of the eager loss last (its compile time is not in its numbers).
if [ "$DRY" = 1 ]; then
  LINEAR=(--n 16 32 --hidden-dim 16 --vocab 300 --reps 1 --providers eager fused_linear_torch fused_linear_cpu \
    fused_logits_cpu)
else
  LINEAR=(--n 1024 4096 16384 --hidden-dim 4096 --vocab 151936 --reps 3
    --providers fused_linear_triton fused_logits_triton fused_linear_cuda eager liger)   # fused_logits: the 3 GEMMs + loss
fi
PARTIAL=1 step linear 60 $COMPILE_MIN suite.log "$PY" -m fused_is.benchmarks.main --linear --out "$OUT" --no-plot \
  "${CPU_ONLY[@]}" "${LINEAR[@]}"
# Long context (issue 41): the 248K vocabulary, packed sequences of 32K tokens (one at N = 32768, four at 131072: the
# peak memory at both N, flat on the fused-linear path), with no and 75% masked rows (prompt and tool spans), against
# Liger (one 32K sequence per chunk) and TRL's chunked lm-head; its files in linear_long/
if [ "$DRY" = 1 ]; then
  LINEAR_LONG=(--n 64 128 --seq-len 64 --hidden-dim 16 --vocab 500 --masked 0 0.75 --reps 1 --providers \
    fused_linear_torch fused_linear_cpu)
else
  LINEAR_LONG=(--n 32768 131072 --seq-len 32768 --hidden-dim 4096 --vocab 248320 --masked 0 0.75 --reps 3
    --providers fused_linear_triton trl_chunked liger fused_linear_cuda)
fi
PARTIAL=1 step linear_long 120 $COMPILE_MIN suite.log "$PY" -m fused_is.benchmarks.main --linear --out \
  "$OUT/linear_long" --no-plot "${CPU_ONLY[@]}" "${LINEAR_LONG[@]}"
PARTIAL=1 step grid 600 $COMPILE_MIN suite.log "${BENCH[@]}" --out "$OUT/grid" --no-plot "${GRID[@]}"
if [ ${#COMPILE[@]} -gt 0 ]; then
  PARTIAL=1 step compile 120 0 suite.log "${BENCH[@]}" --out "$OUT/compile" --no-plot "${COMPILE[@]}"
else
  log "compile: skipped in the dry run (inductor's C++ compile takes minutes on a CPU)"
fi

kill "$CLOCKS_PID" 2>/dev/null && wait "$CLOCKS_PID" 2>/dev/null
CLOCKS_PID=
STATE="done in ${SECONDS}s, fused_is from the $INSTALL: $([ ${#FAILED[@]} = 0 ] && echo "all steps passed" \
  || echo "FAILED: ${FAILED[*]}")"
"${SUMMARY[@]}" --note "$STATE" >/dev/null 2>>"$OUT/suite.log" || FAILED+=(summary)
# Only 8 files come back: everything but KEEP goes into one archive (a rerun's archive is unpacked and packed again)
# (the list is taken before tar starts: listed while tar writes it, the archive would pack and remove itself)
(cd "$OUT" && { [ ! -f extra.tar.gz ] || { tar -xzf extra.tar.gz && rm extra.tar.gz; }; } \
  && packed=$(ls -A | grep -vxF "${KEEP[@]/#/-e}" -e extra.tar.gz || true) \
  && { [ -z "$packed" ] || printf '%s\n' "$packed" | tar -czf extra.tar.gz --remove-files -T -; }) || FAILED+=(archive)
log "done in ${SECONDS}s, fused_is from the $INSTALL: $([ ${#FAILED[@]} = 0 ] && echo "all steps passed" \
  || echo "FAILED: ${FAILED[*]}")"
[ ${#FAILED[@]} = 0 ]

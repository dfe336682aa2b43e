#!/usr/bin/env bash
# The GPU suite, run rarely on a lent H200 machine: no network; python3 with torch, triton, nvcc, ninja, pytest
# and pytest-timeout preinstalled; this working tree copied there (not installed). Results go to $OUT (default
# bench/results/h200): 8 flat files at most, because only those come back.
#   bash bench/gpu_suite.sh             # on the GPU machine; at most BUDGET=290 s, so one lease holds two runs
#   bash bench/gpu_suite.sh --dry-run   # (or DRY_RUN=1) the same steps on the CPU in about a minute: Triton under
#                                       # its interpreter, gpu tests at tiny shapes, no CUDA build (default OUT:
#                                       # build/gpu_suite_dry_run, never the committed results)
# Steps, most valuable first: install (and Liger-Kernel from build/wheels/ when there: `scripts/dev.sh setup` puts it
# there; carry build/wheels to the GPU machine), environment, CUDA build (sm_90 only), the headline bench (copy
# bandwidth, then triton, cuda and liger at N=16384, V=151936, bf16), the Triton launch configurations (issue #18:
# triton_inplace_forward at the headline size once per BLOCK x num_warps), gpu tests, verify, the fused-linear bench, then
# the rest of the grid in the time left.
# Each step has a timeout (caps: build 120 s, headline 60, baselines 30, configs 30, tests 90, verify 40) that also
# leaves the steps after it their least share (headline 40, baselines 30, configs 20, tests 80, verify 30), so the
# whole run ends by BUDGET plus a 10 s kill grace.
# A failing step is logged and the suite goes on; the last line of the log says what failed. Every measurement
# is appended to bench.jsonl as it is taken, so a timeout keeps what ran.
#   STEPS=gpu_tests,verify bash bench/gpu_suite.sh   # a rerun of some steps (headline, baselines, triton_configs,
#                                       # gpu_tests, verify, linear, grid): install, environment and the CUDA build
#                                       # always run, and the earlier run's files in $OUT are kept and appended to
set -uo pipefail
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1
case "${DRY_RUN:-0}" in 0 | "") DRY=0 ;; *) DRY=1 ;; esac
[ -n "${OUT:-}" ] && mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)   # relative to the caller, before the cd
cd "$(dirname "$0")/.."
if [ "$DRY" = 1 ]; then OUT=${OUT:-$PWD/build/gpu_suite_dry_run}; else OUT=${OUT:-$PWD/bench/results/h200}; fi
PY=${PYTHON:-python3}
BUDGET=${BUDGET:-290}   # seconds; 15 minutes of device time per task must cover two runs and two machine starts
SELECTABLE=(headline baselines triton_configs gpu_tests verify linear grid)
STEPS=${STEPS:-}
for name in ${STEPS//,/ }; do
  [[ " ${SELECTABLE[*]} " == *" $name "* ]] || { echo "gpu_suite: STEPS: unknown step '$name'; one of: ${SELECTABLE[*]}" >&2; exit 2; }
done
mkdir -p "$OUT"
if [ -z "${STEPS:-}" ]; then   # a rerun of some steps keeps what the earlier run wrote
  rm -f "$OUT"/{suite.log,bench.jsonl,bench.json,bench.csv,bench.png,build_cuda.txt,gpu_tests.txt,verify.txt} \
    "$OUT"/{triton_configs.json,extra.tar.gz}
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_suite.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
FAILED=()

log() { echo "[gpu_suite ${SECONDS}s] $*" | tee -a "$OUT/suite.log"; }

# step NAME CAP RESERVE FILE CMD...: run CMD under a timeout of CAP seconds, less when the steps after it need
# RESERVE seconds of the budget. Output goes to $OUT/FILE (and to stdout when FILE is the log itself, else its
# last $TAIL lines). A non-zero exit, a timeout or a skip marks the step failed, except with PARTIAL=1 (the grid:
# what it measured before its timeout is kept, and that is all it can do).
step() {
  local name=$1 cap=$2 reserve=$3 file=$4 rc
  shift 4
  if [ -n "${STEPS:-}" ] && [[ " ${SELECTABLE[*]} " == *" $name "* ]] && [[ ",$STEPS," != *",$name,"* ]]; then
    log "$name: not selected (STEPS=$STEPS)"
    return 0
  fi
  local t=$((BUDGET - SECONDS - reserve))
  ((t > cap)) && t=$cap
  if ((t < 5)); then
    log "$name: SKIPPED, the budget is spent"
    [ -n "${PARTIAL:-}" ] || FAILED+=("$name")
    return 1
  fi
  local cmd=${*//$'\n'/ }
  log "$name (timeout ${t}s): ${cmd:0:200}"
  if [ "$file" = suite.log ]; then
    timeout -k 10 "$t" "$@" 2>&1 | tee -a "$OUT/suite.log"
    rc=${PIPESTATUS[0]}
  else
    timeout -s "${SIGNAL:-TERM}" -k 10 "$t" "$@" >>"$OUT/$file" 2>&1
    rc=$?
    tail -n "${TAIL:-4}" "$OUT/$file" | sed 's/^/    /' | tee -a "$OUT/suite.log"
  fi
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
if [ "$DRY" = 1 ]; then
  export TRITON_INTERPRET=1 FUSED_IS_GPU_DRY_RUN=1   # Triton on the CPU; tests/conftest.py runs gpu tests tiny
  # liger: Liger-Kernel's Triton kernels run under the interpreter too (skipped, not failed, where not installed)
  HEADLINE=(--n 8 --seq-len 4 --vocab 1000 --dtypes bf16 --providers triton cuda cpu liger --reps 2)
  BASELINES=(--n 8 --seq-len 4 --vocab 1000 --dtypes bf16 --providers eager --reps 2)   # compile: minutes of C++ here
  GRID=(--n 4 8 --vocab 1000 --dtypes bf16 fp32 --reps 2
    --providers triton triton_inplace triton_inplace_forward cpu cpu_inplace cpu_inplace_forward liger torch torch_inplace eager)   # compile: minutes of C++ here
  CPU_ONLY=(--in-process --triton-interpreter)   # the GPU's code path (one process); Triton allowed on the CPU
  VERIFY=(--vocab 128 --dtypes fp32)   # every preset and backend; one dtype keeps it inside its cap
  # V = 9000: next_pow2 16384, so BLOCK 1024 to 8192 each launch as themselves (the interpreter ignores num_warps)
  CONFIG_SIZE=(--n 4 --vocab 9000 --dtypes bf16 --reps 1 --warmup 0)
else
  export TRITON_INTERPRET=0   # tests/conftest.py would default it to 1
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}   # build for the H200 only
  HEADLINE=(--n 16384 --seq-len 1024 --vocab 151936 --dtypes bf16 --providers triton cuda liger --reps 10)
  BASELINES=(--n 16384 --seq-len 1024 --vocab 151936 --dtypes bf16 --providers eager compile --reps 3)
  GRID=(--n 1024 4096 16384 --vocab 32000 151936 --dtypes bf16 fp32 --reps 5
    --providers triton cuda triton_inplace_forward cuda_inplace_forward cuda_cluster_inplace_forward triton_inplace liger torch torch_inplace eager compile)
  CONFIG_SIZE=(--n 16384 --vocab 151936 --dtypes bf16 --reps 5)
  CPU_ONLY=() VERIFY=(--dtypes bf16)   # every preset and backend at bf16: half the Triton JIT of both dtypes
fi
# BLOCK x num_warps of the Triton row kernels, most telling first (a timeout cuts the tail), spanning the rows
# resident per SM of bench/gpu/gpu_perf_report.py's model (sm_90, none spill: tests/test_triton_configs.py compiles
# each): 16384x32 the default (one persistent program per SM), 8192x32, 8192x16, 4096x8 (the default before), 2048x4.
# Each sets $FUSED_IS_TRITON_BLOCK / $FUSED_IS_TRITON_WARPS for its measurement.
TRITON_CONFIGS=(16384x32 8192x32 8192x16 4096x8 2048x4)
log "$([ "$DRY" = 1 ] && echo "DRY RUN on the CPU" || echo "GPU run"): out $OUT, python $PY, budget ${BUDGET}s"

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
# suite's own that goes first on PYTHONPATH (it holds liger_kernel alone). No wheel: the image's liger-kernel if it
# has one, else the bench skips liger with the reason.
LIGER_WHEEL=$(ls build/wheels/liger_kernel-*.whl 2>/dev/null | sort -V | tail -n 1)
# pytest-xdist and execnet (the gpu tests in parallel, step 5), on the GPU only: the dry run's tests record their
# Triton launches into one file, which parallel workers would overwrite
XDIST_WHEELS=()
[ "$DRY" = 1 ] || mapfile -t XDIST_WHEELS < <(ls build/wheels/pytest_xdist-*.whl build/wheels/execnet-*.whl 2>/dev/null)
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
try:
    import triton
    from fused_is.backends.triton import kernels
    print("triton", triton.__version__, "kernels imported from", kernels().__file__)
except Exception as exc:
    print("triton kernels unavailable:", type(exc).__name__, exc)
print("pytest-timeout", "yes" if importlib.util.find_spec("pytest_timeout") else "MISSING")
try:
    import importlib.metadata, liger_kernel
    print("liger-kernel", importlib.metadata.version("liger-kernel"), "imported from", liger_kernel.__file__)
except Exception as exc:
    print("liger-kernel unavailable:", type(exc).__name__, exc)'
[ "$DRY" = 1 ] || nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1 \
  | tee -a "$OUT/suite.log"

# 3. The CUDA extension. After a failed build the bench leaves cuda out (each use would rebuild), and a lock left
# by a killed build is removed (torch's loader would wait on it forever).
if [ "$DRY" = 1 ]; then
  log "build_cuda: skipped in the dry run (no nvcc or CUDA torch here)" | tee "$OUT/build_cuda.txt"
elif ! TAIL=6 step build_cuda 120 $((40 + 30 + 20 + 80 + 30)) build_cuda.txt "$PY" -m fused_is.cli build cuda --verbose; then
  rm -f "${FUSED_IS_CACHE:-$HOME/.cache/fused_is}"/fused_is_cuda_*/lock
  export FUSED_IS_NO_BUILD=1   # the tests and verify see backend "cuda" unavailable (a skip with the reason), no rebuild
  mapfile -t HEADLINE < <(printf '%s\n' "${HEADLINE[@]}" | grep -v '^cuda')
  mapfile -t GRID < <(printf '%s\n' "${GRID[@]}" | grep -v '^cuda')
fi

# 4. The headline: copy bandwidth, then triton, cuda and liger forward+backward (ppo_tis) at the largest size, in the
# trainer's layout (--seq-len: 16 sequences of 1024 tokens, the model's [B, L + 1, V] output, one advantage per
# sequence), Liger's own: no provider copies the logits. The grid (step 7) measures the packed layout.
BENCH=("$PY" -m fused_is.benchmarks.main --jsonl "$OUT/bench.jsonl" --out "$OUT" "${CPU_ONLY[@]}")
step headline 60 $((30 + 20 + 80 + 30)) suite.log "${BENCH[@]}" "${HEADLINE[@]}" --no-plot

# 4a. The eager torch baselines at the headline size, right after our kernels and Liger (the grid reaches them last,
# when the budget is spent): eager, and torch.compile of the same code (its compile time is not in its numbers).
PARTIAL=1 step baselines 30 $((20 + 80 + 30)) suite.log "${BENCH[@]}" "${BASELINES[@]}" --no-plot

# 4b. The Triton launch configurations (issue #18): triton_inplace_forward at the headline size once per BLOCK x num_warps,
# records of kind triton_config in bench.jsonl as they are taken (a timeout keeps what ran), triton_configs.json.
PARTIAL=1 step triton_configs 30 $((80 + 30)) suite.log "${BENCH[@]}" --triton-configs "${TRITON_CONFIGS[@]}" \
  --providers triton_inplace_forward "${CONFIG_SIZE[@]}"

# 5. The gpu tests (pytest-timeout bounds each one), then every backend and preset against float64.
PER_TEST=()
if "$PY" -c "import pytest_timeout" 2>/dev/null; then PER_TEST=(--timeout=60); else log "no pytest-timeout: no per-test timeout"; fi
# Triton launch record (tests/conftest.py): none unless SUITE_TRITON_LAUNCHES names a file. Inside CI's pytest
# (tests/test_gpu_suite.py) it does, a file of its own, so the dry run's launches (the gpu tests' layouts) join
# the GPU build check without overwriting the outer run's record.
# tests/test_gpu.py first (the kernels at real sizes), then every other gpu test; in 4 processes when pytest-xdist is
# there (the Triton JIT of ~100 specialisations is the bulk of the time); SIGINT at the timeout, so pytest still
# prints which tests failed and which did not run.
PARALLEL=()
if [ "$DRY" = 0 ] && "$PY" -c "import xdist" 2>/dev/null; then PARALLEL=(-n 4 --dist loadfile)
else log "gpu tests in one process ($([ "$DRY" = 1 ] && echo "the dry run" || echo "no pytest-xdist"))"; fi
SIGNAL=INT TAIL=15 step gpu_tests 90 30 gpu_tests.txt env FUSED_IS_TRITON_LAUNCHES="${SUITE_TRITON_LAUNCHES:-}" \
  "$PY" -m pytest -q -rfE -m gpu tests/test_gpu.py tests -p no:cacheprovider "${PER_TEST[@]}" "${PARALLEL[@]}"
# TRITON_INTERPRET=0: on the CPU the interpreter would take a minute here (the gpu tests cover Triton there)
TAIL=2 step verify 40 0 verify.txt env TRITON_INTERPRET=0 "$PY" -m fused_is.cli verify "${VERIFY[@]}"

# 6. The fused-linear bench (fused_is/benchmarks/linear.py): hidden states and the lm_head weight against eager
# (logits, then the loss) and Liger where installed; linear.jsonl/.md go into extra.tar.gz. What it measured
# before its timeout is kept.
if [ "$DRY" = 1 ]; then
  LINEAR=(--n 16 32 --hidden-dim 16 --vocab 300 --reps 1 --providers eager fused_linear_torch fused_linear_cpu \
    fused_logits_cpu)
else
  LINEAR=(--n 1024 4096 16384 --hidden-dim 4096 --vocab 151936 --reps 3
    --providers fused_linear_triton fused_logits_triton fused_linear_cuda eager liger)   # fused_logits: the 3 GEMMs + loss
fi
PARTIAL=1 step linear 60 0 suite.log "$PY" -m fused_is.benchmarks.main --linear --out "$OUT" --no-plot "${CPU_ONLY[@]}" \
  "${LINEAR[@]}"

# 7. The rest of the grid, in whatever time is left (it measures the headline again, so bench.json has it).
PARTIAL=1 step grid 600 0 suite.log "${BENCH[@]}" "${GRID[@]}"

# Only 8 files come back: beyond that, everything but the main results goes into one archive.
if (($(ls -A "$OUT" | wc -l) > 8)); then   # (a rerun's archive of the earlier run is unpacked and packed again)
  (cd "$OUT" && { [ ! -f extra.tar.gz ] || { tar -xzf extra.tar.gz && rm extra.tar.gz; }; } \
    && ls -A | grep -vxE 'suite\.log|bench\.(jsonl|json|csv|png)|gpu_tests\.txt|verify\.txt' \
    | tar -czf extra.tar.gz --remove-files -T -) || FAILED+=(archive)
fi
log "done in ${SECONDS}s, fused_is from the $INSTALL: $([ ${#FAILED[@]} = 0 ] && echo "all steps passed" \
  || echo "FAILED: ${FAILED[*]}")"
[ ${#FAILED[@]} = 0 ]

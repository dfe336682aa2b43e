"""The csrc/ extensions: the CPU build is part of set-up (scripts/dev.sh), the CUDA sources must compile.

The CPU kernel itself is tested against the float64 reference by the shared cases of test_backends.py
(it is one of its BACKENDS); this file checks the build path around it.
"""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

import fused_is
from fused_is import backends
from fused_is.backends import cpp

from cases import check_against_reference, config_for, make_inputs

REPO = Path(__file__).resolve().parent.parent


def test_cpu_extension_is_built_and_picked_by_auto():
    """scripts/dev.sh setup builds it: if it is missing here, the set-up is broken (not a skip)."""
    assert backends.unavailable_reason("cpu") is None, backends.unavailable_reason("cpu")
    assert backends.resolve("auto", torch.empty(2, 3, dtype=torch.bfloat16)) == "cpu"
    assert backends.resolve("auto", torch.empty(2, 3, dtype=torch.float64)) == "torch"


def test_import_never_compiles(tmp_path):
    """With an empty cache, importing fused_is builds nothing and backend='cpu' says how to build it."""
    code = ("import fused_is, torch\n"
            "from fused_is import backends\n"
            "print(backends.unavailable_reason('cpu', torch.empty(1, 1)))\n")
    env = dict(os.environ, FUSED_IS_CACHE=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "fused-is build cpu" in out.stdout
    assert not (tmp_path / "cache").exists()
    with pytest.raises(ValueError, match="backend='cpu' cannot run here.*fused-is build cpu"):
        env_logits = torch.zeros(1, 4)
        old = os.environ.get("FUSED_IS_CACHE")
        os.environ["FUSED_IS_CACHE"] = str(tmp_path / "cache")
        cpp._loaded.pop("cpu", None)
        try:
            fused_is.policy_loss(env_logits, torch.zeros(1, dtype=torch.long), torch.ones(1), config="ppo",
                                 backend="cpu")
        finally:
            if old is None:
                os.environ.pop("FUSED_IS_CACHE")
            else:
                os.environ["FUSED_IS_CACHE"] = old


def test_cuda_backend_names_what_is_missing():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the gpu tests cover the cuda backend")
    reason = backends.unavailable_reason("cuda", torch.empty(1, 1))
    assert reason is not None and "CUDA" in reason
    with pytest.raises(ValueError, match="backend='cuda' cannot run here"):
        fused_is.policy_loss(torch.zeros(1, 4), torch.zeros(1, dtype=torch.long), torch.ones(1), config="ppo",
                             backend="cuda")
    with pytest.raises(RuntimeError, match="cannot build the fused_is CUDA extension"):
        cpp.build("cuda")


def _nvcc():
    path = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if path is None:
        pytest.skip("nvcc is not installed on this machine")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("source", ["cuda/policy_loss_cuda.cu", "cuda/distill_cuda.cu", "cuda/bindings.cpp"])
def test_cuda_sources_compile_for_sm90(source, tmp_path):
    """Compile only (nothing runs without a GPU): a syntax or template error in the CUDA build fails here."""
    torch_include = Path(torch.__file__).parent / "include"
    # A CPU build of torch ships c10/cuda's headers but not the one its CMake generates for CUDA builds;
    # stand in for it with what a CUDA build's copy defines.
    generated = tmp_path / "include" / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    generated.parent.mkdir(parents=True)
    generated.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    # -std=c++20: the standard torch's cpp_extension builds the extension with
    cmd = [_nvcc(), "-std=c++20", "-arch=sm_90", "-O1", "--expt-relaxed-constexpr", f"-I{REPO / 'csrc'}",
           "-isystem", str(tmp_path / "include"),
           "-isystem", str(torch_include), "-isystem", str(torch_include / "torch" / "csrc" / "api" / "include"),
           "-isystem", sysconfig.get_paths()["include"], "-DTORCH_EXTENSION_NAME=fused_is_cuda_check",
           "-c", str(REPO / "csrc" / source), "-o", str(tmp_path / "out.o")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]


def _ptx(tmp_path, source: str) -> str:
    """The sm_90 PTX of csrc/cuda/`source` at -O3 (the extension's build)."""
    torch_include = Path(torch.__file__).parent / "include"
    generated = tmp_path / "include" / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    generated.parent.mkdir(parents=True, exist_ok=True)
    generated.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    ptx = tmp_path / "out.ptx"
    cmd = [_nvcc(), "-std=c++20", "-arch=sm_90", "-O3", "--expt-relaxed-constexpr", f"-I{REPO / 'csrc'}",
           "-isystem", str(tmp_path / "include"),
           "-isystem", str(torch_include), "-isystem", str(torch_include / "torch" / "csrc" / "api" / "include"),
           "-isystem", sysconfig.get_paths()["include"], "-DTORCH_EXTENSION_NAME=fused_is_cuda_check",
           "-ptx", str(REPO / "csrc" / "cuda" / source), "-o", str(ptx)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return ptx.read_text()


def test_cuda_logits_loads_are_coherent_where_the_gradient_may_alias(tmp_path):
    """In place, the gradient is written over the logits the same kernel reads: no kernel may read the logits through
    the non-coherent path (ld.global.nc, which `const S* __restrict__` lets the compiler choose) that a store of the
    same launch does not update. Only the row table, the given statistics (f64) and the tokens (u64) may use it."""
    loads = set(re.findall(r"ld\.global\.nc\.([a-z0-9.]+)", _ptx(tmp_path, "policy_loss_cuda.cu")))
    assert loads and loads <= {"f64", "u64"}, loads


@pytest.mark.slow
def test_cuda_distill_gradient_reads_both_models_coherently(tmp_path):
    """The same for distill_gradient_kernel, whose gradient may be written over the student's logits (and a teacher that
    is the student's detached alias): its non-coherent loads are the row's statistics (f32) and weight (f64), a few
    scalars each, never a row of either model (packed, 16-bit, or more than the six scalars). The statistics kernel
    writes nothing but its statistics, so it may read both models that way."""
    entries = re.split(r"\.entry ", _ptx(tmp_path, "distill_cuda.cu"))[1:]
    gradient = [entry for entry in entries if "distill_gradient_kernel" in entry.split("(")[0]]
    assert len(gradient) == 36, len(gradient)  # 3 student dtypes x 4 teacher dtypes x 3 divergences
    for entry in gradient:
        loads = re.findall(r"ld\.global\.nc\.([a-z0-9.]+)", entry)
        assert set(loads) <= {"f32", "f64"} and len(loads) <= 6, (entry.split("(")[0], loads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cpu_kernel_vocab_strided_half_types(dtype):
    """Column stride != 1 takes the kernel's strided loops (test_backends covers fp32 and padded slices)."""
    inputs = make_inputs("padded", dtype=dtype, seed=11, vocab=1000)
    inputs.logits = inputs.logits.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert inputs.logits.stride(-1) != 1
    check_against_reference(inputs, config_for("ppo_tis", dict(entropy_coef=0.01)), "cpu")
    check_against_reference(inputs, config_for("seq_mis"), "cpu", with_old=False, inplace=True)


def test_cpu_kernel_uses_the_threads_torch_allows():
    """at::parallel_for splits rows across torch's OpenMP threads; one thread gives the same numbers."""
    inputs = make_inputs("packed", dtype=torch.bfloat16, seed=12, vocab=4099)
    from cases import run

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        out1, grad1 = run(inputs, config_for("ppo_tis"), "cpu")
    finally:
        torch.set_num_threads(before)
    out2, grad2 = run(inputs, config_for("ppo_tis"), "cpu")
    assert torch.equal(grad1, grad2) and torch.equal(out1.loss, out2.loss)


def test_auto_builds_the_cpu_kernel_on_first_use(monkeypatch):
    """backend="auto" on the CPU without a built kernel builds it (announced on stderr) and runs it; with the build
    switched off it warns once, naming the fix, and runs "torch"; the output says which ran."""
    built = []
    ready = {"cpu": False}
    real = backends.unavailable_reason
    monkeypatch.setattr(backends, "unavailable_reason",
                        lambda name, logits=None, teacher=None: real(name, logits, teacher) if ready.get(name, True)
                        else "not built")
    monkeypatch.setattr(cpp, "build_on_first_use", lambda: (built.append(True), ready.update(cpu=True)))
    logits = torch.randn(3, 20)
    out = fused_is.policy_loss(logits, torch.zeros(3, dtype=torch.long), torch.ones(3), config="ppo")
    assert built and out.backend == "cpu"

    ready["cpu"] = False
    monkeypatch.setenv(cpp.NO_BUILD_ENV, "1")
    monkeypatch.setattr(backends, "_CPU_FALLBACK_WARNED", [])
    with pytest.warns(RuntimeWarning, match="fused-is build cpu"):
        out = fused_is.policy_loss(logits, torch.zeros(3, dtype=torch.long), torch.ones(3), config="ppo")
    assert out.backend == "torch" and len(built) == 1


def test_first_use_build_says_what_it_does(monkeypatch, capsys):
    monkeypatch.setattr(cpp, "build", lambda kind: None)
    cpp.build_on_first_use()
    err = capsys.readouterr().err
    assert "building the C++ CPU kernel" in err and "built" in err


def test_no_build_makes_an_unbuilt_cuda_extension_unavailable(monkeypatch):
    """FUSED_IS_NO_BUILD=1 (the GPU suite sets it after a failed CUDA build): backend "cuda" is unavailable with that
    reason instead of building on first use (each test would retry the build); without it, buildable is available."""
    monkeypatch.setattr(cpp, "missing_for_cuda", lambda: None)  # as on a GPU machine with nvcc
    monkeypatch.setattr(cpp, "_built_library", lambda name: None)
    monkeypatch.delitem(cpp._loaded, "cuda", raising=False)
    monkeypatch.delenv(cpp.NO_BUILD_ENV, raising=False)
    assert cpp.unavailable_reason("cuda", None) is None
    monkeypatch.setenv(cpp.NO_BUILD_ENV, "1")
    assert "FUSED_IS_NO_BUILD=1" in cpp.unavailable_reason("cuda", None)

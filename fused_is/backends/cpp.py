"""backend="cpu" and backend="cuda": loading, building and launching the csrc/ extensions.

Build path (DESIGN.md section 4; works on a fresh machine and under pip's build isolation, because
setup.py never imports torch): the extensions are compiled with torch.utils.cpp_extension.load (pybind11,
ninja) into a cache directory keyed by a hash of the sources, the torch and Python versions, the compile
flags and, for the CPU build, the CPU model (-march=native):

    fused-is build cpu        # or: python -m fused_is.backends.cpp cpu; scripts/dev.sh setup runs it
    fused-is build cuda       # needs nvcc and a CUDA build of torch; also done on first use of "cuda"

`import fused_is` never compiles. backend="cpu" uses the CPU extension only when it has been built
(otherwise the reason names the command above); backend="cuda" builds on first use and caches.
The cache lives in $FUSED_IS_CACHE (default ~/.cache/fused_is).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Dict, Optional

import torch

from . import abi

_CSRC_CANDIDATES = (
    Path(__file__).resolve().parent.parent / "csrc",  # installed: package data fused_is/csrc
    Path(__file__).resolve().parent.parent.parent / "csrc",  # source tree / editable install
)

# -fno-trapping-math lets GCC vectorise floorf and the float -> int conversion of the exp below; it changes
# no result (no code here reads the floating-point exception flags)
# (no -std flag: torch's cpp_extension adds the standard its headers need, c++20 for torch 2.13)
CPU_FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp"]
CPU_LDFLAGS = ["-fopenmp"]
CUDA_FLAGS = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]

_SOURCES = {
    "cpu": ["cpu/policy_loss_cpu.cpp", "cpu/distill_cpu.cpp"],
    "cuda": ["cuda/policy_loss_cuda.cu", "cuda/distill_cuda.cu", "cuda/bindings.cpp"],
}
_HEADERS = ["fused_is_math.h", "distill_math.h", "rows.h", "params.h", "cpu/vector_math.h", "cuda/device.cuh"]
_loaded: Dict[str, object] = {}


@functools.lru_cache(maxsize=None)
def csrc_dir() -> Path:
    """Directory holding the C++/CUDA sources (looked up once per process)."""
    for path in _CSRC_CANDIDATES:
        if (path / "fused_is_math.h").exists():
            return path
    raise FileNotFoundError("fused_is: csrc/ sources not found next to the package")


def cache_root() -> Path:
    return Path(os.environ.get("FUSED_IS_CACHE", Path.home() / ".cache" / "fused_is"))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


@functools.lru_cache(maxsize=None)
def _module_name(kind: str) -> str:
    """Extension name keyed by a hash of sources, flags, versions and CPU (computed once per process: it
    reads every source file, and backend resolution asks for it on each call until the module is loaded)."""
    src = csrc_dir()
    digest = hashlib.sha256()
    for rel in _HEADERS + _SOURCES[kind]:
        digest.update(rel.encode())
        digest.update((src / rel).read_bytes())
    digest.update(f"{torch.__version__}|{sys.version_info[:2]}|{platform.machine()}".encode())
    digest.update(" ".join(CPU_FLAGS + CPU_LDFLAGS if kind == "cpu" else CUDA_FLAGS).encode())
    if kind == "cpu":
        digest.update(_cpu_model().encode())
    else:  # the architectures it is built for: a build for an sm_80 node must not be reused on an sm_90 one
        digest.update(_cuda_arch_key().encode())
    return f"fused_is_{kind}_{digest.hexdigest()[:16]}"


def _cuda_arch_key() -> str:
    """What decides the architectures torch's extension build compiles for: $TORCH_CUDA_ARCH_LIST, else the visible
    devices' compute capabilities."""
    devices = []
    if torch.cuda.is_available():
        devices = sorted({torch.cuda.get_device_capability(k) for k in range(torch.cuda.device_count())})
    return f"{os.environ.get('TORCH_CUDA_ARCH_LIST', '')}|{devices}"


def _build_dir(name: str) -> Path:
    return cache_root() / name


def _built_library(name: str) -> Optional[Path]:
    path = _build_dir(name) / f"{name}.so"
    return path if path.exists() else None


def _import(name: str, path: Path):
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def missing_for_cuda() -> Optional[str]:
    """What the CUDA build lacks here, or None."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build (the CUDA extension needs a CUDA build of torch)"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None or shutil.which("nvcc") is None and not (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return "nvcc was not found (set CUDA_HOME or put nvcc on PATH)"
    return None


def build(kind: str, verbose: bool = False):
    """Compile (or reuse from the cache) the `kind` ("cpu" or "cuda") extension and return the module."""
    if kind not in _SOURCES:
        raise ValueError(f"kind must be 'cpu' or 'cuda'; got {kind!r}")
    if kind in _loaded:
        return _loaded[kind]
    if kind == "cuda":
        reason = missing_for_cuda()
        if reason is not None:
            raise RuntimeError(f"cannot build the fused_is CUDA extension: {reason}")
    from torch.utils.cpp_extension import load

    name = _module_name(kind)
    build_dir = _build_dir(name)
    build_dir.mkdir(parents=True, exist_ok=True)
    src = csrc_dir()
    kwargs = dict(extra_include_paths=[str(src)], build_directory=str(build_dir), verbose=verbose)
    if kind == "cpu":
        mod = load(name, [str(src / s) for s in _SOURCES[kind]], extra_cflags=CPU_FLAGS, extra_ldflags=CPU_LDFLAGS,
                   **kwargs)
    else:
        mod = load(name, [str(src / s) for s in _SOURCES[kind]], extra_cflags=["-O3"],
                   extra_cuda_cflags=CUDA_FLAGS, **kwargs)
    abi.check_extension(mod, f"the fused_is {kind} extension ({mod.__file__})")
    _loaded[kind] = mod
    return mod


def extension(kind: str):
    """The loaded extension; builds only for "cuda" (first use), never for "cpu" (see module docstring)."""
    if kind in _loaded:
        return _loaded[kind]
    name = _module_name(kind)
    path = _built_library(name)
    if path is None:
        if kind == "cuda":
            return build("cuda")
        raise RuntimeError("the fused_is CPU extension is not built: run `fused-is build cpu`")
    mod = _import(name, path)
    abi.check_extension(mod, f"the fused_is {kind} extension ({path})")
    _loaded[kind] = mod
    return mod


def unavailable_reason(kind: str, logits: Optional[torch.Tensor]) -> Optional[str]:
    """None when backend `kind` can run on these logits here, else a sentence saying what is missing."""
    if logits is not None and logits.dtype == torch.float64:
        return f"the {kind} kernel takes bf16/fp16/fp32 logits (fp64: backend='torch' or 'reference')"
    if kind == "cpu" and logits is not None and logits.device.type != "cpu":
        return "backend 'cpu' needs CPU tensors"
    if kind == "cuda" and logits is not None and not logits.is_cuda:
        return "backend 'cuda' needs CUDA tensors"
    if kind in _loaded:
        return None
    try:
        csrc_dir()
    except FileNotFoundError as err:
        return str(err)
    if kind == "cpu":
        if _built_library(_module_name("cpu")) is None:
            return "the CPU extension is not built: run `fused-is build cpu` (bash scripts/dev.sh setup does)"
        return None
    reason = missing_for_cuda()
    if reason is None and os.environ.get(NO_BUILD_ENV) == "1" and _built_library(_module_name("cuda")) is None:
        return f"the CUDA extension is not built and {NO_BUILD_ENV}=1 forbids building it on first use"
    return reason


class CppBackend:
    """backend="cpu" or "cuda": the primitives of the plan (fused_is/plan.py; the interface of
    fused_is/backends/__init__.py) over the csrc/ extension of `kind`. Each launches the extension's one entry
    point, forward(logits, tokens, row table, ints, floats, grad or None, given stats or None), which returns
    (lp, H, row max, log sum) (float64 [N] each); the CUDA binding takes the logits' device
    and torch's current stream there itself."""

    def __init__(self, kind: str):
        self.kind = kind

    def stats(self, logits: torch.Tensor, tokens: torch.Tensor, temperature):
        """(lp [N], H [N]) float64 for flat token ids [N]: the kernel without a gradient buffer; temperature: a
        float, or float64 [N] per row."""
        args = abi.stats_only(tokens.numel(), temperature, logits.device)
        return tuple(extension(self.kind).forward(logits, tokens.contiguous(), args.row_table, args.int_list(),
                                                  args.float_list(), None, None)[:2])

    def partial_stats(self, logits: torch.Tensor, tokens: torch.Tensor, temperature):
        """(lp, H, row max, log sum) float64 [N]: the rows' statistics, of which a vocabulary shard's are combined."""
        args = abi.stats_only(tokens.numel(), temperature, logits.device)
        return tuple(extension(self.kind).forward(logits, tokens.contiguous(), args.row_table, args.int_list(),
                                                  args.float_list(), None, None))

    def fused(self, logits: torch.Tensor, tokens: torch.Tensor, args: abi.KernelArgs, grad: torch.Tensor):
        """(lp [N], H [N]) float64; the gradient written into grad in the same launch."""
        return tuple(extension(self.kind).forward(logits, tokens.contiguous(), args.row_table, args.int_list(),
                                                  args.float_list(), grad, None)[:2])

    def fused_given(self, logits: torch.Tensor, tokens: torch.Tensor, stats: torch.Tensor, args: abi.KernelArgs,
                    grad: torch.Tensor) -> None:
        """The gradient sweep alone from the whole rows' stats (float64 [4, N]; a vocabulary shard's, or the rows of
        fused_is.logprobs' backward and of policy_loss(inplace=True))."""
        extension(self.kind).forward(logits, tokens.contiguous(), args.row_table, args.int_list(), args.float_list(),
                                     grad, stats.contiguous())

    def pair_unavailable_reason(self, logits: Optional[torch.Tensor], teacher: torch.Tensor) -> Optional[str]:
        """None when the distillation kernels can run on these tensors here, else why not (the dtype check first: it
        needs no extension)."""
        return abi.teacher_unavailable_reason(self.kind, teacher) or unavailable_reason(self.kind, logits)

    def pair_stats(self, logits: torch.Tensor, teacher: torch.Tensor, valid: torch.Tensor,
                   args: abi.PairArgs) -> torch.Tensor:
        """float32 [len(DISTILL_STATS), N]: per row the student's and the teacher's raw max and log2 sum (log-sum-exp
        = max / tau + log2 sum ln 2), D_t and K_t (a mixture's; else 0); zeros at masked rows, whose logits are not
        read (csrc/cpu/distill_cpu.cpp, csrc/cuda/distill_cuda.cu)."""
        return extension(self.kind).distill_stats(logits, teacher, valid.contiguous(), args.divergence,
                                                  args.scalar_list())

    def pair_gradient(self, logits: torch.Tensor, teacher: torch.Tensor, statistics: torch.Tensor,
                      weight: torch.Tensor, args: abi.PairArgs, grad: torch.Tensor) -> None:
        """grad <- weight_t F_t grad_scale for every row, rounded once to grad's dtype (args' accumulate: grad += the
        term, masked rows left as they are); statistics: `pair_stats`' output; weight: float64 [N] on the logits'
        device, 0 at masked rows (zeros written there, their logits unread); grad: the logits' shape and dtype, any
        strides, possibly the logits themselves."""
        extension(self.kind).distill_gradient(logits, teacher, grad, statistics, weight.to(torch.float64).contiguous(),
                                              args.divergence, args.scalar_list())


# backend="auto" on CPU tensors builds the CPU kernel on first use unless this is 1 (then it warns and takes "torch")
NO_BUILD_ENV = "FUSED_IS_NO_BUILD"


def build_on_first_use() -> None:
    """Build the CPU extension now, saying so on one line (backend="auto" with no built kernel)."""
    print(f"fused_is: building the C++ CPU kernel (once; cached in {cache_root()}; about a minute)...",
          file=sys.stderr, flush=True)
    build("cpu")
    print("fused_is: CPU kernel built", file=sys.stderr, flush=True)


if __name__ == "__main__":  # python -m fused_is.backends.cpp {cpu|cuda}
    for arg in sys.argv[1:] or ["cpu"]:
        module = build(arg, verbose="-v" in sys.argv)
        print(f"built {arg}: {module.__file__}")

"""backend="triton": launchers of triton_kernels/policy_loss.py (installed as fused_is.triton_kernels).

Token-local configurations (every preset except sequence/geometric IS with old_logprobs=None) run one
kernel, `_fused_kernel`: per row, the online-softmax sweep, g and h in registers, and the gradient sweep
over the same row while it is still in L2: one read from HBM and one write of the logits.
`_row_stats_kernel` gives lp and H alone: token_logprobs, and the first pass of the two-pass plan
(fused_is/plan.py), whose second pass is `_fused_kernel` again with the per-sequence W given per row.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Optional

import torch

from ..validate import Temperature
from . import abi

# BLOCK = 16384 lanes x NUM_WARPS = 32 (1024 threads): V = 151936 takes 9 full blocks and a tail per sweep; each
# thread loads two 16-byte vectors of bf16 an iteration and keeps its softmax state per vector (3 registers, not 3 per
# lane: triton_kernels/policy_loss.py _softmax_step), at most 64 registers (maxnreg). _fused_kernel is persistent:
# its grid is fused_grid(), about one program per SM at V = 151936, so that the rows in flight (132 x 300 KB = 40 MB)
# fit the L2 between a row's two sweeps and the second reads hit (bench/gpu/gpu_perf_report.py: the LRU model, the
# bytes in flight per thread read from the SASS). _row_stats_kernel reads each row once: one program per row, its sweep
# pipelined (STATS_STAGES). A heuristic, not an autotune (the interpreter cannot autotune); bench/gpu_suite.sh measures
# it against the copy bandwidth.
BLOCK = 16384
NUM_WARPS = 32
STRIDED_BLOCK = 1024  # rows with stride_col != 1 (a transposed view): one lane per thread at 32 warps
# contiguous rows that Triton cannot load as vectors (a row or sequence stride that is not a multiple of 16
# elements, e.g. an odd V, or logits not on a 16-byte boundary): scalar loads, every lane its own address, two lanes
# a thread at 32 warps
UNALIGNED_BLOCK = 2048
SCALE_BLOCK = 4096  # elements per program and loop step of _scale_kernel (16 per thread at SCALE_WARPS = 8)
SCALE_WARPS = 8
SCALE_PROGRAMS_PER_SM = 4  # _scale_kernel's grid: a grid-stride loop over the buffer, not one program per block
# _fused_kernel's rows in flight: at most this many bytes of rows (programs x V x element size) per byte of the device's
# L2, so that sweep 2 re-reads from L2 (0.75: the part of it a streamed row can hold, as bench/gpu/gpu_perf_report.py
# assumes); at least one program per SM, at most the SM's threads
FUSED_L2_FRACTION = 0.75
FUSED_MAX_PROGRAMS_PER_SM = 32
FUSED_THREADS_PER_SM = 1024  # the threads of _fused_kernel's programs on one SM: 64 registers each
INTERPRETER_L2_BYTES = 50 * 2**20  # the L2 assumed off a CUDA device (the interpreter): an H100's

# Overrides of BLOCK (the cap on lanes per program; a row shorter than it still gets next_pow2(V)) and NUM_WARPS
# of _fused_kernel and _row_stats_kernel, read at every launch so that one process can time several configs
# (`fused-is bench --triton-configs`). Unset or empty: the defaults above.
BLOCK_ENV = "FUSED_IS_TRITON_BLOCK"
WARPS_ENV = "FUSED_IS_TRITON_WARPS"
# _fused_kernel's programs per SM in place of programs_per_sm's L2 rule (the GPU suite compares 1, 2 and 4)
PROGRAMS_ENV = "FUSED_IS_TRITON_PROGRAMS_PER_SM"
# _fused_kernel's L2 eviction hints (L2_HINTS) on (1) or off (0) in place of l2_hints's rule (for the GPU suite)
HINTS_ENV = "FUSED_IS_TRITON_L2_HINTS"
BLOCK_CHOICES = tuple(1 << k for k in range(7, 15))  # powers of two in [128, 16384]
WARPS_CHOICES = (1, 2, 4, 8, 16, 32)


KERNEL_PACKAGE = "fused_is.triton_kernels"


@functools.lru_cache(maxsize=None)
def kernels():
    """The kernel module `fused_is.triton_kernels.policy_loss` (imports triton; compiles nothing).

    Installed and editable installs map `triton_kernels/` to `fused_is.triton_kernels` (setup.py). A source
    tree on PYTHONPATH has no such mapping, so there the package is registered from the folder beside
    `fused_is/`; the import name stays `fused_is.triton_kernels` either way (never the top-level
    `triton_kernels`, which is the Triton project's own package)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        _interpreter_index_compat()
    try:
        return importlib.import_module(KERNEL_PACKAGE + ".policy_loss")
    except ModuleNotFoundError as err:
        if err.name not in (KERNEL_PACKAGE, KERNEL_PACKAGE + ".policy_loss"):
            raise  # triton itself (or something it needs) is missing
    source = Path(__file__).resolve().parents[2] / "triton_kernels"
    if not (source / "policy_loss.py").is_file():
        raise ModuleNotFoundError(f"{KERNEL_PACKAGE} is not installed and {source} does not exist", name=KERNEL_PACKAGE)
    spec = importlib.util.spec_from_file_location(KERNEL_PACKAGE, source / "__init__.py",
                                                  submodule_search_locations=[str(source)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[KERNEL_PACKAGE] = package
    spec.loader.exec_module(package)
    setattr(sys.modules["fused_is"], "triton_kernels", package)
    return importlib.import_module(KERNEL_PACKAGE + ".policy_loss")


def _interpreter_index_compat() -> None:
    """Triton 3.6's interpreter turns a program id (a 1-element 1-d array) into a loop bound with int(array), which
    numpy >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"), so the persistent loop
    of _fused_kernel cannot run under TRITON_INTERPRET=1 with that pair (Triton 3.7 converts it itself). Where the
    pair is installed, the interpreter's per-launch patch of tl.tensor also gets an __index__ that reads the one
    element; nothing changes elsewhere (and nothing on a GPU, which compiles the kernels)."""
    import numpy
    import triton

    def version(text: str) -> tuple:
        return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())

    if version(triton.__version__) >= (3, 7) or version(numpy.__version__) < (2, 4):
        return
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "fused_is_compat", False):
        return

    def patch_with_index(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_with_index.fused_is_compat = True
    interpreter._patch_lang_tensor = patch_with_index


@functools.lru_cache(maxsize=None)
def _import_error(which: str = "") -> Optional[str]:
    """None when the kernel module imports (which: "" the policy loss's, "distillation " distill_kernels'), else why
    not."""
    try:
        distill_kernels() if which else kernels()
    except ImportError as err:
        return f"the Triton {which}kernels cannot be imported ({type(err).__name__}: {err})"
    return None


def on_device(x: torch.Tensor):
    """Launch context: Triton launches on the current CUDA device and its current stream, so make the
    tensors' device current (logits on cuda:1 while cuda:0 is current); torch's current stream of that
    device is then the stream Triton uses."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def unavailable_reason(logits: Optional[torch.Tensor]) -> Optional[str]:
    reason = _import_error()
    if reason is not None:
        return reason
    if logits is not None and not logits.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter)"
    if logits is not None and logits.dtype == torch.float64:
        return "the Triton kernels take bf16/fp16/fp32 logits (fp64: backend='torch' or 'reference')"
    return None


def row_layout(x: torch.Tensor):
    """(rows_per_seq, stride_seq, stride_row, stride_col) of [B, T, V] or [N, V] logits."""
    if x.dim() == 2:
        return max(1, x.shape[0]), 0, x.stride(0), x.stride(1)
    return max(1, x.shape[1]), x.stride(0), x.stride(1), x.stride(2)


def _env_override(name: str, allowed) -> Optional[int]:
    """The value of environment variable `name` (None when unset or empty), an int in `allowed`; else a
    ValueError naming the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw, 10)
    except ValueError:
        value = None
    if value is None or value not in allowed:
        raise ValueError(f"{name}={raw!r}: expected one of {', '.join(map(str, allowed))} (unset: the default)")
    return value


def block_override() -> Optional[int]:
    """$FUSED_IS_TRITON_BLOCK: a power of two in [128, 16384], or None when unset."""
    return _env_override(BLOCK_ENV, BLOCK_CHOICES)


# threads per program (workgroup) on AMD GPUs: a ROCm build of torch runs Triton with 64-lane wavefronts as its warps
HIP_MAX_THREADS = 1024
HIP_WARP_SIZE = 64


def warp_size() -> int:
    """Lanes of one of Triton's warps on this build of torch: 32 on CUDA, 64 (a wavefront) on ROCm."""
    return HIP_WARP_SIZE if torch.version.hip else 32


def max_warps() -> int:
    """The most warps a program may have on this build of torch: 32 (32-lane warps, 1024 threads) on CUDA; 16 on
    ROCm, whose warps are 64-lane wavefronts and whose workgroups take at most 1024 threads (32 would be 2048)."""
    return HIP_MAX_THREADS // warp_size()


def num_warps() -> int:
    """num_warps of _fused_kernel and _row_stats_kernel: $FUSED_IS_TRITON_WARPS (1, 2, 4, 8, 16 or 32, at most
    max_warps()), else NUM_WARPS capped at max_warps() (the same 1024 threads on ROCm). Read at each launch."""
    value = _env_override(WARPS_ENV, WARPS_CHOICES)
    if value is None:
        return min(NUM_WARPS, max_warps())
    if value > max_warps():
        raise ValueError(f"{WARPS_ENV}={value}: at most {max_warps()} warps per program on this GPU (ROCm: 64-lane "
                         f"wavefronts, 1024 threads per workgroup)")
    return value


def block_size(vocab: int, contiguous: bool = True, aligned: bool = True, element_size: int = 2) -> int:
    """BLOCK (lanes per program and loop step) of the kernels for vocabulary size `vocab`: the power of two
    covering the row, capped at BLOCK for 16-bit logits (the same bytes for wider ones: BLOCK / 2 lanes of fp32, 32
    bytes a thread at 32 warps; at BLOCK lanes fp32 rows spill 4 B on sm_90 with triton 3.6) or at
    $FUSED_IS_TRITON_BLOCK. Read at each launch. Rows whose columns are not contiguous (stride_col != 1: every lane its
    own 64-bit address, no vector loads) are capped at STRIDED_BLOCK unless overridden: at 4096 lanes ptxas spills them
    on sm_80; contiguous rows that are not `aligned` (rows_aligned) at UNALIGNED_BLOCK."""
    import triton

    cap = block_override()
    if cap is None:
        cap = (BLOCK * 2 // max(2, element_size) if aligned else UNALIGNED_BLOCK) if contiguous else STRIDED_BLOCK
    return min(cap, triton.next_power_of_2(vocab))


def rows_aligned(x: torch.Tensor) -> bool:
    """Whether Triton can load x's rows as 16-byte vectors: the data on a 16-byte boundary and every row and sequence
    stride a multiple of 16 elements (Triton's own specialisation of pointers and ints)."""
    _, stride_seq, stride_row, _ = row_layout(x)
    return x.data_ptr() % 16 == 0 and stride_row % 16 == 0 and stride_seq % 16 == 0


def launch_config(vocab: int, contiguous: bool = True, aligned: bool = True, element_size: int = 2) -> dict:
    """The (BLOCK, num_warps) the row kernels launch with for `vocab` now, overrides included."""
    return dict(BLOCK=block_size(vocab, contiguous, aligned, element_size), num_warps=num_warps())


def launch_config_of(logits: torch.Tensor) -> dict:
    """launch_config for these logits: their V, whether their columns are contiguous and their rows aligned, their
    element size."""
    return launch_config(logits.shape[-1], logits.stride(-1) == 1, rows_aligned(logits), logits.element_size())


LAST_LAUNCH: dict = {}  # kernel name -> what its latest launch compiled to (GPU: registers, spills; bench reads it)


def note_launch(name: str, compiled, config: dict) -> None:
    """Keep the compiled kernel's registers and spills of a launch (on a GPU the launch returns the
    CompiledKernel; the interpreter returns nothing), for the bench's per-config records."""
    LAST_LAUNCH[name] = dict(config, registers=getattr(compiled, "n_regs", None),
                             spills=getattr(compiled, "n_spills", None))


def stats(logits: torch.Tensor, tokens: torch.Tensor, temperature: Temperature):
    """(lp [N], H [N]) float64 for flat token ids [N]: one launch of _row_stats_kernel. temperature: a float,
    or float64 [N] per row."""
    out, grid, arguments, config = _stats_launch(logits, tokens, temperature)
    if grid:
        with on_device(logits):
            compiled = kernels()._row_stats_kernel[grid](*arguments, **config)
        note_launch("_row_stats_kernel", compiled, config)
    return out[0].double(), out[1].double()


def partial_stats(logits: torch.Tensor, tokens: torch.Tensor, temperature: Temperature):
    """(lp, H, row max, log sum) float64 [N] each: the statistics of a vocabulary shard's rows, of which the
    whole rows' are combined (fused_is/distributed.py); lp is that of token id `tokens` in the shard."""
    out, grid, arguments, config = _stats_launch(logits, tokens, temperature)
    if grid:
        with on_device(logits):
            compiled = kernels()._row_stats_kernel[grid](*arguments, **config)
        note_launch("_row_stats_kernel", compiled, config)
    return tuple(out.double().unbind(0))


def _stats_launch(logits, tokens, temperature):
    """(the fp32 [4, N] output, the grid (None for no rows), the positional arguments, the launch config) of one
    _row_stats_kernel launch."""
    n = tokens.numel()
    out = torch.empty(4, n, dtype=torch.float32, device=logits.device)
    if not n:
        return out, None, (), {}
    inv_tau = abi.inverse_temperature(temperature, n, logits.device)
    arguments = (logits, *row_layout(logits), tokens, out[0], out[1], out[2], out[3], logits.shape[-1], inv_tau)
    return out, (n,), arguments, launch_config_of(logits)


def scale_(grad: torch.Tensor, factor: torch.Tensor) -> None:
    """grad *= factor in place (grad contiguous, factor a 0-d tensor on grad's device), read on the device:
    each program returns at once when factor is 1, so a plain loss.backward() costs a launch, not a pass."""
    n = grad.numel()
    factor = factor.to(device=grad.device, dtype=torch.float32).reshape(1)
    programs = min(triton_cdiv(n, SCALE_BLOCK), SCALE_PROGRAMS_PER_SM * multiprocessor_count(grad.device))
    with on_device(grad):
        kernels()._scale_kernel[(programs,)](grad, factor, n, BLOCK=SCALE_BLOCK, num_warps=SCALE_WARPS)


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device: torch.device) -> int:
    """The SM count of a CUDA device (asked once per device); 1 elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def l2_cache_bytes(device: torch.device) -> int:
    """The L2 size of a CUDA device (INTERPRETER_L2_BYTES elsewhere)."""
    if device.type != "cuda":
        return INTERPRETER_L2_BYTES
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", INTERPRETER_L2_BYTES))


def programs_per_sm(l2_bytes: int, sms: int, row_bytes: int, num_warps: int) -> int:
    """_fused_kernel's programs per SM: as many as keep the rows in flight (programs x row_bytes) within
    FUSED_L2_FRACTION of the L2 and FUSED_THREADS_PER_SM threads on the SM (each program then gets the registers of
    fused_registers), at least 1, at most FUSED_MAX_PROGRAMS_PER_SM."""
    fit = int(FUSED_L2_FRACTION * l2_bytes) // (sms * max(1, row_bytes))
    return max(1, min(fit, FUSED_MAX_PROGRAMS_PER_SM, FUSED_THREADS_PER_SM // (warp_size() * num_warps)))


def fused_registers(num_warps: int, per_sm: int) -> int:
    """_fused_kernel's register cap (Triton's maxnreg) for per_sm programs of num_warps warps on an SM: its 65536
    registers shared among them (64 each at FUSED_THREADS_PER_SM threads), at most 255. Without it ptxas keeps the
    persistent row loop at 32 registers and spills (8 B on sm_90 at 8 and 32 warps)."""
    return min(255, 65536 // (per_sm * 32 * num_warps)) // 8 * 8


def programs_override(num_warps: int) -> Optional[int]:
    """$FUSED_IS_TRITON_PROGRAMS_PER_SM: _fused_kernel's programs per SM (1 to FUSED_MAX_PROGRAMS_PER_SM, as many as
    leave each thread at least 32 registers at num_warps), or None when unset. Read at each launch."""
    value = _env_override(PROGRAMS_ENV, range(1, FUSED_MAX_PROGRAMS_PER_SM + 1))
    if value is not None and fused_registers(num_warps, value) < 32:
        raise ValueError(f"{PROGRAMS_ENV}={value}: {value} programs of {num_warps} warps leave "
                         f"{fused_registers(num_warps, value)} registers a thread (at least 32: at most "
                         f"{max(1, min(FUSED_MAX_PROGRAMS_PER_SM, 2048 // (32 * num_warps)))} programs of "
                         f"{num_warps} warps per SM)")
    return value


L2_HINTS_MIN_MAJOR = 9  # sm_90 on: its build keeps 0 spills; sm_80's at 64 registers spills 8 bytes (Triton 3.6)


def l2_hints(capability_major: Optional[int]) -> bool:
    """Whether _fused_kernel launches with L2_HINTS (sweep 1's loads evict_last, sweep 2's loads and stores
    evict_first) on a CUDA device of this compute capability major (None: no CUDA device, the interpreter):
    $FUSED_IS_TRITON_L2_HINTS (0 or 1) when set, else on from sm_90. Read at each launch; the GPU build check
    compiles each architecture with the value it gets here."""
    value = _env_override(HINTS_ENV, (0, 1))
    if value is not None:
        return bool(value)
    return capability_major is not None and capability_major >= L2_HINTS_MIN_MAJOR


def l2_hints_on(device: torch.device) -> bool:
    """l2_hints for a launch on `device`: its compute capability major on CUDA; None (off unless forced) on the CPU
    (the interpreter) and on ROCm, whose Triton backend has no such hints to gain from."""
    if device.type != "cuda" or torch.version.hip:
        return l2_hints(None)
    return l2_hints(torch.cuda.get_device_capability(device)[0])


def fused_grid(logits: torch.Tensor, n: int, num_warps: int) -> tuple:
    """(programs, maxnreg) of a _fused_kernel launch: programs_per_sm x SMs programs ($FUSED_IS_TRITON_PROGRAMS_PER_SM
    x SMs when set), at most n (the grid depends on N only through this cap: each row's outputs do not depend on it,
    the kernel runs the same code for every row), and fused_registers for that many programs per SM."""
    sms = multiprocessor_count(logits.device)
    per_sm = programs_override(num_warps) or programs_per_sm(l2_cache_bytes(logits.device), sms,
                                                             logits.shape[-1] * logits.element_size(), num_warps)
    return max(1, min(n, per_sm * sms)), fused_registers(num_warps, per_sm)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def fused(logits: torch.Tensor, tokens: torch.Tensor, args: abi.KernelArgs, grad: torch.Tensor):
    """(lp [N], H [N]) float64 and the gradient written into grad: one launch of _fused_kernel, which forms g and h
    from the row table and the parameters."""
    lp, entropy, grid, arguments, keywords, config = _fused_launch(logits, tokens, args, grad, None)
    if grid:
        with on_device(logits):
            compiled = kernels()._fused_kernel[grid](*arguments, **keywords)
        note_launch("_fused_kernel", compiled, config)
    return lp.double(), entropy.double()


def fused_given(logits: torch.Tensor, tokens: torch.Tensor, stats: torch.Tensor, args: abi.KernelArgs,
                grad: torch.Tensor) -> None:
    """The gradient sweep alone, of a vocabulary shard: the whole rows' statistics `stats` (float64 [4, N]:
    max, log sum, lp, H), g and h given in args (coef_source given); tokens are shard-local ids, outside
    [0, V) where another shard has the token. One launch of _fused_kernel with STATS_GIVEN."""
    _, _, grid, arguments, keywords, config = _fused_launch(logits, tokens, args, grad, stats.contiguous())
    if grid:
        with on_device(logits):
            compiled = kernels()._fused_kernel[grid](*arguments, **keywords)
        note_launch("_fused_kernel", compiled, config)


def _fused_launch(logits, tokens, args: abi.KernelArgs, grad, stats):
    """(lp, H fp32 [N] outputs, the grid (None for no rows), the positional and the keyword arguments, the
    launch config) of one _fused_kernel launch."""
    n = tokens.numel()
    lp = torch.empty(n, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(lp)
    if not n:
        return lp, entropy, None, (), {}, {}
    config = launch_config_of(logits)
    arguments = (logits, *row_layout(logits), grad, *row_layout(grad), tokens, args.row_table, lp, entropy,
                 args.row_table if stats is None else stats, n, logits.shape[-1])
    keywords = dict(**args.floats, **args.constexprs(), HAS_KL=args.floats["kl_coef"] != 0.0,
                    STATS_GIVEN=stats is not None, WHOLE_GROUPS=logits.shape[-1] % 16 == 0,
                    L2_HINTS=l2_hints_on(logits.device), **config)
    programs, registers = fused_grid(logits, n, config["num_warps"])
    if torch.version.hip is None:  # a CUDA (or interpreter) option; Triton's AMD backend has no maxnreg
        keywords["maxnreg"] = registers
    return lp, entropy, (programs,), arguments, keywords, config


# --- both models' rows: the distillation kernels (triton_kernels/distill.py) ------------------------------------------
#
# The pair sweeps of fused_is/distill.py's plan, taking both models' rows, the valid rows and the launch's PairArgs
# (fused_is/backends/abi.py: the divergence's code and the DISTILL_SCALARS). The launch configuration is the policy
# loss's, taken for the wider of the two models' rows.


@functools.lru_cache(maxsize=None)
def distill_kernels():
    """The kernel module fused_is.triton_kernels.distill (imports triton; compiles nothing)."""
    kernels()  # registers fused_is.triton_kernels from a source tree, the interpreter's compat patch
    return importlib.import_module(KERNEL_PACKAGE + ".distill")


def pair_unavailable_reason(logits: Optional[torch.Tensor], teacher: torch.Tensor) -> Optional[str]:
    """None when the distillation kernels can run on these tensors here, else a sentence saying why not."""
    return (unavailable_reason(logits) or abi.teacher_unavailable_reason("Triton", teacher)
            or _import_error("distillation "))


def column_bytes(student_size: int, teacher_size: int) -> int:
    """The bytes of one column of both rows rounded up to a power of two: the element size the policy loss's BLOCK rule
    (block_size) sizes the distillation kernels' blocks by, so that a block holds as many bytes of both rows as the
    policy kernels' block of one (16384 lanes of bf16 there, 8192 of a bf16 pair here: 16 bytes a thread of each row
    at 32 warps; at 16384 lanes of a 16-bit pair the stats kernel spills on sm_90)."""
    return 1 << (student_size + teacher_size - 1).bit_length()


def pair_launch_config(logits: torch.Tensor, teacher: torch.Tensor) -> dict:
    """(BLOCK, num_warps) of the distillation kernels: the policy loss kernels' rule (and $FUSED_IS_TRITON_BLOCK /
    _WARPS) for columns of column_bytes; rows that Triton cannot load as 16-byte vectors in both models (strided
    columns, or a row off a 16-byte boundary) take the strided rows' cap, every lane its own address in two rows."""
    vectors = (logits.stride(-1) == 1 and teacher.stride(-1) == 1 and rows_aligned(logits)
               and rows_aligned(teacher))
    return launch_config(logits.shape[-1], vectors, True, column_bytes(logits.element_size(), teacher.element_size()))


def _pair_options(device: torch.device, grid: tuple, config: dict) -> dict:
    """A pair launch's keyword options: the config, and (CUDA, not ROCm: Triton's AMD backend has none) the register
    cap of the policy loss's persistent kernel for this many programs per SM (fused_registers); without it ptxas keeps
    the row loop at 32 registers and spills (strided rows, sm_80 and sm_90)."""
    options = dict(config)
    if torch.version.hip is None:
        sms = multiprocessor_count(device)
        resident = FUSED_THREADS_PER_SM // (warp_size() * config["num_warps"])
        per_sm = max(1, min(resident, -(-grid[0] // sms)))
        options["maxnreg"] = fused_registers(config["num_warps"], per_sm)
    return options


def _pair_grid(logits: torch.Tensor, teacher: torch.Tensor, n: int, persistent: bool, num_warps: int) -> tuple:
    """One program per row, or (two sweeps per row) the policy loss's persistent grid for rows of both models' bytes,
    so that a row is still in L2 when its second sweep reads it."""
    if not persistent:
        return (n,)
    sms = multiprocessor_count(logits.device)
    row_bytes = logits.shape[-1] * (logits.element_size() + teacher.element_size())
    per_sm = programs_per_sm(l2_cache_bytes(logits.device), sms, row_bytes, num_warps)
    return (max(1, min(n, per_sm * sms)),)


def _pair_setup(logits: torch.Tensor, teacher: torch.Tensor, n: int, persistent: bool) -> tuple:
    """(grid, config, keyword options) of a distillation launch over n rows of both models, and the rows' leading
    arguments (logits, its layout, teacher, its strides)."""
    config = pair_launch_config(logits, teacher)
    grid = _pair_grid(logits, teacher, n, persistent, config["num_warps"])
    rows = (logits, *row_layout(logits), teacher, *row_layout(teacher)[1:])
    return grid, config, _pair_options(logits.device, grid, config), rows


def pair_stats(logits: torch.Tensor, teacher: torch.Tensor, valid: torch.Tensor, args: abi.PairArgs) -> torch.Tensor:
    """float32 [len(DISTILL_STATS), N]: per row the student's and the teacher's raw max and log2 sum (log-sum-exp =
    max / tau + log2 sum ln 2), D_t and K_t (a mixture's; else 0); zeros at masked rows. One launch of
    _distill_stats_kernel (persistent for a mixture: its two sweeps of a row)."""
    n, s = valid.numel(), args.scalars
    out = torch.empty(len(abi.DISTILL_STATS), n, dtype=torch.float32, device=logits.device)
    if n:
        grid, config, options, rows = _pair_setup(logits, teacher, n, args.mixture)
        with on_device(logits):
            compiled = distill_kernels()._distill_stats_kernel[grid](
                *rows, valid.contiguous(), out, n, logits.shape[-1], s["student_scale"], s["teacher_scale"],
                s["beta"], s["log2_student_share"], s["log2_teacher_share"], DIVERGENCE=args.divergence, **options)
        note_launch("_distill_stats_kernel", compiled, config)
    return out


def pair_jsd_given(logits: torch.Tensor, teacher: torch.Tensor, valid: torch.Tensor, statistics: torch.Tensor,
                   args: abi.PairArgs) -> torch.Tensor:
    """float32 [2, N]: per row this vocabulary shard's parts of KL(p || m) and KL(q || m) in nats, p, q and m the
    whole rows' (vocab_group): statistics laid out as `pair_stats` writes it, its maxes and log2 sums those of the
    whole rows; zeros at masked rows. One launch of _distill_jsd_given_kernel."""
    n, s = valid.numel(), args.scalars
    out = torch.empty(2, n, dtype=torch.float32, device=logits.device)
    if n:
        grid, config, options, rows = _pair_setup(logits, teacher, n, False)
        with on_device(logits):
            compiled = distill_kernels()._distill_jsd_given_kernel[grid](
                *rows, valid.contiguous(), statistics, out, n, logits.shape[-1], s["student_scale"],
                s["teacher_scale"], s["log2_student_share"], s["log2_teacher_share"], **options)
        note_launch("_distill_jsd_given_kernel", compiled, config)
    return out


def pair_gradient(logits: torch.Tensor, teacher: torch.Tensor, statistics: torch.Tensor, weight: torch.Tensor,
                  args: abi.PairArgs, grad: torch.Tensor) -> None:
    """grad <- weight_t F_t grad_scale for every row (fused_is/distill.py), rounded once to grad's dtype (args'
    accumulate: grad += the term instead, grad a buffer of its own, masked rows left as they are); statistics: the
    output of `pair_stats`; weight: float64 [N] on the device, 0 at masked rows (zeros written there, their logits
    unread); grad: the logits' shape, any strides, possibly the logits themselves. One launch of
    _distill_gradient_kernel."""
    n, s = weight.numel(), args.scalars
    if n:
        grid, config, options, rows = _pair_setup(logits, teacher, n, False)
        with on_device(logits):
            compiled = distill_kernels()._distill_gradient_kernel[grid](
                *rows, grad, *row_layout(grad)[1:], statistics, weight.contiguous(), n, logits.shape[-1],
                s["student_scale"], s["teacher_scale"], s["grad_scale"], s["log2_student_share"],
                s["log2_teacher_share"], DIVERGENCE=args.divergence, ACCUMULATE=bool(s["accumulate"]), **options)
        note_launch("_distill_gradient_kernel", compiled, config)


def policy_fused(logits: torch.Tensor, teacher: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor,
                 args: abi.KernelArgs, divergence: int, term_weight: torch.Tensor, grad: torch.Tensor) -> tuple:
    """policy_loss's one pass with its distillation term: (lp, H, D_t, the teacher's log-sum-exp), float64 [N] each
    (D_t and the log-sum-exp 0 at masked rows), and d loss / d z (the policy's and w_t F_t / tau) written into grad
    (the logits' shape, any strides, possibly the logits themselves). args: the policy loss's abi.KernelArgs (the row
    table's inv_tau is both models' 1 / tau); divergence: the kernels' code of a divergence without a mixture;
    term_weight: float64 [N], w_t = a_t distill_coef. One launch of _fused_distill_kernel, persistent (the rows in
    flight between its two sweeps within the L2)."""
    n = valid.numel()
    lp = torch.empty(n, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(lp)
    term = torch.empty(2, n, dtype=torch.float32, device=logits.device)
    if n:
        grid, config, options, rows = _pair_setup(logits, teacher, n, True)
        with on_device(logits):
            compiled = distill_kernels()._fused_distill_kernel[grid](
                *rows, grad, *row_layout(grad)[1:], tokens, args.row_table, valid.contiguous(),
                term_weight.contiguous(), lp, entropy, term, n, logits.shape[-1], **args.floats, **args.constexprs(),
                HAS_KL=args.floats["kl_coef"] != 0.0, DIVERGENCE=divergence, WHOLE_GROUPS=logits.shape[-1] % 16 == 0,
                **options)
        note_launch("_fused_distill_kernel", compiled, config)
    return lp.double(), entropy.double(), term[0].double(), term[1].double()

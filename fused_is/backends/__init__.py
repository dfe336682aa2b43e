"""Backend registry and dispatch: which kernels exist here, what backend="auto" picks, and the interface every
backend implements (`Backend`): the primitives of the plan (fused_is/plan.py), each launching its kernel itself.
Whether a backend can run here, for one model's rows or for both models' (a teacher given), is `unavailable_reason`;
`implementation(name)` is the object that runs it.
"""

from __future__ import annotations

import importlib
import os
import warnings
from typing import Optional, Protocol, Tuple

import torch

from ..combinations import refused
from . import abi



class Backend(Protocol):
    """What the plan asks of a backend (torch_chunked and triton are modules with these functions; cpu and cuda are
    cpp.CppBackend objects). Row statistics are float64 [N]; temperature is a float, or float64 [N] per row; tokens
    are flat int64 [N] (a vocabulary shard's local ids fall outside [0, V) where another shard has the token)."""

    def stats(self, logits: torch.Tensor, tokens: torch.Tensor, temperature) -> Tuple[torch.Tensor, torch.Tensor]:
        """(lp, H) of each row: the stats sweep, no gradient."""

    def partial_stats(self, logits: torch.Tensor, tokens: torch.Tensor, temperature) -> Tuple[torch.Tensor, ...]:
        """(lp, H, row max, log sum): a vocabulary shard's statistics, combined over the group by the caller."""

    def fused(self, logits: torch.Tensor, tokens: torch.Tensor, args: abi.KernelArgs,
              grad: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(lp, H) and d loss / d logits written into grad (logits' shape and dtype; may be the logits) in one
        sweep; g and h formed per row from args (abi.KernelArgs)."""

    def fused_given(self, logits: torch.Tensor, tokens: torch.Tensor, stats: torch.Tensor, args: abi.KernelArgs,
                    grad: torch.Tensor) -> None:
        """The gradient sweep alone from the whole rows' statistics (float64 [4, N]: max, log sum, lp, H) and g, h
        given in args' row table."""

    # the pair sweeps of the distillation kernels (the kernel backends; backend="torch" runs fused_is/distill.py's
    # chunked sweeps): both models' rows [.., V] of the same shape, valid bool [N], the launch's abi.PairArgs

    def pair_stats(self, logits: torch.Tensor, teacher: torch.Tensor, valid: torch.Tensor,
                   args: abi.PairArgs) -> torch.Tensor:
        """float32 [len(abi.DISTILL_STATS), N]: both models' raw max and log2 sum per row, D_t and K_t."""

    def pair_gradient(self, logits: torch.Tensor, teacher: torch.Tensor, statistics: torch.Tensor,
                      weight: torch.Tensor, args: abi.PairArgs, grad: torch.Tensor) -> None:
        """grad <- (or +=, args' accumulate) weight_t F_t grad_scale, rounded once, given pair_stats' statistics."""


# backend name -> module under fused_is.backends implementing Backend, or the csrc/ extension's kind
_MODULES = {"torch": "torch_chunked", "triton": "triton"}
_CPP = ("cpu", "cuda")
_IMPLEMENTATIONS = {}


def unavailable_reason(name: str, logits: Optional[torch.Tensor] = None,
                       teacher: Optional[torch.Tensor] = None) -> Optional[str]:
    """None when `name` can run on `logits` here (with a teacher: its distillation kernels on both models' rows),
    else a sentence saying what is missing."""
    if torch.compiler.is_compiling() and logits is not None:  # at trace time, from what the graph's guards fix
        return _unavailable_at_trace(name, str(logits.device), logits.dtype, teacher is not None and teacher.dtype)
    return _unavailable(name, logits, teacher)


def _unavailable(name: str, logits: Optional[torch.Tensor], teacher: Optional[torch.Tensor]) -> Optional[str]:
    if name in ("torch", "reference"):
        return None
    if name not in ("triton",) + _CPP:
        return f"backend {name!r} is not built into this version of fused_is"
    if name in _CPP:
        from . import cpp

        if teacher is None:  # no extension is loaded to say so
            return cpp.unavailable_reason(name, logits)
    impl = implementation(name)
    return impl.unavailable_reason(logits) if teacher is None else impl.pair_unavailable_reason(logits, teacher)


def _unavailable_at_trace(name: str, device: str, dtype: torch.dtype, teacher_dtype) -> Optional[str]:
    """unavailable_reason for tensors on `device` of these dtypes (teacher_dtype False: no teacher), run at trace time
    with plain values (dynamo cannot trace the imports that find the kernels); the attribute below is what
    torch._dynamo.assume_constant_result sets."""
    return _unavailable(name, *_probes(device, dtype, teacher_dtype))


_unavailable_at_trace._dynamo_marked_constant = True


def available_backends(logits: Optional[torch.Tensor] = None) -> list:
    """Names of the backends (besides "auto") that can run here, on logits' device when given."""
    return [n for n in ("triton", "cuda", "cpu", "torch", "reference") if unavailable_reason(n, logits) is None]


def resolve(backend: str, logits: torch.Tensor, sharded: bool = False, teacher: Optional[torch.Tensor] = None) -> str:
    """The concrete backend for `backend` on these logits; ValueError naming `backend` if it cannot run.

    "auto" takes the fastest kernel that can run: triton, then cuda, on CUDA tensors; the C++ kernel on CPU
    tensors, built on first use (a one-line message, then cached) when a compiler is there; "torch" otherwise
    (fp64 logits, or no way to build: then a one-time warning naming the fix). sharded: the logits are a
    vocabulary shard (vocab_group), which the cuda kernel has no path for yet ("auto" then takes "torch";
    "cuda" and "reference" are refused). teacher: both models' rows, the backend's distillation kernels ("auto" takes
    the first whose kernels read them, else "torch")."""
    if torch.compiler.is_compiling():  # decided while dynamo traces, from what the graph's guards fix
        return _resolve_at_trace(backend, str(logits.device), logits.dtype, sharded,
                                 teacher is not None and teacher.dtype)
    return _resolve(backend, logits, sharded, teacher)


def _resolve(backend: str, logits: torch.Tensor, sharded: bool, teacher: Optional[torch.Tensor] = None) -> str:
    if sharded and backend == "reference":
        raise refused("reference/vocab_group", backends="'cpu', 'triton' or 'torch'")
    if sharded and backend == "cuda":
        raise refused("cuda/vocab_group", backends="'cpu', 'triton' or 'torch'")
    if backend == "auto":
        if logits.dtype == torch.float64:
            return "torch"
        if logits.is_cuda:
            for name in ("triton",) if sharded else ("triton", "cuda"):
                if unavailable_reason(name, logits, teacher) is None:
                    return name
            return "torch"
        if logits.device.type == "cpu" and _cpu_kernel_ready(logits) and unavailable_reason("cpu", logits,
                                                                                            teacher) is None:
            return "cpu"
        return "torch"
    reason = unavailable_reason(backend, logits, teacher)
    if reason is not None:
        raise ValueError(f"backend={backend!r} cannot run here: {reason}")
    return backend


def _resolve_at_trace(backend: str, device: str, dtype: torch.dtype, sharded: bool, teacher_dtype) -> str:
    """resolve() for logits on `device` of `dtype` (teacher_dtype False: no teacher), run at trace time with plain
    values (dynamo cannot trace the imports that find the kernels); the attribute below is what
    torch._dynamo.assume_constant_result sets."""
    logits, teacher = _probes(device, dtype, teacher_dtype)
    return _resolve(backend, logits, sharded, teacher)


def _probes(device: str, dtype: torch.dtype, teacher_dtype) -> tuple:
    """Empty stand-ins of the logits and the teacher (None where teacher_dtype is False) for the trace-time choices."""
    def probe(x_dtype):
        return torch.empty(0, 1, device=device, dtype=x_dtype)

    return probe(dtype), (probe(teacher_dtype) if teacher_dtype is not False else None)


_resolve_at_trace._dynamo_marked_constant = True

_CPU_FALLBACK_WARNED = []


def _cpu_kernel_ready(logits: torch.Tensor) -> bool:
    """Whether backend "cpu" can run, building the C++ kernel on first use (once per machine: cached, about a
    minute) when it is not built; False, with a one-time warning, when it cannot be built here."""
    if unavailable_reason("cpu", logits) is None:
        return True
    from . import cpp

    if os.environ.get(cpp.NO_BUILD_ENV) != "1":
        try:
            cpp.build_on_first_use()
            return unavailable_reason("cpu", logits) is None
        except Exception as err:  # no compiler, no headers: say so once and take the torch backend
            reason = f"the build failed ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    else:
        reason = f"{cpp.NO_BUILD_ENV}=1"
    if not _CPU_FALLBACK_WARNED:
        _CPU_FALLBACK_WARNED.append(True)
        warnings.warn(f"fused_is: backend='auto' runs the torch backend on the CPU, several times slower than the C++ "
                      f"kernel, which is not built ({reason}); run `fused-is build cpu` once to build it",
                      RuntimeWarning, stacklevel=3)
    return False


def gradient_buffer(logits: torch.Tensor, inplace: bool) -> torch.Tensor:
    """Where a backend writes d loss / d logits: a new buffer in the logits' dtype and shape, or (inplace)
    a detached alias of the logits themselves. The alias shares storage and version counter, so autograd
    sees the write, and AccumulateGrad of a leaf adopts it as .grad instead of cloning a tensor it sees
    referenced twice."""
    if inplace:
        return logits.detach()
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def scale_gradient_(grad: torch.Tensor, factor: torch.Tensor) -> None:
    """grad *= factor (0-d fp32 tensor) without reading factor on the host: with Triton usable on grad's
    device and grad contiguous, a kernel that returns at once on the device when factor is 1 (no pass over
    grad); otherwise one multiply pass."""
    triton = implementation("triton")
    if grad.is_contiguous() and grad.numel() and triton.unavailable_reason(grad) is None:
        triton.scale_(grad, factor)
    else:
        grad.mul_(factor)


def implementation(name: str) -> Backend:
    """The object that runs a concrete backend (not "reference"): one per name and process."""
    if name not in _IMPLEMENTATIONS:
        if name in _CPP:
            from .cpp import CppBackend

            _IMPLEMENTATIONS[name] = CppBackend(name)
        else:
            _IMPLEMENTATIONS[name] = importlib.import_module(f"{__name__}.{_MODULES[name]}")
    return _IMPLEMENTATIONS[name]


def version_of(x: torch.Tensor) -> Optional[int]:
    """x's version counter, or None for a tensor made under torch.inference_mode() (it has none: a write into it
    cannot be detected)."""
    return None if x.is_inference() else x._version


def take_once(ctx, name: str, what: str):
    """ctx.<name>, handed to autograd by the first backward and released there (None after): a second backward
    (retain_graph=True) is a RuntimeError naming `what`, the public function to call again."""
    value = getattr(ctx, name)
    if value is None:
        raise RuntimeError(f"{what}: backward ran twice (or without a gradient): the gradient is handed to autograd "
                           f"on the first backward and retain_graph=True cannot reuse it; call {what} again")
    setattr(ctx, name, None)
    return value


class DeferredGradient:
    """A gradient written after the call's statistics are taken: in backward (inplace=True, fp16 logits, kept sets,
    distill_loss in place) with grad_output folded into each sweep's O(N) weights, or during the forward call
    (inplace="forward" with a distillation term). Until it is written, the tensors its sweeps read again keep their
    values: one version check names any that a write changed in between. Its sweeps run in order into one buffer
    (over the logits, or a new one); several over the logits' own buffer run block by block through one reused buffer
    of at most `block_elements`, each block read by all of them before its gradient replaces it, so the extra memory
    is flat in N.

    A sweep is a function of grad_output (a 0-d tensor, or None: 1) returning the block writer
    run(rows, logits, teacher, out): rows a slice of the N rows (None: all), logits and teacher their rows, out where
    the block's gradient goes (the first sweep writes it, the others add to it)."""

    def __init__(self, logits: torch.Tensor, inplace: bool, sweeps, reads, what: str, teacher=None,
                 block_elements: int = 1 << 24):
        self.logits, self.inplace, self.sweeps, self.what = logits, inplace, sweeps, what
        self.teacher, self.block_elements = teacher, block_elements
        self.reads = tuple(reads)  # (name, tensor) of what the sweeps read again
        self.versions = [version_of(x) for _, x in self.reads]

    def write(self, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The gradient times `scale` (a 0-d tensor, not read on the host; None: 1, in the forward call)."""
        changed = [name for (name, x), version in zip(self.reads, self.versions) if version_of(x) != version]
        if changed:
            raise RuntimeError(f"{self.what}: the {' and '.join(changed)} were modified in place between the call and "
                               "backward, which reads them again to write the gradient (inplace=True, fp16 logits, a "
                               "kept set); clone them before modifying them, or pass inplace=False")
        runs = [sweep(scale) for sweep in self.sweeps]
        grad = gradient_buffer(self.logits, self.inplace)
        if not self.inplace or len(runs) == 1:  # every row at once
            for run in runs:
                run(None, self.logits, self.teacher, grad)
            if self.inplace:  # the kernels wrote through a raw pointer: tell autograd the logits changed
                torch.autograd.graph.increment_version(self.logits)
            return grad
        from .torch_chunked import row_chunks

        vocab = grad.shape[-1]
        step = max(1, self.block_elements // max(1, vocab))
        buffer = torch.empty(min(step, grad.shape[:-1].numel()), vocab, dtype=grad.dtype, device=grad.device)
        for rows, logits, *teacher in row_chunks(step, grad, *([] if self.teacher is None else [self.teacher])):
            out = buffer[:rows.stop - rows.start]
            for run in runs:
                run(rows, logits, teacher[0] if teacher else None, out)
            logits.copy_(out)  # a torch write: the logits' version moves
        return grad

"""backend="triton": launchers of triton_kernels/policy_loss.py (installed as fused_is.triton_kernels).

Token-local configurations (every preset except sequence/geometric IS with old_logprobs=None) run one
kernel, `_fused_kernel`: per row, the online-softmax sweep, g and h in registers, and the gradient sweep
over the same row while it is still in L2: one read from HBM and one write of the logits.
The two-pass plan (sequence/geometric IS with old_logprobs=None) runs the statistics kernel, reduces the
IS weights per sequence in float64 (fused_is/coefficients.py, O(N)), then the gradient kernel.
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

from .. import coefficients
from ..api import Batch
from . import gradient_buffer

# One program per row, BLOCK = 4096 lanes: V = 151936 takes 38 iterations per sweep. With NUM_WARPS = 8
# (256 threads) each thread holds 16 lanes of each of the three fp32 accumulators (48 registers), and the
# loads of one iteration are 8 KiB (bf16) per program, 16 bytes per thread: one vector load each, enough
# bytes in flight per SM for HBM with a few programs resident. 132 SMs x ~2 programs x 300 KB rows stay
# inside H100/H200's 50 MB L2, so the second sweep re-reads from L2. A heuristic, not an autotune (the
# interpreter cannot autotune); bench/gpu_suite.sh measures it against the copy bandwidth.
BLOCK = 4096
NUM_WARPS = 8


_PACKAGE = "fused_is.triton_kernels"


@functools.lru_cache(maxsize=None)
def kernels():
    """The kernel module `fused_is.triton_kernels.policy_loss` (imports triton; compiles nothing).

    Installed and editable installs map `triton_kernels/` to `fused_is.triton_kernels` (setup.py). A source
    tree on PYTHONPATH has no such mapping, so there the package is registered from the folder beside
    `fused_is/`; the import name stays `fused_is.triton_kernels` either way (never the top-level
    `triton_kernels`, which is the Triton project's own package)."""
    try:
        return importlib.import_module(_PACKAGE + ".policy_loss")
    except ModuleNotFoundError as err:
        if err.name not in (_PACKAGE, _PACKAGE + ".policy_loss"):
            raise  # triton itself (or something it needs) is missing
    source = Path(__file__).resolve().parents[2] / "triton_kernels"
    if not (source / "policy_loss.py").is_file():
        raise ModuleNotFoundError(f"{_PACKAGE} is not installed and {source} does not exist", name=_PACKAGE)
    spec = importlib.util.spec_from_file_location(_PACKAGE, source / "__init__.py",
                                                  submodule_search_locations=[str(source)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[_PACKAGE] = package
    spec.loader.exec_module(package)
    setattr(sys.modules["fused_is"], "triton_kernels", package)
    return importlib.import_module(_PACKAGE + ".policy_loss")


@functools.lru_cache(maxsize=None)
def _import_error() -> Optional[str]:
    try:
        kernels()
    except ImportError as err:
        return f"the Triton kernels cannot be imported ({type(err).__name__}: {err})"
    return None


def _on_device(x: torch.Tensor):
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


def _layout(x: torch.Tensor):
    """(rows_per_seq, stride_seq, stride_row, stride_col) of [B, T, V] or [N, V] logits."""
    if x.dim() == 2:
        return max(1, x.shape[0]), 0, x.stride(0), x.stride(1)
    return max(1, x.shape[1]), x.stride(0), x.stride(1), x.stride(2)


def block_size(vocab: int) -> int:
    """BLOCK (lanes per program and loop step) of the kernels for vocabulary size `vocab`."""
    import triton

    return min(BLOCK, triton.next_power_of_2(vocab))


def _stats(logits: torch.Tensor, tokens: torch.Tensor, temperature: float):
    n = tokens.numel()
    row_max, log_sum, lp, entropy = (torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(4))
    if n:
        with _on_device(logits):
            kernels()._row_stats_kernel[(n,)](logits, *_layout(logits), tokens, row_max, log_sum, lp, entropy,
                                              logits.shape[-1], 1.0 / temperature, BLOCK=block_size(logits.shape[-1]),
                                              num_warps=NUM_WARPS)
    return (row_max, log_sum), lp, entropy


def stats(logits: torch.Tensor, tokens: torch.Tensor, temperature: float):
    """(lp [N], H [N]) float64 for flat token ids [N]."""
    _, lp, entropy = _stats(logits, tokens, temperature)
    return lp.double(), entropy.double()


def _fused(batch: Batch, grad: torch.Tensor):
    """One launch of _fused_kernel: lp and H (fp32 [N]) and the gradient written into grad."""
    logits = batch.logits
    n = batch.num_rows
    lp = torch.empty(n, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(lp)
    if n:
        table, ints, floats = coefficients.kernel_inputs(batch)
        policy, base_src, weight_src, is_mode, kl_type, has_dual, has_floor = ints
        clip_low, clip_high, dual_clip, is_cap, is_floor, kl_coef, entropy_coef, inv_tau = floats
        with _on_device(logits):
            kernels()._fused_kernel[(n,)](
                logits, *_layout(logits), grad, *_layout(grad), batch.tokens, table, lp, entropy,
                n, logits.shape[-1], inv_tau, clip_low, clip_high, dual_clip, is_cap, is_floor, kl_coef, entropy_coef,
                POLICY=policy, BASE_SRC=base_src, WEIGHT_SRC=weight_src, IS_MODE=is_mode, KL_TYPE=kl_type,
                HAS_DUAL=has_dual, HAS_FLOOR=has_floor, HAS_KL=kl_coef != 0.0,
                BLOCK=block_size(logits.shape[-1]), num_warps=NUM_WARPS)
    return lp, entropy


def forward(batch: Batch, compute_grad: bool, inplace: bool):
    logits = batch.logits
    tau = batch.config.temperature
    if compute_grad and not coefficients.needs_stats_pass(batch):
        grad = gradient_buffer(logits, inplace)
        lp32, ent32 = _fused(batch, grad)
        if inplace:  # the kernel wrote through a raw pointer: tell autograd the logits changed
            torch.autograd.graph.increment_version(logits)
        return lp32.double(), ent32.double(), grad
    (row_max, log_sum), lp32, ent32 = _stats(logits, batch.tokens, tau)
    lp, entropy = lp32.double(), ent32.double()
    if not compute_grad:
        return lp, entropy, None
    # two-pass plan: the sequence's IS weight needs every lp of the sequence
    weight = coefficients.full_is_weight(batch, lp)[0]
    g, h = coefficients.coefficients(batch, lp, slice(None), weight)
    grad = gradient_buffer(logits, inplace)
    n = batch.num_rows
    if n:
        with _on_device(logits):
            kernels()._grad_kernel[(n,)](
                logits, *_layout(logits), grad, *_layout(grad), batch.tokens, row_max, log_sum, ent32,
                g.float().contiguous(), h.float().contiguous(), logits.shape[-1], 1.0 / tau,
                BLOCK=block_size(logits.shape[-1]), num_warps=NUM_WARPS)
    if inplace:
        torch.autograd.graph.increment_version(logits)
    return lp, entropy, grad

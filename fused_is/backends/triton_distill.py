"""backend="triton" of distill_loss: launchers of triton_kernels/distill.py (installed as
fused_is.triton_kernels.distill), the two sweeps of fused_is/distill.py's plan on the device.

`stats` runs `_distill_stats_kernel` (both models' log-sum-exps and D_t; JSD's K_t), `gradient` runs
`_distill_gradient_kernel` (d loss / d z, into a new buffer or over the logits), `jsd_given` (vocab_group, JSD) runs
`_distill_jsd_given_kernel` (a shard's parts of JSD's two sums, the whole rows' statistics given). All take the
checked call (fused_is.distill.DistillCall, read by attribute: this module does not import it). `policy_fused` runs
`_fused_distill_kernel`, policy_loss's one-pass kernel with a forward or reverse KL term (fused_is/plan.py
`fused_distill_term`), on the policy loss's call (fused_is.call.Call) and kernel arguments. The launch configuration
is the policy loss's (fused_is/backends/triton.py), taken for the wider of the two models' rows.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Optional

import torch

from . import triton as triton_backend

# teacher dtypes the kernels read: Triton's fp8 types compile for sm_89 and newer only (an fp8 teacher runs on
# backend="torch", which upcasts one chunk at a time)
TEACHER_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@functools.lru_cache(maxsize=None)
def kernels():
    """The kernel module fused_is.triton_kernels.distill (imports triton; compiles nothing)."""
    triton_backend.kernels()  # registers fused_is.triton_kernels from a source tree, the interpreter's compat patch
    return importlib.import_module(triton_backend._PACKAGE + ".distill")


@functools.lru_cache(maxsize=None)
def _import_error() -> Optional[str]:
    try:
        kernels()
    except ImportError as err:
        return f"the Triton distillation kernels cannot be imported ({type(err).__name__}: {err})"
    return None


def unavailable_reason(logits: Optional[torch.Tensor], teacher: Optional[torch.Tensor] = None) -> Optional[str]:
    """None when the kernels can run on these tensors here, else a sentence saying why not."""
    reason = triton_backend.unavailable_reason(logits) or _import_error()
    if reason is None and teacher is not None and teacher.dtype not in TEACHER_DTYPES:
        reason = (f"the Triton distillation kernels read bf16/fp16/fp32/fp64 teacher logits, not {teacher.dtype} "
                  "(backend='torch' reads any float dtype)")
    return reason


def column_bytes(student_size: int, teacher_size: int) -> int:
    """The bytes of one column of both rows rounded up to a power of two: the element size the policy loss's BLOCK rule
    (backends/triton.py block_size) sizes these kernels' blocks by, so that a block holds as many bytes of both rows
    as the policy kernels' block of one (16384 lanes of bf16 there, 8192 of a bf16 pair here: 16 bytes a thread of
    each row at 32 warps; at 16384 lanes of a 16-bit pair the stats kernel spills on sm_90)."""
    return 1 << (student_size + teacher_size - 1).bit_length()


def launch_config(logits: torch.Tensor, teacher: torch.Tensor) -> dict:
    """(BLOCK, num_warps) of both kernels: the policy loss kernels' rule (and $FUSED_IS_TRITON_BLOCK / _WARPS) for
    columns of column_bytes; rows that Triton cannot load as 16-byte vectors in both models (strided columns, or a
    row off a 16-byte boundary) take the strided rows' cap, every lane its own address in two rows."""
    vectors = (logits.stride(-1) == 1 and teacher.stride(-1) == 1 and triton_backend.rows_aligned(logits)
               and triton_backend.rows_aligned(teacher))
    return triton_backend.launch_config(logits.shape[-1], vectors, True,
                                        column_bytes(logits.element_size(), teacher.element_size()))


def _options(call, grid: tuple, config: dict) -> dict:
    """The launch's keyword options: the config, and (CUDA, not ROCm: Triton's AMD backend has none) the register cap
    of the policy loss's persistent kernel for this many programs per SM (backends/triton.py fused_registers); without
    it ptxas keeps the row loop at 32 registers and spills (strided rows, sm_80 and sm_90)."""
    options = dict(config)
    if torch.version.hip is None:
        sms = triton_backend._multiprocessors(call.logits.device)
        resident = triton_backend.FUSED_THREADS_PER_SM // (triton_backend.warp_size() * config["num_warps"])
        per_sm = max(1, min(resident, -(-grid[0] // sms)))
        options["maxnreg"] = triton_backend.fused_registers(config["num_warps"], per_sm)
    return options


def _common(call) -> tuple:
    """(the kernels' DIVERGENCE code, log2(1 - beta), log2(beta)): the mixture's shares for JSD, 0 otherwise."""
    if call.divergence != "jsd":
        return kernels().DIVERGENCES[call.divergence], 0.0, 0.0
    return kernels().DIVERGENCES["jsd"], math.log2(1.0 - call.beta), math.log2(call.beta)


def _scales(call) -> tuple:
    """(log2(e) / tau, log2(e) / tau_t) in float64, rounded once to fp32 as kernel arguments: the base-2 units."""
    return math.log2(math.e) / call.temperature, math.log2(math.e) / call.teacher_temperature


def _grid(call, persistent: bool, num_warps: int) -> tuple:
    """One program per row, or (JSD's stats: two sweeps per row) the policy loss's persistent grid for rows of both
    models' bytes, so that a row is still in L2 when its second sweep reads it."""
    n = call.num_rows
    if not persistent:
        return (n,)
    sms = triton_backend._multiprocessors(call.logits.device)
    row_bytes = call.logits.shape[-1] * (call.logits.element_size() + call.teacher.element_size())
    per_sm = triton_backend.programs_per_sm(triton_backend._l2_bytes(call.logits.device), sms, row_bytes, num_warps)
    return (max(1, min(n, per_sm * sms)),)


def stats(call) -> torch.Tensor:
    """float32 [len(STATS), N]: per row the student's and the teacher's raw max and log2 sum (log-sum-exp = max / tau
    + log2 sum ln 2), D_t and K_t (JSD; else 0); zeros at masked rows. One launch of _distill_stats_kernel."""
    logits, teacher = call.logits, call.teacher
    out = torch.empty(len(kernels().STATS), call.num_rows, dtype=torch.float32, device=logits.device)
    if not call.num_rows:
        return out
    divergence, log2_student_share, log2_teacher_share = _common(call)
    config = launch_config(logits, teacher)
    grid = _grid(call, call.divergence == "jsd", config["num_warps"])
    layout, teacher_layout = triton_backend._layout(logits), triton_backend._layout(teacher)
    with triton_backend._on_device(logits):
        compiled = kernels()._distill_stats_kernel[grid](
            logits, *layout, teacher, *teacher_layout[1:], call.valid.contiguous(), out, call.num_rows,
            logits.shape[-1], *_scales(call), call.beta, log2_student_share, log2_teacher_share,
            DIVERGENCE=divergence, **_options(call, grid, config))
    triton_backend._note_launch("_distill_stats_kernel", compiled, config)
    return out


def jsd_given(call, statistics: torch.Tensor) -> torch.Tensor:
    """float32 [2, N]: per row this vocabulary shard's parts of KL(p || m) and KL(q || m) in nats, p, q and m the whole
    rows' (vocab_group): statistics is laid out as `stats` writes it, its maxes and log2 sums those of the whole rows;
    zeros at masked rows. One launch of _distill_jsd_given_kernel."""
    logits, teacher = call.logits, call.teacher
    out = torch.empty(2, call.num_rows, dtype=torch.float32, device=logits.device)
    if not call.num_rows:
        return out
    _, log2_student_share, log2_teacher_share = _common(call)
    config = launch_config(logits, teacher)
    grid = _grid(call, False, config["num_warps"])
    layout, teacher_layout = triton_backend._layout(logits), triton_backend._layout(teacher)
    with triton_backend._on_device(logits):
        compiled = kernels()._distill_jsd_given_kernel[grid](
            logits, *layout, teacher, *teacher_layout[1:], call.valid.contiguous(), statistics, out, call.num_rows,
            logits.shape[-1], *_scales(call), log2_student_share, log2_teacher_share, **_options(call, grid, config))
    triton_backend._note_launch("_distill_jsd_given_kernel", compiled, config)
    return out


def gradient(call, statistics: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, accumulate: bool = False
             ) -> None:
    """grad <- weight_t F_t / tau for every row (fused_is/distill.py), rounded once to grad's dtype; statistics: the
    output of `stats`; weight: float64 [N] on the device, 0 at masked rows (zeros written there, their logits unread);
    grad: the logits' shape, any strides, possibly the logits themselves. One launch of _distill_gradient_kernel.
    accumulate: grad += the term instead, rounded once (grad a buffer of its own; masked rows left as they are)."""
    logits, teacher = call.logits, call.teacher
    if not call.num_rows:
        return
    divergence, log2_student_share, log2_teacher_share = _common(call)
    grad_scale = (1.0 - call.beta if call.divergence == "jsd" else 1.0) / call.temperature
    config = launch_config(logits, teacher)
    grid = _grid(call, False, config["num_warps"])
    layout, teacher_layout = triton_backend._layout(logits), triton_backend._layout(teacher)
    with triton_backend._on_device(logits):
        compiled = kernels()._distill_gradient_kernel[grid](
            logits, *layout, teacher, *teacher_layout[1:], grad, *triton_backend._layout(grad)[1:],
            statistics, weight.contiguous(), call.num_rows, logits.shape[-1], *_scales(call), grad_scale,
            log2_student_share, log2_teacher_share, DIVERGENCE=divergence, ACCUMULATE=bool(accumulate),
            **_options(call, grid, config))
    triton_backend._note_launch("_distill_gradient_kernel", compiled, config)


def policy_fused(call, args, divergence: str, term_weight: torch.Tensor, grad: torch.Tensor) -> tuple:
    """policy_loss's one pass with its distillation term: (lp, H, D_t, the teacher's log-sum-exp), float64 [N] each
    (D_t and the log-sum-exp 0 at masked rows), and d loss / d z (the policy's and w_t F_t / tau) written into grad
    (the logits' shape, any strides, possibly the logits themselves). call: the policy loss's (logits, teacher,
    tokens, valid); args: its abi.KernelArgs (the row table's inv_tau is both models' 1 / tau); divergence: "forward"
    or "reverse"; term_weight: float64 [N], w_t = a_t distill_coef. One launch of _fused_distill_kernel, persistent
    (the rows in flight between its two sweeps within the L2, as `stats` for JSD)."""
    logits, teacher = call.logits, call.teacher
    n = call.num_rows
    lp = torch.empty(n, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(lp)
    term = torch.empty(2, n, dtype=torch.float32, device=logits.device)
    if n:
        config = launch_config(logits, teacher)
        grid = _grid(call, True, config["num_warps"])
        layout, teacher_layout = triton_backend._layout(logits), triton_backend._layout(teacher)
        with triton_backend._on_device(logits):
            compiled = kernels()._fused_distill_kernel[grid](
                logits, *layout, teacher, *teacher_layout[1:], grad, *triton_backend._layout(grad)[1:], call.tokens,
                args.row_table, call.valid.contiguous(), term_weight.contiguous(), lp, entropy, term, n,
                logits.shape[-1], **args.floats, **args.constexprs(), HAS_KL=args.floats["kl_coef"] != 0.0,
                DIVERGENCE=kernels().DIVERGENCES[divergence], WHOLE_GROUPS=logits.shape[-1] % 16 == 0,
                **_options(call, grid, config))
        triton_backend._note_launch("_fused_distill_kernel", compiled, config)
    return lp.double(), entropy.double(), term[0].double(), term[1].double()

"""The fused kernels' contract, by name: the parameters, the per-row inputs and the enums that every fused
kernel (Triton, CPU, CUDA) takes, declared once here and packed from a call by `pack`.

csrc/fused_is_math.h mirrors these names in this order (X-macros that define LossParams, RowInputs and the unpacking),
and each compiled extension reports them through its `abi()`; `check_extension` compares the two when the
extension is loaded, so a mismatch is an error at load time, not wrong numbers. The Triton kernels take the
float parameters under these names and the int parameters as constexprs named in upper case, and import
the enum values from here (triton_kernels/policy_loss.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional

import torch

from .. import coefficients, divergences
from ..config import KL_WEIGHTS
from ..policies import KERNEL_POLICIES, kernel_params, policy

# LossParams: int32 fields (constexprs in Triton, upper-cased), then double fields
INT_PARAMS = ("policy", "base_source", "weight_source", "is_mode", "kl_type", "kl_k2_grad", "kl_ratio_weighted",
              "has_floor", "coef_source")
# p0..p3: the policy's own parameters, filled by its row of the policy table (fused_is/policies.py kernel_params)
FLOAT_PARAMS = ("log_ratio_clamp", "is_cap", "is_floor", "kl_coef", "kl_clamp", "kl_input_clamp", "p0", "p1", "p2",
                "p3")
# RowInputs: the rows of the float64 [len(ROW_INPUTS), N] row table
ROW_INPUTS = (
    "adv",  # A_t
    "base",  # ratio base (old or sampler logprob) when base_source == vector; alpha_t when base_source == loglinear
    "samp",  # sampler logprob, for weight_source == from_lp
    "weight",  # W_t when weight_source == vector (sequence/geometric level, reduced in torch)
    "ref",  # reference logprob, when kl_coef != 0
    "agg",  # aggregation weight a_t (0 for masked tokens)
    "g",  # g_t = d loss / d lp_t when coef_source == given (GSPO: it depends on the whole sequence's lp)
    "h",  # h_t = d loss / d H_t = -e_t entropy_coef, always given (e_t: the entropy term's aggregation weight)
    "inv_tau",  # 1 / tau_t: the row's inverse temperature (LossConfig.temperature, or per sequence / per token)
)
ENUMS: Dict[str, Dict[str, int]] = {
    "policy": {name: i for i, name in enumerate(KERNEL_POLICIES)},  # the kernels' branches (fused_is/policies.py)
    # ratio base from the row table, or formed from lp (old_logprobs=None): lp itself, or AReaL's loglinear proximal
    # samp + alpha (lp - samp), which also stands for old in the IS weight from lp
    "base_source": {"vector": 0, "lp": 1, "loglinear": 2},
    "weight_source": {"vector": 0, "one": 1, "from_lp": 2},  # from_lp: token-level IS, old=None: lp - samp
    "is_mode": {"truncate": 0, "mask": 1, "reject": 2, "raw": 3},
    "kl_type": {"k1": 0, "k2": 1, "k3": 2},
    # the KL term's weight, LossConfig.kl_weight in KL_WEIGHTS' order: none, the ratio exp(lp - base) with its
    # gradient (TRL), exp(lp - sg(lp)): the value added to the gradient before the clamp (NeMo-RL's score-function
    # term), or exp(lp - samp) with its gradient before the clamp (NeMo-RL's on-policy KL approximation). The key
    # keeps the name of the boolean it grew from: csrc/ and triton_kernels/ read it by that name
    "kl_ratio_weighted": {name: i for i, name in enumerate(KL_WEIGHTS)},
    "coef_source": {"kernel": 0, "given": 1},  # g and h formed by the kernel, or given per row (two-pass plan)
}

# distill_loss's kernels (csrc/distill_math.h; the Triton kernels' own STATS and DIVERGENCES in
# triton_kernels/distill.py are the same, a test holds them equal): the rows of the float32 [len(DISTILL_STATS), N]
# statistics, the launch's double scalars in order, and the divergence codes of fused_is.distill's
# DistillCall.divergence
DISTILL_STATS = ("student_max", "student_log2_sum", "teacher_max", "teacher_log2_sum", "divergence", "student_kl")
DISTILL_SCALARS = ("student_scale", "teacher_scale", "beta", "grad_scale", "log2_student_share", "log2_teacher_share",
                   "accumulate")
DISTILL_DIVERGENCES = dict(divergences.CODES)  # the divergence table's codes (fused_is/divergences.py)


def declaration() -> dict:
    """The contract as the compiled extensions report it through `abi()`."""
    return dict(int_params=list(INT_PARAMS), float_params=list(FLOAT_PARAMS), row_inputs=list(ROW_INPUTS),
                enums={k: dict(v) for k, v in ENUMS.items()}, distill_stats=list(DISTILL_STATS),
                distill_scalars=list(DISTILL_SCALARS), distill_divergences=dict(DISTILL_DIVERGENCES))


def check_extension(module, what: str) -> None:
    """Raise ImportError when a compiled extension was built against another contract than this file's."""
    reported = module.abi()
    expected = declaration()
    for key, value in expected.items():
        if reported.get(key) != value:
            raise ImportError(f"{what} was built against another kernel contract: its {key} are "
                              f"{reported.get(key)!r}, fused_is/backends/abi.py declares {value!r}; "
                              "csrc/fused_is_math.h (csrc/distill_math.h) and fused_is/backends/abi.py must list the "
                              "same names in the same order")


@dataclasses.dataclass
class KernelArgs:
    """What a fused kernel needs to form g_t and h_t itself: the row table and the named parameters."""

    row_table: torch.Tensor  # contiguous float64 [len(ROW_INPUTS), N]
    ints: Dict[str, int]
    floats: Dict[str, float]
    # the one temperature of every row when the call has one (the row table's inv_tau row holds 1 / it), else None
    # (per-row temperatures): lets the torch backend skip a pass over a chunk at tau = 1
    temperature: Optional[float] = None
    # the call's g_t and h_t from a chunk's lp, for a backend that forms them in Python rather than from the row
    # table and the parameters (the torch backend; coefficients.ChunkCoefficients); compiled kernels never read it
    coefficients: Optional["coefficients.ChunkCoefficients"] = None

    def int_list(self) -> list:
        return [self.ints[name] for name in INT_PARAMS]

    def float_list(self) -> list:
        return [self.floats[name] for name in FLOAT_PARAMS]

    def rows(self, rows, call=None) -> "KernelArgs":
        """The arguments of the rows `rows` (a slice, or int64 indices) alone (their columns of the row table, made
        contiguous); call: those rows' own call (Call.rows), which the coefficients hook then serves (else the hook
        is dropped)."""
        hook = None if self.coefficients is None or call is None else coefficients.ChunkCoefficients(call)
        return KernelArgs(self.row_table[:, rows].contiguous(), self.ints, self.floats, self.temperature, hook)

    def constexprs(self) -> Dict[str, int]:
        """The int parameters as the Triton kernels take them: constexprs named in upper case."""
        return {name.upper(): value for name, value in self.ints.items()}


def inverse_temperature(temperature, num_rows: int, device) -> torch.Tensor:
    """1 / tau of each row as a contiguous float64 [num_rows]: temperature is a float or float64 [num_rows]."""
    if isinstance(temperature, torch.Tensor):
        return (1.0 / temperature).to(device=device, dtype=torch.float64).contiguous()
    return torch.full((num_rows,), 1.0 / temperature, dtype=torch.float64, device=device)


def _write_temperature(table: torch.Tensor, temperature) -> Optional[float]:
    """Fill the row table's inv_tau row with 1 / tau (a float, or float64 [N] per row); returns the call's one
    temperature as KernelArgs.temperature keeps it (None for per-row ones)."""
    table[ROW_INPUTS.index("inv_tau")] = inverse_temperature(temperature, table.shape[1], table.device)
    return None if isinstance(temperature, torch.Tensor) else float(temperature)


def stats_only(num_rows: int, temperature, device) -> KernelArgs:
    """Arguments for a launch that only wants lp and H (no gradient): every row inert. temperature: a float,
    or float64 [num_rows] per row."""
    table = torch.zeros(len(ROW_INPUTS), num_rows, dtype=torch.float64, device=device)
    uniform = _write_temperature(table, temperature)
    ints = dict.fromkeys(INT_PARAMS, 0)
    ints["weight_source"] = ENUMS["weight_source"]["one"]
    floats = dict.fromkeys(FLOAT_PARAMS, 0.0)
    floats.update(is_cap=1.0, log_ratio_clamp=float("inf"), kl_clamp=float("inf"), kl_input_clamp=float("inf"))
    return KernelArgs(table, ints, floats, uniform)


def upstream_args(temperature, valid: torch.Tensor, grad_lp=None, grad_entropy=None) -> KernelArgs:
    """Arguments for the given-statistics gradient sweep of fused logprobs: g and h per row are the upstream
    gradients of lp and H (None: 0), masked rows (valid False) 0, so their gradient is exactly 0 whatever they
    hold. temperature: a float, or float64 [N] per row."""
    args = stats_only(valid.numel(), temperature, valid.device)
    args.ints["coef_source"] = ENUMS["coef_source"]["given"]
    args.row_table[ROW_INPUTS.index("agg")] = valid.double()  # a live row (the CPU kernel gates on agg)
    for name, upstream in (("g", grad_lp), ("h", grad_entropy)):
        if upstream is not None:
            args.row_table[ROW_INPUTS.index(name)] = torch.where(valid, upstream.reshape(-1).double(), 0.0)
    return args


def pack(call, lp: Optional[torch.Tensor] = None) -> KernelArgs:
    """KernelArgs of a prepared call. Token-local W (token level, old_logprobs=None) and the ratio
    base lp (ratio_ref="old", old=None) are left to the kernel; sequence and geometric W come precomputed,
    from `lp` of a stats pass when old_logprobs is None. Rows a config does not use are 0."""
    cfg = call.config
    table = torch.zeros(len(ROW_INPUTS), call.num_rows, dtype=torch.float64, device=call.mask.device)
    row = dict(zip(ROW_INPUTS, table.unbind(0)))
    row["adv"].copy_(call.advantages)
    base_source = "vector"
    if call.proximal_alpha is not None:  # old = samp + alpha (lp - samp), in the ratio and the IS weight
        base_source = "loglinear"
        row["base"].copy_(call.proximal_alpha)
    elif not cfg.reinforce_surrogate or cfg.kl_weight == "ratio":  # the ratio's base (coefficients._ratio_base)
        if cfg.ratio_ref == "sampler" and not cfg.reinforce_surrogate:
            row["base"].copy_(call.sampler_logprobs)
        elif call.old_logprobs is not None:
            row["base"].copy_(call.old_logprobs)
        else:
            base_source = "lp"
    if call.sampler_logprobs is not None:
        row["samp"].copy_(call.sampler_logprobs)
    weight = coefficients.precomputed_is_weight(call, lp)
    if weight is not None:  # sequence/geometric W, or any W with the off-policy mask folded in
        weight_source = "vector"
        row["weight"].copy_(weight)
    else:  # none, or token level with old_logprobs=None: the kernel forms it from lp
        weight_source = "one" if cfg.is_level == "none" else "from_lp"
    if call.ref_logprobs is not None:
        row["ref"].copy_(call.ref_logprobs)
    row["agg"].copy_(call.agg_weight)
    uniform = _write_temperature(table, call.temperature)
    coef_source = "kernel"
    if cfg.coefficients_given:  # GSPO, GMPO (g_t needs every lp of the sequence), DPPO: from the stats pass
        coef_source = "given"
        g, h = coefficients.given_coefficients(call, lp)
        row["g"].copy_(g)
        row["h"].copy_(h)
    else:  # h_t does not depend on lp: always given (its aggregation may differ from the loss's)
        row["h"].copy_(call.entropy_weights * -cfg.entropy_coef)
    # the policy table's kernel branch and its parameters p0..p3; a policy without one has g given per row, and
    # "policy" then goes unread
    entry = policy(cfg.policy)
    kernel_policy = entry.kernel or "reinforce"
    ints = dict(policy=ENUMS["policy"][kernel_policy], base_source=ENUMS["base_source"][base_source],
                weight_source=ENUMS["weight_source"][weight_source], is_mode=ENUMS["is_mode"][cfg.is_mode],
                kl_type=ENUMS["kl_type"][cfg.kl_type.rstrip("+")], kl_k2_grad=int(cfg.kl_type.endswith("+")),
                kl_ratio_weighted=ENUMS["kl_ratio_weighted"][cfg.kl_weight],
                has_floor=int(cfg.is_floor is not None),
                coef_source=ENUMS["coef_source"][coef_source])
    no_clamp = float("inf")  # comparisons with inf never bind: no branch on whether the option is set
    floats = dict(log_ratio_clamp=no_clamp if cfg.log_ratio_clamp is None else cfg.log_ratio_clamp,
                  is_cap=cfg.is_cap, is_floor=cfg.is_floor_value, kl_coef=cfg.kl_coef,
                  kl_clamp=no_clamp if cfg.kl_clamp is None else cfg.kl_clamp,
                  kl_input_clamp=no_clamp if cfg.kl_input_clamp is None else cfg.kl_input_clamp,
                  **dict(zip(("p0", "p1", "p2", "p3"), kernel_params(cfg) if entry.kernel else (0.0,) * 4)))
    return KernelArgs(table, ints, {k: float(v) for k, v in floats.items()}, uniform,
                      coefficients.ChunkCoefficients(call))


# --- the distillation kernels' launch: both models' rows, the divergence's code and DISTILL_SCALARS -----------------

# teacher dtypes the distillation kernels read (Triton's fp8 types compile for sm_89 and newer only: an fp8 teacher
# runs on backend="torch", which upcasts one chunk at a time)
TEACHER_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def teacher_unavailable_reason(kernels: str, teacher: Optional[torch.Tensor]) -> Optional[str]:
    """None when the distillation kernels of `kernels` (a backend's name, for the message) read this teacher's dtype."""
    if teacher is None or teacher.dtype in TEACHER_DTYPES:
        return None
    return (f"the {kernels} distillation kernels read bf16/fp16/fp32/fp64 teacher logits, not {teacher.dtype} "
            "(backend='torch' reads any float dtype)")


@dataclasses.dataclass(frozen=True)
class PairArgs:
    """A distillation launch's plain scalars: the divergence's kernel code, whether it reads the mixture (a second
    sweep of each row), and DISTILL_SCALARS by name."""

    divergence: int
    mixture: bool
    scalars: Dict[str, float]

    def scalar_list(self) -> list:
        """The scalars in DISTILL_SCALARS order (the C++ kernels' argument)."""
        return [self.scalars[name] for name in DISTILL_SCALARS]


def pair_args(call, accumulate: Optional[bool] = None) -> PairArgs:
    """PairArgs of a distillation call (fused_is.distill.DistillCall, read by attribute): the base-2 units
    log2(e) / tau and log2(e) / tau_t (float64, rounded once to fp32 by the kernels), beta, the mixture's shares
    log2(1 - beta) and log2(beta) (0 without one); for the gradient sweep (accumulate a bool) its scale
    Divergence.grad_scale / tau and accumulate (1 / 0); for the statistics sweep (None) both 0."""
    divergence = call.divergence
    # the kernels take one temperature per model and the logits as they are (the plan keeps the rest on torch sweeps)
    assert not isinstance(call.temperature, torch.Tensor) and call.rounding is None, "not a kernel call"
    log2_student_share, log2_teacher_share = divergence.log2_shares(call.beta)
    gradient = accumulate is not None
    scalars = dict(student_scale=math.log2(math.e) / call.temperature,
                   teacher_scale=math.log2(math.e) / call.teacher_temperature, beta=call.beta,
                   grad_scale=divergence.grad_scale(call.beta) / call.temperature if gradient else 0.0,
                   log2_student_share=log2_student_share, log2_teacher_share=log2_teacher_share,
                   accumulate=float(bool(accumulate)))
    return PairArgs(divergence.code, divergence.mixture, scalars)

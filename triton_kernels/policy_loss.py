"""Triton kernels of the policy loss (DESIGN.md section 4).

_fused_kernel: the one-pass kernel for token-local configurations: per row, the online-softmax sweep
(lse, lp, H), the coefficient g = d loss / d lp in registers (_row_coefficients, the math of
csrc/fused_is_math.h; h = d loss / d H comes per row), and the gradient sweep over the same row.
_row_stats_kernel: lp and H alone, for token_logprobs and for the first pass of the two-pass plan
(sequence/geometric IS with old_logprobs=None), whose second pass is _fused_kernel with W given per row.
Every load is cast to fp32 at once (the CPU interpreter cannot do arithmetic on bf16). Row offsets
are int64 (N x V beyond 2**31 elements). Rows are addressed as (row // rows_per_seq, row % rows_per_seq)
so that a padded [B, T, V] slice that cannot be viewed as [N, V] needs no copy.
"""

import triton
import triton.language as tl

from ..backends.abi import ENUMS, ROW_INPUTS
from ..constants import LN_FLT_MAX as _LN_FLT_MAX
from ..constants import LOG_WEIGHT_CLAMP, SAPO_LOG_RATIO_BOUND

# Module globals read inside @triton.jit code must be tl.constexpr: the GPU compiler rejects plain globals
# (the CPU interpreter does not, which is why bench/gpu/gpu_build_check.py compiles every kernel for the GPU).
# a finite "minus infinity" for masked lanes and -inf logits: NEG * log2(e) / tau stays finite (no inf - inf = nan)
# for tau > 5e-9, so a -inf logit gets 2^a = 0 and adds exactly 0 to s, to t = sum 2^a a and to the gradient; the
# rescaling of the online state multiplies by shift 2^shift (at most 0.53 in size), never by a shift alone, so a
# group that saw only -inf logits is rescaled to exact zeros at any accepted tau (MIN_TEMPERATURE = 1e-8)
NEG = tl.constexpr(-1.0e30)
LOG_W_CLAMP = tl.constexpr(LOG_WEIGHT_CLAMP)  # log w_t is clamped to +-20 before exp (DESIGN.md section 2)
SAPO_MAX_LOG_RATIO = tl.constexpr(SAPO_LOG_RATIO_BOUND)  # SAPO's ratio from min(log r, 80): saturated beyond
LN_FLT_MAX = tl.constexpr(_LN_FLT_MAX)  # the KL's sampler weight exp(lp - samp) is 0 beyond it (fp32 overflow)
LOG2E = tl.constexpr(1.4426950408889634)  # exponentials are exp2 with log2(e) / tau folded into one constant
LN2 = tl.constexpr(0.6931471805599453)
NAN = tl.constexpr(float("nan"))  # the target logit of a token outside [0, V) (never read): lp = NaN, not garbage
# software pipelining of the stats kernel's sweep over 16-bit logits (tl.range num_stages): the loads of the next
# STATS_STAGES - 1 blocks are in flight (cp.async into shared memory) while a block is reduced, instead of the one
# 16-byte load that ptxas issues just before its use (bench/gpu/gpu_perf_report.py reads the bytes in
# flight from the SASS); 2 stages for blocks over 4096 lanes (32 KiB of bf16 copies in shared memory, within sm_75's
# 64 KiB). The fused kernel loads each block before reducing the previous one instead (registers, not shared memory)
STATS_STAGES = tl.constexpr(4)
# the kernel contract's enums and row-table rows, by name (fused_is/backends/abi.py)
PPO = tl.constexpr(ENUMS["policy"]["ppo"])
CISPO = tl.constexpr(ENUMS["policy"]["cispo"])
SAPO = tl.constexpr(ENUMS["policy"]["sapo"])
PRIME_RL = tl.constexpr(ENUMS["policy"]["prime_rl"])
BASE_VECTOR = tl.constexpr(ENUMS["base_source"]["vector"])
BASE_LOGLINEAR = tl.constexpr(ENUMS["base_source"]["loglinear"])
WEIGHT_VECTOR = tl.constexpr(ENUMS["weight_source"]["vector"])
WEIGHT_ONE = tl.constexpr(ENUMS["weight_source"]["one"])
TRUNCATE = tl.constexpr(ENUMS["is_mode"]["truncate"])
MASK = tl.constexpr(ENUMS["is_mode"]["mask"])
REJECT = tl.constexpr(ENUMS["is_mode"]["reject"])
K1 = tl.constexpr(ENUMS["kl_type"]["k1"])
K2 = tl.constexpr(ENUMS["kl_type"]["k2"])
KL_BY_RATIO = tl.constexpr(ENUMS["kl_ratio_weighted"]["ratio"])
KL_BY_SCORE = tl.constexpr(ENUMS["kl_ratio_weighted"]["score"])
KL_BY_SAMPLER = tl.constexpr(ENUMS["kl_ratio_weighted"]["sampler"])
COEF_GIVEN = tl.constexpr(ENUMS["coef_source"]["given"])
ROW_ADV = tl.constexpr(ROW_INPUTS.index("adv"))
ROW_BASE = tl.constexpr(ROW_INPUTS.index("base"))
ROW_SAMP = tl.constexpr(ROW_INPUTS.index("samp"))
ROW_WEIGHT = tl.constexpr(ROW_INPUTS.index("weight"))
ROW_REF = tl.constexpr(ROW_INPUTS.index("ref"))
ROW_AGG = tl.constexpr(ROW_INPUTS.index("agg"))
ROW_G = tl.constexpr(ROW_INPUTS.index("g"))
ROW_H = tl.constexpr(ROW_INPUTS.index("h"))
ROW_INV_TAU = tl.constexpr(ROW_INPUTS.index("inv_tau"))


@triton.jit
def _row_offset(row, rows_per_seq, stride_seq, stride_row):
    return (row // rows_per_seq) * stride_seq + (row % rows_per_seq) * stride_row


@triton.jit
def _softmax_step(x, m, s, t, c, inside, MASKED: tl.constexpr):
    """Push one block of logits x (fp32, raw units, [GROUPS, GROUP]: a group is one thread's 16-byte vector) into the
    online softmax state of each group (m, s, t: [GROUPS]) in base-2 units: s = sum 2^a, t = sum 2^a a with
    a = (z - m) c, c = log2(e) / tau. The group's max is taken first, so the state is rescaled once per group and each
    element costs one exp2, one add and one fma; the state is three registers per group, not per element. -inf, and
    any value below NEG (a dtype's most negative value as a mask: (z - m) c would overflow to -inf), becomes NEG
    (finite: 0 * -inf would be NaN); NaN and +inf stay (NaN < NEG is false) and make s or t NaN, the row's flag
    (fused_is/checks.py)."""
    x = tl.where(x < NEG, NEG, x)  # -inf and finite values below -1e30 (finfo.min: (x - m) c would overflow)
    if MASKED:
        x = tl.where(inside, x, NEG)
    new_m = tl.maximum(m, tl.max(x, axis=1))
    shift = (m - new_m) * c  # <= 0: the old state rescaled to the new max
    scale = tl.exp2(shift)
    t = t * scale + s * (shift * scale)  # |shift 2^shift| <= 0.53: s * shift alone can overflow at a tiny tau
    s = s * scale
    a = (x - new_m[:, None]) * c  # differences before the scaling: exact for bf16/fp16 logits
    u = tl.exp2(a)
    if MASKED:
        u = tl.where(inside, u, 0.0)  # a lane past V adds nothing
    return new_m, s + tl.sum(u, axis=1), t + tl.sum(u * a, axis=1)


@triton.jit
def _row_softmax(base, stride_col, V, inv_tau, BLOCK: tl.constexpr, STAGES: tl.constexpr,
                 SHIFT_TAIL: tl.constexpr = False, KEEP: tl.constexpr = False):
    """One sweep over a row with online softmax state per group of GROUP consecutive columns (_softmax_step; GROUP
    = one 16-byte vector of the logits' dtype, held by one thread), merged across groups at the end: the full blocks
    unmasked, then one masked tail. Differences are taken before the scaling (exact for bf16/fp16 logits): scaling
    first would leave an absolute error of ulp(z / tau) on lp and H. Returns (row_max (raw), log2_sum, entropy) with
    log2_sum = log2 sum_j 2^((z_j - row_max) c): lse = row_max / tau + log2_sum ln 2,
    lp = (z_y - row_max) / tau - log2_sum ln 2. KEEP: the unpipelined sweeps' loads evict_last (a second sweep re-reads
    the row); a bool, not the policy string: triton 3.6 cannot bind a string constexpr's default."""
    EVICTION: tl.constexpr = "evict_last" if KEEP else ""
    VECTOR: tl.constexpr = 128 // base.dtype.element_ty.primitive_bitwidth
    GROUP: tl.constexpr = BLOCK if BLOCK < VECTOR else VECTOR
    GROUPS: tl.constexpr = BLOCK // GROUP
    cols = tl.arange(0, GROUPS)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    c = inv_tau * LOG2E
    m = tl.full([GROUPS], NEG, tl.float32)
    s = tl.zeros([GROUPS], tl.float32)
    t = tl.zeros([GROUPS], tl.float32)
    full = V // BLOCK * BLOCK
    if STAGES > 1 and GROUP == 8:  # bf16 / fp16: pipelined
        for start in tl.range(0, full, BLOCK, num_stages=STAGES):
            x = tl.load(base + (start + cols).to(tl.int64) * stride_col).to(tl.float32)
            m, s, t = _softmax_step(x, m, s, t, c, cols < BLOCK, False)
        if full < V:
            idx = full + cols
            inside = idx < V
            x = tl.load(base + idx.to(tl.int64) * stride_col, mask=inside, other=0.0).to(tl.float32)
            m, s, t = _softmax_step(x, m, s, t, c, inside, True)
    elif SHIFT_TAIL:  # the fused kernel's sweep, V a multiple of 16: each block's loads are issued before the previous
        # one is reduced; the last turn loads the row's last BLOCK columns (unmasked, 16-byte aligned: they overlap the
        # last full block), of which the final step takes those past `full`: the tail's loads overlap the last full
        # block's reduction
        current = tl.load(base + cols.to(tl.int64) * stride_col, mask=cols < V, other=0.0, eviction_policy=EVICTION)
        end = full + BLOCK if full < V else full
        for start in range(BLOCK, end, BLOCK):
            first = tl.minimum(start, V - BLOCK)  # start, or (the tail's turn) V - BLOCK
            ahead = tl.load(base + (first + cols).to(tl.int64) * stride_col, eviction_policy=EVICTION)
            m, s, t = _softmax_step(current.to(tl.float32), m, s, t, c, cols < BLOCK, False)
            current = ahead
        if full < V:  # current: the last BLOCK columns (or, V < BLOCK, the row's only, masked, block)
            first = tl.maximum(V - BLOCK, 0)  # V - BLOCK when there is a full block, else 0
            m, s, t = _softmax_step(current.to(tl.float32), m, s, t, c, (first + cols >= full) & (first + cols < V),
                                    True)
        elif full > 0:  # current: the last full block
            m, s, t = _softmax_step(current.to(tl.float32), m, s, t, c, cols < BLOCK, False)
    else:  # fp32 rows of the stats kernel, and V not a multiple of 16 (its last BLOCK columns would not be 16-byte
        # aligned): each block's loads are issued before the previous one is reduced, the masked tail after the loop
        current = tl.load(base + cols.to(tl.int64) * stride_col, mask=cols < full, other=0.0, eviction_policy=EVICTION)
        for start in range(BLOCK, full, BLOCK):
            ahead = tl.load(base + (start + cols).to(tl.int64) * stride_col, eviction_policy=EVICTION)
            m, s, t = _softmax_step(current.to(tl.float32), m, s, t, c, cols < BLOCK, False)
            current = ahead
        if full > 0:
            m, s, t = _softmax_step(current.to(tl.float32), m, s, t, c, cols < BLOCK, False)
        if full < V:
            idx = full + cols
            inside = idx < V
            x = tl.load(base + idx.to(tl.int64) * stride_col, mask=inside, other=0.0,
                        eviction_policy=EVICTION).to(tl.float32)
            m, s, t = _softmax_step(x, m, s, t, c, inside, True)
    row_max = tl.max(m, axis=0)
    lane_a = (m - row_max) * c
    lane_u = tl.exp2(lane_a)
    total = tl.sum(s * lane_u, axis=0)
    total_t = tl.sum(t * lane_u + s * (lane_a * lane_u), axis=0)
    log2_sum = tl.log2(total)
    return row_max, log2_sum, (log2_sum - total_t / total) * LN2


@triton.jit
def _policy_gradient(b, cols, start, c0, c1, g_y, token):
    """d loss / d z of one block of columns [start, start + BLOCK) from b_j = log2 p_j (floored at NEG):
    p_j (c0 + c1 b_j), plus g / tau at the target column (_row_gradient gives c0, c1 and g_y)."""
    grad = tl.exp2(b) * (c0 + c1 * b)
    return tl.where(cols == (token - start).to(tl.int32), grad + g_y, grad)  # int32: no widening per element


@triton.jit
def _gradient_block(x, out, out_stride_col, start, cols, V, c, row_max, log2_sum, c0, c1, g_y, token,
                    MASKED: tl.constexpr, EVICTION: tl.constexpr):
    """d loss / d z of one block of columns [start, start + BLOCK) from its loaded logits x: p_j (c0 + c1 b_j),
    b_j = log2 p_j floored at NEG (a -inf logit gets p = 0 times a finite factor), plus g / tau at the target, added
    by the thread that read the target's logit (the buffer may be the logits themselves: no other thread may read or
    write that column). EVICTION: the stores' L2 eviction policy (_row_gradient's)."""
    idx = start + cols
    b = tl.maximum((x.to(tl.float32) - row_max) * c - log2_sum, NEG)
    grad = _policy_gradient(b, cols, start, c0, c1, g_y, token)
    if MASKED:
        tl.store(out + idx.to(tl.int64) * out_stride_col, grad.to(out.dtype.element_ty), mask=idx < V,
                 eviction_policy=EVICTION)
    else:
        tl.store(out + idx.to(tl.int64) * out_stride_col, grad.to(out.dtype.element_ty), eviction_policy=EVICTION)


@triton.jit
def _row_gradient(base, stride_col, out, out_stride_col, V, inv_tau, row_max, log2_sum, entropy, g, h, token,
                  BLOCK: tl.constexpr, STREAM: tl.constexpr = False):
    """One sweep writing d loss / d z_j = ( g (1[j = y] - p_j) - h p_j (log p_j + H) ) / tau
    = p_j (c0 + c1 log2 p_j) + 1[j = y] g / tau with c0 = -(g + h H) / tau, c1 = -h ln 2 / tau.
    It runs backwards (the tail, then the full blocks from the last): the row's end was read last by the
    first sweep, so it is the likeliest to be still in L2. A token outside [0, V) (another shard's) has no column.
    A row with g = h = 0 (masked) gets exact zeros whatever its logits hold (NaN included), without reading them.
    STREAM: its loads and stores evict_first (the row's last touch); a bool, as _row_softmax's KEEP."""
    EVICTION: tl.constexpr = "evict_first" if STREAM else ""
    cols = tl.arange(0, BLOCK)
    c = inv_tau * LOG2E
    n_full = V // BLOCK
    if (g != 0.0) | (h != 0.0):
        c0 = -(g + h * entropy) * inv_tau
        c1 = -h * LN2 * inv_tau
        g_y = g * inv_tau
        # the tail (nothing when V is whole blocks) and the last full block are loaded together; then each block's
        # loads are issued before the previous block is written (other columns: safe in place)
        tail_start = n_full * BLOCK
        tail = tl.load(base + (tail_start + cols).to(tl.int64) * stride_col, mask=tail_start + cols < V, other=0.0,
                       eviction_policy=EVICTION)
        last = tail_start - BLOCK  # the last full block's start (-BLOCK when there is none: nothing loaded)
        current = tl.load(base + (last + cols).to(tl.int64) * stride_col, mask=last + cols >= 0, other=0.0,
                          eviction_policy=EVICTION)
        if tail_start < V:
            _gradient_block(tail, out, out_stride_col, tail_start, cols, V, c, row_max, log2_sum, c0, c1, g_y, token,
                            True, EVICTION)
        for i in range(1, n_full):
            start = (n_full - 1 - i) * BLOCK
            ahead = tl.load(base + (start + cols).to(tl.int64) * stride_col, eviction_policy=EVICTION)
            _gradient_block(current, out, out_stride_col, start + BLOCK, cols, V, c, row_max, log2_sum, c0, c1, g_y,
                            token, False, EVICTION)
            current = ahead
        if n_full > 0:
            _gradient_block(current, out, out_stride_col, 0, cols, V, c, row_max, log2_sum, c0, c1, g_y, token, False,
                            EVICTION)
    else:
        zeros = tl.zeros([BLOCK], tl.float32).to(out.dtype.element_ty)
        for start in range(0, V, BLOCK):
            idx = start + cols
            tl.store(out + idx.to(tl.int64) * out_stride_col, zeros, mask=idx < V, eviction_policy=EVICTION)


@triton.jit
def _scale_kernel(grad_ptr, factor_ptr, n, BLOCK: tl.constexpr):
    """grad *= factor for the backward's grad_output, read on the device: nothing to do when it is 1
    (validate="async" never reads it on the host). A grid-stride loop: a few programs per SM, each over every
    num_programs-th block (the grid does not grow with n)."""
    factor = tl.load(factor_ptr)
    if factor != 1.0:
        start = tl.program_id(0).to(tl.int64) * BLOCK
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for first in range(start, n, step):
            idx = first + tl.arange(0, BLOCK)
            inside = idx < n
            x = tl.load(grad_ptr + idx, mask=inside, other=0.0).to(tl.float32)
            tl.store(grad_ptr + idx, (x * factor).to(grad_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _row_stats_kernel(
    logits_ptr, rows_per_seq, stride_seq, stride_row, stride_col,
    tokens_ptr, lp_ptr, entropy_ptr, max_ptr, log_sum_ptr,
    V, inv_tau_ptr,
    BLOCK: tl.constexpr,
):
    """lp and H of each row, no gradient: token_logprobs and the first pass of the two-pass plan; also the
    row's max (raw logit) and log sum_j exp((z_j - max) / tau), which a vocabulary shard's partial
    statistics are combined from (fused_is/distributed.py). inv_tau_ptr: float64 [N], each row's 1 / tau."""
    row = tl.program_id(0).to(tl.int64)
    inv_tau = tl.load(inv_tau_ptr + row).to(tl.float32)
    base = logits_ptr + _row_offset(row, rows_per_seq, stride_seq, stride_row)
    STAGES: tl.constexpr = STATS_STAGES if BLOCK <= 4096 else 2  # at most 32 KiB of copies in shared memory
    row_max, log2_sum, entropy = _row_softmax(base, stride_col, V, inv_tau, BLOCK, STAGES)
    log_sum = log2_sum * LN2
    token = tl.load(tokens_ptr + row).to(tl.int64)
    inside = (token >= 0) & (token < V)  # the front door's contract; a direct caller's stray id reads nothing
    z_target = tl.where(inside, tl.load(base + token * stride_col, mask=inside, other=0.0).to(tl.float32), NAN)
    tl.store(lp_ptr + row, (z_target - row_max) * inv_tau - log_sum)
    tl.store(entropy_ptr + row, entropy)
    tl.store(max_ptr + row, row_max)
    tl.store(log_sum_ptr + row, log_sum)


@triton.jit
def _row_coefficients(
    lp, adv, base, samp, weight, ref, agg,
    log_ratio_clamp, is_cap, is_floor, kl_coef, kl_clamp, kl_input_clamp, p0, p1, p2, p3,
    POLICY: tl.constexpr, BASE_SOURCE: tl.constexpr, WEIGHT_SOURCE: tl.constexpr, IS_MODE: tl.constexpr,
    KL_TYPE: tl.constexpr, KL_K2_GRAD: tl.constexpr, KL_RATIO_WEIGHTED: tl.constexpr,
    HAS_FLOOR: tl.constexpr, HAS_KL: tl.constexpr,
):
    """g = d loss / d lp of one row (d loss / d H is given per row): DESIGN.md section 2, as
    csrc/fused_is_math.h writes it; parameters and enums by the names of the kernel contract
    (fused_is/backends/abi.py); p0..p3 are the policy's own (its row of fused_is/policies.py, kernel_params)."""
    # old where old_logprobs is None: lp, or AReaL's loglinear proximal samp + alpha (lp - samp) (base holds alpha)
    if BASE_SOURCE == BASE_LOGLINEAR:
        old = samp + base * (lp - samp)
    else:
        old = lp
    if WEIGHT_SOURCE == WEIGHT_VECTOR:
        w = weight
    elif WEIGHT_SOURCE == WEIGHT_ONE:
        w = 1.0
    else:  # from lp: token-level IS with old_logprobs=None
        log_w = tl.minimum(tl.maximum(old - samp, -LOG_W_CLAMP), LOG_W_CLAMP)
        raw = tl.exp(log_w)
        inside = (raw >= is_floor) & (raw <= is_cap)
        if IS_MODE == TRUNCATE:
            w = tl.minimum(raw, is_cap)
            if HAS_FLOOR:
                w = tl.maximum(w, is_floor)
        elif IS_MODE == MASK:
            w = tl.where(inside, raw, 0.0)
        elif IS_MODE == REJECT:
            w = tl.where(inside, 1.0, 0.0)
        else:
            w = raw
    if BASE_SOURCE != BASE_VECTOR:
        base = old
    if POLICY == CISPO:  # clip(r) A, p0, p1 = clip_low, clip_high: the clipped ratio is a constant weight, the clamp
        # bounds its value only
        log_ratio = tl.minimum(tl.maximum(lp - base, -log_ratio_clamp), log_ratio_clamp)
        ds = tl.minimum(tl.maximum(tl.exp(log_ratio), 1.0 - p0), 1.0 + p1) * adv
    elif POLICY == SAPO:  # sigmoid(tau (r - 1)) 4 / tau A: ds/dlp = 4 sig (1 - sig) r A, 0 beyond the clamp;
        # p0, p1 = tau where A > 0, tau elsewhere
        log_ratio = lp - base
        # beyond log r = 80 the gate is saturated (its gradient 0); the bound keeps fp32 exp finite (0 * inf)
        ratio = tl.exp(tl.minimum(log_ratio, SAPO_MAX_LOG_RATIO))
        tau = tl.where(adv > 0.0, p0, p1)
        sig = 1.0 / (1.0 + tl.exp(-tau * (ratio - 1.0)))
        beyond = (log_ratio < -log_ratio_clamp) | (log_ratio > log_ratio_clamp)
        ds = tl.where(beyond, 0.0, 4.0 * sig * (1.0 - sig) * ratio * adv)
    elif POLICY == PRIME_RL:  # keep r A: p0, p1 = clip_low, clip_high bound the probability's move (total variation)
        log_ratio = lp - base
        ratio = tl.exp(log_ratio)
        moved = tl.exp(lp) - tl.exp(base)
        keep = tl.where(adv > 0.0, moved <= p1, moved >= -p0)
        beyond = (log_ratio < -log_ratio_clamp) | (log_ratio > log_ratio_clamp)
        ds = tl.where(keep & ~beyond, ratio * adv, 0.0)
    elif POLICY != PPO:
        ds = adv
    else:  # p0, p1 = clip_low, clip_high, p2 = the dual clip (inf when unset: never binds)
        log_ratio = lp - base
        ratio = tl.exp(log_ratio)
        unclipped = ratio * adv
        clipped = tl.minimum(tl.maximum(ratio, 1.0 - p0), 1.0 + p1) * adv
        # beyond the log-ratio clamp (inf when unset) the clamp's gradient is 0
        takes_clip = (clipped < unclipped) | (log_ratio < -log_ratio_clamp) | (log_ratio > log_ratio_clamp)
        takes_clip = takes_clip | ((adv < 0.0) & (p2 * adv > unclipped))
        ds = tl.where(takes_clip, 0.0, unclipped)
    g = -w * ds
    if POLICY == PRIME_RL:  # its penalty p2 (lp - base)^2 on every token, outside the weight
        g = g + 2.0 * p2 * (lp - base)
    if HAS_KL:  # the KL term as csrc/fused_is_math.h kl_grad: clamps, straight-through k2 gradient, weights
        raw = lp - ref
        inside = (raw >= -kl_input_clamp) & (raw <= kl_input_clamp)  # the input clamp (inf when unset)
        d = tl.minimum(tl.maximum(raw, -kl_input_clamp), kl_input_clamp)
        if KL_TYPE == K1:
            value = d
            kl_g = 1.0
        elif KL_TYPE == K2:
            value = 0.5 * d * d
            kl_g = d
        else:
            e = tl.exp(-d)
            value = e + d - 1.0
            kl_g = 1.0 - e
        kl_g = tl.where(inside, kl_g, 0.0)
        if KL_RATIO_WEIGHTED == KL_BY_SCORE:  # times exp(lp - sg(lp)) before the clamp
            kl_g = tl.where(inside, kl_g + value, 0.0)
        if KL_RATIO_WEIGHTED == KL_BY_SAMPLER:  # times w = exp(lp - samp) before the clamp, 0 beyond ln FLT_MAX
            x = lp - samp
            w = tl.where(x > LN_FLT_MAX, 0.0, tl.exp(tl.minimum(x, LN_FLT_MAX)))
            kl_g = tl.where(inside, (kl_g + value) * w, 0.0)
            value = value * w
        beyond = (value < -kl_clamp) | (value > kl_clamp)
        kl_g = tl.where(beyond, 0.0, kl_g)
        value = tl.minimum(tl.maximum(value, -kl_clamp), kl_clamp)
        if KL_K2_GRAD:
            kl_g = d
        if KL_RATIO_WEIGHTED == KL_BY_RATIO:
            kl_g = (kl_g + value) * tl.exp(lp - base)
        g = g + kl_coef * kl_g
    live = agg != 0.0  # masked rows give exactly 0: an overflowing ratio there cannot make 0 * inf = nan
    return tl.where(live, agg * g, 0.0)


@triton.jit
def _row_inputs(table_ptr, n_rows, row, COEF_SOURCE: tl.constexpr):
    """The row's inputs from the float64 row table (table_ptr, [len(ROW_INPUTS), N]) as fp32: (adv, base, samp,
    weight, ref, agg, g, h). COEF_SOURCE given: g and h (formed in float64 from the whole sequence's lp: GSPO), the
    others 0 (unread); else g is 0 until _row_coefficients forms it from lp, and h = -e_t entropy_coef comes per row
    (the entropy term may aggregate on its own), 0 at masked rows (agg = 0)."""
    zero = tl.zeros([], tl.float32)
    if COEF_SOURCE == COEF_GIVEN:
        adv, ratio_base, samp, weight, ref, agg = zero, zero, zero, zero, zero, zero
        g = tl.load(table_ptr + ROW_G * n_rows + row).to(tl.float32)
        h = tl.load(table_ptr + ROW_H * n_rows + row).to(tl.float32)
    else:
        adv = tl.load(table_ptr + ROW_ADV * n_rows + row).to(tl.float32)
        ratio_base = tl.load(table_ptr + ROW_BASE * n_rows + row).to(tl.float32)
        samp = tl.load(table_ptr + ROW_SAMP * n_rows + row).to(tl.float32)
        weight = tl.load(table_ptr + ROW_WEIGHT * n_rows + row).to(tl.float32)
        ref = tl.load(table_ptr + ROW_REF * n_rows + row).to(tl.float32)
        agg = tl.load(table_ptr + ROW_AGG * n_rows + row).to(tl.float32)
        g = zero
        h = tl.where(agg != 0.0, tl.load(table_ptr + ROW_H * n_rows + row).to(tl.float32), 0.0)
    return adv, ratio_base, samp, weight, ref, agg, g, h


@triton.jit
def _fused_kernel(
    logits_ptr, rows_per_seq, stride_seq, stride_row, stride_col,
    grad_ptr, grad_rows_per_seq, grad_stride_seq, grad_stride_row, grad_stride_col,
    tokens_ptr, table_ptr, lp_ptr, entropy_ptr, stats_ptr,
    N, V,
    log_ratio_clamp, is_cap, is_floor, kl_coef, kl_clamp, kl_input_clamp, p0, p1, p2, p3,
    POLICY: tl.constexpr, BASE_SOURCE: tl.constexpr, WEIGHT_SOURCE: tl.constexpr, IS_MODE: tl.constexpr,
    KL_TYPE: tl.constexpr, KL_K2_GRAD: tl.constexpr, KL_RATIO_WEIGHTED: tl.constexpr,
    HAS_FLOOR: tl.constexpr, HAS_KL: tl.constexpr, COEF_SOURCE: tl.constexpr, STATS_GIVEN: tl.constexpr,
    BLOCK: tl.constexpr, WHOLE_GROUPS: tl.constexpr, L2_HINTS: tl.constexpr = False,
):
    """The one-pass kernel of DESIGN.md section 4 for token-local configurations: per row, one sweep of
    online softmax (lse, lp, H), g in registers from the row's inputs and h read from them (table_ptr: the float64
    [len(ROW_INPUTS), N] row table of the kernel contract), and a second sweep over the same row, still in
    L2, writing d loss / d z. The float parameters and the upper-cased int constexprs are the contract's
    (fused_is/backends/abi.py), passed by name.
    Persistent: program k runs rows k, k + num_programs, ... (the same code for each row, whatever the grid).
    STATS_GIVEN: the row's statistics come from stats_ptr (float64 [4, N]: max, log sum, lp, H of the whole
    row, of which these logits are one vocabulary shard; fused_is/distributed.py), the first sweep is
    skipped, g and h are given (COEF_SOURCE), and a token outside [0, V) (another shard's) has no column.
    WHOLE_GROUPS: V % 16 == 0 (the launcher's), so that the row's last BLOCK columns load as 16-byte vectors.
    L2_HINTS: sweep 1's loads evict_last (sweep 2 re-reads them), sweep 2's loads and stores evict_first (nothing reads
    them again): the launcher sets it on sm_90 and later (fused_is/backends/triton.py l2_hints); off, the sm_80 build
    at 64 registers keeps clear of spills."""
    # persistent: the grid is a few programs per SM (fused_is/backends/triton.py fused_grid), each taking every
    # num_programs-th row, so that the rows in flight (and their L2 footprint between the sweeps) do not grow with N
    n_rows = tl.cast(N, tl.int64)  # the row table's and the statistics' row stride: 64-bit offsets (N >= 2**28)
    for first in range(tl.program_id(0), N, tl.num_programs(0)):
        row = tl.cast(first, tl.int64)
        base_ptr = logits_ptr + _row_offset(row, rows_per_seq, stride_seq, stride_row)
        token = tl.load(tokens_ptr + row).to(tl.int64)
        # this row's 1 / tau (one value, or per sequence / token); unlike a kernel argument it takes a register
        # through the sweeps, which is why rows Triton cannot vectorise launch at most UNALIGNED_BLOCK lanes
        # (backends/triton.py)
        inv_tau = tl.load(table_ptr + ROW_INV_TAU * n_rows + row).to(tl.float32)
        if STATS_GIVEN:
            row_max = tl.load(stats_ptr + row).to(tl.float32)
            log2_sum = (tl.load(stats_ptr + n_rows + row) * LOG2E).to(tl.float32)
            lp = tl.load(stats_ptr + 2 * n_rows + row).to(tl.float32)
            entropy = tl.load(stats_ptr + 3 * n_rows + row).to(tl.float32)
        else:
            row_max, log2_sum, entropy = _row_softmax(base_ptr, stride_col, V, inv_tau, BLOCK, 1, WHOLE_GROUPS,
                                                      L2_HINTS)
            inside = (token >= 0) & (token < V)  # as in _row_stats_kernel
            z_target = tl.where(inside, tl.load(base_ptr + token * stride_col, mask=inside, other=0.0).to(tl.float32),
                                NAN)
        # the row's other inputs, loaded with the target logit (before the stores below, which they cannot pass):
        # one round trip for all of them after the first sweep
        adv, ratio_base, samp, weight, ref, agg, g, h = _row_inputs(table_ptr, n_rows, row, COEF_SOURCE)
        if not STATS_GIVEN:
            lp = (z_target - row_max) * inv_tau - log2_sum * LN2
            tl.store(lp_ptr + row, lp)
            tl.store(entropy_ptr + row, entropy)
        if COEF_SOURCE != COEF_GIVEN:
            g = _row_coefficients(lp, adv, ratio_base, samp, weight, ref, agg,
                                  log_ratio_clamp, is_cap, is_floor, kl_coef, kl_clamp, kl_input_clamp, p0, p1, p2, p3,
                                  POLICY, BASE_SOURCE, WEIGHT_SOURCE, IS_MODE, KL_TYPE, KL_K2_GRAD, KL_RATIO_WEIGHTED,
                                  HAS_FLOOR, HAS_KL)

        if not STATS_GIVEN:
            # in place, the gradient sweep below overwrites the target's column, which every warp read above: no
            # warp may store before the slowest has loaded it (a barrier per row; the given-statistics path reads
            # no logit outside its own block's columns)
            tl.debug_barrier()
        out = grad_ptr + _row_offset(row, grad_rows_per_seq, grad_stride_seq, grad_stride_row)
        _row_gradient(base_ptr, stride_col, out, grad_stride_col, V, inv_tau, row_max, log2_sum, entropy, g, h, token,
                      BLOCK, L2_HINTS)

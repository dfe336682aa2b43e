"""Triton kernels of the policy loss (DESIGN.md section 4).

_fused_kernel: the one-pass kernel for token-local configurations: per row, the online-softmax sweep
(lse, lp, H), the coefficients g = d loss / d lp and h = d loss / d H in registers (_row_coefficients,
the math of csrc/fused_is_math.h), and the gradient sweep over the same row.
_row_stats_kernel and _grad_kernel: the two halves, for token_logprobs and for the two-pass plan
(sequence/geometric IS with old_logprobs=None), where g and h need a per-sequence reduction in between.
Every load is cast to fp32 at once (the CPU interpreter cannot do arithmetic on bf16). Row offsets
are int64 (N x V beyond 2**31 elements). Rows are addressed as (row // rows_per_seq, row % rows_per_seq)
so that a padded [B, T, V] slice that cannot be viewed as [N, V] needs no copy.
"""

import triton
import triton.language as tl

# a finite "minus infinity" for masked lanes: NEG * inv_tau stays finite (no inf - inf = nan) for tau > 1e-8
NEG = tl.constexpr(-1.0e30)


@triton.jit
def _row_offset(row, rows_per_seq, stride_seq, stride_row):
    return (row // rows_per_seq) * stride_seq + (row % rows_per_seq) * stride_row


@triton.jit
def _row_softmax(base, stride_col, V, inv_tau, BLOCK: tl.constexpr):
    """One sweep over a row with per-lane online softmax accumulators, in raw logit units: running max m,
    s = sum e^d and t = sum e^d d with d = (z - m) / tau, merged across lanes at the end. Differences are
    taken before the 1/tau scaling (exact for bf16/fp16 logits): scaling first would leave an absolute
    error of ulp(z / tau) on lp and H. Returns (row_max (raw), log_sum, mean_d):
    lse = row_max / tau + log_sum, lp = (z_y - row_max) / tau - log_sum, H = log_sum - mean_d."""
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], NEG, tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    t = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + cols
        inside = idx < V
        x = tl.load(base + idx.to(tl.int64) * stride_col, mask=inside, other=0.0).to(tl.float32)
        x = tl.where(inside, x, NEG)
        m_new = tl.maximum(m, x)
        shift = (m - m_new) * inv_tau  # <= 0, finite: NEG * inv_tau stays finite for tau > 1e-8
        scale = tl.exp(shift)
        d = (x - m_new) * inv_tau
        e = tl.where(inside, tl.exp(d), 0.0)
        t = (t + s * shift) * scale + e * tl.where(inside, d, 0.0)
        s = s * scale + e
        m = m_new
    row_max = tl.max(m, axis=0)
    lane_shift = (m - row_max) * inv_tau
    lane_scale = tl.exp(lane_shift)
    total = tl.sum(s * lane_scale, axis=0)
    total_t = tl.sum((t + s * lane_shift) * lane_scale, axis=0)
    return row_max, tl.log(total), total_t / total


@triton.jit
def _row_gradient(base, stride_col, out, out_stride_col, V, inv_tau, row_max, log_sum, entropy, g, h, token,
                  BLOCK: tl.constexpr):
    """One sweep writing d loss / d z_j = ( g (1[j = y] - p_j) - h p_j (log p_j + H) ) / tau."""
    cols = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        idx = start + cols
        inside = idx < V
        x = tl.load(base + idx.to(tl.int64) * stride_col, mask=inside, other=0.0).to(tl.float32)
        log_p = (x - row_max) * inv_tau - log_sum
        p = tl.exp(log_p)
        grad = -p * (g + h * (log_p + entropy))
        grad = tl.where(idx == token, grad + g, grad) * inv_tau
        tl.store(out + idx.to(tl.int64) * out_stride_col, grad.to(out.dtype.element_ty), mask=inside)


@triton.jit
def _row_stats_kernel(
    logits_ptr, rows_per_seq, stride_seq, stride_row, stride_col,
    tokens_ptr, max_ptr, log_sum_ptr, lp_ptr, entropy_ptr,
    V, inv_tau,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + _row_offset(row, rows_per_seq, stride_seq, stride_row)
    row_max, log_sum, mean_d = _row_softmax(base, stride_col, V, inv_tau, BLOCK)
    token = tl.load(tokens_ptr + row).to(tl.int64)
    z_target = tl.load(base + token * stride_col).to(tl.float32)
    # lse = row_max + log_sum is kept as two numbers: at |z| ~ 1e4 their fp32 sum would round by
    # ulp(1e4) ~ 1e-3, while z - row_max is exact for nearby values (Sterbenz)
    tl.store(max_ptr + row, row_max)
    tl.store(log_sum_ptr + row, log_sum)
    tl.store(lp_ptr + row, (z_target - row_max) * inv_tau - log_sum)
    tl.store(entropy_ptr + row, log_sum - mean_d)


@triton.jit
def _grad_kernel(
    logits_ptr, rows_per_seq, stride_seq, stride_row, stride_col,
    grad_ptr, grad_rows_per_seq, grad_stride_seq, grad_stride_row, grad_stride_col,
    tokens_ptr, max_ptr, log_sum_ptr, entropy_ptr, g_ptr, h_ptr,
    V, inv_tau,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + _row_offset(row, rows_per_seq, stride_seq, stride_row)
    out = grad_ptr + _row_offset(row, grad_rows_per_seq, grad_stride_seq, grad_stride_row)
    row_max = tl.load(max_ptr + row)
    log_sum = tl.load(log_sum_ptr + row)
    entropy = tl.load(entropy_ptr + row)
    g = tl.load(g_ptr + row)
    h = tl.load(h_ptr + row)
    token = tl.load(tokens_ptr + row).to(tl.int64)
    _row_gradient(base, stride_col, out, grad_stride_col, V, inv_tau, row_max, log_sum, entropy, g, h, token, BLOCK)


@triton.jit
def _row_coefficients(
    lp, adv, base, samp, weight, ref, agg,
    clip_low, clip_high, dual_clip, is_cap, is_floor, kl_coef, entropy_coef,
    POLICY: tl.constexpr, BASE_SRC: tl.constexpr, WEIGHT_SRC: tl.constexpr, IS_MODE: tl.constexpr,
    KL_TYPE: tl.constexpr, HAS_DUAL: tl.constexpr, HAS_FLOOR: tl.constexpr, HAS_KL: tl.constexpr,
):
    """(g, h) = (d loss / d lp, d loss / d H) of one row: DESIGN.md section 2, as csrc/fused_is_math.h
    writes it (enum values from there: POLICY 1 = ppo; BASE_SRC 1 = lp itself; WEIGHT_SRC 0 given,
    1 none, 2 token-level from lp; IS_MODE truncate/mask/reject/raw = 0..3; KL_TYPE k1/k2/k3 = 0..2)."""
    if WEIGHT_SRC == 0:
        w = weight
    elif WEIGHT_SRC == 1:
        w = 1.0
    else:
        log_w = tl.minimum(tl.maximum(lp - samp, -20.0), 20.0)
        raw = tl.exp(log_w)
        inside = (raw >= is_floor) & (raw <= is_cap)
        if IS_MODE == 0:
            w = tl.minimum(raw, is_cap)
            if HAS_FLOOR:
                w = tl.maximum(w, is_floor)
        elif IS_MODE == 1:
            w = tl.where(inside, raw, 0.0)
        elif IS_MODE == 2:
            w = tl.where(inside, 1.0, 0.0)
        else:
            w = raw
    if BASE_SRC == 1:
        base = lp
    if POLICY == 0:
        ds = adv
    else:
        ratio = tl.exp(lp - base)
        unclipped = ratio * adv
        clipped = tl.minimum(tl.maximum(ratio, 1.0 - clip_low), 1.0 + clip_high) * adv
        takes_clip = clipped < unclipped
        if HAS_DUAL:
            takes_clip = takes_clip | ((adv < 0.0) & (dual_clip * adv > unclipped))
        ds = tl.where(takes_clip, 0.0, unclipped)
    g = -w * ds
    if HAS_KL:
        d = lp - ref
        if KL_TYPE == 0:
            g = g + kl_coef
        elif KL_TYPE == 1:
            g = g + kl_coef * d
        else:
            g = g + kl_coef * (1.0 - tl.exp(-d))
    live = agg != 0.0  # masked rows give exactly 0: an overflowing ratio there cannot make 0 * inf = nan
    return tl.where(live, agg * g, 0.0), tl.where(live, -agg * entropy_coef, 0.0)


@triton.jit
def _fused_kernel(
    logits_ptr, rows_per_seq, stride_seq, stride_row, stride_col,
    grad_ptr, grad_rows_per_seq, grad_stride_seq, grad_stride_row, grad_stride_col,
    tokens_ptr, table_ptr, lp_ptr, entropy_ptr,
    N, V, inv_tau,
    clip_low, clip_high, dual_clip, is_cap, is_floor, kl_coef, entropy_coef,
    POLICY: tl.constexpr, BASE_SRC: tl.constexpr, WEIGHT_SRC: tl.constexpr, IS_MODE: tl.constexpr,
    KL_TYPE: tl.constexpr, HAS_DUAL: tl.constexpr, HAS_FLOOR: tl.constexpr, HAS_KL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The one-pass kernel of DESIGN.md section 4 for token-local configurations: per row, one sweep of
    online softmax (lse, lp, H), g and h in registers from the row's inputs (table_ptr: float64 [6, N] of
    advantages, ratio base, sampler logprob, IS weight, ref logprob, aggregation weight), and a second
    sweep over the same row, still in L2, writing d loss / d z."""
    row = tl.program_id(0).to(tl.int64)
    base_ptr = logits_ptr + _row_offset(row, rows_per_seq, stride_seq, stride_row)
    row_max, log_sum, mean_d = _row_softmax(base_ptr, stride_col, V, inv_tau, BLOCK)
    token = tl.load(tokens_ptr + row).to(tl.int64)
    z_target = tl.load(base_ptr + token * stride_col).to(tl.float32)
    lp = (z_target - row_max) * inv_tau - log_sum
    entropy = log_sum - mean_d
    tl.store(lp_ptr + row, lp)
    tl.store(entropy_ptr + row, entropy)

    adv = tl.load(table_ptr + row).to(tl.float32)
    ratio_base = tl.load(table_ptr + N + row).to(tl.float32)
    samp = tl.load(table_ptr + 2 * N + row).to(tl.float32)
    weight = tl.load(table_ptr + 3 * N + row).to(tl.float32)
    ref = tl.load(table_ptr + 4 * N + row).to(tl.float32)
    agg = tl.load(table_ptr + 5 * N + row).to(tl.float32)
    g, h = _row_coefficients(lp, adv, ratio_base, samp, weight, ref, agg,
                             clip_low, clip_high, dual_clip, is_cap, is_floor, kl_coef, entropy_coef,
                             POLICY, BASE_SRC, WEIGHT_SRC, IS_MODE, KL_TYPE, HAS_DUAL, HAS_FLOOR, HAS_KL)

    out = grad_ptr + _row_offset(row, grad_rows_per_seq, grad_stride_seq, grad_stride_row)
    _row_gradient(base_ptr, stride_col, out, grad_stride_col, V, inv_tau, row_max, log_sum, entropy, g, h, token,
                  BLOCK)

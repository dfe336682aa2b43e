"""Triton kernels of distill_loss (DESIGN.md section 9; the plan is fused_is/distill.py's, the launchers
fused_is/backends/triton.py's pair sweeps).

Cost per row of V columns, s and t bytes per student and teacher element (the teacher is only ever read):
  _distill_stats_kernel: forward and reverse KL read V (s + t) once: both log-sum-exps and D_t online in one sweep
    over both rows; JSD reads them twice: the log-sum-exps, then D_t and K_t = KL(p || m) given them, the second
    sweep backwards over rows still in L2 (persistent grid). Writes STATS floats; a masked row reads nothing.
  _distill_jsd_given_kernel (vocab_group, JSD): reads V (s + t) once and writes 2 floats: a vocabulary shard's parts of
    KL(p || m) and KL(q || m), the whole rows' maxes and log2 sums given (the stats kernel's second JSD sweep alone).
  _distill_gradient_kernel: reads V (s + t) and writes V s (d loss / d z, into a new buffer or over the student's
    logits); a masked row (weight 0) is written with zeros and not read.
  _fused_distill_kernel (policy_loss with a forward or reverse KL term): reads V (s + t) twice and writes V s per
    unmasked row (stats and the KL, then the policy's gradient plus the term's, the second read from L2: persistent
    grid); a masked row reads V s (its lp and H) and writes V s zeros.
Arithmetic is fp32 in base-2 units: c = log2(e) / tau, a_j = (z_j - max z) c and b_j = (u_j - max u) c_t, so that
log2 p_j = a_j - log2 sum 2^a and log2 q_j = b_j - log2 sum 2^b; differences are taken before the scaling (exact for
bf16/fp16 logits). Per-row statistics are kept as (raw max, log2 sum) pairs, not as an lse, which fp32 would round
to ulp(lse) before the subtraction.
"""

import triton
import triton.language as tl

from ..backends.abi import DISTILL_STATS
from ..divergences import CODES, FORWARD_KL, REVERSE_KL
from ..divergences import JSD as _JSD
from .policy_loss import (COEF_GIVEN, LN2, LOG2E, NAN, NEG, ROW_INV_TAU, _policy_gradient, _row_coefficients,
                          _row_inputs, _row_offset, _row_softmax)

# the divergence of a launch: the code of its row of the divergence table (fused_is/divergences.py), the DIVERGENCE
# constexpr
DIVERGENCES = CODES
FORWARD = tl.constexpr(FORWARD_KL.code)
REVERSE = tl.constexpr(REVERSE_KL.code)
JSD = tl.constexpr(_JSD.code)
# the rows of the float32 [len(STATS), N] statistics: the stats kernel writes them, the gradient kernel reads them
STATS = DISTILL_STATS
STUDENT_MAX = tl.constexpr(STATS.index("student_max"))
STUDENT_LOG2_SUM = tl.constexpr(STATS.index("student_log2_sum"))
TEACHER_MAX = tl.constexpr(STATS.index("teacher_max"))
TEACHER_LOG2_SUM = tl.constexpr(STATS.index("teacher_log2_sum"))
DIVERGENCE_ROW = tl.constexpr(STATS.index("divergence"))
STUDENT_KL = tl.constexpr(STATS.index("student_kl"))
NUM_STATS = tl.constexpr(len(STATS))
# lanes past V: probability 0 in both models (-inf, not NEG: a raw -inf logit is how the sweep sees a zero)
MINUS_INF = tl.constexpr(float("-inf"))


@triton.jit
def _pair_step(z, u, m_s, s_s, t_s, m_t, s_t, w, c_s, c_t, DIVERGENCE: tl.constexpr, ENTROPY: tl.constexpr):
    """Push one block of both rows (fp32, raw units, [GROUPS, GROUP]: a group is GROUP consecutive columns, held by
    one thread) into each group's online state: maxes m (floored at NEG), s = sum 2^a (student), sum 2^b (teacher),
    and for the KLs the cross sum w = sum 2^b (b - a) (forward) or sum 2^a (a - b) (reverse), a and b taken against
    the current maxes. When a max moves by shift (in units, <= 0), every old a (or b) moves by shift and its weight by
    2^shift, hence the updates of w below. A -inf logit keeps its raw value: 2^a = 0, and where the other model's
    probability is not 0 its term is +inf, the infinite KL that the caller reports; NaN and +inf make s NaN.
    ENTROPY: also the student's t = sum 2^a a of the policy loss's entropy (policy_loss.py _softmax_step), rescaled
    as there (t 2^shift + s shift 2^shift: |shift 2^shift| <= 0.53); else t_s is returned as it came."""
    new_m_s = tl.maximum(m_s, tl.max(z, axis=1))
    new_m_t = tl.maximum(m_t, tl.max(u, axis=1))
    shift_s = (m_s - new_m_s) * c_s
    shift_t = (m_t - new_m_t) * c_t
    a = (z - new_m_s[:, None]) * c_s
    b = (u - new_m_t[:, None]) * c_t
    p = tl.exp2(a)
    q = tl.exp2(b)
    # shift_t - shift_s is finite for maxes in [NEG, 1e29] at tau >= 1e-8; where it is huge (a model's group saw only
    # -inf so far) the old sum it multiplies is 0, or w is +inf already
    if DIVERGENCE == FORWARD:
        w = tl.exp2(shift_t) * (w + (shift_t - shift_s) * s_t) + tl.sum(tl.where(q > 0.0, q * (b - a), 0.0), axis=1)
    elif DIVERGENCE == REVERSE:
        w = tl.exp2(shift_s) * (w + (shift_s - shift_t) * s_s) + tl.sum(tl.where(p > 0.0, p * (a - b), 0.0), axis=1)
    if ENTROPY:  # 0 a = 0 where p = 0 (a -inf logit, a lane past V: a = -inf)
        scale_s = tl.exp2(shift_s)
        t_s = t_s * scale_s + s_s * (shift_s * scale_s) + tl.sum(tl.where(p > 0.0, p * a, 0.0), axis=1)
    s_s = s_s * tl.exp2(shift_s) + tl.sum(p, axis=1)
    s_t = s_t * tl.exp2(shift_t) + tl.sum(q, axis=1)
    return new_m_s, s_s, t_s, new_m_t, s_t, w


@triton.jit
def _pair_softmax(student, stride_col, teacher, teacher_stride_col, V, c_s, c_t, DIVERGENCE: tl.constexpr,
                  BLOCK: tl.constexpr, ENTROPY: tl.constexpr = False):
    """One sweep over both rows: (student max (raw), log2 sum_j 2^a_j, teacher max, log2 sum_j 2^b_j, the KL in nats,
    the student's entropy in nats) with the KL D = ln 2 (sum 2^b (b - a) / sum 2^b - log2 sum 2^b + log2 sum 2^a)
    (forward; reverse with the roles swapped); 0 for JSD, whose sums need both log-sum-exps first. The entropy (as
    policy_loss.py _row_softmax gives it) only with ENTROPY, else 0. The groups' states are merged at the end."""
    S_BITS: tl.constexpr = student.dtype.element_ty.primitive_bitwidth
    T_BITS: tl.constexpr = teacher.dtype.element_ty.primitive_bitwidth
    # 16 bytes of the wider dtype: the launcher's BLOCK gives each thread that many columns (one group, its reductions
    # in the thread); a group of the narrower dtype's 16 bytes would span two threads
    VECTOR: tl.constexpr = 128 // (S_BITS if S_BITS > T_BITS else T_BITS)
    GROUP: tl.constexpr = BLOCK if BLOCK < VECTOR else VECTOR
    GROUPS: tl.constexpr = BLOCK // GROUP
    cols = tl.arange(0, GROUPS)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    m_s = tl.full([GROUPS], NEG, tl.float32)
    m_t = tl.full([GROUPS], NEG, tl.float32)
    s_s = tl.zeros([GROUPS], tl.float32)
    s_t = tl.zeros([GROUPS], tl.float32)
    t_s = tl.zeros([GROUPS], tl.float32)
    w = tl.zeros([GROUPS], tl.float32)
    full = V // BLOCK * BLOCK
    for start in range(0, full, BLOCK):
        idx = (start + cols).to(tl.int64)
        z = tl.load(student + idx * stride_col).to(tl.float32)
        u = tl.load(teacher + idx * teacher_stride_col).to(tl.float32)
        m_s, s_s, t_s, m_t, s_t, w = _pair_step(z, u, m_s, s_s, t_s, m_t, s_t, w, c_s, c_t, DIVERGENCE, ENTROPY)
    if full < V:
        idx = full + cols
        inside = idx < V
        z = tl.load(student + idx.to(tl.int64) * stride_col, mask=inside, other=MINUS_INF).to(tl.float32)
        u = tl.load(teacher + idx.to(tl.int64) * teacher_stride_col, mask=inside, other=MINUS_INF).to(tl.float32)
        m_s, s_s, t_s, m_t, s_t, w = _pair_step(z, u, m_s, s_s, t_s, m_t, s_t, w, c_s, c_t, DIVERGENCE, ENTROPY)
    row_m_s = tl.max(m_s, axis=0)
    row_m_t = tl.max(m_t, axis=0)
    shift_s = (m_s - row_m_s) * c_s  # each group's state moved to the row's maxes, as in _pair_step
    shift_t = (m_t - row_m_t) * c_t
    total_s = tl.sum(s_s * tl.exp2(shift_s), axis=0)
    log2_sum_s = tl.log2(total_s)
    log2_sum_t = tl.log2(tl.sum(s_t * tl.exp2(shift_t), axis=0))
    entropy = 0.0
    if ENTROPY:  # as _row_softmax merges its groups: H = ln 2 (log2 sum 2^a - sum 2^a a / sum 2^a)
        total_t = tl.sum(t_s * tl.exp2(shift_s) + s_s * (shift_s * tl.exp2(shift_s)), axis=0)
        entropy = (log2_sum_s - total_t / total_s) * LN2
    divergence = 0.0
    if DIVERGENCE == FORWARD:
        cross = tl.sum(tl.exp2(shift_t) * (w + (shift_t - shift_s) * s_t), axis=0)
        divergence = (cross * tl.exp2(-log2_sum_t) - log2_sum_t + log2_sum_s) * LN2
    elif DIVERGENCE == REVERSE:
        cross = tl.sum(tl.exp2(shift_s) * (w + (shift_s - shift_t) * s_s), axis=0)
        divergence = (cross * tl.exp2(-log2_sum_s) - log2_sum_s + log2_sum_t) * LN2
    return row_m_s, log2_sum_s, row_m_t, log2_sum_t, divergence, entropy


@triton.jit
def _log2_probabilities(z, u, m_s, log2_sum_s, m_t, log2_sum_t, c_s, c_t, log2_student_share, log2_teacher_share,
                        WITH_MIXTURE: tl.constexpr):
    """(log2 p, log2 q, log2 m) of one block, the first two floored at NEG (probability 0: a -inf logit, a lane past
    V), m = (1 - beta) p + beta q (log2_student_share = log2(1 - beta), log2_teacher_share = log2 beta) as
    hi + log2(1 + 2^(lo - hi)) of its two terms in units (finite: the floors); log2 m is 0 unless WITH_MIXTURE."""
    lp = tl.maximum((z - m_s) * c_s - log2_sum_s, NEG)
    lq = tl.maximum((u - m_t) * c_t - log2_sum_t, NEG)
    lm = 0.0
    if WITH_MIXTURE:
        x = lp + log2_student_share
        y = lq + log2_teacher_share
        hi = tl.maximum(x, y)
        lm = hi + tl.log2(1.0 + tl.exp2(tl.minimum(x, y) - hi))
    return lp, lq, lm


@triton.jit
def _jsd_block(student, stride_col, teacher, teacher_stride_col, start, cols, V, m_s, log2_sum_s, m_t, log2_sum_t,
               c_s, c_t, log2_student_share, log2_teacher_share, MASKED: tl.constexpr):
    """(sum p (log2 p - log2 m), sum q (log2 q - log2 m)) per group of one block (0 log 0 = 0: p = 2^NEG = 0 times a
    finite log)."""
    idx = start + cols
    if MASKED:
        inside = idx < V
        z = tl.load(student + idx.to(tl.int64) * stride_col, mask=inside, other=MINUS_INF).to(tl.float32)
        u = tl.load(teacher + idx.to(tl.int64) * teacher_stride_col, mask=inside, other=MINUS_INF).to(tl.float32)
    else:
        z = tl.load(student + idx.to(tl.int64) * stride_col).to(tl.float32)
        u = tl.load(teacher + idx.to(tl.int64) * teacher_stride_col).to(tl.float32)
    lp, lq, lm = _log2_probabilities(z, u, m_s, log2_sum_s, m_t, log2_sum_t, c_s, c_t, log2_student_share,
                                     log2_teacher_share, True)
    return tl.sum(tl.exp2(lp) * (lp - lm), axis=1), tl.sum(tl.exp2(lq) * (lq - lm), axis=1)


@triton.jit
def _jsd_sums(student, stride_col, teacher, teacher_stride_col, V, m_s, log2_sum_s, m_t, log2_sum_t, c_s, c_t,
              log2_student_share, log2_teacher_share, BLOCK: tl.constexpr):
    """JSD's second sweep, given both log-sum-exps: (KL(p || m), KL(q || m)) in bits. Backwards (the tail, then the full
    blocks from the last): the row's end was read last by the first sweep, so it is the likeliest still in L2."""
    S_BITS: tl.constexpr = student.dtype.element_ty.primitive_bitwidth
    T_BITS: tl.constexpr = teacher.dtype.element_ty.primitive_bitwidth
    VECTOR: tl.constexpr = 128 // (S_BITS if S_BITS > T_BITS else T_BITS)  # as in _pair_softmax
    GROUP: tl.constexpr = BLOCK if BLOCK < VECTOR else VECTOR
    GROUPS: tl.constexpr = BLOCK // GROUP
    cols = tl.arange(0, GROUPS)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    kl_p = tl.zeros([GROUPS], tl.float32)
    kl_q = tl.zeros([GROUPS], tl.float32)
    n_full = V // BLOCK
    if n_full * BLOCK < V:
        kl_p, kl_q = _jsd_block(student, stride_col, teacher, teacher_stride_col, n_full * BLOCK, cols, V, m_s,
                                log2_sum_s, m_t, log2_sum_t, c_s, c_t, log2_student_share, log2_teacher_share, True)
    for i in range(0, n_full):
        block_p, block_q = _jsd_block(student, stride_col, teacher, teacher_stride_col, (n_full - 1 - i) * BLOCK, cols,
                                      V, m_s, log2_sum_s, m_t, log2_sum_t, c_s, c_t, log2_student_share,
                                      log2_teacher_share, False)
        kl_p += block_p
        kl_q += block_q
    return tl.sum(kl_p, axis=0), tl.sum(kl_q, axis=0)


@triton.jit
def _distill_stats_kernel(
    logits_ptr, rows_per_seq, stride_seq, stride_row, stride_col,
    teacher_ptr, teacher_stride_seq, teacher_stride_row, teacher_stride_col,
    valid_ptr, stats_ptr, N, V,
    c_s, c_t, beta, log2_student_share, log2_teacher_share,
    DIVERGENCE: tl.constexpr, BLOCK: tl.constexpr,
):
    """The statistics of each row (stats_ptr: float32 [NUM_STATS, N], rows named by STATS): both models' max and log2
    sum, D_t and (JSD) K_t = KL(p || m) in nats. valid_ptr: bool [N]; a masked row gets zeros, its logits unread.
    Student and teacher share the [B, T, V] or [N, V] shape (rows_per_seq), not their strides. Persistent: program k
    takes rows k, k + num_programs, ... (the grid only bounds the rows in flight between JSD's two sweeps).
    c_s, c_t: log2(e) / tau and log2(e) / tau_t, each rounded once to fp32 (from float64, by the launcher)."""
    n_rows = tl.cast(N, tl.int64)  # 64-bit offsets into the statistics
    for first in range(tl.program_id(0), N, tl.num_programs(0)):
        row = tl.cast(first, tl.int64)
        out = stats_ptr + row
        if tl.load(valid_ptr + row):
            student = logits_ptr + _row_offset(row, rows_per_seq, stride_seq, stride_row)
            teacher = teacher_ptr + _row_offset(row, rows_per_seq, teacher_stride_seq, teacher_stride_row)
            m_s, log2_sum_s, m_t, log2_sum_t, divergence, _ = _pair_softmax(student, stride_col, teacher,
                                                                            teacher_stride_col, V, c_s, c_t,
                                                                            DIVERGENCE, BLOCK)
            student_kl = 0.0
            if DIVERGENCE == JSD:  # beta KL(q || m) + (1 - beta) KL(p || m)
                kl_p, kl_q = _jsd_sums(student, stride_col, teacher, teacher_stride_col, V, m_s, log2_sum_s, m_t,
                                       log2_sum_t, c_s, c_t, log2_student_share, log2_teacher_share, BLOCK)
                student_kl = kl_p * LN2
                divergence = (beta * kl_q + (1.0 - beta) * kl_p) * LN2
            tl.store(out + STUDENT_MAX * n_rows, m_s)
            tl.store(out + STUDENT_LOG2_SUM * n_rows, log2_sum_s)
            tl.store(out + TEACHER_MAX * n_rows, m_t)
            tl.store(out + TEACHER_LOG2_SUM * n_rows, log2_sum_t)
            tl.store(out + DIVERGENCE_ROW * n_rows, divergence)
            tl.store(out + STUDENT_KL * n_rows, student_kl)
        else:
            for k in tl.static_range(NUM_STATS):
                tl.store(out + k * n_rows, 0.0)


@triton.jit
def _distill_jsd_given_kernel(
    logits_ptr, rows_per_seq, stride_seq, stride_row, stride_col,
    teacher_ptr, teacher_stride_seq, teacher_stride_row, teacher_stride_col,
    valid_ptr, stats_ptr, out_ptr, N, V,
    c_s, c_t, log2_student_share, log2_teacher_share,
    BLOCK: tl.constexpr,
):
    """A vocabulary shard's share of JSD's sums (out_ptr: float32 [2, N]: sum p (ln p - ln m), sum q (ln q - ln m) over
    the shard's V columns), given the whole rows' maxes and log2 sums in stats_ptr (float32 [NUM_STATS, N], laid out
    as the stats kernel writes them, the merged values of every shard: fused_is/distill.py `sharded_statistics`), so
    that p, q and m are the whole vocabulary's. A masked row gets zeros, its logits unread. One program per row."""
    n_rows = tl.cast(N, tl.int64)
    row = tl.program_id(0).to(tl.int64)
    if tl.load(valid_ptr + row):
        student = logits_ptr + _row_offset(row, rows_per_seq, stride_seq, stride_row)
        teacher = teacher_ptr + _row_offset(row, rows_per_seq, teacher_stride_seq, teacher_stride_row)
        m_s = tl.load(stats_ptr + STUDENT_MAX * n_rows + row)
        log2_sum_s = tl.load(stats_ptr + STUDENT_LOG2_SUM * n_rows + row)
        m_t = tl.load(stats_ptr + TEACHER_MAX * n_rows + row)
        log2_sum_t = tl.load(stats_ptr + TEACHER_LOG2_SUM * n_rows + row)
        kl_p, kl_q = _jsd_sums(student, stride_col, teacher, teacher_stride_col, V, m_s, log2_sum_s, m_t, log2_sum_t,
                               c_s, c_t, log2_student_share, log2_teacher_share, BLOCK)
        tl.store(out_ptr + row, kl_p * LN2)
        tl.store(out_ptr + n_rows + row, kl_q * LN2)
    else:
        tl.store(out_ptr + row, 0.0)
        tl.store(out_ptr + n_rows + row, 0.0)


@triton.jit
def _divergence_gradient(lp, lq, lm, center, DIVERGENCE: tl.constexpr):
    """F of one block from log2 p, log2 q and (JSD) log2 m (_log2_probabilities): forward p - q; reverse
    p (ln p - ln q - D); JSD p (ln p - ln m - K) (center: D or K). A probability 0 gives F = 0 times a finite factor."""
    if DIVERGENCE == FORWARD:
        grad = tl.exp2(lp) - tl.exp2(lq)
    elif DIVERGENCE == REVERSE:
        grad = tl.exp2(lp) * ((lp - lq) * LN2 - center)
    else:
        grad = tl.exp2(lp) * ((lp - lm) * LN2 - center)
    return grad


@triton.jit
def _gradient_block(student, stride_col, teacher, teacher_stride_col, out, out_stride_col, start, cols, V, m_s,
                    log2_sum_s, m_t, log2_sum_t, c_s, c_t, coef, center, log2_student_share, log2_teacher_share,
                    DIVERGENCE: tl.constexpr, MASKED: tl.constexpr, ACCUMULATE: tl.constexpr = False):
    """coef F_j of one block, coef = w_t / tau (times 1 - beta for JSD), F per kind (fused_is/distill.py):
    forward p - q; reverse p (log p - log q - D); JSD p (log p - log m - K) (center: D or K). A probability 0 (a -inf
    logit) gives F = 0 times a finite factor. Each column is loaded and stored by the same thread (out may be the
    student's row itself: nothing else reads it). ACCUMULATE: out's value is added in fp32, the sum rounded once."""
    idx = start + cols
    inside = idx < V
    if MASKED:
        z = tl.load(student + idx.to(tl.int64) * stride_col, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(teacher + idx.to(tl.int64) * teacher_stride_col, mask=inside, other=0.0).to(tl.float32)
    else:
        z = tl.load(student + idx.to(tl.int64) * stride_col).to(tl.float32)
        u = tl.load(teacher + idx.to(tl.int64) * teacher_stride_col).to(tl.float32)
    lp, lq, lm = _log2_probabilities(z, u, m_s, log2_sum_s, m_t, log2_sum_t, c_s, c_t, log2_student_share,
                                     log2_teacher_share, DIVERGENCE == JSD)
    grad = _divergence_gradient(lp, lq, lm, center, DIVERGENCE) * coef
    if ACCUMULATE:
        if MASKED:
            grad += tl.load(out + idx.to(tl.int64) * out_stride_col, mask=inside, other=0.0).to(tl.float32)
        else:
            grad += tl.load(out + idx.to(tl.int64) * out_stride_col).to(tl.float32)
    grad = grad.to(out.dtype.element_ty)
    if MASKED:
        tl.store(out + idx.to(tl.int64) * out_stride_col, grad, mask=inside)
    else:
        tl.store(out + idx.to(tl.int64) * out_stride_col, grad)


@triton.jit
def _distill_gradient_kernel(
    logits_ptr, rows_per_seq, stride_seq, stride_row, stride_col,
    teacher_ptr, teacher_stride_seq, teacher_stride_row, teacher_stride_col,
    grad_ptr, grad_stride_seq, grad_stride_row, grad_stride_col,
    stats_ptr, weight_ptr, N, V,
    c_s, c_t, grad_scale, log2_student_share, log2_teacher_share,
    DIVERGENCE: tl.constexpr, BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr = False,
):
    """d loss / d z = w_t F / tau of every row into grad_ptr (the student's shape, its own strides; it may be the
    student's logits: each column is read before the same thread writes it, and no value is shared across threads).
    weight_ptr: float64 [N], w_t = a_t grad_output; grad_scale = 1 / tau, (1 - beta) / tau for JSD; stats_ptr: the
    stats kernel's. A row with w_t = 0 (masked) gets exact zeros, its logits (NaN or anything) unread.
    ACCUMULATE: grad_ptr += the term instead (a buffer of its own, policy_loss's distillation term added to the
    policy's gradient), each sum rounded once; a masked row is left as it is."""
    n_rows = tl.cast(N, tl.int64)
    cols = tl.arange(0, BLOCK)
    for first in range(tl.program_id(0), N, tl.num_programs(0)):
        row = tl.cast(first, tl.int64)
        out = grad_ptr + _row_offset(row, rows_per_seq, grad_stride_seq, grad_stride_row)
        coef = (tl.load(weight_ptr + row) * grad_scale).to(tl.float32)
        if coef != 0.0:
            student = logits_ptr + _row_offset(row, rows_per_seq, stride_seq, stride_row)
            teacher = teacher_ptr + _row_offset(row, rows_per_seq, teacher_stride_seq, teacher_stride_row)
            m_s = tl.load(stats_ptr + STUDENT_MAX * n_rows + row)
            log2_sum_s = tl.load(stats_ptr + STUDENT_LOG2_SUM * n_rows + row)
            m_t = tl.load(stats_ptr + TEACHER_MAX * n_rows + row)
            log2_sum_t = tl.load(stats_ptr + TEACHER_LOG2_SUM * n_rows + row)
            if DIVERGENCE == JSD:
                center = tl.load(stats_ptr + STUDENT_KL * n_rows + row)
            else:
                center = tl.load(stats_ptr + DIVERGENCE_ROW * n_rows + row)
            full = V // BLOCK * BLOCK
            for start in range(0, full, BLOCK):
                _gradient_block(student, stride_col, teacher, teacher_stride_col, out, grad_stride_col, start, cols,
                                V, m_s, log2_sum_s, m_t, log2_sum_t, c_s, c_t, coef, center, log2_student_share,
                                log2_teacher_share, DIVERGENCE, False, ACCUMULATE)
            if full < V:
                _gradient_block(student, stride_col, teacher, teacher_stride_col, out, grad_stride_col, full, cols,
                                V, m_s, log2_sum_s, m_t, log2_sum_t, c_s, c_t, coef, center, log2_student_share,
                                log2_teacher_share, DIVERGENCE, True, ACCUMULATE)
        elif not ACCUMULATE:
            zeros = tl.zeros([BLOCK], tl.float32).to(out.dtype.element_ty)
            for start in range(0, V, BLOCK):
                idx = start + cols
                tl.store(out + idx.to(tl.int64) * grad_stride_col, zeros, mask=idx < V)


# --- policy_loss(..., teacher_logits=u): the policy loss and the distillation term in one kernel ---------------------


@triton.jit
def _policy_pair_block(student, stride_col, teacher, teacher_stride_col, out, out_stride_col, start, cols, V,
                       row_max, log2_sum, m_t, log2_sum_t, c, c0, c1, g_y, token, k,
                       DIVERGENCE: tl.constexpr, MASKED: tl.constexpr):
    """d loss / d z of one block of columns, the policy's gradient and w_t F / tau folded into one (fewer values live
    per element than the two apart: _fused_distill_kernel's register budget): p (c0 + c1 log2 p) + 1[j = y] g / tau
    (policy_loss.py _policy_gradient, its c0 and c1 with the term's share of p folded in) plus k q (forward: k = -w_t /
    tau) or k p log2 q (reverse: k = -w_t ln 2 / tau). Each column is loaded and stored by the same thread (out may be
    the student's row itself)."""
    idx = start + cols
    if MASKED:
        inside = idx < V
        z = tl.load(student + idx.to(tl.int64) * stride_col, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(teacher + idx.to(tl.int64) * teacher_stride_col, mask=inside, other=0.0).to(tl.float32)
    else:
        z = tl.load(student + idx.to(tl.int64) * stride_col).to(tl.float32)
        u = tl.load(teacher + idx.to(tl.int64) * teacher_stride_col).to(tl.float32)
    lp, lq, _ = _log2_probabilities(z, u, row_max, log2_sum, m_t, log2_sum_t, c, c, 0.0, 0.0, False)
    grad = _policy_gradient(lp, cols, start, c0, c1, g_y, token)
    if DIVERGENCE == FORWARD:
        grad += k * tl.exp2(lq)
    else:
        grad += k * tl.exp2(lp) * lq
    if MASKED:
        tl.store(out + idx.to(tl.int64) * out_stride_col, grad.to(out.dtype.element_ty), mask=inside)
    else:
        tl.store(out + idx.to(tl.int64) * out_stride_col, grad.to(out.dtype.element_ty))


@triton.jit
def _fused_distill_kernel(
    logits_ptr, rows_per_seq, stride_seq, stride_row, stride_col,
    teacher_ptr, teacher_stride_seq, teacher_stride_row, teacher_stride_col,
    grad_ptr, grad_stride_seq, grad_stride_row, grad_stride_col,
    tokens_ptr, table_ptr, valid_ptr, term_weight_ptr, lp_ptr, entropy_ptr, term_ptr,
    N, V,
    # kl_input_clamp last: in _fused_kernel's order (after kl_clamp) ptxas of triton 3.6 spills 4 bytes of this
    # kernel's 64 registers (sm_90, a reverse KL with 4096- and 8192-lane blocks), although the KL is not compiled in
    log_ratio_clamp, is_cap, is_floor, kl_coef, kl_clamp, p0, p1, p2, p3, kl_input_clamp,
    POLICY: tl.constexpr, BASE_SOURCE: tl.constexpr, WEIGHT_SOURCE: tl.constexpr, IS_MODE: tl.constexpr,
    KL_TYPE: tl.constexpr, KL_K2_GRAD: tl.constexpr, KL_RATIO_WEIGHTED: tl.constexpr,
    HAS_FLOOR: tl.constexpr, HAS_KL: tl.constexpr, COEF_SOURCE: tl.constexpr,
    DIVERGENCE: tl.constexpr, BLOCK: tl.constexpr, WHOLE_GROUPS: tl.constexpr,
):
    """policy_loss's one-pass kernel (policy_loss.py _fused_kernel) with a forward or reverse KL term of the teacher
    u at the policy's temperature (the row table's inv_tau, both models): per unmasked row (valid_ptr, bool [N]) one
    sweep over both rows (_pair_softmax: the student's max, log2 sum and entropy, the teacher's max and log2 sum,
    D_t), then lp and g in registers (_row_inputs, _row_coefficients), then one sweep over both rows again (backwards:
    the row's end, read last, is the likeliest still in L2) writing d loss / d z = the policy's gradient + w_t F / tau
    (term_weight_ptr: float64 [N], w_t = a_t distill_coef). A masked row's first sweep reads the student alone
    (_row_softmax: its lp and H as _fused_kernel gives them), its teacher not at all, and its gradient is zeros,
    neither row read. Writes lp, H (fp32 [N]) and term_ptr (fp32 [2, N]: D_t in nats and the teacher's log-sum-exp,
    0 at masked rows: the caller's checks read them). Reads V (s + t) twice per unmasked row, writes V s; the teacher
    is never written (the gradient may go over the student's logits). Persistent, as _fused_kernel."""
    tl.static_assert(DIVERGENCE != JSD, "the fused term runs the two KLs (JSD at beta 0 and 1 is one of them)")
    n_rows = tl.cast(N, tl.int64)
    cols = tl.arange(0, BLOCK)
    # both sweeps over both rows take half the launcher's full block a step (4096 lanes of two 16-bit rows, 2048 with
    # an fp32 row: 8 bytes of each row a thread at 32 warps): with whole blocks the kernel spills a few bytes under
    # the persistent grid's 64 registers (ptxas of triton 3.6 and 3.7, sm_90); shorter rows' blocks (a row's
    # next_pow2(V) below 4096 lanes, strided or unaligned rows) and a masked row's sweep over the student alone keep it
    STEP: tl.constexpr = BLOCK // 2 if BLOCK >= 4096 else BLOCK
    steps = tl.arange(0, STEP)
    for first in range(tl.program_id(0), N, tl.num_programs(0)):
        row = tl.cast(first, tl.int64)
        student = logits_ptr + _row_offset(row, rows_per_seq, stride_seq, stride_row)
        teacher = teacher_ptr + _row_offset(row, rows_per_seq, teacher_stride_seq, teacher_stride_row)
        # the row's 1 / tau, both models' (one value, or per sequence / token)
        c = tl.load(table_ptr + ROW_INV_TAU * n_rows + row).to(tl.float32) * LOG2E
        zero = tl.zeros([], tl.float32)
        m_t, log2_sum_t, divergence = zero, zero, zero
        if tl.load(valid_ptr + row):
            row_max, log2_sum, m_t, log2_sum_t, divergence, entropy = _pair_softmax(
                student, stride_col, teacher, teacher_stride_col, V, c, c, DIVERGENCE, STEP, True)
        else:
            row_max, log2_sum, entropy = _row_softmax(student, stride_col, V, c / LOG2E, BLOCK, 1, WHOLE_GROUPS)
        # the row's other values after the first sweep, so that they take no register through it
        token = tl.load(tokens_ptr + row).to(tl.int64)
        inv_tau_row = tl.load(table_ptr + ROW_INV_TAU * n_rows + row)  # float64
        coef = (tl.load(term_weight_ptr + row) * inv_tau_row).to(tl.float32)  # w_t / tau
        inv_tau = inv_tau_row.to(tl.float32)
        inside = (token >= 0) & (token < V)  # as in _fused_kernel
        z_target = tl.where(inside, tl.load(student + token * stride_col, mask=inside, other=0.0).to(tl.float32), NAN)
        adv, ratio_base, samp, weight, ref, agg, g, h = _row_inputs(table_ptr, n_rows, row, COEF_SOURCE)
        lp = (z_target - row_max) * inv_tau - log2_sum * LN2
        tl.store(lp_ptr + row, lp)
        tl.store(entropy_ptr + row, entropy)
        tl.store(term_ptr + row, divergence)
        tl.store(term_ptr + n_rows + row, m_t * inv_tau + log2_sum_t * LN2)
        if COEF_SOURCE != COEF_GIVEN:
            g = _row_coefficients(lp, adv, ratio_base, samp, weight, ref, agg,
                                  log_ratio_clamp, is_cap, is_floor, kl_coef, kl_clamp, kl_input_clamp, p0, p1, p2, p3,
                                  POLICY, BASE_SOURCE, WEIGHT_SOURCE, IS_MODE, KL_TYPE, KL_K2_GRAD, KL_RATIO_WEIGHTED,
                                  HAS_FLOOR, HAS_KL)
        # in place, the gradient sweep overwrites the columns (the target's among them) that every warp read above:
        # no warp may store before the slowest has loaded them
        tl.debug_barrier()
        out = grad_ptr + _row_offset(row, rows_per_seq, grad_stride_seq, grad_stride_row)
        if (g != 0.0) | (h != 0.0) | (coef != 0.0):
            # d loss / d z_j = p_j (c0 + c1 log2 p_j) + 1[j = y] g / tau (policy_loss.py _row_gradient) + coef F_j,
            # F = p - q (forward) or p (ln 2 (log2 p - log2 q) - D) (reverse), its p terms folded into c0 and c1
            c0 = -(g + h * entropy) * inv_tau
            c1 = -h * LN2 * inv_tau
            g_y = g * inv_tau
            if DIVERGENCE == FORWARD:
                c0 += coef
                k = -coef
            else:
                c0 -= coef * divergence
                c1 += coef * LN2
                k = -coef * LN2
            n_full = V // STEP
            if n_full * STEP < V:
                _policy_pair_block(student, stride_col, teacher, teacher_stride_col, out, grad_stride_col,
                                   n_full * STEP, steps, V, row_max, log2_sum, m_t, log2_sum_t, c, c0, c1, g_y, token,
                                   k, DIVERGENCE, True)
            for i in range(0, n_full):
                _policy_pair_block(student, stride_col, teacher, teacher_stride_col, out, grad_stride_col,
                                   (n_full - 1 - i) * STEP, steps, V, row_max, log2_sum, m_t, log2_sum_t, c, c0, c1,
                                   g_y, token, k, DIVERGENCE, False)
        else:  # masked: exact zeros, neither row read
            zeros = tl.zeros([BLOCK], tl.float32).to(out.dtype.element_ty)
            for start in range(0, V, BLOCK):
                idx = start + cols
                tl.store(out + idx.to(tl.int64) * grad_stride_col, zeros, mask=idx < V)

// Per-column math of distill_loss's kernels (DESIGN.md section 9), written once for the CPU (csrc/cpu/distill_cpu.cpp)
// and CUDA (csrc/cuda/distill_cuda.cu) kernels. The plan is fused_is/distill.py's and the Triton kernels'
// (triton_kernels/distill.py), which these mirror: a statistics kernel writes float32 [kNumStats, N] (both models' raw
// max and log2 sum, D_t, and JSD's K_t = KL(p || m)), a gradient kernel reads them with both rows and writes
//     d loss / d z_j = w_t F_j / tau,  F = p - q (forward KL),  p (log p - log q - D) (reverse KL),
//                                      (1 - beta) p (log p - log m - K) (JSD, m = (1 - beta) p + beta q).
// Arithmetic is fp32 in base-2 units: c = log2(e) / tau, a_j = (z_j - max z) c, b_j = (u_j - max u) c_t, so that
// log2 p_j = a_j - log2 sum 2^a; differences are taken before the scaling (exact for bf16/fp16 logits).
// The functions take the exponential and logarithm from a policy type M (M::exp2(x) for x <= 0, M::log2_1p(t) for t in
// [0, 1]): polynomials that vectorise on the CPU, MUFU instructions on the GPU.
#pragma once

#include <cstdint>

#include "fused_is_math.h"

// The rows of the statistics (fused_is/backends/abi.py DISTILL_STATS; triton_kernels/distill.py STATS): each model's
// raw max and log2 sum_j 2^a_j, D_t and K_t (JSD; else 0), in nats.
#define FIS_DISTILL_STATS(X) \
  X(student_max)             \
  X(student_log2_sum)        \
  X(teacher_max)             \
  X(teacher_log2_sum)        \
  X(divergence)              \
  X(student_kl)

// The double scalars of a launch, in order (abi.py DISTILL_SCALARS): log2(e) / tau and log2(e) / tau_t (rounded once
// to fp32 by the kernels), beta (statistics), the gradient's scale 1 / tau or (1 - beta) / tau, and the mixture's
// log2(1 - beta), log2(beta) (JSD; else 0), and the gradient sweep's accumulate (1: grad += the term, read once and
// rounded once, masked rows left as they are; 0: grad <- the term, zeros at masked rows).
#define FIS_DISTILL_SCALARS(X) \
  X(student_scale)             \
  X(teacher_scale)             \
  X(beta)                      \
  X(grad_scale)                \
  X(log2_student_share)        \
  X(log2_teacher_share)        \
  X(accumulate)

// (name in abi.py DISTILL_DIVERGENCES, enum value): fused_is.distill's DistillCall.divergence
#define FIS_DISTILL_DIVERGENCES(X) X(forward_kl, kForwardKL) X(reverse_kl, kReverseKL) X(jsd, kJSD)

namespace fused_is {
namespace distill {

#define FIS_DISTILL_ENUM(name, value) value,
enum Divergence : int32_t { FIS_DISTILL_DIVERGENCES(FIS_DISTILL_ENUM) };
#undef FIS_DISTILL_ENUM
#define FIS_DISTILL_STAT_ENUM(name) k_##name,
enum Stat : int { FIS_DISTILL_STATS(FIS_DISTILL_STAT_ENUM) kNumStats };
#undef FIS_DISTILL_STAT_ENUM

constexpr float kNeg = -1.0e30f;  // the floor of log2 p and the first max: finite, so that 0 log 0 = 0 * finite
constexpr double kLn2 = 0.6931471805599453;
constexpr float kLn2f = static_cast<float>(kLn2);

struct Scalars {
#define FIS_DISTILL_SCALAR_FIELD(name) double name;
  FIS_DISTILL_SCALARS(FIS_DISTILL_SCALAR_FIELD)
#undef FIS_DISTILL_SCALAR_FIELD
};

// What a sweep over a row needs given its statistics, in fp32 (the kernels' arithmetic): the raw maxes, the log2
// sums, the scales c, the center of the reverse KL or JSD gradient (D or K, nats) and the mixture's log2 shares.
struct RowConstants {
  float m_s, log2_sum_s, m_t, log2_sum_t, c_s, c_t, center, log2_student_share, log2_teacher_share;
};

FIS_HD RowConstants row_constants(float m_s, float log2_sum_s, float m_t, float log2_sum_t, float center,
                                  const Scalars& k) {
  return RowConstants{m_s, log2_sum_s, m_t, log2_sum_t, static_cast<float>(k.student_scale),
                      static_cast<float>(k.teacher_scale), center, static_cast<float>(k.log2_student_share),
                      static_cast<float>(k.log2_teacher_share)};
}

// The statistics sweep's cross term of one column, weights p = 2^a, q = 2^b against the maxes: forward KL's
// q (b - a), reverse KL's p (a - b); 0 where the weight is 0 (0 log 0 = 0). A -inf logit keeps its raw value, so
// where the other model's probability is not 0 the term is +inf: the infinite KL that the caller reports.
template <int kDivergence>
FIS_HD float cross_term(float p, float q, float a, float b) {
  if (kDivergence == kForwardKL) return q > 0.0f ? q * (b - a) : 0.0f;
  return p > 0.0f ? p * (a - b) : 0.0f;
}

// KL in nats from a row's sums: the weighting model's cross sum sum 2^x (x - y) and the log2 sums of both:
// ln 2 (cross / sum 2^x - log2 sum 2^x + log2 sum 2^y).
FIS_HD double kl_of_sums(double cross, double weight_sum, double log2_weight_sum, double log2_other_sum) {
  return (cross / weight_sum - log2_weight_sum + log2_other_sum) * kLn2;
}

FIS_HD float floor_neg(float x) { return x < kNeg ? kNeg : x; }  // NaN stays NaN

// log2 p and log2 q of one column, floored at kNeg (probability 0: a -inf logit).
FIS_HD float log2_student(float z, const RowConstants& r) { return floor_neg((z - r.m_s) * r.c_s - r.log2_sum_s); }
FIS_HD float log2_teacher(float u, const RowConstants& r) { return floor_neg((u - r.m_t) * r.c_t - r.log2_sum_t); }

// log2 m, m = (1 - beta) p + beta q, as hi + log2(1 + 2^(lo - hi)) of its two terms (finite: the floors).
template <class M>
FIS_HD float log2_mixture(float lp, float lq, const RowConstants& r) {
  const float x = lp + r.log2_student_share, y = lq + r.log2_teacher_share;
  const float hi = x > y ? x : y, lo = x > y ? y : x;
  return hi + M::log2_1p(M::exp2(lo - hi));
}

// JSD's second statistics sweep, one column: p (log2 p - log2 m) and q (log2 q - log2 m), in bits.
template <class M>
FIS_HD void jsd_terms(float z, float u, const RowConstants& r, float* kl_p, float* kl_q) {
  const float lp = log2_student(z, r), lq = log2_teacher(u, r);
  const float lm = log2_mixture<M>(lp, lq, r);
  *kl_p = M::exp2(lp) * (lp - lm);
  *kl_q = M::exp2(lq) * (lq - lm);
}

// F_j of one column (the module comment; JSD's 1 - beta is in the caller's coefficient): a probability 0 gives
// 0 times a finite factor.
template <int kDivergence, class M>
FIS_HD float gradient_term(float z, float u, const RowConstants& r) {
  const float lp = log2_student(z, r), lq = log2_teacher(u, r);
  if (kDivergence == kForwardKL) return M::exp2(lp) - M::exp2(lq);
  if (kDivergence == kReverseKL) return M::exp2(lp) * ((lp - lq) * kLn2f - r.center);
  return M::exp2(lp) * ((lp - log2_mixture<M>(lp, lq, r)) * kLn2f - r.center);
}

}  // namespace distill
}  // namespace fused_is

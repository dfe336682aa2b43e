// Per-token math of DESIGN.md section 2, written once for the CPU (csrc/cpu) and CUDA (csrc/cuda) kernels.
//
// A kernel reduces a row of logits to (lp_t, H_t); the functions below turn them, with the row's O(1)
// inputs, into the coefficients
//     g_t = d loss / d lp_t,   h_t = d loss / d H_t,
// and the gradient sweep writes  d loss / d z_tj = ( g (1[j = y] - p_j) - h p_j (log p_j + H) ) / tau
// (finish_row and row_gradient at the end: lp, H and the sweep's constants from a row's sums).
// The loss value and the metrics are formed from lp and H afterwards (fused_is/coefficients.py, float64,
// O(N)); here only what the gradient needs. Everything is a template on the scalar type (the kernels use
// double: it is per row, not per element).
#pragma once

#include <cmath>
#include <cstdint>

// ---- The kernel contract, mirrored from fused_is/backends/abi.py: the parameter and row-input names in the
// order the Python side packs them, and the enum values. The X-macros define LossParams and RowInputs (below),
// the unpacking (csrc/params.h, csrc/rows.h) and each extension's `abi()` report, which
// fused_is/backends/abi.py compares with its own declaration when the extension loads.

// int32 parameters (upper-cased constexprs in the Triton kernels)
#define FIS_INT_PARAMS(X) \
  X(policy)               \
  X(base_source)          \
  X(weight_source)        \
  X(is_mode)              \
  X(kl_type)              \
  X(kl_k2_grad)           \
  X(kl_ratio_weighted)    \
  X(has_floor)            \
  X(coef_source)

// double parameters; is_floor is 0 when unset for mask/reject (DESIGN.md: the MIS floor defaults to 0); p0..p3 are
// the policy's own, filled by its row of the policy table (fused_is/policies.py kernel_params; see surrogate_grad)
#define FIS_FLOAT_PARAMS(X) \
  X(log_ratio_clamp)        \
  X(is_cap)                 \
  X(is_floor)               \
  X(kl_coef)                \
  X(kl_clamp)               \
  X(kl_input_clamp)         \
  X(p0)                     \
  X(p1)                     \
  X(p2)                     \
  X(p3)

// rows of the float64 [9, N] row table: A_t, ratio base, sampler logprob, W_t, ref logprob, agg weight, g_t
// (when coef_source == given), h_t, and the row's inverse temperature 1 / tau_t (one value, or per sequence/token)
#define FIS_ROW_INPUTS(X) \
  X(adv)                  \
  X(base)                 \
  X(samp)                 \
  X(weight)               \
  X(ref)                  \
  X(agg)                  \
  X(g)                    \
  X(h)                    \
  X(inv_tau)

namespace fused_is {

// the policy branches (name in fused_is/policies.py KERNEL_POLICIES, enum value), numbered in this order
#define FIS_POLICIES(X) X(reinforce, kReinforce) X(ppo, kPPO) X(cispo, kCISPO) X(sapo, kSAPO) X(prime_rl, kPrimeRL)

#define FIS_POLICY_ENUM(name, value) value,
enum Policy : int32_t { FIS_POLICIES(FIS_POLICY_ENUM) };
#undef FIS_POLICY_ENUM
// ratio base: the row table, or formed from lp (old=None): lp, or the loglinear proximal samp + alpha (lp - samp)
enum BaseSource : int32_t { kBaseVector = 0, kBaseIsLp = 1, kBaseLoglinear = 2 };
enum WeightSource : int32_t { kWeightVector = 0, kWeightOne = 1, kWeightFromLp = 2 };
enum IsMode : int32_t { kTruncate = 0, kMask = 1, kReject = 2, kRaw = 3 };
enum KlType : int32_t { kK1 = 0, kK2 = 1, kK3 = 2 };
// the KL term's weight: none, the ratio exp(lp - base) (TRL), or exp(lp - sg(lp)) (NeMo-RL: its value in the gradient)
enum KlWeight : int32_t { kKlWeightNone = 0, kKlWeightRatio = 1, kKlWeightScore = 2, kKlWeightSampler = 3 };
enum CoefSource : int32_t { kCoefKernel = 0, kCoefGiven = 1 };  // g, h formed here, or given per row (GSPO)

// (enum, name, value) for the abi() report, in the names of fused_is/backends/abi.py ENUMS (the policies' from
// FIS_POLICIES)
#define FIS_ENUM_VALUES(X)                                                                        \
  X(base_source, vector, kBaseVector) X(base_source, lp, kBaseIsLp)                               \
  X(base_source, loglinear, kBaseLoglinear)                                                       \
  X(weight_source, vector, kWeightVector) X(weight_source, one, kWeightOne)                       \
  X(weight_source, from_lp, kWeightFromLp)                                                        \
  X(is_mode, truncate, kTruncate) X(is_mode, mask, kMask) X(is_mode, reject, kReject)             \
  X(is_mode, raw, kRaw)                                                                           \
  X(kl_type, k1, kK1) X(kl_type, k2, kK2) X(kl_type, k3, kK3)                                     \
  X(kl_ratio_weighted, none, kKlWeightNone) X(kl_ratio_weighted, ratio, kKlWeightRatio)           \
  X(kl_ratio_weighted, score, kKlWeightScore) X(kl_ratio_weighted, sampler, kKlWeightSampler)     \
  X(coef_source, kernel, kCoefKernel) X(coef_source, given, kCoefGiven)

}  // namespace fused_is

#if defined(__CUDACC__)
#define FIS_HD __host__ __device__ __forceinline__
#else
#define FIS_HD inline
#endif

namespace fused_is {

constexpr double kLogWeightClamp = 20.0;  // log w_t is clamped to +-20 before exp (config.LOG_WEIGHT_CLAMP)
constexpr double kSapoLogRatioBound = 80.0;  // SAPO's saturated gate (config.SAPO_LOG_RATIO_BOUND)
// kKlWeightSampler's weight exp(lp - samp) is 0 beyond ln FLT_MAX (constants.LN_FLT_MAX)
constexpr double kLnFltMax = 88.72283905206835;

// The loss parameters and the O(1) inputs of one row, named and ordered by the X-macros above.
struct LossParams {
#define FIS_INT_FIELD(name) int32_t name;
  FIS_INT_PARAMS(FIS_INT_FIELD)
#undef FIS_INT_FIELD
#define FIS_FLOAT_FIELD(name) double name;
  FIS_FLOAT_PARAMS(FIS_FLOAT_FIELD)
#undef FIS_FLOAT_FIELD
};

struct RowInputs {
#define FIS_ROW_FIELD(name) double name;
  FIS_ROW_INPUTS(FIS_ROW_FIELD)
#undef FIS_ROW_FIELD
};

// IS weight W_t from log w_t (any level: the level only decides how log w_t was summed).
template <typename T>
FIS_HD T is_weight(T log_w, const LossParams& p) {
  log_w = log_w < T(-kLogWeightClamp) ? T(-kLogWeightClamp) : (log_w > T(kLogWeightClamp) ? T(kLogWeightClamp) : log_w);
  const T w = exp(log_w);
  const bool inside = w >= T(p.is_floor) && w <= T(p.is_cap);
  switch (p.is_mode) {
    case kTruncate: {
      T out = w < T(p.is_cap) ? w : T(p.is_cap);
      if (p.has_floor && out < T(p.is_floor)) out = T(p.is_floor);
      return out;
    }
    case kMask: return inside ? w : T(0);
    case kReject: return inside ? T(1) : T(0);
    default: return w;  // kRaw
  }
}

// d s_t / d lp_t of the policy surrogate, each branch with its parameters p0..p3 (fused_is/policies.py):
//   REINFORCE: A;
//   PPO (p0, p1, p2 = clip_low, clip_high, dual clip or inf): r A on the unclipped branch, 0 where the clip (or the
//     dual clip, for A < 0) binds or the log ratio is beyond its clamp (inf when unset);
//   CISPO (p0, p1 = clip_low, clip_high): clip(r) A (its clipped ratio is a constant weight: the clamp only bounds
//     its value);
//   SAPO (p0, p1 = tau for A > 0, tau otherwise): the soft gate in place of the clip;
//   prime_rl (p0, p1 = clip_low, clip_high; p2 its penalty, in policy_term_grad): r A where the token probability
//     moved from exp(base) by at most p1 (A > 0) or p0 (else), 0 elsewhere.
template <typename T>
FIS_HD T surrogate_grad(T lp, T base, T adv, const LossParams& p) {
  if (p.policy == kReinforce) return adv;
  const T c = T(p.log_ratio_clamp), log_ratio = lp - base;
  const bool beyond = log_ratio < -c || log_ratio > c;
  const T lo = T(1) - T(p.p0), hi = T(1) + T(p.p1);
  if (p.policy == kCISPO) {
    const T ratio = exp(beyond ? (log_ratio < T(0) ? -c : c) : log_ratio);
    return (ratio < lo ? lo : (ratio > hi ? hi : ratio)) * adv;
  }
  if (beyond) return T(0);
  const T ratio = exp(log_ratio);
  if (p.policy == kSAPO) {  // s = sigmoid(tau (r - 1)) 4 / tau A: ds/dlp = 4 sig (1 - sig) r A
    const T bounded = log_ratio < T(kSapoLogRatioBound) ? ratio : exp(T(kSapoLogRatioBound));
    const T tau = adv > T(0) ? T(p.p0) : T(p.p1);
    const T sig = T(1) / (T(1) + exp(-tau * (bounded - T(1))));
    return T(4) * sig * (T(1) - sig) * bounded * adv;
  }
  if (p.policy == kPrimeRL) {  // the trust region on probabilities by total variation (policies.trust_region)
    const T moved = exp(lp) - exp(base);
    const bool keep = adv > T(0) ? moved <= T(p.p1) : moved >= -T(p.p0);
    return keep ? ratio * adv : T(0);
  }
  const T unclipped = ratio * adv;
  const T clipped_ratio = ratio < lo ? lo : (ratio > hi ? hi : ratio);
  const T clipped = clipped_ratio * adv;
  if (clipped < unclipped) return T(0);  // min(r A, clip(r) A) takes the constant branch
  if (adv < T(0) && T(p.p2) * adv > unclipped) return T(0);  // the dual clip (p2 = inf when unset: never binds)
  return unclipped;
}

// d/dlp of prime_rl's extra per-token term outside the IS weight, p2 (lp - base)^2.
template <typename T>
FIS_HD T policy_term_grad(T lp, T base, const LossParams& p) {
  return T(2) * T(p.p2) * (lp - base);
}

// d KL_t / d lp_t of the KL term: the k1 / k2 / k3 estimator of KL(learner || ref) at d = lp - ref clamped to
// +-kl_input_clamp (no gradient where it binds, a weight's included), its value clamped to +-kl_clamp (inf when
// unset; zero gradient beyond), k2's gradient when kl_k2_grad ("k1+"/"k3+"), and times r = exp(lp - base) with
// its gradient when kl_ratio_weighted is kKlWeightRatio: d/dlp (v r) = (v' + v) r; kKlWeightScore: times
// exp(lp - sg(lp)) before the clamp, d/dlp = v' + v inside it; kKlWeightSampler: times w = exp(lp - samp) before
// the clamp, d/dlp = (v' + v) w (w = 0 beyond ln FLT_MAX).
template <typename T>
FIS_HD T kl_grad(T lp, T ref, T base, T samp, const LossParams& p) {
  const T ci = T(p.kl_input_clamp);
  const T raw = lp - ref;
  const bool inside = raw >= -ci && raw <= ci;
  const T d = raw < -ci ? -ci : (raw > ci ? ci : raw);
  T value, grad;
  if (p.kl_type == kK1) {
    value = d;
    grad = T(1);
  } else if (p.kl_type == kK2) {
    value = T(0.5) * d * d;
    grad = d;
  } else {  // k3 = exp(ref - lp) - (ref - lp) - 1
    const T e = exp(-d);
    value = e + d - T(1);
    grad = T(1) - e;
  }
  if (!inside) grad = T(0);
  if (p.kl_ratio_weighted == kKlWeightScore && inside) grad += value;
  if (p.kl_ratio_weighted == kKlWeightSampler) {
    const T x = lp - samp;
    const T w = x > T(kLnFltMax) ? T(0) : exp(x);
    grad = inside ? (grad + value) * w : T(0);
    value *= w;
  }
  const T c = T(p.kl_clamp);
  if (value < -c || value > c) {
    value = value < T(0) ? -c : c;
    grad = T(0);
  }
  if (p.kl_k2_grad) grad = d;
  if (p.kl_ratio_weighted == kKlWeightRatio) grad = (grad + value) * exp(lp - base);
  return grad;
}

// (g_t, h_t) of one row from its learner logprob lp. Masked rows (agg == 0) give exactly (0, 0), whatever
// their other inputs hold, so an overflowing ratio there cannot turn into 0 * inf = nan.
template <typename T>
FIS_HD void row_coefficients(T lp, const RowInputs& in, const LossParams& p, T* g_out, T* h_out) {
  if (in.agg == 0.0) {
    *g_out = T(0);
    *h_out = T(0);
    return;
  }
  if (p.coef_source == kCoefGiven) {  // formed in float64 from the whole sequence's lp (GSPO)
    *g_out = T(in.g);
    *h_out = T(in.h);
    return;
  }
  T weight = T(1);
  if (p.weight_source == kWeightVector) weight = T(in.weight);
  // old = lp where old_logprobs is None, or AReaL's loglinear proximal (the base row then holds alpha)
  const T old = p.base_source == kBaseLoglinear ? T(in.samp) + T(in.base) * (lp - T(in.samp)) : lp;
  if (p.weight_source == kWeightFromLp) weight = is_weight<T>(old - T(in.samp), p);
  const T base = p.base_source == kBaseVector ? T(in.base) : old;
  T g = -weight * surrogate_grad<T>(lp, base, T(in.adv), p);
  if (p.policy == kPrimeRL) g += policy_term_grad<T>(lp, base, p);
  if (p.kl_coef != 0.0) g += T(p.kl_coef) * kl_grad<T>(lp, T(in.ref), base, T(in.samp), p);
  *g_out = T(in.agg) * g;
  *h_out = T(in.h);  // -e_t entropy_coef, given per row (the entropy term may aggregate on its own)
}

// A row finished from its sweep: s = sum_j e_j and t = sum_j e_j d_j with e_j = exp(d_j),
// d_j = (z_j - max z) / tau, and d_y of the sampled token.
struct RowStats {
  double lp, entropy, log_s;
};

FIS_HD RowStats finish_row(double s, double t, double d_y) {
  RowStats r;
  r.log_s = log(s);
  r.lp = d_y - r.log_s;
  r.entropy = r.log_s - t / s;
  return r;
}

// What the gradient sweep of a row needs: d loss / d z_j = e_j (c0 + c1 d_j) for j != y, and the target
// column from double sums (1 - p_y = (s - e_y) / s keeps its digits when p_y ~ 1). live is false for a
// row with g = h = 0 (masked): the kernels write exact zeros there, target column included, whatever its
// logits hold (grad_y is formed regardless: a branch here makes ptxas spill the CUDA kernel).
struct RowGradient {
  double c0, c1, grad_y;
  bool live;
};

FIS_HD RowGradient row_gradient(const RowStats& r, double s, double d_y, const RowInputs& in, const LossParams& p) {
  double g, h;
  row_coefficients<double>(r.lp, in, p, &g, &h);
  RowGradient out;
  out.live = g != 0.0 || h != 0.0;
  // grad_j = -p_j (g + h (log p_j + H)) / tau with log p_j = d_j - log_s, p_j = e_j / s
  out.c0 = -(g + h * (r.entropy - r.log_s)) / s * in.inv_tau;
  out.c1 = -h / s * in.inv_tau;
  const double e_y = exp(d_y);
  out.grad_y = (g * (s - e_y) / s - h * (e_y / s) * (r.lp + r.entropy)) * in.inv_tau;
  return out;
}

}  // namespace fused_is

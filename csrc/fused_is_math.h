// Per-token math of DESIGN.md section 2, written once for the CPU (csrc/cpu) and CUDA (csrc/cuda) kernels.
//
// A kernel reduces a row of logits to (lp_t, H_t); the functions below turn them, with the row's O(1)
// inputs, into the coefficients
//     g_t = d loss / d lp_t,   h_t = d loss / d H_t,
// and the gradient sweep writes  d loss / d z_tj = ( g (1[j = y] - p_j) - h p_j (log p_j + H) ) / tau.
// The loss value and the metrics are formed from lp and H afterwards (fused_is/coefficients.py, float64,
// O(N)); here only what the gradient needs. Everything is a template on the scalar type (the kernels use
// double: it is per row, not per element).
#pragma once

#include <cmath>
#include <cstdint>

#include "abi.h"

#if defined(__CUDACC__)
#define FIS_HD __host__ __device__ __forceinline__
#else
#define FIS_HD inline
#endif

namespace fused_is {

constexpr double kLogWeightClamp = 20.0;  // log w_t is clamped to +-20 before exp (config.LOG_WEIGHT_CLAMP)

// The loss parameters and the O(1) inputs of one row, named and ordered by csrc/abi.h.
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

// d s_t / d lp_t of the policy surrogate: A for REINFORCE; r A on the unclipped PPO branch, 0 where the
// clip (or the dual clip, for A < 0) binds.
template <typename T>
FIS_HD T surrogate_grad(T lp, T base, T adv, const LossParams& p) {
  if (p.policy == kReinforce) return adv;
  const T ratio = exp(lp - base);
  const T unclipped = ratio * adv;
  T lo = T(1) - T(p.clip_low), hi = T(1) + T(p.clip_high);
  const T clipped_ratio = ratio < lo ? lo : (ratio > hi ? hi : ratio);
  const T clipped = clipped_ratio * adv;
  if (clipped < unclipped) return T(0);  // min(r A, clip(r) A) takes the constant branch
  if (p.has_dual_clip && adv < T(0) && T(p.dual_clip) * adv > unclipped) return T(0);
  return unclipped;
}

// d KL_t / d lp_t for the k1 / k2 / k3 estimators of KL(learner || ref).
template <typename T>
FIS_HD T kl_grad(T lp, T ref, const LossParams& p) {
  const T d = lp - ref;
  if (p.kl_type == kK1) return T(1);
  if (p.kl_type == kK2) return d;
  return T(1) - exp(-d);  // k3 = exp(ref - lp) - (ref - lp) - 1
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
  T weight = T(1);
  if (p.weight_source == kWeightVector) weight = T(in.weight);
  else if (p.weight_source == kWeightFromLp) weight = is_weight<T>(lp - T(in.samp), p);
  const T base = p.base_source == kBaseIsLp ? lp : T(in.base);
  T g = -weight * surrogate_grad<T>(lp, base, T(in.adv), p);
  if (p.kl_coef != 0.0) g += T(p.kl_coef) * kl_grad<T>(lp, T(in.ref), p);
  *g_out = T(in.agg) * g;
  *h_out = -T(in.agg) * T(p.entropy_coef);
}

}  // namespace fused_is

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

#if defined(__CUDACC__)
#define FIS_HD __host__ __device__ __forceinline__
#else
#define FIS_HD inline
#endif

namespace fused_is {

// Values of the config enums, in the order fused_is/backends/cpp.py packs them.
enum Policy : int32_t { kReinforce = 0, kPPO = 1 };
enum BaseSource : int32_t { kBaseVector = 0, kBaseIsLp = 1 };      // ratio base: given, or lp itself (old=None)
enum WeightSource : int32_t { kWeightVector = 0, kWeightOne = 1, kWeightFromLp = 2 };
enum IsMode : int32_t { kTruncate = 0, kMask = 1, kReject = 2, kRaw = 3 };
enum KlType : int32_t { kK1 = 0, kK2 = 1, kK3 = 2 };

constexpr double kLogWeightClamp = 20.0;  // log w_t is clamped to +-20 before exp (config.LOG_WEIGHT_CLAMP)

struct LossParams {
  int32_t policy;
  int32_t base_source;
  int32_t weight_source;  // kWeightFromLp: token-level IS with old_logprobs=None, log w = lp - samp
  int32_t is_mode;
  int32_t kl_type;
  int32_t has_dual_clip;
  int32_t has_floor;
  double clip_low, clip_high, dual_clip;
  double is_cap, is_floor;  // is_floor is 0 when unset for mask/reject (DESIGN: MIS floor defaults to 0)
  double kl_coef, entropy_coef;
  double inv_tau;
};

// The O(1) inputs of one row. Pointers the config does not need may be null.
struct RowInputs {
  double adv;     // A_t
  double base;    // ratio base (old or sampler logprob) when base_source == kBaseVector
  double samp;    // sampler logprob, for kWeightFromLp
  double weight;  // W_t when weight_source == kWeightVector (sequence/geometric level reduced in torch)
  double ref;     // reference logprob, when kl_coef != 0
  double agg;     // aggregation weight a_t (0 for masked tokens)
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

// d loss / d z_j (before the 1/tau factor) from the row's log p_j, given g, h and H.
template <typename T>
FIS_HD T logit_grad(T log_p, T prob, bool is_target, T g, T h, T entropy) {
  T out = -prob * (g + h * (log_p + entropy));
  return is_target ? out + g : out;
}

}  // namespace fused_is

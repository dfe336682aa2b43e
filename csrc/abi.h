// The fused kernels' contract, mirrored from fused_is/backends/abi.py: the parameter and row-input names in
// the order the Python side packs them, and the enum values. The X-macros below define LossParams and
// RowInputs (csrc/fused_is_math.h), the unpacking (csrc/params.h, csrc/rows.h) and each extension's
// `abi()` report, which fused_is/backends/abi.py compares with its own declaration when the extension loads.
#pragma once

#include <cstdint>

// int32 parameters (upper-cased constexprs in the Triton kernels)
#define FIS_INT_PARAMS(X) \
  X(policy)               \
  X(base_source)          \
  X(weight_source)        \
  X(is_mode)              \
  X(kl_type)              \
  X(has_dual_clip)        \
  X(has_floor)

// double parameters; is_floor is 0 when unset for mask/reject (DESIGN.md: the MIS floor defaults to 0)
#define FIS_FLOAT_PARAMS(X) \
  X(clip_low)               \
  X(clip_high)              \
  X(dual_clip)              \
  X(is_cap)                 \
  X(is_floor)               \
  X(kl_coef)                \
  X(entropy_coef)           \
  X(inv_tau)

// rows of the float64 [6, N] row table: A_t, ratio base, sampler logprob, W_t, ref logprob, agg weight
#define FIS_ROW_INPUTS(X) \
  X(adv)                  \
  X(base)                 \
  X(samp)                 \
  X(weight)               \
  X(ref)                  \
  X(agg)

namespace fused_is {

enum Policy : int32_t { kReinforce = 0, kPPO = 1 };
enum BaseSource : int32_t { kBaseVector = 0, kBaseIsLp = 1 };  // ratio base: the row table, or lp (old=None)
enum WeightSource : int32_t { kWeightVector = 0, kWeightOne = 1, kWeightFromLp = 2 };
enum IsMode : int32_t { kTruncate = 0, kMask = 1, kReject = 2, kRaw = 3 };
enum KlType : int32_t { kK1 = 0, kK2 = 1, kK3 = 2 };

// (enum, name, value) for the abi() report, in the names of fused_is/backends/abi.py ENUMS
#define FIS_ENUM_VALUES(X)                                                                        \
  X(policy, reinforce, kReinforce) X(policy, ppo, kPPO)                                           \
  X(base_source, vector, kBaseVector) X(base_source, lp, kBaseIsLp)                               \
  X(weight_source, vector, kWeightVector) X(weight_source, one, kWeightOne)                       \
  X(weight_source, from_lp, kWeightFromLp)                                                        \
  X(is_mode, truncate, kTruncate) X(is_mode, mask, kMask) X(is_mode, reject, kReject)             \
  X(is_mode, raw, kRaw)                                                                           \
  X(kl_type, k1, kK1) X(kl_type, k2, kK2) X(kl_type, k3, kK3)

}  // namespace fused_is

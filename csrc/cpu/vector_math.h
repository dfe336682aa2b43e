// What the CPU kernels of csrc/cpu/ share: element conversions on raw bits and exponentials and logarithms written
// without calls, so that the `omp simd` loops that use them vectorise (GCC calls no vector libm without -ffast-math).
// Included by policy_loss_cpu.cpp and distill_cpu.cpp.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>

namespace fused_is {

// exp(x) for x <= 0 (here always z - max): Cody-Waite range reduction and a degree-6 polynomial, about
// 2 ulp, branch-free so that it vectorises. Below -87 it returns exactly 0 (the true value is below 2e-38,
// nothing against a sum that is at least 1), so a -inf logit has probability and gradient exactly 0.
// NaN stays NaN: it is how a NaN logit reaches the row's flag (fused_is/checks.py).
inline float exp_nonpositive(float x) {
  const bool underflow = x < -87.0f;
  x = underflow ? -87.0f : x;
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return underflow ? 0.0f : y * scale;
}

// Element conversions on raw bits, so that loads and stores vectorise (bf16 is the top half of an fp32).
template <typename S> struct Elem;
template <> struct Elem<float> {
  using raw = float;
  static inline float load(raw v) { return v; }
  static inline raw store(float v) { return v; }
};
template <> struct Elem<at::BFloat16> {
  using raw = uint16_t;
  static inline float load(raw v) {
    const uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
  static inline raw store(float v) {  // round to nearest even (gradients are finite)
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return static_cast<raw>(bits >> 16);
  }
};
template <> struct Elem<at::Half> {
  using raw = _Float16;  // GCC's IEEE half: converts with F16C (vcvtph2ps / vcvtps2ph) when available
  static inline float load(raw v) { return static_cast<float>(v); }
  static inline raw store(float v) { return static_cast<raw>(v); }
};
template <> struct Elem<double> {  // read only: a teacher's logits (distill_cpu.cpp)
  using raw = double;
  static inline float load(raw v) { return static_cast<float>(v); }
};

// z_j <- x_j as fp32, returning max(first, max_j z_j) (contiguous rows).
template <typename E>
float load_and_max(const typename E::raw* __restrict x, const int64_t V, float* __restrict z, float first = -3.0e38f) {
  float m = first;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < V; ++j) {
    z[j] = E::load(x[j]);
    m = z[j] > m ? z[j] : m;
  }
  return m;
}

// 2^x for x <= 0 (a log2 probability, or a difference below a max): x = n + r with n an integer and |r| <= 1/2, 2^r
// by its Taylor series in r ln 2 to degree 7 (truncation below 1e-8, under the fp32 rounding), n into the exponent
// bits. Below -126 it returns exactly 0 (flush to zero, as the GPU kernels' ex2.approx.ftz): a -inf argument gives 0,
// and NaN stays NaN.
inline float exp2_nonpositive(float x) {
  const bool underflow = x < -126.0f;
  x = underflow ? -126.0f : x;
  const float n = __builtin_floorf(x + 0.5f);
  const float r = x - n;
  float p = 1.5252733804059840e-5f;
  p = p * r + 1.5403530393381608e-4f;
  p = p * r + 1.3333558146428443e-3f;
  p = p * r + 9.6181291076284772e-3f;
  p = p * r + 5.5504108664821580e-2f;
  p = p * r + 2.4022650695910071e-1f;
  p = p * r + 6.9314718055994531e-1f;
  const float y = p * r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return underflow ? 0.0f : y * scale;
}

// log2(1 + t) for t in [0, 1] (the mixture's log2(1 + 2^(lo - hi))): with y = 1 + t, or (1 + t) / 2 and 1 added
// above sqrt 2, ln y = 2 atanh(s), s = (y - 1) / (y + 1) in [-0.172, 0.172], by its series to s^9 (truncation 2e-9
// relative); s is formed from t, not from a rounded 1 + t, so a small t keeps its digits.
inline float log2_1p_unit(float t) {
  const bool above = t > 0.41421356f;
  const float s = above ? (t - 1.0f) / (t + 3.0f) : t / (t + 2.0f);
  const float s2 = s * s;
  const float series = 1.0f + s2 * (0.33333333f + s2 * (0.2f + s2 * (0.14285714f + s2 * 0.11111111f)));
  return (above ? 1.0f : 0.0f) + 2.8853900817779268f * s * series;  // 2 / ln 2
}

// The math policy of csrc/distill_math.h on the CPU.
struct VectorMath {
  static inline float exp2(float x) { return exp2_nonpositive(x); }
  static inline float log2_1p(float t) { return log2_1p_unit(t); }
};

}  // namespace fused_is

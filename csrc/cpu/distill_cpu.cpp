// backend="cpu" of distill_loss (DESIGN.md section 9): the two kernels of fused_is/distill.py's plan in C++, the
// counterparts of triton_kernels/distill.py's, with the per-column math of csrc/distill_math.h. Bound as
// distill_stats and distill_gradient by policy_loss_cpu.cpp's module (one CPU extension).
//
// Cost per row of V columns, s and t bytes per student and teacher element (the teacher is only ever read):
//   distill_stats: reads V (s + t) once, into two thread-local fp32 buffers with each model's max taken on the way;
//     then one sweep over the buffers (in cache: 2 x 600 KiB at V = 151936) gives both log2 sums and the KLs' cross
//     sum, and JSD a second one KL(p || m) and KL(q || m). Writes kNumStats floats; a masked row reads nothing.
//   distill_gradient: reads V (s + t) into the buffers and writes V s (d loss / d z, into a new buffer or over the
//     student's logits: the row is in the buffers before its first column is written); a row of weight 0 (masked) is
//     written with zeros, its logits unread.
// Rows are split across threads with at::parallel_for (torch's OpenMP pool). The sweeps are plain counted `omp simd`
// loops over contiguous floats (strided rows are gathered into the buffers first), with csrc/cpu/vector_math.h's exp2
// and log2, so GCC vectorises them; the sums are double (the KL from them cancels log2 sums of size log2 V).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "../distill_math.h"
#include "../params.h"
#include "../rows.h"
#include "vector_math.h"

namespace fused_is {
namespace distill {
namespace {

using M = VectorMath;

// A row of either model into buf as fp32; returns max(kNeg, max_j x_j), the Triton kernel's first max (a row of
// only -inf keeps kNeg: its log2 sum is then -inf, which the caller reports).
template <typename E>
float load_row(const typename E::raw* x, int64_t V, int64_t stride, float* __restrict buf) {
  if (stride == 1) return load_and_max<E>(x, V, buf, kNeg);
  float m = kNeg;
  for (int64_t j = 0; j < V; ++j) {
    buf[j] = E::load(x[j * stride]);
    m = buf[j] > m ? buf[j] : m;
  }
  return m;
}

// (sum 2^a, sum 2^b, the KL's cross sum (csrc/distill_math.h cross_term), 0 for JSD) of one row's buffers, in double.
// A -inf logit keeps its raw value: 2^a = 0, and NaN or +inf (a max of +inf) make the sums NaN.
template <int kDivergence>
void pair_sums(const float* __restrict z, const float* __restrict u, const int64_t V, const float m_s, const float m_t,
               const float c_s, const float c_t, double* out) {
  double s_s = 0.0, s_t = 0.0, cross = 0.0;
#pragma omp simd reduction(+ : s_s, s_t, cross)
  for (int64_t j = 0; j < V; ++j) {
    const float a = (z[j] - m_s) * c_s, b = (u[j] - m_t) * c_t;
    const float p = M::exp2(a), q = M::exp2(b);
    s_s += p;
    s_t += q;
    if (kDivergence != kJSD) cross += cross_term<kDivergence>(p, q, a, b);
  }
  out[0] = s_s;
  out[1] = s_t;
  out[2] = cross;
}

// JSD's second sweep given both log2 sums: (KL(p || m), KL(q || m)) in bits, in double.
void jsd_sums(const float* __restrict z, const float* __restrict u, const int64_t V, const RowConstants r,
              double* kl_p, double* kl_q) {
  double sum_p = 0.0, sum_q = 0.0;
#pragma omp simd reduction(+ : sum_p, sum_q)
  for (int64_t j = 0; j < V; ++j) {
    float term_p, term_q;
    jsd_terms<M>(z[j], u[j], r, &term_p, &term_q);
    sum_p += term_p;
    sum_q += term_q;
  }
  *kl_p = sum_p;
  *kl_q = sum_q;
}

// The statistics of one unmasked row from its buffers, in STATS order (csrc/distill_math.h).
template <int kDivergence>
void row_statistics(const float* z, const float* u, const int64_t V, const float m_s, const float m_t,
                    const Scalars& k, float* values) {
  double sums[3];
  pair_sums<kDivergence>(z, u, V, m_s, m_t, static_cast<float>(k.student_scale), static_cast<float>(k.teacher_scale),
                         sums);
  const double log2_sum_s = std::log2(sums[0]), log2_sum_t = std::log2(sums[1]);
  double divergence = 0.0, student_kl = 0.0;
  if (kDivergence == kForwardKL) {
    divergence = kl_of_sums(sums[2], sums[1], log2_sum_t, log2_sum_s);
  } else if (kDivergence == kReverseKL) {
    divergence = kl_of_sums(sums[2], sums[0], log2_sum_s, log2_sum_t);
  } else {  // beta KL(q || m) + (1 - beta) KL(p || m), given the log2 sums as the gradient reads them (fp32)
    double kl_p, kl_q;
    jsd_sums(z, u, V, row_constants(m_s, static_cast<float>(log2_sum_s), m_t, static_cast<float>(log2_sum_t), 0.0f, k),
             &kl_p, &kl_q);
    student_kl = kl_p * kLn2;
    divergence = (k.beta * kl_q + (1.0 - k.beta) * kl_p) * kLn2;
  }
  values[k_student_max] = m_s;
  values[k_student_log2_sum] = static_cast<float>(log2_sum_s);
  values[k_teacher_max] = m_t;
  values[k_teacher_log2_sum] = static_cast<float>(log2_sum_t);
  values[k_divergence] = static_cast<float>(divergence);
  values[k_student_kl] = static_cast<float>(student_kl);
}

// out_j <- coef F_j of one row, or (kAccumulate) out_j + coef F_j rounded once (out: the student's shape and dtype, any
// column stride; never one of the buffers).
template <int kDivergence, bool kAccumulate, typename E>
void write_row(const float* __restrict z, const float* __restrict u, const int64_t V, const RowConstants r,
               const float coef, typename E::raw* out, const int64_t stride) {
  if (stride == 1) {
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) {
      const float term = gradient_term<kDivergence, M>(z[j], u[j], r) * coef;
      if constexpr (kAccumulate) {
        out[j] = E::store(E::load(out[j]) + term);
      } else {
        out[j] = E::store(term);
      }
    }
  } else {
    for (int64_t j = 0; j < V; ++j) {
      const float term = gradient_term<kDivergence, M>(z[j], u[j], r) * coef;
      out[j * stride] = E::store(kAccumulate ? E::load(out[j * stride]) + term : term);
    }
  }
}

template <int kDivergence, typename E>
void write_gradient(const float* __restrict z, const float* __restrict u, const int64_t V, const RowConstants r,
                    const float coef, typename E::raw* out, const int64_t stride, const bool accumulate) {
  if (accumulate) {
    write_row<kDivergence, true, E>(z, u, V, r, coef, out, stride);
  } else {
    write_row<kDivergence, false, E>(z, u, V, r, coef, out, stride);
  }
}

// f(S*, T*) with the element types of a (student, teacher) dtype pair (check_distill_pair has checked them).
template <typename F>
void with_types(at::ScalarType student, at::ScalarType teacher, F&& f) {
  auto with_teacher = [&](auto* s) {
    switch (teacher) {
      case at::kFloat: return f(s, static_cast<float*>(nullptr));
      case at::kBFloat16: return f(s, static_cast<at::BFloat16*>(nullptr));
      case at::kHalf: return f(s, static_cast<at::Half*>(nullptr));
      default: return f(s, static_cast<double*>(nullptr));
    }
  };
  switch (student) {
    case at::kFloat: return with_teacher(static_cast<float*>(nullptr));
    case at::kBFloat16: return with_teacher(static_cast<at::BFloat16*>(nullptr));
    default: return with_teacher(static_cast<at::Half*>(nullptr));
  }
}

template <typename S, typename T>
void stats_rows(const at::Tensor& logits, const at::Tensor& teacher, const int divergence, const bool* valid,
                float* stats, const Scalars& k) {
  using ES = Elem<S>;
  using ET = Elem<T>;
  const Layout ls = layout_of(logits), lt = layout_of(teacher);
  const auto* student = reinterpret_cast<const typename ES::raw*>(logits.data_ptr());
  const auto* teach = reinterpret_cast<const typename ET::raw*>(teacher.data_ptr());
  const int64_t n = ls.rows, V = ls.vocab;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(2 * V);
    float* z = buf.data();
    float* u = z + V;
    for (int64_t row = begin; row < end; ++row) {
      float values[kNumStats] = {};  // a masked row: zeros, its logits unread
      if (valid[row]) {
        const float m_s = load_row<ES>(student + ls.row_offset(row), V, ls.stride_col, z);
        const float m_t = load_row<ET>(teach + lt.row_offset(row), V, lt.stride_col, u);
        if (divergence == kForwardKL) {
          row_statistics<kForwardKL>(z, u, V, m_s, m_t, k, values);
        } else if (divergence == kReverseKL) {
          row_statistics<kReverseKL>(z, u, V, m_s, m_t, k, values);
        } else {
          row_statistics<kJSD>(z, u, V, m_s, m_t, k, values);
        }
      }
      for (int i = 0; i < kNumStats; ++i) stats[i * n + row] = values[i];
    }
  });
}

template <typename S, typename T>
void gradient_rows(const at::Tensor& logits, const at::Tensor& teacher, const at::Tensor& grad, const int divergence,
                   const float* stats, const double* weight, const Scalars& k) {
  using ES = Elem<S>;
  using ET = Elem<T>;
  const Layout ls = layout_of(logits), lt = layout_of(teacher), lo = layout_of(grad);
  const auto* student = reinterpret_cast<const typename ES::raw*>(logits.data_ptr());
  const auto* teach = reinterpret_cast<const typename ET::raw*>(teacher.data_ptr());
  auto* dst = reinterpret_cast<typename ES::raw*>(grad.data_ptr());  // may be the student's logits themselves
  const int64_t n = ls.rows, V = ls.vocab;
  const int center_row = divergence == kJSD ? k_student_kl : k_divergence;
  const bool accumulate = k.accumulate != 0.0;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(2 * V);
    float* z = buf.data();
    float* u = z + V;
    for (int64_t row = begin; row < end; ++row) {
      typename ES::raw* out = dst + lo.row_offset(row);
      const float coef = static_cast<float>(weight[row] * k.grad_scale);
      if (coef == 0.0f) {  // masked: exact zeros, whatever the row holds (NaN included); accumulating, left as it is
        if (accumulate) continue;
        const typename ES::raw zero = ES::store(0.0f);
        for (int64_t j = 0; j < V; ++j) out[j * lo.stride_col] = zero;
        continue;
      }
      load_row<ES>(student + ls.row_offset(row), V, ls.stride_col, z);
      load_row<ET>(teach + lt.row_offset(row), V, lt.stride_col, u);
      const RowConstants r = row_constants(stats[k_student_max * n + row], stats[k_student_log2_sum * n + row],
                                           stats[k_teacher_max * n + row], stats[k_teacher_log2_sum * n + row],
                                           stats[center_row * n + row], k);
      if (divergence == kForwardKL) {
        write_gradient<kForwardKL, ES>(z, u, V, r, coef, out, lo.stride_col, accumulate);
      } else if (divergence == kReverseKL) {
        write_gradient<kReverseKL, ES>(z, u, V, r, coef, out, lo.stride_col, accumulate);
      } else {
        write_gradient<kJSD, ES>(z, u, V, r, coef, out, lo.stride_col, accumulate);
      }
    }
  });
}

}  // namespace

// float32 [kNumStats, N]: each row's statistics (csrc/distill_math.h), zeros at rows where valid (bool [N]) is false.
at::Tensor distill_stats(const at::Tensor& logits, const at::Tensor& teacher, const at::Tensor& valid,
                         int64_t divergence, const std::vector<double>& scalars) {
  TORCH_CHECK(logits.device().is_cpu(), "fused_is cpu distillation kernel: logits must be on the CPU");
  check_distill_pair(logits, teacher, divergence);
  check_distill_rows(logits, valid, at::kBool, 1, "valid");
  const Scalars k = unpack_distill_scalars(scalars);
  const int64_t n = layout_of(logits).rows;
  at::Tensor stats = at::empty({kNumStats, n}, logits.options().dtype(at::kFloat));
  with_types(logits.scalar_type(), teacher.scalar_type(), [&](auto* s, auto* t) {
    using S = std::remove_pointer_t<decltype(s)>;
    using T = std::remove_pointer_t<decltype(t)>;
    stats_rows<S, T>(logits, teacher, static_cast<int>(divergence), valid.data_ptr<bool>(),
                     stats.data_ptr<float>(), k);
  });
  return stats;
}

// grad <- weight_t F_t * grad_scale for every row (grad: the logits' shape and dtype, any strides, possibly the logits
// themselves); stats: distill_stats' output; weight: float64 [N], 0 at masked rows (zeros written there). With the
// scalar accumulate: grad += the term instead (grad never the logits), masked rows untouched.
void distill_gradient(const at::Tensor& logits, const at::Tensor& teacher, const at::Tensor& grad,
                      const at::Tensor& stats, const at::Tensor& weight, int64_t divergence,
                      const std::vector<double>& scalars) {
  TORCH_CHECK(logits.device().is_cpu(), "fused_is cpu distillation kernel: logits must be on the CPU");
  check_distill_pair(logits, teacher, divergence);
  TORCH_CHECK(grad.sizes() == logits.sizes() && grad.scalar_type() == logits.scalar_type() &&
                  grad.device() == logits.device(),
              "fused_is cpu distillation kernel: grad must match logits in shape, dtype and device");
  check_distill_rows(logits, stats, at::kFloat, kNumStats, "stats");
  check_distill_rows(logits, weight, at::kDouble, 1, "weight");
  const Scalars k = unpack_distill_scalars(scalars);
  with_types(logits.scalar_type(), teacher.scalar_type(), [&](auto* s, auto* t) {
    using S = std::remove_pointer_t<decltype(s)>;
    using T = std::remove_pointer_t<decltype(t)>;
    gradient_rows<S, T>(logits, teacher, grad, static_cast<int>(divergence), stats.data_ptr<float>(),
                        weight.data_ptr<double>(), k);
  });
}

}  // namespace distill
}  // namespace fused_is

// backend="cpu": the fused policy-loss kernel of DESIGN.md section 4 in C++ (csrc/fused_is_math.h for the math).
//
// Rows are split across threads with at::parallel_for (torch's OpenMP pool, so torch.set_num_threads
// applies). Per row: one read of the logits into a thread-local fp32 buffer with the max taken on the way,
// one sweep turning it into d = (z - max) / tau with sum exp(d) and sum exp(d) d, then the gradient sweep
// over the buffer, which is still in L2 (151936 floats = 600 KiB), writing d loss / d z in the logits' dtype.
// A row without an entropy term (h = 0, the default) keeps exp(d) in the buffer instead of d, so that its
// gradient sweep is one multiply per element: one exp per element in all.
// Every inner loop is a plain counted loop over contiguous floats with `omp simd`, in a function of its own
// with restrict pointers, so GCC vectorises it (-fopt-info-vec shows each one), including the exp of
// vector_math.h, which is written without calls for that.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "../fused_is_math.h"
#include "../rows.h"
#include "../params.h"
#include "vector_math.h"

namespace fused_is {
namespace {

// z_j <- d_j = (z_j - m) / tau in place, and (sum exp(d), sum exp(d) d) in double: 1 - p_y below needs the sum
// to ~1e-16, not 1e-7. A function of its own for the same reason as write_row. d is floored at -1e30 so that a
// -inf logit adds 0 * -1e30 = 0 to t (not 0 * -inf = NaN); a NaN passes the floor and makes s NaN.
// kStoreExp: z_j <- e_j = exp(d_j) instead, for a row without an entropy term (h = 0), whose gradient is c0 e_j:
// the gradient sweep (scale_row) then needs no exp of its own, one exp per element in all. The sums are the same.
template <bool kStoreExp>
inline void shift_and_sum(float* __restrict z, const float m, const float inv_tau, const int64_t V, double* s_out,
                          double* t_out) {
  double s = 0.0, t = 0.0;
#pragma omp simd reduction(+ : s, t)
  for (int64_t j = 0; j < V; ++j) {
    float d = (z[j] - m) * inv_tau;
    d = d < -1.0e30f ? -1.0e30f : d;
    const float e = exp_nonpositive(d);
    z[j] = kStoreExp ? e : d;
    s += e;
    t += e * d;
  }
  *s_out = s;
  *t_out = t;
}

// z_j <- d_j = (z_j - m) / tau in place, floored at -1e30, without the sums: the shard of a row whose max and
// sums are given (the vocabulary-parallel gradient sweep, fused_is/distributed.py).
inline void shift_only(float* __restrict z, const float m, const float inv_tau, const int64_t V) {
#pragma omp simd
  for (int64_t j = 0; j < V; ++j) {
    const float d = (z[j] - m) * inv_tau;
    z[j] = d < -1.0e30f ? -1.0e30f : d;
  }
}

// The gradient sweep of one contiguous row from d_j = (z_j - max) / tau, a separate function so that the
// restrict-qualified pointers and by-value scalars let GCC vectorise it (inside the lambda it reloads
// captured references).
template <typename E>
void write_row(const float* __restrict d, const float c0, const float c1, const int64_t V,
               typename E::raw* __restrict out) {
#pragma omp simd
  for (int64_t j = 0; j < V; ++j) out[j] = E::store(exp_nonpositive(d[j]) * (c0 + c1 * d[j]));
}

// The gradient sweep of a row without an entropy term, from e_j (shift_and_sum<true>): c0 e_j, which is what
// write_row gives there (c1 = -0, so c0 + c1 d_j = c0 for every d_j the sweep leaves).
template <typename E>
void scale_row(const float* __restrict e, const float c0, const int64_t V, typename E::raw* __restrict out) {
#pragma omp simd
  for (int64_t j = 0; j < V; ++j) out[j] = E::store(e[j] * c0);
}

// Outputs per row: lp, H, the row's max (raw logit) and log s (s = sum exp(d)), the last two for combining the
// statistics of vocabulary shards. given (float64 [4, N]: max, log s, lp, H of the whole row, or null): the
// row is one shard of a longer row, its statistics and coefficients are given, only the gradient is written,
// and a token outside [0, V) (another shard's) has no column here.
struct RowOutputs {
  double *lp, *entropy, *row_max, *log_s;
  const double* given;
};

template <typename S>
void run_rows(const at::Tensor& logits, const Layout& in_layout, const int64_t* tokens, const RowTable& rows,
              const LossParams& p, at::Tensor* grad, const Layout& out_layout, const RowOutputs& o) {
  using E = Elem<S>;
  using raw = typename E::raw;
  const raw* src = reinterpret_cast<const raw*>(logits.data_ptr());
  raw* dst = grad ? reinterpret_cast<raw*>(grad->data_ptr()) : nullptr;
  const int64_t V = in_layout.vocab;
  // The buffer holds d_j = (z_j - max z) / tau: the difference is taken on the raw logits (exact for bf16 and
  // fp16 logits, one rounding for fp32) and only then scaled, so d carries a relative error of ~1e-7 instead
  // of the absolute ulp(z / tau) that scaling first would leave (which swamps lp when p_y is close to 1).

  at::parallel_for(0, rows.n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(V);
    float* z = buf.data();
    for (int64_t row = begin; row < end; ++row) {
      const raw* x = src + in_layout.row_offset(row);
      const int64_t sc = in_layout.stride_col;
      float m = -3.0e38f;
      if (sc == 1) {
        m = load_and_max<E>(x, V, z);
      } else {
        for (int64_t j = 0; j < V; ++j) {
          z[j] = E::load(x[j * sc]);
          m = z[j] > m ? z[j] : m;
        }
      }
      const int64_t y = tokens[row];
      const RowInputs in = rows.at(row);
      const float inv_tau = static_cast<float>(in.inv_tau);  // 1 / tau of this row (per sequence or token)
      double s, t, d_y;
      RowStats r;
      // no entropy term in this row's gradient (h = 0, see row_coefficients): the buffer keeps e_j, not d_j
      const bool buffer_holds_e = dst && !o.given && (in.h == 0.0 || in.agg == 0.0);
      if (o.given) {  // a shard: the whole row's max, log s, lp and H
        const int64_t n = rows.n;
        m = static_cast<float>(o.given[row]);
        shift_only(z, m, inv_tau, V);
        r.log_s = o.given[n + row];
        r.lp = o.given[2 * n + row];
        r.entropy = o.given[3 * n + row];
        s = exp(r.log_s);
        d_y = r.lp + r.log_s;
      } else {
        if (buffer_holds_e) {
          shift_and_sum<true>(z, m, inv_tau, V, &s, &t);
        } else {
          shift_and_sum<false>(z, m, inv_tau, V, &s, &t);
        }
        // a token outside [0, V) is never read (the front door replaces it; a direct caller gets lp = NaN)
        const double z_y = y >= 0 && y < V ? static_cast<double>(E::load(x[y * sc])) : std::nan("");
        d_y = (z_y - static_cast<double>(m)) * in.inv_tau;
        r = finish_row(s, t, d_y);
      }
      o.lp[row] = r.lp;
      o.entropy[row] = r.entropy;
      o.row_max[row] = m;
      o.log_s[row] = r.log_s;
      if (!dst) continue;

      const RowGradient gr = row_gradient(r, s, d_y, in, p);
      raw* out = dst + out_layout.row_offset(row);
      const int64_t oc = out_layout.stride_col;
      if (!gr.live) {  // masked: exact zeros, whatever the row holds (NaN included)
        const raw zero = E::store(0.0f);
        for (int64_t j = 0; j < V; ++j) out[j * oc] = zero;
        continue;
      }
      const float c0 = static_cast<float>(gr.c0), c1 = static_cast<float>(gr.c1);
      if (buffer_holds_e && oc == 1) {
        scale_row<E>(z, c0, V, out);
      } else if (buffer_holds_e) {
        for (int64_t j = 0; j < V; ++j) out[j * oc] = E::store(z[j] * c0);
      } else if (oc == 1) {
        write_row<E>(z, c0, c1, V, out);
      } else {
        for (int64_t j = 0; j < V; ++j) {
          out[j * oc] = E::store(exp_nonpositive(z[j]) * (c0 + c1 * z[j]));
        }
      }
      if (y >= 0 && y < V) out[y * oc] = E::store(static_cast<float>(gr.grad_y));
    }
  });
}

// (lp, H, row max, log s) float64 [N] each; with grad given, d loss / d logits is written into it (it may alias
// logits); with stats given (float64 [4, N]), the rows are vocabulary shards whose statistics are those (see
// RowOutputs), and g, h come from the row table.
std::vector<at::Tensor> forward(const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& row_table,
                                const std::vector<int64_t>& int_params, const std::vector<double>& float_params,
                                const c10::optional<at::Tensor>& grad, const c10::optional<at::Tensor>& stats) {
  TORCH_CHECK(logits.device().is_cpu(), "fused_is cpu kernel: logits must be on the CPU");
  const Layout in_layout = layout_of(logits);
  check_inputs(logits, tokens, row_table, in_layout.rows);
  const LossParams p = unpack_params(int_params, float_params);
  auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor out = at::empty({4, in_layout.rows}, opts);
  at::Tensor grad_t;
  Layout out_layout = in_layout;
  if (grad.has_value()) {
    grad_t = *grad;
    TORCH_CHECK(grad_t.sizes() == logits.sizes() && grad_t.scalar_type() == logits.scalar_type(),
                "fused_is cpu kernel: grad must match logits in shape and dtype");
    out_layout = layout_of(grad_t);
  }
  RowOutputs o{out[0].data_ptr<double>(), out[1].data_ptr<double>(), out[2].data_ptr<double>(),
               out[3].data_ptr<double>(), nullptr};
  if (stats.has_value()) {
    TORCH_CHECK(stats->scalar_type() == at::kDouble && stats->is_contiguous() && stats->dim() == 2 &&
                    stats->size(0) == 4 && stats->size(1) == in_layout.rows,
                "fused_is cpu kernel: stats must be a contiguous float64 [4, N] tensor");
    TORCH_CHECK(grad.has_value() && p.coef_source == kCoefGiven,
                "fused_is cpu kernel: given stats need a gradient buffer and given coefficients");
    o.given = stats->data_ptr<double>();
  }
  const RowTable rows = row_table_of(row_table);
  const int64_t* tok = tokens.data_ptr<int64_t>();
  at::Tensor* gp = grad.has_value() ? &grad_t : nullptr;
  switch (logits.scalar_type()) {
    case at::kFloat: run_rows<float>(logits, in_layout, tok, rows, p, gp, out_layout, o); break;
    case at::kBFloat16: run_rows<at::BFloat16>(logits, in_layout, tok, rows, p, gp, out_layout, o); break;
    case at::kHalf: run_rows<at::Half>(logits, in_layout, tok, rows, p, gp, out_layout, o); break;
    default: TORCH_CHECK(false, "fused_is cpu kernel: logits must be bf16, fp16 or fp32, got ", logits.scalar_type());
  }
  return {out[0], out[1], out[2], out[3]};
}

}  // namespace

namespace distill {  // csrc/cpu/distill_cpu.cpp, bound below: one CPU extension
at::Tensor distill_stats(const at::Tensor& logits, const at::Tensor& teacher, const at::Tensor& valid,
                         int64_t divergence, const std::vector<double>& scalars);
void distill_gradient(const at::Tensor& logits, const at::Tensor& teacher, const at::Tensor& grad,
                      const at::Tensor& stats, const at::Tensor& weight, int64_t divergence,
                      const std::vector<double>& scalars);
}  // namespace distill
}  // namespace fused_is

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fused_is CPU kernels (csrc/cpu/policy_loss_cpu.cpp, csrc/cpu/distill_cpu.cpp)";
  m.def("forward", &fused_is::forward,
        "lp, H, row max, log s (float64 [N]); writes d loss / d logits into grad when given; stats: see RowOutputs",
        py::arg("logits"), py::arg("tokens"), py::arg("row_table"), py::arg("int_params"),
        py::arg("float_params"), py::arg("grad") = py::none(), py::arg("stats") = py::none());
  m.def("distill_stats", &fused_is::distill::distill_stats,
        "distill_loss's statistics, float32 [6, N] (csrc/distill_math.h); zeros at rows where valid is false",
        py::arg("logits"), py::arg("teacher"), py::arg("valid"), py::arg("divergence"), py::arg("scalars"));
  m.def("distill_gradient", &fused_is::distill::distill_gradient,
        "writes distill_loss's d loss / d logits into grad (which may be the logits) from distill_stats' output",
        py::arg("logits"), py::arg("teacher"), py::arg("grad"), py::arg("stats"), py::arg("weight"),
        py::arg("divergence"), py::arg("scalars"));
  m.def("abi", &fused_is::abi_report, "the kernel contract compiled in (csrc/fused_is_math.h), checked at load");
}

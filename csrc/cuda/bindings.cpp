// Python binding of the CUDA kernels (csrc/cuda/policy_loss_cuda.cu, csrc/cuda/distill_cuda.cu). Host C++ only. The launch runs on the
// logits' device (a device guard: logits on cuda:1 while cuda:0 is current) and on torch's current stream of
// that device, so it orders correctly with the caller's work under `with torch.cuda.stream(s)`.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <vector>

#include "../distill_math.h"
#include "../fused_is_math.h"
#include "../params.h"
#include "../rows.h"

namespace fused_is {

void launch_forward(const void* logits, int dtype, const Layout& in, void* grad, const Layout& out,
                    const int64_t* tokens, const RowTable& table, const LossParams& p, double* lp, double* ent,
                    double* row_max, double* log_s, const double* given, int64_t stream_handle);

void launch_counts(int64_t* given, int64_t* persistent, int64_t* cluster);

namespace distill {
void launch_distill_stats(const void* logits, int student_dtype, const Layout& ls, const void* teacher,
                          int teacher_dtype, const Layout& lt, const bool* valid, float* stats, int divergence,
                          const Scalars& k, int64_t stream_handle);
void launch_distill_gradient(const void* logits, int student_dtype, const Layout& ls, const void* teacher,
                             int teacher_dtype, const Layout& lt, void* grad, const Layout& lo, const float* stats,
                             const double* weight, int divergence, const Scalars& k, int64_t stream_handle);
}  // namespace distill

namespace {

// The dtype codes of distill_cuda.cu's launches: 0 fp32, 1 bf16, 2 fp16, 3 fp64 (teacher only; check_distill_pair).
int dtype_code(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: return 3;
  }
}

// float32 [kNumStats, N]: distill_loss's statistics of each row (csrc/distill_math.h), zeros where valid is false.
at::Tensor distill_stats(const at::Tensor& logits, const at::Tensor& teacher, const at::Tensor& valid,
                         int64_t divergence, const std::vector<double>& scalars) {
  TORCH_CHECK(logits.is_cuda(), "fused_is cuda distillation kernel: logits must be CUDA tensors");
  const c10::cuda::CUDAGuard device_guard(logits.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(logits.device().index()).stream();
  check_distill_pair(logits, teacher, divergence);
  check_distill_rows(logits, valid, at::kBool, 1, "valid");
  const distill::Scalars k = unpack_distill_scalars(scalars);
  const Layout ls = layout_of(logits);
  at::Tensor stats = at::empty({distill::kNumStats, ls.rows}, logits.options().dtype(at::kFloat));
  distill::launch_distill_stats(logits.data_ptr(), dtype_code(logits), ls, teacher.data_ptr(), dtype_code(teacher),
                                layout_of(teacher), valid.data_ptr<bool>(), stats.data_ptr<float>(),
                                static_cast<int>(divergence), k, reinterpret_cast<int64_t>(stream));
  return stats;
}

// grad <- weight_t F_t grad_scale for every row (grad may be the logits); stats: distill_stats' output.
void distill_gradient(const at::Tensor& logits, const at::Tensor& teacher, const at::Tensor& grad,
                      const at::Tensor& stats, const at::Tensor& weight, int64_t divergence,
                      const std::vector<double>& scalars) {
  TORCH_CHECK(logits.is_cuda(), "fused_is cuda distillation kernel: logits must be CUDA tensors");
  const c10::cuda::CUDAGuard device_guard(logits.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(logits.device().index()).stream();
  check_distill_pair(logits, teacher, divergence);
  TORCH_CHECK(grad.sizes() == logits.sizes() && grad.scalar_type() == logits.scalar_type() &&
                  grad.device() == logits.device(),
              "fused_is cuda distillation kernel: grad must match logits in shape, dtype and device");
  check_distill_rows(logits, stats, at::kFloat, distill::kNumStats, "stats");
  check_distill_rows(logits, weight, at::kDouble, 1, "weight");
  const distill::Scalars k = unpack_distill_scalars(scalars);
  distill::launch_distill_gradient(logits.data_ptr(), dtype_code(logits), layout_of(logits), teacher.data_ptr(),
                                   dtype_code(teacher), layout_of(teacher), grad.data_ptr(), layout_of(grad),
                                   stats.data_ptr<float>(), weight.data_ptr<double>(), static_cast<int>(divergence), k,
                                   reinterpret_cast<int64_t>(stream));
}

py::dict launch_counts_dict() {
  int64_t given = 0, persistent = 0, cluster = 0;
  launch_counts(&given, &persistent, &cluster);
  py::dict out;
  out["given"] = given;
  out["persistent"] = persistent;
  out["cluster"] = cluster;
  return out;
}

std::vector<at::Tensor> forward(const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& row_table,
                                const std::vector<int64_t>& int_params, const std::vector<double>& float_params,
                                const c10::optional<at::Tensor>& grad, const c10::optional<at::Tensor>& stats) {
  TORCH_CHECK(logits.is_cuda(), "fused_is cuda kernel: logits must be CUDA tensors");
  const c10::cuda::CUDAGuard device_guard(logits.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(logits.device().index()).stream();
  const Layout in = layout_of(logits);
  check_inputs(logits, tokens, row_table, in.rows);
  const LossParams p = unpack_params(int_params, float_params);
  int dtype;
  switch (logits.scalar_type()) {
    case at::kFloat: dtype = 0; break;
    case at::kBFloat16: dtype = 1; break;
    case at::kHalf: dtype = 2; break;
    default: TORCH_CHECK(false, "fused_is cuda kernel: logits must be bf16, fp16 or fp32, got ", logits.scalar_type());
  }
  auto opts = logits.options().dtype(at::kDouble);
  at::Tensor lp = at::empty({in.rows}, opts);
  at::Tensor ent = at::empty({in.rows}, opts);
  at::Tensor row_max = at::empty({in.rows}, opts);
  at::Tensor log_s = at::empty({in.rows}, opts);
  const double* given = nullptr;
  if (stats.has_value()) {
    TORCH_CHECK(stats->scalar_type() == at::kDouble && stats->is_contiguous() && stats->dim() == 2 &&
                    stats->size(0) == 4 && stats->size(1) == in.rows && stats->device() == logits.device(),
                "fused_is cuda kernel: stats must be a contiguous float64 [4, N] tensor on the logits' device");
    TORCH_CHECK(grad.has_value() && p.coef_source == kCoefGiven,
                "fused_is cuda kernel: given stats need a gradient buffer and given coefficients");
    given = stats->data_ptr<double>();
  }
  void* grad_ptr = nullptr;
  Layout out = in;
  if (grad.has_value()) {
    TORCH_CHECK(grad->sizes() == logits.sizes() && grad->scalar_type() == logits.scalar_type() &&
                    grad->device() == logits.device(),
                "fused_is cuda kernel: grad must match logits in shape, dtype and device");
    out = layout_of(*grad);
    grad_ptr = grad->data_ptr();
  }
  launch_forward(logits.data_ptr(), dtype, in, grad_ptr, out, tokens.data_ptr<int64_t>(), row_table_of(row_table),
                 p, lp.data_ptr<double>(), ent.data_ptr<double>(), row_max.data_ptr<double>(),
                 log_s.data_ptr<double>(), given, reinterpret_cast<int64_t>(stream));
  return {lp, ent, row_max, log_s};
}

}  // namespace
}  // namespace fused_is

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fused_is CUDA kernels (csrc/cuda/policy_loss_cuda.cu, csrc/cuda/distill_cuda.cu)";
  m.def("forward", &fused_is::forward,
        "lp, H, row max, log s (float64 [N]); writes d loss / d logits into grad when given; stats: the rows' given "
        "statistics (float64 [4, N]), for the gradient sweep alone",
        py::arg("logits"), py::arg("tokens"), py::arg("row_table"), py::arg("int_params"),
        py::arg("float_params"), py::arg("grad") = py::none(), py::arg("stats") = py::none());
  m.def("launch_counts", &fused_is::launch_counts_dict,
        "kernel launches since load: given (the gradient sweep alone), persistent (the fused kernel), cluster "
        "(the Hopper cluster kernel, FUSED_IS_CUDA_CLUSTER=1)");
  m.def("distill_stats", &fused_is::distill_stats,
        "distill_loss's statistics, float32 [6, N] (csrc/distill_math.h); zeros at rows where valid is false",
        py::arg("logits"), py::arg("teacher"), py::arg("valid"), py::arg("divergence"), py::arg("scalars"));
  m.def("distill_gradient", &fused_is::distill_gradient,
        "writes distill_loss's d loss / d logits into grad (which may be the logits) from distill_stats' output",
        py::arg("logits"), py::arg("teacher"), py::arg("grad"), py::arg("stats"), py::arg("weight"),
        py::arg("divergence"), py::arg("scalars"));
  m.def("abi", &fused_is::abi_report, "the kernel contract compiled in (csrc/fused_is_math.h), checked at load");
}

// Python binding of the CUDA kernel (csrc/cuda/policy_loss_cuda.cu). Host C++ only. The launch runs on the
// logits' device (a device guard: logits on cuda:1 while cuda:0 is current) and on torch's current stream of
// that device, so it orders correctly with the caller's work under `with torch.cuda.stream(s)`.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <vector>

#include "../fused_is_math.h"
#include "../params.h"
#include "../rows.h"

namespace fused_is {

void launch_forward(const void* logits, int dtype, const Layout& in, void* grad, const Layout& out,
                    const int64_t* tokens, const RowTable& table, const LossParams& p, double* lp, double* ent,
                    double* row_max, double* log_s, const double* given, int64_t stream_handle);

void launch_counts(int64_t* given, int64_t* persistent, int64_t* cluster);

namespace {

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
  m.doc() = "fused_is CUDA kernel (csrc/cuda/policy_loss_cuda.cu)";
  m.def("forward", &fused_is::forward,
        "lp, H, row max, log s (float64 [N]); writes d loss / d logits into grad when given; stats: the rows' given "
        "statistics (float64 [4, N]), for the gradient sweep alone",
        py::arg("logits"), py::arg("tokens"), py::arg("row_table"), py::arg("int_params"),
        py::arg("float_params"), py::arg("grad") = py::none(), py::arg("stats") = py::none());
  m.def("launch_counts", &fused_is::launch_counts_dict,
        "kernel launches since load: given (the gradient sweep alone), persistent (the fused kernel), cluster "
        "(the Hopper cluster kernel, FUSED_IS_CUDA_CLUSTER=1)");
  m.def("abi", &fused_is::abi_report, "the kernel contract compiled in (csrc/fused_is_math.h), checked at load");
}

// Host-side glue shared by the CPU and CUDA bindings: tensor layout, argument checks, parameter unpacking
// (in the order of csrc/fused_is_math.h, which fused_is/backends/abi.py packs) and the abi() report of the contract.
#pragma once

#include <torch/extension.h>

#include <vector>

#include "distill_math.h"
#include "fused_is_math.h"
#include "rows.h"

namespace fused_is {

#define FIS_COUNT(name) +1
constexpr int kNumIntParams = 0 FIS_INT_PARAMS(FIS_COUNT);
constexpr int kNumFloatParams = 0 FIS_FLOAT_PARAMS(FIS_COUNT);
constexpr int kNumRowInputs = 0 FIS_ROW_INPUTS(FIS_COUNT);
constexpr int kNumDistillScalars = 0 FIS_DISTILL_SCALARS(FIS_COUNT);
#undef FIS_COUNT

inline Layout layout_of(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "fused_is: logits must be [N, V] or [B, T, V]");
  Layout l;
  l.vocab = x.size(-1);
  if (x.dim() == 2) {
    l.rows = x.size(0);
    l.rows_per_seq = l.rows > 0 ? l.rows : 1;
    l.stride_seq = 0;
    l.stride_row = x.stride(0);
    l.stride_col = x.stride(1);
  } else {
    l.rows = x.size(0) * x.size(1);
    l.rows_per_seq = x.size(1) > 0 ? x.size(1) : 1;
    l.stride_seq = x.stride(0);
    l.stride_row = x.stride(1);
    l.stride_col = x.stride(2);
  }
  return l;
}

inline void check_inputs(const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& table, int64_t rows) {
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.is_contiguous() && tokens.numel() == rows,
              "fused_is: tokens must be contiguous int64 [N]");
  TORCH_CHECK(table.scalar_type() == at::kDouble && table.is_contiguous() && table.dim() == 2 &&
                  table.size(0) == kNumRowInputs && table.size(1) == rows,
              "fused_is: row_table must be contiguous float64 [", kNumRowInputs, ", N] (csrc/fused_is_math.h)");
  TORCH_CHECK(tokens.device() == logits.device() && table.device() == logits.device(),
              "fused_is: tokens and row_table must be on the logits' device");
}

inline LossParams unpack_params(const std::vector<int64_t>& ip, const std::vector<double>& fp) {
  TORCH_CHECK(ip.size() == kNumIntParams && fp.size() == kNumFloatParams, "fused_is: expected ", kNumIntParams,
              " int and ", kNumFloatParams, " float parameters (csrc/fused_is_math.h)");
  LossParams p;
  size_t i = 0, f = 0;
#define FIS_UNPACK_INT(name) p.name = static_cast<int32_t>(ip[i++]);
  FIS_INT_PARAMS(FIS_UNPACK_INT)
#undef FIS_UNPACK_INT
#define FIS_UNPACK_FLOAT(name) p.name = fp[f++];
  FIS_FLOAT_PARAMS(FIS_UNPACK_FLOAT)
#undef FIS_UNPACK_FLOAT
  return p;
}

// The contract this extension was compiled with, for fused_is/backends/abi.py check_extension.
inline py::dict abi_report() {
  py::list ints, floats, rows;
#define FIS_APPEND_INT(name) ints.append(#name);
  FIS_INT_PARAMS(FIS_APPEND_INT)
#undef FIS_APPEND_INT
#define FIS_APPEND_FLOAT(name) floats.append(#name);
  FIS_FLOAT_PARAMS(FIS_APPEND_FLOAT)
#undef FIS_APPEND_FLOAT
#define FIS_APPEND_ROW(name) rows.append(#name);
  FIS_ROW_INPUTS(FIS_APPEND_ROW)
#undef FIS_APPEND_ROW
  py::dict enums;
#define FIS_APPEND_ENUM(kind, name, value)                                  \
  if (!enums.contains(#kind)) enums[#kind] = py::dict();                    \
  enums[#kind].cast<py::dict>()[#name] = static_cast<int>(value);
  FIS_ENUM_VALUES(FIS_APPEND_ENUM)
#define FIS_APPEND_POLICY(name, value) FIS_APPEND_ENUM(policy, name, value)
  FIS_POLICIES(FIS_APPEND_POLICY)
#undef FIS_APPEND_POLICY
#undef FIS_APPEND_ENUM
  py::list distill_stats, distill_scalars;
  py::dict distill_divergences;
#define FIS_APPEND_NAME(list, name) list.append(#name);
#define FIS_APPEND_STAT(name) FIS_APPEND_NAME(distill_stats, name)
#define FIS_APPEND_SCALAR(name) FIS_APPEND_NAME(distill_scalars, name)
  FIS_DISTILL_STATS(FIS_APPEND_STAT)
  FIS_DISTILL_SCALARS(FIS_APPEND_SCALAR)
#undef FIS_APPEND_SCALAR
#undef FIS_APPEND_STAT
#undef FIS_APPEND_NAME
#define FIS_APPEND_DIVERGENCE(name, value) distill_divergences[#name] = static_cast<int>(distill::value);
  FIS_DISTILL_DIVERGENCES(FIS_APPEND_DIVERGENCE)
#undef FIS_APPEND_DIVERGENCE
  py::dict out;
  out["int_params"] = ints;
  out["float_params"] = floats;
  out["row_inputs"] = rows;
  out["enums"] = enums;
  out["distill_stats"] = distill_stats;
  out["distill_scalars"] = distill_scalars;
  out["distill_divergences"] = distill_divergences;
  return out;
}

inline RowTable row_table_of(const at::Tensor& table) {
  RowTable t;
  t.data = table.data_ptr<double>();
  t.n = table.size(1);
  return t;
}

// ---- distill_loss's kernels (csrc/distill_math.h): the checks of both bindings' distill_stats and distill_gradient.

inline distill::Scalars unpack_distill_scalars(const std::vector<double>& values) {
  TORCH_CHECK(values.size() == kNumDistillScalars, "fused_is: expected ", kNumDistillScalars,
              " distillation scalars (csrc/distill_math.h)");
  distill::Scalars k;
  size_t i = 0;
#define FIS_UNPACK_SCALAR(name) k.name = values[i++];
  FIS_DISTILL_SCALARS(FIS_UNPACK_SCALAR)
#undef FIS_UNPACK_SCALAR
  return k;
}

// The student's and the teacher's logits (one shape and device, each its own strides; the dtypes the kernels are
// built for: bf16/fp16/fp32 students, bf16/fp16/fp32/fp64 teachers) and a divergence code.
inline void check_distill_pair(const at::Tensor& logits, const at::Tensor& teacher, int64_t divergence) {
  TORCH_CHECK(teacher.sizes() == logits.sizes() && teacher.device() == logits.device(),
              "fused_is: teacher_logits must have the logits' shape and device");
  const auto s = logits.scalar_type(), t = teacher.scalar_type();
  TORCH_CHECK(s == at::kFloat || s == at::kBFloat16 || s == at::kHalf,
              "fused_is distillation kernel: logits must be bf16, fp16 or fp32, got ", s);
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf || t == at::kDouble,
              "fused_is distillation kernel: teacher_logits must be bf16, fp16, fp32 or fp64, got ", t);
  TORCH_CHECK(divergence == distill::kForwardKL || divergence == distill::kReverseKL || divergence == distill::kJSD,
              "fused_is distillation kernel: unknown divergence code ", divergence);
}

// The statistics' valid rows (bool [N]), or the gradient's statistics (float32 [kNumStats, N]) and row weights
// (float64 [N]), contiguous on the logits' device.
inline void check_distill_rows(const at::Tensor& logits, const at::Tensor& rows, at::ScalarType dtype, int64_t count,
                               const char* what) {
  const int64_t n = layout_of(logits).rows;
  TORCH_CHECK(rows.scalar_type() == dtype && rows.is_contiguous() && rows.numel() == count * n &&
                  rows.device() == logits.device(),
              "fused_is distillation kernel: ", what, " must be contiguous ", dtype, " with ", count, " x N values on the "
              "logits' device");
}

}  // namespace fused_is

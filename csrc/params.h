// Host-side glue shared by the CPU and CUDA bindings: tensor layout, argument checks, parameter unpacking.
// The order of int_params / float_params is fixed by fused_is/backends/cpp.py (_pack_params).
#pragma once

#include <torch/extension.h>

#include <vector>

#include "fused_is_math.h"
#include "rows.h"

namespace fused_is {

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
                  table.size(0) == 6 && table.size(1) == rows,
              "fused_is: row_table must be contiguous float64 [6, N]");
  TORCH_CHECK(tokens.device() == logits.device() && table.device() == logits.device(),
              "fused_is: tokens and row_table must be on the logits' device");
}

inline LossParams unpack_params(const std::vector<int64_t>& ip, const std::vector<double>& fp) {
  TORCH_CHECK(ip.size() == 7 && fp.size() == 8, "fused_is: expected 7 int and 8 float parameters");
  LossParams p;
  p.policy = static_cast<int32_t>(ip[0]);
  p.base_source = static_cast<int32_t>(ip[1]);
  p.weight_source = static_cast<int32_t>(ip[2]);
  p.is_mode = static_cast<int32_t>(ip[3]);
  p.kl_type = static_cast<int32_t>(ip[4]);
  p.has_dual_clip = static_cast<int32_t>(ip[5]);
  p.has_floor = static_cast<int32_t>(ip[6]);
  p.clip_low = fp[0];
  p.clip_high = fp[1];
  p.dual_clip = fp[2];
  p.is_cap = fp[3];
  p.is_floor = fp[4];
  p.kl_coef = fp[5];
  p.entropy_coef = fp[6];
  p.inv_tau = fp[7];
  return p;
}

inline RowTable row_table_of(const at::Tensor& table) {
  RowTable t;
  t.data = table.data_ptr<double>();
  t.n = table.size(1);
  return t;
}

}  // namespace fused_is
